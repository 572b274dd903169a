"""The prefill's chunked Gated DeltaNet on the GPU at the 27B's shapes: GPU time per kernel of
``sn.gated_delta_net(..., exact=False)`` (issue 7, prefill), and its distance from the CPU backend.

Shapes of the 27B's GDN layers: 16 key heads and 48 value heads of 128 (q, k L2-normalised as gdn_qkv
makes them, g = log decay <= 0, beta in (0, 1)), T tokens per call (a prefill chunk: 2048 by default).
Kernel times: torch.profiler's CUPTI trace of 10 calls (tools/bench/gpu_decode.py's ``kernel_times``:
each kernel counted from the end of the kernels before it). ``--check`` compares one call's output and
new state with the CPU backend's token-by-token op (max |diff| / max |ref|; the chunked path's tolerance
is 1e-4 of max |ref|: ssm.cu).

Usage (GPU machine, specd built with SPECD_GPU=cuda): python tools/device/gdn_chunk_bench.py
[--tokens 2048] [--check] [--probe]. Prints a markdown table; --probe calls the op once per length (a
target for Nsight Compute: ncu -k regex:gdn_chunk).
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

HK, HV, DK, DV = 16, 48, 128, 128


def inputs(rng, t: int) -> list[np.ndarray]:
    """q, k [t, HK, DK] (unit rows), v [t, HV, DV], g, beta [t, HV], state [HV, DV, DK], F32."""
    def unit(*s):
        x = rng.standard_normal(s).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    v = rng.standard_normal((t, HV, DV)).astype(np.float32)
    g = -np.abs(rng.standard_normal((t, HV))).astype(np.float32) * 0.1
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((t, HV))))).astype(np.float32)
    state = (rng.standard_normal((HV, DV, DK)) / 10).astype(np.float32)
    return [unit(t, HK, DK), unit(t, HK, DK), v, g, beta, state]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--check", action="store_true", help="compare one call with the CPU backend")
    ap.add_argument("--probe", action="store_true", help="one call per length, no profiler")
    args = ap.parse_args(argv)
    if any(t < 64 for t in args.tokens):
        ap.error("--tokens: at least 64 (one chunk)")
    rng = np.random.default_rng(11)
    scale = DK ** -0.5
    print("| tokens | us per call (GPU) | kernels (us per call) | max err / max ref (output, state) |\n"
          "| --- | --- | --- | --- |")
    for t in args.tokens:
        host = inputs(rng, t)
        dev = [on_gpu(x) for x in host]
        run = lambda: sn.gated_delta_net(*dev[:5], dev[5], scale, exact=False)  # noqa: E731
        if args.probe:
            run()
            sn.gpu_synchronize()
            continue
        err = "-"
        if args.check:
            state_gpu = on_gpu(host[5])
            out = sn.gated_delta_net(*dev[:5], state_gpu, scale, exact=False).numpy()
            state_cpu = sn.Tensor(host[5].copy())
            ref = sn.gated_delta_net(*[sn.Tensor(x) for x in host[:5]], state_cpu, scale).numpy()
            rel = lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b)))  # noqa: E731
            err = f"{rel(out, ref):.2e}, {rel(state_gpu.numpy(), state_cpu.numpy()):.2e}"
        for _ in range(3):
            run()
        total, detail = kernel_times(lambda: [run() for _ in range(10)], sn.gpu_synchronize, 10)
        print(f"| {t} | {total:.1f} | {detail} | {err} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
