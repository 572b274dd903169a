"""The mask compaction of the attention op (native/src/gpu/attention_mask.cuh), emulated on the host.

host_emu/mask_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: one thread per lane,
shuffles, __syncthreads) and runs attn_mask_count_kernel and attn_mask_compact_kernel with attention.cu's
launch (one block per (row, segment of 2048 positions), the count pass only for rows of several
segments), with idx and the segment counts poisoned. So the per-segment counts, each segment's first
rank summed from the earlier segments' counts, the scan within a segment and the row counts are checked
without a GPU against numpy: idx[i, :cnt[i]] = the nonzero positions of the row's [lo, hi), in order, and
nothing written past cnt[i]. The launch itself (registers, PDL) is covered by the masked attention tests of
test_gpu_ops2.py on a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu, tree_mask  # noqa: E402

SEG = 2048     # positions per block (attention_mask.cuh: kThreads * kPer)
POISON = -7    # mask_main.cpp's fill of idx


@pytest.fixture(scope="module")
def mask_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "mask_emu",
                     ["attention_mask.cuh", "attention_rows.cuh", "pdl.cuh", "warp_reduce.cuh"], "mask_main.cpp")


def run_emu(emu, mask, pos, causal, window):
    """(idx [n, kv_len], cnt [n], plan line) of the emulated kernels."""
    d, exe = emu
    n, kv_len = mask.shape
    files = {name: str(d / f"{name}.bin") for name in ("pos", "mask", "idx", "cnt")}
    np.ascontiguousarray(pos, np.int32).tofile(files["pos"])
    np.ascontiguousarray(mask, np.int32).tofile(files["mask"])
    r = subprocess.run([str(exe), str(n), str(kv_len), str(window), str(int(causal)), files["pos"], files["mask"],
                        files["idx"], files["cnt"]], check=True, capture_output=True, text=True)
    return (np.fromfile(files["idx"], np.int32).reshape(n, kv_len), np.fromfile(files["cnt"], np.int32),
            r.stdout.strip())


def check(emu, mask, pos, causal=False, window=0):
    n, kv_len = mask.shape
    idx, cnt, plan = run_emu(emu, mask, pos, causal, window)
    assert plan == f"nseg={-(-kv_len // SEG)} blocks={n * -(-kv_len // SEG)}"
    for i in range(n):
        lo = max(int(pos[i]) - window + 1, 0) if window > 0 else 0
        hi = min(int(pos[i]) + 1, kv_len) if causal else kv_len
        want = lo + np.flatnonzero(mask[i, lo:max(lo, hi)])
        what = f"row {i} (pos {pos[i]}, [{lo}, {hi}), kv_len {kv_len}, causal {causal}, window {window})"
        assert cnt[i] == len(want), what
        np.testing.assert_array_equal(idx[i, :cnt[i]], want, err_msg=what)
        assert (idx[i, cnt[i]:] == POISON).all(), f"{what}: written past the count"
    return cnt


@pytest.mark.parametrize("kv_len", [1, 100, SEG - 1, SEG, SEG + 1, 2 * SEG, 3 * SEG + 37])
def test_mask_compact_emulated_random(mask_emu, rng, kv_len):
    """Random masks of several densities (a row of all zeros, one of all ones, one sparse), kv_len a
    multiple of the segment or not, one segment (no count pass) or several; bidirectional and causal rows."""
    n = 6
    mask = (rng.random((n, kv_len)) < rng.choice([0.5, 0.9], (n, 1))).astype(np.int32)
    mask[1] = 0
    mask[2] = 1
    mask[3] = rng.random(kv_len) < 0.002
    mask *= rng.integers(1, 5, (n, kv_len), dtype=np.int32) * rng.choice([-1, 1], (n, kv_len))  # any nonzero
    pos = rng.integers(0, kv_len, n).astype(np.int32)
    pos[0] = kv_len - 1
    check(mask_emu, mask, pos)
    cnt = check(mask_emu, mask, pos, causal=True)
    assert cnt[1] == 0


@pytest.mark.parametrize("causal,window", [(True, 37), (True, 2500), (False, 2049), (False, 5000), (True, 1)])
def test_mask_compact_emulated_windows(mask_emu, rng, causal, window):
    """Windows that start inside a segment and span one or several segment boundaries (blocks wholly
    outside the row's range count zero), causal or not, with rows past kv_len (a causal row past
    kv_len + window - 1 sees nothing)."""
    kv_len = 3 * SEG + 500
    pos = np.array([0, 5, SEG - 1, SEG, SEG + 40, 2 * SEG + 7, kv_len - 1, kv_len + 3, kv_len + window + 10],
                   np.int32)
    mask = (rng.random((len(pos), kv_len)) < 0.7).astype(np.int32)
    cnt = check(mask_emu, mask, pos, causal, window)
    if causal:
        assert cnt[-1] == 0


def test_mask_compact_emulated_tree(mask_emu):
    """A tree verify's mask (committed prefix + ancestors) over a long prefix: the prefix plus the path,
    in order."""
    prefix, parents = 5000, [-1, 0, 0, 1, 1, 2, 3]
    mask = tree_mask(prefix, parents)
    pos = np.arange(prefix, prefix + len(parents), dtype=np.int32)
    cnt = check(mask_emu, mask, pos)
    assert list(cnt) == [prefix + 1, prefix + 2, prefix + 2, prefix + 3, prefix + 3, prefix + 3, prefix + 4]
