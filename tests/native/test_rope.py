"""NeoX partial RoPE and YaRN against float64 numpy references.

Plain RoPE: qwen35-target.md §6.4 (pair (i, i + n_rot/2), angle pos * theta^(-2i/n_rot), dims >= n_rot
untouched). YaRN: a float64 port of transformers' modeling_rope_utils._compute_yarn_parameters
(truncate=True) plus the attention factor folded into cos/sin, as the rotary embedding classes do.
"""
import math

import numpy as np
import pytest

import specd.native as sn

# Output is the F32 rounding of a double computation: half an ulp (6e-8 relative); measured 6.2e-8.
RTOL = 2.5e-7


def inv_freq_ref(n_rot, theta, factor=1.0, orig=0, beta_fast=32.0, beta_slow=1.0):
    inv = 1.0 / theta ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if factor == 1.0:
        return inv

    def corr_dim(rot):
        return n_rot * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), n_rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrap_factor = 1 - ramp
    return inv / factor * (1 - extrap_factor) + inv * extrap_factor


def rope_ref(x, pos, n_rot, inv_freq, mscale=1.0):
    x = x.astype(np.float64)
    y = x.copy()
    half = n_rot // 2
    ang = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [n, half]
    c = (np.cos(ang) * mscale)[:, None, :]
    s = (np.sin(ang) * mscale)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:n_rot]
    y[..., :half] = x0 * c - x1 * s
    y[..., half:n_rot] = x1 * c + x0 * s
    return y


def check(y, ref):
    y = y.numpy() if hasattr(y, "numpy") else y
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=RTOL * max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize(
    "n,heads,hd,n_rot",
    [(1, 1, 2, 2), (5, 3, 64, 16), (7, 5, 256, 64), (4, 7, 128, 128), (3, 1, 10, 0), (9, 24, 256, 64)],
)
def test_rope_plain(rng, n, heads, hd, n_rot):
    x = rng.standard_normal((n, heads, hd)).astype(np.float32)
    pos = rng.integers(0, 4096, n).astype(np.int32)
    y = sn.rope_neox(x, pos, n_rot, 1e7).numpy()
    check(y, rope_ref(x, pos, n_rot, inv_freq_ref(n_rot, 1e7)))
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])  # pass-through is a copy


def test_rope_large_positions(rng):
    x = rng.standard_normal((6, 3, 128)).astype(np.float32)
    pos = np.array([0, 1, 262143, 1_000_000, 50_000_000, 2**31 - 1], np.int32)
    y = sn.rope_neox(x, pos, 128, 10000.0)
    check(y, rope_ref(x, pos, 128, inv_freq_ref(128, 10000.0)))


def test_rope_position_zero_is_identity(rng):
    x = rng.standard_normal((2, 4, 64)).astype(np.float32)
    y = sn.rope_neox(x, np.zeros(2, np.int32), 64, 1e6).numpy()
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize(
    "n_rot,theta,factor,orig,bf,bs",
    [(128, 1e7, 32.0, 8192, 32.0, 1.0), (64, 1e7, 4.0, 32768, 32.0, 1.0), (128, 1e6, 8.0, 4096, 16.0, 2.0)],
)
def test_rope_yarn(rng, n_rot, theta, factor, orig, bf, bs):
    x = rng.standard_normal((5, 3, 128)).astype(np.float32)
    pos = np.array([0, 7, 8191, 20000, 20011], np.int32)  # includes positions beyond the original window
    y = sn.rope_neox(x, pos, n_rot, theta, yarn_factor=factor, yarn_original_context=orig,
                     yarn_beta_fast=bf, yarn_beta_slow=bs)
    mscale = 0.1 * math.log(factor) + 1.0
    check(y, rope_ref(x, pos, n_rot, inv_freq_ref(n_rot, theta, factor, orig, bf, bs), mscale))


def test_rope_yarn_attention_factor_override(rng):
    x = rng.standard_normal((3, 2, 128)).astype(np.float32)
    pos = np.array([3, 9000, 19999], np.int32)
    y = sn.rope_neox(x, pos, 128, 1e7, yarn_factor=32.0, yarn_original_context=8192, yarn_attention_factor=1.0)
    check(y, rope_ref(x, pos, 128, inv_freq_ref(128, 1e7, 32.0, 8192), 1.0))


@pytest.mark.oracle
def test_yarn_port_matches_transformers():
    """Cross-checks the float64 port above against transformers itself (float32 there)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.Qwen3Config(
        head_dim=128, hidden_size=512, num_attention_heads=4, max_position_embeddings=262144,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "factor": 32.0,
                         "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0},
    )
    inv, att = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    np.testing.assert_allclose(inv.numpy(), inv_freq_ref(128, 1e7, 32.0, 8192), rtol=1e-6)
    assert att == pytest.approx(0.1 * math.log(32.0) + 1.0)


def test_rope_strided_input_and_batch_invariance(rng):
    qg = rng.standard_normal((6, 4, 2 * 64)).astype(np.float32)
    q = qg[:, :, :64]  # per-head [q | gate] packing, sliced without a copy
    pos = rng.integers(0, 100000, 6).astype(np.int32)
    full = sn.rope_neox(q, pos, 32, 1e7).numpy()
    check(full, rope_ref(q, pos, 32, inv_freq_ref(32, 1e7)))
    for i in range(6):
        np.testing.assert_array_equal(sn.rope_neox(q[i : i + 1], pos[i : i + 1], 32, 1e7).numpy(), full[i : i + 1])


def test_rope_bad_input():
    x = np.ones((2, 3, 8), np.float32)
    pos = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="theta must be finite and > 0"):
        sn.rope_neox(x, pos, 8, 0.0)
    with pytest.raises(ValueError, match="theta must be finite"):
        sn.rope_neox(x, pos, 8, float("inf"))
    with pytest.raises(ValueError, match="n_rot must be even"):
        sn.rope_neox(x, pos, 5, 1e4)
    with pytest.raises(ValueError, match="n_rot must be <= head_dim"):
        sn.rope_neox(x, pos, 10, 1e4)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        sn.rope_neox(x, np.array([0, -1], np.int32), 8, 1e4)
    with pytest.raises(ValueError, match="positions has 3 entries"):
        sn.rope_neox(x, np.zeros(3, np.int32), 8, 1e4)
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        sn.rope_neox(np.ones((2, 8), np.float32), pos, 8, 1e4)
    with pytest.raises(ValueError, match="x must be F32"):
        sn.rope_neox(x.astype(np.float16), pos, 8, 1e4)
    with pytest.raises(ValueError, match="positions must be I32"):
        sn.rope_neox(x, np.zeros(2, np.float32), 8, 1e4)
    with pytest.raises(ValueError, match="yarn_original_context must be > 0"):
        sn.rope_neox(x, pos, 8, 1e4, yarn_factor=4.0)
    with pytest.raises(ValueError, match="yarn_factor must be finite and >= 1"):
        sn.rope_neox(x, pos, 8, 1e4, yarn_factor=0.5, yarn_original_context=16)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        sn.rope_neox(np.ones((2, 3, 16), np.float32)[:, :, ::2], pos, 8, 1e4)
