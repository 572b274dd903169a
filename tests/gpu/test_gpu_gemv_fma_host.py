"""The FP32-FMA GEMV (native/src/gpu/gemv_fma.cuh), run on the CPU by the host emulation (host_emu/gemv_fma_main.cpp).

It is the only GEMV of the HIP build, for every weight format, and CUDA's for F32 / F16 weights and BF16 off the
tensor cores. On CUDA the quantized formats take the tensor-core GEMV, so no GPU test runs this kernel on Q8_0,
Q4_K, Q5_K, Q6_K or IQ4_XS weights; here it runs on each, against gguf's dequantization in float64 (the
oracle of oracles.md §4: random valid blocks, tests/native/quant_blocks.py), with the bound the GPU tests hold the
GEMV to, |y - x @ w^T| <= 1e-5 (|x| @ |w|^T). Batch invariance, which lossless speculative decoding rests on, is
checked bit for bit: the first n rows of x give the same outputs through every instance (1, 2, 4, 8 and 16 rows
of x; 1, 2 and 4 output rows a block) as through the 16-row one. x rows with one nonzero input must give that
input times w's column with one rounding (any precision lost inside the kernel shows). The sizes make every thread
take several chunk steps, a ragged last step and a ragged last row block; the harness runs under AddressSanitizer,
so a read past x's rows or the last weight row fails.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "native"))
sys.path.insert(0, HERE)
from host_emu_build import build_emu  # noqa: E402
from quant_blocks import random_blocks  # noqa: E402

# FORMAT -> (the weight type, input width: 552 chunks of 32 weights (8 for Q8_0, 4 / 8 for the float types'
# vector chunks, 1 for the scalar ones): more than the 128 threads' chunk steps in flight (4 at one output row a
# block: 512 chunks), not a multiple of them)
FORMATS = {
    "Q4_K": ("Q4_K", 256 * 69), "Q5_K": ("Q5_K", 256 * 69), "Q6_K": ("Q6_K", 256 * 69),
    "IQ4_XS": ("IQ4_XS", 256 * 69), "Q8_0": ("Q8_0", 32 * 138),
    "F32": ("F32", 4 * 552), "F32x1": ("F32", 553), "F16": ("F16", 8 * 552), "F16x1": ("F16", 553),
    "BF16": ("BF16", 8 * 552), "BF16x1": ("BF16", 553),
}
OUT = 7  # a ragged last block at 2 and 4 rows a block


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """The harness under AddressSanitizer: a read past x's rows or the weights' last row fails the run."""
    return build_emu(tmp_path_factory, "gemv_fma_emu", ["gemv_fma.cuh", "pdl.cuh", "weight_formats.cuh"],
                     "gemv_fma_main.cpp", ("-fsanitize=address",))


def weight(rng, wtype, rows, cols):
    """(raw bytes [rows, row bytes], float64 [rows, cols] from gguf's dequantization)."""
    if wtype == "F32":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return w.view(np.uint8), w.astype(np.float64)
    if wtype in ("F16", "BF16", "Q8_0"):
        raw = np.ascontiguousarray(gq.quantize(rng.standard_normal((rows, cols)).astype(np.float32), getattr(GT, wtype)))
        raw = raw.view(np.uint8).reshape(rows, -1)
    else:
        raw = random_blocks(rng, wtype, rows, cols)
    return raw, gq.dequantize(raw, getattr(GT, wtype)).reshape(rows, cols).astype(np.float64)


def run(emu, fmt, raw, x, r):
    d, exe = emu
    tag = f"{fmt}-{x.shape[0]}-{r}"
    (d / f"w{tag}.bin").write_bytes(np.ascontiguousarray(raw).tobytes())
    (d / f"x{tag}.bin").write_bytes(np.ascontiguousarray(x, dtype=np.float32).tobytes())
    p = subprocess.run([str(exe), fmt, str(raw.shape[0]), str(x.shape[1]), str(raw.shape[1]), str(x.shape[0]), str(r),
                        str(d / f"w{tag}.bin"), str(d / f"x{tag}.bin"), str(d / f"y{tag}.bin")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return np.fromfile(d / f"y{tag}.bin", dtype=np.float32).reshape(x.shape[0], raw.shape[0])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemv_fma_emulated_against_gguf_and_batch_invariant(emu, fmt):
    rng = np.random.default_rng(sum(map(ord, fmt)))
    wtype, cols = FORMATS[fmt]
    raw, w = weight(rng, wtype, OUT, cols)
    x = rng.standard_normal((16, cols)).astype(np.float32)
    x[5] *= 1e-30  # rows of very different magnitudes share a launch
    x[9] *= 1e20
    y16 = run(emu, fmt, raw, x, 4)
    x64 = x.astype(np.float64)
    err, bound = np.abs(y16 - x64 @ w.T), 1e-5 * (np.abs(x64) @ np.abs(w).T)
    assert np.all(err <= bound), f"{fmt}: worst error / bound {float(np.max(err / bound))}"
    # Every (rows of x, output rows a block) instance: the first n rows of x through the 1-, 2-, 4-, 8- and 16-row
    # instances at 1, 2 and 4 output rows a block give those rows' bits of the 16-row, 4-row-block run.
    for n in (1, 2, 3, 5, 9):
        for r in (1, 2, 4):
            y = run(emu, fmt, raw, x[:n], r)
            assert np.array_equal(y.view(np.uint32), y16[:n].view(np.uint32)), (fmt, n, r)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemv_fma_emulated_one_hot_rows_are_exact(emu, fmt):
    """x rows with one nonzero input j (full 24-bit mantissas, at the first, a middle, a chunk's last and the last
    input): y[:, i] = w[:, j] * x[i, j], one rounding, which gguf's F32 values give bit for bit (Q8_0, whose
    scale multiplies the part's sum: within an ulp). Any loss of x's or w's precision inside the kernel shows."""
    rng = np.random.default_rng(7 + sum(map(ord, fmt)))
    wtype, cols = FORMATS[fmt]
    raw, w = weight(rng, wtype, OUT, cols)
    w32 = w.astype(np.float32)
    js = [0, 1, cols // 2, 31, 32, cols - 1]
    x = np.zeros((len(js), cols), np.float32)
    vals = (1.0 + rng.random(len(js)) * (1 - 2.0 ** -23)).astype(np.float32) * np.float32(1.7)
    for i, j in enumerate(js):
        x[i, j] = vals[i]
    y = run(emu, fmt, raw, x, 4)
    ref = np.stack([w32[:, j] * vals[i] for i, j in enumerate(js)])
    if wtype == "Q8_0":
        ulps = np.abs(y.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
        assert np.all((ulps <= 1) | (y == ref)), (fmt, int(ulps.max()))
    else:
        assert np.array_equal(y, ref), (fmt, float(np.max(np.abs(y - ref))))


def test_gemv_fma_emulated_refuses_what_matmul_does_not_launch(emu):
    d, exe = emu
    (d / "w1.bin").write_bytes(bytes(144))
    (d / "x1.bin").write_bytes(bytes(4 * 256))
    for args, says in [(["Q2_K", "1", "256", "144", "1", "1"], "unknown format"),
                       (["Q4_K", "1", "256", "144", "17", "1"], "out of range"),
                       (["Q4_K", "1", "256", "144", "1", "3"], "not launched"),
                       (["F32", "1", "37", "144", "1", "1"], "not launched")]:  # 4-float chunks of 37 inputs
        p = subprocess.run([str(exe), *args, str(d / "w1.bin"), str(d / "x1.bin"), str(d / "y1.bin")],
                           capture_output=True, text=True)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr)
