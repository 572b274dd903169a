"""Explicit translator: mainline llama.cpp ``dflash`` GGUF dialect → specd's draft GGUF (C15).

drafters.md §7.4: the other published dialect uses ``general.architecture = "dflash"``, keys under
``dflash.*`` and different tensor names. specd's loader refuses it (naming the dialect and key)
and this module translates it on request, never silently. What is *not* in such a file is never
guessed:

* ``dflash.target_layers`` — llama.cpp's ``convert_hf_to_gguf.py`` stores the HF ids **+1** (the
  layer *input* index; e.g. z-lab Qwen3.8-27B DFlash 2 dumps hold [6, 20, 34, 48, 62] for HF
  [5, 19, 33, 47, 61]). The file does not record the convention, so the caller must pass
  ``tap_offset`` (1 for llama.cpp-converted files, 0 for files already holding 0-based output ids).
* the mask id is read from ``tokenizer.ggml.mask_token_id`` (mainline) or ``dflash.mask_token_id``;
  absent → ``mask_token_id`` must be given.
* a DSpark head in this dialect does not record its slot convention → ``row_alignment`` required.

Key map (source ``dflash.<k>`` → ``qwen35-dflash-draft.<k>``): embedding_length, block_count,
feed_forward_length, attention.head_count(_kv), attention.key_length, attention.layer_norm_rms_epsilon,
rope.freq_base, context_length, vocab_size (else ``tokenizer.ggml.tokens`` length, else codebook rows,
else ``vocab_size``), block_size, target_layers − tap_offset → dflash.target_layer_ids,
attention.sliding_window(_pattern) (BOOL or 0/1 ints), attention.causal → dflash.attention.causal_pattern
(every layer; absent → causal = sliding, the ZL-0.1.0 rule), rope.scaling.{type, factor,
original_context_length, attn_factor, (yarn_)beta_fast, (yarn_)beta_slow} (ggml semantics; absent
attn_factor / betas mean ggml's 1 / 32 / 1), conv_kernel_size / conv_group_size / selector_rank /
selector_top_k → dflash.dflash2.* (DFlash 2 iff selector_top_k > 0), input_embedding_scale /
output_multiplier / final_logit_softcapping → the logit transform keys (absent → 1, 1, off, drafters.md
§2.1), markov_rank / confidence_head / confidence_head_with_markov → dflash.dspark.*.

Tensor map: ``fc.weight`` → ``dflash.fc.weight``; ``enc.output_norm.weight`` (or
``hidden_norm.weight``) → ``dflash.hidden_norm.weight``; ``blk.i.*`` backbone names unchanged
(``post_attention_norm`` → ``ffn_norm``); ``blk.i.{attn,ffn}_conv_base`` → ``blk.i.{attn,ffn}_conv.base``;
``blk.i.{attn,ffn}_conv_proj.weight`` → ``blk.i.{attn,ffn}_conv.proj.weight``;
``selector_{hidden,predecessor,successor}.weight`` → ``dflash.selector.{hproj.weight,pred_cb,succ_cb}``;
``markov_w{1,2}.weight`` → ``dflash.dspark.markov.w{1,2}``; ``conf_proj.{weight,bias}`` →
``dflash.dspark.confidence.{weight,bias}``. ``token_embd.weight`` / ``output.weight`` (target
copies) are dropped. Anything else is refused, and so is any ``dflash.*`` key outside
:data:`KNOWN_KEYS` (named in the error). Tensor bytes are copied unchanged (norms stored as
F16 are widened to F32, losslessly).
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from .contract import ARCH, MAINLINE_ARCH, MATRIX, DrafterFormatError, expected_tensors, tensor_sort_key
from .gguf_meta import GGUFMeta, write_gguf_atomic
from .hparams import DFlash2Params, DrafterHParams, DSparkParams, YarnParams

P = "dflash."

_GLOBAL = {
    "fc.weight": "dflash.fc.weight",
    "enc.output_norm.weight": "dflash.hidden_norm.weight",
    "hidden_norm.weight": "dflash.hidden_norm.weight",
    "output_norm.weight": "output_norm.weight",
    "selector_hidden.weight": "dflash.selector.hproj.weight",
    "selector_predecessor.weight": "dflash.selector.pred_cb",
    "selector_successor.weight": "dflash.selector.succ_cb",
    "markov_w1.weight": "dflash.dspark.markov.w1",
    "markov_w2.weight": "dflash.dspark.markov.w2",
    "conf_proj.weight": "dflash.dspark.confidence.weight",
    "conf_proj.bias": "dflash.dspark.confidence.bias",
}
_LAYER = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "post_attention_norm.weight": "ffn_norm.weight", "attn_q.weight": "attn_q.weight",
    "attn_k.weight": "attn_k.weight", "attn_v.weight": "attn_v.weight", "attn_output.weight": "attn_output.weight",
    "attn_q_norm.weight": "attn_q_norm.weight", "attn_k_norm.weight": "attn_k_norm.weight",
    "ffn_gate.weight": "ffn_gate.weight", "ffn_up.weight": "ffn_up.weight", "ffn_down.weight": "ffn_down.weight",
    "attn_conv_base": "attn_conv.base", "attn_conv_base.weight": "attn_conv.base",
    "ffn_conv_base": "ffn_conv.base", "ffn_conv_base.weight": "ffn_conv.base",
    "attn_conv_proj.weight": "attn_conv.proj.weight", "ffn_conv_proj.weight": "ffn_conv.proj.weight",
}
_DROPPED = ("token_embd.weight", "output.weight")

# Every ``dflash.*`` key the translator understands (drafters.md §7.4). Anything else under ``dflash.``
# is refused by name: its meaning would otherwise be guessed or silently dropped (C15).
_DF2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
KNOWN_KEYS = frozenset(P + k for k in (
    "embedding_length", "target_hidden_size", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "context_length", "vocab_size", "mask_token_id", "block_size",
    "target_layers", "attention.sliding_window", "attention.sliding_window_pattern", "attention.causal",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    "rope.scaling.beta_fast", "rope.scaling.beta_slow", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    *_DF2_KEYS, "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
    "markov_rank", "confidence_head", "confidence_head_with_markov"))
# Spellings no public source uses for the logit transforms: refused with the documented name.
_UNDOCUMENTED = {P + "embedding_scale": P + "input_embedding_scale", P + "logit_scale": P + "output_multiplier"}


def mainline_to_specd_name(name: str) -> str | None:
    """specd GGUF name for a mainline ``dflash`` tensor name, or None if it has no mapping."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def translate_mainline(src: str | os.PathLike, out: str | os.PathLike, *, tap_offset: int | None,
                       mask_token_id: int | None = None, vocab_size: int | None = None,
                       row_alignment: str | None = None, log: Callable[[str], None] = print) -> DrafterHParams:
    """Translate the mainline-dialect GGUF ``src`` into the specd draft GGUF ``out``.

    tap_offset: 1 when ``dflash.target_layers`` holds HF ids + 1 (llama.cpp converter), 0 when it
    holds 0-based output ids; required. mask_token_id / vocab_size / row_alignment: only when the
    file lacks them (a value that contradicts the file is an error). Returns the translated
    hyper-parameters. Raises DrafterFormatError naming the file and the source key.
    """
    src = str(src)
    from .gguf_loader import open_draft_gguf
    reader = open_draft_gguf(src)
    meta = GGUFMeta(reader, src)
    arch = meta.get_str("general.architecture")
    if arch != MAINLINE_ARCH:
        raise DrafterFormatError(f"{src}: general.architecture = {arch!r}; the translator reads the mainline "
                                 f"'{MAINLINE_ARCH}' dialect only")
    if tap_offset not in (0, 1):
        ids = meta.get_int_array(P + "target_layers", required=False)
        raise DrafterFormatError(
            f"{src}: dflash.target_layers = {ids}: the mainline dialect does not record whether tap ids are "
            "stored +1 (llama.cpp's convert_hf_to_gguf.py writes HF id + 1). Pass --tap-offset 1 for files made "
            "by llama.cpp's converter, or --tap-offset 0 if the ids are already 0-based layer outputs")

    # -- keys: refuse anything under dflash.* we do not know ------------------------------------------------
    for k in reader.fields:
        if k in _UNDOCUMENTED:
            raise meta.error(k, f"is not a documented key (the logit transform is {_UNDOCUMENTED[k]}, "
                             "drafters.md §2.1 / §7.4); refusing to guess its meaning")
        if k.startswith(P) and k not in KNOWN_KEYS:
            raise meta.error(k, "is not a key the mainline-dialect translator knows; refusing to run with its "
                             "meaning guessed or dropped (C15)")

    # -- tensors ----------------------------------------------------------------------------------------
    mapped: dict[str, object] = {}
    unknown, dropped = [], []
    for t in reader.tensors:
        if t.name in _DROPPED:
            dropped.append(t.name)
            continue
        g = mainline_to_specd_name(t.name)
        if g is None:
            unknown.append(t.name)
            continue
        if g in mapped:
            raise DrafterFormatError(f"{src}: tensors {mapped[g].name} and {t.name} both map to {g}")
        mapped[g] = t
    if unknown:
        raise DrafterFormatError(f"{src}: unknown tensor(s) in the mainline dialect: {', '.join(unknown[:8])}"
                                 f"{' …' if len(unknown) > 8 else ''} (refusing to guess their role)")
    if dropped:
        log(f"  dropped {', '.join(dropped)} (target copies; specd uses the target's own)")
    ne = lambda g: tuple(int(x) for x in mapped[g].shape) if g in mapped else None  # noqa: E731

    # -- keys --------------------------------------------------------------------------------------------
    n_embd = meta.get_int(P + "embedding_length")
    th = meta.get_int(P + "target_hidden_size", required=False)
    if th is not None and th != n_embd:
        raise meta.error(P + "target_hidden_size", f"= {th} differs from dflash.embedding_length = {n_embd}; "
                         "the specd contract requires the drafter width to equal the target's")
    n_layer = meta.get_int(P + "block_count")
    head_dim = meta.get_int(P + "attention.key_length")
    for k in ("attention.value_length", "rope.dimension_count"):
        v = meta.get_int(P + k, required=False)
        if v is not None and v != head_dim:
            raise meta.error(P + k, f"= {v} differs from dflash.attention.key_length = {head_dim} "
                             "(specd drafters use full-head RoPE and equal K/V head sizes)")
    theta = meta.get_float(P + "rope.freq_base", finite=False)
    if not math.isfinite(theta):
        raise meta.error(P + "rope.freq_base", f"= {theta} is not finite (NaN/inf RoPE base)")

    vocab_sources = []
    if meta.has(P + "vocab_size"):
        vocab_sources.append((P + "vocab_size", meta.get_int(P + "vocab_size")))
    if meta.has("tokenizer.ggml.tokens"):
        vocab_sources.append(("tokenizer.ggml.tokens (length)", len(reader.fields["tokenizer.ggml.tokens"].data)))
    for g in ("dflash.selector.pred_cb", "dflash.dspark.markov.w1"):
        if ne(g):
            vocab_sources.append((f"{mapped[g].name} rows", ne(g)[1]))
    if vocab_size is not None:
        vocab_sources.append(("--vocab-size", vocab_size))
    if not vocab_sources:
        raise DrafterFormatError(f"{src}: no vocabulary size (dflash.vocab_size, tokenizer.ggml.tokens and codebooks "
                                 "are absent); pass --vocab-size with the target's vocabulary size")
    for where, v in vocab_sources[1:]:
        if v != vocab_sources[0][1]:
            raise DrafterFormatError(f"{src}: {vocab_sources[0][0]} = {vocab_sources[0][1]} contradicts {where} = {v}")
    n_vocab = vocab_sources[0][1]

    mask_sources = [(k, meta.get_int(k)) for k in ("tokenizer.ggml.mask_token_id", P + "mask_token_id") if meta.has(k)]
    if mask_token_id is not None:
        mask_sources.append(("--mask-token-id", mask_token_id))
    if not mask_sources:
        raise DrafterFormatError(f"{src}: no mask token id (tokenizer.ggml.mask_token_id and dflash.mask_token_id "
                                 "are absent); pass --mask-token-id")
    for where, v in mask_sources[1:]:
        if v != mask_sources[0][1]:
            raise DrafterFormatError(f"{src}: {mask_sources[0][0]} = {mask_sources[0][1]} contradicts {where} = {v}")
    mask = mask_sources[0][1]

    raw_taps = meta.get_int_array(P + "target_layers")
    taps = tuple(i - tap_offset for i in raw_taps)
    if any(i < 0 for i in taps):
        raise meta.error(P + "target_layers", f"= {raw_taps}: subtracting --tap-offset {tap_offset} gives negative "
                         "ids, so this file does not use the +1 convention (try --tap-offset 0)")

    pattern = meta.get_bool_array(P + "attention.sliding_window_pattern", required=False, allow_int=True)
    window = meta.get_int(P + "attention.sliding_window", required=False)
    if pattern is None:
        if window:
            raise meta.error(P + "attention.sliding_window_pattern", "is absent while dflash.attention.sliding_window "
                             f"= {window}: which layers slide is not recorded")
        pattern = [False] * n_layer
    if len(pattern) != n_layer:
        raise meta.error(P + "attention.sliding_window_pattern", f"has {len(pattern)} entries for {n_layer} layers")
    if not any(pattern):
        if window:
            raise meta.error(P + "attention.sliding_window", f"= {window} but dflash.attention.sliding_window_pattern "
                             "is all false: contradictory (which layers slide?)")
        window = None
    causal_all = meta.get_bool(P + "attention.causal", required=False)
    causal = tuple(causal_all if causal_all is not None else s for s in pattern)

    yarn = None
    rtype = meta.get_str(P + "rope.scaling.type", required=False)
    if rtype not in (None, "none", "yarn"):
        raise meta.error(P + "rope.scaling.type", f"= {rtype!r}: only yarn is supported")
    if rtype == "yarn":
        # ggml's YaRN defaults (beta_fast 32, beta_slow 1, attn_factor 1.0; drafters.md §3.4) are also
        # the published values (RadixArk DSpark), so an absent key keeps them, said in the log.
        def scaling(names: tuple[str, ...], default: float) -> float:
            present = [k for k in names if meta.has(k)]
            if len(present) > 1 and len({meta.get_float(k) for k in present}) > 1:
                raise meta.error(present[0], f"= {meta.get_float(present[0])} contradicts {present[1]} = "
                                 f"{meta.get_float(present[1])}: ambiguous")
            if present:
                return meta.get_float(present[0])
            log(f"  {names[-1]} absent: using ggml's default {default:g} (the published value, drafters.md §3.4)")
            return default
        yarn = YarnParams(
            factor=meta.get_float(P + "rope.scaling.factor"),
            original_context_length=meta.get_int(P + "rope.scaling.original_context_length"),
            beta_fast=scaling((P + "rope.scaling.yarn_beta_fast", P + "rope.scaling.beta_fast"), 32.0),
            beta_slow=scaling((P + "rope.scaling.yarn_beta_slow", P + "rope.scaling.beta_slow"), 1.0),
            attn_factor=scaling((P + "rope.scaling.attn_factor",), 1.0),
        )

    family, dflash2, dspark = "dflash", None, None
    df2_keys = _DF2_KEYS
    # llama.cpp detects DFlash 2 by selector_top_k > 0 (drafters.md §7.4).
    top_k = meta.get_int(P + "selector_top_k", required=False, default=0)
    df2_tensors = [mapped[g].name for g in mapped if g.startswith("dflash.selector.") or "_conv." in g]
    if top_k > 0:
        family = "dflash2"
        dflash2 = DFlash2Params(*(meta.get_int(P + k) for k in df2_keys))
    else:
        if df2_tensors:
            raise meta.error(P + "selector_top_k", f"= {top_k if meta.has(P + 'selector_top_k') else 'absent'} "
                             f"(DFlash 1) but the file has DFlash 2 tensors ({', '.join(df2_tensors[:4])}): contradictory")
        stray = [P + k for k in df2_keys[:3] if meta.get_int(P + k, required=False, default=0)]
        if stray:
            raise meta.error(stray[0], "is set but dflash.selector_top_k is not > 0 (DFlash 1): contradictory")
    if "dflash.dspark.markov.w1" in mapped:
        if family != "dflash":
            raise DrafterFormatError(f"{src}: carries both DFlash 2 and DSpark heads")
        family = "dspark"
        if row_alignment is None:
            raise DrafterFormatError(f"{src}: a DSpark head in the mainline dialect does not record its slot convention; "
                                     "pass --row-alignment proposals_only (DeepSpec / SpecForge heads: slot 0 proposes) "
                                     "or seed_then_proposals")
        w1 = ne("dflash.dspark.markov.w1")
        rank = meta.get_int(P + "markov_rank", required=False, default=w1[0])
        cw = ne("dflash.dspark.confidence.weight")
        conf = meta.get_bool(P + "confidence_head", required=False, default=cw is not None)
        with_markov = meta.get_bool(P + "confidence_head_with_markov", required=False,
                                    default=bool(cw and cw[0] == n_embd + rank))
        log("  DSpark Markov head type not recorded in the mainline dialect: vanilla (the variant of every "
            "published Qwen DSpark head, drafters.md §5.2)")
        dspark = DSparkParams(markov_rank=rank, markov_type="vanilla", confidence=conf,
                              confidence_with_markov=with_markov and conf)
    softcap = meta.get_float(P + "final_logit_softcapping", required=False)

    hp = DrafterHParams(
        family=family, row_alignment=row_alignment or "seed_then_proposals", n_embd=n_embd, n_layer=n_layer,
        n_ff=meta.get_int(P + "feed_forward_length"), n_head=meta.get_int(P + "attention.head_count"),
        n_head_kv=meta.get_int(P + "attention.head_count_kv"), head_dim=head_dim, n_vocab=n_vocab,
        rms_eps=meta.get_float(P + "attention.layer_norm_rms_epsilon"), rope_theta=theta, yarn=yarn,
        sliding_window=window, sliding_pattern=tuple(pattern), causal_pattern=causal,
        block_size=meta.get_int(P + "block_size"), mask_token_id=mask, target_layer_ids=taps,
        n_target_layers=None, context_length=meta.get_int(P + "context_length", required=False),
        input_embedding_scale=meta.get_float(P + "input_embedding_scale", required=False, default=1.0),
        output_multiplier=meta.get_float(P + "output_multiplier", required=False, default=1.0),
        final_logit_softcapping=softcap if softcap else None, dspark=dspark, dflash2=dflash2,
    )
    names = {"n_embd": P + "embedding_length", "n_layer": P + "block_count", "n_ff": P + "feed_forward_length",
             "n_head": P + "attention.head_count", "n_head_kv": P + "attention.head_count_kv",
             "head_dim": P + "attention.key_length", "n_vocab": vocab_sources[0][0], "rms_eps":
             P + "attention.layer_norm_rms_epsilon", "rope_theta": P + "rope.freq_base",
             "block_size": P + "block_size", "mask_token_id": mask_sources[0][0],
             "target_layer_ids": f"{P}target_layers (after subtracting --tap-offset {tap_offset})",
             "sliding_window": P + "attention.sliding_window", "sliding_pattern": P + "attention.sliding_window_pattern",
             "causal_pattern": P + "attention.causal", "row_alignment": "--row-alignment",
             **{f"dflash2.{k}": P + k for k in df2_keys}}
    hp.validate(src, names)

    expected = expected_tensors(hp)
    missing = [g for g in expected if g not in mapped]
    if missing:
        raise DrafterFormatError(f"{src}: missing tensor(s) for a {family} drafter: {', '.join(missing[:8])}")
    extra = [mapped[g].name for g in mapped if g not in expected]
    if extra:
        raise DrafterFormatError(f"{src}: tensor(s) {', '.join(extra[:8])} do not belong to a {family} drafter "
                                 f"with {n_layer} layers")
    for g, spec in expected.items():
        if ne(g) != spec.ne:
            raise DrafterFormatError(f"{src}: tensor {mapped[g].name} has ne {list(ne(g))}; expected {list(spec.ne)}")
        if spec.kind != MATRIX and mapped[g].tensor_type not in (QT.F32, QT.F16):
            raise DrafterFormatError(f"{src}: tensor {mapped[g].name} is {mapped[g].tensor_type.name}; "
                                     "norms, conv base kernels and the confidence head must be F32 or F16")

    def fill(writer: gguf.GGUFWriter) -> None:
        for k in ("general.name", "general.type"):
            if meta.has(k):
                writer.add_string(k, meta.get_str(k))
        ft = meta.get_int("general.file_type", required=False)
        if ft is not None:
            writer.add_uint32("general.file_type", ft)
        qv = meta.get_int("general.quantization_version", required=False)
        if qv is not None:
            writer.add_quantization_version(qv)
        hp.write_gguf_kv(writer, ARCH)
        writer.add_string(f"{ARCH}.source.dialect", MAINLINE_ARCH)
        writer.add_uint32(f"{ARCH}.source.tap_offset", tap_offset)
        for g in sorted(expected, key=tensor_sort_key):
            t = mapped[g]
            data = np.asarray(t.data)
            if expected[g].kind != MATRIX:
                writer.add_tensor(g, np.ascontiguousarray(data.view(np.float16 if t.tensor_type == QT.F16 else np.float32),
                                                          dtype=np.float32))
            elif t.tensor_type == QT.F32:
                writer.add_tensor(g, data.view(np.float32))
            elif t.tensor_type == QT.F16:
                writer.add_tensor(g, data.view(np.float16))
            else:
                writer.add_tensor(g, data.view(np.uint8), raw_dtype=t.tensor_type)

    write_gguf_atomic(out, ARCH, fill)
    log(f"  {hp.summary()}")
    log(f"  taps {raw_taps} (file) -> {list(taps)} (0-based outputs, --tap-offset {tap_offset}); "
        f"wrote {out} ({Path(out).stat().st_size:,} bytes)")
    return hp
