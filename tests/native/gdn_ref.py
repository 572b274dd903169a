"""Float64 references of the Gated DeltaNet ops (qwen35-target.md §6.5), shared by the CPU tests
(tests/native/test_ssm.py) and the GPU kernels' host emulation (tests/gpu/test_gpu_gdn_step_host.py).

The recurrence follows §6.5 step 7 literally, one token at a time in the HF state layout S[i_k, j_v]; the
op's ggml layout stores head j as [dv][dk], i.e. state[j] = S_j^T.
"""
import numpy as np


def silu64(x):
    return x / (1 + np.exp(-x))


def gdn_ref(q, k, v, g, beta, state, scale):
    """state: ggml layout [Hv, dv, dk]. Returns (o [T, Hv, dv], per-token states [T, Hv, dv, dk])."""
    T, hk, _ = q.shape
    hv = v.shape[1]
    S = state.astype(np.float64).transpose(0, 2, 1).copy()  # [Hv, dk, dv]
    outs, states = [], []
    for t in range(T):
        o = np.zeros((hv, v.shape[2]))
        for j in range(hv):
            kt, qt = k[t, j % hk].astype(np.float64), q[t, j % hk].astype(np.float64) * scale
            S[j] *= np.exp(np.float64(g[t, j]))
            m = S[j].T @ kt
            d = np.float64(beta[t, j]) * (v[t, j] - m)
            S[j] += np.outer(kt, d)
            o[j] = S[j].T @ qt
        outs.append(o)
        states.append(S.transpose(0, 2, 1).copy())
    if not T:
        return np.zeros((0, hv, v.shape[2])), np.zeros((0, *state.shape))
    return np.stack(outs), np.stack(states)


def gdn_step_inputs_ref(cv, a, b, dt, ssm_a, hk, dk, hv, dv, eps):
    """gdn_step's first stages in float64: (q, k) L2-normed heads of the conv output cv [T, 2 Hk dk + Hv dv],
    v, g = ssm_a * softplus(a + dt), beta = sigmoid(b)."""
    c = cv.astype(np.float64)
    T = c.shape[0]
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)  # noqa: E731
    q = l2(c[:, : hk * dk].reshape(T, hk, dk))
    k = l2(c[:, hk * dk : 2 * hk * dk].reshape(T, hk, dk))
    v = c[:, 2 * hk * dk :].reshape(T, hv, dv)
    g = ssm_a * np.log1p(np.exp(a.astype(np.float64) + dt))
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    return q, k, v, g, beta
