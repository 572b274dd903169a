#!/usr/bin/env python3
"""Random-weight drafter GGUFs in the published 27B drafter shapes, for GPU benchmarks (issue 7).

The partner of tools/bench/random_qwen35.py: a drafter of each family whose hidden size, vocabulary,
mask id and tap ids fit that file's random target (``--config 27b`` pairs with random_qwen35
``27b``, ``--config tiny`` with random_qwen35 ``tiny``). Shapes (docs/drafters.md):

* ``dflash``: z-lab/Qwen3.5-27B-DFlash (§2.2 / §2.3): hidden 5120, 5 full-attention non-causal
  layers of 32 q / 8 KV heads x 128, FFN 17408, block 16, taps [1, 16, 31, 46, 61], mask 248070,
  θ 1e7. 1.73 B parameters (no embedding / lm_head: the target's are reused).
* ``dspark``: RadixArk/Qwen3.8-27B-DSpark (§5.6): block 7, 40 q / 8 KV heads x 128, FFN 10240,
  taps [4, 16, 28, 40, 52], Markov rank 256, YaRN factor 32 over 8192; plus a confidence head with
  the Markov input ([1, H + r], §5.3 — RadixArk ships none; it adds 5,377 parameters, so the
  count stays 1.3593 B).
* ``dflash2``: z-lab/Qwen3.8-27B-DFlash2 (§6.1): block 8, grouped dynamic convs (group 16,
  kernel 2), selector rank 256 / top-k 16, taps [5, 19, 33, 47, 61], 5 sliding (W 2048)
  non-causal layers. 1.924 B parameters.

How: the HF ``config.json`` of each family goes through the converter's reader
(:func:`specd.draft_worker.hf_config.read_hf_drafter`, against a shape-only tensor table in the HF
layout), which yields the :class:`DrafterHParams`; the converter's metadata writer and the
contract's :func:`expected_tensors` give every key, tensor name and ``ne``; the data are streamed by
the target converter's atomic writer (:func:`specd.target_worker.convert.write_gguf`), one tensor
in memory at a time. Storage as ``specd convert-drafter``: norms, conv base kernels and the
confidence head F32; every 2-D matrix BF16 (``--type bf16``) or Q8_0 (``--type q8_0``; F16 where
ne0 % 32 != 0). Values: norm gains 1, matrices N(0, 1/ne0) (unit-variance outputs for
unit-variance inputs, so activations stay O(1) through the 5 layers, cf. the N(0, 0.05) of the
64-wide tests/drafter/tinydrafters.py), conv base kernels N(0, 0.25), the confidence weight
N(0, 1/d), its bias 0. Matrix bytes are tiled from a per-(type, ne0) 16 MiB pool from a random block
boundary (random_qwen35's trick), so a 3.9 GB drafter takes seconds.

Usage: python tools/bench/random_drafter.py OUT.gguf --family dflash|dspark|dflash2
           [--config 27b|tiny] [--type bf16|q8_0] [--seed 0] [--target TARGET.gguf]
(the written file is loaded back with the drafter loader and pair-checked against ``--target``, or
against random_qwen35's hyperparameters of the same config when no target file is given).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import random_qwen35  # noqa: E402

from specd.draft_worker.contract import MATRIX, NORM, expected_tensors, q8_0_eligible, tensor_sort_key  # noqa: E402
from specd.draft_worker.contract import ARCH  # noqa: E402
from specd.draft_worker.convert import write_drafter_metadata  # noqa: E402
from specd.draft_worker.hf_config import HFDrafter, read_hf_drafter  # noqa: E402
from specd.draft_worker.safetensors_io import StTensor  # noqa: E402

FAMILIES = ("dflash", "dspark", "dflash2")
TYPES = ("bf16", "q8_0")
POOL_BYTES = random_qwen35.POOL_BYTES

_ROPE = {"rope_type": "default", "rope_theta": 10000000.0}
_YARN = {"rope_type": "yarn", "rope_theta": 10000000.0, "factor": 32.0, "original_max_position_embeddings": 8192,
         "beta_fast": 32.0, "beta_slow": 1.0}

CONFIGS: dict[str, dict[str, dict]] = {
    # published configs (drafters.md §2.2, §5.6, §6.1), as in tests/drafter/test_published_configs.py
    "27b": {
        "dflash": {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_hidden_layers": 5,
            "hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "num_target_layers": 64, "vocab_size": 248320, "rms_norm_eps": 1e-6,
            "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
            "rope_parameters": dict(_ROPE)},
        "dspark": {
            "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "block_size": 7, "num_hidden_layers": 5,
            "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 10240, "num_target_layers": 64, "vocab_size": 248320, "rms_norm_eps": 1e-6,
            "dflash_config": {"target_layer_ids": [4, 16, 28, 40, 52], "markov_rank": 256, "projector_type": "dspark",
                              "mask_token_id": 248070, "enable_confidence_head": True,
                              "confidence_head_with_markov": True},
            "rope_parameters": dict(_YARN)},
        "dflash2": {
            "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
            "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 248070,
                              "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61]},
            "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5,
            "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "use_sliding_window": True,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_target_layers": 64,
            "vocab_size": 248320, "rope_parameters": dict(_ROPE), "rms_norm_eps": 1e-6},
    },
}


def _tiny(cfg: dict, family: str) -> dict:
    """The 27B config of ``family`` shrunk to random_qwen35 ``tiny`` (hidden 256, vocab 1024, 8 target
    layers): 2 layers of 4 q / 2 KV heads x 64, FFN 512, taps inside 8 layers, mask 1000, DSpark
    rank 32, DFlash 2 selector 16 / top-k 4 and window 64; block sizes and flags as published."""
    t = random_qwen35.CONFIGS["tiny"]
    c = copy.deepcopy(cfg)
    c.update(hidden_size=t["hidden_size"], intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_target_layers=t["num_hidden_layers"], vocab_size=t["vocab_size"])
    dc = c["dflash_config"]
    dc.update(mask_token_id=1000, target_layer_ids={"dflash": [1, 3, 5], "dspark": [0, 2, 4, 6],
                                                    "dflash2": [1, 4, 7]}[family])
    if family == "dspark":
        dc["markov_rank"] = 32
    if family == "dflash2":
        dc.update(selector_rank=16, selector_top_k=4)
        c.update(layer_types=["sliding_attention"] * 2, sliding_window=64)
    return c


CONFIGS["tiny"] = {f: _tiny(CONFIGS["27b"][f], f) for f in FAMILIES}

PUBLISHED_PARAMS = {"dflash": 1.73e9, "dspark": 1.3593e9, "dflash2": 1.924e9}
"""Parameter counts stated in drafters.md (§2.3, §5.6, §6.4), embedding / lm_head excluded."""


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> torch-order shapes of the drafter ``cfg`` describes (the published layouts,
    drafters.md §2.3 / §5.4 / §6.4: SpecForge DSpark packaging, codebooks without ``.weight``)."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dc, V, arch = cfg["dflash_config"], cfg["vocab_size"], cfg["architectures"][0]
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(dc["target_layer_ids"]) * H), "hidden_norm.weight": (H,),
                                       "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                    p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I)})
        if arch == "DFlash2DraftModel":
            K, G = dc["conv_kernel_size"], H // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, K, H)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * K * G, H)
    if arch == "DFlash2DraftModel":
        R = dc["selector_rank"]
        out.update({"candidate_selector.predecessor_codebook": (V, R), "candidate_selector.successor_codebook": (V, R),
                    "candidate_selector.hidden_projection.weight": (R, H)})
    if arch == "DSparkDraftModel":
        r = dc["markov_rank"]
        out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
        if dc.get("enable_confidence_head"):
            d = H + (r if dc.get("confidence_head_with_markov") else 0)
            out.update({"confidence_head.proj.weight": (1, d), "confidence_head.proj.bias": (1,)})
    return out


def drafter_description(family: str, config: str = "27b") -> HFDrafter:
    """The converter's reading (hyperparameters, GGUF <- HF name map, config) of the ``family`` drafter
    of ``config``. No weights are read or written. Raises KeyError for an unknown family / config,
    DrafterFormatError if the config breaks the contract."""
    cfg = CONFIGS[config][family]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(cfg))
        table = {n: StTensor(n, "BF16", s, path, 0, 2 * math.prod(s)) for n, s in hf_shapes(cfg).items()}
        return read_hf_drafter(path, table)


def param_count(family: str, config: str = "27b") -> int:
    """Parameters of the drafter GGUF (every tensor of the contract; no embedding / lm_head)."""
    return sum(math.prod(s.ne) for s in expected_tensors(drafter_description(family, config).hparams).values())


def storage_type(spec, outtype: str) -> QT:
    """ggml type of a contract tensor under ``outtype`` (the converter's rule: non-MATRIX F32; Q8_0 only
    where ne0 % 32 == 0, else F16)."""
    if spec.kind != MATRIX:
        return QT.F32
    if outtype == "bf16":
        return QT.BF16
    return QT.Q8_0 if q8_0_eligible(spec) else QT.F16


def _pool(qtype: QT, std: float, nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """min(POOL_BYTES, nbytes) rounded up to whole 1024-value rows of N(0, std²) values stored as
    ``qtype`` (uint8 bytes; every Q8_0 block has its own finite scale)."""
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = max(1, -(-min(POOL_BYTES, nbytes) // (1024 // blk * size)))
    vals = (rng.standard_normal((rows, 1024), dtype=np.float32) * np.float32(std))
    if qtype == QT.F16:
        return vals.astype(np.float16).view(np.uint8).reshape(-1)
    return gguf.quants.quantize(vals, qtype).view(np.uint8).reshape(-1)


def _tile(pool: np.ndarray, nbytes: int, block_bytes: int, rng: np.random.Generator) -> np.ndarray:
    """``nbytes`` of ``pool`` bytes from a random block boundary, tiled when longer than the pool."""
    start = int(rng.integers(0, len(pool) // block_bytes)) * block_bytes
    if start + nbytes <= len(pool):
        return pool[start:start + nbytes]
    reps = -(-(start + nbytes) // len(pool))
    return np.tile(pool, reps)[start:start + nbytes]


def _f32_values(name: str, kind: str, ne: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    shape = tuple(reversed(ne))
    if kind == NORM:
        return np.ones(shape, np.float32)
    if name.endswith("conv.base"):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.25))
    if name.endswith("confidence.bias"):
        return np.zeros(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(ne[0]))


def write(out: str | os.PathLike, family: str, config: str = "27b", outtype: str = "bf16", seed: int = 0) -> dict:
    """Write the random ``family`` drafter of ``config`` to ``out`` (atomically; nothing left on error).

    outtype: "bf16" or "q8_0" (2-D matrices; the rest F32). Returns {"bytes", "seconds", "params",
    "types": {ggml type: tensor count}, "hparams": summary line}. Raises ValueError for an unknown
    family / config / type.
    """
    if family not in FAMILIES or config not in CONFIGS or outtype not in TYPES:
        raise ValueError(f"family must be one of {FAMILIES}, config one of {sorted(CONFIGS)}, type one of {TYPES}; "
                         f"got {family!r}, {config!r}, {outtype!r}")
    t0 = time.time()
    rng = np.random.default_rng(seed)
    d = drafter_description(family, config)
    hp = d.hparams
    specs = sorted(expected_tensors(hp).values(), key=lambda s: tensor_sort_key(s.name))
    plan = []
    need: dict[tuple[QT, int], int] = {}
    for s in specs:
        qt = storage_type(s, outtype)
        nb = random_qwen35.nbytes_of(s.ne, qt)
        plan.append((s, qt, nb))
        if qt != QT.F32:
            need[(qt, s.ne[0])] = max(need.get((qt, s.ne[0]), 0), nb)
    pools = {k: _pool(k[0], 1.0 / math.sqrt(k[1]), nb, rng) for k, nb in sorted(need.items())}

    def metadata(w: gguf.GGUFWriter) -> None:
        write_drafter_metadata(w, hp, f"random-{config}-{family}-{outtype}", outtype, d.config)

    def data(i: int) -> np.ndarray:
        s, qt, nb = plan[i]
        if qt == QT.F32:
            return _f32_values(s.name, s.kind, s.ne, rng)
        return _tile(pools[(qt, s.ne[0])], nb, gguf.GGML_QUANT_SIZES[qt][1], rng)

    from specd.target_worker.convert import write_gguf

    write_gguf(Path(out), metadata, [(s.name, tuple(reversed(s.ne)), qt, nb) for s, qt, nb in plan], data, arch=ARCH)
    types: dict[str, int] = {}
    for _, qt, _ in plan:
        types[qt.name] = types.get(qt.name, 0) + 1
    return {"bytes": os.path.getsize(out), "seconds": round(time.time() - t0, 1),
            "params": sum(math.prod(s.ne) for s in specs), "types": types, "hparams": hp.summary()}


def target_hparams(config: str):
    """random_qwen35's target hyperparameters of ``config`` (n_embd, n_vocab, n_layer, ...)."""
    from specd.target_worker.convert import hparams_from_config

    c = random_qwen35.CONFIGS[config]
    return hparams_from_config(c, c["vocab_size"], 0, f"random {config}")


def validate(path: str | os.PathLike, config: str = "27b", target: str | os.PathLike | None = None):
    """Load ``path`` with the drafter loader and pair-check it against the target GGUF ``target``
    (its hyperparameters only), or against random_qwen35's ``config`` target when ``target`` is None.
    Returns the LoadedDrafter; raises DrafterFormatError / DrafterPairError."""
    from specd.draft_worker.gguf_loader import check_pair, load_drafter

    drafter = load_drafter(path)
    if target is not None:
        from specd.target_worker.gguf_loader import load_qwen35

        check_pair(drafter.hparams, path, load_qwen35(target).hparams, target)
    else:
        check_pair(drafter.hparams, path, target_hparams(config), f"random_qwen35 --config {config}")
    return drafter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output drafter GGUF")
    ap.add_argument("--family", choices=FAMILIES, required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="27b",
                    help="27b (published shapes, pairs with random_qwen35 27b) or tiny (tests)")
    ap.add_argument("--type", dest="outtype", choices=TYPES, default="bf16", help="storage of 2-D matrices")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=Path, default=None,
                    help="target GGUF to pair-check against (default: random_qwen35's hyperparameters of --config)")
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    if args.target is not None and not args.target.is_file():
        ap.error(f"--target {args.target}: no such file")
    info = write(args.out, args.family, args.config, args.outtype, args.seed)
    validate(args.out, args.config, args.target)
    print(f"wrote {args.out}: {info['params'] / 1e9:.4f} B params, {info['bytes'] / 1e9:.2f} GB in "
          f"{info['seconds']} s, types {info['types']}; loads and pairs with "
          f"{args.target or 'random_qwen35 ' + args.config}\n  {info['hparams']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
