"""Load a draft GGUF (drafters.md §7): typed hyper-parameters plus zero-copy weight views.

Weights are :class:`specd.native.Tensor` views over the ``gguf.GGUFReader`` memory map (no copy):
F32 / F16 tensors are numpy-typed views, block formats (Q8_0, K-quants, IQ4_XS) and BF16 are raw
uint8 rows tagged with their DType. Shapes are numpy order, i.e. (out, in) for a projection whose
ggml ``ne`` is [in, out]; 1-D norms are (n,); conv base kernels (2, taps, H).

Everything that decides drafting — mask id, taps, block size, RoPE/YaRN, sliding and causal
patterns, family, row alignment — is read from the file; a missing or contradictory key raises
:class:`DrafterFormatError` naming the file and the key (never a silent default). A GGUF in the
mainline llama.cpp ``dflash`` dialect (C15) is refused with the dialect, the key and the translation
command (``specd convert-drafter SRC.gguf OUT.gguf --tap-offset 1``).

:func:`check_pair` matches a drafter to a target (hidden size, vocabulary, mask id, tap ids).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from specd.native import DType, Tensor

from .contract import (
    ARCH, DB_ARCH, F32_ONLY, MAINLINE_ARCH, NORM, DrafterFormatError, DrafterPairError, K,
    canonical_gguf_name, expected_tensors, key,
)
from .gguf_meta import GGUFMeta
from .hparams import DFlash2Params, DrafterHParams, DSparkParams, YarnParams

__all__ = [
    "DrafterHParams", "YarnParams", "DSparkParams", "DFlash2Params", "DrafterLayerWeights",
    "DSparkHeadWeights", "SelectorWeights", "DrafterWeights", "LoadedDrafter", "TargetHParamsLike",
    "DrafterFormatError", "DrafterPairError", "read_drafter_hparams", "load_drafter", "check_pair",
]

_MATRIX_TYPES = {QT.F32: DType.F32, QT.F16: DType.F16, QT.BF16: DType.BF16, QT.Q8_0: DType.Q8_0,
                 QT.Q4_K: DType.Q4_K, QT.Q5_K: DType.Q5_K, QT.Q6_K: DType.Q6_K, QT.IQ4_XS: DType.IQ4_XS}


@dataclass(frozen=True)
class DrafterLayerWeights:
    """One decoder layer. Norms F32 (H,) / (head_dim,); projections (out, in): attn_q (Hq·hd, H),
    attn_k / attn_v (Hkv·hd, H), attn_output (H, Hq·hd), ffn_gate / ffn_up (n_ff, H),
    ffn_down (H, n_ff). DFlash 2 only: conv base kernels F32 (2, taps, H) [side, tap, channel] and
    kernel projections (2·taps·G, H); None otherwise."""

    attn_norm: Tensor
    ffn_norm: Tensor
    attn_q: Tensor
    attn_k: Tensor
    attn_v: Tensor
    attn_output: Tensor
    attn_q_norm: Tensor
    attn_k_norm: Tensor
    ffn_gate: Tensor
    ffn_up: Tensor
    ffn_down: Tensor
    attn_conv_base: Tensor | None = None
    attn_conv_proj: Tensor | None = None
    ffn_conv_base: Tensor | None = None
    ffn_conv_proj: Tensor | None = None


@dataclass(frozen=True)
class DSparkHeadWeights:
    """DSpark heads: markov_w1, markov_w2 (V, r) (W1 gathered by previous token; W2 as a Linear
    r → V); confidence_weight (1, d_in) and confidence_bias (1,) F32, or None without the head."""

    markov_w1: Tensor
    markov_w2: Tensor
    confidence_weight: Tensor | None
    confidence_bias: Tensor | None


@dataclass(frozen=True)
class SelectorWeights:
    """DFlash 2 candidate selector: hproj (R, H); pred_cb, succ_cb (V, R) gathered by token id."""

    hproj: Tensor
    pred_cb: Tensor
    succ_cb: Tensor


@dataclass(frozen=True)
class DrafterWeights:
    """All drafter weights: fc (H, N·H), hidden_norm (H,), output_norm (H,), layers, family heads."""

    fc: Tensor
    hidden_norm: Tensor
    output_norm: Tensor
    layers: tuple[DrafterLayerWeights, ...]
    dspark: DSparkHeadWeights | None
    selector: SelectorWeights | None


@dataclass(frozen=True)
class LoadedDrafter:
    """A loaded draft GGUF: path, hyper-parameters, weights, and the reader whose memory map the
    weight views point into (kept alive with this object)."""

    path: str
    hparams: DrafterHParams
    weights: DrafterWeights
    tensors: dict[str, Tensor]
    reader: gguf.GGUFReader


def open_draft_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Memory-map a draft GGUF through the target loader's :func:`open_gguf` (which turns any reader
    failure on truncated / corrupt bytes into an error naming the file and checks every tensor's
    data range against the file size), re-raised as DrafterFormatError."""
    from specd.target_worker.gguf_loader import TargetFileError, open_gguf
    try:
        return open_gguf(path)
    except TargetFileError as exc:
        raise DrafterFormatError(str(exc)) from exc


def _open(path: str | os.PathLike) -> GGUFMeta:
    return GGUFMeta(open_draft_gguf(path), path)


def _arch(meta: GGUFMeta) -> str:
    arch = meta.get_str("general.architecture")
    if arch == MAINLINE_ARCH:
        present = [k for k in ("dflash.block_size", "dflash.target_layers", "dflash.attention.causal",
                               "dflash.selector_top_k") if meta.has(k)]
        shown = present[0] if present else "general.architecture"
        raise DrafterFormatError(
            f"{meta.path}: general.architecture = 'dflash' is the mainline llama.cpp dialect "
            f"(keys such as {shown}"
            + (f"; dflash.target_layers = {meta.get_int_array('dflash.target_layers')}" if meta.has("dflash.target_layers") else "")
            + "), not the draft GGUF contract specd reads ('qwen35-dflash-draft'). Its tap ids may be stored +1 "
            "and its mask id lives elsewhere, so specd will not guess: translate it explicitly with "
            f"`specd convert-drafter {meta.path} OUT.gguf --tap-offset 1` (llama.cpp's converter stores "
            "dflash.target_layers +1; pass 0 if this file stores 0-based ids)")
    if arch == DB_ARCH:
        raise DrafterFormatError(f"{meta.path}: general.architecture = {DB_ARCH!r} (the DB DSpark converter's files) "
                                 f"lacks the keys specd requires ({ARCH}.dflash.family, row alignment, causal "
                                 "pattern); convert the HF checkpoint with `specd convert-drafter` instead")
    if arch != ARCH:
        raise DrafterFormatError(f"{meta.path}: general.architecture = {arch!r} is not a drafter this loader reads "
                                 f"(expected {ARCH!r})")
    return arch


def read_drafter_hparams(path: str | os.PathLike) -> DrafterHParams:
    """Hyper-parameters of the draft GGUF at ``path`` (metadata only). Raises DrafterFormatError."""
    meta = _open(path)
    return DrafterHParams.read_gguf_kv(meta, _arch(meta))


def _view(meta: GGUFMeta, t, kind: str) -> Tensor:
    """Zero-copy native view of ReaderTensor ``t`` (numpy order shape)."""
    if kind in (NORM, F32_ONLY):
        if t.tensor_type != QT.F32:
            raise DrafterFormatError(f"{meta.path}: tensor {t.name} is {t.tensor_type.name}; "
                                     f"{'norms' if kind == NORM else 'conv base kernels and the confidence head'} must be F32")
        return Tensor(_native_view(t.data, np.float32))
    dtype = _MATRIX_TYPES.get(t.tensor_type)
    if dtype is None:
        raise DrafterFormatError(f"{meta.path}: tensor {t.name} has type {t.tensor_type.name}, which specd does not read "
                                 f"(supported: {', '.join(q.name for q in _MATRIX_TYPES)})")
    if t.tensor_type == QT.F32:
        return Tensor(_native_view(t.data, np.float32))
    if t.tensor_type == QT.F16:
        return Tensor(_native_view(t.data, np.float16))
    return Tensor(_native_view(t.data, np.uint8), dtype)


def _native_view(a: np.ndarray, dtype: type) -> np.ndarray:
    """Zero-copy view of ``a`` with the canonical numpy dtype object. GGUFReader hands out arrays
    whose dtype carries an explicit byte-order flag; specd.native matches dtypes by identity, so
    re-view them (same memory) with the canonical dtype."""
    return a.view(np.dtype(dtype))  # ndarray.view never copies


def load_drafter(path: str | os.PathLike) -> LoadedDrafter:
    """Read and validate the draft GGUF at ``path``; weights are zero-copy views of the file.

    Raises DrafterFormatError naming the file and the key or tensor for: the mainline ``dflash``
    dialect (C15), a missing / mistyped / contradictory key, a missing or unknown tensor, a shape
    that disagrees with the keys, or a storage type the contract does not allow (norms, conv base
    kernels and the confidence head must be F32).
    """
    path = str(path)
    meta = _open(path)
    arch = _arch(meta)
    hp = DrafterHParams.read_gguf_kv(meta, arch)
    expected = expected_tensors(hp)
    found: dict[str, object] = {}
    unknown: list[str] = []
    for t in meta.reader.tensors:
        name = canonical_gguf_name(t.name)
        if name not in expected:
            unknown.append(t.name)
            continue
        if name in found:
            raise DrafterFormatError(f"{path}: tensor {name} appears twice (alias {t.name})")
        found[name] = t
    if unknown:
        raise DrafterFormatError(f"{path}: unknown tensor(s) {', '.join(unknown[:8])}{' …' if len(unknown) > 8 else ''} "
                                 f"for a {hp.family} drafter with {hp.n_layer} layers (refusing to guess their role)")
    missing = [n for n in expected if n not in found]
    if missing:
        raise DrafterFormatError(f"{path}: missing tensor(s) {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''} "
                                 f"required by {key(arch, K.FAMILY)} = {hp.family!r} and the shape keys")
    views: dict[str, Tensor] = {}
    for name, spec in expected.items():
        t = found[name]
        ne = tuple(int(x) for x in t.shape)
        if ne != spec.ne:
            raise DrafterFormatError(f"{path}: tensor {t.name} has ne {list(ne)}; the metadata implies {list(spec.ne)}")
        views[name] = _view(meta, t, spec.kind)

    def layer(i: int) -> DrafterLayerWeights:
        b = f"blk.{i}."
        g = lambda s: views.get(b + s)  # noqa: E731
        return DrafterLayerWeights(
            attn_norm=g("attn_norm.weight"), ffn_norm=g("ffn_norm.weight"), attn_q=g("attn_q.weight"),
            attn_k=g("attn_k.weight"), attn_v=g("attn_v.weight"), attn_output=g("attn_output.weight"),
            attn_q_norm=g("attn_q_norm.weight"), attn_k_norm=g("attn_k_norm.weight"),
            ffn_gate=g("ffn_gate.weight"), ffn_up=g("ffn_up.weight"), ffn_down=g("ffn_down.weight"),
            attn_conv_base=g("attn_conv.base"), attn_conv_proj=g("attn_conv.proj.weight"),
            ffn_conv_base=g("ffn_conv.base"), ffn_conv_proj=g("ffn_conv.proj.weight"),
        )

    dspark = None
    if hp.dspark is not None:
        dspark = DSparkHeadWeights(views["dflash.dspark.markov.w1"], views["dflash.dspark.markov.w2"],
                                   views.get("dflash.dspark.confidence.weight"),
                                   views.get("dflash.dspark.confidence.bias"))
    selector = None
    if hp.dflash2 is not None:
        selector = SelectorWeights(views["dflash.selector.hproj.weight"], views["dflash.selector.pred_cb"],
                                   views["dflash.selector.succ_cb"])
    weights = DrafterWeights(
        fc=views["dflash.fc.weight"], hidden_norm=views["dflash.hidden_norm.weight"],
        output_norm=views["output_norm.weight"], layers=tuple(layer(i) for i in range(hp.n_layer)),
        dspark=dspark, selector=selector,
    )
    return LoadedDrafter(path=path, hparams=hp, weights=weights, tensors=views, reader=meta.reader)


@runtime_checkable
class TargetHParamsLike(Protocol):
    """What :func:`check_pair` needs from the target (``Qwen35HParams`` provides it): hidden size
    ``n_embd``, vocabulary size ``n_vocab`` (rows of token_embd / lm_head), decoder depth ``n_layer``."""

    n_embd: int
    n_vocab: int
    n_layer: int


def check_pair(drafter: DrafterHParams, drafter_path: str | os.PathLike,
               target: TargetHParamsLike, target_path: str | os.PathLike) -> None:
    """Check that ``drafter`` can run against ``target``; raise DrafterPairError listing every
    mismatch and naming both files.

    * hidden size: the drafter reuses the target's embedding and lm_head, so H must match;
    * vocabulary: the drafter's vocabulary (its Markov / selector codebook rows, and the vocab it
      was trained with) must equal the target's;
    * mask id: taken from the drafter metadata (C17; no lookup in a drafter vocabulary, which a
      weights-only GGUF does not have) and must be a valid target token id;
    * tap ids: 0-based target layer outputs, each < the target's layer count; a drafter trained
      for a target of a different depth (``dflash.target.block_count``) is refused too.
    """
    d, t = str(drafter_path), str(target_path)
    problems: list[str] = []
    if drafter.n_embd != target.n_embd:
        problems.append(f"hidden size: drafter {key(ARCH, K.EMBEDDING_LENGTH)} = {drafter.n_embd}, "
                        f"target n_embd = {target.n_embd}")
    if drafter.n_vocab != target.n_vocab:
        problems.append(f"vocabulary: drafter {key(ARCH, K.VOCAB_SIZE)} = {drafter.n_vocab}, "
                        f"target n_vocab = {target.n_vocab}")
    if not 0 <= drafter.mask_token_id < target.n_vocab:
        problems.append(f"mask token: drafter {key(ARCH, K.MASK_TOKEN_ID)} = {drafter.mask_token_id} is not a "
                        f"target token id (target vocabulary {target.n_vocab})")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.n_layer]
    if bad:
        problems.append(f"tap ids: drafter {key(ARCH, K.TARGET_LAYER_IDS)} = {list(drafter.target_layer_ids)} has "
                        f"{bad} outside the target's {target.n_layer} layers [0, {target.n_layer})")
    if drafter.n_target_layers is not None and drafter.n_target_layers != target.n_layer:
        problems.append(f"target depth: drafter {key(ARCH, K.TARGET_BLOCK_COUNT)} = {drafter.n_target_layers} "
                        f"(the target it was trained for), target n_layer = {target.n_layer}")
    if problems:
        raise DrafterPairError(f"drafter {d} does not fit target {t}:\n  " + "\n  ".join(problems))
