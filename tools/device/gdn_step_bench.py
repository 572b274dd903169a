"""The Gated DeltaNet step of the 27B on the GPU: ``sn.gdn_step`` against the composition it replaces
(gdn_qkv, gdn_gates, gated_delta_net), GPU time per kernel (issue 7, decode). Which kernels gdn_step runs
shows in the table. (The output's gated norm runs in the out projection's x split: rms_norm_gated_matmul.)

Shapes of the 27B's GDN layers: 16 key heads and 48 value heads of 128, conv output [w, 10240], widths w =
1 (decode) and the verify widths. Kernel times: torch.profiler's CUPTI trace of 20 calls (tools/bench/
gpu_decode.py's ``kernel_profile``: each kernel counted from the end of the kernels before it, so a host-bound
loop's idle gaps are not counted); the state is updated in place, as a decode step does.

Usage (GPU machine, specd built with SPECD_GPU=cuda): python tools/device/gdn_step_bench.py [--widths 1 4 8 16]
[--probe]. Prints a markdown table; --probe calls gdn_step once per width (a target for Nsight Compute:
ncu -k regex:gdn_step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import specd.native as sn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_decode import kernel_times  # noqa: E402
from gpu_report import on_gpu  # noqa: E402

HK, HV, DK, DV, EPS = 16, 48, 128, 128, 1e-6


def inputs(rng, w: int):
    """(cv, a, b, dt, ssm_a) on the GPU and a state, for w tokens."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    args = [f(w, 2 * HK * DK + HV * DV), f(w, HV), f(w, HV), f(1, HV), -np.abs(f(1, HV))]
    return [on_gpu(x) for x in args], on_gpu(f(HV, DV, DK) / 10)


def composed(cv, a, b, dt, ssm_a, state):
    q, k, v = sn.gdn_qkv(cv, HK, DK, HV, DV, EPS)
    g, beta = sn.gdn_gates(a, b, dt, ssm_a)
    return sn.gated_delta_net(q, k, v, g, beta, state, DK ** -0.5)


def fused(cv, a, b, dt, ssm_a, state):
    return sn.gdn_step(cv, a, b, dt, ssm_a, state, HK, DK, HV, DV, EPS, DK ** -0.5)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--probe", action="store_true", help="call gdn_step once per width, no profiler")
    args = ap.parse_args(argv)
    if any(w < 1 for w in args.widths):
        ap.error("--widths: each at least 1")
    rng = np.random.default_rng(7)
    print("| w | op | us per call (GPU) | kernels (us per call) |\n| --- | --- | --- | --- |")
    for w in args.widths:
        x, state = inputs(rng, w)
        if args.probe:
            fused(*x, state)
            sn.gpu_synchronize()
            continue
        for name, op in (("composition", composed), ("gdn_step", fused)):
            for _ in range(5):
                op(*x, state)
            total, detail = kernel_times(lambda: [op(*x, state) for _ in range(20)], sn.gpu_synchronize, 20, 2)
            print(f"| {w} | {name} | {total:.2f} | {detail} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
