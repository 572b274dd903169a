"""KV cache writes and attention against float64 numpy references.

Visibility rule (specd.native.attention docstring; masks from drafters.md §3.3, spec-loop.md tree
verify): key j visible to query i iff mask[i, j] != 0 (if given), j <= q_pos[i] (if causal) and
j > q_pos[i] - window (if window). The reference reads the cache through its dequantized values
(float16 -> float64; Q8_0 via gguf.quants.dequantize on the raw bytes), so it checks the attention
math, not the cache rounding.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

import specd.native as sn

# F32 scores/softmax/accumulation over d <= 128 products vs float64: measured <= 1.2e-6 of the V
# scale over 40 seeds (scores of a few units); the output is a convex combination of V rows, so
# compare against the V scale.
TOL = 3e-6
DTYPES = ["F32", "F16", "Q8_0"]


class Cache:
    """A KV cache in one dtype plus a float64 view of its stored values for the reference."""

    def __init__(self, capacity, hkv, d, dtype):
        self.dtype = dtype
        if dtype == "F32":
            self.raw = np.zeros((capacity, hkv, d), np.float32)
            self.tensor = self.raw
        elif dtype == "F16":
            self.raw = np.zeros((capacity, hkv, d), np.float16)
            self.tensor = self.raw
        else:
            self.raw = np.zeros((capacity, hkv, d // 32 * 34), np.uint8)
            self.tensor = sn.Tensor(self.raw, sn.DType.Q8_0)

    def write(self, x, rows):
        sn.kv_write(self.tensor, x, np.asarray(rows, np.int32))

    def values(self):
        if self.dtype == "Q8_0":
            return dequantize(self.raw, QT.Q8_0).astype(np.float64)
        return self.raw.astype(np.float64)


def visible(n, kv_len, q_pos, causal, window, mask):
    j = np.arange(kv_len)[None, :]
    p = np.asarray(q_pos, np.int64)[:, None]
    vis = np.ones((n, kv_len), bool)
    if mask is not None:
        vis &= mask != 0
    if causal:
        vis &= j <= p
    if window:
        vis &= j > p - window
    return vis


def attn_ref(q, K, V, kv_len, q_pos, causal=True, window=0, mask=None, scale=None):
    n, hq, d = q.shape
    hkv = K.shape[1]
    r = hq // hkv
    scale = 1 / np.sqrt(d) if scale is None else scale
    vis = visible(n, kv_len, q_pos, causal, window, mask)
    out = np.zeros((n, hq, d))
    for h in range(hq):
        k = K[:kv_len, h // r]  # [kv_len, d]
        v = V[:kv_len, h // r]
        s = q[:, h].astype(np.float64) @ k.T * scale  # [n, kv_len]
        s = np.where(vis, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        den = p.sum(axis=1, keepdims=True)
        out[:, h] = np.where(den > 0, (p @ v) / np.where(den > 0, den, 1), 0)
    return out


def check(y, ref, V, tol=TOL):
    y = y.numpy()
    scale = max(np.abs(V).max(), 1e-30)
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * scale)


def filled(rng, capacity, hkv, d, dtype, kv_len):
    kc, vc = Cache(capacity, hkv, d, dtype), Cache(capacity, hkv, d, dtype)
    kc.write(rng.standard_normal((kv_len, hkv, d)).astype(np.float32), np.arange(kv_len))
    vc.write(rng.standard_normal((kv_len, hkv, d)).astype(np.float32), np.arange(kv_len))
    return kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_codecs(rng, dtype):
    c = Cache(10, 3, 64, dtype)
    x = rng.standard_normal((4, 3, 64)).astype(np.float32)
    rows = np.array([7, 0, 9, 3])
    c.write(x, rows)
    if dtype == "Q8_0":
        np.testing.assert_array_equal(c.raw[rows], quantize(x, QT.Q8_0))
    else:
        np.testing.assert_array_equal(c.raw[rows], x.astype(c.raw.dtype))
    untouched = np.setdiff1d(np.arange(10), rows)
    assert not c.raw[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,r", [(2, 1), (2, 2), (1, 3), (2, 6)])
def test_causal_prefill(rng, dtype, hkv, r):
    n, d = 37, 64
    kc, vc = filled(rng, 40, hkv, d, dtype, n)
    q = rng.standard_normal((n, hkv * r, d)).astype(np.float32)
    pos = np.arange(n, dtype=np.int32)
    y = sn.attention(q, kc.tensor, vc.tensor, n, pos)
    check(y, attn_ref(q, kc.values(), vc.values(), n, pos), vc.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_verify_long_cache(rng, dtype):
    hkv, r, d, kv_len = 2, 3, 128, 300
    kc, vc = filled(rng, 320, hkv, d, dtype, kv_len)
    for n in (1, 5):
        q = rng.standard_normal((n, hkv * r, d)).astype(np.float32) * 3  # peaky softmax
        pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
        y = sn.attention(q, kc.tensor, vc.tensor, kv_len, pos)
        check(y, attn_ref(q, kc.values(), vc.values(), kv_len, pos), vc.values())


def test_decode_only_reads_kv_len_rows(rng):
    kc, vc = filled(rng, 64, 1, 32, "F32", 64)
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    pos = np.array([100], np.int32)  # causal bound beyond kv_len: all kv_len rows visible
    y = sn.attention(q, kc.tensor, vc.tensor, 20, pos)
    check(y, attn_ref(q, kc.values(), vc.values(), 20, pos), vc.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_mask(rng, dtype):
    # Committed prefix of c rows, then a draft tree of 7 nodes stored at rows c..c+6.
    c, hkv, r, d = 21, 2, 2, 64
    parent = [-1, 0, 0, 1, 1, 2, 5]
    depth = [0, 1, 1, 2, 2, 2, 3]
    n = len(parent)
    kc, vc = filled(rng, 32, hkv, d, dtype, c + n)
    mask = np.zeros((n, c + n), np.int32)
    mask[:, :c] = 1
    for i in range(n):
        a = i
        while a >= 0:
            mask[i, c + a] = 1
            a = parent[a]
    pos = (c + np.array(depth)).astype(np.int32)
    q = rng.standard_normal((n, hkv * r, d)).astype(np.float32)
    y = sn.attention(q, kc.tensor, vc.tensor, c + n, pos, causal=False, mask=mask)
    check(y, attn_ref(q, kc.values(), vc.values(), c + n, pos, causal=False, mask=mask), vc.values())


@pytest.mark.parametrize("causal", [True, False])
def test_window(rng, causal):
    kv_len, hkv, r, d, w = 150, 2, 3, 64, 8
    kc, vc = filled(rng, 160, hkv, d, "F32", kv_len)
    q = rng.standard_normal((kv_len, hkv * r, d)).astype(np.float32)
    pos = np.arange(kv_len, dtype=np.int32)
    y = sn.attention(q, kc.tensor, vc.tensor, kv_len, pos, causal=causal, window=w)
    check(y, attn_ref(q, kc.values(), vc.values(), kv_len, pos, causal, w), vc.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_bidirectional_drafter_block(rng, dtype):
    ctx, block, hkv, r, d = 45, 16, 1, 6, 128
    kc, vc = filled(rng, 64, hkv, d, dtype, ctx + block)
    q = rng.standard_normal((block, hkv * r, d)).astype(np.float32)
    pos = np.arange(ctx, ctx + block, dtype=np.int32)
    y = sn.attention(q, kc.tensor, vc.tensor, ctx + block, pos, causal=False)
    check(y, attn_ref(q, kc.values(), vc.values(), ctx + block, pos, False), vc.values())
    y = sn.attention(q, kc.tensor, vc.tensor, ctx + block, pos, causal=False, window=20)
    check(y, attn_ref(q, kc.values(), vc.values(), ctx + block, pos, False, 20), vc.values())


def test_explicit_scale_and_large_scores(rng):
    # Scores spanning hundreds of units across many 64-key chunks exercise the running max.
    kv_len = 700
    kc, vc = filled(rng, kv_len, 1, 32, "F32", kv_len)
    kc.raw[:kv_len] *= np.linspace(0.1, 4, kv_len, dtype=np.float32)[:, None, None]
    q = rng.standard_normal((3, 2, 32)).astype(np.float32) * 5
    pos = np.array([kv_len - 1, 400, 64], np.int32)
    y = sn.attention(q, kc.tensor, vc.tensor, kv_len, pos, scale=0.5)
    # Scores reach ~60 here; their F32 rounding (~60 * 6e-8) shifts softmax weights by ~4e-6.
    check(y, attn_ref(q, kc.values(), vc.values(), kv_len, pos, scale=0.5), vc.values(), tol=1e-5)


def test_no_visible_key_gives_zeros(rng):
    kc, vc = filled(rng, 16, 1, 32, "F32", 16)
    q = rng.standard_normal((3, 2, 32)).astype(np.float32)
    mask = np.ones((3, 16), np.int32)
    mask[1] = 0
    y = sn.attention(q, kc.tensor, vc.tensor, 16, np.full(3, 15, np.int32), mask=mask).numpy()
    assert np.all(y[1] == 0) and np.isfinite(y).all() and np.abs(y[0]).max() > 0
    y0 = sn.attention(q, kc.tensor, vc.tensor, 0, np.zeros(3, np.int32)).numpy()  # empty cache
    assert np.all(y0 == 0)


@pytest.mark.parametrize("dtype", ["F32", "Q8_0"])
def test_batch_and_thread_invariance(rng, dtype):
    kv_len, hkv, r, d = 200, 2, 3, 64
    kc, vc = filled(rng, 256, hkv, d, dtype, kv_len)
    n = 24
    q = rng.standard_normal((n, hkv * r, d)).astype(np.float32)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    full = sn.attention(q, kc.tensor, vc.tensor, kv_len, pos).numpy()
    for i in (0, 7, n - 1):
        one = sn.attention(q[i : i + 1], kc.tensor, vc.tensor, kv_len, pos[i : i + 1]).numpy()
        np.testing.assert_array_equal(one, full[i : i + 1])
    np.testing.assert_array_equal(sn.attention(q[5:17], kc.tensor, vc.tensor, kv_len, pos[5:17]).numpy(), full[5:17])
    threads = sn.num_threads()
    try:
        sn.set_num_threads(1)
        np.testing.assert_array_equal(sn.attention(q, kc.tensor, vc.tensor, kv_len, pos).numpy(), full)
    finally:
        sn.set_num_threads(threads)


def test_strided_query(rng):
    kc, vc = filled(rng, 32, 2, 64, "F32", 30)
    qg = rng.standard_normal((4, 4, 128)).astype(np.float32)
    q = qg[:, :, :64]  # query half of the per-head [q | gate] packing
    pos = np.arange(26, 30, dtype=np.int32)
    y = sn.attention(q, kc.tensor, vc.tensor, 30, pos)
    check(y, attn_ref(q, kc.values(), vc.values(), 30, pos), vc.values())


def test_bad_input():
    kc = np.zeros((8, 2, 32), np.float32)
    q = np.zeros((2, 4, 32), np.float32)
    pos = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple of cache KV heads \(2\)"):
        sn.attention(np.zeros((2, 3, 32), np.float32), kc, kc, 4, pos)
    with pytest.raises(ValueError, match=r"kv_len must be in \[0, capacity=8\]"):
        sn.attention(q, kc, kc, 9, pos)
    with pytest.raises(ValueError, match="head_dim 32 differs from q head_dim 16"):
        sn.attention(np.zeros((2, 4, 16), np.float32), kc, kc, 4, pos)
    with pytest.raises(ValueError, match="q_pos must be >= 0"):
        sn.attention(q, kc, kc, 4, np.array([0, -2], np.int32))
    with pytest.raises(ValueError, match="q_pos has 3 entries"):
        sn.attention(q, kc, kc, 4, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="window must be >= 0"):
        sn.attention(q, kc, kc, 4, pos, window=-1)
    with pytest.raises(ValueError, match=r"mask must have shape \[2, 4\]"):
        sn.attention(q, kc, kc, 4, pos, mask=np.ones((2, 5), np.int32))
    with pytest.raises(ValueError, match="mask must be I32"):
        sn.attention(q, kc, kc, 4, pos, mask=np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="k_cache and v_cache shapes differ"):
        sn.attention(q, kc, np.zeros((9, 2, 32), np.float32), 4, pos)
    with pytest.raises(ValueError, match="k_cache must be F32, F16 or Q8_0"):
        sn.attention(q, np.zeros((8, 2, 32), np.int32), kc, 4, pos)
    with pytest.raises(ValueError, match="scale must be finite"):
        sn.attention(q, kc, kc, 4, pos, scale=float("nan"))
    x = np.zeros((2, 2, 32), np.float32)
    with pytest.raises(ValueError, match=r"rows\[1\] = 8 is outside the cache \[0, 8\)"):
        sn.kv_write(kc, x, np.array([0, 8], np.int32))
    with pytest.raises(ValueError, match="is outside the cache"):
        sn.kv_write(kc, x, np.array([-1, 0], np.int32))
    with pytest.raises(ValueError, match="rows must be distinct"):
        sn.kv_write(kc, x, np.array([3, 3], np.int32))
    with pytest.raises(ValueError, match="x must be"):
        sn.kv_write(kc, np.zeros((2, 1, 32), np.float32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="cache must be contiguous"):
        sn.kv_write(np.zeros((8, 4, 32), np.float32)[:, ::2], x, np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="multiple of 32"):  # Q8_0 needs whole blocks per head
        sn.kv_write(sn.Tensor.zeros([8, 2, 48], sn.DType.Q8_0), np.zeros((2, 2, 48), np.float32),
                    np.array([0, 1], np.int32))
