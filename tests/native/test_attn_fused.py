"""The gated attention's fused ops on the CPU, bit for bit against the compositions they replace in
Qwen35Model._attention (qwen35-target.md §6.3): qk_norm_rope = rope_neox(rms_norm(.)) of the q half
of qg and of k (gate: a view of qg's other half), with its KV cache write = kv_write(k_cache, k, rows)
and kv_write(v_cache, v, rows), mul_sigmoid = mul(a, sigmoid(gate))."""
import gc

import numpy as np
import pytest

import specd.native as sn

SPECIAL = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e4, -1e4, 20.0, 88.7, -88.7, -100, 1e-30], np.float32)


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def qk_inputs(rng, w, nh, nkv, hd):
    """qg [w, nh, 2 hd], k [w, nkv, hd], the two norm weights and positions (not contiguous, may repeat
    as in a tree verify)."""
    qg = (rng.standard_normal((w, nh, 2 * hd)) * rng.uniform(0.01, 100)).astype(np.float32)
    k = (rng.standard_normal((w, nkv, hd)) * rng.uniform(0.01, 100)).astype(np.float32)
    qw, kw = (rng.standard_normal(hd).astype(np.float32) for _ in range(2))
    pos = rng.integers(0, 300000, w).astype(np.int32)
    return qg, k, qw, kw, pos


def composed_qk(qg, k, qw, kw, pos, n_rot, theta, eps):
    hd = k.shape[-1]
    q = sn.rope_neox(sn.rms_norm(np.ascontiguousarray(qg[..., :hd]), qw, eps), pos, n_rot, theta).numpy()
    return q, sn.rope_neox(sn.rms_norm(k, kw, eps), pos, n_rot, theta).numpy()


def check_qk(qg, k, qw, kw, pos, n_rot, theta=1e7, eps=1e-6):
    q, gate, ko = sn.qk_norm_rope(qg, k, qw, kw, pos, n_rot, theta, eps)
    want_q, want_k = composed_qk(qg, k, qw, kw, pos, n_rot, theta, eps)
    assert_bits(q.numpy(), want_q)
    assert_bits(ko.numpy(), want_k)
    g = gate.numpy()
    assert g.shape == want_q.shape and (g.size == 0 or np.shares_memory(g, qg))  # a view, not a copy
    np.testing.assert_array_equal(g, qg[..., k.shape[-1]:])
    return q.numpy(), ko.numpy()


@pytest.mark.parametrize("w", range(1, 18))
def test_qk_norm_rope_27b_shapes(rng, w):
    check_qk(*qk_inputs(rng, w, 24, 4, 256), 64)


@pytest.mark.parametrize("w,nh,nkv,hd,n_rot", [(1, 1, 1, 2, 2), (3, 5, 3, 10, 4), (7, 3, 1, 6, 0), (2, 6, 2, 12, 12),
                                               (17, 2, 2, 130, 130), (5, 7, 7, 66, 32), (0, 3, 1, 8, 8)])
def test_qk_norm_rope_odd_shapes(rng, w, nh, nkv, hd, n_rot):
    check_qk(*qk_inputs(rng, w, nh, nkv, hd), n_rot, theta=1e4)


def test_qk_norm_rope_special_values(rng):
    """Zero heads (scale 1/sqrt(eps); inf * 0 with eps 0), inf / NaN inside a head, huge positions."""
    qg, k, qw, kw, pos = qk_inputs(rng, 4, 3, 2, 8)
    qg[0, 0], k[1, 1] = 0, 0
    qg[2, 1, 3], qg[3, 2, 12], k[2, 0, 5] = np.inf, np.nan, -np.inf
    pos[:] = [0, 2**31 - 1, 5, 1_000_000]
    for eps in (0.0, 1e-6):
        check_qk(qg, k, qw, kw, pos, 8, eps=eps)


def test_qk_norm_rope_tensors_and_batch_invariance(rng):
    """sn.Tensor inputs (the model's tensor-ops path) give the same bits, and each row alone equals the
    batch."""
    qg, k, qw, kw, pos = qk_inputs(rng, 9, 4, 2, 64)
    q, gate, ko = sn.qk_norm_rope(sn.Tensor(qg).reshape([9, 4, 128]), sn.Tensor(k), sn.Tensor(qw), sn.Tensor(kw),
                                  sn.Tensor(pos), 32, 1e7, 1e-6)
    full_q, full_k = check_qk(qg, k, qw, kw, pos, 32)
    assert_bits(q.numpy(), full_q)
    assert_bits(ko.numpy(), full_k)
    for i in range(9):
        qi, _, ki = sn.qk_norm_rope(qg[i : i + 1], k[i : i + 1], qw, kw, pos[i : i + 1], 32, 1e7, 1e-6)
        assert_bits(qi.numpy(), full_q[i : i + 1])
        assert_bits(ki.numpy(), full_k[i : i + 1])


def test_qk_gate_keeps_qg_alive(rng):
    def gate_only():
        qg = np.full((2, 3, 8), 7.0, np.float32)
        return sn.qk_norm_rope(qg, np.ones((2, 1, 4), np.float32), np.ones(4, np.float32), np.ones(4, np.float32),
                               np.zeros(2, np.int32), 4, 1e4, 1e-6)[1]

    gate = gate_only()
    gc.collect()
    np.testing.assert_array_equal(gate.numpy(), np.full((2, 3, 4), 7.0, np.float32))


def test_qk_norm_rope_bad_inputs():
    qg, k, v, pos = np.ones((2, 3, 8), np.float32), np.ones((2, 1, 4), np.float32), np.ones(4, np.float32), \
        np.zeros(2, np.int32)
    cases = [
        ((qg.astype(np.float16), k, v, v, pos, 4, 1e4, 1e-6), "qk_norm_rope: qg must be F32"),
        ((np.ones((2, 3, 16), np.float32)[..., ::2], k, v, v, pos, 4, 1e4, 1e-6), "qg must be contiguous"),
        ((np.ones((6, 8), np.float32), k, v, v, pos, 4, 1e4, 1e-6), "qg must have 3 dimensions"),
        ((qg, np.ones((2, 4), np.float32), v, v, pos, 4, 1e4, 1e-6), "k must have 3 dimensions"),
        ((qg, k.astype(np.float16), v, v, pos, 4, 1e4, 1e-6), "k must be F32"),
        ((np.ones((2, 3, 6), np.float32), k, v, v, pos, 4, 1e4, 1e-6), r"qg must be \[w, heads, 2 \* head_dim\]"),
        ((np.ones((3, 3, 8), np.float32), k, v, v, pos, 4, 1e4, 1e-6), r"qg must be \[w, heads, 2 \* head_dim\]"),
        ((qg, k, np.ones(5, np.float32), v, pos, 4, 1e4, 1e-6), "q_norm_w has 5 elements, heads have 4"),
        ((qg, k, v, v.astype(np.float16), pos, 4, 1e4, 1e-6), "k_norm_w must be F32"),
        ((qg, k, v, np.ones(8, np.float32), pos, 4, 1e4, 1e-6), "k_norm_w has 8 elements"),
        ((qg, k, v, v, pos.astype(np.float32), 4, 1e4, 1e-6), "positions must be I32"),
        ((qg, k, v, v, np.zeros(3, np.int32), 4, 1e4, 1e-6), "positions has 3 entries, qg and k have 2 rows"),
        ((qg, k, v, v, np.array([0, -1], np.int32), 4, 1e4, 1e-6), "positions must be >= 0, got -1 at index 1"),
        ((qg, k, v, v, pos, 3, 1e4, 1e-6), "qk_norm_rope: n_rot must be even"),
        ((qg, k, v, v, pos, -2, 1e4, 1e-6), "n_rot must be even and >= 0"),
        ((qg, k, v, v, pos, 6, 1e4, 1e-6), r"n_rot must be <= head_dim \(4\)"),
        ((qg, k, v, v, pos, 4, 0.0, 1e-6), "qk_norm_rope: theta must be finite and > 0"),
        ((qg, k, v, v, pos, 4, float("nan"), 1e-6), "theta must be finite"),
        ((qg, k, v, v, pos, 4, 1e4, -1.0), "qk_norm_rope: eps must be finite and >= 0"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.qk_norm_rope(*args)


# ---------------------------------------------------------------- qk_norm_rope's KV cache write

KV_DTYPES = ["F32", "F16", "Q8_0"]
ROW_BYTES = {"F32": lambda hd: 4 * hd, "F16": lambda hd: 2 * hd, "Q8_0": lambda hd: hd // 32 * 34}


def random_cache(rng, cap, nkv, hd, dtype):
    """Raw bytes of a cache [cap, nkv, hd] of `dtype`, random (rows a call does not write keep them)."""
    return rng.integers(0, 256, (cap, nkv, ROW_BYTES[dtype](hd)), np.uint8)


def cache_arg(raw, dtype):
    """The cache argument over raw's bytes (zero-copy: the op writes into raw)."""
    if dtype == "Q8_0":
        return sn.Tensor(raw, sn.DType.Q8_0)
    return raw.view(np.float32 if dtype == "F32" else np.float16)


def kv_inputs(rng, w, nh, nkv, hd, cap):
    """qk_inputs, v [w, nkv, hd] (a few special values, an all-zero Q8_0 block) and distinct rows in any
    order (a tree verify's)."""
    qg, k, qw, kw, pos = qk_inputs(rng, w, nh, nkv, hd)
    v = (rng.standard_normal((w, nkv, hd)) * rng.uniform(0.01, 100)).astype(np.float32)
    if w:
        v.flat[rng.integers(0, v.size, 4)] = rng.choice(SPECIAL[3:], 4)  # finite: kv_write's contract
        v[0, 0, :32] = 0
    return qg, k, qw, kw, pos, v, rng.permutation(cap)[:w].astype(np.int32)


def composed_kv(qg, k, qw, kw, pos, v, rows, n_rot, kraw, kdt, vraw, vdt):
    """What Qwen35Model._attention ran before the fused write, into copies of the caches: (q, k, k bytes,
    v bytes)."""
    q, _, ko = sn.qk_norm_rope(qg, k, qw, kw, pos, n_rot, 1e7, 1e-6)
    kraw, vraw = kraw.copy(), vraw.copy()
    sn.kv_write(cache_arg(kraw, kdt), ko, rows)
    sn.kv_write(cache_arg(vraw, vdt), v, rows)
    return q.numpy(), ko.numpy(), kraw, vraw


CACHE_CASES = [
    # w, heads, kv_heads, head_dim, n_rot, capacity
    (1, 24, 4, 256, 64, 40),  # 27B decode
    (5, 24, 4, 256, 64, 40),  # verify
    (17, 4, 2, 64, 32, 17),  # every row of the cache
    (3, 5, 3, 96, 96, 8),
    (0, 3, 1, 32, 8, 4),
]
CACHE_DTYPES = [(d, d) for d in KV_DTYPES] + [("F16", "Q8_0"), ("Q8_0", "F32")]


@pytest.mark.parametrize("kdt,vdt", CACHE_DTYPES)
@pytest.mark.parametrize("case", CACHE_CASES)
def test_qk_norm_rope_cache_write_bitwise(rng, case, kdt, vdt):
    """q, k and every cache byte equal qk_norm_rope then kv_write(k_cache, k, rows) and
    kv_write(v_cache, v, rows), bit for bit; the rows not written keep their bytes."""
    w, nh, nkv, hd, n_rot, cap = case
    qg, k, qw, kw, pos, v, rows = kv_inputs(rng, w, nh, nkv, hd, cap)
    kraw, vraw = random_cache(rng, cap, nkv, hd, kdt), random_cache(rng, cap, nkv, hd, vdt)
    want_q, want_k, want_kc, want_vc = composed_kv(qg, k, qw, kw, pos, v, rows, n_rot, kraw, kdt, vraw, vdt)
    q, gate, ko = sn.qk_norm_rope(qg, k, qw, kw, pos, n_rot, 1e7, 1e-6, k_cache=cache_arg(kraw, kdt),
                                  v_cache=cache_arg(vraw, vdt), v=v, rows=rows)
    assert_bits(q.numpy(), want_q)
    assert_bits(ko.numpy(), want_k)
    np.testing.assert_array_equal(gate.numpy(), qg[..., hd:])
    np.testing.assert_array_equal(kraw, want_kc)
    np.testing.assert_array_equal(vraw, want_vc)


def test_qk_norm_rope_cache_write_tensors_and_rows_alone(rng):
    """sn.Tensor arguments (the model's tensor-ops path) write the same bytes, and each row written alone
    (a decode step at a time) equals the batch."""
    w, nh, nkv, hd, cap = 6, 4, 2, 64, 12
    qg, k, qw, kw, pos, v, rows = kv_inputs(rng, w, nh, nkv, hd, cap)
    kraw, vraw = random_cache(rng, cap, nkv, hd, "Q8_0"), random_cache(rng, cap, nkv, hd, "F16")
    _, _, want_kc, want_vc = composed_kv(qg, k, qw, kw, pos, v, rows, 32, kraw, "Q8_0", vraw, "F16")
    kt, vt = kraw.copy(), vraw.copy()
    sn.qk_norm_rope(sn.Tensor(qg), sn.Tensor(k), sn.Tensor(qw), sn.Tensor(kw), sn.Tensor(pos), 32, 1e7, 1e-6,
                    k_cache=cache_arg(kt, "Q8_0"), v_cache=sn.Tensor(cache_arg(vt, "F16")), v=sn.Tensor(v),
                    rows=sn.Tensor(rows))
    np.testing.assert_array_equal(kt, want_kc)
    np.testing.assert_array_equal(vt, want_vc)
    for i in range(w):
        sn.qk_norm_rope(qg[i : i + 1], k[i : i + 1], qw, kw, pos[i : i + 1], 32, 1e7, 1e-6,
                        k_cache=cache_arg(kraw, "Q8_0"), v_cache=cache_arg(vraw, "F16"), v=v[i : i + 1],
                        rows=rows[i : i + 1])
    np.testing.assert_array_equal(kraw, want_kc)
    np.testing.assert_array_equal(vraw, want_vc)


def test_qk_norm_rope_cache_write_bad_inputs(rng):
    """Every bad argument raises ValueError naming it before anything is written: no cache byte changes."""
    w, nh, nkv, hd, cap = 2, 3, 1, 32, 8
    qg, k, qw, kw, pos, v, _ = kv_inputs(rng, w, nh, nkv, hd, cap)
    kraw, vraw = random_cache(rng, cap, nkv, hd, "F16"), random_cache(rng, cap, nkv, hd, "Q8_0")
    kc, vc, rows = cache_arg(kraw, "F16"), cache_arg(vraw, "Q8_0"), np.array([5, 1], np.int32)
    f32c = np.zeros((cap, nkv, hd), np.float32)  # a cache some input lies in
    f32c.view(np.int32)[0, 0, :2] = [0, 1]
    read_only = np.zeros((cap, nkv, hd), np.float16)
    read_only.flags.writeable = False
    good = dict(k_cache=kc, v_cache=vc, v=v, rows=rows)
    cases = [
        (dict(k_cache=kc, v=v, rows=rows), "qk_norm_rope: k_cache, v_cache, v and rows must be given together"),
        (dict(rows=rows), "must be given together"),
        (dict(good, k_cache=np.zeros((cap, nkv, hd), np.int32)), "qk_norm_rope: k_cache must be F32, F16 or Q8_0"),
        (dict(good, v_cache=np.zeros((cap, nkv, 2 * hd), np.float16)[..., ::2]), "v_cache must be contiguous"),
        (dict(good, v_cache=np.zeros((cap, hd), np.float16)), "v_cache must have 3 dimensions"),
        (dict(good, k_cache=read_only), "k_cache is read-only"),
        (dict(good, v_cache=np.zeros((cap + 1, nkv, hd), np.float16)), "k_cache and v_cache shapes differ"),
        (dict(good, k_cache=np.zeros((cap, 2, hd), np.float16), v_cache=np.zeros((cap, 2, hd), np.float16)),
         r"k must be \[n, 2, 32\] to match the k_cache"),
        (dict(good, v=v.astype(np.float16)), "qk_norm_rope: v must be F32"),
        (dict(good, v=np.zeros((w, nkv, 2 * hd), np.float32)[..., ::2]), "v must be contiguous"),
        (dict(good, v=np.zeros((w + 1, nkv, hd), np.float32)), "v must have k's shape"),
        (dict(good, rows=rows.astype(np.float32)), "qk_norm_rope: rows must be I32"),
        (dict(good, rows=rows.reshape(2, 1)), "rows must have 1 dimensions"),
        (dict(good, rows=np.array([0, 1, 2], np.int32)), "rows has 3 entries, k has 2"),
        (dict(good, rows=np.array([0, 8], np.int32)), r"qk_norm_rope: rows\[1\] = 8 is outside the cache \[0, 8\)"),
        (dict(good, rows=np.array([-1, 0], np.int32)), r"rows\[0\] = -1 is outside the cache"),
        (dict(good, rows=np.array([3, 3], np.int32)), "qk_norm_rope: rows must be distinct"),
        (dict(good, v_cache=kc), "k_cache and v_cache must not overlap"),
        (dict(good, k_cache=vc), "k_cache and v_cache must not overlap"),  # Q8_0: whole rows of blocks
        (dict(good, k_cache=np.zeros_like(f32c), v_cache=f32c, v=f32c[cap - w :]),
         "v_cache must not overlap the inputs"),
        (dict(good, k_cache=f32c, v_cache=np.zeros_like(f32c), rows=f32c.view(np.int32)[0, 0, :2]),
         "k_cache must not overlap the inputs"),
    ]
    snapshot = [a.copy() for a in (kraw, vraw, f32c)]
    for kw_cache, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.qk_norm_rope(qg, k, qw, kw, pos, 4, 1e4, 1e-6, **kw_cache)
        for a, b in zip((kraw, vraw, f32c), snapshot):
            np.testing.assert_array_equal(a, b)
    # the op's own arguments are checked before the write as well
    for args, msg in [((qg, k, qw, kw, np.array([0, -1], np.int32), 4, 1e4, 1e-6), "positions must be >= 0"),
                      ((qg, k, qw, kw, pos, 3, 1e4, 1e-6), "n_rot must be even"),
                      ((qg, k, qw, kw[:4], pos, 4, 1e4, 1e-6), "k_norm_w has 4 elements")]:
        with pytest.raises(ValueError, match=msg):
            sn.qk_norm_rope(*args, **good)
        for a, b in zip((kraw, vraw), snapshot):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------ mul_sigmoid


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 257), (0, 4), (17, 24, 256)])
def test_mul_sigmoid_bitwise(rng, shape):
    a = (rng.standard_normal(shape) * 10).astype(np.float32)
    g = (rng.standard_normal(shape) * 20).astype(np.float32)
    for x in (a, g):
        if x.size:
            x.flat[rng.integers(0, x.size, 6)] = rng.choice(SPECIAL, 6)
    assert_bits(sn.mul_sigmoid(a, g).numpy(), sn.mul(a, sn.sigmoid(g)).numpy())


def test_mul_sigmoid_reads_the_gate_inside_qg(rng):
    """The model's use: gate is qk_norm_rope's view of qg (and any row-strided slice works on the CPU)."""
    w, nh, hd = 5, 6, 16
    qg = (rng.standard_normal((w, nh, 2 * hd)) * 10).astype(np.float32)
    gate = sn.qk_norm_rope(qg, np.ones((w, 1, hd), np.float32), np.ones(hd, np.float32), np.ones(hd, np.float32),
                           np.arange(w, dtype=np.int32), hd, 1e4, 1e-6)[1]
    a = rng.standard_normal((w, nh, hd)).astype(np.float32)
    want = sn.mul(a, sn.sigmoid(np.ascontiguousarray(qg[..., hd:]))).numpy()
    assert_bits(sn.mul_sigmoid(a, gate).numpy(), want)
    assert_bits(sn.mul_sigmoid(a, qg[..., hd:]).numpy(), want)


def test_mul_sigmoid_bad_inputs():
    a = np.ones((3, 4), np.float32)
    cases = [
        ((a, np.ones((4, 3), np.float32)), "mul_sigmoid: a and gate must have the same shape"),
        ((a, np.ones(4, np.float32)), "a and gate must have the same shape"),  # no broadcasting
        ((a.astype(np.float16), a), "mul_sigmoid: a must be F32"),
        ((a, a.astype(np.float16)), "mul_sigmoid: gate must be F32"),
        ((a, np.ones((3, 8), np.float32)[:, ::2]), "gate must have a contiguous last dimension"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.mul_sigmoid(*args)
