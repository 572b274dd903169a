"""The row-wise top-k kernels (native/src/gpu/topk.cuh), emulated on the host.

host_emu/topk_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: one thread per lane,
shuffles, __syncthreads, shared-memory atomicAdd) and runs topk.cu's launch: chunk_max_kernel +
select_kernel when plan(V, k) splits the row, else rounds_kernel (mode 1 runs rounds_kernel whatever the
plan), with the outputs poisoned. Checked without a GPU against a numpy model of the ranking (NaN first,
larger value first, -0.0 == +0.0, ties by lower index) and against the CPU op, bit for bit (values and
indices): random rows, ties across chunk edges, NaN / +-inf / -0.0 / +0.0, k = 1 and k = V, V at and
around chunk edges, rows of mostly one value (the select kernel's overflow rounds), and the plan's chunk
choice. The launches themselves (registers, PDL, scratch) are covered by test_gpu_ops2.py on a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu, topk_plan as plan  # noqa: E402

POISON_IDX = -7  # topk_main.cpp's fill of idx


@pytest.fixture(scope="module")
def topk_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "topk_emu", ["topk.cuh", "pdl.cuh", "ranking.cuh", "warp_reduce.cuh"],
                     "topk_main.cpp")


def ref_topk(x, k):
    """(values, indices) [n, k] by the ranking, from a stable sort (numpy's lexsort)."""
    n, V = x.shape
    vals = np.empty((n, k), np.float32)
    idx = np.empty((n, k), np.int32)
    for r in range(n):
        row = x[r]
        nan = np.isnan(row)
        order = np.lexsort((np.arange(V), -np.where(nan, 0, row), ~nan))[:k]  # -0.0 == +0.0: index decides
        idx[r] = order
        vals[r] = row[order]
    return vals, idx


def run_emu(emu, x, k, mode=0):
    d, exe = emu
    n, V = x.shape
    files = {name: str(d / f"{name}.bin") for name in ("x", "vals", "idx")}
    np.ascontiguousarray(x, np.float32).tofile(files["x"])
    r = subprocess.run([str(exe), str(n), str(V), str(k), str(mode), files["x"], files["vals"], files["idx"]],
                       check=True, capture_output=True, text=True)
    return (np.fromfile(files["vals"], np.float32).reshape(n, k), np.fromfile(files["idx"], np.int32).reshape(n, k),
            r.stdout.strip())


def check(emu, x, k, mode=0):
    vals, idx, line = run_emu(emu, x, k, mode)
    lg, chunks, split = plan(x.shape[1], k)
    assert line == f"split={int(split)} lg={lg} chunks={chunks}"
    assert (idx != POISON_IDX).all(), "an output never written"
    rv, ri = ref_topk(x, k)
    what = f"V={x.shape[1]} k={k} mode={mode} {line}"
    np.testing.assert_array_equal(idx, ri, err_msg=what)
    np.testing.assert_array_equal(vals.view(np.uint32), rv.view(np.uint32), err_msg=what)  # bits: -0.0, NaN
    try:
        import specd.native as sn
    except ImportError:
        return split
    cv, ci = sn.topk(np.ascontiguousarray(x, np.float32), k)
    np.testing.assert_array_equal(idx, ci.numpy(), err_msg=what)
    np.testing.assert_array_equal(vals.view(np.uint32), cv.numpy().view(np.uint32), err_msg=what)
    return split


def specials(rng, x):
    """x with NaN, +-inf, -0.0 / +0.0 and ties planted in some rows."""
    n, V = x.shape
    for r in range(n):
        kind = r % 4
        pos = rng.choice(V, size=min(V, 6), replace=False)
        if kind == 1:
            x[r, pos[:2]] = np.nan
            x[r, pos[2:3]] = np.inf
            x[r, pos[3:4]] = -np.inf
        elif kind == 2:
            x[r, pos[:3]] = -0.0
            x[r, pos[3:]] = 0.0
            x[r] = np.where(x[r] > 0, -x[r], x[r])  # zeros on top: -0.0 and +0.0 tie, by index
        elif kind == 3:
            x[r, pos] = x[r].max()  # ties at the top
    return x


def test_plan_chunks():
    """The chunk choice: >= 8 k chunks of at least 256 entries when V allows, at most 1024 chunks."""
    assert plan(248320, 16) == (10, 243, True)
    assert plan(248320, 1) == (12, 61, True)
    assert plan(248320, 64) == (8, 970, True)
    assert plan(4096, 16) == (8, 16, True)
    assert plan(4096, 17) == (8, 16, False)
    assert plan(7, 1) == (8, 1, True) and plan(7, 2)[2] is False
    assert plan(2**31 - 1, 1) == (21, 1024, True)


@pytest.mark.parametrize("V", [1, 7, 255, 256, 257, 1000, 4096, 4097, 2 * 4096 + 3])
@pytest.mark.parametrize("k", [1, 2, 16, "V"])
def test_topk_emulated_random(topk_emu, rng, V, k):
    """Random rows with specials, V at and around chunk edges, both paths (k = V and rounds_kernel on
    every input only for short rows: an emulated round costs two block barriers)."""
    if k == "V" and V > 64:
        pytest.skip("k = V emulated for short rows only")
    k = V if k == "V" else k
    if k > V:
        pytest.skip("k > V")
    x = specials(rng, rng.standard_normal((4, V)).astype(np.float32))
    check(topk_emu, x, k)
    if V <= 300 and k < V:
        check(topk_emu, x, k, mode=1)


@pytest.mark.parametrize("k", [1, 5, 16, 64])
def test_topk_emulated_chunk_edge_ties(topk_emu, rng, k):
    """Equal top values on both sides of chunk edges (the lower index wins across chunks), and equal
    chunk maxima, so the k-th chunk maximum is decided by index."""
    V = 20000
    lg, chunks, split = plan(V, k)
    assert split
    C = 1 << lg
    x = rng.standard_normal((3, V)).astype(np.float32)
    for e in range(1, chunks):
        x[0, e * C - 1] = x[0, e * C] = 9.0  # 2 (chunks - 1) tied entries, pairs straddling each edge
    x[1, ::C] = 5.0  # every chunk's maximum is 5.0 at its first entry
    x[1, 3 * C + 7] = 5.0
    x[2, C - 2:C + 2] = np.nan  # NaNs across an edge
    x[2, 2 * C] = -0.0
    x[2, 2 * C + 1] = np.inf
    assert check(topk_emu, x, k)


def test_topk_emulated_overflow(topk_emu, rng):
    """Rows where thousands of entries tie with the k-th chunk maximum: the select kernel's k rounds."""
    V, k = 40000, 16
    x = np.zeros((3, V), np.float32)
    x[1] = -np.inf
    x[1, rng.choice(V, 5, replace=False)] = rng.standard_normal(5)  # 5 finite, the rest -inf
    x[2] = np.float32(1.5)
    x[2, 12345] = -0.0
    x[2, 777] = np.nan
    check(topk_emu, x, k)


def test_topk_emulated_long_row(topk_emu, rng):
    """One vocabulary-sized row (the drafter's shape), k = 16, with specials."""
    x = specials(rng, rng.standard_normal((2, 248320)).astype(np.float32))
    assert check(topk_emu, x[1:], 16)


def test_topk_emulated_batch_invariant(topk_emu, rng):
    """A row's result alone equals its result among other rows."""
    x = specials(rng, rng.standard_normal((5, 3000)).astype(np.float32))
    v_all, i_all, _ = run_emu(topk_emu, x, 16)
    v_one, i_one, _ = run_emu(topk_emu, x[3:4], 16)
    np.testing.assert_array_equal(i_all[3:4], i_one)
    np.testing.assert_array_equal(v_all[3:4].view(np.uint32), v_one.view(np.uint32))
