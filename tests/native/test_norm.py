"""RMSNorm and L2 norm against float64 numpy references (qwen35-target.md §6.2); rms_norm_gated bit for bit
against mul(rms_norm, silu(z)), gdn_qkv bit for bit against l2_norm of the column slices."""
import numpy as np
import pytest

import specd.native as sn

SHAPES = [(1, 1), (3, 7), (5, 128), (2, 3, 257), (17, 5120)]
RTOL = 2e-6  # fp32 result of a float64-accumulated reduction


def rms_ref(x, w, eps):
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * w if w is not None else y


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(rng, shape, with_weight):
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 100)
    w = rng.standard_normal(shape[-1]).astype(np.float32) if with_weight else None
    y = sn.rms_norm(x, w, eps=1e-6).numpy()
    ref = rms_ref(x, w, 1e-6)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fused_residual(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    y, h = sn.rms_norm(x, w, eps=1e-5, residual=r)
    h_ref = x + r  # exact in fp32 (one rounding), same as numpy
    np.testing.assert_array_equal(h.numpy(), h_ref)
    ref = rms_ref(h_ref, w, 1e-5)
    np.testing.assert_allclose(y.numpy(), ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())


def test_rms_norm_batch_invariant(rng):
    x = rng.standard_normal((9, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    full = sn.rms_norm(x, w).numpy()
    for i in range(9):
        np.testing.assert_array_equal(sn.rms_norm(x[i : i + 1], w).numpy(), full[i : i + 1])


@pytest.mark.parametrize("shape", SHAPES)
def test_l2_norm(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    y = sn.l2_norm(x, eps=1e-6).numpy()
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).sum(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=1e-7)


def test_rms_norm_bad_input():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight has 7 elements"):
        sn.rms_norm(x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="x must be F32"):
        sn.rms_norm(np.ones((2, 8), np.float16))
    with pytest.raises(ValueError, match="residual shape"):
        sn.rms_norm(x, None, residual=np.ones((2, 9), np.float32))


def test_explicit_little_endian_arrays_are_accepted():
    # GGUFReader returns float32 arrays with an explicit '<' byte order; they must view zero-copy.
    x = np.arange(8, dtype="<f4").reshape(2, 4)
    t = sn.Tensor(x)
    assert t.dtype == sn.DType.F32
    x[0, 0] = 5.0
    assert t.numpy()[0, 0] == 5.0
    with pytest.raises(ValueError, match="unsupported numpy dtype"):
        sn.Tensor(np.zeros(4, ">f4"))


def test_tensor_size_overflow_is_an_error():
    with pytest.raises(ValueError, match="overflows"):
        sn.Tensor.zeros([2**62, 1, 4], sn.DType.F32)
    with pytest.raises(ValueError, match="overflows"):
        sn.Tensor.empty([2**40, 2**40], sn.DType.F16)


def test_read_only_memory_stays_read_only():
    # GGUF weights are read-only memory maps: their views must not be writable, and ops that write
    # into an argument refuse read-only ones instead of writing (or crashing).
    a = np.zeros((4, 2, 32), np.float32)
    a.flags.writeable = False
    t = sn.Tensor(a)
    assert not t.numpy().flags.writeable
    with pytest.raises(ValueError, match="kv_write: cache is read-only"):
        sn.kv_write(a, np.ones((1, 2, 32), np.float32), np.zeros(1, np.int32))
    state = np.zeros((3, 8), np.float32)
    state.flags.writeable = False
    with pytest.raises(ValueError, match="conv1d_causal: state is read-only"):
        sn.conv1d_causal(np.ones((2, 8), np.float32), np.ones((4, 8), np.float32), state)


# ------------------------------------------------ rms_norm_gated: bit for bit mul(rms_norm, silu(z))

SPECIAL = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e4, -1e4, 20.0, 19.99, 20.01, 88.7, -88.7, -100, 1e-30],
                   np.float32)


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (3, 7), (2, 3, 128), (5, 4, 130)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_gated_bitwise(rng, shape, with_weight):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(np.float32)
    z = (rng.standard_normal(shape) * 20).astype(np.float32)
    if z.size:
        z.flat[rng.integers(0, z.size, 4)] = rng.choice(SPECIAL, 4)
    w = rng.standard_normal(shape[-1]).astype(np.float32) if with_weight else None
    got = sn.rms_norm_gated(x, w, 1e-6, z).numpy()
    assert_bits(got, sn.mul(sn.rms_norm(x, w, 1e-6), sn.silu(z)).numpy())


def test_rms_norm_gated_special_rows():
    """Zero rows (scale 1/sqrt(eps)), an inf / NaN in x: still the composition's bits."""
    x = np.array([[0, 0, 0, 0], [1, np.inf, 2, 3], [np.nan, 1, 2, 3], [1e-30, -1e30, 5, 0]], np.float32)
    z = np.array([[1, -1, 50, -50]] * 4, np.float32)
    w = np.array([1, 2, -3, 0], np.float32)
    for eps in (0.0, 1e-6):
        got = sn.rms_norm_gated(x, w, eps, z).numpy()
        assert_bits(got, sn.mul(sn.rms_norm(x, w, eps), sn.silu(z)).numpy())


def test_rms_norm_gated_bad_inputs():
    x = np.ones((3, 4), np.float32)
    w = np.ones(4, np.float32)
    cases = [
        ((x.astype(np.float16), w, 1e-6, x), "x must be F32"),
        ((x, w, 1e-6, x.astype(np.float16)), "z must be F32"),
        ((x, w.astype(np.float16), 1e-6, x), "weight must be F32"),
        ((x, w, 1e-6, np.ones((4, 3), np.float32)), "z shape differs from x"),
        ((x, w, 1e-6, np.ones(12, np.float32)), "z shape differs from x"),
        ((x, np.ones(5, np.float32), 1e-6, x), "weight has 5 elements"),
        ((x, w, -1.0, x), "eps must be finite"),
        ((np.ones((4, 8), np.float32)[:, ::2], w, 1e-6, x), "x must be contiguous"),
        ((x, w, 1e-6, np.ones((3, 8), np.float32)[:, ::2]), "z must be contiguous"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.rms_norm_gated(*args)


# ------------------------------------------- gdn_qkv: bit for bit l2_norm of the q / k slices, the v slice

# (Hk, dk, Hv, dv): the 27B, small odd ones, dk % 4 == 0 with C % 4 != 0 (GPU rows of cv unaligned)
QKV_DIMS = [(16, 128, 48, 128), (1, 1, 1, 1), (2, 3, 5, 7), (3, 4, 3, 3), (2, 130, 4, 5), (4, 64, 8, 32)]


def composed_qkv(cv, hk, dk, hv, dv, eps):
    """The composition _gdn ran before gdn_qkv (numpy column copies and sn.l2_norm)."""
    w = cv.shape[0]
    q = sn.l2_norm(np.ascontiguousarray(cv[:, : hk * dk]).reshape(w, hk, dk), eps).numpy()
    k = sn.l2_norm(np.ascontiguousarray(cv[:, hk * dk : 2 * hk * dk]).reshape(w, hk, dk), eps).numpy()
    return q, k, np.ascontiguousarray(cv[:, 2 * hk * dk :]).reshape(w, hv, dv)


@pytest.mark.parametrize("dims", QKV_DIMS)
def test_gdn_qkv_bitwise(rng, dims):
    hk, dk, hv, dv = dims
    c = 2 * hk * dk + hv * dv
    for w in range(18):
        cv = (rng.standard_normal((w, c)) * rng.uniform(0.01, 100)).astype(np.float32)
        if w:
            cv[0, :dk] = 0  # a zero head: the scale is 1/sqrt(eps)
        for eps in (1e-6, 0.0) if w == 3 else (1e-6,):
            got = sn.gdn_qkv(cv, hk, dk, hv, dv, eps)
            assert all(isinstance(t, sn.Tensor) for t in got)
            for g, want in zip(got, composed_qkv(cv, hk, dk, hv, dv, eps)):
                assert_bits(g.numpy(), want)


def test_gdn_qkv_special_values():
    """inf / NaN in a head spoil that head only (as l2_norm); v is copied bit for bit (NaN payloads too)."""
    hk, dk, hv, dv = 2, 4, 3, 2
    cv = np.arange(2 * (2 * hk * dk + hv * dv), dtype=np.float32).reshape(2, -1)
    cv[0, 1], cv[1, 9], cv[1, -1] = np.inf, np.nan, np.float32(1e-45)
    cv.view(np.uint32)[0, -2] = 0x7FC00123
    for g, want in zip(sn.gdn_qkv(cv, hk, dk, hv, dv, 1e-6), composed_qkv(cv, hk, dk, hv, dv, 1e-6)):
        assert_bits(g.numpy(), want)


def test_gdn_qkv_bad_inputs():
    cv = np.ones((3, 2 * 2 * 4 + 3 * 5), np.float32)  # Hk 2, dk 4, Hv 3, dv 5: C = 31
    dims = (2, 4, 3, 5)
    cases = [
        ((cv.astype(np.float16), *dims, 1e-6), "gdn_qkv: cv must be F32"),
        ((cv.reshape(-1), *dims, 1e-6), "gdn_qkv: cv must have 2 dimensions"),
        ((cv.reshape(3, 1, 31), *dims, 1e-6), "gdn_qkv: cv must have 2 dimensions"),
        ((np.ones((3, 62), np.float32)[:, ::2], *dims, 1e-6), "gdn_qkv: cv must be contiguous"),
        ((cv, 2, 4, 3, 4, 1e-6), r"cv has 31 columns, expected 2 \* n_k_heads \* head_k_dim \+ n_v_heads \* "
                                 r"head_v_dim = 2 \* 2 \* 4 \+ 3 \* 4"),
        ((cv, 2, 4, 3, 2**62, 1e-6), "cv has 31 columns"),
        ((cv, 2**62, 2**62, 3, 5, 1e-6), "cv has 31 columns"),
        ((cv, 0, 4, 3, 5, 1e-6), "n_k_heads, head_k_dim, n_v_heads and head_v_dim must be > 0, got 0, 4, 3, 5"),
        ((cv, 2, 4, 3, -5, 1e-6), "must be > 0"),
        ((cv, *dims, -1.0), "gdn_qkv: eps must be finite and >= 0"),
        ((cv, *dims, float("nan")), "gdn_qkv: eps must be finite"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.gdn_qkv(*args)
    q, k, v = sn.gdn_qkv(np.ones((0, 31), np.float32), *dims, 1e-6)
    assert q.shape == k.shape == (0, 2, 4) and v.shape == (0, 3, 5)
