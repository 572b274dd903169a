"""Builds a host-emulation harness (tests/gpu/host_emu/*_main.cpp) with the GPU headers it compiles for the
CPU, and draws the attention harnesses' random inputs, for the emulation tests (test_gpu_flash_attention_host.py,
test_gpu_attention_mma_host.py, test_gpu_mask_compact_host.py, test_gpu_topk_host.py, ...); tree_mask and topk_plan also serve test_gpu_ops2.py."""
import os
import shutil
import subprocess

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_SRC = os.path.join(HERE, "..", "..", "native", "src", "gpu")
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build_emu(tmp_path_factory, name, headers, main, defines=()):
    """(folder, executable) of host_emu/``main`` compiled (C++20, -ffp-contract=off, with ``defines``, e.g.
    "-DSPECD_HIP=1" for a header's AMD path) with the GPU ``headers`` (names in native/src/gpu) and
    host_emu's portability.h / warp_emu.h / attn_case.h; skips without a C++20 compiler or the source tree."""
    if not CXX or not all(os.path.exists(os.path.join(GPU_SRC, h)) for h in headers):
        pytest.skip("no C++ compiler or no source tree")
    d = tmp_path_factory.mktemp(name)
    for src in [os.path.join(GPU_SRC, h) for h in headers] + [
            os.path.join(HERE, "host_emu", f) for f in ("portability.h", "warp_emu.h", "attn_case.h", main)]:
        shutil.copy(src, d / os.path.basename(src))
    exe = d / name
    r = subprocess.run([CXX, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", *defines, "-I", str(d), "-o",
                        str(exe), str(d / main)], capture_output=True, text=True)
    if r.returncode != 0 and "barrier" in r.stderr:
        pytest.skip("C++ compiler without std::barrier (C++20)")
    assert r.returncode == 0, r.stderr
    return d, exe


def inputs(rng, n, hq, hkv, d, cap, qscale=1.0):
    """Random attention inputs for the harnesses: q F32 [n, hq, d] (times qscale), K and V F16
    [cap, hkv, d], all standard normal."""
    q = (rng.standard_normal((n, hq, d)) * qscale).astype(np.float32)
    k = rng.standard_normal((cap, hkv, d)).astype(np.float16)
    v = rng.standard_normal((cap, hkv, d)).astype(np.float16)
    return q, k, v


def tree_mask(prefix, parents):
    """A tree verify's mask, I32 [nodes, prefix + nodes]: every node sees the committed prefix, itself and
    its ancestors (parents[j] < j, -1 for a root)."""
    nodes = len(parents)
    mask = np.zeros((nodes, prefix + nodes), np.int32)
    mask[:, :prefix] = 1
    for j in range(nodes):
        a = j
        while a >= 0:
            mask[j, prefix + a] = 1
            a = parents[a]
    return mask


def topk_plan(V, k):
    """native/src/gpu/topk.cuh's plan(V, k) for the top-k tests: (lg, chunks, split), chunks of 2^lg
    entries (>= 8 k chunks of 256..4096 when V allows, at most 1024 chunks), split when k <= chunks."""
    lg = 12
    while lg > 8 and (V >> lg) < 8 * k:
        lg -= 1
    while -(-V // (1 << lg)) > 1024:
        lg += 1
    chunks = -(-V // (1 << lg))
    return lg, chunks, k <= chunks
