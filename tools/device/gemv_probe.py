#!/usr/bin/env python3
"""A few GEMV calls for a profiler to look at (tools/device/gemv_ncu.sh): per format, a random
[17408, 5120] weight (the 27B's FFN up/gate shape) times x of 1 and 8 rows, ``--calls`` calls each,
synchronised at the end. Random bytes as weights (gpu_report.random_weight): timing only."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_report  # noqa: E402
import specd.native as sn  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", nargs="+", default=["IQ4_XS", "Q8_0"], choices=gpu_report.MMA_GEMV_FORMATS)
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    for name in args.formats:
        w = gpu_report.random_weight(rng, name, 17408, 5120, pool)
        for n in args.widths:
            x = gpu_report.on_gpu(rng.standard_normal((n, 5120)).astype(np.float32))
            for _ in range(args.calls):
                sn.matmul(x, w)
    sn.gpu_synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
