"""Reference and tolerance of the tensor-core flash-attention path (native/src/gpu/attention_flash.cuh),
shared by its host emulation test (test_gpu_flash_attention_host.py) and its GPU tests
(test_gpu_ops2.py, test_gpu_target.py).

Tolerance (derivation). The path rounds q to F16 when it stages it (K and V are F16 already) and the
softmax weights p = 2^(x - m) to F16 for the weights @ v product; everything else is F32 (tensor-core
accumulation, ex2.approx at ~2^-22, the online rescaling). With u = 2^-11 (F16 unit roundoff), for query
row i of head h:
* q rounding moves each score s_ij = scale q_i . k_j by at most E_ij = u * scale * sum_e |q_ie k_je|, so
  the softmax weights move by at most e^(2 E_i) - 1 ~ 2 E_i in L1 (E_i = max over the visible j);
* p rounding moves each weight by at most u relative, plus 2^-25 absolute for a subnormal F16 p
  (p <= 1, the row sum l >= 1): at most u + N 2^-25 in L1 over N visible keys;
* the F32 parts stay below 1e-5 relative.
Hence |out - exact| <= max|v| * (2 E_i (1 + 2 E_i) + u + N 2^-25 + 1e-5) (``flash_bound``), which is
rigorous to first order but loose: the perturbations are random in sign, and for q, k, v ~ N(0, 1) the
largest error of a call is ~1e-4 of max|v| (host emulation, 4 seeds: 1.6e-5 .. 6.4e-5, about 1 % of the
bound; q * 4, a peaky softmax: 4.9e-4 .. 6.2e-4), so the tests also hold every call's largest error to
``TYPICAL`` = 2e-3 * max|v| (the ~1e-3 the path is documented with; 100 times the exact path's
2e-5 * max|v| tolerance).
"""
import numpy as np

U = 2.0 ** -11
TYPICAL = 2e-3  # of max|v|: the largest error allowed in a call of N(0, 1) inputs (see above)


def row_ranges(pos, kv_len, causal, window):
    """[lo, hi) of each query row, as cpu::attention defines visibility (empty: lo >= hi)."""
    pos = np.asarray(pos, np.int64)
    lo = np.maximum(pos - window + 1, 0) if window > 0 else np.zeros_like(pos)
    hi = np.minimum(pos + 1, kv_len) if causal else np.full_like(pos, kv_len)
    return lo, hi


def attention64(q, k, v, kv_len, pos, causal=True, window=0, scale=None):
    """softmax(scale q k^T) v in float64 over each row's visible keys (zeros when none); q [n, hq, d],
    k, v [capacity, hkv, d] (any float dtype), GQA head h -> KV head h // (hq // hkv)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    r = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    lo, hi = row_ranges(pos, kv_len, causal, window)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    out = np.zeros((n, hq, d))
    for i in range(n):
        if lo[i] >= hi[i]:
            continue
        ks, vs = k64[lo[i]:hi[i]], v64[lo[i]:hi[i]]  # [N, hkv, d]
        for g in range(hkv):
            s = q64[i, g * r:(g + 1) * r] @ ks[:, g].T * scale  # [r, N]
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[i, g * r:(g + 1) * r] = (w / w.sum(axis=1, keepdims=True)) @ vs[:, g]
    return out


def flash_bound(q, k, v, kv_len, pos, causal=True, window=0, scale=None):
    """Per (row, head) bound [n, hq] on |flash - exact| (module docstring)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    r = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    lo, hi = row_ranges(pos, kv_len, causal, window)
    vmax = float(np.abs(v[:kv_len].astype(np.float64)).max()) if kv_len else 0.0
    qa, ka = np.abs(q.astype(np.float64)), np.abs(k[:kv_len].astype(np.float64))
    bound = np.zeros((n, hq))
    for g in range(hkv):
        dots = qa[:, g * r:(g + 1) * r] @ ka[:, g].T  # [n, r, kv_len]: sum_e |q_ie| |k_je|
        for i in range(n):
            if lo[i] >= hi[i]:
                continue
            e = U * scale * dots[i, :, lo[i]:hi[i]].max(axis=1)
            bound[i, g * r:(g + 1) * r] = vmax * (2 * e * (1 + 2 * e) + U + (hi[i] - lo[i]) * 2.0 ** -25 + 1e-5)
    return bound


def check_flash(out, q, k, v, kv_len, pos, causal=True, window=0, scale=None, typical=TYPICAL, what="", ref=None):
    """Asserts out (the flash path's [n, hq, d]) is within flash_bound of ref (default: the float64
    reference; the CPU op's F32 result, ~1e-6 * max|v| from it, fits the bound's 1e-5 slack) per
    (row, head), within typical * max|v| everywhere, and zero for rows without a visible key. Returns
    the largest error / max|v|."""
    if ref is None:
        ref = attention64(q, k, v, kv_len, pos, causal, window, scale)
    bound = flash_bound(q, k, v, kv_len, pos, causal, window, scale)
    vmax = float(np.abs(v[:kv_len].astype(np.float64)).max())
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    err = np.abs(out.astype(np.float64) - ref).max(axis=2)
    worst = np.unravel_index(np.argmax(err / np.maximum(bound, 1e-30)), err.shape)
    assert np.all(err <= bound), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at row/head {worst}")
    assert err.max() <= typical * vmax, f"{what}: max error {err.max() / vmax:.3g} * max|v| > {typical}"
    lo, hi = row_ranges(pos, kv_len, causal, window)
    empty = lo >= hi
    assert not out[empty].any(), f"{what}: a row without a visible key is not zero"
    return err.max() / vmax
