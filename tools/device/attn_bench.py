"""Decode / verify attention over a long KV cache on the GPU: time per call, K/V bandwidth against the copy
bandwidth of the same run, and the GPU time per kernel (issue 7, long-context decode).

The 27B's attention shapes (24 q heads, 4 KV heads, head_dim 256, F16 caches): for each context length, one
query row (a decode step), 8 causal rows at the last 8 positions (a chain verify of width 8) and 8 rows with
an ancestor mask over the last 8 keys (a tree verify). Each call reads the visible K and V once from HBM at
best (4 KiB per key and layer), so ``kv_GBps`` = K/V bytes / time is the figure to hold against the copy
bandwidth. Calls rotate among enough cache copies (>= 256 MB) that no call finds its keys in the 50 MB L2;
``trusted=True`` (no host read-back of q_pos), so the loop measures the GPU (the host enqueues faster).
Kernel times: torch.profiler's CUPTI trace of 10 calls, each kernel counted from the end of the kernels
before it (tools/bench/gpu_decode.py's ``exclusive_times``: with programmatic dependent launch a kernel's
span also covers its wait for the predecessor).

Usage (GPU machine, specd built with SPECD_GPU=cuda): python tools/device/attn_bench.py --out DIR
[--contexts 4096 32768 131072] [--label NAME] [--probe]. Writes DIR/attn_bench[_NAME].json and prints a markdown
table; --probe only calls each case once (for Nsight Compute).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import specd.native as sn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import kernel_profile  # noqa: E402
from gpu_report import copy_bandwidth, on_gpu  # noqa: E402

HQ, HKV, D = 24, 4, 256
L2_BYTES = 256 << 20  # rotate among copies until this much K/V is in play (5x the H200's L2)


def cases(rng, kv_len: int):
    """(name, rows, kwargs of sn.attention) for one context length."""
    one = on_gpu(rng.standard_normal((1, HQ, D)).astype(np.float32))
    eight = on_gpu(rng.standard_normal((8, HQ, D)).astype(np.float32))
    mask = np.ones((8, kv_len), np.int32)
    mask[:, kv_len - 8:] = np.tril(np.ones((8, 8), np.int32))
    return [("decode, 1 row", 1, dict(q=one, q_pos=on_gpu(np.array([kv_len - 1], np.int32)))),
            ("chain verify, 8 rows", 8, dict(q=eight, q_pos=on_gpu(np.arange(kv_len - 8, kv_len, dtype=np.int32)))),
            ("tree verify, 8 rows (mask)", 8, dict(q=eight, q_pos=on_gpu(np.arange(kv_len - 8, kv_len, dtype=np.int32)),
                                                  causal=False, mask=on_gpu(mask)))]


def kernel_times(call, calls: int = 10) -> list[dict]:
    """GPU time per kernel of one call (the mean over ``calls``), or [] without PyTorch's profiler."""
    try:
        return kernel_profile(lambda: [call() for _ in range(calls)], sn.gpu_synchronize, calls)
    except ImportError:
        return []


def measure(rng, kv_len: int, copy_gbps: float | None) -> list[dict]:
    kv_bytes = 2 * kv_len * HKV * D * 2
    copies = max(1, math.ceil(L2_BYTES / kv_bytes))
    raw = (rng.standard_normal((kv_len, HKV, D)) * 0.5).astype(np.float16)
    caches = [(on_gpu(raw), on_gpu(raw[::-1].copy())) for _ in range(copies)]
    rows = []
    for name, n, kw in cases(rng, kv_len):
        i = 0

        def call():
            nonlocal i
            k, v = caches[i % copies]
            i += 1
            return sn.attention(kw["q"], k, v, kv_len, kw["q_pos"], causal=kw.get("causal", True),
                                mask=kw.get("mask"), trusted=True)
        calls = max(20, min(400, int(2e10 / kv_bytes)))
        for _ in range(5):
            call()
        sn.gpu_synchronize()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            sn.gpu_synchronize()
            times.append((time.perf_counter() - t0) / calls)
        t = statistics.median(times)
        gbps = kv_bytes / t / 1e9
        rows.append({"context": kv_len, "case": name, "rows": n, "us_per_call": t * 1e6, "kv_GBps": gbps,
                     "ratio_to_copy": gbps / copy_gbps if copy_gbps else None,
                     "kernels": kernel_times(call)})
        print(json.dumps(rows[-1]), flush=True)
    del caches
    return rows


def markdown(rep: dict) -> str:
    L = [f"Copy bandwidth {rep['copy_GBps']:.0f} GB/s." if rep["copy_GBps"] else "", "",
         "| context | case | us / call | K/V GB/s | of copy | kernels (us / call) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        ks = "; ".join(f"{k['kernel'].split('<')[0]} {k['us_per_step']:.1f}" for k in r["kernels"][:4])
        ratio = f"{r['ratio_to_copy']:.3f}" if r["ratio_to_copy"] else "n/a"
        L.append(f"| {r['context']} | {r['case']} | {r['us_per_call']:.1f} | {r['kv_GBps']:.0f} | {ratio} | {ks} |")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072],
                    help="KV lengths (keys per call), default 4096 32768 131072")
    ap.add_argument("--label", default="", help="name of the tree measured (shown in the JSON)")
    ap.add_argument("--probe", action="store_true",
                    help="call each case once, no timing or profiler (a target for Nsight Compute: ncu -k regex:attn_)")
    args = ap.parse_args(argv)
    if any(c < 8 for c in args.contexts):
        ap.error("--contexts: each at least 8 (the verify cases use the last 8 positions)")
    rng = np.random.default_rng(7)
    if args.probe:
        for c in args.contexts:
            raw = (rng.standard_normal((c, HKV, D)) * 0.5).astype(np.float16)
            k, v = on_gpu(raw), on_gpu(raw[::-1].copy())
            for name, _, kw in cases(rng, c):
                sn.attention(kw["q"], k, v, c, kw["q_pos"], causal=kw.get("causal", True), mask=kw.get("mask"), trusted=True)
            sn.gpu_synchronize()
        return 0
    cb = copy_bandwidth()
    rep = {"label": args.label, "copy_GBps": cb["GBps"] if cb else None, "rows": []}
    for c in args.contexts:
        rep["rows"] += measure(rng, c, rep["copy_GBps"])
    os.makedirs(args.out, exist_ok=True)
    name = f"attn_bench{'_' + args.label if args.label else ''}.json"
    Path(args.out, name).write_text(json.dumps(rep, indent=1))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
