"""Tiny random drafter checkpoints in the published HF layouts (DFlash, DSpark, DFlash 2).

Tensor names and shapes come from the reference model classes of PyPI ``dflash==0.1.0``
(``DFlashDraftModel`` / ``DFlash2DraftModel``, instantiated on CPU from the tiny config) when that
package is importable, and from the documented tensor lists of docs/drafters.md §2.3 / §5.4 / §6.4
otherwise; ``documented_names`` is the latter and a test checks both agree. DSpark has no torch
reference on PyPI, so its list is always the documented one (SpecForge packaging: heads inline in
model.safetensors, no embedding / lm_head; DeepSpec packaging adds the target copies).

Values are drawn from a numpy generator (stable across library versions): 2-D weights N(0, 0.05),
norm gains 1 + N(0, 0.1) (perturbed so a dropped or added +1 shows), conv base kernels N(0, 0.5),
biases N(0, 0.1). Published codebooks are raw parameters, written without ``.weight``.
Checkpoints are written as BF16 (the published dtype) or F32 safetensors by a small numpy writer.
"""
from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import numpy as np

TINY = dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16,
            taps=[1, 3, 5], n_target=6, block=8, mask=500, theta=1e7)
DSPARK_RANK = 32
DF2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}


def make_config(family: str, *, rope: str = "nested", block_at: str | None = None, yarn: bool = False,
                sliding: str = "none", packaging: str = "specforge", confidence: bool = True,
                with_markov: bool = True) -> dict:
    """A raw ``config.json`` dict for a tiny drafter.

    rope: ``nested`` (transformers ≥ 5 ``rope_parameters``) or ``toplevel`` (``rope_theta``).
    block_at: where ``block_size`` lives (``dflash_config`` or ``top``); C19. Default as published:
    top level for z-lab DFlash 1 and SpecForge / DeepSpec DSpark, inside dflash_config for DFlash 2.
    yarn: declare YaRN (factor 32, original 8192, β 32/1), as RadixArk DSpark does.
    sliding: ``none`` (Qwen3.5 DFlash), ``qwen36`` (sliding + last full, window 32) or ``all``
    (DFlash 2: every layer sliding, ``is_causal: false``).
    packaging (DSpark): ``specforge`` (keys nested in dflash_config) or ``deepspec`` (top level).
    """
    t = TINY
    cfg: dict = {
        "architectures": [ARCHITECTURES[family] if not (family == "dspark" and packaging == "deepspec")
                          else "Qwen3DSparkModel"],
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": t["hidden"], "intermediate_size": t["inter"], "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"], "num_key_value_heads": t["kv_heads"], "head_dim": t["head_dim"],
        "rms_norm_eps": 1e-6, "vocab_size": t["vocab"], "max_position_embeddings": 40960,
        "num_target_layers": t["n_target"], "tie_word_embeddings": False, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": t["mask"], "target_layer_ids": list(t["taps"])},
    }
    rope_params = {"rope_type": "default", "rope_theta": t["theta"]}
    if yarn:
        rope_params = {"rope_type": "yarn", "rope_theta": t["theta"], "factor": 32.0,
                       "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0}
    if rope == "nested":
        cfg["rope_parameters"] = rope_params
    else:
        cfg["rope_theta"] = t["theta"]
        if yarn:
            cfg["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if block_at is None:
        block_at = "dflash_config" if family == "dflash2" else "top"
    if block_at == "dflash_config":
        cfg["dflash_config"]["block_size"] = t["block"]
    else:
        cfg["block_size"] = t["block"]
    if sliding == "qwen36":
        cfg.update(layer_types=["sliding_attention"] * (t["layers"] - 1) + ["full_attention"],
                   sliding_window=32, use_sliding_window=True)
    elif sliding == "all":
        cfg.update(layer_types=["sliding_attention"] * t["layers"], sliding_window=32,
                   use_sliding_window=True, is_causal=False)
    if family == "dflash2":
        cfg["dflash_config"].update(DF2)
    if family == "dspark":
        heads = {"markov_rank": DSPARK_RANK, "markov_head_type": "vanilla",
                 "enable_confidence_head": confidence, "confidence_head_with_markov": with_markov and confidence}
        if packaging == "specforge":
            cfg["dflash_config"].update(projector_type="dspark", **heads)
        else:  # DeepSpec: everything at top level, no dflash_config
            dc = cfg.pop("dflash_config")
            cfg.update(mask_token_id=dc["mask_token_id"], target_layer_ids=dc["target_layer_ids"], **heads)
            if "block_size" in dc:
                cfg["block_size"] = dc["block_size"]
            cfg["layer_types"] = ["full_attention"] * t["layers"]
    return cfg


def documented_names(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names → torch shapes from drafters.md §2.3 / §5.4 / §6.4 for ``cfg``."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dc = cfg.get("dflash_config", {})
    taps = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
    V = cfg["vocab_size"]
    arch = cfg["architectures"][0]
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(taps) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
        if arch == "DFlash2DraftModel":
            K, G = dc["conv_kernel_size"], H // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, K, H)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * K * G, H)
    if arch == "DFlash2DraftModel":
        R = dc["selector_rank"]
        out.update({"candidate_selector.predecessor_codebook": (V, R),
                    "candidate_selector.successor_codebook": (V, R),
                    "candidate_selector.hidden_projection.weight": (R, H)})
    if arch in ("DSparkDraftModel", "Qwen3DSparkModel"):
        r = dc.get("markov_rank", cfg.get("markov_rank"))
        out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
        conf = dc.get("enable_confidence_head", cfg.get("enable_confidence_head"))
        wm = dc.get("confidence_head_with_markov", cfg.get("confidence_head_with_markov"))
        if conf:
            out.update({"confidence_head.proj.weight": (1, H + (r if wm else 0)), "confidence_head.proj.bias": (1,)})
        if arch == "Qwen3DSparkModel":  # DeepSpec ships frozen target copies
            out.update({"embed_tokens.weight": (V, H), "lm_head.weight": (V, H)})
    return out


def reference_names(cfg: dict) -> dict[str, tuple[int, ...]] | None:
    """Names → shapes of dflash 0.1.0's model class for ``cfg`` (codebooks without ``.weight``, as
    published), or None when ``dflash`` / torch are not importable or the family has no class."""
    arch = cfg["architectures"][0]
    if arch not in ("DFlashDraftModel", "DFlash2DraftModel"):
        return None
    try:
        from dflash import DFlash2DraftModel, DFlashDraftModel
        from transformers import Qwen3Config
    except Exception:  # noqa: BLE001 - any import failure means "oracle absent"
        return None
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "model_type", "dtype")}
    qc = Qwen3Config(**kwargs)
    qc.dflash_config = copy.deepcopy(cfg.get("dflash_config", {}))
    if "is_causal" in cfg:
        qc.is_causal = cfg["is_causal"]
    cls = DFlash2DraftModel if arch == "DFlash2DraftModel" else DFlashDraftModel
    model = cls(qc)
    out = {}
    for name, v in model.state_dict().items():
        if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
            name = name[: -len(".weight")]
        out[name] = tuple(v.shape)
    return out


def random_weights(names: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fixed-distribution float32 values for every tensor in ``names``."""
    out = {}
    for name, shape in names.items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + rng.normal(0, 0.1, shape)).astype(np.float32)
        elif name.endswith("base_kernel"):
            out[name] = rng.normal(0, 0.5, shape).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = rng.normal(0, 0.1, shape).astype(np.float32)
        else:
            out[name] = rng.normal(0, 0.05, shape).astype(np.float32)
    return out


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 → bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """Write float32 ``tensors`` as a safetensors file of ``dtype`` (BF16, F16 or F32)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        raw = (to_bf16_bits(a) if dtype == "BF16" else a.astype(np.float16 if dtype == "F16" else np.float32)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for b in blobs:
            fh.write(b)


def write_checkpoint(folder: Path, cfg: dict, tensors: dict[str, np.ndarray], dtype: str = "BF16",
                     shards: int = 1) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (or ``shards`` files with an index)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, allow_nan=True))
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, dtype)
    else:
        names = sorted(tensors)
        per = math.ceil(len(names) / shards)
        weight_map = {}
        for s in range(shards):
            part = names[s * per:(s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(folder / fname, {n: tensors[n] for n in part}, dtype)
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def make_drafter(folder: Path, family: str, rng: np.random.Generator, *, dtype: str = "BF16", shards: int = 1,
                 cfg: dict | None = None, **config_kwargs) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """Write a tiny random drafter of ``family`` under ``folder``; return (folder, config, float32
    tensors as stored, i.e. after BF16 rounding when dtype is BF16)."""
    cfg = cfg if cfg is not None else make_config(family, **config_kwargs)
    names = reference_names(cfg) or documented_names(cfg)
    tensors = random_weights(names, rng)
    if dtype == "BF16":
        tensors = {k: from_bf16_bits(to_bf16_bits(v)) for k, v in tensors.items()}
    elif dtype == "F16":
        tensors = {k: v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}
    write_checkpoint(folder, cfg, tensors, dtype, shards)
    return folder, cfg, tensors
