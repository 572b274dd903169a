"""Time per call of sn.topk on the GPU for the drafter's shapes (DFlash 2 proposes with [8, 248320], k = 16).

Each case: 50 calls, each followed by sn.gpu_synchronize(), wall clock; prints the median in us per call
(host enqueue + kernels + sync, as one call in the drafter's loop sees it) after 10 warm-up calls.

Usage (GPU machine, specd built with SPECD_GPU=cuda): python tools/device/topk_bench.py
For the kernels alone without the Python build: tools/device/topk_check.cu (its header says how).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

import specd.native as sn

CASES = [((8, 248320), 16), ((1, 248320), 16), ((1, 248320), 64), ((8, 248320), 1), ((8, 248320), 64)]


def bench(shape, k, calls=50, warmup=10):
    """Median microseconds per sn.topk call on a GPU F32 tensor of `shape` (standard normal)."""
    x = sn.Tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).to(sn.Device.GPU)
    for _ in range(warmup):
        sn.topk(x, k)
    sn.gpu_synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sn.topk(x, k)
        sn.gpu_synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    if not sn.gpu_available():
        raise SystemExit("no GPU backend/device in this build or machine")
    for shape, k in CASES:
        print(f"topk {list(shape)} k={k}: {bench(shape, k):.1f} us/call")


if __name__ == "__main__":
    main()
