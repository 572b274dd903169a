"""GPU backend ops against the CPU backend and float64 numpy references.

Tests marked ``gpu`` run only where ``specd.native.gpu_available()`` (a build with SPECD_GPU=cuda|hip on
a machine with a device); elsewhere they are skipped, and ``test_gpu_unavailable_*`` checks instead
that the GPU interface reports itself unavailable and refuses GPU tensors with a clear error.

Tolerances (stated per op):
* argmax: exact (first maximum on ties, numpy.argmax semantics incl. NaN).
* rms_norm / l2_norm: 1e-6 relative per element against the CPU backend (both sum squares in
  double and scale in float the same way; at most the scale's last bit differs), 2e-6 relative to
  the row max against float64 numpy, and the fused residual sum h bit-exact.
* matmul (Q8_0 and F32 weights): |y - ref| <= 1e-5 * (|x| @ |w|^T) per element, ref in float64 from
  the exactly dequantized weights (F32 accumulation of up to 14336 products stays well inside), for
  any n (the default exact GEMV, in 16-row slices above 16 rows).
  Every format, width and the inexact cuBLAS path (exact=False) in detail: test_gpu_matmul.py.
Every GPU result is also checked for bit-identical rows whatever the number of rows in the call
(batch invariance, needed for lossless speculative decoding).

Every op is reached through the public Python API (``sn.rms_norm``, ``sn.l2_norm``, ``sn.matmul``,
``sn.argmax``), which dispatches GPU tensors to the CUDA kernels.
"""
import numpy as np
import pytest

import specd.native as sn

GPU = sn.Device.GPU
HAVE_GPU = sn.gpu_available()


def gpu_only(f):
    """Marks a test `gpu` and skips it unless a GPU is available."""
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)


VOCAB = 248320  # Qwen3.5 vocabulary


def on_gpu(a, dtype=None):
    a = np.ascontiguousarray(a)
    t = sn.Tensor(a) if dtype is None else sn.Tensor(a, dtype)
    return t.to(GPU)


def poison(nbytes):
    """Leave a NaN-filled block of `nbytes` in the device pool, so an op whose output allocation
    reuses it and that fails to write every element is caught (best effort: the pool usually hands
    the same block back for the same size)."""
    n = max(1, (nbytes + 3) // 4)
    t = on_gpu(np.full(n, np.nan, np.float32))
    sn.gpu_synchronize()
    del t


# --------------------------------------------------------------------------------------------
# CPU-only machines
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a usable GPU")
def test_gpu_unavailable_reports_false_and_refuses_gpu_tensors():
    assert sn.gpu_available() is False
    assert sn.gpu_backend() in ("none", "cuda", "hip")
    assert (sn.gpu_backend() == "none") == (not sn.gpu_compiled())
    assert sn.gpu_device_name() == ""
    sn.gpu_synchronize()  # nothing queued: a no-op, not an error
    x = sn.Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(RuntimeError, match="GPU") as e:
        x.to(GPU)
    # The message says why: no GPU backend in the build, or no device/driver on this machine.
    assert ("SPECD_GPU" in str(e.value)) or ("device" in str(e.value))
    with pytest.raises(RuntimeError, match="GPU"):
        sn.Tensor.zeros([4], sn.DType.F32, GPU)
    with pytest.raises(RuntimeError, match="GPU"):
        sn.Tensor.empty([4, 32], sn.DType.Q8_0, GPU)


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


@gpu_only
def test_runtime_round_trip(rng):
    assert sn.gpu_compiled() and sn.gpu_backend() in ("cuda", "hip")
    assert sn.gpu_device_name() != ""
    for dtype, a in [
        (None, rng.standard_normal((3, 5, 7)).astype(np.float32)),
        (None, rng.integers(-(2**31), 2**31 - 1, (11,), dtype=np.int32)),
        (None, rng.standard_normal((4, 9)).astype(np.float16)),
        (sn.DType.Q8_0, rng.integers(0, 256, (3, 2 * 34), dtype=np.uint8)),
    ]:
        t = on_gpu(a, dtype)
        assert t.device == GPU
        assert t.shape == (sn.Tensor(a, dtype).shape if dtype is not None else a.shape)
        back = t.numpy()
        np.testing.assert_array_equal(back, a)
        np.testing.assert_array_equal(t.to(sn.Device.CPU).numpy(), a)
    z = sn.Tensor.zeros([5, 33], sn.DType.F32, GPU)
    np.testing.assert_array_equal(z.numpy(), np.zeros((5, 33), np.float32))
    e = sn.Tensor.empty([0, 8], sn.DType.F32, GPU)
    assert e.numpy().shape == (0, 8)


# --------------------------------------------------------------------------------------------
# RMSNorm / L2 norm
# --------------------------------------------------------------------------------------------

NORM_SHAPES = [(1, 1), (3, 7), (5, 128), (2, 3, 257), (17, 5120), (4, 4096), (64, 256), (2, 6), (3, 4100)]


def rms_ref(x, w, eps):
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * w if w is not None else y


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
@gpu_only
def test_rms_norm_gpu_vs_cpu(rng, shape, with_weight):
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(rng.uniform(0.01, 100))
    w = rng.standard_normal(shape[-1]).astype(np.float32) if with_weight else None
    poison(x.nbytes)
    y = sn.rms_norm(on_gpu(x), on_gpu(w) if w is not None else None, eps=1e-6)
    assert y.device == GPU and y.shape == x.shape
    y = y.numpy()
    cpu = sn.rms_norm(x, w, eps=1e-6).numpy()
    np.testing.assert_allclose(y, cpu, rtol=1e-6, atol=0)
    ref = rms_ref(x, w, 1e-6)
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("shape", NORM_SHAPES)
@gpu_only
def test_rms_norm_fused_residual_gpu(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    poison(x.nbytes)
    y, h = sn.rms_norm(on_gpu(x), on_gpu(w), eps=1e-5, residual=on_gpu(r))
    assert y.device == GPU and h.device == GPU
    np.testing.assert_array_equal(h.numpy(), x + r)  # one fp32 rounding, as numpy
    ycpu, hcpu = sn.rms_norm(x, w, eps=1e-5, residual=r)
    np.testing.assert_array_equal(h.numpy(), hcpu.numpy())
    np.testing.assert_allclose(y.numpy(), ycpu.numpy(), rtol=1e-6, atol=0)


@gpu_only
def test_rms_norm_gpu_batch_invariant(rng):
    x = rng.standard_normal((9, 5120)).astype(np.float32)
    w = rng.standard_normal(5120).astype(np.float32)
    wg = on_gpu(w)
    full = sn.rms_norm(on_gpu(x), wg).numpy()
    for i in range(9):
        np.testing.assert_array_equal(sn.rms_norm(on_gpu(x[i : i + 1]), wg).numpy(), full[i : i + 1])


@gpu_only
def test_rms_norm_gpu_bad_input():
    x = on_gpu(np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="weight has 7 elements"):
        sn.rms_norm(x, on_gpu(np.ones(7, np.float32)))
    with pytest.raises(ValueError, match="x must be F32"):
        sn.rms_norm(on_gpu(np.ones((2, 8), np.float16)))
    with pytest.raises(ValueError, match="residual shape"):
        sn.rms_norm(x, None, residual=on_gpu(np.ones((2, 9), np.float32)))
    with pytest.raises(ValueError, match="eps"):
        sn.rms_norm(x, None, eps=-1.0)
    with pytest.raises(ValueError, match="different devices"):
        sn.rms_norm(x, np.ones(8, np.float32))


@pytest.mark.parametrize("shape", NORM_SHAPES)
@gpu_only
def test_l2_norm_gpu_vs_cpu(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    y = sn.l2_norm(on_gpu(x), eps=1e-6)
    assert y.device == GPU
    np.testing.assert_allclose(y.numpy(), sn.l2_norm(x, eps=1e-6).numpy(), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------
# matmul
# --------------------------------------------------------------------------------------------


def random_q8_0(rng, out, k):
    """Random ggml block_q8_0 rows: [out, k/32 * 34] uint8 and their exact float64 values.

    Scales are random fp16 of both signs over several magnitudes, quants random int8 over the
    whole range (the format allows -128 even though ggml's quantizer emits [-127, 127])."""
    nb = k // 32
    d = (rng.standard_normal((out, nb)) * np.exp(rng.uniform(-6, 0, (out, nb)))).astype(np.float16)
    q = rng.integers(-128, 128, (out, nb, 32), dtype=np.int8)
    raw = np.empty((out, nb, 34), np.uint8)
    raw[:, :, :2] = d.view(np.uint8).reshape(out, nb, 2)
    raw[:, :, 2:] = q.view(np.uint8)
    values = (d.astype(np.float64)[:, :, None] * q.astype(np.float64)).reshape(out, k)
    return raw.reshape(out, nb * 34), values


def check_matmul(y, x, wf, what):
    tol = 1e-5  # the exact GEMV at every row count
    x64 = x.astype(np.float64)
    ref = x64 @ wf.T
    bound = np.abs(x64) @ np.abs(wf).T
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(np.isfinite(y)), f"{what}: non-finite output"
    bad = err > tol * bound + 1e-30
    assert not bad.any(), f"{what}: {bad.sum()} elements over {tol:.3g}*sum|x||w|; max ratio {(err / (bound + 1e-30)).max():.3g}"


def cpu_matmul_or_none(x, w, dtype):
    """The CPU backend's result, or None while the CPU op is not in this build."""
    try:
        return sn.matmul(x, sn.Tensor(w, dtype) if dtype is not None else w).numpy()
    except (ValueError, RuntimeError, NotImplementedError, TypeError):
        return None


MATMUL_SHAPES = [  # (n, in, out)
    (1, 32, 1),
    (1, 64, 7),
    (3, 96, 33),
    (2, 4096, 1000),
    (5, 5120, 129),
    (8, 1024, 4099),
    (16, 2048, 513),
    (17, 4096, 300),
    (33, 256, 64),
    (1, 14336, 4096),
    (16, 4096, 2048),
]


@pytest.mark.parametrize("n,k,out", MATMUL_SHAPES)
@gpu_only
def test_matmul_q8_0_gpu(rng, n, k, out):
    raw, wf = random_q8_0(rng, out, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    wg = on_gpu(raw, sn.DType.Q8_0)
    assert wg.shape == (out, k)
    poison(n * out * 4)
    y = sn.matmul(on_gpu(x), wg)
    assert y.device == GPU and y.shape == (n, out)
    y = y.numpy()
    check_matmul(y, x, wf, f"Q8_0 n={n} in={k} out={out}")
    cpu = cpu_matmul_or_none(x, raw, sn.DType.Q8_0)
    if cpu is not None:
        check_matmul(cpu, x, wf, "CPU backend (sanity)")
        bound = np.abs(x.astype(np.float64)) @ np.abs(wf).T
        assert np.all(np.abs(y.astype(np.float64) - cpu) <= 2e-5 * bound + 1e-30)


@pytest.mark.parametrize("n,k,out", [(1, 1, 1), (2, 7, 5), (3, 33, 17), (4, 256, 300), (16, 4096, 1024), (20, 130, 9)])
@gpu_only
def test_matmul_f32_gpu(rng, n, k, out):
    w = rng.standard_normal((out, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    poison(n * out * 4)
    y = sn.matmul(on_gpu(x), on_gpu(w)).numpy()
    check_matmul(y, x, w.astype(np.float64), f"F32 n={n} in={k} out={out}")
    cpu = cpu_matmul_or_none(x, w, None)
    if cpu is not None:
        bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
        assert np.all(np.abs(y.astype(np.float64) - cpu) <= 2e-5 * bound + 1e-30)


@gpu_only
def test_matmul_gpu_batch_invariant(rng):
    raw, _ = random_q8_0(rng, 777, 2048)
    wg = on_gpu(raw, sn.DType.Q8_0)
    wf = on_gpu(rng.standard_normal((333, 2048)).astype(np.float32))
    x = rng.standard_normal((16, 2048)).astype(np.float32)  # batch invariance holds for n <= 16 (GEMV)
    for w in (wg, wf):
        full = sn.matmul(on_gpu(x), w).numpy()
        for lo, hi in [(0, 1), (3, 4), (0, 2), (5, 8), (2, 7), (0, 16), (4, 16), (15, 16)]:
            np.testing.assert_array_equal(sn.matmul(on_gpu(x[lo:hi]), w).numpy(), full[lo:hi])


@gpu_only
def test_matmul_gpu_bad_input(rng):
    raw, _ = random_q8_0(rng, 8, 64)
    wg = on_gpu(raw, sn.DType.Q8_0)
    with pytest.raises(ValueError, match="columns"):
        sn.matmul(on_gpu(np.ones((2, 32), np.float32)), wg)
    with pytest.raises(ValueError, match="x must be F32"):
        sn.matmul(on_gpu(np.ones((2, 64), np.float16)), wg)


# --------------------------------------------------------------------------------------------
# argmax
# --------------------------------------------------------------------------------------------


def cpu_argmax_or_none(x):
    try:
        return sn.argmax(x).numpy()
    except (ValueError, RuntimeError, NotImplementedError, TypeError):
        return None


@pytest.mark.parametrize("shape", [(1, VOCAB), (4, VOCAB), (16, VOCAB), (3, 7), (2, 1), (5, 1001), (1, 1024), (2, 3, 257), (1, VOCAB + 1)])
@gpu_only
def test_argmax_gpu(rng, shape):
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    poison(int(np.prod(shape[:-1])) * 4)
    got = sn.argmax(on_gpu(x))
    assert got.device == GPU and got.dtype == sn.DType.I32 and got.shape == shape[:-1]
    got = got.numpy()
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1).astype(np.int32))
    cpu = cpu_argmax_or_none(x)
    if cpu is not None:
        np.testing.assert_array_equal(got, cpu)


@gpu_only
def test_argmax_gpu_ties_and_specials(rng):
    V = VOCAB
    rows = []
    # Planted ties: the maximum appears at several random positions; the first must win.
    for _ in range(6):
        r = rng.standard_normal(V).astype(np.float32)
        pos = np.sort(rng.choice(V, size=rng.integers(2, 6), replace=False))
        r[pos] = r.max() + 1.0
        rows.append(r)
    rows.append(np.full(V, 3.5, np.float32))  # all equal -> 0
    rows.append(np.full(V, -np.inf, np.float32))  # all -inf -> 0
    r = np.full(V, -np.inf, np.float32)
    r[V - 1] = -1e38
    rows.append(r)  # the only finite value is last
    r = rng.standard_normal(V).astype(np.float32)
    r[[100, 5000, 200000]] = np.nan
    rows.append(r)  # NaN counts as the maximum: first NaN (numpy)
    r = np.zeros(V, np.float32)
    r[:10] = -0.0
    rows.append(r)  # -0.0 == +0.0: index 0
    x = np.stack(rows)
    got = sn.argmax(on_gpu(x)).numpy()
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1).astype(np.int32))
    # Each row alone gives the same answer (independent of the number of rows).
    for i in range(len(rows)):
        assert sn.argmax(on_gpu(x[i : i + 1])).numpy()[0] == got[i]
