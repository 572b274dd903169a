"""Read an HF drafter checkpoint's raw ``config.json`` together with its tensor shapes and build the
drafter's :class:`DrafterHParams` (drafters.md §2.1 lookups, §7.3 "DB DSpark converter" rules).

Raw JSON is read on purpose (not through ``Qwen3Config``): transformers hoists / renames keys
differently across versions. Its semantics are kept where the reference (dflash 0.1.0 on
``Qwen3Config``) depends on them: ``sliding_window`` only counts when ``use_sliding_window`` is true.

Lookup rules (first present wins; two present and different → error naming both):

* family: ``architectures`` (DFlashDraftModel / DFlash2DraftModel / DSparkDraftModel /
  Qwen3DSparkModel) or ``dflash_config.projector_type == "dspark"``; absent → inferred from the
  tensor set and reported.
* block size: ``dflash_config.block_size``, ``block_size``, ``draft_block_size``, ``dspark_block_size``.
* mask id: ``dflash_config.mask_token_id``, ``mask_token_id``, ``dspark_noise_token_id``.
* taps: ``dflash_config.target_layer_ids``, ``target_layer_ids``, ``aux_hidden_state_layer_ids``,
  ``dspark_target_layer_ids`` — required (C16: no spread-formula fallback).
* θ: ``rope_parameters.rope_theta``, then ``rope_theta`` — required (C18b), finite (C18c).
* RoPE scaling: ``rope_parameters.rope_type`` / ``rope_scaling.{rope_type,type}``: default or yarn.
* layers: ``layer_types``, ``sliding_window``, ``use_sliding_window``, top-level ``is_causal``.
  ``sliding_attention`` layers are causal (unless ``is_causal`` says otherwise) and windowed only
  when ``use_sliding_window`` is true (absent/false: no window, as transformers / dflash; noted).
* documented published defaults, used when the key is absent and stated in the log:
  ``hidden_act`` silu, ``markov_head_type`` vanilla, YaRN β_fast 32 / β_slow 1 / attention factor
  0.1·ln(factor) + 1.
* shapes: config keys cross-checked against the tensors; a key the packaging omits is taken from
  the tensors (drafters.md §2.4) and reported.
* ignored on purpose (drafters.md §3.4): ``partial_rotary_factor`` and mrope fields (deep-copied
  target noise in DeepSpec configs).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import HF_LAYER_SUFFIXES, HF_TARGET_COPIES, DrafterFormatError, expected_tensors, hf_to_gguf_name
from .hparams import DFlash2Params, DrafterHParams, DSparkParams, YarnParams, f32, yarn_mscale
from .safetensors_io import StTensor

_ABSENT = object()

ARCHITECTURE_FAMILIES = {
    "DFlashDraftModel": "dflash",
    "DFlash2DraftModel": "dflash2",
    "DSparkDraftModel": "dspark",
    "Qwen3DSparkModel": "dspark",
}

LOOKUPS = {
    "block_size": ("dflash_config.block_size", "block_size", "draft_block_size", "dspark_block_size"),
    "mask_token_id": ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id"),
    "target_layer_ids": ("dflash_config.target_layer_ids", "target_layer_ids", "aux_hidden_state_layer_ids",
                         "dspark_target_layer_ids"),
    "n_target_layers": ("num_target_layers", "n_target_layers"),
    "markov_rank": ("dflash_config.markov_rank", "markov_rank", "dspark_markov_rank"),
    "markov_head_type": ("dflash_config.markov_head_type", "markov_head_type"),
    "enable_confidence_head": ("dflash_config.enable_confidence_head", "enable_confidence_head"),
    "confidence_head_with_markov": ("dflash_config.confidence_head_with_markov", "confidence_head_with_markov"),
    "conv_kernel_size": ("dflash_config.conv_kernel_size", "conv_kernel_size"),
    "conv_group_size": ("dflash_config.conv_group_size", "conv_group_size"),
    "selector_rank": ("dflash_config.selector_rank", "selector_rank"),
    "selector_top_k": ("dflash_config.selector_top_k", "selector_top_k"),
    "input_embedding_scale": ("dflash_config.input_embedding_scale", "input_embedding_scale"),
    "output_multiplier": ("dflash_config.output_multiplier", "output_multiplier"),
    "final_logit_softcapping": ("dflash_config.final_logit_softcapping", "final_logit_softcapping"),
    "sample_from_anchor": ("dflash_config.sample_from_anchor", "sample_from_anchor"),
}


@dataclass
class HFDrafter:
    """Result of reading an HF drafter: hyper-parameters, the GGUF ← HF tensor name map, HF
    tensors dropped on purpose (DeepSpec target copies), human-readable notes on where each key
    came from, and the raw config (provenance)."""

    hparams: DrafterHParams
    gguf_to_hf: dict[str, str]
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)


class _Config:
    """Dotted-path lookups over a raw config dict with provenance and contradiction checks."""

    def __init__(self, cfg: dict, path: Path):
        self.cfg, self.path = cfg, str(path)

    def raw(self, dotted: str) -> Any:
        cur: Any = self.cfg
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur or cur[part] is None:
                return _ABSENT
            cur = cur[part]
        return cur

    def err(self, msg: str) -> DrafterFormatError:
        return DrafterFormatError(f"{self.path}: {msg}")

    def first(self, what: str, candidates: tuple[str, ...] | None = None, required: bool = True,
              kind: type | tuple = int) -> tuple[Any, str | None]:
        """(value, key it came from) of the first candidate present; (None, None) when absent and
        not required. Two candidates present with different values → error."""
        candidates = candidates or LOOKUPS.get(what, (what,))
        found = [(c, v) for c in candidates if (v := self.raw(c)) is not _ABSENT]
        if not found:
            if required:
                raise self.err(f"{what} is missing: looked for {', '.join(candidates)}")
            return None, None
        c0, v0 = found[0]
        for c, v in found[1:]:
            if v != v0:
                raise self.err(f"{c0} = {v0!r} contradicts {c} = {v!r}")
        self.check_type(c0, v0, kind)
        return v0, c0

    def check_type(self, where: str, v: Any, kind: type | tuple) -> None:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = False
        for k in kinds:
            if k is int:
                ok |= isinstance(v, int) and not isinstance(v, bool)
            elif k is float:
                ok |= isinstance(v, (int, float)) and not isinstance(v, bool)
            elif k is list:
                ok |= isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            else:
                ok |= isinstance(v, k)
        if not ok:
            raise self.err(f"{where} = {v!r} has the wrong type (expected {'/'.join(k.__name__ for k in kinds)})")


def _shape(tensors: dict[str, StTensor], name: str) -> tuple[int, ...] | None:
    t = tensors.get(name)
    return t.shape if t is not None else None


def read_hf_drafter(config_path: str | Path, tensors: dict[str, StTensor]) -> HFDrafter:
    """Build the drafter description from ``config.json`` and the checkpoint's tensor table.

    Raises DrafterFormatError (naming ``config.json`` and the key, or the tensor) for: a missing
    required key (taps C16, θ C18b, mask id, block size, ε, vocabulary), NaN/inf θ (C18c), keys
    that contradict each other or the tensor shapes, unsupported variants (speculators packaging,
    gated/rnn Markov heads, attention bias, non-SiLU MLP, RoPE types other than default/yarn,
    per-layer RoPE), unknown tensors, and missing tensors.
    """
    config_path = Path(config_path)
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DrafterFormatError(f"{config_path}: cannot read config: {exc}") from exc
    if not isinstance(raw, dict):
        raise DrafterFormatError(f"{config_path}: not a JSON object")
    c = _Config(raw, config_path)
    notes: list[str] = []

    if "speculators_config" in raw or "transformer_layer_config" in raw:
        raise c.err("vLLM speculators packaging (speculators_config / transformer_layer_config) is not "
                    "supported by convert-drafter; convert a DeepSpec or SpecForge packaging instead")
    if raw.get("attention_bias"):
        raise c.err("attention_bias = true is not supported (the draft GGUF contract has no attention biases)")
    act = raw.get("hidden_act")
    if act is None:
        act = "silu"
        notes.append("hidden_act absent: silu (Qwen3Config's default and the SwiGLU MLP every published "
                     "drafter uses, drafters.md §2.3 / §3.2)")
    if act != "silu":
        raise c.err(f"hidden_act = {act!r}: only the SiLU (SwiGLU) MLP is supported")

    # -- tensor names ---------------------------------------------------------------------------------
    gguf_to_hf: dict[str, str] = {}
    dropped: list[str] = []
    unknown: list[str] = []
    for name in sorted(tensors):
        g = hf_to_gguf_name(name)
        if g is None:
            if name in HF_TARGET_COPIES:
                dropped.append(name)
            else:
                unknown.append(name)
            continue
        if g in gguf_to_hf:
            raise DrafterFormatError(f"{tensors[name].file}: tensors {gguf_to_hf[g]!r} and {name!r} both map to {g!r}")
        gguf_to_hf[g] = name
    if unknown:
        raise DrafterFormatError(
            f"{tensors[unknown[0]].file}: unknown tensor(s) not in the DFlash / DSpark / DFlash 2 layouts: "
            f"{', '.join(unknown[:8])}{' …' if len(unknown) > 8 else ''} (refusing to guess their role)")
    if dropped:
        notes.append(f"dropped {', '.join(dropped)}: DeepSpec copies of the target's embedding/head; "
                     "specd uses the target's own tensors")
    shape_of = lambda g: _shape(tensors, gguf_to_hf[g]) if g in gguf_to_hf else None  # noqa: E731

    # -- family ----------------------------------------------------------------------------------------
    has_conv = any(g.startswith("blk.") and "_conv." in g for g in gguf_to_hf)
    has_selector = any(g.startswith("dflash.selector.") for g in gguf_to_hf)
    has_markov = any(g.startswith("dflash.dspark.") for g in gguf_to_hf)
    archs = raw.get("architectures")
    fam_from_arch = None
    if archs is not None:
        if not isinstance(archs, list):
            raise c.err(f"architectures = {archs!r}: expected a list")
        fams = {ARCHITECTURE_FAMILIES[a] for a in archs if a in ARCHITECTURE_FAMILIES}
        if len(fams) > 1:
            raise c.err(f"architectures = {archs} names several drafter families")
        if not fams:
            raise c.err(f"architectures = {archs}: not a drafter (expected one of {sorted(ARCHITECTURE_FAMILIES)})")
        fam_from_arch = fams.pop()
    if c.raw("dflash_config.projector_type") == "dspark":
        if fam_from_arch not in (None, "dspark"):
            raise c.err(f"dflash_config.projector_type = 'dspark' contradicts architectures = {archs}")
        fam_from_arch = "dspark"
    if fam_from_arch is None:
        family = "dflash2" if (has_conv or has_selector) else "dspark" if has_markov else "dflash"
        notes.append(f"family = {family} (no architectures in config; inferred from the tensor set)")
    else:
        family = fam_from_arch
        if family != "dflash2" and (has_conv or has_selector):
            raise c.err(f"architectures = {archs} (family {family}) but the checkpoint has DFlash 2 conv/selector tensors")
        if family != "dspark" and has_markov:
            raise c.err(f"architectures = {archs} (family {family}) but the checkpoint has DSpark head tensors")

    # -- shapes: config keys cross-checked with the tensors ----------------------------------------------
    def dim(cfg_key: str, from_tensor: int | None, tensor_desc: str) -> int:
        v, where = c.first(cfg_key, (cfg_key,), required=from_tensor is None)
        if v is None:
            notes.append(f"{cfg_key} = {from_tensor} (absent from config; from {tensor_desc})")
            return from_tensor
        if from_tensor is not None and v != from_tensor:
            raise c.err(f"{where} = {v} contradicts the checkpoint: {tensor_desc} gives {from_tensor}")
        return v

    layer_ids = sorted({int(m.group(1)) for g in gguf_to_hf if (m := re.match(r"blk\.(\d+)\.", g))})
    if layer_ids and layer_ids != list(range(len(layer_ids))):
        raise DrafterFormatError(f"{config_path.parent}: decoder layer indices {layer_ids} are not 0..n-1")
    norm = shape_of("output_norm.weight") or shape_of("dflash.hidden_norm.weight")
    H = dim("hidden_size", norm[0] if norm else None, "norm.weight")
    n_layer = dim("num_hidden_layers", len(layer_ids) or None, "the layers.* tensor names")
    qn = shape_of("blk.0.attn_q_norm.weight")
    head_dim = dim("head_dim", qn[0] if qn else None, "layers.0.self_attn.q_norm.weight")
    qp, kp = shape_of("blk.0.attn_q.weight"), shape_of("blk.0.attn_k.weight")
    n_head = dim("num_attention_heads", qp[0] // head_dim if qp and qp[0] % head_dim == 0 else None,
                 "layers.0.self_attn.q_proj.weight rows / head_dim")
    n_head_kv = dim("num_key_value_heads", kp[0] // head_dim if kp and kp[0] % head_dim == 0 else None,
                    "layers.0.self_attn.k_proj.weight rows / head_dim")
    gp = shape_of("blk.0.ffn_gate.weight")
    n_ff = dim("intermediate_size", gp[0] if gp else None, "layers.0.mlp.gate_proj.weight rows")
    vocab_tensor = (shape_of("dflash.dspark.markov.w1") or shape_of("dflash.selector.pred_cb") or (None,))[0]
    n_vocab = dim("vocab_size", vocab_tensor, "the Markov head / selector codebook rows")
    eps, eps_where = c.first("rms_norm_eps", ("rms_norm_eps",), kind=float)
    context_length, _ = c.first("max_position_embeddings", ("max_position_embeddings",), required=False)

    # -- drafter keys -----------------------------------------------------------------------------------
    block_size, bs_where = c.first("block_size")
    notes.append(f"block_size = {block_size} (from {bs_where})")
    mask, mask_where = c.first("mask_token_id")
    taps, taps_where = c.first("target_layer_ids", kind=list)
    if taps_where is None or not taps:
        raise c.err("target_layer_ids is empty")
    n_target_layers, _ = c.first("n_target_layers", required=False)
    fc = shape_of("dflash.fc.weight")
    if fc is not None and fc[1] != len(taps) * H:
        raise c.err(f"{taps_where} lists {len(taps)} taps but fc.weight has {fc[1]} inputs "
                    f"(= {fc[1] / H:g} × hidden size {H})")

    theta, yarn, rope_names = _read_rope(c, context_length, head_dim, notes)

    sliding, window, causal, layer_names = _read_layers(c, n_layer)
    if window is None and any(t == "sliding_attention" for t in (raw.get("layer_types") or [])):
        notes.append("sliding_attention layers get no window: use_sliding_window is not true, so "
                     "transformers' Qwen3Config (and dflash) drop sliding_window; those layers stay causal")

    def scale(what: str, default: float | None) -> float | None:
        v, _ = c.first(what, required=False, kind=float)
        if v is None:
            return default
        if not math.isfinite(v):
            raise c.err(f"{what} = {v} is not finite")
        return float(v)

    in_scale = scale("input_embedding_scale", 1.0)
    out_mult = scale("output_multiplier", 1.0)
    softcap = scale("final_logit_softcapping", None)
    if softcap is not None and softcap <= 0:
        softcap = None  # ZL-0.1.0: a cap <= 0 means "off"

    # -- family heads -----------------------------------------------------------------------------------
    dspark = dflash2 = None
    row_alignment = "seed_then_proposals"
    if family == "dspark":
        w1 = shape_of("dflash.dspark.markov.w1")
        rank_cfg, rank_where = c.first("markov_rank", required=False)
        if w1 is None and rank_cfg is None:
            raise DrafterFormatError(f"{config_path.parent}: missing DSpark head tensors markov_head.markov_w1.weight / "
                                     "markov_w2.weight (and no markov_rank in config)")
        rank = rank_cfg if rank_cfg is not None else w1[1]
        if w1 is not None and rank_cfg is not None and w1[1] != rank_cfg:
            raise c.err(f"{rank_where} = {rank_cfg} contradicts markov_head.markov_w1.weight {list(w1)}")
        mtype, _ = c.first("markov_head_type", required=False, kind=str)
        if mtype is None:
            mtype = "vanilla"
            notes.append("markov_head_type absent: vanilla (the variant of every published Qwen DSpark head; "
                         "RadixArk's config omits the key, drafters.md §5.2 / §5.6)")
        conf_w = shape_of("dflash.dspark.confidence.weight")
        conf_cfg, conf_where = c.first("enable_confidence_head", required=False, kind=bool)
        conf = conf_w is not None if conf_cfg is None else conf_cfg
        if conf_cfg is True and conf_w is None:
            raise DrafterFormatError(f"{config_path.parent}: missing DSpark head tensor confidence_head.proj.weight "
                                     f"({conf_where} = true)")
        if conf_cfg is False and conf_w is not None:
            raise c.err(f"{conf_where} = false but the checkpoint has a confidence head")
        with_markov_cfg, wm_where = c.first("confidence_head_with_markov", required=False, kind=bool)
        with_markov = bool(with_markov_cfg)
        if conf_w is not None:
            from_shape = conf_w[1] == H + rank
            if conf_w[1] not in (H, H + rank):
                raise DrafterFormatError(f"{config_path.parent}: confidence_head.proj.weight {list(conf_w)} has neither "
                                         f"H = {H} nor H + markov_rank = {H + rank} inputs")
            if with_markov_cfg is not None and with_markov_cfg != from_shape:
                raise c.err(f"{wm_where} = {with_markov_cfg} contradicts confidence_head.proj.weight {list(conf_w)}")
            with_markov = from_shape
        dspark = DSparkParams(markov_rank=int(rank), markov_type=str(mtype).lower(),
                              confidence=bool(conf), confidence_with_markov=with_markov)
        anchor, anchor_where = c.first("sample_from_anchor", required=False, kind=bool)
        row_alignment = "proposals_only" if anchor in (None, True) else "seed_then_proposals"
        notes.append(f"row_alignment = {row_alignment} ("
                     + (f"{anchor_where} = {anchor}" if anchor_where else "DeepSpec / SpecForge DSpark: slot 0 proposes")
                     + ")")
    elif family == "dflash2":
        base = shape_of("blk.0.attn_conv.base")
        proj = shape_of("blk.0.attn_conv.proj.weight")
        hproj = shape_of("dflash.selector.hproj.weight")
        ks, ks_where = c.first("conv_kernel_size", required=base is None)
        ks = ks if ks is not None else base[1]
        if base is not None and base[1] != ks:
            raise c.err(f"{ks_where} = {ks} contradicts layers.0.attention_conv.base_kernel {list(base)}")
        group_from_shape = None
        if proj is not None and proj[0] % (2 * ks) == 0 and proj[0] // (2 * ks) > 0 and H % (proj[0] // (2 * ks)) == 0:
            group_from_shape = H // (proj[0] // (2 * ks))
        gs, gs_where = c.first("conv_group_size", required=group_from_shape is None)
        gs = gs if gs is not None else group_from_shape
        if group_from_shape is not None and gs != group_from_shape:
            raise c.err(f"{gs_where} = {gs} contradicts layers.0.attention_conv.kernel_projection.weight {list(proj)}")
        rank, rank_where = c.first("selector_rank", required=hproj is None)
        rank = rank if rank is not None else hproj[0]
        if hproj is not None and hproj[0] != rank:
            raise c.err(f"{rank_where} = {rank} contradicts candidate_selector.hidden_projection.weight {list(hproj)}")
        top_k, _ = c.first("selector_top_k")
        dflash2 = DFlash2Params(conv_kernel_size=int(ks), conv_group_size=int(gs),
                                selector_rank=int(rank), selector_top_k=int(top_k))

    hp = DrafterHParams(
        family=family, row_alignment=row_alignment, n_embd=H, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_vocab=n_vocab, rms_eps=f32(eps), rope_theta=f32(theta),
        yarn=yarn, sliding_window=window, sliding_pattern=sliding, causal_pattern=causal,
        block_size=block_size, mask_token_id=mask, target_layer_ids=tuple(taps),
        n_target_layers=n_target_layers, context_length=context_length, input_embedding_scale=f32(in_scale),
        output_multiplier=f32(out_mult), final_logit_softcapping=None if softcap is None else f32(softcap), dspark=dspark, dflash2=dflash2,
    )
    names = {
        "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_ff": "intermediate_size",
        "n_head": "num_attention_heads", "n_head_kv": "num_key_value_heads", "head_dim": "head_dim",
        "n_vocab": "vocab_size", "rms_eps": eps_where, "block_size": bs_where, "mask_token_id": mask_where,
        "target_layer_ids": taps_where, "n_target_layers": "num_target_layers",
        "family": "architectures", "row_alignment": "dflash_config.sample_from_anchor",
        "dspark.markov_rank": "markov_rank", "dspark.markov_type": "markov_head_type",
        "dspark.confidence_with_markov": "confidence_head_with_markov",
        "dflash2.conv_kernel_size": "dflash_config.conv_kernel_size",
        "dflash2.conv_group_size": "dflash_config.conv_group_size",
        "dflash2.selector_rank": "dflash_config.selector_rank",
        "dflash2.selector_top_k": "dflash_config.selector_top_k",
        **rope_names, **layer_names,
    }
    hp.validate(str(config_path), names)

    # -- tensor set and shapes against the contract -------------------------------------------------------
    expected = expected_tensors(hp)
    missing = [g for g in expected if g not in gguf_to_hf]
    if missing:
        raise DrafterFormatError(
            f"{config_path.parent}: missing tensor(s) for a {family} drafter with this config: "
            + ", ".join(f"{g} (HF {_hf_name_hint(g)})" for g in missing[:8]) + (" …" if len(missing) > 8 else ""))
    extra = [gguf_to_hf[g] for g in gguf_to_hf if g not in expected]
    if extra:
        raise DrafterFormatError(f"{config_path.parent}: tensor(s) {', '.join(extra[:8])} do not belong to a {family} "
                                 f"drafter with {n_layer} layers and this config")
    for g, spec in expected.items():
        got = tuple(reversed(tensors[gguf_to_hf[g]].shape))
        if got != spec.ne:
            raise DrafterFormatError(
                f"{tensors[gguf_to_hf[g]].file}: tensor {gguf_to_hf[g]} has shape {list(tensors[gguf_to_hf[g]].shape)}; "
                f"the config implies {list(reversed(spec.ne))}")
    return HFDrafter(hparams=hp, gguf_to_hf=gguf_to_hf, dropped=dropped, notes=notes, config=raw)


def _hf_name_hint(g: str) -> str:
    inverse = {
        "dflash.fc.weight": "fc.weight", "dflash.hidden_norm.weight": "hidden_norm.weight",
        "output_norm.weight": "norm.weight", "dflash.dspark.markov.w1": "markov_head.markov_w1.weight",
        "dflash.dspark.markov.w2": "markov_head.markov_w2.weight",
        "dflash.dspark.confidence.weight": "confidence_head.proj.weight",
        "dflash.dspark.confidence.bias": "confidence_head.proj.bias",
        "dflash.selector.hproj.weight": "candidate_selector.hidden_projection.weight",
        "dflash.selector.pred_cb": "candidate_selector.predecessor_codebook",
        "dflash.selector.succ_cb": "candidate_selector.successor_codebook",
    }
    if g in inverse:
        return inverse[g]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", g)
    if m:
        for hf_suffix, g_suffix in HF_LAYER_SUFFIXES.items():
            if g_suffix == m.group(2):
                return f"layers.{m.group(1)}.{hf_suffix}"
    return g


def _read_rope(c: _Config, context_length: int | None, head_dim: int, notes: list[str]) -> tuple[float, YarnParams | None, dict]:
    """θ and YaRN from ``rope_parameters`` (transformers ≥ 5) or top-level ``rope_theta`` /
    ``rope_scaling``. Returns (θ, YarnParams | None, field → key names for messages)."""
    rp = c.raw("rope_parameters")
    if rp is not _ABSENT:
        if not isinstance(rp, dict):
            raise c.err(f"rope_parameters = {rp!r}: expected an object")
        if rp and all(isinstance(v, dict) for v in rp.values()):  # per-layer-type RoPE
            vals = list(rp.values())
            if any(v != vals[0] for v in vals[1:]):
                raise c.err(f"rope_parameters differs per layer type ({sorted(rp)}); per-layer RoPE is not supported")
            rp = vals[0]
            prefix = f"rope_parameters.{next(iter(c.raw('rope_parameters')))}"
        else:
            prefix = "rope_parameters"
    else:
        rp, prefix = {}, "rope_parameters"

    nested = rp.get("rope_theta")
    top = c.raw("rope_theta")
    candidates = []
    if nested is not None:
        candidates.append((f"{prefix}.rope_theta", nested))
    if top is not _ABSENT:
        candidates.append(("rope_theta", top))
    if not candidates:
        raise c.err("RoPE base θ is missing: looked for rope_parameters.rope_theta and rope_theta "
                    "(specd never assumes a default θ)")
    where, theta = candidates[0]
    for w, v in candidates:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise c.err(f"{w} = {v!r}: expected a number")
        if not math.isfinite(float(v)):
            raise c.err(f"{w} = {v} is not finite (NaN/inf RoPE base)")
    if len(candidates) == 2 and float(candidates[0][1]) != float(candidates[1][1]):
        raise c.err(f"{candidates[0][0]} = {candidates[0][1]} contradicts {candidates[1][0]} = {candidates[1][1]}")
    theta = float(theta)

    # scaling: rope_parameters.rope_type (or .type), then legacy rope_scaling
    scaling_sources = []
    rtype = rp.get("rope_type", rp.get("type"))
    if rtype is not None:
        scaling_sources.append((prefix, rp, str(rtype)))
    rs = c.raw("rope_scaling")
    if rs is not _ABSENT:
        if not isinstance(rs, dict):
            raise c.err(f"rope_scaling = {rs!r}: expected an object")
        st = rs.get("rope_type", rs.get("type"))
        if st is not None:
            scaling_sources.append(("rope_scaling", rs, str(st)))
    kinds = {s[2] if s[2] != "none" else "default" for s in scaling_sources}
    if len(kinds) > 1:
        raise c.err(f"{scaling_sources[0][0]} type {scaling_sources[0][2]!r} contradicts "
                    f"{scaling_sources[1][0]} type {scaling_sources[1][2]!r}")
    names = {"rope_theta": where}
    kind = kinds.pop() if kinds else "default"
    if kind == "default":
        return theta, None, names
    if kind != "yarn":
        raise c.err(f"RoPE scaling type {kind!r} is not supported for drafters (only default and yarn)")
    src_name, src, _ = next(s for s in scaling_sources if s[2] == "yarn")

    def num(k: str, required: bool, default: float | None = None) -> float | None:
        v = src.get(k)
        if v is None:
            if required:
                raise c.err(f"{src_name}.{k} is missing (needed for YaRN)")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise c.err(f"{src_name}.{k} = {v!r}: expected a finite number")
        return float(v)

    orig = src.get("original_max_position_embeddings", c.raw("original_max_position_embeddings"))
    if orig is _ABSENT or orig is None:
        raise c.err(f"{src_name}.original_max_position_embeddings is missing (needed for YaRN)")
    if (isinstance(orig, bool) or not isinstance(orig, (int, float)) or not math.isfinite(orig)
            or orig != int(orig) or orig <= 0):
        raise c.err(f"{src_name}.original_max_position_embeddings = {orig!r}: expected a positive integer")
    factor = num("factor", required=False)
    if factor is None:  # transformers: factor = max_position_embeddings / original
        if not context_length:
            raise c.err(f"{src_name}.factor is missing and max_position_embeddings is absent")
        factor = context_length / orig
        notes.append(f"{src_name}.factor absent: {factor:g} = max_position_embeddings / original (transformers' rule)")
    if src.get("truncate", True) is not True:
        raise c.err(f"{src_name}.truncate = false is not supported (ggml YaRN truncates the correction range)")
    attention = num("attention_factor", required=False)
    if attention is None:
        ms, msa = src.get("mscale"), src.get("mscale_all_dim")
        if ms and msa:  # transformers: ratio of the two mscale terms
            f = lambda s, m: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
            attention = f(factor, ms) / f(factor, msa)
        else:
            attention = yarn_mscale(factor)
            notes.append(f"{src_name}.attention_factor absent: 0.1·ln(factor) + 1 = {attention:.6g} "
                         "(transformers' YaRN default, drafters.md §3.4)")
    betas = {}
    for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        betas[k] = num(k, False)
        if betas[k] is None:
            betas[k] = d
            notes.append(f"{src_name}.{k} absent: {d:g} (transformers' YaRN default and the published RadixArk "
                         "value, drafters.md §3.4)")
    yarn = YarnParams(
        factor=f32(factor),
        original_context_length=int(orig),
        beta_fast=f32(betas["beta_fast"]),
        beta_slow=f32(betas["beta_slow"]),
        attn_factor=f32(attention / yarn_mscale(factor)),
    )
    names.update({f"yarn.{k}": f"{src_name}.{v}" for k, v in (
        ("factor", "factor"), ("original_context_length", "original_max_position_embeddings"),
        ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("attn_factor", "attention_factor"))})
    return theta, yarn, names


def _read_layers(c: _Config, n_layer: int) -> tuple[tuple[bool, ...], int | None, tuple[bool, ...], dict]:
    """(sliding pattern, window, causal pattern, names) from ``layer_types``, ``sliding_window``,
    ``use_sliding_window`` and ``is_causal`` (drafters.md §3.3, ZL-0.1.0 rule: causal =
    ``is_causal`` if present else the layer type is sliding_attention). The returned sliding
    pattern means "uses the window": all false unless ``use_sliding_window`` is true."""
    lt = c.raw("layer_types")
    use_sw = c.raw("use_sliding_window")
    if use_sw is not _ABSENT and not isinstance(use_sw, bool):
        raise c.err(f"use_sliding_window = {use_sw!r}: expected a bool")
    if lt is _ABSENT:
        if use_sw is True:
            mwl, _ = c.first("max_window_layers", ("max_window_layers",))
            sliding = tuple(i >= mwl for i in range(n_layer))  # Qwen3Config's rule without layer_types
        else:
            sliding = (False,) * n_layer
    else:
        if not isinstance(lt, list) or len(lt) != n_layer:
            raise c.err(f"layer_types = {lt!r}: expected {n_layer} entries (num_hidden_layers)")
        bad = sorted({t for t in lt if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise c.err(f"layer_types has unsupported entries {bad} (expected full_attention / sliding_attention)")
        sliding = tuple(t == "sliding_attention" for t in lt)
    # transformers' Qwen3Config keeps ``sliding_window`` only when ``use_sliding_window`` is true
    # (default false), and dflash 0.1.0 reads ``config.sliding_window``: a sliding_attention layer
    # without the flag is causal (its layer type) but has no window. Follow that exactly.
    slides = sliding
    window = None
    if any(sliding) and use_sw is True:
        w, _ = c.first("sliding_window", ("sliding_window",))
        if w <= 0:
            raise c.err(f"sliding_window = {w}: expected > 0")
        window = int(w)
    else:
        sliding = (False,) * n_layer
    ic = c.raw("is_causal")
    if ic is not _ABSENT and not isinstance(ic, bool):
        raise c.err(f"is_causal = {ic!r}: expected a bool")
    causal = tuple(bool(ic) if ic is not _ABSENT else s for s in slides)
    names = {"sliding_pattern": "layer_types", "sliding_window": "sliding_window", "causal_pattern": "is_causal"}
    return sliding, window, causal, names
