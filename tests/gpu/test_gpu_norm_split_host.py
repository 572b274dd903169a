"""rms_norm_matmul's GPU kernel (native/src/gpu/norm_split.cuh: RMSNorm fused with the tensor-core GEMV's x
split), emulated on the host.

host_emu/norm_split_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: one thread per
thread of a block, shuffles, __syncthreads, shared memory) and runs it with matmul.cu's launch (one
block per row of norm::threads_for(d / 4) threads), then the composition it replaces on the GPU: the
standalone norm kernel's row code (norm_row, same block size) and split_x_kernel of its output, every
buffer poisoned first. The fused split must equal the composition's byte for byte, h = x + residual
bit for bit, and the values the split encodes must be float64's RMSNorm within the split's contract
(matmul_mma.cuh: 2^-20 of each 256-input group's maximum) plus F32 rounding. Built with AddressSanitizer,
so a read out of bounds fails too. Cases: d = 256 and a ragged
last group (288), the 27B's 5120 (640 threads), 1024-thread blocks (8192), more 256-input groups than warps
(12288, and 8480 with a ragged last group), 1-3 rows, with and without the residual and the norm weight, the
row staged in (poisoned) shared memory as matmul.cu launches rows of up to 8192 floats, or re-read from global
memory as it launches longer ones. (Blocks
run one after another here, so races between blocks cannot show; the hardware: test_gpu_matmul.py's
test_rms_norm_matmul_and_swiglu_matmul_equal_their_compositions_on_gpu.)

norm_split_partials_kernel (x as split-K partials, one thread-block cluster a row) runs with its launch's shape:
a cluster's blocks at once (warp_emu.h: emulate_clusters), each with its own poisoned dynamic shared memory of
cluster_smem_bytes, the warp sums stored into every block's through the emulated distributed shared memory.
Its split must equal the composition on the parts' in-order sum byte for byte, h bit for bit. (On the H200:
test_gpu_partials.py.)
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu  # noqa: E402

HEADERS = ["norm_split.cuh", "dyn_smem.cuh", "matmul_mma.cuh", "weight_formats.cuh", "norm.cuh", "activations.cuh",
           "warp_reduce.cuh", "pdl.cuh", "partials.cuh"]
FILES = ("x", "r", "w", "h", "split", "h_ref", "split_ref", "recon")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    # AddressSanitizer: a read past a row, the norm weight or the shared-memory stage fails the run
    return build_emu(tmp_path_factory, "norm_split_emu", HEADERS, "norm_split_main.cpp", ("-fsanitize=address",))


def run_emu(emu, x, r, w, eps, staged, splits=0):
    """The harness on x [n, d] (splits 0), or on x's partials [splits, n, d] (the cluster kernel)."""
    d, exe = emu
    n, dim = x.shape[-2:]
    files = {f: str(d / f"{f}.bin") for f in FILES}
    x.astype(np.float32).tofile(files["x"])
    (r if r is not None else np.zeros(0, np.float32)).astype(np.float32).tofile(files["r"])
    (w if w is not None else np.zeros(0, np.float32)).astype(np.float32).tofile(files["w"])
    flags = [str(int(r is not None)), str(int(w is not None)), str(int(staged)), str(splits)]
    out = subprocess.run([str(exe), str(n), str(dim), *flags, repr(eps)] + [files[f] for f in FILES], check=True,
                         capture_output=True, text=True).stdout.strip()
    got = {f: np.fromfile(files[f], np.uint8 if f.startswith("split") else np.float32) for f in FILES[3:]}
    for f in ("h", "h_ref", "recon"):
        got[f] = got[f].reshape(n, dim)
    return got, out


def threads_for(items):
    """norm.cuh's threads_for: about ceil(items / 1024) items a thread, whole warps."""
    per = -(-items // 1024)
    return -(-(-(-items // per)) // 32) * 32


def rms_norm64(h, w, eps):
    h = h.astype(np.float64)
    u = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps)
    return u * w.astype(np.float64) if w is not None else u


# (n, d): one warp per 256-input group and 2 rows; a ragged last group (Q8_0's 288 inputs); the 27B's
# hidden size (640-thread blocks, 20 groups); 1024-thread blocks, one group per warp (8192); more groups
# than warps (12288: 48 groups on 32 warps; 8480: 34 on 23, the last group ragged)
CASES = [(2, 256), (3, 288), (1, 5120), (2, 5120), (1, 8192), (2, 12288), (2, 8480)]


# norm_split.cuh's kMaxStagedFloats: matmul.cu stages rows of up to this many floats in shared memory
MAX_STAGED_FLOATS = int(re.search(r"kMaxStagedFloats = (\d+);", open(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "native", "src", "gpu", "norm_split.cuh")).read()).group(1))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("resid", [True, False])
@pytest.mark.parametrize("n,d,staged", [(n, d, staged) for n, d in CASES for staged in (True, False)
                                        if d <= MAX_STAGED_FLOATS or not staged])
def test_norm_split_emulated_equals_the_composition(emu, rng, n, d, resid, weighted, staged):
    eps = 1e-6
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, 7] *= 40.0  # an outlier activation: its group's other inputs keep fewer bits in the split
    r = rng.standard_normal((n, d)).astype(np.float32) if resid else None
    w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32) if weighted else None
    got, out = run_emu(emu, x, r, w, eps, staged)
    assert out == f"threads={threads_for(d // 4)}"
    check(got, x, r, w, eps, h_always=False)


def check(got, x, r, w, eps, h_always):
    """The fused split byte for byte the composition's, h = x (+ r) bit for bit (written without a residual
    only when h_always), and the split's values float64's RMSNorm within the split's contract."""
    d = x.shape[1]
    assert np.array_equal(got["split"], got["split_ref"])  # byte for byte, poisoned bytes included
    h = x + r if r is not None else x
    if r is not None:
        assert np.array_equal(got["h_ref"].view(np.uint32), h.view(np.uint32))
    if r is not None or h_always:
        assert np.array_equal(got["h"].view(np.uint32), h.view(np.uint32))
    else:
        assert np.isnan(got["h"]).all()  # no h without a residual
    want = rms_norm64(h, w, eps)
    # each input's 256-input group maximum (the last group ragged when d % 256 != 0)
    bound = np.concatenate([np.repeat(np.abs(want[:, g:g + 256]).max(axis=1, keepdims=True), min(256, d - g), axis=1)
                            for g in range(0, d, 256)], axis=1)
    err = np.abs(got["recon"].astype(np.float64) - want)
    assert np.all(err <= 2.0 ** -20 * bound + 2e-7 * np.abs(want)), (err / bound).max()


def cluster_blocks(d):
    """norm_split.cuh's norm_cluster_blocks for the cases below: threads_for(d / 4) in blocks of 128."""
    return threads_for(d // 4) // 128


# (n, d, S): the 27B's FFN down projection (17 parts of 5120: 5 blocks, two items a thread) and its out
# projections (6 parts), 8 blocks of one item (4096) and of two (8192), the smallest cluster (1024: 2 blocks), one
# part (the value itself), 3 rows (the clusters in turn), ragged rows (4000: 1000 items on 1024 threads, the last
# 256-input group ragged; 2016: 504 items on 4 blocks).
PARTIALS_CASES = [(1, 5120, 17), (2, 5120, 6), (1, 4096, 5), (1, 8192, 3), (3, 1024, 2), (1, 6144, 1), (1, 4000, 4),
                  (2, 2016, 3)]


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("resid", [True, False])
@pytest.mark.parametrize("n,d,splits", PARTIALS_CASES)
def test_norm_split_partials_emulated_equals_the_composition(emu, rng, n, d, splits, resid, weighted):
    """norm_split_partials_kernel, its cluster's blocks run together with their own shared memory (the warp sums
    exchanged through the emulated distributed shared memory): bit for bit the one-block composition on the
    in-order sum of the parts."""
    eps = 1e-6
    parts = rng.standard_normal((splits, n, d)).astype(np.float32)
    parts[:, :, 7] *= 40.0
    x = parts[0].copy()
    for k in range(1, splits):  # partials.cuh's order: one F32 add per part, in part order
        x = x + parts[k]
    r = rng.standard_normal((n, d)).astype(np.float32) if resid else None
    w = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32) if weighted else None
    got, out = run_emu(emu, parts, r, w, eps, False, splits)
    assert out == f"blocks={cluster_blocks(d)}\nthreads={threads_for(d // 4)}"
    check(got, x, r, w, eps, h_always=True)

