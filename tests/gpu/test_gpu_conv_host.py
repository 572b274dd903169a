"""The GDN conv kernels of the GPU (native/src/gpu/conv.cuh), emulated on the host.

host_emu/conv_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h) and runs conv1d_kernel
(any K) and conv1d_taps_kernel<4> (the models' 4 taps: weights in registers, inputs through a register
window) with ssm.cu's grid, in place on the state, or out of place into a poisoned state_out (the state read
checked unchanged), as the host launches a verify's few tokens: a token a chunk. The window kernel must give the
generic kernel's bits
(outputs and state) for every token count, chunk edge and the state-only start (T < K - 1); both are checked
against float64 numpy (y[t, c] = sum_j w[j, c] X[t + j, c] over X = [state ; x], then silu). Every run also
updates two layers' states in one conv_states_kernel launch (conv1d_causal_states), checked against X's last
K - 1 rows. The launch itself: test_gpu_ops2.py's conv tests on a GPU.
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


def run_emu(emu, x, w, state, chunk, silu, in_place=True):
    d, exe = emu
    T, C = x.shape
    K = w.shape[0]
    names = ("x", "w", "state", "y1", "s1", "y2", "s2", "l0", "l1")
    files = {n: str(d / f"{n}.bin") for n in names}
    for n, a in zip(names, (x, w, state)):
        np.ascontiguousarray(a, np.float32).tofile(files[n])
    subprocess.run([str(exe), str(T), str(C), str(K), str(chunk), str(int(silu)), str(int(in_place))]
                   + [files[n] for n in names], check=True, capture_output=True, text=True)
    out = [np.fromfile(files[n], np.float32) for n in ("y1", "s1", "y2", "s2", "l0", "l1")]
    layers = out[4].reshape(K - 1, C), out[5].reshape(K - 1, C)
    np.testing.assert_array_equal(layers[0], conv_reference(x, w, state, False)[1])  # conv_states_kernel, layer 0
    np.testing.assert_array_equal(layers[1], -layers[0])  # layer 1: (-x, -state)
    return out[0].reshape(T, C), out[1].reshape(K - 1, C), out[2].reshape(T, C), out[3].reshape(K - 1, C)


def conv_reference(x, w, state, silu):
    """float64 numpy: y[t, c] = sum_j w[j, c] X[t + j, c] over X = [state ; x] (then silu), the new state X's last
    K - 1 rows."""
    K, T = w.shape[0], x.shape[0]
    X = np.concatenate([state, x]).astype(np.float64)
    ref = np.stack([(w.astype(np.float64) * X[t : t + K]).sum(0) for t in range(T)]) if T else np.zeros((0, x.shape[1]))
    return (ref / (1 + np.exp(-ref)) if silu else ref), X[X.shape[0] - (K - 1) :].astype(np.float32)


# in place: chunks of at least K - 1 tokens (as the host asks); out of place: a token a chunk (the host's verify widths,
# T <= 16), or 2, every chunk reading the state rows it needs
@pytest.mark.parametrize("T,C,chunk,in_place", [(1, 130, 16, True), (2, 64, 16, True), (3, 5, 16, True),
                                                (40, 200, 16, True), (37, 129, 8, True), (0, 33, 16, True),
                                                (8, 130, 1, False), (2, 64, 1, False), (1, 33, 1, False),
                                                (16, 40, 1, False), (5, 129, 2, False), (40, 70, 16, False)])
@pytest.mark.parametrize("silu", [True, False])
def test_conv_taps_kernel_emulated_bitwise(conv_emu, rng, T, C, chunk, in_place, silu):
    K = 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    y1, s1, y2, s2 = run_emu(conv_emu, x, w, state, chunk, silu, in_place)
    np.testing.assert_array_equal(y2.view(np.uint32), y1.view(np.uint32))
    np.testing.assert_array_equal(s2, s1)
    ref, new_state = conv_reference(x, w, state, silu)
    np.testing.assert_allclose(y1, ref, rtol=1e-5, atol=1e-5 * max(np.abs(ref).max(initial=0), 1))
    np.testing.assert_array_equal(s1, new_state)


@pytest.mark.parametrize("K,T,chunk,in_place", [(2, 8, 1, False), (2, 8, 16, True), (5, 3, 1, False), (5, 9, 16, True),
                                                (1, 4, 1, False)])
def test_conv_generic_kernel_emulated(conv_emu, rng, K, T, chunk, in_place):
    """conv1d_kernel (K != 4) out of place a token a chunk, and in place, against float64 numpy."""
    C = 70
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    y1, s1, _, _ = run_emu(conv_emu, x, w, state, chunk, True, in_place)
    ref, new_state = conv_reference(x, w, state, True)
    np.testing.assert_allclose(y1, ref, rtol=1e-5, atol=1e-5 * max(np.abs(ref).max(initial=0), 1))
    np.testing.assert_array_equal(s1, new_state)

