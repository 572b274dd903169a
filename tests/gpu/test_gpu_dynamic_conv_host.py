"""DFlash 2's grouped dynamic conv kernel of the GPU (native/src/gpu/dynamic_conv.cuh), emulated on the host.

host_emu/dynamic_conv_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: __fmul_rn /
__fadd_rn rounded once each, as the device's) and runs grouped_dynamic_conv_kernel with dynamic_conv.cu's grid
and arguments. Its output must equal the numpy reference draft_worker.model.grouped_dynamic_conv bit for bit
(NaNs equal as NaNs): the index arithmetic (flattened grid, groups, taps, the side of a [L, S, taps, G]
projection, the causal cut at the block start) and the order of the F32 operations. The launch itself:
test_gpu_dynamic_conv.py on a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from specd.draft_worker.model import grouped_dynamic_conv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native"))
from host_emu_build import build_emu  # noqa: E402
from test_dynamic_conv import assert_bits  # noqa: E402


@pytest.fixture(scope="module")
def conv_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "dynamic_conv_emu", ["dynamic_conv.cuh", "pdl.cuh"], "dynamic_conv_main.cpp")


def run_emu(emu, y, D, base, side):
    d, exe = emu
    L, S, taps, G = D.shape
    H = y.shape[1]
    files = {n: str(d / f"{n}.bin") for n in ("y", "dyn", "base", "out")}
    for n, a in (("y", y), ("dyn", D), ("base", base)):
        np.ascontiguousarray(a, np.float32).tofile(files[n])
    subprocess.run([str(exe), *(str(v) for v in (L, H, taps, G, S, side))] +
                   [files[n] for n in ("y", "dyn", "base", "out")], check=True, capture_output=True, text=True)
    return np.fromfile(files["out"], np.float32).reshape(L, H)


# (L, taps, G, group_size, S): L < taps, one row, H odd (21), a partial last block (L * H = 17 * 21 = 357),
# several blocks (8 * 320), the 27B's groups of 16 with both projection sides
@pytest.mark.parametrize("L,taps,G,gs,S", [(1, 2, 7, 3, 1), (2, 4, 7, 1, 1), (3, 4, 5, 3, 2), (17, 2, 7, 3, 1),
                                           (8, 2, 20, 16, 2), (17, 4, 4, 16, 2), (5, 1, 3, 5, 1)])
def test_dynamic_conv_kernel_emulated_bitwise(conv_emu, rng, L, taps, G, gs, S):
    H = G * gs
    y = rng.standard_normal((L, H)).astype(np.float32)
    D = rng.standard_normal((L, S, taps, G)).astype(np.float32)
    base = rng.standard_normal((taps, H)).astype(np.float32)
    for side in range(S):
        assert_bits(run_emu(conv_emu, y, D, base, side), grouped_dynamic_conv(y, D[:, side], base, gs))


def test_dynamic_conv_kernel_emulated_inf_nan(conv_emu, rng):
    L, taps, G, gs = 8, 4, 5, 3
    y = rng.standard_normal((L, G * gs)).astype(np.float32)
    D = rng.standard_normal((L, 2, taps, G)).astype(np.float32)
    base = rng.standard_normal((taps, G * gs)).astype(np.float32)
    y[3] = 0.0
    D[4, 1, 1] = np.inf  # inf coefficient times zero input: NaN
    y[0, :4] = [np.inf, -np.inf, np.nan, -0.0]
    base[2, 5:8] = [np.inf, -np.inf, np.nan]
    with np.errstate(invalid="ignore"):
        want = grouped_dynamic_conv(y, D[:, 1], base, gs)
    assert np.isnan(want).any()
    assert_bits(run_emu(conv_emu, y, D, base, 1), want)
