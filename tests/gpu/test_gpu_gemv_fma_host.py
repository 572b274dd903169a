"""The FP32-FMA GEMV (native/src/gpu/gemv_fma.cuh), run on the CPU by the host emulation (host_emu/gemv_fma_main.cpp).

It is the only GEMV of the HIP build, for every weight format, and CUDA's for F32 / F16 weights and BF16 off the
tensor cores. On CUDA the quantized formats take the tensor-core GEMV, so no GPU test runs this kernel on Q8_0,
Q4_K, Q5_K, Q6_K or IQ4_XS weights; here it runs on each, against gguf's dequantization in float64 (the
oracle of oracles.md §4: random valid blocks, tests/native/quant_blocks.py), with the bound the GPU tests hold the
GEMV to, |y - x @ w^T| <= 1e-5 (|x| @ |w|^T). Batch invariance, which lossless speculative decoding rests on, is
checked bit for bit: a row of x gives the same output alone (the 1-row instance) as among 3 or 16 rows (the 4- and
16-row instances), and with 1, 2 or 4 output rows a block. The sizes make every thread take several chunk steps,
a ragged last step and a ragged last row block.
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

# FORMAT -> (the weight type, input width: 1064 chunks of 32 weights (8 for Q8_0, 4 / 8 for the float types'
# vector chunks, 1 for the scalar ones), more than the 128 threads' 4 steps in flight, not a multiple of them)
FORMATS = {
    "Q4_K": ("Q4_K", 256 * 133), "Q5_K": ("Q5_K", 256 * 133), "Q6_K": ("Q6_K", 256 * 133),
    "IQ4_XS": ("IQ4_XS", 256 * 133), "Q8_0": ("Q8_0", 32 * 301),
    "F32": ("F32", 4 * 1064), "F32x1": ("F32", 4257), "F16": ("F16", 8 * 1064), "F16x1": ("F16", 1063),
    "BF16": ("BF16", 8 * 1064), "BF16x1": ("BF16", 1063),
}
OUT = 7  # a ragged last block at 2 and 4 rows a block


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "gemv_fma_emu", ["gemv_fma.cuh", "pdl.cuh", "weight_formats.cuh"],
                     "gemv_fma_main.cpp")


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
    p = subprocess.run([str(exe), fmt, str(raw.shape[0]), str(x.shape[1]), str(x.shape[0]), str(r),
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
    # The same rows through the 1- and 4-row instances, and with 1 or 2 output rows a block: bit for bit.
    for i in (0, 9, 15):
        assert np.array_equal(run(emu, fmt, raw, x[i : i + 1], 4)[0].view(np.uint32), y16[i].view(np.uint32)), (fmt, i)
    for r in (1, 2):
        y3 = run(emu, fmt, raw, x[4:7], r)
        assert np.array_equal(y3.view(np.uint32), y16[4:7].view(np.uint32)), (fmt, r)


def test_gemv_fma_emulated_refuses_what_matmul_does_not_launch(emu):
    d, exe = emu
    (d / "w1.bin").write_bytes(bytes(144))
    (d / "x1.bin").write_bytes(bytes(4 * 256))
    for args, says in [(["Q2_K", "1", "256", "1", "1"], "unknown format"), (["Q4_K", "1", "256", "17", "1"], "out of range"),
                       (["Q4_K", "1", "256", "1", "3"], "not served")]:
        p = subprocess.run([str(exe), *args, str(d / "w1.bin"), str(d / "x1.bin"), str(d / "y1.bin")],
                           capture_output=True, text=True)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr)
