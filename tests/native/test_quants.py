"""Row codecs against gguf.quants (oracles.md §4, qwen35-target.md §10).

Tolerance: none. specd's dequantization performs gguf's float32 operations in gguf's order, so
every comparison here is bitwise (NaN payloads included where NaNs can occur).
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

import specd.native as sn
from quant_blocks import ALL_TYPES, BLOCK_TYPES, block_size, make_weight, random_blocks, type_size

ROW_SHAPES = [(1, 1), (3, 2), (5, 7), (16, 1)]  # (rows, blocks per row)


def assert_bits_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    ai, bi = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    bad = np.flatnonzero(ai.ravel() != bi.ravel())
    assert bad.size == 0, f"{bad.size} elements differ, first at {bad[0]}: {a.ravel()[bad[0]]!r} vs {b.ravel()[bad[0]]!r}"


# ---- dequantize ----


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("rows,blocks", ROW_SHAPES)
@pytest.mark.parametrize("extreme", [False, True], ids=["realistic", "extreme-scales"])
def test_dequantize_blocks_bit_exact(rng, name, rows, blocks, extreme):
    raw = random_blocks(rng, name, rows, blocks * block_size(name), extreme)
    ours = sn.dequantize(sn.Tensor(raw, getattr(sn.DType, name))).numpy()
    ref = gq.dequantize(raw, getattr(GT, name))
    assert ours.shape == (rows, blocks * block_size(name))
    assert_bits_equal(ours, ref)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_any_leading_shape(rng, name):
    cols = 2 * block_size(name) if name in BLOCK_TYPES else 37
    w, ref = make_weight(rng, name, 6, cols)
    raw = w.numpy()
    ours = sn.dequantize(sn.Tensor(raw.reshape(2, 3, -1), w.dtype)).numpy()
    assert ours.shape == (2, 3, cols)
    assert_bits_equal(ours.reshape(6, cols), ref)


def test_dequantize_f16_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    ours = sn.dequantize(bits.view(np.float16)).numpy()
    assert_bits_equal(ours, gq.dequantize(bits.view(np.uint8), GT.F16))


def test_dequantize_bf16_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    ours = sn.dequantize(sn.Tensor(bits, sn.DType.BF16)).numpy()
    assert_bits_equal(ours, gq.dequantize(bits.view(np.uint8), GT.BF16))


def test_dequantize_f32_is_identity(rng):
    x = rng.standard_normal((3, 11)).astype(np.float32)
    assert_bits_equal(sn.dequantize(x).numpy(), x)


def test_dequantize_layout_by_hand():
    """A Q6_K block written field by field (independent of gguf): element e = d * sc[e/16] * (q-32)."""
    q = np.arange(256) % 64  # 6-bit codes
    sc = np.arange(16, dtype=np.int8) - 5
    d = np.float16(0.25)
    ql = np.zeros(128, np.uint8)
    qh = np.zeros(64, np.uint8)
    for e in range(256):
        half, i = divmod(e, 128)
        g, l = divmod(i, 32)  # g: 0..3 (low nibble rows 0/1, high nibble rows 2/3)
        ql[64 * half + 32 * (g % 2) + l] |= (q[e] & 15) << (4 * (g // 2))
        qh[32 * half + l] |= (q[e] >> 4) << (2 * g)
    block = np.concatenate([ql, qh, sc.view(np.uint8), np.array([d]).view(np.uint8)])[None]
    want = (np.float32(d) * sc.astype(np.float32)[np.arange(256) // 16] * (q - 32)).astype(np.float32)
    assert_bits_equal(sn.dequantize(sn.Tensor(block, sn.DType.Q6_K)).numpy()[0], want)


# ---- quantize ----


def random_float_bits(rng, n):
    """float32 values from uniformly random bit patterns: every exponent, NaNs and infinities."""
    return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


F16_EDGES = np.array(
    [0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001,
     3 * 2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-14 - 2.0**-25, np.inf, -np.inf, np.nan, 1e-30, 1e30],
    np.float32,
)


def test_quantize_f16_bit_exact(rng):
    x = np.concatenate([random_float_bits(rng, 100000), F16_EDGES, -F16_EDGES,
                        (rng.standard_normal(10000) * 1e-5).astype(np.float32)])
    nan_payloads = np.array([0x7F800001, 0x7F802000, 0xFF812345, 0x7FBFE000], np.uint32).view(np.float32)
    x = np.concatenate([x, nan_payloads])
    ours = sn.quantize(x, sn.DType.F16).numpy()
    with np.errstate(over="ignore"):  # numpy warns on overflow to inf, which is the expected result
        ref = gq.quantize(x, GT.F16)
    assert_bits_equal(ours, ref)


def test_quantize_bf16_bit_exact(rng):
    x = np.concatenate([random_float_bits(rng, 100000), F16_EDGES, -F16_EDGES]).reshape(-1, 2)
    ours = sn.quantize(x, sn.DType.BF16).numpy()
    ref = gq.quantize(x, GT.BF16).view(np.uint16)
    assert_bits_equal(ours, ref)


@pytest.mark.parametrize("rows,blocks", ROW_SHAPES)
def test_quantize_q8_0_bit_exact(rng, rows, blocks):
    x = rng.standard_normal((rows, blocks, 32)).astype(np.float32)
    x *= np.exp(rng.uniform(-15, 8, (rows, blocks, 1))).astype(np.float32)  # per-block magnitudes, d < fp16 max
    x[0, 0] = 0.0  # an all-zero block: d = 0, q = 0
    if blocks > 1:  # a block of exact .5 ties: d = 127/127 = 1, round half away from zero
        x[0, 1] = np.arange(-16, 16) + 0.5
        x[0, 1, 0] = 127.0
    x = x.reshape(rows, blocks * 32)
    ours = sn.quantize(x, sn.DType.Q8_0).numpy()
    ref = gq.quantize(x, GT.Q8_0)
    assert_bits_equal(ours, ref)
    round_trip = sn.dequantize(sn.quantize(x, sn.DType.Q8_0)).numpy()
    assert_bits_equal(round_trip, gq.dequantize(ref, GT.Q8_0))


def test_quantize_f32_is_identity(rng):
    x = rng.standard_normal((4, 9)).astype(np.float32)
    assert_bits_equal(sn.quantize(x, sn.DType.F32).numpy(), x)


@pytest.mark.parametrize("name", ["F16", "BF16", "Q8_0"])
def test_quantize_round_trip_error(rng, name):
    """Sanity of the encoders' precision: error per element within half an ulp of the format."""
    x = rng.standard_normal((8, 256)).astype(np.float32)
    y = sn.dequantize(sn.quantize(x, getattr(sn.DType, name))).numpy().astype(np.float64)
    if name == "Q8_0":  # |err| <= d/2 per block, d = amax/127 (+ fp16 rounding of d)
        amax = np.abs(x.reshape(8, 8, 32)).max(-1, keepdims=True)
        bound = np.broadcast_to(amax / 127 * (0.5 + 2.0**-10), (8, 8, 32)).reshape(8, 256)
        assert np.all(np.abs(y - x) <= bound * 1.001 + amax.max() * 2.0**-11)
    else:
        # Half an ulp: 2^-11 relative for fp16 normals, 2^-25 absolute in fp16's subnormal range.
        half_ulp = 2.0**-11 if name == "F16" else 2.0**-8
        bound = np.maximum(np.abs(x) * half_ulp, 2.0**-25 if name == "F16" else 0.0)
        assert np.all(np.abs(y - x) <= bound)


# ---- bad input ----


def test_truncated_block_rows_rejected():
    raw = np.zeros((2, 143), np.uint8)
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks of 144 bytes"):
        sn.Tensor(raw, sn.DType.Q4_K)
    with pytest.raises(ValueError, match="not a whole number of Q6_K blocks of 210 bytes"):
        sn.Tensor(np.zeros(211, np.uint8), sn.DType.Q6_K)


def test_dequantize_bad_input():
    with pytest.raises(ValueError, match="dequantize: w must be a weight format .* got I32"):
        sn.dequantize(np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="dequantize: w has numpy dtype float64"):
        sn.dequantize(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="dequantize: w must be contiguous"):
        sn.dequantize(np.zeros((4, 6), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="dequantize: w must be a specd Tensor or a numpy array"):
        sn.dequantize([1.0, 2.0])


def test_quantize_bad_input():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="quantize: dtype must be F32, F16, BF16 or Q8_0, got Q4_K"):
        sn.quantize(np.zeros((2, 256), np.float32), sn.DType.Q4_K)
    with pytest.raises(ValueError, match="rows of x have 33 elements, not a multiple of the Q8_0 block size 32"):
        sn.quantize(np.zeros((2, 33), np.float32), sn.DType.Q8_0)
    with pytest.raises(ValueError, match="quantize: x must be F32, got F16"):
        sn.quantize(x.astype(np.float16), sn.DType.Q8_0)
    with pytest.raises(ValueError, match="quantize: x has numpy dtype float64"):
        sn.quantize(x.astype(np.float64), sn.DType.F16)
    with pytest.raises(ValueError, match="quantize: dtype must be .* got I32"):
        sn.quantize(x, sn.DType.I32)


def test_type_sizes_match_gguf():
    from gguf.constants import GGML_QUANT_SIZES

    for name in ALL_TYPES:
        assert (block_size(name), type_size(name)) == GGML_QUANT_SIZES[getattr(GT, name)]
