"""The chunked Gated DeltaNet recurrence of the GPU's prefill (native/src/gpu/gdn_chunked.cuh), emulated on
the host.

host_emu/gdn_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: one thread per thread of a
block, __syncthreads) and runs gdn_chunk_prep_kernel and gdn_chunk_state_kernel with ssm.cu's launch, its
scratch, output and shared memory poisoned, built twice: as CUDA (the state pass on tensor cores, 3xTF32) and
as HIP (-DSPECD_HIP=1: its FP32-FMA state pass). Checked against the token-by-token recurrence in float64
(cpu::gated_delta_net's arithmetic: S <- exp(g) S; m = S^T k; d = beta (v - m); S <- S + k d^T; o = S^T (scale
q)) with the GPU op's tolerance 1e-4 * max|ref| + 1e-4 |ref|, so the chunkwise algebra (the WY form), the
forward substitution, the chunk edges and ragged last chunks are checked without a GPU. The launch itself
(shared memory limits, PDL) is covered by test_gpu_ops2.py's chunked tests on a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu  # noqa: E402


@pytest.fixture(scope="module", params=["cuda", "hip"])
def gdn_emu(request, tmp_path_factory):
    """The emulation of the CUDA build (the state pass on tensor cores, 3xTF32) or of the HIP build (its
    FP32-FMA state pass), each run by every test below."""
    return build_emu(tmp_path_factory, "gdn_emu", ["gdn_chunked.cuh", "dyn_smem.cuh", "pdl.cuh"], "gdn_main.cpp",
                     ["-DSPECD_HIP=1"] if request.param == "hip" else [])


def reference(q, k, v, g, beta, state, scale):
    """Token-by-token recurrence in float64: (o [T, hv, dv], final state [hv, dv, dk])."""
    T, hk, _ = q.shape
    hv = v.shape[1]
    S = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(T):
        for j in range(hv):
            kk, qq = k[t, j % hk].astype(np.float64), q[t, j % hk].astype(np.float64) * scale
            S[j] *= np.exp(g[t, j])
            d = beta[t, j] * (v[t, j] - S[j] @ kk)
            S[j] += np.outer(d, kk)
            out[t, j] = S[j] @ qq
    return out, S


def run_emu(emu, q, k, v, g, beta, state, scale):
    d, exe = emu
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    names = ("q", "k", "v", "g", "beta", "state", "out", "state_out")
    files = {n: str(d / f"{n}.bin") for n in names}
    for n, a in zip(names, (q, k, v, g, beta, state)):
        np.ascontiguousarray(a, np.float32).tofile(files[n])
    r = subprocess.run([str(exe), str(dk), str(T), str(hk), str(hv), str(dv), repr(float(scale))] +
                       [files[n] for n in names], check=True, capture_output=True, text=True)
    return (np.fromfile(files["out"], np.float32).reshape(T, hv, dv),
            np.fromfile(files["state_out"], np.float32).reshape(hv, dv, dk), r.stdout.strip())


def inputs(rng, T, hk, hv, dk, dv, decay):
    def l2(a):
        return (a / np.sqrt((a.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6)).astype(np.float32)
    q, k = l2(rng.standard_normal((T, hk, dk))), l2(rng.standard_normal((T, hk, dk)))
    v = rng.standard_normal((T, hv, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((T, hv))) * decay).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, hv))))).astype(np.float32)
    state = (rng.standard_normal((hv, dv, dk)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, state


# (T, hk, hv, dk, dv, decay): one whole chunk, ragged chunks, one token past a chunk, GQA 1:3 and 2:4,
# decays from ~e^-0.1 to ~e^-8 per token (exp(G_i - G_j) over many orders of magnitude), several chunks at dk 128.
CASES = [(64, 1, 2, 32, 32, 0.5), (130, 2, 4, 64, 16, 2.0), (65, 1, 3, 128, 32, 0.1), (200, 2, 2, 32, 48, 8.0),
         (250, 1, 3, 128, 64, 1.0)]


@pytest.mark.parametrize("T,hk,hv,dk,dv,decay", CASES)
def test_gdn_chunked_emulated_matches_token_recurrence(gdn_emu, rng, T, hk, hv, dk, dv, decay):
    args = inputs(rng, T, hk, hv, dk, dv, decay)
    scale = 1 / np.sqrt(dk)
    out, st, plan = run_emu(gdn_emu, *args, scale)
    chunks = -(-T // 64)
    assert plan == f"chunks={chunks} prep_blocks={chunks * hv} state_blocks={hv * dv // 16}"
    ref_o, ref_s = reference(*args, scale)
    np.testing.assert_allclose(out, ref_o, rtol=1e-4, atol=1e-4 * np.abs(ref_o).max())
    np.testing.assert_allclose(st, ref_s, rtol=1e-4, atol=1e-4 * np.abs(ref_s).max())


def test_gdn_chunked_emulated_huge_gates(gdn_emu, rng):
    """Gates of -1000 and -inf at chunk starts and inside chunks: their decay is 0 (the state restarts), as
    token by token, and the other gates' prefix sums keep their digits (the kernel clamps at -104)."""
    T, hk, hv, dk, dv = 150, 1, 2, 32, 16
    q, k, v, g, beta, state = inputs(rng, T, hk, hv, dk, dv, 1.0)
    g[0, 0], g[64, 1], g[70, 0], g[128, 0] = -1000.0, -np.inf, -1000.0, -np.inf
    scale = 1 / np.sqrt(dk)
    out, st, _ = run_emu(gdn_emu, q, k, v, g, beta, state, scale)
    ref_o, ref_s = reference(q, k, v, g, beta, state, scale)
    np.testing.assert_allclose(out, ref_o, rtol=1e-4, atol=1e-4 * np.abs(ref_o).max())
    np.testing.assert_allclose(st, ref_s, rtol=1e-4, atol=1e-4 * np.abs(ref_s).max())
