#!/usr/bin/env python3
"""Random-weight qwen35 GGUFs with the Qwen3.8-27B shapes, for GPU benchmarks (issue 7).

Real 27B checkpoints cannot be downloaded here; decode speed depends on shapes and storage types,
not on the values, so the benchmark runs on a file with the 27B hyperparameters
(qwen35-target.md §2 of the shared specs: hidden 5120, 64 layers of which 16 gated full attention (24 q / 4 KV heads
of 256), 48 Gated DeltaNet (16 k / 48 v heads of 128), FFN 17408, vocab 248320, untied head) and
random weights in the storage types of a quantization mix:

* ``iq4xs``: the seed's mix: IQ4_XS body, Q5_K ``output``, Q6_K ``attn_v`` and ``ssm_out``;
* ``q4km``: llama.cpp Q4_K_M-like: Q4_K body, Q6_K ``output``, ``attn_v``, and ``ffn_down`` of
  every other layer;
* ``q8_0``, ``f16``: everything in one type.

A placeholder byte-level BPE vocabulary makes the file loadable by llama.cpp too (the baseline,
tools/device/llamacpp_baseline.sh). 1-D tensors, ``ssm_conv1d``, ``ssm_a`` and ``ssm_dt`` are F32 (what the loader requires); norms are
1, ``ssm_a`` in [-1, -0.1] (= -exp(A_log)), ``ssm_dt`` 0. Block-format tensors are random bytes
whose F16 scale fields are set to small finite values (so every decoded weight is finite); the bytes
are tiled from a 16 MiB pool, which makes a 15 GB file as fast to write as the disk allows.

Usage: python tools/bench/random_qwen35.py OUT.gguf [--mix iq4xs] [--config 27b|tiny] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from specd.target_worker.convert import _expected_ne, hparams_from_config, write_gguf, write_metadata

CONFIGS = {
    "27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10]}),
    # a small config with the same structure, for tests on the CPU
    "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                 linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                 max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                  "mrope_section": [3, 3, 2]}),
}
MIXES = ("iq4xs", "q4km", "q8_0", "f16")
FILE_TYPE = {"iq4xs": QT.IQ4_XS, "q4km": QT.Q4_K, "q8_0": QT.Q8_0, "f16": QT.F16}  # body type
GENERAL_FILE_TYPE = {"iq4xs": gguf.LlamaFileType.MOSTLY_IQ4_XS, "q4km": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16}
# F16 scale fields (byte offsets inside one block) of each block format (ggml-common.h layouts)
SCALE_OFFSETS = {QT.Q8_0: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.IQ4_XS: (0,)}
POOL_BYTES = 16 << 20


def storage_type(name: str, ne: tuple[int, ...], mix: str, layer: int | None) -> QT:
    """Storage type of tensor ``name`` under ``mix``."""
    if len(ne) == 1 or name.endswith((".ssm_a", ".ssm_dt.bias", ".ssm_conv1d.weight")):
        return QT.F32
    if mix in ("q8_0", "f16"):
        return FILE_TYPE[mix]
    body = FILE_TYPE[mix]
    if name == "output.weight":
        return QT.Q5_K if mix == "iq4xs" else QT.Q6_K
    if "attn_v" in name or (mix == "iq4xs" and "ssm_out" in name):
        return QT.Q6_K
    if mix == "q4km" and "ffn_down" in name and layer is not None and layer % 2 == 0:
        return QT.Q6_K
    return body


def block_pool(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """POOL_BYTES (rounded to whole blocks) of random blocks of ``qtype`` with finite F16 scales."""
    if qtype == QT.F16:
        return (rng.standard_normal(POOL_BYTES // 2).astype(np.float16) * 0.02).view(np.uint8)
    bs = gguf.GGML_QUANT_SIZES[qtype][1]
    pool = rng.integers(0, 256, (POOL_BYTES // bs, bs), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scale = (rng.uniform(0.5, 1.0, len(pool)) * 2.0 ** -10).astype(np.float16)
        pool[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return pool.reshape(-1)


def tensor_bytes(pool: np.ndarray, nbytes: int, block_bytes: int, rng: np.random.Generator) -> np.ndarray:
    """``nbytes`` tiled from ``pool`` (a whole number of ``block_bytes`` blocks) from a random block
    boundary (so tensors differ and every block keeps its finite scales)."""
    if nbytes <= len(pool) // 2:
        return pool[:nbytes].copy()
    reps = -(-nbytes // len(pool)) + 1
    start = int(rng.integers(0, len(pool) // block_bytes)) * block_bytes
    return np.tile(pool, reps)[start:start + nbytes]


def f32_values(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.1, 1.0, n).astype(np.float32)
    if "ssm_dt" in name:
        return np.zeros(n, np.float32)
    if "norm" in name:
        return np.ones(n, np.float32)
    return (rng.standard_normal(n) * 0.1).astype(np.float32)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map (the byte-level BPE alphabet), 256 distinct characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def add_placeholder_tokenizer(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A valid byte-level BPE vocabulary of ``n_vocab`` tokens (llama.cpp refuses a GGUF without
    one): the 256 byte tokens, two-byte merges after them, the rest control tokens; eos = the last.
    The benchmark feeds token ids, so the vocabulary only has to load."""
    alpha = byte_alphabet()
    n_merge = max(0, min(n_vocab - 257, 256 * 256))
    pairs = [(alpha[i // 256], alpha[i % 256]) for i in range(n_merge)]
    tokens = alpha + [a + b for a, b in pairs]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += [f"<|ctl_{i}|>" for i in range(n_vocab - len(tokens))]
    types += [gguf.TokenType.CONTROL] * (n_vocab - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in pairs])
    w.add_eos_token_id(n_vocab - 1)


def nbytes_of(ne: tuple[int, ...], qtype: QT) -> int:
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    if ne[0] % blk:
        raise ValueError(f"ne0 {ne[0]} is not a multiple of the {qtype.name} block ({blk})")
    return rows * ne[0] // blk * size


def write(out: str | os.PathLike, config: str = "27b", mix: str = "iq4xs", seed: int = 0) -> dict:
    """Write the random GGUF; returns {"bytes", "seconds", "types": {type: count}}."""
    t0 = time.time()
    rng = np.random.default_rng(seed)
    hp = hparams_from_config(CONFIGS[config], CONFIGS[config]["vocab_size"], 0, f"random {config}")
    ne = _expected_ne(hp)
    plan = []
    for name, shape in ne.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        qt = storage_type(name, shape, mix, layer)
        plan.append((name, shape, qt, nbytes_of(shape, qt)))
    pools = {qt: block_pool(qt, rng) for qt in {p[2] for p in plan} if qt != QT.F32}

    def metadata(w):
        write_metadata(w, hp, f"random-{config}-{mix}", GENERAL_FILE_TYPE[mix])
        add_placeholder_tokenizer(w, hp.n_vocab)

    def data(i):
        name, _, qt, nb = plan[i]
        if qt == QT.F32:
            return f32_values(name, nb // 4, rng)
        return tensor_bytes(pools[qt], nb, gguf.GGML_QUANT_SIZES[qt][1], rng)

    write_gguf(Path(out), metadata, [(n, tuple(reversed(sh)), qt, nb) for n, sh, qt, nb in plan], data)
    types: dict[str, int] = {}
    for _, _, qt, _ in plan:
        types[qt.name] = types.get(qt.name, 0) + 1
    return {"bytes": os.path.getsize(out), "seconds": round(time.time() - t0, 1), "types": types}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="27b")
    ap.add_argument("--mix", choices=MIXES, default="iq4xs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    info = write(args.out, args.config, args.mix, args.seed)
    print(f"wrote {args.out}: {info['bytes'] / 1e9:.2f} GB in {info['seconds']} s, types {info['types']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
