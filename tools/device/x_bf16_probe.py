"""The prefill GEMM's input conversion on the GPU (native/src/gpu/matmul_blas.cu, x_bf16_kernel) at the 27B's
FFN shapes: one sn.swiglu_matmul (SwigluX: gate and up [T, 17408] F32 -> swiglu in BF16) and one sn.matmul
(PlainX: x [T, 5120]) with exact=False, each against a small weight so the conversion dominates. A target for
Nsight Compute (issue 7, prefill):

    OUT=<dir> NAME=xbf16 KERNELS=regex:x_bf16 LAUNCHES=2 bash tools/device/ncu_probe.sh \\
        python3 tools/device/x_bf16_probe.py [--tokens 2048]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import specd.native as sn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import on_gpu  # noqa: E402

FF, D = 17408, 5120


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(3)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    gate, up, x = on_gpu(f32(args.tokens, FF)), on_gpu(f32(args.tokens, FF)), on_gpu(f32(args.tokens, D))
    sn.swiglu_matmul(gate, up, [on_gpu(f32(16, FF))], exact=False)
    sn.matmul(x, on_gpu(f32(16, D)), exact=False)
    sn.gpu_synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
