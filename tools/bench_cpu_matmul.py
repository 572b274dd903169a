"""CPU matmul microbenchmark: y = x @ w.T for every weight dtype, w 4096 x 4096, n = 1, 4, 16, 64.

Prints the best-of-repeats time per call, the weight bytes read per second (each call reads the
weight once whatever n) and the arithmetic rate, next to two baselines measured in the same run: the
memory copy bandwidth (numpy copy of 512 MiB, bytes read + written) and numpy's own F32 matmul
(its BLAS) on the same shapes. No assertions: numbers for BENCHMARKS.md.
Usage: python tools/bench_cpu_matmul.py [--out 4096] [--in 4096] [--threads N] [--repeats 5]
"""
import argparse
import platform
import time

import numpy as np

import specd.native as sn

BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}


def random_blocks(rng, dtype, rows, cols):
    """Random valid K-quant / IQ4_XS rows: random bytes with finite fp16 scales (oracles.md §4.3)."""
    tb = BLOCK_BYTES[dtype]
    raw = rng.integers(0, 256, (rows, cols // 256, tb), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.0, (rows, cols // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    if dtype == "Q6_K":
        raw[..., -2:] = d
    else:
        raw[..., :2] = d
    if dtype in ("Q4_K", "Q5_K"):
        raw[..., 2:4] = (d.view(np.float16) * 7.5).view(np.uint8)
    return sn.Tensor(raw.reshape(rows, -1), getattr(sn.DType, dtype))


def make_weight(rng, dtype, rows, cols):
    if dtype in BLOCK_BYTES:
        return random_blocks(rng, dtype, rows, cols)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    return sn.quantize(w, getattr(sn.DType, dtype))


def time_call(f, repeats):
    f()  # warm-up (page faults, thread pool)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=int, default=4096)
    ap.add_argument("--in", dest="inp", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: library default)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sn.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"# specd CPU matmul, w [{args.out}, {args.inp}], threads={sn.num_threads()}, "
          f"{platform.processor() or platform.machine()}, best of {args.repeats}")
    src = np.ones(128 << 20, np.float32)
    dst = np.empty_like(src)
    copy_bw = 2 * src.nbytes / time_call(lambda: np.copyto(dst, src), args.repeats) / 1e9
    print(f"# copy bandwidth (numpy, read + write): {copy_bw:.1f} GB/s")
    w32 = (rng.standard_normal((args.out, args.inp)) * 0.02).astype(np.float32)
    for n in (1, 4, 16, 64):
        x = rng.standard_normal((n, args.inp)).astype(np.float32)
        t = time_call(lambda: x @ w32.T, args.repeats)
        print(f"# numpy F32 baseline n={n}: {t * 1e3:.3f} ms, {2.0 * n * args.inp * args.out / t / 1e9:.1f} GFLOP/s")
    print(f"{'dtype':7} {'n':>3} {'ms':>9} {'weight GB/s':>12} {'/ copy':>7} {'GFLOP/s':>9}")
    for dtype in ["F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS"]:
        w = make_weight(rng, dtype, args.out, args.inp)
        for n in (1, 4, 16, 64):
            x = rng.standard_normal((n, args.inp)).astype(np.float32)
            t = time_call(lambda: sn.matmul(x, w), args.repeats)
            flops = 2.0 * n * args.inp * args.out
            gbs = w.nbytes / t / 1e9
            print(f"{dtype:7} {n:3d} {t * 1e3:9.3f} {gbs:12.2f} {gbs / copy_bw:7.2f} {flops / t / 1e9:9.1f}")


if __name__ == "__main__":
    main()
