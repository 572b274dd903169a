"""Gated DeltaNet conv and recurrence against float64 loop references (qwen35-target.md §6.5; the
recurrence's: tests/native/gdn_ref.py)."""
import os
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gdn_ref import gdn_ref, gdn_step_inputs_ref, silu64  # noqa: E402
from quant_blocks import random_blocks  # noqa: E402

CONV_TOL = 1e-6  # K-term F32 sums (+ silu) vs float64; measured <= 1.9e-7 of the output scale
GDN_TOL = 3e-6  # F32 recurrence over up to 17 tokens vs float64; measured <= 4.2e-7 of the scale


def conv_ref(x, w, state, apply_silu):
    K = w.shape[0]
    X = np.concatenate([state, x]).astype(np.float64)
    y = np.stack([(w.astype(np.float64) * X[t : t + K]).sum(0) for t in range(x.shape[0])])
    return (silu64(y) if apply_silu else y), X[X.shape[0] - (K - 1) :]


def gdn_inputs(rng, T, hk, hv, dk, dv):
    def unit(shape):
        a = rng.standard_normal(shape)
        return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)

    q, k = unit((T, hk, dk)), unit((T, hk, dk))
    v = rng.standard_normal((T, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 1.5, (T, hv)).astype(np.float32)  # log-decay <= 0
    beta = rng.uniform(0.05, 0.95, (T, hv)).astype(np.float32)
    state = (rng.standard_normal((hv, dv, dk)) * 0.3).astype(np.float32)
    return q, k, v, g, beta, state


def close(a, ref, tol):
    np.testing.assert_allclose(a, ref, rtol=tol, atol=tol * max(np.abs(ref).max(), 1e-30))


# ---- conv1d ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,C,K", [(1, 5, 4), (17, 130, 4), (2, 64, 4), (9, 7, 1), (6, 33, 2), (40, 200, 5)])
@pytest.mark.parametrize("apply_silu", [True, False])
@pytest.mark.parametrize("with_state", [True, False])
def test_conv1d(rng, T, C, K, apply_silu, with_state):
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32) if with_state else np.zeros((K - 1, C), np.float32)
    y_ref, s_ref = conv_ref(x, w, state, apply_silu)
    y = sn.conv1d_causal(x, w, state, apply_silu).numpy()
    close(y, y_ref, CONV_TOL)
    np.testing.assert_array_equal(state, s_ref.astype(np.float32))  # the last K-1 inputs, copied exactly


@pytest.mark.parametrize("split", [[1] * 9, [4, 5], [2, 1, 6]])
def test_conv1d_split_run_bitwise(rng, split):
    T, C, K = sum(split), 150, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    s0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    s_all = s0.copy()
    y_all = sn.conv1d_causal(x, w, s_all).numpy()
    s_part, ys, t = s0.copy(), [], 0
    for n in split:
        ys.append(sn.conv1d_causal(x[t : t + n], w, s_part).numpy())
        t += n
    np.testing.assert_array_equal(np.concatenate(ys), y_all)
    np.testing.assert_array_equal(s_part, s_all)


def test_conv1d_strided_input(rng):
    qkvz = rng.standard_normal((5, 96)).astype(np.float32)
    x = qkvz[:, :64]  # slice of a fused projection, rows strided
    w = rng.standard_normal((4, 64)).astype(np.float32)
    state = np.zeros((3, 64), np.float32)
    y_ref, s_ref = conv_ref(x, w, state, True)
    close(sn.conv1d_causal(x, w, state).numpy(), y_ref, CONV_TOL)
    np.testing.assert_array_equal(state, s_ref.astype(np.float32))


def test_conv1d_bad_input():
    x, w, s = np.zeros((3, 8), np.float32), np.zeros((4, 8), np.float32), np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match=r"weight must be \[K >= 1, C=8\]"):
        sn.conv1d_causal(x, np.zeros((4, 9), np.float32), s)
    with pytest.raises(ValueError, match="state has the wrong shape"):
        sn.conv1d_causal(x, w, np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="state must be contiguous"):
        sn.conv1d_causal(x, w, np.zeros((3, 16), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="x must be F32"):
        sn.conv1d_causal(x.astype(np.float16), w, s)
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        sn.conv1d_causal(x, np.zeros(8, np.float32), s)


# ---- gated delta net ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,hk,hv,dk,dv", [(1, 1, 1, 4, 4), (17, 2, 6, 16, 8), (5, 3, 3, 32, 32), (4, 2, 4, 128, 128), (3, 1, 3, 7, 5)]
)
def test_gdn(rng, T, hk, hv, dk, dv):
    q, k, v, g, beta, s0 = gdn_inputs(rng, T, hk, hv, dk, dv)
    scale = 1 / np.sqrt(dk)
    o_ref, states = gdn_ref(q, k, v, g, beta, s0, scale)
    state = s0.copy()
    ckpt = np.full((T, hv, dv, dk), np.nan, np.float32)
    o = sn.gated_delta_net(q, k, v, g, beta, state, scale, checkpoints=ckpt).numpy()
    close(o, o_ref, GDN_TOL)
    close(state, states[-1], GDN_TOL)
    close(ckpt, states, GDN_TOL)
    np.testing.assert_array_equal(ckpt[-1], state)


def test_gdn_tiled_head_mapping(rng):
    # r = 3: value heads 0, 2, 4 use key head 0 and 1, 3, 5 use key head 1 (j % Hk), not j // r.
    T, hk, hv, d = 3, 2, 6, 8
    q, k, v, g, beta, _ = gdn_inputs(rng, T, hk, hv, d, d)
    o = sn.gated_delta_net(q, k, v, g, beta, np.zeros((hv, d, d), np.float32), 1.0).numpy()
    kq = np.zeros_like(q)
    kq[:, 1] = q[:, 1]  # key head 0 reads zero queries -> heads 0, 2, 4 output zeros
    o2 = sn.gated_delta_net(kq, k, v, g, beta, np.zeros((hv, d, d), np.float32), 1.0).numpy()
    np.testing.assert_array_equal(o2[:, 0::2], 0)
    np.testing.assert_array_equal(o2[:, 1::2], o[:, 1::2])


@pytest.mark.parametrize("split", [[1] * 7, [3, 4], [6, 1]])
def test_gdn_split_run_and_checkpoints_bitwise(rng, split):
    T, hk, hv, dk, dv = sum(split), 2, 6, 32, 16
    q, k, v, g, beta, s0 = gdn_inputs(rng, T, hk, hv, dk, dv)
    s_all = s0.copy()
    ckpt = np.zeros((T, hv, dv, dk), np.float32)
    o_all = sn.gated_delta_net(q, k, v, g, beta, s_all, 0.2, checkpoints=ckpt).numpy()
    s_part, outs, t = s0.copy(), [], 0
    for n in split:
        sl = slice(t, t + n)
        outs.append(sn.gated_delta_net(q[sl], k[sl], v[sl], g[sl], beta[sl], s_part, 0.2).numpy())
        t += n
        np.testing.assert_array_equal(ckpt[t - 1], s_part)  # checkpoint = state after that token
    np.testing.assert_array_equal(np.concatenate(outs), o_all)
    np.testing.assert_array_equal(s_part, s_all)


def test_gdn_thread_invariance_and_strided_inputs(rng):
    T, hk, hv, dk, dv = 5, 2, 4, 16, 16
    # q | k | v as views into one conv output row, the way the layer splits it.
    c = rng.standard_normal((T, 2 * hk * dk + hv * dv)).astype(np.float32) / 4
    q = c[:, : hk * dk].reshape(T, hk, dk)
    k = c[:, hk * dk : 2 * hk * dk].reshape(T, hk, dk)
    v = c[:, 2 * hk * dk :].reshape(T, hv, dv)
    assert not q.flags.c_contiguous
    g = -rng.uniform(0, 1, (T, hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, hv)).astype(np.float32)
    s0 = rng.standard_normal((hv, dv, dk)).astype(np.float32) * 0.1
    o_ref, states = gdn_ref(q, k, v, g, beta, s0, 0.25)
    s1 = s0.copy()
    o1 = sn.gated_delta_net(q, k, v, g, beta, s1, 0.25).numpy()
    close(o1, o_ref, GDN_TOL)
    close(s1, states[-1], GDN_TOL)
    threads = sn.num_threads()
    try:
        sn.set_num_threads(1)
        s2 = s0.copy()
        o2 = sn.gated_delta_net(np.ascontiguousarray(q), k, v, g, beta, s2, 0.25).numpy()
    finally:
        sn.set_num_threads(threads)
    np.testing.assert_array_equal(o2, o1)
    np.testing.assert_array_equal(s2, s1)


def test_gdn_bad_input():
    T, hk, hv, d = 2, 2, 4, 8
    q = np.zeros((T, hk, d), np.float32)
    v = np.zeros((T, hv, d), np.float32)
    gb = np.zeros((T, hv), np.float32)
    s = np.zeros((hv, d, d), np.float32)
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of key heads \(2\)"):
        sn.gated_delta_net(q, q, np.zeros((T, 3, d), np.float32), np.zeros((T, 3), np.float32),
                           np.zeros((T, 3), np.float32), np.zeros((3, d, d), np.float32), 1.0)
    with pytest.raises(ValueError, match="k must have q's shape"):
        sn.gated_delta_net(q, np.zeros((T, hk, 4), np.float32), v, gb, gb, s, 1.0)
    with pytest.raises(ValueError, match="v has 3 tokens"):
        sn.gated_delta_net(q, q, np.zeros((3, hv, d), np.float32), gb, gb, s, 1.0)
    with pytest.raises(ValueError, match=r"g must be \[T, Hv\]"):
        sn.gated_delta_net(q, q, v, np.zeros((T, 3), np.float32), gb, s, 1.0)
    with pytest.raises(ValueError, match=r"beta must be \[T, Hv\]"):
        sn.gated_delta_net(q, q, v, gb, np.zeros((1, hv), np.float32), s, 1.0)
    with pytest.raises(ValueError, match="state has the wrong shape"):
        sn.gated_delta_net(q, q, v, gb, gb, np.zeros((hv, d, 4), np.float32), 1.0)
    with pytest.raises(ValueError, match="checkpoints has the wrong shape"):
        sn.gated_delta_net(q, q, v, gb, gb, s, 1.0, checkpoints=np.zeros((T + 1, hv, d, d), np.float32))
    with pytest.raises(ValueError, match="scale must be finite"):
        sn.gated_delta_net(q, q, v, gb, gb, s, float("inf"))
    with pytest.raises(ValueError, match="q must be F32"):
        sn.gated_delta_net(q.astype(np.float16), q, v, gb, gb, s, 1.0)


# ---- out-of-place states (state_out) --------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 6])
def test_conv1d_state_out_bitwise(rng, T):
    C, K = 70, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    s0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    s_in = s0.copy()
    y_in = sn.conv1d_causal(x, w, s_in).numpy()
    src = s0.copy()
    src.flags.writeable = False  # only read when out of place
    s_out = np.full_like(s0, np.nan)
    y_out = sn.conv1d_causal(x, w, src, state_out=s_out).numpy()
    np.testing.assert_array_equal(y_out, y_in)
    np.testing.assert_array_equal(s_out, s_in)
    np.testing.assert_array_equal(src, s0)
    s_same = s0.copy()  # state_out = state itself: in place
    np.testing.assert_array_equal(sn.conv1d_causal(x, w, s_same, state_out=s_same).numpy(), y_in)
    np.testing.assert_array_equal(s_same, s_in)


def test_conv1d_state_out_bad_input():
    x, w, s = np.zeros((3, 8), np.float32), np.zeros((4, 8), np.float32), np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="state_out has the wrong shape"):
        sn.conv1d_causal(x, w, s, state_out=np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="state_out must be F32"):
        sn.conv1d_causal(x, w, s, state_out=np.zeros((3, 8), np.float16))
    with pytest.raises(ValueError, match="state_out must be contiguous"):
        sn.conv1d_causal(x, w, s, state_out=np.zeros((3, 16), np.float32)[:, ::2])
    big = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="state_out must be state itself or not overlap it"):
        sn.conv1d_causal(x, w, big[:3], state_out=big[1:])
    xs = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="state_out must not overlap the inputs"):
        sn.conv1d_causal(xs, w, s, state_out=xs)
    ro = s.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="state"):
        sn.conv1d_causal(x, w, ro, state_out=ro)  # in place needs a writable state
    wbuf = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="state_out must not overlap the inputs"):
        sn.conv1d_causal(x, wbuf, s, state_out=wbuf[:3])  # the weight is an input too


@pytest.mark.parametrize("T,hk,hv,dk,dv", [(0, 1, 2, 8, 8), (1, 2, 6, 16, 8), (5, 2, 4, 128, 128)])
def test_gdn_state_out_bitwise(rng, T, hk, hv, dk, dv):
    q, k, v, g, beta, s0 = gdn_inputs(rng, T, hk, hv, dk, dv)
    s_in, ck_in = s0.copy(), np.zeros((T, hv, dv, dk), np.float32)
    o_in = sn.gated_delta_net(q, k, v, g, beta, s_in, 0.3, checkpoints=ck_in).numpy()
    src = s0.copy()
    src.flags.writeable = False  # only read when out of place
    s_out, ck_out = np.full_like(s0, np.nan), np.zeros_like(ck_in)
    o_out = sn.gated_delta_net(q, k, v, g, beta, src, 0.3, checkpoints=ck_out, state_out=s_out).numpy()
    np.testing.assert_array_equal(o_out, o_in)
    np.testing.assert_array_equal(s_out, s_in)
    np.testing.assert_array_equal(ck_out, ck_in)
    np.testing.assert_array_equal(src, s0)
    s_same = s0.copy()  # state_out = state itself: in place
    np.testing.assert_array_equal(sn.gated_delta_net(q, k, v, g, beta, s_same, 0.3, state_out=s_same).numpy(), o_in)
    np.testing.assert_array_equal(s_same, s_in)


def test_gdn_state_out_bad_input(rng):
    T, hk, hv, d = 2, 2, 4, 8
    q, k, v, g, beta, s = gdn_inputs(rng, T, hk, hv, d, d)
    with pytest.raises(ValueError, match="state_out has the wrong shape"):
        sn.gated_delta_net(q, k, v, g, beta, s, 1.0, state_out=np.zeros((hv, d, 4), np.float32))
    with pytest.raises(ValueError, match="state_out must be F32"):
        sn.gated_delta_net(q, k, v, g, beta, s, 1.0, state_out=np.zeros((hv, d, d), np.int32))
    big = np.zeros((hv + 1, d, d), np.float32)
    with pytest.raises(ValueError, match="state_out must be state itself or not overlap it"):
        sn.gated_delta_net(q, k, v, g, beta, big[:hv], 1.0, state_out=big[1:])
    ck = np.zeros((T, hv, d, d), np.float32)
    with pytest.raises(ValueError, match="state_out must not overlap the inputs"):
        sn.gated_delta_net(q, k, v, g, beta, s, 1.0, checkpoints=ck, state_out=ck[0])
    ck_on_s = np.zeros((T + 1, hv, d, d), np.float32)
    with pytest.raises(ValueError, match="checkpoints must not overlap state"):
        sn.gated_delta_net(q, k, v, g, beta, ck_on_s[T], 1.0, checkpoints=ck_on_s[1:])
    buf = np.zeros(hv * d * d, np.float32)
    with pytest.raises(ValueError, match="state_out must not overlap the inputs"):
        sn.gated_delta_net(buf[: q.size].reshape(q.shape), k, v, g, beta, s, 1.0, state_out=buf.reshape(s.shape))


# ---- gdn_step (the step's qkv, gates and recurrence as one op) ----------------------------------------


@pytest.mark.parametrize("T,hk,hv,dk,dv", [(0, 1, 2, 8, 8), (1, 2, 6, 16, 8), (3, 2, 4, 32, 16)])
def test_gdn_step_against_float64(rng, T, hk, hv, dk, dv):
    """gdn_step = L2-normed q / k heads of cv, g = ssm_a * softplus(a + dt), beta = sigmoid(b) and the
    recurrence's o, against float64 numpy (qwen35-target.md §6.5 steps 3-7); out of place leaves the state
    untouched and equals in place bitwise."""
    eps, scale = 1e-6, 1 / np.sqrt(dk)
    cv = rng.standard_normal((T, 2 * hk * dk + hv * dv)).astype(np.float32)
    a, b = (rng.standard_normal((T, hv)).astype(np.float32) for _ in range(2))
    dt, ssm_a = rng.standard_normal(hv).astype(np.float32), -rng.uniform(0.1, 2, hv).astype(np.float32)
    state = (rng.standard_normal((hv, dv, dk)) * 0.3).astype(np.float32)
    q, k, v, g, beta = gdn_step_inputs_ref(cv, a, b, dt, ssm_a, hk, dk, hv, dv, eps)
    st = state.copy()
    got = [t.numpy() for t in sn.gdn_step(cv, a, b, dt, ssm_a, st, hk, dk, hv, dv, eps, scale)]
    assert [x.shape for x in got] == [(T, hv, dv), (T, hk, dk), (T, hk, dk), (T, hv, dv), (T, hv), (T, hv)]
    if T:
        for x, ref in zip(got[1:], (q, k, v, g, beta)):
            close(x, ref, 1e-6)
        o, states = gdn_ref(q, k, v, g, beta, state, scale)
        close(got[0], o, GDN_TOL)
        close(st, states[-1], GDN_TOL)
    st2, out = state.copy(), np.full_like(state, np.nan)
    o2 = sn.gdn_step(cv, a, b, dt, ssm_a, st2, hk, dk, hv, dv, eps, scale, state_out=out)[0].numpy()
    np.testing.assert_array_equal(o2, got[0])
    np.testing.assert_array_equal(out, st)
    np.testing.assert_array_equal(st2, state)


@pytest.mark.parametrize("T,weighted", [(1, True), (3, False), (0, True)])
def test_gdn_step_gated_matmul_against_float64(rng, T, weighted):
    """gdn_step_gated_matmul = gdn_step's pending values, and its o's gated RMS norm (per value head, times the
    norm weight, times silu(z)) projected by each weight (qwen35-target.md §6.5 steps 3-9), against float64
    numpy on the dequantized weights; partials=True gives each output as one part [1, T, out]."""
    hk, hv, dk, dv, eps = 2, 4, 16, 8, 1e-6
    scale = 1 / np.sqrt(dk)
    cv = rng.standard_normal((T, 2 * hk * dk + hv * dv)).astype(np.float32)
    a, b = (rng.standard_normal((T, hv)).astype(np.float32) for _ in range(2))
    dt, ssm_a = rng.standard_normal(hv).astype(np.float32), -rng.uniform(0.1, 2, hv).astype(np.float32)
    state = (rng.standard_normal((hv, dv, dk)) * 0.3).astype(np.float32)
    z = rng.standard_normal((T, hv, dv)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, dv).astype(np.float32) if weighted else None
    ws = [sn.Tensor(random_blocks(rng, "Q8_0", out, hv * dv), sn.DType.Q8_0) for out in (5, 3)]
    st = state.copy()
    ys, *pend = sn.gdn_step_gated_matmul(cv, a, b, dt, ssm_a, st, hk, dk, hv, dv, eps, scale, nw, z, ws)
    q, k, v, g, beta = gdn_step_inputs_ref(cv, a, b, dt, ssm_a, hk, dk, hv, dv, eps)
    assert [x.shape for x in pend] == [(T, hk, dk), (T, hk, dk), (T, hv, dv), (T, hv), (T, hv)]
    o, states = gdn_ref(q, k, v, g, beta, state, scale)
    if T:
        for x, ref in zip(pend, (q, k, v, g, beta)):
            close(x.numpy(), ref, 1e-6)
        close(st, states[-1], GDN_TOL)
    u = o / np.sqrt((o ** 2).mean(axis=-1, keepdims=True) + eps) * (nw if weighted else 1.0) * silu64(z)
    for y, w in zip(ys, ws):
        ref = u.reshape(T, hv * dv) @ sn.dequantize(w).numpy().astype(np.float64).T
        assert y.shape == (T, w.shape[0])
        if T:
            close(y.numpy(), ref, 1e-4)
    st2 = state.copy()
    parts, *_ = sn.gdn_step_gated_matmul(cv, a, b, dt, ssm_a, st2, hk, dk, hv, dv, eps, scale, nw, z, ws,
                                         partials=True)
    for p, y in zip(parts, ys):
        np.testing.assert_array_equal(p.numpy(), y.numpy()[None])
    np.testing.assert_array_equal(st2, st)


def test_gdn_step_gated_matmul_bad_input(rng):
    """A bad argument of the step, of the norm or a weight raises ValueError naming it, and the state (in
    place) is left as it was; z overlapping the state written is refused."""
    hk, hv, dk, dv, T = 1, 2, 8, 16, 2
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    cv, a, vec, z = f(T, 2 * hk * dk + hv * dv), f(T, hv), f(hv), f(T, hv, dv)
    w = sn.Tensor(random_blocks(rng, "Q8_0", 4, hv * dv), sn.DType.Q8_0)
    st = f(hv, dv, dk)
    keep = st.copy()
    cases = [("gdn_step: scale must be finite", dict(scale=np.inf)),
             ("gdn_step_gated_matmul: z", dict(z=f(T, hv, dv + 1))),
             ("gdn_step_gated_matmul: norm_weight must be", dict(nw=f(dv - 1))),
             ("gdn_step_gated_matmul: z must not overlap the state",
              dict(z=st.reshape(-1)[: T * hv * dv].reshape(T, hv, dv))),
             ("ws\\[0\\]", dict(ws=[sn.Tensor(random_blocks(rng, "Q8_0", 4, hv * dv + 32), sn.DType.Q8_0)]))]
    for match, bad in cases:
        args = dict(scale=0.1, z=z, nw=f(dv), ws=[w]) | bad
        with pytest.raises(ValueError, match=match):
            sn.gdn_step_gated_matmul(cv, a, a, vec, vec, st, hk, dk, hv, dv, 1e-6, args["scale"], args["nw"],
                                     args["z"], args["ws"])
        np.testing.assert_array_equal(st, keep, err_msg=match)


def test_gdn_step_bad_input(rng):
    """Every argument is checked before anything runs: a bad one raises ValueError naming the op and the
    argument, and the state (in place) and state_out are left as they were."""
    hk, hv, dk, dv, T = 1, 2, 8, 8, 2
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    cv, a, vec = f(T, 2 * hk * dk + hv * dv), f(T, hv), f(hv)
    st = f(hv, dv, dk)
    keep = st.copy()
    big = f(hv * dv * dk + 8)
    cases = [
        ("gdn_qkv: cv has", dict(cv=f(T, cv.shape[1] - 1))),
        ("gdn_gates: dt must have shape", dict(a=f(T, hv + 1), b=f(T, hv + 1))),
        ("gdn_step: a and b", dict(a=f(T + 1, hv), b=f(T + 1, hv))),
        ("gdn_step: state", dict(st=f(1, dv, dk))),
        ("gdn_step: scale must be finite", dict(scale=np.inf)),
        ("gdn_step: the state written must not overlap", dict(a=big[: T * hv].reshape(T, hv),
                                                              st=big[2:2 + hv * dv * dk].reshape(hv, dv, dk))),
    ]
    for match, bad in cases:
        args = dict(cv=cv, a=a, b=a, dt=vec, ssm_a=vec, st=st, scale=0.1) | bad
        before = args["st"].copy()
        with pytest.raises(ValueError, match=match):
            sn.gdn_step(args["cv"], args["a"], args["b"], args["dt"], args["ssm_a"], args["st"],
                        hk, dk, hv, dv, 1e-6, args["scale"])
        np.testing.assert_array_equal(args["st"], before, err_msg=match)
    np.testing.assert_array_equal(st, keep)
    out = np.full_like(st, 7.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        sn.gdn_step(cv, a, a, vec, vec, st, hk, dk, hv, dv, 1e-6, np.nan, state_out=out)
    assert (out == 7.0).all()
    cv3 = f(T, 2 * 2 * dk + 3 * dv)
    with pytest.raises(ValueError, match="multiple of key heads"):
        sn.gdn_step(cv3, f(T, 3), f(T, 3), f(3), f(3), f(3, dv, dk), 2, dk, 3, dv, 1e-6, 0.1)


# ---- a commit's state updates on several layers (conv1d_causal_states, gated_delta_net_states) -----------------


@pytest.mark.parametrize("T,K", [(0, 4), (1, 4), (2, 4), (3, 4), (7, 4), (2, 1), (1, 2), (5, 3)])
def test_conv1d_causal_states_equals_each_layer(rng, T, K):
    C, layers = 37, 3
    xs = [rng.standard_normal((T, C)).astype(np.float32) for _ in range(layers)]
    w = rng.standard_normal((K, C)).astype(np.float32)
    states = [rng.standard_normal((K - 1, C)).astype(np.float32) for _ in range(layers)]
    want = []
    for x, s in zip(xs, states):
        one = s.copy()
        sn.conv1d_causal(x, w, one, apply_silu=False)  # the single-layer op's state update
        np.testing.assert_array_equal(one, np.concatenate([s, x])[T:])  # [state ; x]'s last K - 1 rows
        want.append(one)
    sn.conv1d_causal_states(xs, states)
    for s, ref in zip(states, want):
        np.testing.assert_array_equal(s, ref)


@pytest.mark.parametrize("T,hk,hv,dk,dv", [(1, 2, 4, 16, 8), (3, 1, 3, 32, 32), (9, 2, 4, 128, 128), (5, 1, 3, 7, 5)])
def test_gated_delta_net_states_equals_each_layer(rng, T, hk, hv, dk, dv):
    layers, scale = 3, 1 / np.sqrt(dk)
    ins = [gdn_inputs(rng, T, hk, hv, dk, dv) for _ in range(layers)]
    want = []
    for q, k, v, g, beta, s0 in ins:
        one = s0.copy()
        sn.gated_delta_net(q, k, v, g, beta, one, scale)
        close(one, gdn_ref(q, k, v, g, beta, s0, scale)[1][-1], GDN_TOL)
        want.append(one)
    states = [x[5] for x in ins]
    sn.gated_delta_net_states(*([x[f] for x in ins] for f in range(5)), states, scale)
    for s, ref in zip(states, want):
        np.testing.assert_array_equal(s, ref)


def test_commit_states_bad_input(rng):
    T, hk, hv, d, C = 2, 1, 2, 8, 6
    q, k, v, g, beta, s = gdn_inputs(rng, T, hk, hv, d, d)
    s2 = s.copy()
    kept = (s.copy(), s2.copy())

    def gdn(**kw):
        a = dict(q=[q, q], k=[k, k], v=[v, v], g=[g, g], beta=[beta, beta], states=[s, s2], scale=0.5)
        a.update(kw)
        sn.gated_delta_net_states(**a)

    with pytest.raises(ValueError, match="1 tensors in k for 2 states"):
        gdn(k=[k])
    with pytest.raises(ValueError, match=r"layer 1: \[T, Hk, dk, Hv, dv\] = \[1, .*differ from layer 0's"):
        gdn(q=[q, q[:1]], k=[k, k[:1]], v=[v, v[:1]], g=[g, g[:1]], beta=[beta, beta[:1]])
    with pytest.raises(ValueError, match="the states of layers 0 and 1 overlap"):
        gdn(states=[s, s])
    with pytest.raises(ValueError, match="layer 1's state overlaps layer 0's v"):
        gdn(v=[s2.reshape(-1)[: v.size].reshape(v.shape), v])  # layer 0's v inside layer 1's state
    with pytest.raises(ValueError, match=r"layer 1: \[T, Hk, dk, Hv, dv\] = \[2, 2, 8, 2, 8\] differ"):
        q2, k2 = gdn_inputs(rng, T, 2, hv, d, d)[:2]  # Hk 2 against layer 0's 1
        gdn(q=[q, q2], k=[k, k2])
    with pytest.raises(ValueError, match="layer 0's state overlaps layer 0's q"):  # its own layer's input
        gdn(q=[s.reshape(-1)[: q.size].reshape(q.shape), q])
    pair = np.zeros((2,) + s.shape, np.float32)  # two states side by side, an input spanning both
    with pytest.raises(ValueError, match="layer 0's state overlaps layer 1's v"):
        gdn(states=[pair[0], pair[1]], v=[v, pair.reshape(-1)[s.size - 4: s.size - 4 + v.size].reshape(v.shape)])
    s3 = s.copy()
    with pytest.raises(ValueError, match="the states of layers 0 and 2 overlap"):  # not next to each other
        gdn(**{f: [a, a, a] for f, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))},
            states=[s3, s2, s3])
    with pytest.raises(ValueError, match="layer 1: state is read-only"):
        ro = s2.copy()
        ro.setflags(write=False)
        gdn(states=[s, ro])
    with pytest.raises(ValueError, match=r"layer 1: state must be \[Hv, dv, dk\] = \[2, 8, 8\], got \[1, 8, 8\]"):
        gdn(states=[s, s2[:1]])
    with pytest.raises(ValueError, match="layer 0: q must be F32"):
        gdn(q=[q.astype(np.float16), q])
    with pytest.raises(ValueError, match="layer 1: v must be contiguous"):
        gdn(v=[v, np.ascontiguousarray(np.repeat(v, 2, axis=2))[:, :, ::2]])
    with pytest.raises(ValueError, match="layer 0: scale must be finite"):
        gdn(scale=float("nan"))
    np.testing.assert_array_equal(s, kept[0])  # nothing ran
    np.testing.assert_array_equal(s2, kept[1])
    x, st = rng.standard_normal((T, C)).astype(np.float32), np.zeros((3, C), np.float32)
    with pytest.raises(ValueError, match="1 inputs \\(xs\\) for 2 states"):
        sn.conv1d_causal_states([x], [st, st.copy()])
    with pytest.raises(ValueError, match=r"layer 1: x must be \[T, C\] = \[2, 6\] as layer 0's, got \[3, 6\]"):
        sn.conv1d_causal_states([x, np.zeros((3, C), np.float32)], [st, st.copy()])
    with pytest.raises(ValueError, match=r"layer 1: state must be \[K - 1, C\] = \[3, 6\] \(layer 0's K - 1\), "
                                         r"got \[2, 6\]"):
        sn.conv1d_causal_states([x, x.copy()], [st, np.zeros((2, C), np.float32)])
    with pytest.raises(ValueError, match=r"layer 0: state must be \[K - 1, C = 6\], got \[18\]"):
        sn.conv1d_causal_states([x], [st.reshape(-1)])
    with pytest.raises(ValueError, match="layer 0's state overlaps layer 1's x"):
        sn.conv1d_causal_states([x, st[:2]], [st, np.zeros((3, C), np.float32)])
    with pytest.raises(ValueError, match="the states of layers 0 and 1 overlap"):
        sn.conv1d_causal_states([x, x.copy()], [st, st])
    sn.gated_delta_net_states([], [], [], [], [], [], 1.0)  # no layers: nothing to do
    sn.conv1d_causal_states([], [])
    q0, k0, v0, g0, beta0, s0 = gdn_inputs(rng, 0, hk, hv, d, d)  # no tokens: the states stay
    sn.gated_delta_net_states([q0], [k0], [v0], [g0], [beta0], [s], 0.5)
    np.testing.assert_array_equal(s, kept[0])
