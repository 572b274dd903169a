"""``specd convert-target``: transformers Qwen3.5 checkpoint → qwen35 GGUF, and the inverse mapping.

The output follows llama.cpp's converter exactly (``conversion/qwen.py``: ``Qwen3_5TextModel``,
``_LinearAttentionVReorderBase``, ``Qwen3NextModel``, ``_Qwen35MtpMixin``; contract in
docs/qwen35-target.md §3-§5):

* names from ``gguf.get_tensor_name_map(MODEL_ARCH.QWEN35, block_count)`` (``dt_bias`` renamed
  ``dt_proj.bias`` first); MTP tensors ``mtp.*`` become block ``L = num_hidden_layers`` with the
  ``blk.L.nextn.*`` names of ``gguf.TENSOR_NAMES`` (PyPI gguf 0.19.0 lacks them in the QWEN35 map);
* every ``*norm.weight`` except ``linear_attn.norm.weight`` gets +1 (float32 add); ``A_log`` →
  ``ssm_a = -exp(A_log)`` (float64, rounded to float32); ``conv1d`` (C, 1, K) → (C, K);
* value heads move from HF "grouped" order (head j = g*r + s for key head g) to ggml "tiled" order
  (position s*Hk + g): V rows of ``in_proj_qkv``/``conv1d``, rows of ``in_proj_z`` (unit dv),
  ``in_proj_b``/``in_proj_a``/``A_log``/``dt_bias`` (unit 1), input columns of ``out_proj`` (unit dv);
* ``q_proj`` keeps its per-head [q | gate] rows; all §3 keys, including the literal
  ``qwen35.attention.recurrent_layers`` and ``rope.dimension_sections``; tokenizer metadata when
  ``tokenizer.json`` is present.

1-D tensors, norms and ``ssm_conv1d`` stay F32; other 2-D tensors take ``--outtype`` (q8_0 via
``gguf.quants.quantize``; a tensor whose ne0 is not a multiple of 32 falls back to F16, as in
llama.cpp). Tensors are streamed: the header is written from the safetensors headers alone, then
each tensor is read (memory-mapped), transformed, encoded and written before the next is touched.

:func:`to_hf_state_dict` is the inverse (§5.3): it dequantizes a qwen35 GGUF with ``gguf.quants``
and returns a state dict that loads strictly into ``Qwen3_5ForCausalLM`` — the golden-reference
path for quantized files (oracles.md §1.3). :func:`to_hf_config` gives the matching config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize
from gguf.utility import LocalTensor, SafetensorsLocal

from .gguf_loader import (
    ARCH,
    FullAttnLayer,
    Qwen35HParams,
    TargetFileError,
    check_hparams,
    expected_tensors,
    gguf_name,
    interval_schedule,
    layer_fields,
    layer_ne,
    load_qwen35,
    open_gguf,
)
from .tokenizer import SPLIT_REGEX

OUTTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
FILE_TYPES = {QT.F32: gguf.LlamaFileType.ALL_F32, QT.F16: gguf.LlamaFileType.MOSTLY_F16,
              QT.BF16: gguf.LlamaFileType.MOSTLY_BF16, QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # llama.cpp _Qwen35MRopeMixin default

_COMMON = ["input_layernorm.weight", "post_attention_layernorm.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
_FULL = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
_GDN = ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight", "linear_attn.A_log", "linear_attn.dt_bias",
        "linear_attn.conv1d.weight", "linear_attn.norm.weight", "linear_attn.out_proj.weight"]
# mtp.<part>.weight → the nextn tensor it becomes at block L (llama.cpp _Qwen35MtpMixin renames)
_MTP_GLOBAL = {"fc": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "pre_fc_norm_embedding": gguf.MODEL_TENSOR.NEXTN_ENORM,
               "pre_fc_norm_hidden": gguf.MODEL_TENSOR.NEXTN_HNORM, "norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}
# Transform per GDN tensor (after "linear_attn."): value-head reorder and value transforms.
_GDN_KIND = {"in_proj_qkv.weight": "qkv", "in_proj_z.weight": "v_rows", "in_proj_b.weight": "head_rows",
             "in_proj_a.weight": "head_rows", "A_log": "a_log", "dt_bias": "head_rows",
             "conv1d.weight": "conv", "norm.weight": "copy", "out_proj.weight": "v_cols"}


class ConversionError(ValueError):
    """A checkpoint the converter cannot turn into a qwen35 GGUF; the message names the file and
    the key or tensor."""


# --------------------------------------------------------------------------------------------
# Checkpoint reading
# --------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A transformers Qwen3.5 checkpoint directory, indexed but not loaded.

    ``config`` is config.json with ``text_config`` merged over the top level; ``tensors`` maps
    normalised HF names (``model.*``, ``lm_head.weight``, ``mtp.*``; the ``language_model.`` prefix
    stripped, vision tensors dropped) to memory-mappable safetensors ranges.
    """

    path: Path
    config: dict
    tensors: dict[str, LocalTensor]
    tied: bool


def open_checkpoint(hf_dir: str | os.PathLike) -> Checkpoint:
    """Index config.json and model.safetensors (or the shards of model.safetensors.index.json).
    Raises ConversionError for a missing config or weights file, or a tensor listed twice."""
    path = Path(hf_dir)
    raw = _read_json(path / "config.json")
    config = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    config.update(raw.get("text_config") or {})
    tied = bool(raw.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    tensors: dict[str, LocalTensor] = {}
    for shard in _shards(path):
        for name, local in _safetensors_index(shard).items():
            norm = _normalise_name(name)
            if norm is None:
                continue
            if norm in tensors:
                raise ConversionError(f"{shard}: tensor '{name}' appears twice in the checkpoint")
            tensors[norm] = local
    return Checkpoint(path=path, config=config, tensors=tensors, tied=tied)


def _safetensors_index(shard: Path) -> dict[str, LocalTensor]:
    try:
        return SafetensorsLocal(shard).tensors
    except (ValueError, KeyError, OSError) as exc:
        raise ConversionError(f"{shard}: not a readable safetensors file: {exc}") from exc


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: invalid JSON: {exc}") from exc


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index}: no 'weight_map' object")
        shards = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        shards = [path / "model.safetensors"]
    else:
        shards = sorted(path.glob("model-*.safetensors"))
    if not shards:
        raise ConversionError(f"{path}: no model.safetensors, shards or index json")
    for shard in shards:
        if not shard.is_file():
            raise ConversionError(f"{shard}: shard listed in the index is missing")
    return shards


def _normalise_name(name: str) -> str | None:
    """HF tensor name → the Qwen3_5ForCausalLM layout; None for vision tensors (dropped)."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.mtp."):
        return name[len("model."):]
    return name


_SOURCE_DTYPES = ("F32", "F16", "BF16")


def read_tensor(local: LocalTensor) -> np.ndarray:
    """A safetensors tensor (F32/F16/BF16, memory-mapped) as a float32 array of its shape; BF16
    widens exactly by shifting the bits into the high half of a float32."""
    raw = local.mmap_bytes()
    if local.dtype == "F32":
        data = raw.view(np.float32)
    elif local.dtype == "F16":
        data = raw.view(np.float16)
    elif local.dtype == "BF16":
        data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ConversionError(f"{local.data_range.filename}: tensor dtype {local.dtype} is not F32/F16/BF16")
    return np.asarray(data, dtype=np.float32).reshape(local.shape)


# --------------------------------------------------------------------------------------------
# Config → hyperparameters
# --------------------------------------------------------------------------------------------


def hparams_from_config(cfg: dict, n_vocab: int, n_nextn: int, where: str) -> Qwen35HParams:
    """Qwen35HParams of a transformers Qwen3.5 text config (qwen35-target.md §2 → §3).

    Defaults follow transformers where a config may omit a field (rms_norm_eps 1e-6,
    max_position_embeddings 32768, rope_theta 10000, partial_rotary_factor 0.25) and llama.cpp
    for mrope_section ([11, 11, 10, 0]). Raises ConversionError for a missing dimension, dk != dv,
    scaled RoPE or a layer schedule without an interval pattern.
    """
    req = lambda key: _require(cfg, key, where)  # noqa: E731
    dk, dv = req("linear_key_head_dim"), req("linear_value_head_dim")
    if dk != dv:
        raise ConversionError(f"{where}: linear_key_head_dim ({dk}) != linear_value_head_dim ({dv}); "
                              "qwen35 GGUFs (llama.cpp) require equal GDN key and value head dims")
    head_dim, n_layer = req("head_dim"), req("num_hidden_layers")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConversionError(f"{where}: rope_type '{rope_type}' (scaled RoPE) is not supported")
    sections = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)[:4]
    recurrent, interval = _layer_schedule(cfg, n_layer, where)
    hp = Qwen35HParams(
        n_layer=n_layer, n_nextn=n_nextn, n_vocab=n_vocab,
        n_embd=req("hidden_size"), n_ff=req("intermediate_size"),
        n_head=req("num_attention_heads"), n_head_kv=req("num_key_value_heads"), head_dim=head_dim,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_freq_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        n_rot=int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        rope_sections=tuple(sections + [0] * (4 - len(sections))),  # type: ignore[arg-type]
        context_length=int(cfg.get("max_position_embeddings", 32768)),
        ssm_conv_kernel=req("linear_conv_kernel_dim"), ssm_state_size=dk,
        ssm_group_count=req("linear_num_key_heads"), ssm_time_step_rank=req("linear_num_value_heads"),
        ssm_inner_size=dv * req("linear_num_value_heads"),
        full_attention_interval=interval, recurrent=recurrent,
    )
    try:
        check_hparams(hp, where)
    except TargetFileError as exc:
        raise ConversionError(str(exc)) from None
    return hp


def _require(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise ConversionError(f"{where}: config key '{key}' is missing")
    return cfg[key]


def _layer_schedule(cfg: dict, n_layer: int, where: str) -> tuple[tuple[bool, ...], int]:
    """(per-layer is-GDN flags, full_attention_interval) from layer_types and/or the interval."""
    interval = cfg.get("full_attention_interval")
    types = cfg.get("layer_types")
    if types is None:
        interval = int(interval or 4)
        return interval_schedule(n_layer, interval), interval
    if len(types) != n_layer or not set(types) <= {"linear_attention", "full_attention"}:
        raise ConversionError(f"{where}: layer_types must list {n_layer} entries of 'linear_attention' "
                              f"or 'full_attention'; got {types}")
    recurrent = tuple(t == "linear_attention" for t in types)
    if interval is None:  # transformers does not save the interval: infer it from the pattern
        interval = next((k for k in range(1, n_layer + 2) if interval_schedule(n_layer, k) == recurrent), None)
        if interval is None:
            raise ConversionError(f"{where}: layer_types {types} follow no full_attention_interval "
                                  "pattern and config.json has no full_attention_interval")
    return recurrent, int(interval)


# --------------------------------------------------------------------------------------------
# Names and transforms
# --------------------------------------------------------------------------------------------


def hf_tensor_names(hp: Qwen35HParams, lm_head: bool, n_mtp: int) -> list[str]:
    """Every HF tensor of a Qwen3.5 text checkpoint (Qwen3_5ForCausalLM layout), in write order:
    embeddings, final norm, optional lm_head, trunk layers, then ``n_mtp`` MTP blocks."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + (["lm_head.weight"] if lm_head else [])
    for i, is_gdn in enumerate(hp.recurrent):
        names += [f"model.layers.{i}.{n}" for n in _COMMON[:2] + (_GDN if is_gdn else _FULL) + _COMMON[2:]]
    if n_mtp:
        names += [f"mtp.{part}.weight" for part in _MTP_GLOBAL]
    for k in range(n_mtp):
        names += [f"mtp.layers.{k}.{n}" for n in _COMMON[:2] + _FULL + _COMMON[2:]]
    return names


def gguf_tensor_name(hf_name: str, hp: Qwen35HParams, tmap: gguf.TensorNameMap) -> str:
    """GGUF name of a normalised HF tensor name (llama.cpp mapping; MTP renamed first)."""
    if hf_name.startswith("mtp.layers."):
        k, rest = hf_name[len("mtp.layers."):].split(".", 1)
        hf_name = f"model.layers.{hp.n_layer + int(k)}.{rest}"
    elif hf_name.startswith("mtp."):
        part = hf_name.split(".")[1]
        if part not in _MTP_GLOBAL or not hf_name.endswith(".weight"):
            raise KeyError(hf_name)
        return gguf.TENSOR_NAMES[_MTP_GLOBAL[part]].format(bid=hp.n_layer) + ".weight"
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name[: -len("dt_bias")] + "dt_proj.bias"
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise KeyError(hf_name)
    return name


def transform_kind(hf_name: str) -> str:
    """Which §5.1 transform a tensor takes: norm (+1), a_log (-exp, tiled), qkv/conv (V rows
    tiled; conv also squeezed), v_rows/v_cols (tiled by dv rows/columns), head_rows (tiled by
    single rows/entries), copy."""
    if ".linear_attn." in hf_name:
        return _GDN_KIND[hf_name.split(".linear_attn.", 1)[1]]
    if hf_name.endswith("norm.weight") or hf_name.startswith("mtp.pre_fc_norm_"):
        return "norm"
    return "copy"


def tiled_head_order(n_k_heads: int, v_per_k: int) -> np.ndarray:
    """Index array p → HF head: the tiled position p = s*Hk + g holds HF (grouped) head g*r + s."""
    s, g = np.divmod(np.arange(n_k_heads * v_per_k), n_k_heads)
    return g * v_per_k + s


def _unit_order(hp: Qwen35HParams, unit: int) -> np.ndarray:
    heads = tiled_head_order(hp.n_k_heads, hp.v_per_k)
    return (heads[:, None] * unit + np.arange(unit)).ravel()


def _tile(x: np.ndarray, axis: int, unit: int, hp: Qwen35HParams) -> np.ndarray:
    return np.take(x, _unit_order(hp, unit), axis=axis)


def _untile(x: np.ndarray, axis: int, unit: int, hp: Qwen35HParams) -> np.ndarray:
    return np.take(x, np.argsort(_unit_order(hp, unit)), axis=axis)


def _v_part(x: np.ndarray, hp: Qwen35HParams, fn) -> np.ndarray:
    qk = 2 * hp.key_dim
    return np.concatenate([x[:qk], fn(x[qk:], 0, hp.head_v_dim, hp)], axis=0)


def to_gguf_layout(kind: str, x: np.ndarray, hp: Qwen35HParams) -> np.ndarray:
    """Apply the forward transform ``kind`` (see :func:`transform_kind`) to a float32 HF tensor;
    returns float32 in GGUF layout, numpy shape (out, in)."""
    if kind == "norm":
        return x + np.float32(1.0)
    if kind == "a_log":
        return _tile((-np.exp(x.astype(np.float64))).astype(np.float32), 0, 1, hp)
    if kind == "head_rows":
        return _tile(x, 0, 1, hp)
    if kind == "v_rows":
        return _tile(x, 0, hp.head_v_dim, hp)
    if kind == "v_cols":
        return _tile(x, 1, hp.head_v_dim, hp)
    if kind == "qkv":
        return _v_part(x, hp, _tile)
    if kind == "conv":
        return _v_part(x.reshape(x.shape[0], x.shape[-1]), hp, _tile)
    return x


def to_hf_layout(kind: str, x: np.ndarray, hp: Qwen35HParams) -> np.ndarray:
    """Inverse of :func:`to_gguf_layout` (qwen35-target.md §5.3): -1 on norms, A_log = log(-ssm_a)
    (float64, rounded to float32), tiled → grouped heads, conv (C, K) → (C, 1, K)."""
    if kind == "norm":
        return x - np.float32(1.0)
    if kind == "a_log":
        return np.log(-_untile(x, 0, 1, hp).astype(np.float64)).astype(np.float32)
    if kind == "head_rows":
        return _untile(x, 0, 1, hp)
    if kind == "v_rows":
        return _untile(x, 0, hp.head_v_dim, hp)
    if kind == "v_cols":
        return _untile(x, 1, hp.head_v_dim, hp)
    if kind == "qkv":
        return _v_part(x, hp, _untile)
    if kind == "conv":
        return _v_part(x, hp, _untile)[:, None, :]
    return x


# --------------------------------------------------------------------------------------------
# Plan and write
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its HF source, GGUF name, transform, numpy shape (out, in) and type."""

    hf_name: str
    gguf_name: str
    kind: str
    shape: tuple[int, ...]
    qtype: QT

    @property
    def nbytes(self) -> int:
        return int(np.prod(quant_shape_to_byte_shape(self.shape, self.qtype)))


@dataclass
class ConversionResult:
    """What :func:`convert` wrote."""

    path: Path
    hparams: Qwen35HParams
    tensors: list[TensorPlan]
    tokenizer: bool
    type_counts: dict[str, int] = field(default_factory=dict)


def output_qtype(plan_shape: tuple[int, ...], gguf_name: str, outtype: QT) -> QT:
    """Type of one output tensor: F32 for 1-D tensors and ssm_conv1d; F16 for Q8_0 requests whose
    ne0 is not a multiple of 32 (llama.cpp's fallback); else ``outtype``."""
    if len(plan_shape) == 1 or "ssm_conv1d" in gguf_name:
        return QT.F32
    if outtype == QT.Q8_0 and plan_shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        return QT.F16
    return outtype


def plan_conversion(ckpt: Checkpoint, outtype: QT, mtp: bool = True) -> tuple[Qwen35HParams, list[TensorPlan]]:
    """Check the checkpoint against its config and list every output tensor (no data read).
    Raises ConversionError for missing, unexpected or mis-shaped tensors."""
    where = str(ckpt.path / "config.json")
    names = dict(ckpt.tensors)
    n_mtp = _count_mtp_layers(names, ckpt.config, where) if mtp else 0
    if not mtp:
        names = {k: v for k, v in names.items() if not k.startswith("mtp.")}
    if "model.embed_tokens.weight" not in names:
        raise ConversionError(f"{ckpt.path}: tensor 'model.embed_tokens.weight' is missing")
    n_vocab = int(names["model.embed_tokens.weight"].shape[0])
    hp = hparams_from_config(ckpt.config, n_vocab, n_mtp, where)
    lm_head = "lm_head.weight" in names and not ckpt.tied
    if ckpt.tied:
        names.pop("lm_head.weight", None)
    elif not lm_head:
        raise ConversionError(f"{ckpt.path}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
    expected = hf_tensor_names(hp, lm_head, n_mtp)
    _check_names(expected, names, ckpt.path)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, hp.block_count)
    ne = _expected_ne(hp)
    plans = []
    for hf_name in expected:
        name = gguf_tensor_name(hf_name, hp, tmap)
        kind = transform_kind(hf_name)
        shape = _gguf_shape(names[hf_name].shape, kind)
        if names[hf_name].dtype not in _SOURCE_DTYPES:
            raise ConversionError(f"{names[hf_name].data_range.filename}: tensor '{hf_name}' is "
                                  f"{names[hf_name].dtype}; expected one of {', '.join(_SOURCE_DTYPES)}")
        if tuple(reversed(shape)) != ne[name]:
            raise ConversionError(f"{ckpt.path}: tensor '{hf_name}' has shape {list(names[hf_name].shape)}; "
                                  f"the config implies GGUF ne {list(ne[name])} for '{name}'")
        plans.append(TensorPlan(hf_name, name, kind, shape, output_qtype(shape, name, outtype)))
    return hp, plans


def _count_mtp_layers(names: dict, cfg: dict, where: str) -> int:
    layers = {n.split(".")[2] for n in names if n.startswith("mtp.layers.")}
    found = len(layers)
    declared = cfg.get("mtp_num_hidden_layers")
    if found and declared is not None and declared != found:
        raise ConversionError(f"{where}: mtp_num_hidden_layers is {declared} but the checkpoint has "
                              f"{found} mtp.layers.* blocks")
    if not found and any(n.startswith("mtp.") for n in names):
        raise ConversionError(f"{where}: the checkpoint has mtp.* tensors but no mtp.layers.* block")
    return found


def _check_names(expected: list[str], present: dict, path: Path) -> None:
    missing = [n for n in expected if n not in present]
    extra = sorted(set(present) - set(expected))
    if missing:
        raise ConversionError(f"{path}: checkpoint lacks tensor(s) {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} required by config.json")
    if extra:
        raise ConversionError(f"{path}: checkpoint has tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} "
                              "that are not part of a Qwen3.5 text model with this config")


def _gguf_shape(hf_shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    if kind == "conv":
        return (hf_shape[0], hf_shape[-1]) if len(hf_shape) == 3 and hf_shape[1] == 1 else tuple(hf_shape)
    return tuple(hf_shape)


def _expected_ne(hp: Qwen35HParams) -> dict[str, tuple[int, ...]]:
    """GGUF ne of every tensor including MTP blocks (full-attention layout plus nextn tensors)."""
    ne = {name: spec.ne for name, spec in expected_tensors(hp).items()}
    shapes = layer_ne(hp)
    for b in range(hp.n_layer, hp.block_count):
        for fname in layer_fields(FullAttnLayer):
            ne[gguf_name(b, fname)] = shapes[fname]
    H = hp.n_embd
    nextn = {gguf.MODEL_TENSOR.NEXTN_EH_PROJ: (2 * H, H), gguf.MODEL_TENSOR.NEXTN_ENORM: (H,),
             gguf.MODEL_TENSOR.NEXTN_HNORM: (H,), gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM: (H,)}
    if hp.n_nextn:
        for tensor, shape in nextn.items():
            ne[gguf.TENSOR_NAMES[tensor].format(bid=hp.n_layer) + ".weight"] = shape
    return ne


def encode(x: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 (out, in) → the bytes/array GGUFWriter stores for ``qtype`` (gguf.quants.quantize)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x if qtype == QT.F32 else quantize(x, qtype)


def write_metadata(w: gguf.GGUFWriter, hp: Qwen35HParams, name: str,
                   file_type: QT | gguf.LlamaFileType) -> None:
    """All qwen35 keys of qwen35-target.md §3 (general.architecture is written by GGUFWriter).
    ``file_type``: the converter's output type (mapped to general.file_type) or a LlamaFileType."""
    w.add_name(name)
    ft = file_type if isinstance(file_type, gguf.LlamaFileType) else FILE_TYPES[file_type]
    w.add_file_type(int(ft))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(hp.block_count)
    if hp.n_nextn:
        w.add_nextn_predict_layers(hp.n_nextn)
    if hp.context_length is not None:
        w.add_context_length(hp.context_length)
    w.add_embedding_length(hp.n_embd)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_rope_freq_base(hp.rope_freq_base)
    w.add_rope_dimension_count(hp.n_rot)
    w.add_rope_dimension_sections(list(hp.rope_sections))
    w.add_ssm_conv_kernel(hp.ssm_conv_kernel)
    w.add_ssm_state_size(hp.ssm_state_size)
    w.add_ssm_group_count(hp.ssm_group_count)
    w.add_ssm_time_step_rank(hp.ssm_time_step_rank)
    w.add_ssm_inner_size(hp.ssm_inner_size)
    w.add_full_attention_interval(hp.full_attention_interval)
    # Not in PyPI gguf 0.19.0's Keys: written by its literal name (MTP blocks are not recurrent).
    w.add_array(f"{ARCH}.attention.recurrent_layers", list(hp.recurrent) + [False] * hp.n_nextn)


def write_gguf(out: Path, metadata, infos, data, arch: str = ARCH) -> None:
    """Write a GGUF of architecture ``arch`` (default qwen35) at ``out`` atomically (``out + .tmp``,
    renamed when complete; removed on any error), streaming tensor data (only one tensor is in memory
    at a time). ``metadata(writer)`` adds the KV pairs; ``infos`` lists (name, numpy-order shape,
    storage type, bytes) per tensor; ``data(i)`` returns tensor i's stored array (called in order)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        metadata(writer)
        for name, shape, qtype, nbytes in infos:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i in range(len(infos)):
            writer.write_tensor_data(data(i))
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def convert(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "auto",
            mtp: bool = True) -> ConversionResult:
    """Convert a transformers Qwen3.5 checkpoint directory to a qwen35 GGUF at ``out_path``.

    ``outtype``: f32, f16, bf16, q8_0, or auto (f16 for an f16 checkpoint, else bf16, as
    llama.cpp). ``mtp=False`` drops ``mtp.*`` tensors. The file is written to ``out_path + .tmp``
    and renamed when complete. Raises ConversionError (nothing is left behind).
    """
    ckpt = open_checkpoint(hf_dir)
    qtype = _resolve_outtype(outtype, ckpt)
    hp, plans = plan_conversion(ckpt, qtype, mtp)
    out = Path(out_path)
    has_tokenizer = False

    def metadata(writer):
        nonlocal has_tokenizer
        write_metadata(writer, hp, ckpt.path.name, qtype)
        has_tokenizer = add_tokenizer(writer, ckpt.path, hp.n_vocab, ckpt.config)

    infos = [(p.gguf_name, p.shape, p.qtype, p.nbytes) for p in plans]
    write_gguf(out, metadata, infos,
               lambda i: encode(to_gguf_layout(plans[i].kind, read_tensor(ckpt.tensors[plans[i].hf_name]), hp),
                                plans[i].qtype))
    counts: dict[str, int] = {}
    for p in plans:
        counts[p.qtype.name] = counts.get(p.qtype.name, 0) + 1
    return ConversionResult(out, hp, plans, has_tokenizer, counts)


def _resolve_outtype(outtype: str, ckpt: Checkpoint) -> QT:
    if outtype == "auto":
        first_2d = next((t for t in ckpt.tensors.values() if len(t.shape) >= 2), None)
        # llama.cpp's convert_hf_to_gguf "auto": f16 when the checkpoint is f16, else bf16 (keeps the
        # range of bf16 and f32 checkpoints)
        return QT.F16 if first_2d is not None and first_2d.dtype == "F16" else QT.BF16
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype '{outtype}'; choose from {', '.join(OUTTYPES)} or auto")
    return OUTTYPES[outtype]


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, n_vocab: int, cfg: dict) -> bool:
    """Write byte-level BPE tokenizer metadata from tokenizer.json (+ tokenizer_config.json,
    chat_template.jinja) when present; returns whether a tokenizer was written.

    Tokens are padded to ``n_vocab`` with ``[PAD{i}]`` (UNUSED); added tokens are CONTROL when
    marked special (or shaped ``<|...|>``) and USER_DEFINED otherwise; merges, bos/eos/pad ids and
    the chat template come from ``gguf.SpecialVocab``. EOT is the second end-of-generation id: the
    tokenizer config's eot_token, else ``<|im_end|>``, else another config eos_token_id, when it
    differs from EOS. Raises ConversionError for a non-BPE tokenizer or ids beyond ``n_vocab``.
    """
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return False
    tj = _read_json(path)
    tokens, types = vocab_tokens(tj, n_vocab, path)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_type(tj, path))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, special_token_types=("bos", "eos", "eot", "unk", "pad"),
                                n_vocab=n_vocab)
    _fill_eot(special, tokens, cfg)
    if special.chat_template is None and (hf_dir / "chat_template.jinja").is_file():
        special.chat_template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    special.add_to_gguf(w, quiet=True)
    return True


def pre_tokenizer_type(tj: dict, path: Path) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for the split regex of a tokenizer.json ("qwen35" or
    "qwen2"); ConversionError for any other pre-tokenizer (never a guess)."""
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regexes = [st.get("pattern", {}).get("Regex") for st in steps if st.get("type") == "Split"]
    for name, regex in SPLIT_REGEX.items():
        if regexes == [regex]:
            return name
    raise ConversionError(f"{path}: pre_tokenizer split {regexes!r} is neither Qwen3.5's nor Qwen2's; "
                          "specd cannot name its llama.cpp pre-tokenizer")


def vocab_tokens(tj: dict, n_vocab: int, path: Path) -> tuple[list[str], list[int]]:
    """(tokens, llama.cpp token types) of a tokenizer.json, padded to ``n_vocab``."""
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(tj.get("pre_tokenizer")):
        raise ConversionError(f"{path}: expected a byte-level BPE tokenizer (model.type BPE with a "
                              f"ByteLevel pre-tokenizer); got model.type {model.get('type')!r}")
    by_id = {int(i): tok for tok, i in model.get("vocab", {}).items()}
    added = {int(a["id"]): a for a in tj.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if by_id and max(by_id) >= n_vocab:
        raise ConversionError(f"{path}: token id {max(by_id)} is beyond the embedding's {n_vocab} rows")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            text = by_id[i]
            looks_special = text.startswith("<|") and text.endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i].get("special") or looks_special
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _fill_eot(special: gguf.SpecialVocab, tokens: list[str], cfg: dict) -> None:
    ids = special.special_token_ids
    if "eot" in ids:
        return
    eos = ids.get("eos")
    candidates = [tokens.index("<|im_end|>")] if "<|im_end|>" in tokens else []
    config_eos = cfg.get("eos_token_id")
    candidates += config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else []
    eot = next((int(c) for c in candidates if c != eos and 0 <= int(c) < len(tokens)), None)
    if eot is not None:
        ids["eot"] = eot
    if eos is None and isinstance(config_eos, int):
        ids["eos"] = config_eos


# --------------------------------------------------------------------------------------------
# Inverse mapping: GGUF → HF
# --------------------------------------------------------------------------------------------


def dequantize_tensor(t) -> np.ndarray:
    """A reader tensor as a new float32 array, numpy shape (out, in) (gguf.quants.dequantize)."""
    return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)


def to_hf_state_dict(reader: gguf.GGUFReader | str | os.PathLike, include_mtp: bool = False) -> dict[str, np.ndarray]:
    """Dequantize a qwen35 GGUF and map it back to transformers names and layouts (§5.3).

    Returns float32 numpy arrays keyed like ``Qwen3_5ForCausalLM.state_dict()``, including
    ``lm_head.weight`` (a copy of the embedding when the file has no ``output.weight``), so it
    loads strictly into a model built from :func:`to_hf_config`. With ``include_mtp`` the MTP
    block is returned too under ``mtp.*`` names (transformers ignores these). Raises
    TargetFileError for files the loader rejects or tensors outside the layout.
    """
    if not isinstance(reader, gguf.GGUFReader):
        reader = open_gguf(reader)
    path = str(reader.data.filename)
    weights = load_qwen35(path, reader=reader)  # full validation of the trunk
    hp, tied = weights.hparams, weights.output_tied
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, hp.block_count)
    names = hf_tensor_names(hp, not tied, hp.n_nextn if include_mtp else 0)
    by_gguf = {gguf_tensor_name(n, hp, tmap): n for n in names}
    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        hf_name = by_gguf.get(t.name)
        if hf_name is None:
            if not include_mtp and _block_index(t.name) >= hp.n_layer:
                continue
            raise TargetFileError(f"{path}: tensor '{t.name}' has no transformers counterpart")
        state[hf_name] = to_hf_layout(transform_kind(hf_name), dequantize_tensor(t), hp)
    missing = [n for n in names if n not in state]
    if missing:
        raise TargetFileError(f"{path}: required tensor(s) for {missing[:5]} are missing")
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].copy()
    return state


def _block_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1


def to_hf_config(hp: Qwen35HParams, tied: bool) -> dict:
    """A transformers ``Qwen3_5TextConfig`` dict (config.json for ``Qwen3_5ForCausalLM``) equivalent
    to the hyperparameters of a qwen35 GGUF, for golden references built from the file alone."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": hp.n_vocab, "hidden_size": hp.n_embd, "intermediate_size": hp.n_ff,
        "num_hidden_layers": hp.n_layer, "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv, "head_dim": hp.head_dim,
        "linear_num_key_heads": hp.n_k_heads, "linear_num_value_heads": hp.n_v_heads,
        "linear_key_head_dim": hp.head_k_dim, "linear_value_head_dim": hp.head_v_dim,
        "linear_conv_kernel_dim": hp.ssm_conv_kernel,
        "layer_types": ["linear_attention" if r else "full_attention" for r in hp.recurrent],
        "rms_norm_eps": hp.rms_eps, "tie_word_embeddings": tied,
        "max_position_embeddings": hp.context_length or 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": hp.rope_freq_base,
                            "partial_rotary_factor": hp.n_rot / hp.head_dim,
                            "mrope_section": list(hp.rope_sections[:3]), "mrope_interleaved": True},
    }


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specd convert-target``."""
    parser.add_argument("hf_dir", help="transformers checkpoint directory (config.json + model.safetensors)")
    parser.add_argument("out", help="output GGUF path")
    parser.add_argument("--outtype", choices=[*OUTTYPES, "auto"], default="auto",
                        help="type of 2-D weights (1-D tensors, norms and ssm_conv1d stay f32); "
                             "auto = f16 for an f16 checkpoint, else bf16 (as llama.cpp)")
    parser.add_argument("--no-mtp", action="store_true", help="drop the MTP (mtp.*) tensors")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    """Run the conversion; prints a summary, returns 0, or 1 with the error on stderr."""
    if Path(args.out).exists() and not args.force:
        print(f"specd convert-target: {args.out} exists (pass --force to replace it)", file=sys.stderr)
        return 1
    try:
        result = convert(args.hf_dir, args.out, args.outtype, mtp=not args.no_mtp)
    except (ConversionError, TargetFileError) as exc:
        print(f"specd convert-target: {exc}", file=sys.stderr)
        return 1
    hp = result.hparams
    types = ", ".join(f"{n} {k}" for k, n in sorted(result.type_counts.items()))
    print(f"wrote {result.path}: {hp.n_layer} layers ({hp.n_delta} GDN, {hp.n_full} attention)"
          f"{f' + {hp.n_nextn} MTP' if hp.n_nextn else ''}, {len(result.tensors)} tensors ({types}), "
          f"tokenizer {'yes' if result.tokenizer else 'no'}")
    return 0
