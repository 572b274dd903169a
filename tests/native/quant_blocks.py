"""Test weights in every format specd reads, with gguf.quants' dequantization as the reference.

K-quant and IQ4_XS data are random *valid* blocks (oracles.md §4.3): random bytes, then the fp16
scale fields overwritten with finite values (Q4_K/Q5_K: d and dmin at bytes 0-3; Q6_K: d in the
last two bytes of its 210-byte block; IQ4_XS and Q8_0: d in the first two bytes). F16, BF16 and
Q8_0 weights are encoded by gguf.quants.quantize, so specd's own encoder is not involved.
"""
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

import specd.native as sn

BLOCK_TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES

# Byte offsets of the fp16 scale fields inside one block.
SCALE_FIELDS = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}


def block_size(name):
    return sn.block_size(getattr(sn.DType, name))


def type_size(name):
    return sn.type_size(getattr(sn.DType, name))


def finite_fp16(rng, shape):
    """Random finite fp16 values over the whole range (normals, subnormals, zeros, both signs)."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/nan -> subnormal
    return bits.view(np.float16)


def random_blocks(rng, name, rows, cols, extreme=False):
    """uint8 [rows, cols / block * type_size] of random valid blocks of format `name`.

    Realistic scales (default) put the dequantized values at std ~0.01-0.1 with dmin ~7.5 d so
    blocks are roughly zero-mean; extreme=True draws every fp16 field from the whole finite range.
    """
    bs, ts = block_size(name), type_size(name)
    nb = cols // bs
    raw = rng.integers(0, 256, (rows, nb, ts), dtype=np.uint8)
    for k, off in enumerate(SCALE_FIELDS[name]):
        if extreme:
            d = finite_fp16(rng, (rows, nb, 1))
        else:
            base = {"Q8_0": 1e-3, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 2e-5, "IQ4_XS": 2e-5}[name]
            d = base * rng.lognormal(0.0, 0.5, (rows, nb, 1)) * (7.5 if k == 1 else 1.0)
            if name in ("Q8_0", "Q6_K", "IQ4_XS"):
                d *= rng.choice([-1.0, 1.0], (rows, nb, 1))  # signed scales are valid codes too
            d = d.astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8)
    return raw.reshape(rows, nb * ts)


def make_weight(rng, name, rows, cols, extreme=False):
    """(Tensor [rows, cols] of format `name`, float32 reference from gguf.quants.dequantize)."""
    qtype = getattr(GT, name)
    if name in BLOCK_TYPES and name != "Q8_0":
        raw = random_blocks(rng, name, rows, cols, extreme)
    elif name == "Q8_0" and extreme:
        raw = random_blocks(rng, name, rows, cols, extreme)
    else:
        w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1.0)).astype(np.float32)
        if name == "F32":
            return sn.Tensor(w), w
        raw = np.ascontiguousarray(gq.quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
    ref = gq.dequantize(raw, qtype).reshape(rows, cols)
    return sn.Tensor(raw, getattr(sn.DType, name)), ref


def in_sizes(name):
    """Input widths to test: odd values for float types, 1, 3 and 5 blocks for block formats."""
    if name in FLOAT_TYPES:
        return [1, 15, 17, 63, 257]
    return [block_size(name) * b for b in (1, 3, 5)]
