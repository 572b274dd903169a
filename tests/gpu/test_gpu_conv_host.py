"""The GDN conv kernels of the GPU (native/src/gpu/conv.cuh), emulated on the host.

host_emu/conv_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h) and runs conv1d_kernel
(any K) and conv1d_taps_kernel<4> (the models' 4 taps: weights in registers, inputs through a register
window) with ssm.cu's grid, in place on the state (or, with chunks shorter than K - 1 tokens, out of place into a
poisoned state_out). The window kernel must give the generic kernel's bits
(outputs and state) for every token count, chunk edge and the state-only start (T < K - 1); both are checked
against float64 numpy (y[t, c] = sum_j w[j, c] X[t + j, c] over X = [state ; x], then silu). The launch
itself: test_gpu_ops2.py's conv tests on a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu  # noqa: E402


@pytest.fixture(scope="module")
def conv_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "conv_emu", ["conv.cuh", "activations.cuh", "warp_reduce.cuh", "pdl.cuh"],
                     "conv_main.cpp")


def run_emu(emu, x, w, state, chunk, silu):
    d, exe = emu
    T, C = x.shape
    K = w.shape[0]
    names = ("x", "w", "state", "y1", "s1", "y2", "s2")
    files = {n: str(d / f"{n}.bin") for n in names}
    for n, a in zip(names, (x, w, state)):
        np.ascontiguousarray(a, np.float32).tofile(files[n])
    subprocess.run([str(exe), str(T), str(C), str(K), str(chunk), str(int(silu))] + [files[n] for n in names],
                   check=True, capture_output=True, text=True)
    out = [np.fromfile(files[n], np.float32) for n in ("y1", "s1", "y2", "s2")]
    return out[0].reshape(T, C), out[1].reshape(K - 1, C), out[2].reshape(T, C), out[3].reshape(K - 1, C)


# chunk < K - 1 (1, 2): out of place, as the host launches a verify's T <= 16 tokens (a token a chunk), every chunk
# reading the state rows it needs
@pytest.mark.parametrize("T,C,chunk", [(1, 130, 16), (2, 64, 16), (3, 5, 16), (40, 200, 16), (37, 129, 8), (0, 33, 16),
                                       (8, 130, 1), (2, 64, 1), (1, 33, 1), (16, 40, 1), (5, 129, 2)])
@pytest.mark.parametrize("silu", [True, False])
def test_conv_taps_kernel_emulated_bitwise(conv_emu, rng, T, C, chunk, silu):
    K = 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    y1, s1, y2, s2 = run_emu(conv_emu, x, w, state, chunk, silu)
    np.testing.assert_array_equal(y2.view(np.uint32), y1.view(np.uint32))
    np.testing.assert_array_equal(s2, s1)
    X = np.concatenate([state, x]).astype(np.float64)
    ref = np.stack([(w.astype(np.float64) * X[t : t + K]).sum(0) for t in range(T)]) if T else np.zeros((0, C))
    if silu:
        ref = ref / (1 + np.exp(-ref))
    np.testing.assert_allclose(y1, ref, rtol=1e-5, atol=1e-5 * max(np.abs(ref).max(initial=0), 1))
    np.testing.assert_array_equal(s1, X[X.shape[0] - (K - 1) :].astype(np.float32))
