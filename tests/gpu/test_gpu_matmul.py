"""GPU matmul (sn.matmul on GPU tensors) for every weight format, against the CPU backend.

Skipped (marked ``gpu``) unless ``specd.native.gpu_available()``.

Weights: random valid blocks (tests/native/quant_blocks.py: random bytes with realistic fp16 scale
fields) for Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; random normals for F32 / F16 / BF16. The reference is
the CPU backend's sn.matmul on the same weights (its decoders are bit-exact with gguf; its own
float32 error is far inside the bounds below), and bound = |x| @ |dequantize(w)|^T (float64).

Tolerances, elementwise:
* GEMV path (n <= 16 rows of x, and n > 16 with exact=True in 16-row slices): |y_gpu - y_cpu| <=
  1e-5 * bound. F32 / F16 (and BF16 rows off the tensor cores): both accumulate in float32 in
  different orders; the GPU decodes the weights to exactly the CPU's float32 values. BF16 with
  in % 64 == 0 (CUDA): x split into three BF16 terms whose sum is x, exact products on the bf16
  tensor cores, F32 accumulation. Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS (CUDA: the
  integer tensor-core GEMV, matmul_mma.cuh): int8 quants times x split, per 256-input group, into a
  power of two times three int8 terms (|x - s (2^14 hi + 2^7 mid + lo)| <= 2^-20 max|x over the
  group|), exact integer sums with the integer sub-block scales, F32 once per super-block: ~1e-7 of
  the bound for inputs whose group-wise dynamic range is not extreme (H200 and host emulation, also
  with x spanning 2^-72 .. 2^72), inside 1e-5.
* cuBLAS path (n > 16): x and the dequantized weights are rounded to BF16 (8 significant bits),
  products and sums in float32: each product is off by at most 2^-9 + 2^-9 + 2^-18 relative, so
  |y_gpu - y_cpu| <= (2^-8 + 2e-5) * bound.
* Batch invariance (n <= 16): row i of y is bit-identical whatever the number of rows in the call.
"""
import os
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_blocks import random_blocks  # noqa: E402
from mma_bounds import mma_tolerance  # noqa: E402

GPU = sn.Device.GPU
HAVE_GPU = sn.gpu_available()
FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
GEMV_TOL = 1e-5
BLAS_TOL = 2.0**-8 + 2e-5


def gpu_only(f):
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)


def weight(rng, name, out, k):
    """CPU Tensor [out, k] of format `name` (raw bytes / bits wrapped with the dtype)."""
    if name == "F32":
        return sn.Tensor(np.ascontiguousarray((rng.standard_normal((out, k)) * 0.05).astype(np.float32)))
    if name == "F16":
        return sn.Tensor(np.ascontiguousarray((rng.standard_normal((out, k)) * 0.05).astype(np.float16)))
    if name == "BF16":
        bits = ((rng.standard_normal((out, k)) * 0.05).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return sn.Tensor(np.ascontiguousarray(bits), sn.DType.BF16)
    return sn.Tensor(np.ascontiguousarray(random_blocks(rng, name, out, k)), getattr(sn.DType, name))


def abs_bound(x, w_cpu, rows_per_chunk=8192):
    """|x| @ |dequantize(w)|^T in float64, dequantizing w in row chunks (bounded memory)."""
    ax = np.abs(x.astype(np.float64))
    out = w_cpu.shape[0]
    res = np.empty((x.shape[0], out))
    raw = w_cpu.numpy()
    for r0 in range(0, out, rows_per_chunk):
        part = raw[r0 : r0 + rows_per_chunk]
        wt = sn.Tensor(np.ascontiguousarray(part), w_cpu.dtype) if w_cpu.dtype not in (sn.DType.F32, sn.DType.F16) \
            else sn.Tensor(np.ascontiguousarray(part))
        res[:, r0 : r0 + rows_per_chunk] = ax @ np.abs(sn.dequantize(wt).numpy().astype(np.float64)).T
    return res


def check_close(y, ref, bound, tol, what):
    assert np.all(np.isfinite(y)), f"{what}: non-finite output"
    err = np.abs(y.astype(np.float64) - ref.astype(np.float64))
    bad = err > tol * bound + 1e-30
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements over {tol:.3g} * sum|x||w|; "
                           f"max ratio {(err / (bound + 1e-30)).max():.3g}")


# (in, out) per format; in a multiple of 256 for the K-quants. K = 5120 / 17408 are the 27B's.
SHAPES = [(256, 7), (512, 130), (5120, 96), (17408, 40)]
FLOAT_ODD_SHAPES = [(100, 33), (7, 5)]  # 16-bit / F32 rows that are not 16-byte multiples


def run_widths(rng, name, k, out, widths):
    w = weight(rng, name, out, k)
    wg = w.to(GPU)
    assert wg.shape == (out, k)
    x = rng.standard_normal((max(widths), k)).astype(np.float32)
    ref = sn.matmul(x, w).numpy()  # CPU: batch invariant, so ref[:n] is the reference for every n
    bound = abs_bound(x, w)
    for n in widths:
        y = sn.matmul(sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU), wg)
        assert y.device == GPU and y.shape == (n, out)
        check_close(y.numpy(), ref[:n], bound[:n], GEMV_TOL, f"{name} n={n} in={k} out={out}")  # exact: any n


@pytest.mark.parametrize("k,out", SHAPES)
@pytest.mark.parametrize("name", FORMATS)
@gpu_only
def test_matmul_gpu_formats_widths(rng, name, k, out):
    run_widths(rng, name, k, out, list(range(1, 18)))


@pytest.mark.parametrize("k,out", FLOAT_ODD_SHAPES)
@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
@gpu_only
def test_matmul_gpu_float_unaligned_rows(rng, name, k, out):
    run_widths(rng, name, k, out, [1, 2, 5, 16, 17])


@pytest.mark.parametrize("k,out", [(96, 33), (288, 40), (5152, 70)])
@gpu_only
def test_matmul_gpu_q8_0_ragged_x_group(rng, k, out):
    """Q8_0 rows whose length is not a multiple of 256: the tensor-core GEMV's last x group is ragged."""
    run_widths(rng, "Q8_0", k, out, [1, 2, 3, 8, 9, 16, 17])


@gpu_only
def test_matmul_gpu_q8_0_output_head(rng):
    """The vocabulary-sized output head (248320 rows), Q8_0, at decode and verify widths."""
    run_widths(rng, "Q8_0", 2048, 248320, [1, 3, 16])


@pytest.mark.parametrize("name", FORMATS)
@gpu_only
def test_matmul_gpu_batch_invariant(rng, name):
    k, out = (5120, 300)
    wg = weight(rng, name, out, k).to(GPU)
    x = rng.standard_normal((16, k)).astype(np.float32)
    full = sn.matmul(sn.Tensor(x).to(GPU), wg).numpy()
    for n in range(1, 17):
        np.testing.assert_array_equal(sn.matmul(sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU), wg).numpy(),
                                      full[:n], err_msg=f"{name}: width {n} differs from width 16")
    for lo, hi in [(3, 4), (5, 8), (2, 7), (9, 16), (15, 16)]:
        np.testing.assert_array_equal(sn.matmul(sn.Tensor(np.ascontiguousarray(x[lo:hi])).to(GPU), wg).numpy(),
                                      full[lo:hi], err_msg=f"{name}: rows {lo}:{hi}")


@pytest.mark.parametrize("name", FORMATS)
@gpu_only
def test_matmul_gpu_exact_wide_rows_equal_single_rows(rng, name):
    """exact (the default) keeps rows > 16 on the GEMV in 16-row slices: every row of a 17..40-row
    call is bit-identical to the same row computed alone (verify of any width equals decode)."""
    k, out = (512, 130)
    wg = weight(rng, name, out, k).to(GPU)
    x = rng.standard_normal((40, k)).astype(np.float32)
    single = np.concatenate([sn.matmul(sn.Tensor(np.ascontiguousarray(x[i:i + 1])).to(GPU), wg).numpy()
                             for i in range(40)])
    for n in (17, 31, 33, 40):
        np.testing.assert_array_equal(sn.matmul(sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU), wg).numpy(),
                                      single[:n], err_msg=f"{name}: {n} rows")


@pytest.mark.parametrize("n", [17, 64, 300])
@pytest.mark.parametrize("name", FORMATS)
@gpu_only
def test_matmul_gpu_blas_path(rng, name, n):
    k, out = (1024, 520)
    w = weight(rng, name, out, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y = sn.matmul(sn.Tensor(x).to(GPU), w.to(GPU), exact=False).numpy()
    check_close(y, sn.matmul(x, w).numpy(), abs_bound(x, w), BLAS_TOL, f"{name} cuBLAS n={n}")


@gpu_only
def test_matmul_gpu_blas_panels(rng):
    """A weight larger than one 256 MiB BF16 panel (several dequantize + GEMM rounds)."""
    k, out, n = 4096, 40000, 33
    w = weight(rng, "Q4_K", out, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y = sn.matmul(sn.Tensor(x).to(GPU), w.to(GPU), exact=False).numpy()
    check_close(y, sn.matmul(x, w).numpy(), abs_bound(x, w), BLAS_TOL, "Q4_K cuBLAS, 2 panels")


MMA_FORMATS = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]  # the tensor-core GEMV (matmul_mma.cuh)


def check_mma_widths(rng, name, k, out, widths):
    """Every width against the CPU backend (GEMV_TOL) and bitwise: width n <= 16 gives rows equal
    to the first n rows of the widest call <= 16; a width > 16 gives rows equal to 1-row calls."""
    w = weight(rng, name, out, k)
    wg = w.to(GPU)
    x = rng.standard_normal((max(widths), k)).astype(np.float32)
    ref = sn.matmul(x, w).numpy()
    bound = abs_bound(x, w)
    res = {}
    for n in widths:
        y = sn.matmul(sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU), wg).numpy()
        check_close(y, ref[:n], bound[:n], GEMV_TOL, f"{name} n={n} in={k} out={out}")
        res[n] = y
    top = max(n for n in widths if n <= 16)
    for n in widths:
        if n <= 16:
            np.testing.assert_array_equal(res[n], res[top][:n], err_msg=f"{name} in={k} out={out}: width {n} vs {top}")
    if any(n > 16 for n in widths):
        single = np.concatenate([sn.matmul(sn.Tensor(np.ascontiguousarray(x[i:i + 1])).to(GPU), wg).numpy()
                                 for i in range(max(widths))])
        for n in widths:
            np.testing.assert_array_equal(res[n], single[:n], err_msg=f"{name} in={k} out={out}: {n} rows vs 1-row calls")


@pytest.mark.parametrize("k,out", [(512, 77), (1024, 77), (2048, 300)])
@pytest.mark.parametrize("name", MMA_FORMATS)
@gpu_only
def test_matmul_gpu_mma_formats_widths(rng, name, k, out):
    """The tensor-core GEMV at every width 1..16 (one and two n8 tiles) plus 17 and 33 (16-row
    slices), ragged out (not a multiple of the 128-row block), several sub-blocks per row."""
    check_mma_widths(rng, name, k, out, list(range(1, 18)) + [33])


@pytest.mark.parametrize("name", ["IQ4_XS", "Q6_K", "Q4_K"])
@gpu_only
def test_matmul_gpu_mma_27b_shape(rng, name):
    """A 27B FFN down projection shape (out 5120, in 17408): split-K over many blocks."""
    check_mma_widths(rng, name, 17408, 5120, [1, 2, 8, 9, 16])


@pytest.mark.parametrize("name", MMA_FORMATS)
@gpu_only
def test_matmul_gpu_mma_wide_range_and_nonfinite_x(rng, name):
    """x spanning ~2^-72 .. 2^72 (rows scaled by 2^-60 .. 2^60, elements by 2^-12 .. 2^12): the x
    split scales each 256-input group by a power of two, so the GEMV's contract (mma_bounds.py:
    GEMV_TOL of |x| @ |w|^T plus 2^-20 of the group maxima term) holds at every magnitude. inf / NaN
    in a row of x make that row's results non-finite, as on the CPU, and leave the other rows alone."""
    k, out = 1024, 77
    w = weight(rng, name, out, k)
    wg = w.to(GPU)
    x = rng.standard_normal((16, k)) * np.exp2(rng.uniform(-12, 12, (16, k)))
    x = (x * np.exp2(np.linspace(-60, 60, 16))[:, None]).astype(np.float32)
    x[rng.random((16, k)) < 0.02] = 0.0
    ref = sn.matmul(x, w).numpy()
    allow = mma_tolerance(x, np.abs(sn.dequantize(w).numpy().astype(np.float64)), GEMV_TOL)
    for n in (1, 9, 16):
        y = sn.matmul(sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU), wg).numpy()
        check_close(y, ref[:n], allow[:n], 1.0, f"{name} wide-range x n={n}")
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 100] = np.inf
    x[1, 700] = np.nan
    y = sn.matmul(sn.Tensor(x).to(GPU), wg).numpy()
    assert not np.isfinite(y[0]).any() and not np.isfinite(y[1]).any(), f"{name}: inf / NaN in x lost"
    assert np.all(np.isfinite(y[2])), f"{name}: a finite row of x gave non-finite results"


@gpu_only
def test_matmul_gpu_bf16_tensor_cores(rng):
    """BF16 weights with in % 64 == 0 run on the tensor cores (BF16U: x as three BF16 terms, F32 MMA
    sums): a DFlash-drafter-sized down projection (17408 -> 5120, split-K) at drafter widths within
    GEMV_TOL of the CPU; x spanning 2^-60 .. 2^60 (BF16 keeps F32's exponents); inf / NaN in a row of x
    make that row non-finite (inf where the CPU's is inf) and leave the others; a matmul_group of BF16
    weights equals the single calls bit for bit."""
    w = weight(rng, "BF16", 5120, 17408)
    wg = w.to(GPU)
    x = rng.standard_normal((16, 17408)).astype(np.float32)
    ref, bound = sn.matmul(x, w).numpy(), abs_bound(x, w)
    for n in (1, 8, 16):
        check_close(sn.matmul(sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU), wg).numpy(), ref[:n], bound[:n],
                    GEMV_TOL, f"BF16 17408 -> 5120 n={n}")
    k, out = 1024, 77
    w = weight(rng, "BF16", out, k)
    wg = w.to(GPU)
    x = (rng.standard_normal((16, k)) * np.exp2(np.linspace(-60, 60, 16))[:, None]).astype(np.float32)
    check_close(sn.matmul(sn.Tensor(x).to(GPU), wg).numpy(), sn.matmul(x, w).numpy(), abs_bound(x, w), GEMV_TOL,
                "BF16 wide-range x")
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 100], x[1, 700] = np.inf, np.nan
    y, ref = sn.matmul(sn.Tensor(x).to(GPU), wg).numpy(), sn.matmul(x, w).numpy()
    assert np.array_equal(np.isposinf(y[0]), np.isposinf(ref[0])) and np.array_equal(np.isneginf(y[0]), np.isneginf(ref[0]))
    assert not np.isfinite(y[1]).any() and np.all(np.isfinite(y[2]))
    # x near F32's maximum against a small weight column: finite, as on the CPU (the terms truncate)
    bits = w.numpy().copy()
    bits[:, 5] = 0x3A83  # ~1e-3
    w5 = sn.Tensor(np.ascontiguousarray(bits), sn.DType.BF16)
    x = rng.standard_normal((2, k)).astype(np.float32)
    x[0, 5], x[1, 5] = np.float32(3.3e38), -np.float32(3.39e38)
    check_close(sn.matmul(sn.Tensor(x).to(GPU), w5.to(GPU)).numpy(), sn.matmul(x, w5).numpy(), abs_bound(x, w5),
                GEMV_TOL, "BF16 x near F32's maximum")
    ws = [weight(rng, "BF16", o, k).to(GPU) for o in (7, 130, 40)]
    x = sn.Tensor(rng.standard_normal((9, k)).astype(np.float32)).to(GPU)
    for yg, wi in zip(sn.matmul_group(x, ws), ws):
        np.testing.assert_array_equal(yg.numpy(), sn.matmul(x, wi).numpy())


@gpu_only
def test_matmul_gpu_bad_input(rng):
    wg = weight(rng, "Q4_K", 8, 256).to(GPU)
    with pytest.raises(ValueError, match="columns"):
        sn.matmul(sn.Tensor(np.ones((2, 512), np.float32)).to(GPU), wg)
    with pytest.raises(ValueError, match="w must be"):
        sn.matmul(sn.Tensor(np.ones((2, 4), np.float32)).to(GPU),
                  sn.Tensor(np.ones((3, 4), np.int32)).to(GPU))


@gpu_only
def test_matmul_group_equals_separate_calls(rng):
    """sn.matmul_group (x split once, one grouped tensor-core launch per format, the FMA GEMV for the
    float formats) gives every weight bit for bit what its own sn.matmul gives, at one and two n8
    tiles, over 16-row slices (exact) and on the wide GEMM path (exact=False); more than 8 weights of
    one format take several launches."""
    k = 512
    names = ["IQ4_XS", "Q8_0", "IQ4_XS", "F32", "BF16", "Q6_K", "IQ4_XS", "Q4_K", "Q5_K", "F16"]
    names += ["IQ4_XS"] * 7  # 10 IQ4_XS weights: two grouped launches
    outs = [int(o) for o in rng.integers(1, 300, len(names))]
    ws = [weight(rng, name, o, k).to(GPU) for name, o in zip(names, outs)]
    x = rng.standard_normal((40, k)).astype(np.float32)
    for n, exact in ((1, True), (5, True), (9, True), (16, True), (17, True), (40, True), (40, False)):
        xg = sn.Tensor(np.ascontiguousarray(x[:n])).to(GPU)
        ys = sn.matmul_group(xg, ws, exact=exact)
        assert len(ys) == len(ws)
        for name, w, y in zip(names, ws, ys):
            ref = sn.matmul(xg, w, exact=exact).numpy()
            assert y.shape == ref.shape and np.array_equal(y.numpy().view(np.uint32), ref.view(np.uint32)), (
                f"{name} [{w.shape[0]}, {k}] n={n} exact={exact}")


@gpu_only
def test_matmul_group_bad_input(rng):
    xg = sn.Tensor(rng.standard_normal((2, 256)).astype(np.float32)).to(GPU)
    with pytest.raises(ValueError, match="no weights"):
        sn.matmul_group(xg, [])
    with pytest.raises(ValueError, match="columns"):
        sn.matmul_group(xg, [weight(rng, "Q8_0", 4, 256).to(GPU), weight(rng, "Q8_0", 4, 512).to(GPU)])
    with pytest.raises(ValueError):
        sn.matmul_group(xg, [weight(rng, "Q8_0", 4, 256)])  # a CPU weight with a GPU x


def _bits(t):
    return t.numpy().view(np.uint32)


@gpu_only
def test_rms_norm_matmul_and_swiglu_matmul_equal_their_compositions_on_gpu(rng):
    """The GEMV's x split fused into the op producing x (norm_split_kernel, elementwise_split_kernel)
    gives bit for bit what the composition gives on the GPU (rms_norm or swiglu, then matmul_group):
    every tensor-core format incl. the tiled layouts, with and without a residual and a norm weight, n = 1..16
    (fused) and 17, 40 (the composition: GEMV slices, and the BF16 GEMM with exact=False), a ragged
    last 256-group (Q8_0, 288 inputs) and a float weight in the list (composition). With the BF16 GEMM,
    swiglu_matmul computes swiglu in F32 inside x's BF16 rounding: an x value whose F32 and double
    evaluations round to neighbouring BF16 values (rare: near a rounding midpoint) differs by one BF16 ulp
    there, so the outputs are held to 2^-8 * |x| @ |w|^T of the composition's instead
    (test_swiglu_matmul_bf16_gemm_input_values checks the values themselves)."""
    # d 4096 / 8192 / 12288: 1024-thread norm blocks (8192: the largest row the fused norm stages in shared
    # memory), and more 256-input groups than warps
    cases = [(512, ["IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS_TILED", "Q4_K_TILED", "Q5_K_TILED", "Q6_K_TILED"]),
             (288, ["Q8_0", "Q8_0"]),
             (256, ["Q8_0", "F32"]), (4096, ["Q4_K"]), (8192, ["Q8_0"]), (12288, ["Q8_0"])]
    for d, names in cases:
        ws, wcpu = [], []
        for name in names:
            if name.endswith("_TILED"):
                wcpu.append(weight(rng, name[: -len("_TILED")], 48, d))
                ws.append(sn.tile_for_gemv(wcpu[-1].to(GPU)))
            else:
                wcpu.append(weight(rng, name, int(rng.integers(1, 200)), d))
                ws.append(wcpu[-1].to(GPU))
        nw = sn.Tensor((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)).to(GPU)
        widths = ((0, True), (1, True), (2, True), (7, True), (16, True), (17, True), (40, False)) if d <= 512 else \
            ((1, True), (16, True))
        for n, exact in widths:
            x, r, g, u = (sn.Tensor(rng.standard_normal((n, d)).astype(np.float32)).to(GPU) for _ in range(4))
            for weight_, residual in ((nw, r), (nw, None), (None, r), (None, None)):
                ys, h = sn.rms_norm_matmul(x, weight_, 1e-6, ws, residual=residual, exact=exact)
                if residual is None:
                    uref, href = sn.rms_norm(x, weight_, 1e-6), x
                else:
                    uref, href = sn.rms_norm(x, weight_, 1e-6, residual=residual)
                assert np.array_equal(_bits(h), _bits(href))
                for name, y, want in zip(names, ys, sn.matmul_group(uref, ws, exact=exact)):
                    assert np.array_equal(_bits(y), _bits(want)), (d, name, n, residual is None, weight_ is None)
            sw = sn.swiglu(g, u)
            for name, y, want, w in zip(names, sn.swiglu_matmul(g, u, ws, exact=exact),
                                        sn.matmul_group(sw, ws, exact=exact), wcpu):
                if exact or n <= 16:
                    assert np.array_equal(_bits(y), _bits(want)), (d, name, n, "swiglu")
                else:
                    check_close(y.numpy(), want.numpy(), abs_bound(sw.numpy(), w), 2.0**-8, f"{d} {name} swiglu")


def _bf16(x):
    """float32 -> the nearest BF16 value (ties to even), as float32 (finite inputs)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def _swiglu_inputs(rng, n, k):
    """gate, up [n, k] over silu's range: normal gates (|g| < ~25), rows of +-120 (e^-g overflows F32 below
    -88.7: the double path), a row of gates in [-95, -81) with up = 1 / |silu(gate)| (x = O(1): a value lost
    by the F32 path there shows), a row of subnormal gates (odd multiples of 2^-149 among them: g / 2 would
    lose a bit in F32) with up = 2^120, exact zeros, up values of 1e30, and such values again as the last 5
    (the scalar loop's)."""
    g = (rng.standard_normal((n, k)) * 6).astype(np.float32)
    u = rng.standard_normal((n, k)).astype(np.float32)
    g[:4] = rng.uniform(-120, 120, (4, k)).astype(np.float32)
    g[4] = rng.uniform(-95, -81, k).astype(np.float32)
    silu = np.abs(g[4].astype(np.float64) / (1 + np.exp(-g[4].astype(np.float64))))
    u[4] = np.minimum(3e38, 1 / silu).astype(np.float32)
    g[5] = (rng.choice([-1, 1], k) * rng.integers(1, 32, k) * 2.0**-149).astype(np.float32)  # subnormal, exact
    u[5] = np.float32(2.0**120)
    g[6, :64] = 0.0
    u[7] *= np.float32(1e30)
    # the last 5 values (the conversion's scalar loop when n * k % 8 == 5): both double paths and the F32 one
    g[-1, -5:] = [-90.0, -85.0, 3 * 2.0**-149, 0.0, 90.0]
    u[-1, -5:] = [1 / (90 * np.exp(-90.0)), 1 / (85 * np.exp(-85.0)), 2.0**120, 1.0, 1e30]
    return g, u


@gpu_only
@pytest.mark.parametrize("n, k", [(40, 1024), (41, 333)])
def test_swiglu_matmul_bf16_gemm_input_values(rng, n, k):
    """The F32 swiglu of the BF16 GEMM's input, value by value: with an identity weight the GEMM returns its
    input x exactly (one nonzero product per output), so each output is the kernel's BF16 x. It must be within
    a BF16 rounding (2^-8) plus the F32 evaluation's 6e-7 of the CPU's swiglu (double, rounded once), and
    equal its BF16 rounding where the double path runs (gates below -80 or under 2^-100 in magnitude; normal
    values). 41 x 333 values end with 5 that the conversion's scalar loop takes (8 a thread before them)."""
    g, u = _swiglu_inputs(rng, n, k)
    eye = sn.Tensor(np.eye(k, dtype=np.float32)).to(GPU)
    ref = sn.swiglu(sn.Tensor(g), sn.Tensor(u)).numpy()
    y = sn.swiglu_matmul(sn.Tensor(g).to(GPU), sn.Tensor(u).to(GPU), [eye], exact=False)[0].numpy()
    assert np.all(np.isfinite(ref)) and np.all(np.isfinite(y))
    err = np.abs(y.astype(np.float64) - ref)
    # (+ 2^-126: gates near -120 give subnormal values, which the tensor cores may flush)
    assert np.all(err <= (2.0**-8 + 1e-6) * np.abs(ref) + 2.0**-126), float((err / (np.abs(ref) + 1e-45)).max())
    double = ((g < -80) | (np.abs(g) < 2.0**-100)) & (np.abs(ref) >= 2.0**-126)
    assert double[4].all() and double[5].all() and double[-1, -5:-2].all()  # (the inputs reach the path)
    np.testing.assert_array_equal(y[double], _bf16(ref[double]))  # (values: the GEMM's sum turns -0 into +0)


@gpu_only
@pytest.mark.parametrize("name, n, k", [("Q4_K", 40, 1024), ("F32", 41, 333)])
def test_swiglu_matmul_bf16_gemm_vs_cpu(rng, name, n, k):
    """swiglu_matmul on the BF16 GEMM path (n > 16, exact=False) against the CPU's swiglu and matmul, within
    the GEMM's bound, on _swiglu_inputs; non-finite gates give non-finite outputs where the CPU's are."""
    w = weight(rng, name, 96, k)
    wg = w.to(GPU)
    g, u = _swiglu_inputs(rng, n, k)
    ref_x = sn.swiglu(sn.Tensor(g), sn.Tensor(u)).numpy()
    ref = sn.matmul(ref_x, w).numpy()
    y = sn.swiglu_matmul(sn.Tensor(g).to(GPU), sn.Tensor(u).to(GPU), [wg], exact=False)[0].numpy()
    check_close(y, ref, abs_bound(ref_x, w), BLAS_TOL, f"{name} swiglu_matmul, BF16 GEMM")
    for bad in (np.inf, -np.inf, np.nan):
        gb = g.copy()
        gb[3, 5] = bad
        want = sn.matmul(sn.swiglu(sn.Tensor(gb), sn.Tensor(u)).numpy(), w).numpy()
        got = sn.swiglu_matmul(sn.Tensor(gb).to(GPU), sn.Tensor(u).to(GPU), [wg], exact=False)[0].numpy()
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=str(bad))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=str(bad))


@gpu_only
def test_rms_norm_gated_matmul_equals_its_composition_on_gpu(rng):
    """rms_norm_gated_matmul (the GDN output norm fused into the out projection's x split,
    gated_norm_split_kernel) gives bit for bit rms_norm_gated, then matmul_group, on the GPU: the 27B's 48
    heads of 128 against tiled IQ4_XS / Q6_K; norm groups of 256 (one per split group), 64, 32, 16, 8 and 4
    (several per warp: up to 64 groups over 8 warps); a ragged last split group (3 heads of 128; 96 inputs
    in groups of 32, 16 and 4, whose warps zero-fill several groups past the row); with and without a norm
    weight; n = 1..16 fused, exact or not (a prefill's last chunk), and 0, 17, 40 (the composition); an inf in x
    (its row non-finite, as the composition's); and the composition's own paths: a d that does not divide
    256 (96), unaligned x, z or weight, a float weight in the list."""
    cases = [(48, 128, ["IQ4_XS_TILED", "Q6_K_TILED"]), (2, 256, ["IQ4_XS", "Q8_0"]), (8, 64, ["Q4_K"]),
             (64, 8, ["Q8_0"]), (3, 32, ["Q8_0"]), (6, 16, ["Q8_0"]), (24, 4, ["Q8_0"]), (3, 128, ["Q8_0"]),
             (4, 96, ["Q8_0"]), (2, 128, ["Q8_0", "F32"])]

    def unaligned(a):  # a's values at a 4-byte offset from an aligned buffer
        flat = sn.Tensor(np.concatenate([np.zeros(1, np.float32), a.ravel()])).to(GPU)
        return flat.view_rows(1, 1 + a.size).reshape(list(a.shape))
    for heads, d, names in cases:
        k = heads * d
        ws = []
        for name in names:
            if name.endswith("_TILED"):
                ws.append(sn.tile_for_gemv(weight(rng, name[: -len("_TILED")], 64, k).to(GPU)))
            else:
                ws.append(weight(rng, name, int(rng.integers(1, 200)), k).to(GPU))
        nw_host = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        nw = sn.Tensor(nw_host).to(GPU)
        widths = ((0, True), (1, True), (2, True), (7, True), (5, False), (16, True), (17, True), (40, False)) \
            if k <= 1024 else ((1, True), (3, True), (16, True))
        for n, exact in widths:
            xh = rng.standard_normal((n, heads, d)).astype(np.float32)
            zh = rng.standard_normal((n, heads, d)).astype(np.float32)
            if n >= 2:
                xh[1, heads - 1, d // 2] = np.inf
            x, z = sn.Tensor(xh).to(GPU), sn.Tensor(zh).to(GPU)
            variants = [("weight", x, nw, z), ("no weight", x, None, z)]
            if n in (1, 16) and names[0] == "Q8_0":
                variants += [("unaligned z", x, nw, unaligned(zh)), ("unaligned x", unaligned(xh), nw, z)]
                if d % 4 == 0:
                    variants += [("unaligned weight", x, unaligned(nw_host), z)]
            for what, xx, ww, zz in variants:
                ys = sn.rms_norm_gated_matmul(xx, ww, 1e-6, zz, ws, exact=exact)
                u = sn.rms_norm_gated(xx, ww, 1e-6, zz).reshape([n, k])
                for name, y, want in zip(names, ys, sn.matmul_group(u, ws, exact=exact)):
                    assert y.shape == (n, want.shape[1]) and np.array_equal(_bits(y), _bits(want)), (
                        heads, d, name, n, what)


@gpu_only
def test_mul_sigmoid_matmul_equals_its_composition_on_gpu(rng):
    """mul_sigmoid_matmul (gated attention's output gate fused into the out projection's x split,
    elementwise_split_kernel) gives bit for bit mul_sigmoid, then matmul_group, on the GPU: the 27B's 24 heads
    of 256 against tiled IQ4_XS, the gate a strided view of qg (as qk_norm_rope returns it) or contiguous, a
    ragged last split group (4 heads of 24), n = 1..16 fused, exact or not, and 0, 17, 40 (the composition), an
    inf in a, a float weight in the list (the composition), and a of 2 and 4 dimensions."""
    for nh, hd, names in ((24, 256, ["IQ4_XS_TILED"]), (2, 128, ["Q8_0", "Q4_K"]), (4, 24, ["Q8_0"]),
                          (2, 64, ["Q8_0", "F32"])):
        k = nh * hd
        ws = [sn.tile_for_gemv(weight(rng, name[: -len("_TILED")], 64, k).to(GPU)) if name.endswith("_TILED")
              else weight(rng, name, int(rng.integers(1, 200)), k).to(GPU) for name in names]
        for n, exact in ((0, True), (1, True), (2, True), (9, True), (4, False), (16, True), (17, True), (40, False)):
            ah = rng.standard_normal((n, nh, hd)).astype(np.float32)
            if n >= 2:
                ah[1, 0, 3] = np.inf
            a = sn.Tensor(ah).to(GPU)
            qg = sn.Tensor(4 * rng.standard_normal((n, nh, 2 * hd)).astype(np.float32)).to(GPU)
            flat = sn.Tensor(np.ascontiguousarray(qg.numpy()[..., :hd])).to(GPU)
            for what, gate in (("view", sn.slice(qg, -1, hd, 2 * hd)), ("contiguous", flat)):
                ys = sn.mul_sigmoid_matmul(a, gate, ws, exact=exact)
                u = sn.mul_sigmoid(a, gate).reshape([n, k])
                for name, y, want in zip(names, ys, sn.matmul_group(u, ws, exact=exact)):
                    assert y.shape == (n, want.shape[1]) and np.array_equal(_bits(y), _bits(want)), (
                        nh, hd, name, n, what)
    w = weight(rng, "Q8_0", 32, 256).to(GPU)
    for shape in ((3, 256), (3, 2, 2, 64)):  # a of 2 and 4 dimensions: rows of 256 inputs
        a, g = (sn.Tensor(rng.standard_normal(shape).astype(np.float32)).to(GPU) for _ in range(2))
        want = sn.matmul(sn.mul_sigmoid(a, g).reshape([3, 256]), w)
        assert np.array_equal(_bits(sn.mul_sigmoid_matmul(a, g, [w])[0]), _bits(want)), shape


@gpu_only
def test_fused_matmul_bad_input_on_gpu(rng):
    xg = sn.Tensor(rng.standard_normal((2, 256)).astype(np.float32)).to(GPU)
    w = weight(rng, "Q8_0", 4, 256).to(GPU)
    with pytest.raises(ValueError, match="no weights"):
        sn.rms_norm_matmul(xg, None, 1e-6, [])
    with pytest.raises(ValueError, match="columns"):
        sn.rms_norm_matmul(xg, None, 1e-6, [w, weight(rng, "Q8_0", 4, 512).to(GPU)])
    with pytest.raises(ValueError):
        sn.rms_norm_matmul(xg, None, 1e-6, [weight(rng, "Q8_0", 4, 256)])  # a CPU weight with a GPU x
    with pytest.raises(ValueError, match="residual"):
        sn.rms_norm_matmul(xg, None, 1e-6, [w], residual=sn.Tensor(np.zeros((2, 128), np.float32)).to(GPU))
    with pytest.raises(ValueError, match="same shape"):
        sn.swiglu_matmul(xg, sn.Tensor(np.zeros((2, 128), np.float32)).to(GPU), [w])
    x3 = sn.Tensor(rng.standard_normal((2, 2, 128)).astype(np.float32)).to(GPU)
    with pytest.raises(ValueError, match="groups, d"):
        sn.rms_norm_gated_matmul(xg, None, 1e-6, xg, [w])
    with pytest.raises(ValueError, match="rms_norm_gated_matmul: z"):
        sn.rms_norm_gated_matmul(x3, None, 1e-6, sn.Tensor(np.zeros((2, 2, 64), np.float32)).to(GPU), [w])
    with pytest.raises(ValueError, match="columns"):
        sn.rms_norm_gated_matmul(x3, None, 1e-6, x3, [weight(rng, "Q8_0", 4, 512).to(GPU)])
    with pytest.raises(ValueError, match="a must be"):
        sn.mul_sigmoid_matmul(sn.Tensor(np.zeros(256, np.float32)).to(GPU),
                              sn.Tensor(np.zeros(256, np.float32)).to(GPU), [w])
    with pytest.raises(ValueError, match="same shape"):
        sn.mul_sigmoid_matmul(x3, xg, [w])
    with pytest.raises(ValueError, match="columns"):
        sn.mul_sigmoid_matmul(x3, x3, [weight(rng, "Q8_0", 4, 512).to(GPU)])
