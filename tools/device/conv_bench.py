"""The Gated DeltaNet's causal conv on the GPU (``sn.conv1d_causal``), GPU time per call against the bytes
it must move at the device's copy bandwidth (issue 7, prefill and decode).

Shape of the 27B's GDN layers: C = 10240 channels (2 Hk dk + Hv dv), K = 4 taps, T tokens (1 = decode,
2048 = a prefill chunk). K = 4 runs ``conv1d_taps_kernel<4>`` (weights in registers, a register window of
inputs); K = 5 runs the generic ``conv1d_kernel``, the same run's reference (5 taps, so a little more
arithmetic, the same bytes). Bytes = x + y + weights + state read and written (F32). Kernel times:
torch.profiler's CUPTI trace of 20 calls (tools/bench/gpu_decode.py's ``kernel_profile``); the state is
updated in place, as the model does.

Usage (GPU machine, specd built with SPECD_GPU=cuda): python tools/device/conv_bench.py [--tokens 1 2048]
[--taps 4 5]. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import specd.native as sn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_decode import copy_bandwidth, kernel_profile  # noqa: E402
from gpu_report import on_gpu  # noqa: E402

C = 10240


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 2048])
    ap.add_argument("--taps", type=int, nargs="+", default=[4, 5])
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.tokens) or any(k < 1 for k in args.taps):
        ap.error("--tokens and --taps: each at least 1")
    copy = copy_bandwidth()
    print(f"copy bandwidth: {copy and f'{copy:.0f} GB/s'}")
    print("| T | K | us per call (GPU) | GB/s | of copy | kernels |\n| --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(7)
    for t in args.tokens:
        for k in args.taps:
            f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
            x, w, state = on_gpu(f(t, C)), on_gpu(f(k, C)), on_gpu(f(k - 1, C))
            run = lambda: sn.conv1d_causal(x, w, state, True, state)  # noqa: E731
            for _ in range(5):
                run()
            ks = kernel_profile(lambda: [run() for _ in range(20)], sn.gpu_synchronize, 20)
            us = sum(r["us_per_step"] for r in ks)
            nbytes = 4 * C * (2 * t + k + 2 * (k - 1))
            gbps = nbytes / us / 1e3
            detail = "; ".join(f"{r['kernel'].split('(')[0]} {r['us_per_step']:.2f}" for r in ks)
            ratio = f"{gbps / copy:.2f}" if copy else "-"
            print(f"| {t} | {k} | {us:.2f} | {gbps:.0f} | {ratio} | {detail} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
