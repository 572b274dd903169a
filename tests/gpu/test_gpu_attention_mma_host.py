"""The exact attention path's tensor-core chunk pass (native/src/gpu/attention_chunk_mma.cuh), emulated
on the host.

host_emu/chunk_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: one thread per lane,
mma.sync m16n8k16 f16 -> f32 and shuffles emulated from the PTX ISA fragment layouts) and runs
attn_chunk_mma_kernel with attention.cu's launch plan, then combines its partials with the two-level
arithmetic of attn_combine_kernel / attn_combine_groups_kernel (mirrored on the host, not emulated). So the q / K / V / P fragment layouts (the permuted dims of the 16-byte loads,
the byte permutes that pair two keys of V), the two-term F16 splits of q and p, the slot table (rows packed
into m-tiles, or one row per m-tile under a window; GQA groups over 16 heads), the key walk (chunks by rank,
the mask's compacted positions, read once per tile where the rows agree and once per row where not or where
a key some row does not see holds a non-finite V, zero-filled keys past the pass's count), the per-slot
masking and the row slices of a call are checked without
a GPU against a float64 reference, within the exact path's tolerance (atol 2e-5 * max|v| + rtol 1e-4).
The emulated MMA sums in double, so the hardware's own accumulation is covered only by the GPU tests
(test_gpu_ops2.py), as is the launch itself (registers, occupancy, PDL).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu, inputs, tree_mask  # noqa: E402

ATOL, RTOL = 2e-5, 1e-4  # of max|v|, relative: the exact path's tolerance vs the CPU op


@pytest.fixture(scope="module")
def chunk_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "chunk_emu",
                     ["attention_chunk_mma.cuh", "attention_flash.cuh", "attention_rows.cuh", "pdl.cuh",
                      "warp_reduce.cuh"], "chunk_main.cpp")


def run_emu(emu, q, k, v, kv_len, pos, causal=True, window=0, scale=None, mask=None, resident=10_000, slice_rows=0):
    """The emulated chunk pass + combine: F32 [n, hq, d] (k, v: F16 [capacity, hkv, d]) and the plan line."""
    d, exe = emu
    n, hq, hd = q.shape
    cap, hkv, _ = k.shape
    sc = 1.0 / np.sqrt(hd) if scale is None else scale
    files = {name: str(d / f"{name}.bin") for name in ("q", "pos", "k", "v", "mask", "out")}
    np.ascontiguousarray(q, np.float32).tofile(files["q"])
    np.ascontiguousarray(pos, np.int32).tofile(files["pos"])
    np.ascontiguousarray(k, np.float16).tofile(files["k"])
    np.ascontiguousarray(v, np.float16).tofile(files["v"])
    if mask is not None:
        np.ascontiguousarray(mask, np.int32).tofile(files["mask"])
    r = subprocess.run([str(exe), str(hd), str(n), str(hq), str(hkv), str(cap), str(kv_len), str(window),
                        str(int(causal)), repr(float(sc)), f"{resident}:{slice_rows}", files["q"], files["pos"], files["k"],
                        files["v"], files["mask"] if mask is not None else "-", files["out"]],
                       check=True, capture_output=True, text=True, timeout=600)  # a barrier bug hangs: fail instead
    return np.fromfile(files["out"], np.float32).reshape(n, hq, hd), r.stdout.strip()


def reference(q, k, v, kv_len, pos, causal=True, window=0, scale=None, mask=None):
    """softmax(scale q k^T) v in float64 over each row's visible keys (cpu::attention's visibility:
    [lo, hi) and, with a mask, its nonzero entries); zeros for a row without one."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    r = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((n, hq, d))
    for i in range(n):
        lo = max(pos[i] - window + 1, 0) if window > 0 else 0
        hi = min(pos[i] + 1, kv_len) if causal else kv_len
        keys = [j for j in range(lo, hi) if mask is None or mask[i, j] != 0]
        if not keys:
            continue
        for g in range(hkv):
            s = q[i, g * r:(g + 1) * r].astype(np.float64) @ k[keys, g].astype(np.float64).T * scale
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[i, g * r:(g + 1) * r] = (w / w.sum(axis=1, keepdims=True)) @ v[keys, g].astype(np.float64)
    return out


def check(out, ref, v, what):
    assert np.isfinite(out).all(), f"{what}: unwritten partial or output (NaN)"
    err = np.abs(out - ref)
    lim = ATOL * float(np.abs(v.astype(np.float32)).max()) + RTOL * np.abs(ref)
    assert (err <= lim).all(), f"{what}: max err {err.max():.3g} (limit {lim.min():.3g}..)"


# (head_dim, hq, hkv, n, kv_len): decode and chain verify of the 27B's group (24:4 -> one KV head of 6:1
# here), drafter-like 128 with 1:1 (16 rows packed per m-tile), 64; chunk edges (64, 65, 127, 128 keys);
# the combine's group edge (rows of 4093..4100 keys: 64 or 65 chunks, one or two groups) and three groups.
CASES = [
    (256, 6, 1, 1, 200),
    (256, 12, 2, 8, 130),
    (128, 2, 2, 17, 128),
    (128, 1, 1, 20, 65),
    (64, 6, 1, 3, 64),
    (64, 4, 2, 5, 127),
    (64, 2, 1, 8, 4100),
    (64, 1, 1, 2, 8500),
]


@pytest.mark.parametrize("d,hq,hkv,n,kv_len", CASES)
def test_chunk_mma_emulated_chain_verify(chunk_emu, rng, d, hq, hkv, n, kv_len):
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len + 5)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    out, plan = run_emu(chunk_emu, q, k, v, kv_len, pos)
    assert "packed=1" in plan
    check(out, reference(q, k, v, kv_len, pos), v, f"d={d} {hq}/{hkv} n={n} kv={kv_len}")


def test_chunk_mma_emulated_rows_independent_of_the_call(chunk_emu, rng):
    """A row's result is the same bits whatever rows share its m-tiles: the 8 rows of a chain verify (GQA
    6:1: rows straddle m-tiles, keys past a row's count are real for later rows) equal 8 decodes."""
    d, hq, hkv, n, kv_len = 256, 6, 1, 8, 150
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    full, _ = run_emu(chunk_emu, q, k, v, kv_len, pos)
    for i in range(n):
        one, _ = run_emu(chunk_emu, q[i:i + 1], k, v, kv_len, pos[i:i + 1])
        np.testing.assert_array_equal(one.view(np.uint32), full[i:i + 1].view(np.uint32))


def test_chunk_mma_emulated_tree_mask_equals_chain(chunk_emu, rng):
    """A tree verify (mask over the prefix + ancestors, keys at cache rows c + node index) equals the chain
    verify of each node's path (keys at rows c + depth) bit for bit: same visible key sequence, so the
    same chunks. The nodes share m-tiles (GQA 3:1, 5 rows per tile); they agree on chunk 0 (the prefix,
    read once) and not on chunk 1 (read once per row)."""
    d, hq, hkv, prefix = 128, 3, 1, 100
    parents = [-1, 0, 0, 1, 1, 2, 3]  # node 0 at depth 0
    nodes = len(parents)
    depth = [0] * nodes
    for j in range(1, nodes):
        depth[j] = depth[parents[j]] + 1
    kv_len = prefix + nodes
    q, k, v = inputs(rng, nodes, hq, hkv, d, kv_len + 8)
    mask = tree_mask(prefix, parents)
    pos = np.array([prefix + j for j in range(nodes)], np.int32)  # each node at its own cache row
    tree, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, mask=mask)
    assert "packed=1" in plan
    check(tree, reference(q, k, v, kv_len, pos, mask=mask), v, "tree")
    for j in range(nodes):
        path = []
        a = j
        while a >= 0:
            path.append(a)
            a = parents[a]
        path = path[::-1]  # root .. j: the chain's rows prefix .. prefix + depth
        kc, vc = k.copy(), v.copy()
        kc[prefix:prefix + len(path)] = k[[prefix + a for a in path]]
        vc[prefix:prefix + len(path)] = v[[prefix + a for a in path]]
        chain, _ = run_emu(chunk_emu, q[j:j + 1], kc, vc, prefix + len(path), np.array([prefix + depth[j]], np.int32))
        np.testing.assert_array_equal(chain.view(np.uint32), tree[j:j + 1].view(np.uint32))


@pytest.mark.parametrize("causal,window", [(True, 37), (False, 0), (False, 21), (True, 70)])
def test_chunk_mma_emulated_window_and_bidirectional(chunk_emu, rng, causal, window):
    """Sliding windows (one row per m-tile: each row's chunks start at its own lo) and bidirectional rows,
    incl. rows without a visible key (zeros)."""
    d, hq, hkv, n, kv_len = 64, 6, 2, 12, 210
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n + 4, kv_len + 4, dtype=np.int32)  # the last rows past kv_len
    out, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, causal=causal, window=window)
    assert ("packed=1" in plan) == (window == 0)
    check(out, reference(q, k, v, kv_len, pos, causal, window), v, f"causal={causal} window={window}")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_chunk_mma_emulated_several_chunks_per_warp(chunk_emu, rng, d):
    """Few resident warps: each warp walks several chunks (cpw > 1, ds = 1), partial chunk groups at the end."""
    hq, hkv, n, kv_len = 2, 1, 2, 64 * 37 + 5
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.array([kv_len - 2, kv_len - 1], np.int32)
    out, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, resident=4)
    assert "cpw=1 " not in plan and "ds=1 " in plan, plan
    check(out, reference(q, k, v, kv_len, pos), v, "cpw > 1")


def test_chunk_mma_emulated_q_scales_and_peaky_softmax(chunk_emu, rng):
    """q of very different magnitudes per head (the per-slot 2^sigma: 1e-6 .. 1e4, beyond F16's range
    without it) and a peaky softmax (q * 4 on a head: most p far below F16's normal range before the 2^14
    scale), with an explicit scale."""
    d, hq, hkv, n, kv_len = 128, 6, 1, 2, 190
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    q[:, 0] *= 1e-6
    q[:, 1] *= 1e4 * 1e-3  # scores stay moderate with the scale below
    q[:, 2] *= 4.0
    q[:, 3] = 0.0  # all-zero q: uniform weights
    pos = np.array([kv_len - 2, kv_len - 1], np.int32)
    scale = 0.05
    out, _ = run_emu(chunk_emu, q, k, v, kv_len, pos, scale=scale)
    check(out, reference(q, k, v, kv_len, pos, scale=scale), v, "q scales")


def test_chunk_mma_emulated_random_mask(chunk_emu, rng):
    """Random masks (rows disagree in every chunk: one pass per row), incl. a row without a visible key,
    beside all-ones rows (which agree with each other), and an all-ones mask equal to no mask bitwise."""
    d, hq, hkv, n, kv_len = 64, 4, 2, 6, 300
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.array([299, 150, 299, 64, 299, 299], np.int32)
    mask = (rng.random((n, kv_len)) < 0.5).astype(np.int32)
    mask[1] = 0
    mask[4:] = 1
    out, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, causal=False, mask=mask)
    assert "packed=1" in plan
    check(out, reference(q, k, v, kv_len, pos, causal=False, mask=mask), v, "random mask")
    assert not out[1].any()
    ones = np.ones((n, kv_len), np.int32)
    y1, _ = run_emu(chunk_emu, q, k, v, kv_len, pos, mask=ones)
    y0, _ = run_emu(chunk_emu, q, k, v, kv_len, pos)
    np.testing.assert_array_equal(y1.view(np.uint32), y0.view(np.uint32))


def test_chunk_mma_emulated_mask_with_window(chunk_emu, rng):
    """A mask and a window together (a drafter's windowed block): one row per m-tile, the mask's compacted
    positions from each row's own window start."""
    d, hq, hkv, n, kv_len = 128, 4, 1, 9, 300
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    for window in (5, 70, 130):
        mask = (rng.random((n, kv_len)) < 0.8).astype(np.int32)
        out, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, causal=False, window=window, mask=mask)
        assert "packed=0" in plan
        check(out, reference(q, k, v, kv_len, pos, False, window, mask=mask), v, f"mask, window={window}")


@pytest.mark.parametrize("window", [0, 50])
def test_chunk_mma_emulated_gqa_over_16_heads(chunk_emu, rng, window):
    """20 q heads per KV head: a row's heads span two m-tiles (packed across rows, or two per row under a
    window); each row of a 3-row call equals the row alone bitwise."""
    d, hq, hkv, n, kv_len = 64, 40, 2, 3, 200
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    out, _ = run_emu(chunk_emu, q, k, v, kv_len, pos, window=window)
    check(out, reference(q, k, v, kv_len, pos, window=window), v, f"r=20 window={window}")
    for i in range(n):
        one, _ = run_emu(chunk_emu, q[i:i + 1], k, v, kv_len, pos[i:i + 1], window=window)
        np.testing.assert_array_equal(one.view(np.uint32), out[i:i + 1].view(np.uint32))


@pytest.mark.parametrize("key,masked", [(99, False), (97, False), (97, True)])
def test_chunk_mma_emulated_non_finite_v_seen_by_another_row(chunk_emu, rng, key, masked):
    """An inf in V (an F16 cache overflows past 65504) at a key only the later verify rows see (the last
    key; the first key the first row does not see), with or without an all-ones mask, beside a row without
    keys in that chunk (a masked row with its tail masked off): the rows that do not see it stay finite and
    equal their decodes bitwise (the chunk then runs once per row: a zero weight times inf would be NaN);
    the rows that see it get the CPU's inf / NaN."""
    d, hq, hkv, n, kv_len = 64, 2, 1, 4, 100
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    v[key, 0, 5] = np.inf
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)  # row i sees keys < 97 + i
    mask = None
    if masked:
        mask = np.ones((n + 1, kv_len), np.int32)
        mask[n, 64:] = 0  # an extra row with no key in chunk 1
        q = np.concatenate([q, q[:1]])
        pos = np.concatenate([pos, pos[-1:]])
    out, _ = run_emu(chunk_emu, q, k, v, kv_len, pos, causal=True, mask=mask)
    for i in range(len(pos)):
        one, _ = run_emu(chunk_emu, q[i:i + 1], k, v, kv_len, pos[i:i + 1], mask=None if mask is None else mask[i:i + 1])
        np.testing.assert_array_equal(one.view(np.uint32), out[i:i + 1].view(np.uint32))
        assert np.isfinite(one).all() == (pos[i] < key or (masked and i == n)), f"row {i}"


def test_chunk_mma_emulated_huge_q(chunk_emu, rng):
    """|q| near 2^118 with tiny keys and scale (finite scores): 2^sigma keeps q inside F16's range."""
    d, hq, hkv, n, kv_len = 64, 1, 1, 1, 64
    q, _, v = inputs(rng, n, hq, hkv, d, kv_len)
    q *= np.float32(2.0 ** 118 / np.abs(q).max())
    k = (rng.standard_normal((kv_len, hkv, d)) * 2 ** -20).astype(np.float16)
    pos = np.array([kv_len - 1], np.int32)
    out, _ = run_emu(chunk_emu, q, k, v, kv_len, pos, scale=2.0 ** -100)
    check(out, reference(q, k, v, kv_len, pos, scale=2.0 ** -100), v, "huge q")


def test_chunk_mma_emulated_row_slices(chunk_emu, rng):
    """Rows in slices of 3 (attention.cu bounds its scratch so: i0 > 0) equal one slice bitwise."""
    d, hq, hkv, n, kv_len = 128, 6, 2, 8, 170
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    whole, _ = run_emu(chunk_emu, q, k, v, kv_len, pos)
    sliced, _ = run_emu(chunk_emu, q, k, v, kv_len, pos, slice_rows=3)
    np.testing.assert_array_equal(sliced.view(np.uint32), whole.view(np.uint32))
    check(whole, reference(q, k, v, kv_len, pos), v, "slices")


@pytest.mark.parametrize("case", ["decode", "chain", "tree", "window", "inf_v", "decode_128", "tree_128", "window_128"])
def test_chunk_mma_emulated_warps_per_chunk_change_no_bit(chunk_emu, rng, case):
    """ds = head_dim / 64 warps sharing a chunk (each computes 8 / ds of S's key tiles, exchanged through shared
    memory between named barriers, then P and one 64-dim round of P V: the plan of a short context) give the same
    bits as one warp per chunk (ds = 1, as the plan picks when fewer warps are resident; cpw = 1 in both). The
    27B's head_dim 256 and GQA group (6:1): a decode, a chain verify, a tree mask (chunks read once per row), a
    window (one row per m-tile) and an inf in V that only later rows see (per-row passes); and a head_dim 128
    decode, tree and window (ds = 2)."""
    d, hq, hkv = (128, 2, 2) if case.endswith("_128") else (256, 6, 1)
    n, kv_len, window = {"decode": (1, 200, 0), "chain": (8, 150, 0), "tree": (7, 107, 0), "window": (3, 230, 70),
                         "inf_v": (4, 100, 0), "decode_128": (1, 300, 0), "tree_128": (7, 107, 0),
                         "window_128": (3, 230, 70)}[case]
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len + 8)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    mask = None
    if case.startswith("tree"):
        mask = tree_mask(100, [-1, 0, 0, 1, 1, 2, 3])
        pos = np.arange(100, 107, dtype=np.int32)
    if case == "inf_v":
        v[kv_len - 2, 0, 5] = np.inf
    split, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, window=window, mask=mask)
    assert f"ds={d // 64} " in plan and "cpw=1 " in plan, plan
    tasks = int(plan.split("mtiles=")[1].split()[0]) * hkv * -(-kv_len // 64)
    one, plan = run_emu(chunk_emu, q, k, v, kv_len, pos, window=window, mask=mask, resident=tasks)
    assert "ds=1 " in plan and "cpw=1 " in plan, plan
    np.testing.assert_array_equal(split.view(np.uint32), one.view(np.uint32))
    if case != "inf_v":  # (the rows that see the inf are inf / NaN: compared bitwise only)
        check(one, reference(q, k, v, kv_len, pos, window=window, mask=mask), v, case)
