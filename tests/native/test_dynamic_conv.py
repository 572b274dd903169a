"""sn.grouped_dynamic_conv (DFlash 2's grouped dynamic causal conv, drafters.md §6.2) on the CPU against
its numpy reference draft_worker.model.grouped_dynamic_conv, bit for bit: the op promises the reference's
F32 operations in the reference's order (no fused multiply-add). Also its argument checks.
The GPU op against this one: tests/gpu/test_gpu_dynamic_conv.py."""
import numpy as np
import pytest

import specd.native as sn
from specd.draft_worker.model import grouped_dynamic_conv

# (G, group_size): H = G * group_size; odd H (7, 21), one group, the 27B head's group of 16
GROUPINGS = [(7, 1), (20, 16), (7, 3), (1, 16)]


def inputs(rng, L, taps, G, gs, S=None):
    """y [L, H], dyn [L, taps, G] (or [L, S, taps, G]), base [taps, H]: standard normal F32 (products and
    sums of such values round differently with and without FMA in most elements)."""
    H = G * gs
    y = rng.standard_normal((L, H)).astype(np.float32)
    dyn = rng.standard_normal((L, taps, G) if S is None else (L, S, taps, G)).astype(np.float32)
    base = rng.standard_normal((taps, H)).astype(np.float32)
    return y, dyn, base


def assert_bits(got, want):
    """Equal bit for bit (-0.0 != +0.0), except that every NaN equals every NaN (payloads differ between
    numpy's operand order, the CPU's and the GPU's canonical NaN)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@pytest.mark.parametrize("L", [1, 2, 8, 17])
@pytest.mark.parametrize("taps", [1, 2, 4])
@pytest.mark.parametrize("G,gs", GROUPINGS)
def test_grouped_dynamic_conv_equals_numpy_bitwise(rng, L, taps, G, gs):
    y, dyn, base = inputs(rng, L, taps, G, gs)
    assert_bits(sn.grouped_dynamic_conv(y, dyn, base).numpy(), grouped_dynamic_conv(y, dyn, base, gs))
    assert_bits(sn.grouped_dynamic_conv(y, dyn, base, side=0).numpy(), grouped_dynamic_conv(y, dyn, base, gs))


@pytest.mark.parametrize("L,taps", [(1, 2), (8, 2), (3, 4), (17, 1)])
@pytest.mark.parametrize("side", [0, 1])
def test_grouped_dynamic_conv_side_of_projection(rng, L, taps, side):
    """dyn as the kernel projection's whole output [L, 2, taps, G], the side read in place: equal to the
    op on the copied side and to numpy."""
    G, gs = 20, 16
    y, D, base = inputs(rng, L, taps, G, gs, S=2)
    want = grouped_dynamic_conv(y, D[:, side], base, gs)
    assert_bits(sn.grouped_dynamic_conv(y, D, base, side).numpy(), want)
    assert_bits(sn.grouped_dynamic_conv(y, np.ascontiguousarray(D[:, side]), base).numpy(), want)


def test_grouped_dynamic_conv_no_fma(rng):
    """The case where fusing would show: the reference differs from a fused multiply-add (product and sum
    rounded once, emulated in float64) in many elements, and the op matches the reference, not the fused form."""
    L, taps, G, gs = 17, 4, 64, 16
    y, dyn, base = inputs(rng, L, taps, G, gs)
    coef = base[None] + np.repeat(dyn, gs, axis=2)
    fused = coef[:, 0] * y
    for o in range(1, taps):
        fused[o:] = (fused[o:].astype(np.float64) + coef[o:, o].astype(np.float64) * y[:-o]).astype(np.float32)
    want = grouped_dynamic_conv(y, dyn, base, gs)
    assert (fused != want).mean() > 0.05
    assert_bits(sn.grouped_dynamic_conv(y, dyn, base).numpy(), want)


def test_grouped_dynamic_conv_empty_block(rng):
    y, dyn, base = inputs(rng, 0, 2, 4, 3)
    out = sn.grouped_dynamic_conv(y, dyn, base).numpy()
    assert out.shape == (0, 12) and out.dtype == np.float32


def test_grouped_dynamic_conv_hand_case():
    """The hand case of tests/drafter/test_forward_cases.py (two taps, H = 4, groups of 2)."""
    y = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 0, -1, 2]], np.float32)
    base = np.array([[1, 1, 0, 0], [0, 1, 2, 0]], np.float32)
    d = np.zeros((3, 2, 2), np.float32)
    d[1, 1, 0] = 10
    d[2, 0, 1] = -1
    want = np.array([[1, 2, 0, 0], [15, 28, 6, 0], [1, 6, 15, -2]], np.float32)
    np.testing.assert_array_equal(sn.grouped_dynamic_conv(y, d, base).numpy(), want)


@pytest.mark.parametrize("where", ["y", "dyn", "base"])
def test_grouped_dynamic_conv_inf_nan(rng, where):
    """inf, -inf, NaN and signed zeros in any input propagate as in numpy (inf * 0 = NaN, inf - inf = NaN;
    a zero-padded term is left out, so an inf coefficient before the block start adds no NaN)."""
    L, taps, G, gs = 8, 4, 5, 3
    y, dyn, base = inputs(rng, L, taps, G, gs)
    a = {"y": y, "dyn": dyn, "base": base}[where]
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
    flat[idx] = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, np.inf] * 2, np.float32)[: idx.size]
    if where == "y":
        y[3, :] = 0.0  # inf coefficients times zero inputs
        dyn[4, 1, :] = np.inf
    with np.errstate(invalid="ignore"):
        want = grouped_dynamic_conv(y, dyn, base, gs)
    assert np.isnan(want).any() or np.isinf(want).any()
    assert_bits(sn.grouped_dynamic_conv(y, dyn, base).numpy(), want)


def test_grouped_dynamic_conv_signed_zeros():
    """-0.0 results stay -0.0 (bitwise, not merely equal): (-0 + -0) * 1 = -0, then -0 + (-0) = -0."""
    y = np.ones((2, 4), np.float32)
    base = np.full((2, 4), -0.0, np.float32)
    dyn = np.full((2, 2, 2), -0.0, np.float32)
    out = sn.grouped_dynamic_conv(y, dyn, base).numpy()
    assert_bits(out, grouped_dynamic_conv(y, dyn, base, 2))
    assert np.signbit(out).all()


def test_grouped_dynamic_conv_errors(rng):
    y, dyn, base = inputs(rng, 4, 2, 5, 3)
    D = np.stack([dyn, dyn], axis=1)  # [L, 2, taps, G]
    op = "grouped_dynamic_conv"
    bad = [
        ((y.astype(np.float16), dyn, base), "y must be F32"),
        ((y, dyn.astype(np.float16), base), "dyn must be F32"),
        ((y, dyn, base.astype(np.float16)), "base must be F32"),
        ((np.zeros((4, 30), np.float32)[:, ::2], dyn, base), "y must be contiguous"),
        ((y, np.zeros((4, 2, 10), np.float32)[:, :, ::2], base), "dyn must be contiguous"),
        ((y, dyn, np.zeros((2, 30), np.float32)[:, ::2]), "base must be contiguous"),
        ((y.reshape(-1), dyn, base), r"y must be \[L, H\]"),
        ((y, dyn.reshape(4, 10), base), r"dyn must be \[L, taps, G\] or \[L, S, taps, G\]"),
        ((y, dyn[None, None], base), r"dyn must be \[L, taps, G\] or \[L, S, taps, G\]"),
        ((y[:3], dyn, base), "dyn must have y's L = 3 rows"),
        ((np.zeros((4, 0), np.float32), np.zeros((4, 2, 1), np.float32), np.zeros((2, 0), np.float32)),
         "y must have at least one channel"),
        ((y, np.zeros((4, 0, 5), np.float32), np.zeros((0, 15), np.float32)), r"dyn \[4, 0, 5\] must have S, taps, G >= 1"),
        ((y, np.zeros((4, 2, 0), np.float32), base), r"dyn \[4, 2, 0\] must have S, taps, G >= 1"),
        ((y, np.zeros((4, 2, 4), np.float32), base), "y's H = 15 must be a multiple of dyn's G = 4"),
        ((y, dyn, base[:1]), r"base must be \[taps, H\] = \[2, 15\]"),
        ((y, dyn, base.T.copy()), r"base must be \[taps, H\] = \[2, 15\]"),
        ((y, dyn, base[None]), r"base must be \[taps, H\]"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=f"{op}: {msg}"):
            sn.grouped_dynamic_conv(*args)
    with pytest.raises(ValueError, match=f"{op}: side 1 out of range .*3-D dyn has side 0 only"):
        sn.grouped_dynamic_conv(y, dyn, base, 1)
    for side in (2, -1):
        with pytest.raises(ValueError, match=f"{op}: side {side} out of range for dyn"):
            sn.grouped_dynamic_conv(y, D, base, side)


def test_grouped_dynamic_conv_size_bound(tmp_path):
    """A tensor of 2^31 elements or more is refused (the GPU kernel indexes in 32 bits): a sparse 8 GiB
    file mapped, never touched."""
    n = 2**31
    mm = np.memmap(tmp_path / "big.f32", np.float32, mode="w+", shape=(n,))
    try:
        y = mm.reshape(1, n)
        with pytest.raises(ValueError, match=r"grouped_dynamic_conv: y \[1, 2147483648\] has 2147483648 elements"):
            sn.grouped_dynamic_conv(y, np.zeros((1, 1, 1), np.float32), y)
        with pytest.raises(ValueError, match=r"grouped_dynamic_conv: dyn \[1, 2147483648, 1\] has"):
            sn.grouped_dynamic_conv(np.ones((1, 1), np.float32), mm.reshape(1, n, 1), mm.reshape(n, 1))
    finally:
        del mm
