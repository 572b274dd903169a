"""Error bound of the integer tensor-core GEMV (native/src/gpu/matmul_mma.cuh), shared by its GPU test
and its host emulation test.

The GEMV splits each 256-input group of a row of x into three int8 terms of a power-of-two scale, so
an element is represented to within 2^-20 of its GROUP's maximum |x| (at least 2^-100: the scale
exponent is clamped, and a super-block scale d times 2^-k may be subnormal, for groups below ~1e-30);
the products and sums after that are exact integers or F32 with a few roundings. Hence, elementwise
against the exact product:

    |y - x @ w^T| <= 1e-5 * (|x| @ |w|^T) + 2^-20 * sum_g max(max|x_g|, 2^-100) * sum_{k in g} |w_k|

The first term covers the F32 accumulation (far below it in practice, ~1e-7); the second is the x
split, which matters only when a group's elements span a wide range (e.g. x spanning 2^24 within a
row) and the small elements carry the product, or for groups of tiny values.
"""
import numpy as np

GROUP = 256
SPLIT_REL = 2.0 ** -20
FLOOR = 2.0 ** -100


def group_bound(x, w_abs):
    """sum over 256-input groups g of max(max|x_g|, 2^-100) * |w_g|, [n, out] float64 (x: [n, in];
    w_abs: |w| [out, in])."""
    x = np.abs(np.asarray(x, np.float64))
    n, k = x.shape
    res = np.zeros((n, w_abs.shape[0]))
    for g0 in range(0, k, GROUP):
        m = np.maximum(x[:, g0 : g0 + GROUP].max(axis=1, keepdims=True), FLOOR)
        res += m * w_abs[:, g0 : g0 + GROUP].sum(axis=1)[None, :]
    return res


def mma_tolerance(x, w_abs, tol=1e-5):
    """The elementwise error allowance above, [n, out] float64."""
    return tol * (np.abs(np.asarray(x, np.float64)) @ w_abs.T) + SPLIT_REL * group_bound(x, w_abs)
