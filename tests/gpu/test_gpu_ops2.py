"""GPU ops of issue 7 part 2 against the CPU backend: embedding, rope_neox, kv_write, attention,
conv1d_causal, gated_delta_net, silu/sigmoid/softplus/swiglu/mul/add, gdn_gates, rms_norm_gated, gdn_qkv,
qk_norm_rope, mul_sigmoid, topk.

Skipped without a GPU exactly like test_gpu_ops.py. SPECD_TEST_GPU_DRYRUN=1 runs every test with
"GPU" tensors left on the CPU (CPU vs CPU), to check the test logic on machines without a GPU.

Tolerances (stated per op, matching the comments in native/src/gpu/*.cu):
* embedding, kv_write (finite inputs), topk, mul, add: bit-identical to the CPU op.
* silu, sigmoid, softplus, swiglu, rope_neox, conv1d_causal: <= 1 F32 ulp from the CPU op (both
  compute in double and round once; only the device/host double libm may differ in the last bit).
* gdn_gates: bit-identical to the composition it fuses on the GPU (add, softplus, mul, sigmoid);
  <= 2 ulp from the CPU op (softplus / sigmoid 1 ulp, then the product).
* rms_norm_gated: bit-identical to mul(rms_norm, silu(z)) on the GPU; 1.2e-6 relative to the CPU
  op (rms_norm's 1e-6 and silu's ulp).
* gdn_qkv: bit-identical to l2_norm of the sliced q / k heads and the sliced v on the GPU; q, k within
  l2_norm's 1e-6 relative of the CPU op (double sums in another order: at most the scale's last bit), v
  bit-identical (a copy).
* qk_norm_rope: q and k bit-identical to rope_neox(rms_norm(.)) on the GPU; within rms_norm's 1e-6
  relative (+ rope's ulp) of the CPU op. With its KV cache write, every cache byte bit-identical to
  kv_write(k_cache, k, rows) and kv_write(v_cache, v, rows) after it on the GPU, and to the CPU kv_write
  of the GPU's k and of v. mul_sigmoid: bit-identical to mul(a, sigmoid(gate)) on the
  GPU (also reading qk_norm_rope's gate view inside qg); <= 2 ulp from the CPU op.
* attention: |gpu - cpu| <= 2e-5 * max|v| + 1e-4 |cpu| (different dot order, expf vs exp). With
  exact=False (prefill) and >= 64 rows without a mask on F16 caches of head_dim 64/128/256, the
  tensor-core flash path: F16 q and softmax weights, so a looser tolerance derived in flash_ref.py
  (per (row, head): max|v| * (2 E (1 + 2 E) + 2^-11 + N 2^-25 + 1e-5), E = 2^-11 * scale * max_j
  sum_e |q_e k_je|; and at most 2e-3 * max|v| in any call, ~1e-4 measured); every other exact=False
  call is bit-identical to exact=True.
* gated_delta_net: output and state within 1e-4 * max|cpu| + 1e-4 |cpu| per element; with exact=False
  and >= 64 tokens without checkpoints (prefill) the chunked (WY-form) path, same tolerance; every other
  exact=False call is bit-identical to exact=True.
Bitwise properties checked on the GPU itself: attention rows are identical whatever the number of
query rows in the call (1..17) and a tree node equals the chain verify of its path; conv1d and
GDN give the same outputs/state whether the tokens come in one call or several, and GDN
checkpoints equal the carried state.
"""
import os
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_ref import check_flash  # noqa: E402
from host_emu_build import topk_plan, tree_mask  # noqa: E402

from gpu_marks import DEV, DRYRUN, GPU, gpu_only  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native"))
from quant_blocks import random_blocks  # noqa: E402


def on_gpu(a, dtype=None):
    a = np.array(a, copy=True, order="C")  # a device copy: never aliases the host array
    t = sn.Tensor(a) if dtype is None else sn.Tensor(a, dtype)
    return t if DRYRUN else t.to(GPU)


def poison(nbytes):
    if DRYRUN:
        return
    t = on_gpu(np.full(max(1, (nbytes + 3) // 4), np.nan, np.float32))
    sn.gpu_synchronize()
    del t


def f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ulp_close(a, b, maxulp=1):
    np.testing.assert_array_max_ulp(np.asarray(a, np.float32), np.asarray(b, np.float32), maxulp=maxulp)


# -------------------------------------------------------------------------------- elementwise

EW_SHAPES = [(1,), (7,), (3, 5), (17, 5120), (2, 3, 257), (4, 17408)]
SPECIALS = np.array([0.0, -0.0, 1e-40, -1e-40, 20.0, 20.5, 19.99, -100.0, 100.0, -88.0, 88.0, 1e30, -1e30,
                     np.inf, -np.inf], np.float32)


@pytest.mark.parametrize("shape", EW_SHAPES)
@pytest.mark.parametrize("op", ["silu", "sigmoid", "softplus"])
@gpu_only
def test_unary_gpu_vs_cpu(rng, shape, op):
    x = f32(rng, shape, rng.uniform(0.1, 30))
    flat = x.reshape(-1)
    flat[: min(flat.size, SPECIALS.size)] = SPECIALS[: min(flat.size, SPECIALS.size)]
    poison(x.nbytes)
    y = getattr(sn, op)(on_gpu(x))
    assert y.device == DEV and y.shape == x.shape
    ulp_close(y.numpy(), getattr(sn, op)(x).numpy())


@pytest.mark.parametrize("shape", EW_SHAPES)
@pytest.mark.parametrize("op", ["swiglu", "mul", "add"])
@gpu_only
def test_binary_gpu_vs_cpu(rng, shape, op):
    a, b = f32(rng, shape, 5), f32(rng, shape, 5)
    poison(a.nbytes)
    y = getattr(sn, op)(on_gpu(a), on_gpu(b)).numpy()
    cpu = getattr(sn, op)(a, b).numpy()
    if op == "swiglu":
        ulp_close(y, cpu)
    else:
        np.testing.assert_array_equal(y, cpu)


@gpu_only
def test_elementwise_gpu_bad_input(rng):
    a = on_gpu(f32(rng, (3, 4)))
    with pytest.raises(ValueError, match="mul"):
        sn.mul(a, on_gpu(f32(rng, (4, 3))))
    with pytest.raises(ValueError, match="silu"):
        sn.silu(on_gpu(np.zeros((3, 4), np.int32)))
    if not DRYRUN:
        with pytest.raises(ValueError, match="different devices"):
            sn.add(a, f32(rng, (3, 4)))


# ------------------------------------------------------------- fused GDN gates and gated norm

def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def ulp_close_nan(a, b, maxulp=1):
    """ulp_close, with NaN required at the same places (and skipped by the ulp count)."""
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    ulp_close(np.where(nan, 0, a), np.where(nan, 0, b), maxulp)


@pytest.mark.parametrize("t,h", [(0, 48), (1, 48), (7, 48), (16, 48), (5, 7)])
@pytest.mark.parametrize("vec_shape", ["h", "1h"])
@gpu_only
def test_gdn_gates_gpu(rng, t, h, vec_shape):
    """One launch, bit-identical to mul(softplus(add(a, dt)), ssm_a) / sigmoid(b) on the GPU, <= 2 ulp
    from the CPU op in g (softplus's device libm ulp, then the multiply), <= 1 in beta."""
    a, b = f32(rng, (t, h), 30), f32(rng, (t, h), 20)
    for x in (a, b):
        x.reshape(-1)[: min(x.size, SPECIALS.size)] = SPECIALS[: min(x.size, SPECIALS.size)]
    if a.size:
        a.reshape(-1)[-1], b.reshape(-1)[-1] = np.nan, np.nan
    dt, ssm_a = f32(rng, h, 5), -np.exp(f32(rng, h)).astype(np.float32)
    if vec_shape == "1h":
        dt, ssm_a = dt.reshape(1, h), ssm_a.reshape(1, h)
    poison(a.nbytes)
    ga, gb, gdt, gssm = on_gpu(a), on_gpu(b), on_gpu(dt), on_gpu(ssm_a)
    g, beta = sn.gdn_gates(ga, gb, gdt, gssm)
    assert g.device == DEV and beta.device == DEV and g.shape == beta.shape == (t, h)
    g, beta = g.numpy(), beta.numpy()
    np.testing.assert_array_equal(bits(g), bits(sn.mul(sn.softplus(sn.add(ga, gdt)), gssm).numpy()))
    np.testing.assert_array_equal(bits(beta), bits(sn.sigmoid(gb).numpy()))
    cpu_g, cpu_beta = (y.numpy() for y in sn.gdn_gates(a, b, dt, ssm_a))
    ulp_close_nan(g, cpu_g, 2)  # softplus 1 ulp off moves the product by <= 2
    ulp_close_nan(beta, cpu_beta)


@gpu_only
def test_gdn_gates_gpu_bad_input(rng):
    a, v = on_gpu(f32(rng, (3, 4))), on_gpu(f32(rng, 4))
    with pytest.raises(ValueError, match="gdn_gates: b must have a's shape"):
        sn.gdn_gates(a, on_gpu(f32(rng, (4, 3))), v, v)
    with pytest.raises(ValueError, match="gdn_gates: a must have 2 dimensions"):
        sn.gdn_gates(on_gpu(f32(rng, (1, 3, 4))), on_gpu(f32(rng, (1, 3, 4))), v, v)
    with pytest.raises(ValueError, match=r"gdn_gates: ssm_a must have shape \[H\] or \[1, H\]"):
        sn.gdn_gates(a, a, v, on_gpu(f32(rng, (2, 4))))
    with pytest.raises(ValueError, match="gdn_gates: dt must be F32"):
        sn.gdn_gates(a, a, on_gpu(np.zeros(4, np.int32)), v)
    if not DRYRUN:
        with pytest.raises(ValueError, match="different devices"):
            sn.gdn_gates(a, a, f32(rng, 4), v)


@pytest.mark.parametrize("shape", [(0, 128), (1, 128), (5, 4, 128), (3, 7), (2, 3, 130), (16, 32, 128)])
@pytest.mark.parametrize("with_weight", [True, False])
@gpu_only
def test_rms_norm_gated_gpu(rng, shape, with_weight):
    """One launch (vector and scalar paths), bit-identical to mul(rms_norm(x, w), silu(z)) on the GPU,
    within rms_norm's 1e-6 relative (+ silu's 1 ulp) of the CPU op."""
    x, z = f32(rng, shape, rng.uniform(0.01, 100)), f32(rng, shape, 20)
    z.reshape(-1)[: min(z.size, SPECIALS.size)] = SPECIALS[: min(z.size, SPECIALS.size)]
    w = f32(rng, shape[-1]) if with_weight else None
    gx, gz, gw = on_gpu(x), on_gpu(z), on_gpu(w) if with_weight else None
    poison(x.nbytes)
    y = sn.rms_norm_gated(gx, gw, 1e-6, gz)
    assert y.device == DEV and y.shape == shape
    y = y.numpy()
    np.testing.assert_array_equal(bits(y), bits(sn.mul(sn.rms_norm(gx, gw, 1e-6), sn.silu(gz)).numpy()))
    # atol: silu of very negative z is denormal, where a last-bit scale flip is a large relative step
    np.testing.assert_allclose(y, sn.rms_norm_gated(x, w, 1e-6, z).numpy(), rtol=1.2e-6, atol=1e-37)


# (Hk, dk, Hv, dv): the 27B, odd sizes (scalar path), dk % 4 == 0 with C % 4 != 0 (cv rows not 16-byte
# aligned), heads longer than one block pass (dk 4100: 544 threads, 2050 / 2051: scalar)
GPU_QKV_DIMS = [(16, 128, 48, 128), (1, 1, 1, 1), (2, 3, 5, 7), (3, 4, 3, 3), (2, 4100, 3, 5), (1, 2051, 2, 3),
                (2, 2050, 1, 1)]


@pytest.mark.parametrize("dims", GPU_QKV_DIMS)
@pytest.mark.parametrize("w", [0, 1, 5, 16, 17])
@gpu_only
def test_gdn_qkv_gpu(rng, dims, w):
    """One launch, bit-identical to l2_norm of the slices on the GPU (the composition _gdn ran), within
    l2_norm's 1e-6 of the CPU op (v exact); each row equals a 1-row call (batch invariance)."""
    hk, dk, hv, dv = dims
    cv = f32(rng, (w, 2 * hk * dk + hv * dv), rng.uniform(0.01, 100))
    if w:
        cv[0, dk : 2 * dk] = 0  # a zero head
    gcv = on_gpu(cv)
    poison(cv.nbytes)
    q, k, v = (t.numpy() for t in sn.gdn_qkv(gcv, hk, dk, hv, dv, 1e-6))
    assert q.shape == k.shape == (w, hk, dk) and v.shape == (w, hv, dv)
    comp = [sn.l2_norm(sn.slice(gcv, -1, 0, hk * dk).reshape([w, hk, dk]), 1e-6),
            sn.l2_norm(sn.slice(gcv, -1, hk * dk, 2 * hk * dk).reshape([w, hk, dk]), 1e-6),
            sn.slice(gcv, -1, 2 * hk * dk, cv.shape[1]).reshape([w, hv, dv])]
    for got, want in zip((q, k, v), comp):
        np.testing.assert_array_equal(bits(got), bits(want.numpy()))
    cq, ck, cv_ = (t.numpy() for t in sn.gdn_qkv(cv, hk, dk, hv, dv, 1e-6))
    np.testing.assert_allclose(q, cq, rtol=1e-6, atol=0)
    np.testing.assert_allclose(k, ck, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(bits(v), bits(cv_))
    for t in range(min(w, 3)):
        one = sn.gdn_qkv(on_gpu(cv[t : t + 1]), hk, dk, hv, dv, 1e-6)
        for got, full in zip(one, (q, k, v)):
            np.testing.assert_array_equal(bits(got.numpy()), bits(full[t : t + 1]))


@gpu_only
def test_gdn_qkv_gpu_bad_input(rng):
    cv = on_gpu(f32(rng, (3, 31)))
    with pytest.raises(ValueError, match="gdn_qkv: cv has 31 columns"):
        sn.gdn_qkv(cv, 2, 4, 3, 4, 1e-6)
    with pytest.raises(ValueError, match="gdn_qkv: cv must be F32"):
        sn.gdn_qkv(on_gpu(np.ones((3, 31), np.float16)), 2, 4, 3, 5, 1e-6)
    with pytest.raises(ValueError, match="gdn_qkv: eps must be finite"):
        sn.gdn_qkv(cv, 2, 4, 3, 5, -1.0)
    if not DRYRUN:  # the CPU op has no head_k_dim limit
        with pytest.raises(ValueError, match="gdn_qkv: head_k_dim must be at most 8192 on the GPU, got 8193"):
            sn.gdn_qkv(on_gpu(np.ones((1, 2 * 8193 + 1), np.float32)), 1, 8193, 1, 1, 1e-6)


@gpu_only
def test_rms_norm_gated_gpu_batch_invariant(rng):
    x, z, w = f32(rng, (9, 4, 128)), f32(rng, (9, 4, 128), 5), on_gpu(f32(rng, 128))
    full = sn.rms_norm_gated(on_gpu(x), w, 1e-6, on_gpu(z)).numpy()
    for i in range(9):
        one = sn.rms_norm_gated(on_gpu(x[i : i + 1]), w, 1e-6, on_gpu(z[i : i + 1])).numpy()
        np.testing.assert_array_equal(bits(one), bits(full[i : i + 1]))


@gpu_only
def test_rms_norm_gated_gpu_bad_input(rng):
    x = on_gpu(f32(rng, (3, 4)))
    with pytest.raises(ValueError, match="rms_norm_gated: z shape differs from x"):
        sn.rms_norm_gated(x, None, 1e-6, on_gpu(f32(rng, (4, 3))))
    with pytest.raises(ValueError, match="rms_norm_gated: weight has 5 elements"):
        sn.rms_norm_gated(x, on_gpu(f32(rng, 5)), 1e-6, x)
    with pytest.raises(ValueError, match="rms_norm_gated: z must be F32"):
        sn.rms_norm_gated(x, None, 1e-6, on_gpu(np.zeros((3, 4), np.int32)))
    if not DRYRUN:
        with pytest.raises(ValueError, match="different devices"):
            sn.rms_norm_gated(x, None, 1e-6, f32(rng, (3, 4)))


# ---------------------------------------------------------------------------------- embedding


def q8_0_rows(rng, rows, k):
    """Random Q8_0 rows (finite fp16 scales) as raw uint8 [rows, k/32*34]."""
    nb = k // 32
    raw = np.zeros((rows, nb, 34), np.uint8)
    d = (rng.uniform(0.001, 0.1, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
    raw[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    raw[:, :, 2:] = rng.integers(0, 256, (rows, nb, 32), dtype=np.uint8)
    return raw.reshape(rows, nb * 34)


def table(rng, dtype, V, H):
    if dtype == "F32":
        return f32(rng, (V, H)), None
    if dtype == "F16":
        return f32(rng, (V, H)).astype(np.float16), None
    if dtype == "BF16":
        return (f32(rng, (V, H)).view(np.uint32) >> 16).astype(np.uint16), sn.DType.BF16
    return q8_0_rows(rng, V, H), sn.DType.Q8_0


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "Q8_0"])
@pytest.mark.parametrize("V,H,n", [(50, 64, 1), (300, 5120, 9), (17, 96, 33)])
@gpu_only
def test_embedding_gpu_bit_exact(rng, dtype, V, H, n):
    w, dt = table(rng, dtype, V, H)
    ids = rng.integers(0, V, n).astype(np.int32)
    cpu = sn.embedding(sn.Tensor(w, dt) if dt else w, ids).numpy()
    wg = on_gpu(w, dt)
    for idt in (ids, on_gpu(ids)):  # ids from the host or already on the GPU
        y = sn.embedding(wg, idt)
        assert y.device == DEV and y.shape == (n, H)
        np.testing.assert_array_equal(y.numpy(), cpu)


KQ_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}  # fp16 fields per block


def kquant_rows(rng, dtype, rows, k):
    """Random rows [rows, k] of a 256-weight block format as raw uint8: random bytes with the fp16
    scale fields (ggml block layouts) set to finite values."""
    dt = getattr(sn.DType, dtype)
    nb, bs = k // 256, sn.type_size(dt)
    raw = rng.integers(0, 256, (rows, nb, bs), dtype=np.uint8)
    for off in KQ_SCALES[dtype]:
        d = rng.uniform(0.001, 0.1, (rows, nb)).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * bs), dt


@pytest.mark.parametrize("dtype", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("V,H,n", [(40, 256, 1), (300, 5120, 9)])
@gpu_only
def test_embedding_gpu_block_formats_bit_exact(rng, dtype, V, H, n):
    w, dt = kquant_rows(rng, dtype, V, H)
    ids = rng.integers(0, V, n).astype(np.int32)
    cpu = sn.embedding(sn.Tensor(w, dt), ids).numpy()
    y = sn.embedding(on_gpu(w, dt), on_gpu(ids))
    np.testing.assert_array_equal(y.numpy(), cpu)


@gpu_only
def test_embedding_gpu_bad_ids(rng):
    wg = on_gpu(f32(rng, (10, 32)))
    with pytest.raises(ValueError, match="ids"):
        sn.embedding(wg, np.array([1, 10], np.int32))
    with pytest.raises(ValueError, match="ids"):
        sn.embedding(wg, on_gpu(np.array([-1], np.int32)))


# --------------------------------------------------------------------------------------- rope

ROPE_CASES = [
    # n, heads, head_dim, n_rot, theta, yarn kwargs
    (5, 24, 256, 64, 1e7, {}),  # 27B q (partial rotary)
    (3, 4, 256, 64, 1e7, {}),  # 27B k
    (17, 8, 128, 128, 1e6, {}),  # drafter, whole head
    (4, 2, 64, 32, 1e4, {"yarn_factor": 4.0, "yarn_original_context": 4096}),
    (6, 3, 128, 128, 1e6, {"yarn_factor": 8.0, "yarn_original_context": 32768, "yarn_beta_fast": 16.0,
                           "yarn_beta_slow": 2.0, "yarn_attention_factor": 1.3}),
    (2, 1, 10, 0, 1e4, {}),
]


@pytest.mark.parametrize("case", ROPE_CASES)
@gpu_only
def test_rope_gpu_vs_cpu(rng, case):
    n, heads, hd, n_rot, theta, yarn = case
    x = f32(rng, (n, heads, hd))
    pos = rng.integers(0, 300000, n).astype(np.int32)
    pos[0] = 0
    cpu = sn.rope_neox(x, pos, n_rot, theta, **yarn).numpy()
    poison(x.nbytes)
    y = sn.rope_neox(on_gpu(x), on_gpu(pos), n_rot, theta, **yarn)
    assert y.device == DEV and y.shape == x.shape
    y = y.numpy()
    ulp_close(y, cpu)
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])
    np.testing.assert_array_equal(sn.rope_neox(on_gpu(x), pos, n_rot, theta, **yarn).numpy(), y)  # host positions
    # Batch invariance: each row alone.
    for i in (0, n - 1):
        yi = sn.rope_neox(on_gpu(x[i:i + 1]), on_gpu(pos[i:i + 1]), n_rot, theta, **yarn).numpy()
        np.testing.assert_array_equal(yi[0], y[i])


@gpu_only
def test_rope_gpu_bad_input(rng):
    x = on_gpu(f32(rng, (2, 3, 64)))
    with pytest.raises(ValueError, match="positions"):
        sn.rope_neox(x, on_gpu(np.array([0, -1], np.int32)), 64, 1e4)
    with pytest.raises(ValueError, match="n_rot"):
        sn.rope_neox(x, on_gpu(np.array([0, 1], np.int32)), 66, 1e4)
    with pytest.raises(ValueError, match="positions"):
        sn.rope_neox(x, on_gpu(np.array([0], np.int32)), 64, 1e4)


# ---------------------------------------------------- fused attention q / k preparation, output gate

QK_CASES = [
    # w, heads, kv_heads, head_dim, n_rot
    (1, 24, 4, 256, 64),  # 27B decode (vector loads)
    (5, 24, 4, 256, 64),
    (17, 24, 4, 256, 64),
    (3, 5, 3, 10, 4),  # scalar loads (head_dim % 4 != 0)
    (4, 3, 1, 6, 0),
    (2, 2, 2, 130, 130),
    (2, 3, 1, 2050, 64),  # several loads per thread
    (0, 3, 1, 8, 8),
]


def qk_composition(qg, k, qw, kw, pos, n_rot, hd):
    """What Qwen35Model._attention ran before qk_norm_rope, on qg's device."""
    q = sn.rope_neox(sn.rms_norm(sn.slice(qg, -1, 0, hd), qw, 1e-6), pos, n_rot, 1e7).numpy()
    return q, sn.rope_neox(sn.rms_norm(k, kw, 1e-6), pos, n_rot, 1e7).numpy()


@pytest.mark.parametrize("case", QK_CASES)
@gpu_only
def test_qk_norm_rope_gpu(rng, case):
    """One launch; q and k bit-identical to rope_neox(rms_norm(.)) on the GPU and within rms_norm's
    1e-6 relative (+ rope's ulp) of the CPU op; gate is the view of qg that mul_sigmoid reads: bitwise
    mul(a, sigmoid(a copy of qg's gate half)). Host, GPU and trusted GPU positions agree; rows alone
    equal the batch."""
    w, nh, nkv, hd, n_rot = case
    qg, k = f32(rng, (w, nh, 2 * hd), rng.uniform(0.01, 100)), f32(rng, (w, nkv, hd), rng.uniform(0.01, 100))
    qw, kw = f32(rng, hd), f32(rng, hd)
    pos = rng.integers(0, 300000, w).astype(np.int32)
    gqg, gk, gqw, gkw, gpos = on_gpu(qg), on_gpu(k), on_gpu(qw), on_gpu(kw), on_gpu(pos)
    poison(qg.nbytes)
    q, gate, ko = sn.qk_norm_rope(gqg, gk, gqw, gkw, gpos, n_rot, 1e7, 1e-6)
    assert q.device == gate.device == ko.device == DEV
    assert q.shape == gate.shape == (w, nh, hd) and ko.shape == (w, nkv, hd)
    q, ko = q.numpy(), ko.numpy()
    want_q, want_k = qk_composition(gqg, gk, gqw, gkw, gpos, n_rot, hd)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(ko), bits(want_k))
    for got, cpu in zip((q, ko), sn.qk_norm_rope(qg, k, qw, kw, pos, n_rot, 1e7, 1e-6)[::2]):
        cpu = cpu.numpy()
        np.testing.assert_allclose(got, cpu, rtol=2e-6, atol=4e-6 * np.abs(cpu).max(initial=0))
    a = on_gpu(f32(rng, (w, nh, hd)))
    np.testing.assert_array_equal(bits(sn.mul_sigmoid(a, gate).numpy()),
                                  bits(sn.mul(a, sn.sigmoid(sn.slice(gqg, -1, hd, 2 * hd))).numpy()))
    for p, trusted in ((pos, False), (gpos, True)):
        q2, _, k2 = sn.qk_norm_rope(gqg, gk, gqw, gkw, p, n_rot, 1e7, 1e-6, trusted=trusted)
        np.testing.assert_array_equal(bits(q2.numpy()), bits(q))
        np.testing.assert_array_equal(bits(k2.numpy()), bits(ko))
    for i in sorted({0, w - 1}) if w else ():
        qi, _, ki = sn.qk_norm_rope(on_gpu(qg[i : i + 1]), on_gpu(k[i : i + 1]), gqw, gkw, on_gpu(pos[i : i + 1]),
                                    n_rot, 1e7, 1e-6)
        np.testing.assert_array_equal(bits(qi.numpy()), bits(q[i : i + 1]))
        np.testing.assert_array_equal(bits(ki.numpy()), bits(ko[i : i + 1]))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 257), (17, 24, 256), (0, 4)])
@gpu_only
def test_mul_sigmoid_gpu(rng, shape):
    """One launch, bit-identical to mul(a, sigmoid(gate)) on the GPU, <= 2 ulp from the CPU op
    (sigmoid's device libm ulp, then the multiply)."""
    a, g = f32(rng, shape, 10), f32(rng, shape, 20)
    g.reshape(-1)[: min(g.size, SPECIALS.size)] = SPECIALS[: min(g.size, SPECIALS.size)]
    ga, gg = on_gpu(a), on_gpu(g)
    poison(a.nbytes)
    y = sn.mul_sigmoid(ga, gg)
    assert y.device == DEV and y.shape == shape
    y = y.numpy()
    np.testing.assert_array_equal(bits(y), bits(sn.mul(ga, sn.sigmoid(gg)).numpy()))
    ulp_close_nan(y, sn.mul_sigmoid(a, g).numpy(), 2)


@gpu_only
def test_attn_fused_gpu_bad_input(rng):
    qg, k, v, pos = on_gpu(f32(rng, (2, 3, 8))), on_gpu(f32(rng, (2, 1, 4))), on_gpu(f32(rng, 4)), \
        on_gpu(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="qk_norm_rope: positions must be >= 0, got -1 at index 1"):
        sn.qk_norm_rope(qg, k, v, v, on_gpu(np.array([0, -1], np.int32)), 4, 1e4, 1e-6)
    with pytest.raises(ValueError, match="qk_norm_rope: positions has 1 entries"):
        sn.qk_norm_rope(qg, k, v, v, on_gpu(np.zeros(1, np.int32)), 4, 1e4, 1e-6)
    with pytest.raises(ValueError, match="qk_norm_rope: q_norm_w has 5 elements"):
        sn.qk_norm_rope(qg, k, on_gpu(f32(rng, 5)), v, pos, 4, 1e4, 1e-6)
    with pytest.raises(ValueError, match=r"qk_norm_rope: qg must be \[w, heads, 2 \* head_dim\]"):
        sn.qk_norm_rope(on_gpu(f32(rng, (2, 3, 6))), k, v, v, pos, 4, 1e4, 1e-6)
    with pytest.raises(ValueError, match="qk_norm_rope: n_rot must be <= head_dim"):
        sn.qk_norm_rope(qg, k, v, v, pos, 6, 1e4, 1e-6)
    with pytest.raises(ValueError, match="mul_sigmoid: a and gate must have the same shape"):
        sn.mul_sigmoid(on_gpu(f32(rng, (3, 4))), on_gpu(f32(rng, (4, 3))))
    with pytest.raises(ValueError, match="mul_sigmoid: gate must be F32"):
        sn.mul_sigmoid(on_gpu(f32(rng, (3, 4))), on_gpu(np.zeros((3, 4), np.int32)))
    if not DRYRUN:
        with pytest.raises(ValueError, match="different devices"):
            sn.qk_norm_rope(qg, f32(rng, (2, 1, 4)), v, v, pos, 4, 1e4, 1e-6)
        with pytest.raises(ValueError, match="different devices"):
            sn.mul_sigmoid(on_gpu(f32(rng, (3, 4))), f32(rng, (3, 4)))
        # a qg view 4 bytes past an allocation: the composition would normalise an aligned copy of q
        # (vector loads) but k in place, so the fused op refuses instead of computing in another order
        buf = sn.Tensor.zeros([1 + 2 * 3 * 8], sn.DType.F32, GPU)
        odd = buf.view_rows(1, 1 + 2 * 3 * 8).reshape([2, 3, 8])
        with pytest.raises(ValueError, match="qk_norm_rope: on the GPU, qg, k, q_norm_w and k_norm_w must be 16-byte"):
            sn.qk_norm_rope(odd, k, v, v, pos, 4, 1e4, 1e-6)


# ---------------------------------------------------------------------------- kv cache, attention

DTYPES = ["F32", "F16", "Q8_0"]


def tree_path(parents, j):
    """Rows from the root's child down to tree row j (parents[i] < i, -1 for the root's children)."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def empty_cache(capacity, hkv, d, dtype):
    if dtype == "F32":
        return np.zeros((capacity, hkv, d), np.float32), None
    if dtype == "F16":
        return np.zeros((capacity, hkv, d), np.float16), None
    return np.zeros((capacity, hkv, d // 32 * 34), np.uint8), sn.DType.Q8_0


class Caches:
    """The same K/V contents on the CPU (numpy, written by the CPU kv_write) and on the GPU."""

    def __init__(self, rng, capacity, hkv, d, dtype, kv_len):
        self.cpu, self.gpu = [], []
        for _ in range(2):
            raw, dt = empty_cache(capacity, hkv, d, dtype)
            t = sn.Tensor(raw, dt) if dt else raw
            if kv_len:
                sn.kv_write(t, f32(rng, (kv_len, hkv, d)), np.arange(kv_len, dtype=np.int32))
            self.cpu.append(t)
            self.gpu.append(on_gpu(raw, dt))
        self.vmax = float(np.abs(sn.dequantize(self.cpu[1]).numpy()).max()) if kv_len else 1.0


def attn_both(c, q, kv_len, pos, **kw):
    cpu = sn.attention(q, c.cpu[0], c.cpu[1], kv_len, pos, **kw).numpy()
    gkw = dict(kw)
    if gkw.get("mask") is not None:
        gkw["mask"] = on_gpu(gkw["mask"])
    y = sn.attention(on_gpu(q), c.gpu[0], c.gpu[1], kv_len, on_gpu(pos), **gkw)
    assert y.device == DEV and y.shape == q.shape
    return y.numpy(), cpu


def check_attn(y, cpu, vmax):
    np.testing.assert_allclose(y, cpu, rtol=1e-4, atol=2e-5 * vmax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@gpu_only
def test_kv_write_gpu_bit_exact(rng, dtype, d):
    hkv, cap = 4, 40
    x = f32(rng, (7, hkv, d), 3)
    x[0, 0, :32] = 0  # an all-zero Q8_0 block
    rows = np.array([39, 0, 5, 17, 3, 30, 8], np.int32)
    raw_c, dt = empty_cache(cap, hkv, d, dtype)
    sn.kv_write(sn.Tensor(raw_c, dt) if dt else raw_c, x, rows)
    raw_g, _ = empty_cache(cap, hkv, d, dtype)
    g = on_gpu(raw_g, dt)
    sn.kv_write(g, on_gpu(x[:4]), on_gpu(rows[:4]))
    sn.kv_write(g, on_gpu(x[4:]), rows[4:])  # rows from the host
    got = g.numpy()
    np.testing.assert_array_equal(got.view(np.uint8), raw_c.view(np.uint8))


@gpu_only
def test_kv_write_gpu_bad_rows(rng):
    raw, _ = empty_cache(8, 2, 64, "F16")
    g = on_gpu(raw)
    x = on_gpu(f32(rng, (2, 2, 64)))
    with pytest.raises(ValueError, match="distinct"):
        sn.kv_write(g, x, on_gpu(np.array([3, 3], np.int32)))
    with pytest.raises(ValueError, match="outside"):
        sn.kv_write(g, x, on_gpu(np.array([3, 8], np.int32)))
    with pytest.raises(ValueError, match="x must be"):
        sn.kv_write(g, on_gpu(f32(rng, (2, 3, 64))), np.array([0, 1], np.int32))


def random_cache(rng, capacity, hkv, d, dtype):
    """empty_cache filled with random bytes (rows a call does not write must keep them)."""
    raw, dt = empty_cache(capacity, hkv, d, dtype)
    raw.view(np.uint8)[...] = rng.integers(0, 256, raw.view(np.uint8).shape, dtype=np.uint8)
    return raw, dt


def cache_bytes(t):
    return t.numpy().view(np.uint8)


# w, heads, kv_heads, head_dim, n_rot: the 27B's decode / verify (vector loads), scalar loads (head_dim % 4
# != 0: F32 / F16 caches only), several loads per thread and many Q8_0 blocks, no rows
QK_CACHE_CASES = [(1, 24, 4, 256, 64), (5, 24, 4, 256, 64), (17, 24, 4, 256, 64), (3, 5, 3, 10, 4),
                  (2, 3, 1, 2080, 64), (0, 3, 1, 32, 8)]


@pytest.mark.parametrize("dtypes", [(d, d) for d in DTYPES] + [("F16", "Q8_0"), ("Q8_0", "F32")])
@pytest.mark.parametrize("case", QK_CACHE_CASES)
@gpu_only
def test_qk_norm_rope_cache_write_gpu(rng, case, dtypes):
    """One launch writes the caches as the composition does: q, k and every cache byte bit-identical to
    qk_norm_rope then kv_write(k_cache, k, rows) and kv_write(v_cache, v, rows) on the GPU (rows in any
    order; other rows keep their bytes); the same bytes as the CPU kv_write of the GPU's k and of v, q and k
    within the CPU op's tolerance. Host, GPU and trusted GPU rows agree; each row alone equals the batch."""
    (w, nh, nkv, hd, n_rot), (kdt, vdt) = case, dtypes
    if "Q8_0" in dtypes and hd % 32:
        pytest.skip("Q8_0 needs head_dim % 32 == 0")
    cap = 2 * w + 3
    qg, k = f32(rng, (w, nh, 2 * hd), rng.uniform(0.01, 100)), f32(rng, (w, nkv, hd), rng.uniform(0.01, 100))
    v, qw, kw = f32(rng, (w, nkv, hd), 3), f32(rng, hd), f32(rng, hd)
    if w and hd >= 32:
        v[0, 0, :32] = 0  # an all-zero Q8_0 block
    pos = rng.integers(0, 300000, w).astype(np.int32)
    rows = rng.permutation(cap)[:w].astype(np.int32)
    (kraw, kt), (vraw, vt) = random_cache(rng, cap, nkv, hd, kdt), random_cache(rng, cap, nkv, hd, vdt)
    g = [on_gpu(a) for a in (qg, k, qw, kw, pos)]
    gv, grows = on_gpu(v), on_gpu(rows)

    def fused(p_rows, trusted=False, sl=slice(None), caches=None):
        kc, vc = caches or (on_gpu(kraw, kt), on_gpu(vraw, vt))
        gqg, gk, gpos, gvs = (sn.slice(t, 0, sl.start, sl.stop) if sl.start is not None else t
                              for t in (g[0], g[1], g[4], gv))
        q, gate, ko = sn.qk_norm_rope(gqg, gk, g[2], g[3], gpos, n_rot, 1e7, 1e-6, trusted=trusted, k_cache=kc,
                                      v_cache=vc, v=gvs, rows=p_rows)
        return q, gate, ko, kc, vc

    ref_k, ref_v = on_gpu(kraw, kt), on_gpu(vraw, vt)
    q0, _, k0 = sn.qk_norm_rope(*g, n_rot, 1e7, 1e-6)
    sn.kv_write(ref_k, k0, grows)
    sn.kv_write(ref_v, gv, grows)
    poison(qg.nbytes)
    q, gate, ko, kc, vc = fused(grows)
    assert q.device == gate.device == ko.device == DEV
    assert q.shape == gate.shape == (w, nh, hd) and ko.shape == (w, nkv, hd)
    q, ko = q.numpy(), ko.numpy()
    np.testing.assert_array_equal(bits(q), bits(q0.numpy()))
    np.testing.assert_array_equal(bits(ko), bits(k0.numpy()))
    np.testing.assert_array_equal(cache_bytes(kc), cache_bytes(ref_k))
    np.testing.assert_array_equal(cache_bytes(vc), cache_bytes(ref_v))
    # the CPU: kv_write of the GPU's k and of v gives the same bytes; q and k as test_qk_norm_rope_gpu's
    ck, cv = kraw.copy(), vraw.copy()
    sn.kv_write(sn.Tensor(ck, kt) if kt else ck, ko, rows)
    sn.kv_write(sn.Tensor(cv, vt) if vt else cv, v, rows)
    np.testing.assert_array_equal(cache_bytes(kc), ck.view(np.uint8))
    np.testing.assert_array_equal(cache_bytes(vc), cv.view(np.uint8))
    cpu_k, cpu_v = kraw.copy(), vraw.copy()
    cq, _, cko = sn.qk_norm_rope(qg, k, qw, kw, pos, n_rot, 1e7, 1e-6, k_cache=sn.Tensor(cpu_k, kt) if kt else cpu_k,
                                 v_cache=sn.Tensor(cpu_v, vt) if vt else cpu_v, v=v, rows=rows)
    np.testing.assert_array_equal(cpu_v.view(np.uint8), cv.view(np.uint8))
    for got, cpu in ((q, cq.numpy()), (ko, cko.numpy())):
        np.testing.assert_allclose(got, cpu, rtol=2e-6, atol=4e-6 * np.abs(cpu).max(initial=0))
    for p_rows, trusted in ((rows, False), (grows, True)):
        _, _, _, kc2, vc2 = fused(p_rows, trusted)
        np.testing.assert_array_equal(cache_bytes(kc2), cache_bytes(kc))
        np.testing.assert_array_equal(cache_bytes(vc2), cache_bytes(vc))
    one = (on_gpu(kraw, kt), on_gpu(vraw, vt))
    for i in range(w):
        fused(on_gpu(rows[i : i + 1]), sl=slice(i, i + 1), caches=one)
    np.testing.assert_array_equal(cache_bytes(one[0]), cache_bytes(kc))
    np.testing.assert_array_equal(cache_bytes(one[1]), cache_bytes(vc))


@gpu_only
def test_qk_norm_rope_cache_write_gpu_bad_input(rng):
    """Bad arguments raise ValueError naming them before the launch: no cache byte changes."""
    w, nh, nkv, hd, cap = 2, 3, 1, 32, 8
    args = [on_gpu(a) for a in (f32(rng, (w, nh, 2 * hd)), f32(rng, (w, nkv, hd)), f32(rng, hd), f32(rng, hd),
                                np.zeros(w, np.int32))]
    kc, vc = on_gpu(random_cache(rng, cap, nkv, hd, "F16")[0]), on_gpu(*random_cache(rng, cap, nkv, hd, "Q8_0"))
    f32c = on_gpu(np.zeros((cap, nkv, hd), np.float32))
    v, rows = on_gpu(f32(rng, (w, nkv, hd))), on_gpu(np.array([5, 1], np.int32))
    good = dict(k_cache=kc, v_cache=vc, v=v, rows=rows)
    cases = [
        (dict(k_cache=kc, v_cache=vc, v=v), "qk_norm_rope: k_cache, v_cache, v and rows must be given together"),
        (dict(good, rows=on_gpu(np.array([5, 8], np.int32))), r"qk_norm_rope: rows\[1\] = 8 is outside the cache"),
        (dict(good, rows=np.array([-1, 1], np.int32)), "is outside the cache"),  # host rows
        (dict(good, rows=on_gpu(np.array([3, 3], np.int32))), "qk_norm_rope: rows must be distinct"),
        (dict(good, rows=on_gpu(np.array([3], np.int32))), "rows has 1 entries, k has 2"),
        (dict(good, v=on_gpu(f32(rng, (w, 2, hd)))), "v must have k's shape"),
        (dict(good, v_cache=on_gpu(np.zeros((cap + 1, nkv, hd), np.float16))), "k_cache and v_cache shapes differ"),
        (dict(good, k_cache=on_gpu(np.zeros((cap, nkv, hd), np.int32))), "k_cache must be F32, F16 or Q8_0"),
        (dict(good, v_cache=kc), "k_cache and v_cache must not overlap"),
        (dict(good, k_cache=on_gpu(np.zeros((cap, nkv, hd), np.float32)), v_cache=f32c,
              v=f32c.view_rows(cap - w, cap)), "v_cache must not overlap the inputs"),
    ]
    if not DRYRUN:  # the CPU op takes CPU caches and row-strided host rows
        cases += [(dict(good, k_cache=np.zeros((cap, nkv, hd), np.float16)), "k_cache must be on the GPU"),
                  (dict(good, v=f32(rng, (w, nkv, hd))), "v must be on the GPU"),
                  (dict(good, rows=np.array([5, 0, 1, 0], np.int32)[::2]), "rows must be contiguous")]
    before = [cache_bytes(t).copy() for t in (kc, vc, f32c)]
    for kw_cache, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.qk_norm_rope(*args, 4, 1e4, 1e-6, **kw_cache)
    with pytest.raises(ValueError, match="qk_norm_rope: positions must be >= 0"):
        sn.qk_norm_rope(*args[:4], on_gpu(np.array([0, -1], np.int32)), 4, 1e4, 1e-6, **good)
    for t, b in zip((kc, vc, f32c), before):
        np.testing.assert_array_equal(cache_bytes(t), b)


# (hq, hkv, d): 27B full attention, drafter, small; d = 20: no 16-byte loads, partials padded to 24
ATTN_SHAPES = [(24, 4, 256), (8, 2, 128), (4, 4, 64), (6, 2, 96), (4, 2, 20)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
@gpu_only
def test_attention_gpu_prefill_and_verify(rng, dtype, shape):
    hq, hkv, d = shape
    if dtype == "Q8_0" and d % 32:
        pytest.skip("Q8_0 needs head_dim % 32 == 0")
    kv_len = 70
    c = Caches(rng, 80, hkv, d, dtype, kv_len)
    # prefill: every row causal
    q = f32(rng, (kv_len, hq, d))
    pos = np.arange(kv_len, dtype=np.int32)
    check_attn(*attn_both(c, q, kv_len, pos), c.vmax)
    # verify / decode at the end of the cache, peaky softmax
    for n in (1, 5):
        q = f32(rng, (n, hq, d), 3)
        pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
        check_attn(*attn_both(c, q, kv_len, pos), c.vmax)


@pytest.mark.parametrize("dtypes", [("F16", "F32"), ("Q8_0", "F16"), ("F32", "Q8_0")])
@gpu_only
def test_attention_gpu_mixed_cache_dtypes(rng, dtypes):
    hq, hkv, d, kv_len = 8, 2, 128, 50
    a = Caches(rng, 64, hkv, d, dtypes[0], kv_len)
    b = Caches(rng, 64, hkv, d, dtypes[1], kv_len)
    a.cpu[1], a.gpu[1], a.vmax = b.cpu[1], b.gpu[1], b.vmax
    q = f32(rng, (3, hq, d))
    pos = np.array([10, 30, 49], np.int32)
    check_attn(*attn_both(a, q, kv_len, pos), a.vmax)


def tree(c):
    parent = [-1, 0, 0, 1, 1, 2, 5]
    depth = [0, 1, 1, 2, 2, 2, 3]
    return parent, depth, tree_mask(c, parent)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(24, 4, 256), (8, 2, 128)])
@gpu_only
def test_attention_gpu_tree_window_and_bidirectional(rng, dtype, shape):
    hq, hkv, d = shape
    c0 = 41
    parent, depth, mask = tree(c0)
    n = len(parent)
    c = Caches(rng, 64, hkv, d, dtype, c0 + n)
    q = f32(rng, (n, hq, d))
    pos = (c0 + np.array(depth)).astype(np.int32)
    check_attn(*attn_both(c, q, c0 + n, pos, causal=False, mask=mask), c.vmax)
    # windowed (causal and not), bidirectional drafter block, explicit scale, no visible key
    pos = rng.integers(0, c0 + n, n).astype(np.int32)
    check_attn(*attn_both(c, q, c0 + n, pos, window=8), c.vmax)
    check_attn(*attn_both(c, q, c0 + n, pos, causal=False, window=5), c.vmax)
    check_attn(*attn_both(c, q, c0 + n, pos, causal=False, scale=0.3), c.vmax)
    m0 = mask.copy()
    m0[2] = 0
    y, cpu = attn_both(c, q, c0 + n, pos, causal=False, mask=m0)
    check_attn(y, cpu, c.vmax)
    assert not y[2].any()


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("shape", [(24, 4, 256), (8, 2, 128)])
@gpu_only
def test_attention_gpu_batch_invariance_bitwise(rng, dtype, shape):
    hq, hkv, d = shape
    kv_len = 300
    c = Caches(rng, 320, hkv, d, dtype, kv_len)
    q = f32(rng, (17, hq, d), 2)
    pos = np.arange(kv_len - 17, kv_len, dtype=np.int32)
    kg, vg = c.gpu
    full = sn.attention(on_gpu(q), kg, vg, kv_len, on_gpu(pos)).numpy()
    for m in range(1, 18):  # the last m rows in one call
        y = sn.attention(on_gpu(q[17 - m:]), kg, vg, kv_len, on_gpu(pos[17 - m:])).numpy()
        np.testing.assert_array_equal(y, full[17 - m:], err_msg=f"{m} rows")
    # Tree node == chain verify of its path (keys at other cache rows), bitwise.
    c0 = 200
    parent, depth, mask = tree(c0)
    n = len(parent)
    cap = c0 + n + 8
    raw_k, dt = empty_cache(cap, hkv, d, dtype)
    raw_v, _ = empty_cache(cap, hkv, d, dtype)
    kx, vx = f32(rng, (c0 + n, hkv, d)), f32(rng, (c0 + n, hkv, d))
    kt, vt = on_gpu(raw_k, dt), on_gpu(raw_v, dt)
    sn.kv_write(kt, on_gpu(kx), np.arange(c0 + n, dtype=np.int32))
    sn.kv_write(vt, on_gpu(vx), np.arange(c0 + n, dtype=np.int32))
    qn = f32(rng, (n, hq, d))
    pos_t = (c0 + np.array(depth)).astype(np.int32)
    yt = sn.attention(on_gpu(qn), kt, vt, c0 + n, on_gpu(pos_t), causal=False, mask=on_gpu(mask)).numpy()
    for node in (3, 6):
        path = tree_path(parent, node)
        rk, dt2 = empty_cache(cap, hkv, d, dtype)
        rv, _ = empty_cache(cap, hkv, d, dtype)
        ck, cv = on_gpu(rk, dt2), on_gpu(rv, dt2)
        rows = np.arange(c0 + len(path), dtype=np.int32)
        sn.kv_write(ck, on_gpu(np.concatenate([kx[:c0], kx[c0 + np.array(path)]])), rows)
        sn.kv_write(cv, on_gpu(np.concatenate([vx[:c0], vx[c0 + np.array(path)]])), rows)
        pch = np.arange(c0, c0 + len(path), dtype=np.int32)
        qch = np.stack([qn[p] for p in path])
        ych = sn.attention(on_gpu(qch), ck, cv, c0 + len(path), on_gpu(pch)).numpy()
        np.testing.assert_array_equal(ych[-1], yt[node], err_msg=f"tree node {node} vs chain")


def assert_tree_equals_chain(rng, hq, hkv, d, dtype, c0, nodes):
    """tree(c0)'s rows in one masked call over c0 committed keys equal, bitwise, the last row of a chain
    verify of each node's path (the path's keys written at rows c0, c0 + 1, ... of another cache)."""
    parent, depth, tmask = tree(c0)
    n = len(parent)
    cap = c0 + n + 8
    kx, vx = f32(rng, (c0 + n, hkv, d)), f32(rng, (c0 + n, hkv, d))

    def caches(kr, vr):
        rk, dt = empty_cache(cap, hkv, d, dtype)
        rv, _ = empty_cache(cap, hkv, d, dtype)
        ck, cv = on_gpu(rk, dt), on_gpu(rv, dt)
        rows = np.arange(len(kr), dtype=np.int32)
        sn.kv_write(ck, on_gpu(kr), rows)
        sn.kv_write(cv, on_gpu(vr), rows)
        return ck, cv

    kt, vt = caches(kx, vx)
    qn = f32(rng, (n, hq, d))
    pos_t = (c0 + np.array(depth)).astype(np.int32)
    yt = sn.attention(on_gpu(qn), kt, vt, c0 + n, on_gpu(pos_t), causal=False, mask=on_gpu(tmask)).numpy()
    for node in nodes:
        path = tree_path(parent, node)
        idx = np.concatenate([np.arange(c0), c0 + np.array(path)])
        ck, cv = caches(kx[idx], vx[idx])
        pch = np.arange(c0, c0 + len(path), dtype=np.int32)
        ych = sn.attention(on_gpu(np.stack([qn[p] for p in path])), ck, cv, c0 + len(path), on_gpu(pch)).numpy()
        np.testing.assert_array_equal(ych[-1], yt[node], err_msg=f"tree node {node} vs chain")


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@gpu_only
def test_attention_gpu_chunk_boundaries(rng, dtype):
    """The split-K kernel cuts each row's visible-key sequence into fixed chunks (64 keys): long
    rows (many chunks, windowed, masked) match the CPU; a tree whose draft rows straddle a chunk
    boundary still equals the chain verify bitwise; an all-ones mask equals no mask bitwise."""
    hq, hkv, d = 8, 2, 128
    kv_len = 1000
    c = Caches(rng, 1024, hkv, d, dtype, kv_len)
    q = f32(rng, (5, hq, d), 2)
    pos = np.array([0, 63, 64, 500, 999], np.int32)
    check_attn(*attn_both(c, q, kv_len, pos), c.vmax)
    check_attn(*attn_both(c, q, kv_len, pos, window=200), c.vmax)
    mask = (rng.random((5, kv_len)) < 0.3).astype(np.int32)
    check_attn(*attn_both(c, q, kv_len, pos, causal=False, mask=mask), c.vmax)
    kg, vg = c.gpu
    ones = np.ones((5, kv_len), np.int32)
    y0 = sn.attention(on_gpu(q), kg, vg, kv_len, on_gpu(pos), causal=False).numpy()
    y1 = sn.attention(on_gpu(q), kg, vg, kv_len, on_gpu(pos), causal=False, mask=on_gpu(ones)).numpy()
    np.testing.assert_array_equal(y0, y1)
    # Tree rows [c0, c0 + 7) across the chunk boundary at 64: node == chain verify of its path.
    assert_tree_equals_chain(rng, hq, hkv, d, dtype, 60, range(7))


@pytest.mark.parametrize("shape", [(24, 4, 256), (32, 8, 128)])
@gpu_only
def test_attention_gpu_warps_per_chunk_bitwise(rng, shape):
    """The tensor-core chunk pass (F16 caches) shares a chunk among head_dim / 64 warps when its tasks are
    few (attention_chunk_mma.cuh: plan's ds; a short context) and gives each warp whole chunks when they are
    many: 32 causal rows over 1600 keys in one call equal each row alone bit for bit, and the CPU within the
    exact path's tolerance. On the H200 (1584 resident warps) the call has 1200 / 1600 tasks (ds = 1) and a
    row alone 100 / 200 (ds = 4 / 2); on other GPUs the plans may differ, the equality must hold anyway."""
    hq, hkv, d = shape
    kv_len, n = 1600, 32
    c = Caches(rng, kv_len, hkv, d, "F16", kv_len)
    q = f32(rng, (n, hq, d), 2)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    full, cpu = attn_both(c, q, kv_len, pos)
    check_attn(full, cpu, c.vmax)
    kg, vg = c.gpu
    for i in range(n):
        y = sn.attention(on_gpu(q[i:i + 1]), kg, vg, kv_len, on_gpu(pos[i:i + 1])).numpy()
        np.testing.assert_array_equal(y, full[i:i + 1], err_msg=f"row {i}")


# (hq, hkv, head_dim, kv_len, query positions): one 64-output combine block per head, 1094 chunks; two
# combine blocks per head, the second half past head_dim (96)
LONG_ROWS = [(4, 1, 64, 70000, [4095, 4096, 8191, 8192, 12300, 65535, 65536, 69999]),
             (6, 2, 96, 20000, [31, 2047, 2048, 2111, 8191, 12300, 19998, 19999])]


@pytest.mark.parametrize("dtype", ["F16", "Q8_0", "F32"])
@pytest.mark.parametrize("case", LONG_ROWS)
@gpu_only
def test_attention_gpu_long_rows(rng, dtype, case):
    """Rows of up to 70000 visible keys (1094 chunks: the combine reduces them in 18 groups of 64 chunks, then
    the groups) match the CPU, alone or with shorter rows in one call (bitwise: the chunk grid
    and the combine's order depend only on the row), masked too; and a tree at 8253 keys whose
    draft rows straddle the chunk boundary 8256 equals the chain verify of each path."""
    hq, hkv, d, kv_len, pos = case
    c = Caches(rng, kv_len + 8, hkv, d, dtype, kv_len)
    pos = np.array(pos, np.int32)  # cnt = pos + 1
    q = f32(rng, (len(pos), hq, d), 2)
    y, cpu = attn_both(c, q, kv_len, pos)
    check_attn(y, cpu, c.vmax)
    kg, vg = c.gpu
    for i in (0, 1, 3, 7):
        alone = sn.attention(on_gpu(q[i:i + 1]), kg, vg, kv_len, on_gpu(pos[i:i + 1])).numpy()
        np.testing.assert_array_equal(alone[0], y[i], err_msg=f"row {i} alone")
    mask = (rng.random((2, kv_len)) < 0.9).astype(np.int32)
    check_attn(*attn_both(c, q[[1, 7]], kv_len, pos[[1, 7]], causal=False, mask=mask), c.vmax)
    # The tree's rows [c0, c0 + 4) cross the chunk boundary 8256 (= 129 x 64).
    assert_tree_equals_chain(rng, hq, hkv, d, dtype, 8253, (3, 6))


@pytest.mark.parametrize("window", [0, 50])
@gpu_only
def test_attention_gpu_gqa_over_16_heads_and_masked_windows(rng, window):
    """20 q heads per KV head (a row's heads span two of the tensor-core pass's 16-slot m-tiles) and a mask
    with a window (one row per m-tile) match the CPU; each row equals the row alone bitwise."""
    hq, hkv, d, kv_len = 40, 2, 64, 200
    c = Caches(rng, kv_len + 8, hkv, d, "F16", kv_len)
    q = f32(rng, (5, hq, d), 2)
    pos = np.arange(kv_len - 5, kv_len, dtype=np.int32)
    y, cpu = attn_both(c, q, kv_len, pos, window=window)
    check_attn(y, cpu, c.vmax)
    kg, vg = c.gpu
    for i in range(5):
        alone = sn.attention(on_gpu(q[i:i + 1]), kg, vg, kv_len, on_gpu(pos[i:i + 1]), window=window).numpy()
        np.testing.assert_array_equal(alone[0], y[i], err_msg=f"row {i} alone")
    mask = (rng.random((5, kv_len)) < 0.7).astype(np.int32)
    check_attn(*attn_both(c, q, kv_len, pos, causal=False, window=window or 90, mask=mask), c.vmax)


@gpu_only
def test_attention_gpu_non_finite_v_seen_by_another_row(rng):
    """An inf in the F16 V cache (kv_write stores inf past 65504) at the key only the last verify row sees:
    the other rows of the 8-row verify stay finite and equal their decodes bitwise (the tensor-core pass
    reads that chunk once per row: a zero weight times inf would be NaN)."""
    hq, hkv, d, kv_len = 24, 4, 256, 300
    c = Caches(rng, kv_len + 8, hkv, d, "F16", kv_len)
    kg, vg = c.gpu
    big = np.zeros((1, hkv, d), np.float32)
    big[0, :, 7] = 1e6
    sn.kv_write(vg, on_gpu(big), np.array([kv_len - 1], np.int32))
    q = f32(rng, (8, hq, d))
    pos = np.arange(kv_len - 8, kv_len, dtype=np.int32)
    y = sn.attention(on_gpu(q), kg, vg, kv_len, on_gpu(pos)).numpy()
    for i in range(7):
        alone = sn.attention(on_gpu(q[i:i + 1]), kg, vg, kv_len, on_gpu(pos[i:i + 1])).numpy()
        assert np.isfinite(alone).all()
        np.testing.assert_array_equal(alone[0], y[i], err_msg=f"row {i} alone")
    assert not np.isfinite(y[7, :, 7]).any()


@gpu_only
def test_attention_gpu_bad_input(rng):
    raw, _ = empty_cache(16, 2, 64, "F16")
    k, v = on_gpu(raw), on_gpu(raw.copy())
    q = on_gpu(f32(rng, (2, 4, 64)))
    pos = on_gpu(np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="q_pos"):
        sn.attention(q, k, v, 4, on_gpu(np.array([0, -1], np.int32)))
    with pytest.raises(ValueError, match="kv_len"):
        sn.attention(q, k, v, 17, pos)
    with pytest.raises(ValueError, match="mask"):
        sn.attention(q, k, v, 4, pos, mask=on_gpu(np.ones((2, 5), np.int32)))
    with pytest.raises(ValueError, match="multiple"):
        sn.attention(on_gpu(f32(rng, (2, 3, 64))), k, v, 4, pos)
    with pytest.raises(ValueError, match="window"):
        sn.attention(q, k, v, 4, pos, window=-1)


# ------------------------------------------------------- flash attention (exact=False: prefill chunks)

FLASH_MIN_ROWS = 64  # flash::kMinRows (attention_flash.cuh)


def f16_cache(rng, capacity, hkv, d):
    return rng.standard_normal((capacity, hkv, d)).astype(np.float16)


def flash_and_exact(q, k, v, kv_len, pos, **kw):
    """(exact=False, exact=True, default, CPU op) results of one call, numpy."""
    qg, kg, vg, pg = on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(pos)
    y = sn.attention(qg, kg, vg, kv_len, pg, exact=False, **kw).numpy()
    ye = sn.attention(qg, kg, vg, kv_len, pg, exact=True, **kw).numpy()
    yd = sn.attention(qg, kg, vg, kv_len, pg, **kw).numpy()
    cpu = sn.attention(q, k, v, kv_len, pos, **kw).numpy()
    return y, ye, yd, cpu


# (head_dim, hq, hkv, n, c): n query rows at positions c .. c + n - 1 over kv_len = c + n keys (a prefill
# chunk in the middle of a prompt); GQA 6:1 (the 27B's 24 q / 4 KV heads) and 1:1; 100 rows: a ragged
# last slab; 512 rows over 2048 keys: a 27B prefill chunk of 512 tokens (--prefill-chunk 512).
FLASH_CASES = [(d, hq, hkv, n, c) for d in (64, 128, 256) for hq, hkv in ((24, 4), (8, 8)) for n, c in ((64, 0), (100, 700))]
FLASH_CASES += [(d, 24, 4, 512, 1536) for d in (64, 128, 256)] + [(128, 8, 8, 512, 0)]
# GQA 8:1 at head_dim 256: 8 warps, the largest shared-memory launch (192 KiB); 9:1: a group of more
# heads than a block's warps, split over nsub = 2 blocks (idle warps in the second)
FLASH_CASES += [(256, 16, 2, 100, 0), (64, 18, 2, 100, 300)]


@pytest.mark.parametrize("d,hq,hkv,n,c", FLASH_CASES)
@gpu_only
def test_attention_gpu_flash_prefill_vs_cpu(rng, d, hq, hkv, n, c):
    """exact=False takes the tensor-core path (its result differs from exact=True) and stays within
    the flash tolerance of the CPU op (flash_ref.check_flash); exact=True is the default and within the
    exact path's tolerance."""
    kv_len = c + n
    k, v = f16_cache(rng, kv_len + 16, hkv, d), f16_cache(rng, kv_len + 16, hkv, d)
    q = f32(rng, (n, hq, d))
    pos = np.arange(c, kv_len, dtype=np.int32)
    y, ye, yd, cpu = flash_and_exact(q, k, v, kv_len, pos)
    err = check_flash(y, q, k, v, kv_len, pos, ref=cpu, what=f"d={d} {hq}/{hkv} n={n} c={c}")
    np.testing.assert_array_equal(yd, ye)
    check_attn(ye, cpu, float(np.abs(v[:kv_len].astype(np.float32)).max()))
    if not DRYRUN:
        assert not np.array_equal(y, ye), "exact=False did not take the flash path"
        assert err > 0


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 300), (False, 0), (False, 129)])
@gpu_only
def test_attention_gpu_flash_window_bidirectional_and_row_independence(rng, causal, window):
    """Windows and bidirectional rows, unsorted positions, an explicit scale, rows without keys
    (bidirectional window past kv_len: zeros); and a row's flash result does not depend on the other
    rows of the call (key tiles at absolute positions): the last 64 rows of a 100-row call equal a call
    of those rows alone, bit for bit."""
    d, hq, hkv, n, kv_len = 128, 12, 2, 100, 900
    k, v = f16_cache(rng, kv_len, hkv, d), f16_cache(rng, kv_len, hkv, d)
    q = f32(rng, (n, hq, d))
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    y, _, _, cpu = flash_and_exact(q, k, v, kv_len, pos, causal=causal, window=window)
    check_flash(y, q, k, v, kv_len, pos, causal, window, ref=cpu, what=f"causal={causal} window={window}")
    kg, vg = on_gpu(k), on_gpu(v)
    tail = sn.attention(on_gpu(q[n - 64:]), kg, vg, kv_len, on_gpu(pos[n - 64:]), causal=causal, window=window,
                        exact=False).numpy()
    np.testing.assert_array_equal(tail, y[n - 64:])
    pos2 = rng.integers(0, kv_len + 200, n).astype(np.int32)  # any order; some past kv_len
    y2, _, _, cpu2 = flash_and_exact(q, k, v, kv_len, pos2, causal=causal, window=window, scale=0.05)
    check_flash(y2, q, k, v, kv_len, pos2, causal, window, scale=0.05, ref=cpu2, what="random positions")


@gpu_only
def test_attention_gpu_exact_false_falls_back_bitwise(rng):
    """exact=False is bit-identical to exact=True wherever the flash path does not apply: fewer than 64
    rows (verify widths, prefill tails), a mask (tree verify), F32 / Q8_0 / mixed caches, head_dim 96."""
    kv_len, hkv = 300, 2
    pos = np.arange(kv_len - FLASH_MIN_ROWS, kv_len, dtype=np.int32)

    def same(c, q, p, **kw):
        qg, pg = on_gpu(q), on_gpu(p)
        a = sn.attention(qg, c.gpu[0], c.gpu[1], kv_len, pg, exact=False, **kw).numpy()
        b = sn.attention(qg, c.gpu[0], c.gpu[1], kv_len, pg, **kw).numpy()
        np.testing.assert_array_equal(a, b)

    f16 = Caches(rng, kv_len, hkv, 128, "F16", kv_len)
    q = f32(rng, (FLASH_MIN_ROWS, 8, 128))
    same(f16, q[:FLASH_MIN_ROWS - 1], pos[1:])
    for w in (1, 5, 16):
        same(f16, q[:w], pos[-w:])
    mask = np.ones((FLASH_MIN_ROWS, kv_len), np.int32)
    same(f16, q, pos, causal=False, mask=mask)
    for dtype in ("F32", "Q8_0"):
        same(Caches(rng, kv_len, hkv, 128, dtype, kv_len), q, pos)
    mixed = Caches(rng, kv_len, hkv, 128, "F16", kv_len)
    other = Caches(rng, kv_len, hkv, 128, "F32", kv_len)
    mixed.gpu[1] = other.gpu[1]
    same(mixed, q, pos)
    same(Caches(rng, kv_len, 2, 96, "F16", kv_len), f32(rng, (FLASH_MIN_ROWS, 6, 96)), pos)


# ----------------------------------------------------------------------------------------- ssm


# T > 16: the kernel splits the tokens over blocks (kConvTokens), K = 20: chunks of K - 1 tokens
@pytest.mark.parametrize("T,C,K", [(1, 10240, 4), (7, 10240, 4), (2, 100, 1), (1, 33, 3), (9, 6144, 4),
                                   (40, 10240, 4), (33, 300, 1), (50, 130, 20)])
@pytest.mark.parametrize("silu", [True, False])
@gpu_only
def test_conv1d_gpu_vs_cpu_and_split(rng, T, C, K, silu):
    x, w, st = f32(rng, (T, C)), f32(rng, (K, C), 0.5), f32(rng, (K - 1, C))
    st_cpu = st.copy()
    cpu = sn.conv1d_causal(x, w, st_cpu, silu).numpy()
    sg = on_gpu(st)
    wg = on_gpu(w)
    y = sn.conv1d_causal(on_gpu(x), wg, sg, silu)
    assert y.device == DEV and y.shape == (T, C)
    y = y.numpy()
    if silu:
        ulp_close(y, cpu)  # the device's and the host's double exp
    else:  # the same products and sums in the same order, no FMA on either side (-ffp-contract=off)
        np.testing.assert_array_equal(y.view(np.uint32), cpu.view(np.uint32))
    np.testing.assert_array_equal(sg.numpy(), st_cpu)
    # token by token with the carried state: bitwise the same
    s2 = on_gpu(st)
    ys = np.concatenate([sn.conv1d_causal(on_gpu(x[t:t + 1]), wg, s2, silu).numpy() for t in range(T)])
    np.testing.assert_array_equal(ys, y)
    np.testing.assert_array_equal(s2.numpy(), sg.numpy())


@pytest.mark.parametrize("T,C", [(1, 10240), (3, 130), (40, 10240)])
@pytest.mark.parametrize("silu", [True, False])
@gpu_only
def test_conv1d_gpu_taps_kernel_equals_generic(rng, T, C, silu):
    """K = 4 runs the register-window kernel, other K the generic one. A K = 5 conv whose first tap is 0 (and
    whose first state row is anything) is the K = 4 conv in exact arithmetic and in F32 (0 * X + 0 = +0 starts
    the same sums), so the generic kernel must give the window kernel's bits, and the same last 3 state rows."""
    x, w, st = f32(rng, (T, C)), f32(rng, (4, C), 0.5), f32(rng, (3, C))
    s4, s5 = on_gpu(st), on_gpu(np.concatenate([f32(rng, (1, C)), st]))
    y4 = sn.conv1d_causal(on_gpu(x), on_gpu(w), s4, silu).numpy()
    y5 = sn.conv1d_causal(on_gpu(x), on_gpu(np.concatenate([np.zeros((1, C), np.float32), w])), s5, silu).numpy()
    np.testing.assert_array_equal(y5.view(np.uint32), y4.view(np.uint32))
    np.testing.assert_array_equal(s5.numpy()[1:], s4.numpy())


def gdn_inputs(rng, T, hk, hv, dk, dv):
    def l2(a):
        return (a / np.sqrt((a.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6)).astype(np.float32)
    q, k = l2(f32(rng, (T, hk, dk))), l2(f32(rng, (T, hk, dk)))
    v = f32(rng, (T, hv, dv))
    g = -np.abs(f32(rng, (T, hv), 0.5))
    beta = (1 / (1 + np.exp(-f32(rng, (T, hv))))).astype(np.float32)
    state = f32(rng, (hv, dv, dk), 0.1)
    return q, k, v, g, beta, state


# (hk, hv, dk, dv): the 27B, a small one, a fallback shape (dk not in {32,64,128})
GDN_SHAPES = [(16, 48, 128, 128), (2, 4, 64, 32), (1, 2, 48, 40), (2, 2, 32, 256), (2, 2, 48, 64)]  # last: dv % 32 == 0 with the fallback's dk


@pytest.mark.parametrize("shape", GDN_SHAPES)
@pytest.mark.parametrize("T", [1, 8, 21])  # 21: stages of 8 tokens and a ragged one; the split below crosses a stage
@gpu_only
def test_gdn_gpu_vs_cpu(rng, shape, T):
    hk, hv, dk, dv = shape
    q, k, v, g, beta, state = gdn_inputs(rng, T, hk, hv, dk, dv)
    scale = 1 / np.sqrt(dk)
    st_cpu = state.copy()
    ck_cpu = np.zeros((T, hv, dv, dk), np.float32)
    cpu = sn.gated_delta_net(q, k, v, g, beta, st_cpu, scale, ck_cpu).numpy()
    sg = on_gpu(state)
    ckg = on_gpu(np.zeros((T, hv, dv, dk), np.float32))
    args = [on_gpu(a) for a in (q, k, v, g, beta)]
    y = sn.gated_delta_net(*args, sg, scale, ckg)
    assert y.device == DEV and y.shape == (T, hv, dv)
    y = y.numpy()
    np.testing.assert_allclose(y, cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())
    np.testing.assert_allclose(sg.numpy(), st_cpu, rtol=1e-4, atol=1e-4 * np.abs(st_cpu).max())
    np.testing.assert_allclose(ckg.numpy(), ck_cpu, rtol=1e-4, atol=1e-4 * np.abs(ck_cpu).max())
    np.testing.assert_array_equal(ckg.numpy()[-1], sg.numpy())
    # Split into calls with the carried state (no checkpoints): bitwise equal outputs and state.
    s2 = on_gpu(state)
    ys = []
    for t0, t1 in [(0, T // 2), (T // 2, T)]:
        if t1 > t0:
            ys.append(sn.gated_delta_net(*[on_gpu(a[t0:t1]) for a in (q, k, v, g, beta)], s2, scale).numpy())
    np.testing.assert_array_equal(np.concatenate(ys), y)
    np.testing.assert_array_equal(s2.numpy(), sg.numpy())


@pytest.mark.parametrize("shape", GDN_SHAPES)
@pytest.mark.parametrize("T", [0, 1, 8, 21])
@gpu_only
def test_gdn_gpu_state_out(rng, shape, T):
    """Out of place (state_out) equals in place bitwise (outputs, state, checkpoints) and leaves
    state untouched, for the register kernels (split and whole heads) and the fallback."""
    hk, hv, dk, dv = shape
    q, k, v, g, beta, state = gdn_inputs(rng, T, hk, hv, dk, dv)
    args = [on_gpu(a) for a in (q, k, v, g, beta)]
    s_in, ck_in = on_gpu(state), on_gpu(np.zeros((T, hv, dv, dk), np.float32))
    y_in = sn.gated_delta_net(*args, s_in, 0.2, ck_in).numpy()
    src, s_out = on_gpu(state), on_gpu(np.full_like(state, np.nan))
    ck_out = on_gpu(np.zeros((T, hv, dv, dk), np.float32))
    y_out = sn.gated_delta_net(*args, src, 0.2, ck_out, state_out=s_out).numpy()
    np.testing.assert_array_equal(y_out, y_in)
    np.testing.assert_array_equal(s_out.numpy(), s_in.numpy())
    np.testing.assert_array_equal(ck_out.numpy(), ck_in.numpy())
    np.testing.assert_array_equal(src.numpy(), state)


# (layers, T, K): the 27B's 48 GDN layers at the commits of AL 1 / 3 / 7 of a verify (fewer rows than K - 1 too);
# 70 layers: two launches (64 a launch); K = 1: no state; T = 0: nothing moves.
@pytest.mark.parametrize("layers,T,K", [(48, 1, 4), (48, 3, 4), (48, 7, 4), (70, 2, 4), (3, 5, 2), (2, 3, 1),
                                        (3, 0, 4)])
@gpu_only
def test_conv1d_causal_states_gpu_equals_each_layer(rng, layers, T, K):
    """One launch for every layer's conv state: bitwise what conv1d_causal leaves in each state, on the GPU and
    on the CPU (the state is a copy of [state ; x]'s last K - 1 rows)."""
    C = 10240 if layers == 48 else 130
    xs = [f32(rng, (8, C))[:T] for _ in range(layers)]  # a verify's leading rows
    w = f32(rng, (K, C), 0.5)
    states = [f32(rng, (K - 1, C)) for _ in range(layers)]
    want_gpu, want_cpu = [], []
    for x, s in zip(xs, states):
        one = on_gpu(s)
        sn.conv1d_causal(on_gpu(x), on_gpu(w), one, False)
        want_gpu.append(one.numpy())
        cpu = s.copy()
        sn.conv1d_causal(x, w, cpu, False)
        want_cpu.append(cpu)
    sg = [on_gpu(s) for s in states]
    sn.conv1d_causal_states([on_gpu(x) for x in xs], sg)
    for got, a, b in zip(sg, want_gpu, want_cpu):
        np.testing.assert_array_equal(got.numpy(), a)
        np.testing.assert_array_equal(got.numpy(), b)


# (layers, T, shape): the 27B's 48 layers at AL 1 / 3 / 7 and past a stage of 8 tokens; 70 layers of a small shape
# (two launches); whole-head register blocks; the fallback recurrence (dk 48: a layer at a time).
@pytest.mark.parametrize("layers,T,shape", [(48, 1, (16, 48, 128, 128)), (48, 3, (16, 48, 128, 128)),
                                            (48, 7, (16, 48, 128, 128)), (4, 9, (16, 48, 128, 128)),
                                            (70, 3, (2, 4, 64, 32)), (3, 5, (1, 2, 64, 40)),
                                            (3, 4, (2, 2, 48, 64)), (3, 0, (2, 4, 64, 32))])
@gpu_only
def test_gated_delta_net_states_gpu_equals_each_layer(rng, layers, T, shape):
    """One launch for every layer's recurrence: each state bitwise gated_delta_net's on the GPU (what makes a
    commit's state that of plain decoding) and within gated_delta_net's tolerance of the CPU op."""
    hk, hv, dk, dv = shape
    ins = [gdn_inputs(rng, T, hk, hv, dk, dv) for _ in range(layers)]
    scale = 1 / np.sqrt(dk)
    sg = [on_gpu(x[5]) for x in ins]
    args = [[on_gpu(x[f]) for x in ins] for f in range(5)]
    sn.gated_delta_net_states(*args, sg, scale)
    for i, x in enumerate(ins):
        one = on_gpu(x[5])
        sn.gated_delta_net(*(a[i] for a in args), one, scale)
        np.testing.assert_array_equal(sg[i].numpy().view(np.uint32), one.numpy().view(np.uint32))
        cpu = x[5].copy()
        sn.gated_delta_net(*x[:5], cpu, scale)
        np.testing.assert_allclose(sg[i].numpy(), cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())


@gpu_only
def test_commit_states_gpu_errors(rng):
    """Bad arguments raise before anything runs (every state untouched): a layer's wrong shape, a state on the
    host beside device ones, two layers sharing a state."""
    q, k, v, g, beta, s = gdn_inputs(rng, 2, 2, 4, 64, 32)
    args = [[on_gpu(a)] * 2 for a in (q, k, v, g, beta)]
    s0, s1 = on_gpu(s), on_gpu(s)
    with pytest.raises(ValueError, match=r"layer 1: state must be \[Hv, dv, dk\] = \[4, 32, 64\], got \[2, 32, 64\]"):
        sn.gated_delta_net_states(*args, [s0, on_gpu(s[:2])], 0.1)
    with pytest.raises(ValueError, match=r"layer 1: v has 1 tokens, q has 2"):
        sn.gated_delta_net_states(*args[:2], [args[2][0], on_gpu(v[:1])], *args[3:], [s0, s1], 0.1)
    if not DRYRUN:
        with pytest.raises(ValueError, match="layer 1: state must be on the GPU"):
            sn.gated_delta_net_states(*args, [s0, s.copy()], 0.1)
    with pytest.raises(ValueError, match="the states of layers 0 and 1 overlap"):
        sn.gated_delta_net_states(*args, [s0, s0], 0.1)
    np.testing.assert_array_equal(s0.numpy(), s)
    np.testing.assert_array_equal(s1.numpy(), s)
    x, st = f32(rng, (2, 40)), f32(rng, (3, 40))
    c0 = on_gpu(st)
    with pytest.raises(ValueError, match=r"layer 1: x must be \[T, C\] = \[2, 40\]"):
        sn.conv1d_causal_states([on_gpu(x), on_gpu(x[:1])], [c0, on_gpu(st)])
    np.testing.assert_array_equal(c0.numpy(), st)


def gdn_step_inputs(rng, T, hk, hv, dk, dv):
    """gdn_step's inputs: cv (conv output, silu'd scale), a, b, dt, ssm_a, state."""
    cv = f32(rng, (T, 2 * hk * dk + hv * dv))
    a, b = f32(rng, (T, hv)), f32(rng, (T, hv))
    dt, ssm_a = f32(rng, (1, hv), 0.5), -np.abs(f32(rng, (1, hv)))
    state = f32(rng, (hv, dv, dk), 0.1)
    return cv, a, b, dt, ssm_a, state


def gdn_step_composed(cv, a, b, dt, ssm_a, state, hk, dk, hv, dv, eps, scale, state_out=None):
    """What gdn_step stands for: the three ops on cv's device."""
    q, k, v = sn.gdn_qkv(cv, hk, dk, hv, dv, eps)
    g, beta = sn.gdn_gates(a, b, dt, ssm_a)
    return sn.gated_delta_net(q, k, v, g, beta, state, scale, state_out=state_out), q, k, v, g, beta


# (hk, hv, dk, dv): the 27B (4 blocks of 32 state rows per head), GQA 2:1 with dk 64 and dk 32, whole-head
# register blocks (dv 40), dv 256 at dk 128 (8 row blocks), and shapes gdn_step composes (dk 48: the fallback
# recurrence; dv 36 at dk 64: 144 threads, not whole warps)
GDN_STEP_SHAPES = [(16, 48, 128, 128), (2, 4, 64, 32), (2, 2, 32, 256), (1, 2, 64, 40), (2, 2, 48, 64), (1, 2, 64, 36),
                   (1, 1, 128, 256)]


@pytest.mark.parametrize("shape", GDN_STEP_SHAPES)
@pytest.mark.parametrize("T", [0, 1, 3, 8, 17])  # 8 / 17: one stage of 8 tokens, stages and a ragged one
@gpu_only
def test_gdn_step_gpu_equals_composition_bitwise(rng, shape, T):
    """gdn_step (its one launch where it fuses) gives bit for bit what gdn_qkv, gdn_gates and gated_delta_net
    give on the GPU: o, the pending q / k / v / g / beta, and the state, in place and out of place (state then
    untouched); and it matches the CPU op (the composition) within the recurrence's tolerance."""
    hk, hv, dk, dv = shape
    cv, a, b, dt, ssm_a, state = gdn_step_inputs(rng, T, hk, hv, dk, dv)
    dims, eps, scale = (hk, dk, hv, dv), 1e-6, 1 / np.sqrt(dk)
    g_in = [on_gpu(x) for x in (cv, a, b, dt, ssm_a)]
    s_ref = on_gpu(state)
    ref = [t.numpy() for t in gdn_step_composed(*g_in, s_ref, *dims, eps, scale)]
    s_in = on_gpu(state)
    got = sn.gdn_step(*g_in, s_in, *dims, eps, scale)
    assert got[0].device == DEV and got[0].shape == (T, hv, dv)
    for name, x, r in zip(("o", "q", "k", "v", "g", "beta"), got, ref):
        np.testing.assert_array_equal(x.numpy(), r, err_msg=name)
    np.testing.assert_array_equal(s_in.numpy(), s_ref.numpy())
    src, s_out = on_gpu(state), on_gpu(np.full_like(state, np.nan))
    o_out = sn.gdn_step(*g_in, src, *dims, eps, scale, state_out=s_out)[0]
    np.testing.assert_array_equal(o_out.numpy(), ref[0])
    np.testing.assert_array_equal(s_out.numpy(), s_ref.numpy())
    np.testing.assert_array_equal(src.numpy(), state)
    st_cpu = state.copy()
    cpu = sn.gdn_step(cv, a, b, dt, ssm_a, st_cpu, *dims, eps, scale)[0].numpy()
    if T:
        np.testing.assert_allclose(ref[0], cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())
        np.testing.assert_allclose(s_ref.numpy(), st_cpu, rtol=1e-4, atol=1e-4 * np.abs(st_cpu).max())


@gpu_only
def test_gdn_step_gpu_errors(rng):
    """Bad arguments raise ValueError before anything runs (state and state_out untouched)."""
    hk, hv, dk, dv, T = 2, 4, 64, 32, 5
    cv, a, b, dt, ssm_a, state = gdn_step_inputs(rng, T, hk, hv, dk, dv)
    dims = (hk, dk, hv, dv)
    g_in = [on_gpu(x) for x in (cv, a, b, dt, ssm_a)]
    sg, out = on_gpu(state), on_gpu(np.full_like(state, 7.0))
    for match, kw in [("gdn_gates", dict(a=on_gpu(a[:, :3]))), ("scale", dict(scale=np.nan))]:
        args = dict(a=g_in[1], scale=0.1) | kw
        with pytest.raises(ValueError, match=match):
            sn.gdn_step(g_in[0], args["a"], *g_in[2:], sg, *dims, 1e-6, args["scale"], state_out=out)
        with pytest.raises(ValueError, match=match):
            sn.gdn_step(g_in[0], args["a"], *g_in[2:], sg, *dims, 1e-6, args["scale"])
    np.testing.assert_array_equal(sg.numpy(), state)
    assert (out.numpy() == 7.0).all()
    with pytest.raises(ValueError, match="state"):
        sn.gdn_step(*g_in, on_gpu(state[:1].copy()), *dims, 1e-6, 0.1)


def gemv_weight(rng, name, out, k):
    """A weight [out, k] of format `name` on the test device (random valid blocks; *_TILED: tiled for the GEMV)."""
    base = name[: -len("_TILED")] if name.endswith("_TILED") else name
    if base == "F32":
        return on_gpu(f32(rng, (out, k), 0.05))
    w = on_gpu(random_blocks(rng, base, out, k), getattr(sn.DType, base))
    return sn.tile_for_gemv(w) if name.endswith("_TILED") and not DRYRUN else w


def gdn_step_gated_composed(cv, a, b, dt, ssm_a, state, dims, eps, scale, nw, z, ws, partials, state_out=None):
    """What gdn_step_gated_matmul stands for: gdn_step, then rms_norm_gated_matmul of its o."""
    o, *pend = sn.gdn_step(cv, a, b, dt, ssm_a, state, *dims, eps, scale, state_out=state_out)
    return sn.rms_norm_gated_matmul(o, nw, eps, z, ws, partials=partials), pend


# (hk, hv, dk, dv, ws): the 27B (its out projection Q6_K, tiled), dk 64 / dv 64 (4 heads a split group), dk 32 /
# dv 32 (8), dv 256 (one head a group), and shapes the op composes: hv dv not whole groups (3 heads of 128), dv 48
# (whole-head blocks), a float weight in ws.
GATED_SHAPES = [(16, 48, 128, 128, ["Q6_K_TILED"]), (2, 4, 64, 64, ["IQ4_XS_TILED", "Q8_0"]),
                (1, 8, 32, 32, ["Q4_K"]), (1, 2, 128, 256, ["IQ4_XS"]), (1, 3, 128, 128, ["Q8_0"]),
                (1, 2, 64, 48, ["Q8_0"]), (2, 4, 64, 64, ["Q8_0", "F32"])]


@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("T", [0, 1, 4, 16, 17])  # 16: every block rank of a cluster splits two tokens; 17: composed
@gpu_only
def test_gdn_step_gated_matmul_gpu_equals_composition_bitwise(rng, shape, T):
    """gdn_step_gated_matmul (one launch steps, norms and splits where it fuses: gdn_step_split_kernel) gives bit
    for bit gdn_step then rms_norm_gated_matmul on the GPU: the projections (summed and as partials), the pending
    q / k / v / g / beta and the state, in place and out of place (the state then untouched), with and without a
    norm weight; and it matches the CPU op within the recurrence's tolerance."""
    hk, hv, dk, dv, names = shape
    dims, eps, scale = (hk, dk, hv, dv), 1e-6, 1 / np.sqrt(dk)
    cv, a, b, dt, ssm_a, state = gdn_step_inputs(rng, T, hk, hv, dk, dv)
    z = f32(rng, (T, hv, dv), 2.0)
    nw_host = (1.0 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    ws = [gemv_weight(rng, name, int(rng.integers(1, 4)) * 64, hv * dv) for name in names]
    g_in = [on_gpu(x) for x in (cv, a, b, dt, ssm_a)]
    zg = on_gpu(z)
    for nw, partials in ((on_gpu(nw_host), False), (None, True)):
        s_ref, s_in = on_gpu(state), on_gpu(state)
        ys_ref, pend_ref = gdn_step_gated_composed(*g_in, s_ref, dims, eps, scale, nw, zg, ws, partials)
        ys, *pend = sn.gdn_step_gated_matmul(*g_in, s_in, *dims, eps, scale, nw, zg, ws, partials=partials)
        for y, want in zip(ys, ys_ref):
            assert y.device == DEV and y.shape == want.shape
            np.testing.assert_array_equal(y.numpy().view(np.uint32), want.numpy().view(np.uint32))
        for name, x, r in zip(("q", "k", "v", "g", "beta"), pend, pend_ref):
            np.testing.assert_array_equal(x.numpy(), r.numpy(), err_msg=name)
        np.testing.assert_array_equal(s_in.numpy(), s_ref.numpy())
        src, s_out = on_gpu(state), on_gpu(np.full_like(state, np.nan))
        ys_out, *_ = sn.gdn_step_gated_matmul(*g_in, src, *dims, eps, scale, nw, zg, ws, partials=partials,
                                              state_out=s_out)
        for y, want in zip(ys_out, ys_ref):
            np.testing.assert_array_equal(y.numpy().view(np.uint32), want.numpy().view(np.uint32))
        np.testing.assert_array_equal(s_out.numpy(), s_ref.numpy())
        np.testing.assert_array_equal(src.numpy(), state)
    if T:  # against the CPU op (the composition on the CPU), no partials
        w_cpu = [sn.Tensor(random_blocks(np.random.default_rng(7), "Q8_0", 64, hv * dv), sn.DType.Q8_0)]
        w_dev = [on_gpu(w_cpu[0].numpy(), sn.DType.Q8_0)]
        st_cpu, st_dev = state.copy(), on_gpu(state)
        y_cpu = sn.gdn_step_gated_matmul(cv, a, b, dt, ssm_a, st_cpu, *dims, eps, scale, nw_host, z, w_cpu)[0][0]
        y_dev = sn.gdn_step_gated_matmul(*g_in, st_dev, *dims, eps, scale, on_gpu(nw_host), zg, w_dev)[0][0]
        y_cpu = np.asarray(y_cpu.numpy() if hasattr(y_cpu, "numpy") else y_cpu)
        np.testing.assert_allclose(y_dev.numpy(), y_cpu, rtol=1e-3, atol=1e-3 * np.abs(y_cpu).max())
        np.testing.assert_allclose(st_dev.numpy(), st_cpu, rtol=1e-4, atol=1e-4 * np.abs(st_cpu).max())


@gpu_only
def test_gdn_step_gated_matmul_gpu_errors(rng):
    """Bad arguments raise ValueError naming them before anything runs: the state (in place) and state_out are
    left as they were, whether the bad argument is the step's, the norm's or a weight."""
    hk, hv, dk, dv, T = 1, 2, 128, 128, 2
    dims = (hk, dk, hv, dv)
    cv, a, b, dt, ssm_a, state = gdn_step_inputs(rng, T, hk, hv, dk, dv)
    g_in = [on_gpu(x) for x in (cv, a, b, dt, ssm_a)]
    z, nw = on_gpu(f32(rng, (T, hv, dv))), on_gpu(np.ones(dv, np.float32))
    w = gemv_weight(rng, "Q8_0", 64, hv * dv)
    cases = [("gdn_gates", dict(a=on_gpu(a[:, :1]))), ("scale", dict(scale=np.nan)),
             ("z must be", dict(z=on_gpu(f32(rng, (T, hv, 64))))),
             ("norm_weight must be", dict(nw=on_gpu(np.ones(dv + 1, np.float32)))),
             (r"w \(i = 0\)|ws\[0\]", dict(ws=[gemv_weight(rng, "Q8_0", 64, hv * dv + 32)]))]  # GPU | CPU
    for in_place in (True, False):
        for match, bad in cases:
            args = dict(a=g_in[1], scale=0.1, z=z, nw=nw, ws=[w]) | bad
            sg, out = on_gpu(state), on_gpu(np.full_like(state, 7.0))
            with pytest.raises(ValueError, match=match):
                sn.gdn_step_gated_matmul(g_in[0], args["a"], *g_in[2:], sg, *dims, 1e-6, args["scale"], args["nw"],
                                         args["z"], args["ws"], state_out=None if in_place else out)
            np.testing.assert_array_equal(sg.numpy(), state, err_msg=match)
            assert (out.numpy() == 7.0).all(), match
    flat = on_gpu(state.reshape(-1))  # z a view of the state written (the fused kernel would read it as it changes)
    sg = flat.view_rows(0, state.size).reshape(list(state.shape))
    with pytest.raises(ValueError, match="z must not overlap the state written"):
        sn.gdn_step_gated_matmul(*g_in, sg, *dims, 1e-6, 0.1, nw, flat.view_rows(0, z.shape[0] * hv * dv).reshape(
            [T, hv, dv]), [w])
    np.testing.assert_array_equal(sg.numpy(), state)


@gpu_only
def test_gdn_step_gated_matmul_is_one_fused_launch(rng):
    """At the 27B's shapes on an sm_90 device gdn_step_gated_matmul runs gdn_step_split_kernel and the GEMV, not the
    composition's gdn_step_kernel and gated_norm_split_kernel (the bitwise tests above would pass on the composition
    too). Kernel names from torch.profiler's CUDA activity trace."""
    if DRYRUN:
        pytest.skip("kernel names exist on a GPU only")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the fused kernel needs thread-block clusters (sm_90)")
    from torch.profiler import ProfilerActivity, profile
    hk, hv, dk, dv, T = 16, 48, 128, 128, 1
    cv, a, b, dt, ssm_a, state = gdn_step_inputs(rng, T, hk, hv, dk, dv)
    args = [on_gpu(x) for x in (cv, a, b, dt, ssm_a, state)] + [hk, dk, hv, dv, 1e-6, 1 / np.sqrt(dk)]
    norm = [on_gpu(np.ones(dv, np.float32)), on_gpu(f32(rng, (T, hv, dv))),
            [gemv_weight(rng, "Q6_K_TILED", 5120, hv * dv)]]
    sn.gdn_step_gated_matmul(*args, *norm)  # loads the kernels
    sn.gpu_synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sn.gdn_step_gated_matmul(*args, *norm)
        sn.gpu_synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("gdn_step_split_kernel" in n for n in names) == 1, names
    assert not any("gdn_step_kernel" in n or "gated_norm_split_kernel" in n for n in names), names


# (hk, hv, dk, dv) of the chunked path (dk 32 / 64 / 128, dv % 16 == 0) and T: one chunk, ragged chunks
GDN_CHUNKED = [((16, 48, 128, 128), 200), ((2, 4, 64, 32), 64), ((2, 4, 64, 32), 130), ((2, 2, 32, 256), 300),
               ((1, 3, 128, 16), 65)]


@pytest.mark.parametrize("shape,T", GDN_CHUNKED)
@gpu_only
def test_gdn_gpu_chunked_vs_cpu(rng, shape, T):
    """exact=False (prefill): the chunked recurrence against the CPU op (token by token), in place and out of
    place; then the tokens split over two calls (129 + the rest) carrying the state: still within the
    tolerance of the CPU's one call."""
    hk, hv, dk, dv = shape
    q, k, v, g, beta, state = gdn_inputs(rng, T, hk, hv, dk, dv)
    g *= 4  # decays down to ~e^-8 per token: the chunk's exp(G_i - G_j) spans many orders of magnitude
    scale = 1 / np.sqrt(dk)
    st_cpu = state.copy()
    cpu = sn.gated_delta_net(q, k, v, g, beta, st_cpu, scale).numpy()
    args = [on_gpu(a) for a in (q, k, v, g, beta)]

    def close(y, ref):
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    sg = on_gpu(state)
    y = sn.gated_delta_net(*args, sg, scale, exact=False).numpy()
    close(y, cpu)
    close(sg.numpy(), st_cpu)
    src, s_out = on_gpu(state), on_gpu(np.full_like(state, np.nan))
    y_out = sn.gated_delta_net(*args, src, scale, state_out=s_out, exact=False).numpy()
    np.testing.assert_array_equal(y_out, y)
    np.testing.assert_array_equal(s_out.numpy(), sg.numpy())
    np.testing.assert_array_equal(src.numpy(), state)
    if T > 129:
        s2 = on_gpu(state)
        ys = [sn.gated_delta_net(*[on_gpu(a[t0:t1]) for a in (q, k, v, g, beta)], s2, scale, exact=False).numpy()
              for t0, t1 in [(0, 129), (129, T)]]
        close(np.concatenate(ys), cpu)
        close(s2.numpy(), st_cpu)


@pytest.mark.parametrize("case", ["short", "checkpoints", "dk48", "dv24"])
@gpu_only
def test_gdn_gpu_inexact_falls_back_bitwise(rng, case):
    """exact=False where the chunked path does not apply (< 64 tokens, checkpoints, dk 48, dv % 16 != 0) is the
    token kernel."""
    hk, hv, dk, dv = {"dk48": (2, 2, 48, 64), "dv24": (1, 2, 64, 24)}.get(case, (2, 4, 64, 32))
    T = 63 if case == "short" else 70
    q, k, v, g, beta, state = gdn_inputs(rng, T, hk, hv, dk, dv)
    args = [on_gpu(a) for a in (q, k, v, g, beta)]
    ck = (lambda: on_gpu(np.zeros((T, hv, dv, dk), np.float32))) if case == "checkpoints" else (lambda: None)
    sa, sb = on_gpu(state), on_gpu(state)
    ya = sn.gated_delta_net(*args, sa, 0.2, ck()).numpy()
    yb = sn.gated_delta_net(*args, sb, 0.2, ck(), exact=False).numpy()
    np.testing.assert_array_equal(yb, ya)
    np.testing.assert_array_equal(sb.numpy(), sa.numpy())


@pytest.mark.parametrize("T", [0, 1, 2, 5, 8, 16, 17, 40])
@pytest.mark.parametrize("K", [4, 2])
@gpu_only
def test_conv1d_gpu_state_out(rng, T, K):
    """Out of place (a token a chunk up to 16 tokens, the verify widths) equals in place (chunks of 16 tokens) bit for
    bit, outputs and state, and leaves the source state alone; K 4 (the register-window kernel) and 2 (the generic)."""
    C = 300
    x, w, st = f32(rng, (T, C)), f32(rng, (K, C)), f32(rng, (K - 1, C))
    xg, wg = on_gpu(x), on_gpu(w)
    s_in = on_gpu(st)
    y_in = sn.conv1d_causal(xg, wg, s_in).numpy()
    src, s_out = on_gpu(st), on_gpu(np.full_like(st, np.nan))
    y_out = sn.conv1d_causal(xg, wg, src, state_out=s_out).numpy()
    np.testing.assert_array_equal(y_out, y_in)
    np.testing.assert_array_equal(s_out.numpy(), s_in.numpy())
    np.testing.assert_array_equal(src.numpy(), st)


@gpu_only
def test_ssm_gpu_bad_input(rng):
    q, k, v, g, beta, state = gdn_inputs(rng, 2, 2, 4, 64, 32)
    args = [on_gpu(a) for a in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="state"):
        sn.gated_delta_net(*args, on_gpu(state[:3]), 0.1)
    with pytest.raises(ValueError, match="checkpoints"):
        sn.gated_delta_net(*args, on_gpu(state), 0.1, on_gpu(np.zeros((1, 4, 32, 64), np.float32)))
    with pytest.raises(ValueError, match="state_out has the wrong shape"):
        sn.gated_delta_net(*args, on_gpu(state), 0.1, state_out=on_gpu(state[:3]))
    with pytest.raises(ValueError, match="weight"):
        sn.conv1d_causal(on_gpu(f32(rng, (2, 8))), on_gpu(f32(rng, (4, 9))), on_gpu(f32(rng, (3, 8))))


# ---------------------------------------------------------------------------------------- topk


@pytest.mark.parametrize("shape,k", [((1, 248320), 8), ((5, 1000), 1), ((3, 37), 37), ((2, 4, 513), 20)])
@gpu_only
def test_topk_gpu_exact(rng, shape, k):
    x = f32(rng, shape)
    flat = x.reshape(-1, shape[-1])
    flat[0, 3] = flat[0, 5] = flat[0].max() + 1  # tie: lower index first
    if shape[-1] > 40:
        flat[-1, 7] = np.nan
        flat[-1, 9] = np.nan
        flat[-1, 11] = np.inf
        flat[-1, 12] = -0.0
        flat[-1, 13] = 0.0
    cv, ci = sn.topk(x, k)
    gv, gi = sn.topk(on_gpu(x), k)
    assert gv.device == DEV and gv.shape == shape[:-1] + (k,)
    np.testing.assert_array_equal(gi.numpy(), ci.numpy())
    np.testing.assert_array_equal(gv.numpy(), cv.numpy())


@gpu_only
def test_topk_gpu_bad_k(rng):
    with pytest.raises(ValueError, match="k must be"):
        sn.topk(on_gpu(f32(rng, (2, 5))), 6)


def topk_specials(rng, x):
    """x [n, V] with, by row: NaNs, +-inf; -0.0 / +0.0 tied at the top; the maximum repeated (ties)."""
    n, V = x.shape
    for r in range(n):
        pos = rng.choice(V, size=min(V, 6), replace=False)
        if r % 4 == 1:
            x[r, pos[:2]] = np.nan
            x[r, pos[2:3]] = np.inf
            x[r, pos[3:4]] = -np.inf
        elif r % 4 == 2:
            x[r] = -np.abs(x[r])
            x[r, pos[:3]] = -0.0
            x[r, pos[3:]] = 0.0
        elif r % 4 == 3:
            x[r, pos] = x[r].max()
    return x


def check_topk_gpu(x, k, alone=()):
    """sn.topk on the GPU == the CPU op, values bit for bit (-0.0, NaN) and indices; each row in `alone`
    run by itself gives its result among the others (batch invariance)."""
    cv, ci = sn.topk(x, k)
    gv, gi = sn.topk(on_gpu(x), k)
    assert gv.device == DEV and gv.shape == x.shape[:-1] + (k,) and gi.shape == gv.shape
    gv, gi = gv.numpy(), gi.numpy()
    np.testing.assert_array_equal(gi, ci.numpy())
    np.testing.assert_array_equal(gv.view(np.uint32), cv.numpy().view(np.uint32))
    for r in alone:
        ov, oi = sn.topk(on_gpu(x[r:r + 1]), k)
        np.testing.assert_array_equal(oi.numpy(), gi[r:r + 1])
        np.testing.assert_array_equal(ov.numpy().view(np.uint32), gv[r:r + 1].view(np.uint32))


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("V", [1, 7, 255, 256, 257, 4096, 4097, 20000])
@pytest.mark.parametrize("k", [1, 16, 64, "V"])
@gpu_only
def test_topk_gpu_matrix(rng, rows, V, k):
    """Every path of topk.cuh (chunk maxima + select, rounds for k > chunks, k = V), V at and around the
    chunk edges, specials in the rows, bit-identical to the CPU op and batch invariant."""
    k = V if k == "V" else k
    if k > V:
        pytest.skip("k > V")
    x = topk_specials(rng, f32(rng, (rows, V)))
    check_topk_gpu(x, k, alone=sorted({0, rows - 1, min(3, rows - 1)}))


@pytest.mark.parametrize("k", [1, 16, 64])
@gpu_only
def test_topk_gpu_vocab(rng, k):
    """The DFlash 2 drafter's shape [8, 248320] (k = 16 there), with specials; a row alone == among 8."""
    x = topk_specials(rng, f32(rng, (8, 248320)))
    check_topk_gpu(x, k, alone=[0, 5])


@gpu_only
def test_topk_gpu_long_row(rng):
    """A row past kMaxChunks chunks of 4096 (5e6 entries: 8192-entry chunks, the plan's lg > 12)."""
    check_topk_gpu(topk_specials(rng, f32(rng, (1, 5_000_000))), 16)


@pytest.mark.parametrize("k", [1, 5, 16, 64])
@gpu_only
def test_topk_gpu_chunk_edge_ties(rng, k):
    """Ties straddling every chunk edge of the split path (the lower index wins across chunks), equal
    chunk maxima (the k-th chunk maximum decided by index), NaNs across an edge."""
    V = 20000
    lg, chunks, split = topk_plan(V, k)
    assert split
    C = 1 << lg
    x = f32(rng, (3, V))
    for e in range(1, chunks):
        x[0, e * C - 1] = x[0, e * C] = 9.0
    x[1, ::C] = 5.0
    x[1, 3 * C + 7] = 5.0
    x[2, C - 2:C + 2] = np.nan
    x[2, 2 * C] = -0.0
    x[2, 2 * C + 1] = np.inf
    check_topk_gpu(x, k, alone=[1])


@pytest.mark.parametrize("V", [4097, 40000, 248320])
@gpu_only
def test_topk_gpu_many_ties(rng, V):
    """Rows where thousands of entries tie with the k-th best (all zeros, mostly -inf with 5 finite
    entries, one repeated value with a -0.0 and a NaN): the select kernel's overflow rounds."""
    x = np.zeros((4, V), np.float32)
    x[1] = -np.inf
    x[1, rng.choice(V, 5, replace=False)] = f32(rng, 5)
    x[2] = np.float32(1.5)
    x[2, V // 3] = -0.0
    x[2, V // 2] = np.nan
    x[3] = -0.0
    x[3, V - 1] = 0.0
    for k in (1, 16, 64):
        check_topk_gpu(x, k, alone=[1, 2])
