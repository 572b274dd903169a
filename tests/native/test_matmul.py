"""matmul (y = x @ w.T) and embedding against float64 numpy with gguf.quants' dequantization.

Tolerance (matmul): the weights decode bit-exactly (test_quants.py), so the only error is the
float32 dot product. specd sums each output as 16 interleaved lane sums of ceil(in/16) terms (the
last group zero-padded) and a 4-level pairwise tree, so every product passes through at most
m = ceil(in/16) + 5 roundings (one more if the compiler does not fuse multiply-adds), and the
standard bound (Higham, Accuracy and Stability of Numerical Algorithms, §3.1) gives
    |y - y_exact| <= gamma_m * sum_k |x_k| |w_k|,   gamma_m = m u / (1 - m u),  u = 2^-24.
The float64 reference is exact to ~2^-53 relative, far inside this bound. Embedding is exact.
"""
import numpy as np
import pytest

import specd.native as sn
from quant_blocks import ALL_TYPES, BLOCK_TYPES, block_size, in_sizes, make_weight

SHAPES = [(1, 1), (3, 7), (17, 13), (4, 33)]  # (n, out)
U = 2.0**-24


def error_bound(x, w_ref):
    k = x.shape[1]
    m = -(-k // 16) + 5
    gamma = m * U / (1 - m * U)
    return gamma * (np.abs(x.astype(np.float64)) @ np.abs(w_ref.astype(np.float64)).T)


def check_matmul(x, w, w_ref):
    y = sn.matmul(x, w).numpy()
    ref = x.astype(np.float64) @ w_ref.astype(np.float64).T
    assert y.shape == ref.shape and y.dtype == np.float32
    err = np.abs(y - ref)
    bound = error_bound(x, w_ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    return y


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize("n,out", SHAPES)
def test_matmul(rng, name, n, out):
    for k in in_sizes(name):
        w, w_ref = make_weight(rng, name, out, k)
        x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10)).astype(np.float32)
        check_matmul(x, w, w_ref)


@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_wide(rng, name):
    """A model-sized width (in = 4097 for F32, 4096 otherwise) over several weight tiles."""
    k = 4097 if name == "F32" else 4096
    w, w_ref = make_weight(rng, name, 21, k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    check_matmul(x, w, w_ref)


def test_matmul_empty(rng):
    w, _ = make_weight(rng, "Q4_K", 5, 256)
    assert sn.matmul(np.zeros((0, 256), np.float32), w).numpy().shape == (0, 5)
    y = sn.matmul(np.ones((2, 0), np.float32), np.ones((3, 0), np.float32)).numpy()
    assert y.shape == (2, 3) and np.all(y == 0)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_matmul_batch_invariant(rng, name):
    """Row i of y is bitwise the same whatever rows share the call, and whatever the thread count."""
    k = 3 * block_size(name) if name in BLOCK_TYPES else 271  # 271 = 16 * 16 + 15: a long tail
    w, _ = make_weight(rng, name, 9, k)
    x = rng.standard_normal((11, k)).astype(np.float32)
    full = sn.matmul(x, w).numpy()
    for i in range(11):
        np.testing.assert_array_equal(sn.matmul(x[i : i + 1], w).numpy()[0], full[i])
    for start, count in [(0, 2), (1, 3), (2, 5), (3, 8)]:
        np.testing.assert_array_equal(sn.matmul(x[start : start + count], w).numpy(), full[start : start + count])
    try:
        sn.set_num_threads(1)
        np.testing.assert_array_equal(sn.matmul(x, w).numpy(), full)
    finally:
        sn.set_num_threads(0)


def test_matmul_bad_input(rng):
    w, _ = make_weight(rng, "Q4_K", 4, 256)
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match="matmul: x must have 2 dimensions, got 1"):
        sn.matmul(np.zeros(256, np.float32), w)
    with pytest.raises(ValueError, match="matmul: x has 512 columns but w \\(shape \\[out, in\\]\\) has 256"):
        sn.matmul(np.zeros((2, 512), np.float32), w)
    with pytest.raises(ValueError, match="matmul: x must be F32, got F16"):
        sn.matmul(x.astype(np.float16), w)
    with pytest.raises(ValueError, match="matmul: x has numpy dtype float64"):
        sn.matmul(x.astype(np.float64), w)
    # numpy arrays by dtype kind and size, in native byte order only
    for dt in (">f4", ">f2", ">i4"):
        with pytest.raises(ValueError, match=f"matmul: x has numpy dtype {dt}"):
            sn.matmul(x.astype(dt), w)
    with pytest.raises(ValueError, match="embedding: ids has numpy dtype >i4"):
        sn.embedding(w, np.zeros(2, ">i4"))
    np.testing.assert_array_equal(sn.embedding(w, np.arange(2, dtype=np.intc)).numpy(),
                                  sn.embedding(w, np.arange(2, dtype=np.int32)).numpy())
    with pytest.raises(ValueError, match="matmul: w must be a weight format .* got I32"):
        sn.matmul(x, np.zeros((3, 256), np.int32))
    with pytest.raises(ValueError, match="matmul: w must have 2 dimensions, got 3"):
        sn.matmul(x, np.zeros((1, 3, 256), np.float32))
    with pytest.raises(ValueError, match="matmul: x must be contiguous"):
        sn.matmul(np.zeros((2, 512), np.float32)[:, ::2], w)
    with pytest.raises(ValueError, match="matmul: w must be a specd Tensor or a numpy array"):
        sn.matmul(x, None)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_embedding(rng, name):
    h = 2 * block_size(name) if name in BLOCK_TYPES else 19
    vocab = 37
    w, w_ref = make_weight(rng, name, vocab, h)
    ids = np.concatenate([[0, vocab - 1], rng.integers(0, vocab, 20), [5, 5]]).astype(np.int32)
    y = sn.embedding(w, ids).numpy()
    np.testing.assert_array_equal(y.view(np.uint32), w_ref[ids].view(np.uint32))
    y_tensor_ids = sn.embedding(w, sn.Tensor(ids)).numpy()
    np.testing.assert_array_equal(y_tensor_ids, y)
    assert sn.embedding(w, np.zeros(0, np.int32)).numpy().shape == (0, h)


def test_embedding_bad_input(rng):
    w, _ = make_weight(rng, "Q6_K", 10, 256)
    with pytest.raises(ValueError, match="embedding: ids\\[2\\] = 10 is out of range for 10 rows of w"):
        sn.embedding(w, np.array([0, 9, 10], np.int32))
    with pytest.raises(ValueError, match="embedding: ids\\[1\\] = -1 is out of range"):
        sn.embedding(w, np.array([3, -1], np.int32))
    with pytest.raises(ValueError, match="embedding: ids has numpy dtype int64"):
        sn.embedding(w, np.array([1, 2], np.int64))
    with pytest.raises(ValueError, match="embedding: ids must be I32, got F32"):
        sn.embedding(w, np.array([1, 2], np.float32))
    with pytest.raises(ValueError, match="embedding: ids must have 1 dimensions, got 2"):
        sn.embedding(w, np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="embedding: w must have 2 dimensions, got 1"):
        sn.embedding(np.zeros(8, np.float32), np.zeros(1, np.int32))


def test_matmul_group(rng):
    """sn.matmul_group on the CPU: one result per weight, each equal to its own sn.matmul; bad input
    raises ValueError (the GPU path: tests/gpu/test_gpu_matmul.py)."""
    x = rng.standard_normal((5, 256)).astype(np.float32)
    ws = [make_weight(rng, name, out, 256)[0] for name, out in (("Q8_0", 7), ("IQ4_XS", 3), ("F32", 11))]
    ys = sn.matmul_group(x, ws)
    assert [y.shape for y in ys] == [(5, 7), (5, 3), (5, 11)]
    for w, y in zip(ws, ys):
        np.testing.assert_array_equal(y.numpy(), sn.matmul(x, w).numpy())
    with pytest.raises(ValueError, match="no weights"):
        sn.matmul_group(x, [])
    with pytest.raises(ValueError):
        sn.matmul_group(x, [make_weight(rng, "Q8_0", 4, 512)[0]])


def bits(t):
    return (t.numpy() if isinstance(t, sn.Tensor) else t).view(np.uint32)


@pytest.mark.parametrize("n", [1, 3, 17])
def test_rms_norm_matmul_and_swiglu_matmul_equal_their_compositions(rng, n):
    """The fused projections on the CPU (the GPU kernels: tests/gpu/test_gpu_matmul.py) are the
    compositions bit for bit: rms_norm_matmul = matmul_group(rms_norm(...)) with and without a
    residual and a norm weight; swiglu_matmul = matmul_group(swiglu(gate, up))."""
    d = 256
    x, r, g, u = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(4))
    nw = sn.Tensor((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    ws = [make_weight(rng, name, out, d)[0] for name, out in (("Q8_0", 7), ("IQ4_XS", 3), ("F32", 5))]
    for weight, residual in ((nw, None), (nw, r), (None, r), (None, None)):
        ys, h = sn.rms_norm_matmul(x, weight, 1e-6, ws, residual=residual)
        ref = sn.rms_norm(x, weight, 1e-6, residual=residual) if residual is not None else \
            (sn.rms_norm(x, weight, 1e-6), x)
        assert np.array_equal(bits(h), bits(ref[1]))
        for y, want in zip(ys, sn.matmul_group(ref[0], ws)):
            assert np.array_equal(bits(y), bits(want))
    for y, want in zip(sn.swiglu_matmul(g, u, ws), sn.matmul_group(sn.swiglu(g, u), ws)):
        assert np.array_equal(bits(y), bits(want))


@pytest.mark.parametrize("n", [0, 1, 3, 17])
def test_rms_norm_gated_matmul_on_the_cpu(rng, n):
    """rms_norm_gated_matmul on the CPU (the GPU's fused kernel: tests/gpu/test_gpu_matmul.py) is
    rms_norm_gated then matmul_group of the [n, heads * d] view bit for bit, and within float32 rounding of
    float64 numpy on the gguf-dequantized weights: y = x / rms(x) * w * silu(z) over each group of d
    (qwen35-target.md §6.5 step 8), then y @ W^T."""
    heads, d = 4, 128
    x, z = (rng.standard_normal((n, heads, d)).astype(np.float32) for _ in range(2))
    nw = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    made = [make_weight(rng, name, out, heads * d) for name, out in (("Q8_0", 7), ("IQ4_XS", 3), ("F32", 5))]
    ws = [w for w, _ in made]
    for weight in (sn.Tensor(nw), None):
        ys = sn.rms_norm_gated_matmul(x, weight, 1e-6, z, ws)
        u = sn.rms_norm_gated(x, weight, 1e-6, z).numpy().reshape(n, heads * d)
        x64, z64 = x.astype(np.float64), z.astype(np.float64)
        y64 = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * (nw if weight is not None else 1.0)
        y64 = (y64 * z64 / (1 + np.exp(-z64))).reshape(n, heads * d)
        for y, want, (_, wref) in zip(ys, sn.matmul_group(u, ws), made):
            assert y.shape == (n, wref.shape[0]) and np.array_equal(bits(y), bits(want))
            ref = y64 @ wref.astype(np.float64).T
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4 * (np.abs(ref).max() if n else 1))


@pytest.mark.parametrize("n", [0, 1, 3, 17])
def test_mul_sigmoid_matmul_on_the_cpu(rng, n):
    """mul_sigmoid_matmul on the CPU (the GPU's fused split: tests/gpu/test_gpu_matmul.py) is mul_sigmoid then
    matmul_group of the [n, heads * d] view bit for bit, with the gate a strided view (qg's gate half), and
    within float32 rounding of float64 numpy: (a * sigmoid(gate)) @ W^T (qwen35-target.md §6.3)."""
    heads, d = 2, 128
    a = rng.standard_normal((n, heads, d)).astype(np.float32)
    qg = (3 * rng.standard_normal((n, heads, 2 * d))).astype(np.float32)
    gate = qg[..., d:]
    made = [make_weight(rng, name, out, heads * d) for name, out in (("Q8_0", 7), ("IQ4_XS", 3), ("F32", 5))]
    ws = [w for w, _ in made]
    ys = sn.mul_sigmoid_matmul(a, gate, ws)
    u = sn.mul_sigmoid(a, gate).numpy().reshape(n, heads * d)
    y64 = (a.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64)))).reshape(n, heads * d)
    for y, want, (_, wref) in zip(ys, sn.matmul_group(u, ws), made):
        assert y.shape == (n, wref.shape[0]) and np.array_equal(bits(y), bits(want))
        ref = y64 @ wref.astype(np.float64).T
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4 * (np.abs(ref).max() if n else 1))


def test_fused_matmul_bad_input(rng):
    x = rng.standard_normal((2, 256)).astype(np.float32)
    w = make_weight(rng, "Q8_0", 4, 256)[0]
    with pytest.raises(ValueError, match="rms_norm_matmul: no weights"):
        sn.rms_norm_matmul(x, None, 1e-6, [])
    with pytest.raises(ValueError, match="residual"):
        sn.rms_norm_matmul(x, None, 1e-6, [w], residual=np.zeros((2, 128), np.float32))
    with pytest.raises(ValueError, match=r"rms_norm_matmul: ws\[0\]"):
        sn.rms_norm_matmul(x, None, 1e-6, [make_weight(rng, "Q8_0", 4, 512)[0]])
    with pytest.raises(ValueError, match="swiglu_matmul: no weights"):
        sn.swiglu_matmul(x, x, [])
    with pytest.raises(ValueError):
        sn.swiglu_matmul(x, np.zeros((2, 128), np.float32), [w])
    x3 = rng.standard_normal((2, 2, 128)).astype(np.float32)
    with pytest.raises(ValueError, match=r"rms_norm_gated_matmul: x must be \[n, groups, d\]"):
        sn.rms_norm_gated_matmul(x, None, 1e-6, x, [w])
    with pytest.raises(ValueError, match="rms_norm_gated_matmul: no weights"):
        sn.rms_norm_gated_matmul(x3, None, 1e-6, x3, [])
    with pytest.raises(ValueError, match="rms_norm_gated_matmul: z"):
        sn.rms_norm_gated_matmul(x3, None, 1e-6, x3[:, :1], [w])
    with pytest.raises(ValueError, match="rms_norm_gated_matmul: weight"):
        sn.rms_norm_gated_matmul(x3, np.ones(64, np.float32), 1e-6, x3, [w])
    with pytest.raises(ValueError, match=r"mul_sigmoid_matmul: a must be \[n, \.\.\., d\]"):
        sn.mul_sigmoid_matmul(x[0], x[0], [w])
    with pytest.raises(ValueError, match="mul_sigmoid_matmul: no weights"):
        sn.mul_sigmoid_matmul(x3, x3, [])
    with pytest.raises(ValueError, match="mul_sigmoid_matmul: a and gate must have the same shape"):
        sn.mul_sigmoid_matmul(x3, x3[:, :1], [w])
    with pytest.raises(ValueError, match="mul_sigmoid_matmul: gate must be F32"):
        sn.mul_sigmoid_matmul(x3, x3.astype(np.int32), [w])


def test_sum_partials_on_the_cpu(rng):
    """sum_partials adds split-K partials [S, ...] in order, each add rounded once in float32 (numpy's left
    fold of float32 arrays), for S = 1 (part 0 itself), 2, 5, 17 and parts of 1..3 dimensions; bad partials
    raise ValueError naming the op."""
    for s, shape in ((1, (3, 8)), (2, (5,)), (5, (2, 3, 4)), (17, (1, 5120))):
        p = (rng.standard_normal((s,) + shape) * 10.0 ** rng.integers(-3, 4, (s,) + shape)).astype(np.float32)
        want = p[0].copy()
        for k in range(1, s):
            want = want + p[k]
        got = sn.sum_partials(p)
        assert got.shape == shape and np.array_equal(bits(got), want.view(np.uint32)), (s, shape)
    with pytest.raises(ValueError, match=r"sum_partials: p must be split-K partials \[S, \.\.\.\]"):
        sn.sum_partials(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="sum_partials: p must hold 1 .. 65536 partials, got 0"):
        sn.sum_partials(np.zeros((0, 4), np.float32))
    with pytest.raises(ValueError, match="sum_partials"):
        sn.sum_partials(np.zeros((2, 4), np.int32))


@pytest.mark.parametrize("n", [1, 3, 17])
def test_fused_matmuls_hand_over_partials_on_the_cpu(rng, n):
    """partials=True on the CPU gives each output as its one part [1, n, out] (the output bit for bit), and
    in_partials=True takes x (rms_norm_matmul) or gate and up (swiglu_matmul) as partials [S, n, d]: the
    results equal the ops on sum_partials of them bit for bit; bad partials raise ValueError naming the op."""
    d, heads = 256, 2
    ws = [make_weight(rng, name, out, d)[0] for name, out in (("Q8_0", 7), ("IQ4_XS", 3), ("F32", 5))]
    nw = sn.Tensor((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    p, pg, pu = (rng.standard_normal((4, n, d)).astype(np.float32) for _ in range(3))
    r, a, z = (rng.standard_normal(shape).astype(np.float32) for shape in ((n, d), (n, heads, d // heads),
                                                                         (n, heads, d // heads)))
    x = sn.sum_partials(p).numpy()
    for residual in (r, None):
        ys, h = sn.rms_norm_matmul(p, nw, 1e-6, ws, residual=residual, partials=True, in_partials=True)
        ys_ref, h_ref = sn.rms_norm_matmul(x, nw, 1e-6, ws, residual=residual)
        assert np.array_equal(bits(h), bits(h_ref))
        for y, want in zip(ys, ys_ref):
            assert y.shape == (1,) + want.shape and np.array_equal(bits(y)[0], bits(want))
    fused = sn.swiglu_matmul(pg, pu, ws, partials=True, in_partials=True)
    for y, want in zip(fused, sn.swiglu_matmul(sn.sum_partials(pg), sn.sum_partials(pu), ws)):
        assert y.shape == (1,) + want.shape and np.array_equal(bits(y)[0], bits(want))
    for y, want in zip(sn.mul_sigmoid_matmul(a, z, ws, partials=True), sn.mul_sigmoid_matmul(a, z, ws)):
        assert y.shape == (1,) + want.shape and np.array_equal(bits(y)[0], bits(want))
    for y, want in zip(sn.rms_norm_gated_matmul(a, None, 1e-6, z, ws, partials=True),
                       sn.rms_norm_gated_matmul(a, None, 1e-6, z, ws)):
        assert y.shape == (1,) + want.shape and np.array_equal(bits(y)[0], bits(want))
    with pytest.raises(ValueError, match=r"rms_norm_matmul: x must be split-K partials"):
        sn.rms_norm_matmul(p[0, 0], None, 1e-6, ws, in_partials=True)
    # a matrix [n, d] itself is not read as n partials of one row
    with pytest.raises(ValueError, match=r"rms_norm_matmul: x must be split-K partials \[S, n, d\].*got 2 dim"):
        sn.rms_norm_matmul(p[0], None, 1e-6, ws, in_partials=True)
    with pytest.raises(ValueError, match=r"swiglu_matmul: gate must be split-K partials \[S, n, d\].*got 2 dim"):
        sn.swiglu_matmul(pg[0], pu[0], ws, in_partials=True)
    with pytest.raises(ValueError, match="residual shape differs"):
        sn.rms_norm_matmul(p, None, 1e-6, ws, residual=r[:, :128].copy(), in_partials=True)
    with pytest.raises(ValueError, match="swiglu_matmul: gate must hold 1 .. 65536 partials"):
        sn.swiglu_matmul(pg[:0], pu[:0], ws, in_partials=True)
