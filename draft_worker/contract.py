"""The draft GGUF contract shared by the converter, the quantizer and the loader.

Source: docs/drafters.md §7 (lucebox dialect, arch ``qwen35-dflash-draft``, plus the specd additions
``dflash.family``, ``dflash.row_alignment``, ``dflash.attention.causal_pattern`` and the logit
transform keys). Shapes below are ggml ``ne`` order ``[in, out]``; numpy / torch order is reversed.

Names, HF → GGUF (§2.3, §5.4, §6.4, §7.2):

==========================================================  ==================================
HF checkpoint                                                GGUF
==========================================================  ==================================
``fc.weight``                                                ``dflash.fc.weight``
``hidden_norm.weight``                                       ``dflash.hidden_norm.weight``
``norm.weight``                                              ``output_norm.weight``
``layers.i.input_layernorm.weight``                          ``blk.i.attn_norm.weight``
``layers.i.post_attention_layernorm.weight``                 ``blk.i.ffn_norm.weight``
``layers.i.self_attn.{q,k,v,o}_proj.weight``                 ``blk.i.attn_{q,k,v,output}.weight``
``layers.i.self_attn.{q,k}_norm.weight``                     ``blk.i.attn_{q,k}_norm.weight``
``layers.i.mlp.{gate,up,down}_proj.weight``                  ``blk.i.ffn_{gate,up,down}.weight``
``layers.i.attention_conv.base_kernel``                      ``blk.i.attn_conv.base``
``layers.i.attention_conv.kernel_projection.weight``         ``blk.i.attn_conv.proj.weight``
``layers.i.mlp_conv.base_kernel``                            ``blk.i.ffn_conv.base``
``layers.i.mlp_conv.kernel_projection.weight``               ``blk.i.ffn_conv.proj.weight``
``markov_head.markov_w{1,2}.weight``                         ``dflash.dspark.markov.w{1,2}``
``confidence_head.proj.{weight,bias}``                       ``dflash.dspark.confidence.{weight,bias}``
``candidate_selector.hidden_projection.weight``              ``dflash.selector.hproj.weight``
``candidate_selector.predecessor_codebook``                  ``dflash.selector.pred_cb``
``candidate_selector.successor_codebook``                    ``dflash.selector.succ_cb``
==========================================================  ==================================
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .hparams import DrafterHParams

# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


class DrafterFormatError(ValueError):
    """A drafter checkpoint, config or GGUF violates the contract. The message names the file and
    the key or tensor at fault."""


class DrafterPairError(DrafterFormatError):
    """A drafter and a target do not fit together (hidden size, vocabulary, mask id, tap ids).
    The message names both files."""


# ------------------------------------------------------------------------------------------------
# Architecture and keys
# ------------------------------------------------------------------------------------------------

ARCH = "qwen35-dflash-draft"
"""``general.architecture`` specd writes (LH/LX name)."""

DB_ARCH = "dflash-draft"
"""``general.architecture`` of the DB DSpark converter. Its files lack specd's required keys
(family, row alignment, causal pattern), so the loader refuses them with a re-conversion hint."""

MAINLINE_ARCH = "dflash"
"""The other published dialect (mainline llama.cpp); read only through :mod:`.dialect`."""

FAMILIES = ("dflash", "dspark", "dflash2")
ROW_ALIGNMENTS = ("seed_then_proposals", "proposals_only")
"""``seed_then_proposals``: block row r (1..B-1) proposes the token at start + r (DFlash,
DFlash 2). ``proposals_only``: block row r (0..B-1) proposes the token at start + r + 1 (DeepSpec /
SpecForge DSpark). drafters.md §4, DB ``draft_contract.h`` terms."""


class K:
    """Key suffixes; the full key is ``f"{arch}.{suffix}"``."""

    CONTEXT_LENGTH = "context_length"
    EMBEDDING_LENGTH = "embedding_length"
    BLOCK_COUNT = "block_count"
    FEED_FORWARD_LENGTH = "feed_forward_length"
    HEAD_COUNT = "attention.head_count"
    HEAD_COUNT_KV = "attention.head_count_kv"
    KEY_LENGTH = "attention.key_length"
    VALUE_LENGTH = "attention.value_length"
    VOCAB_SIZE = "vocab_size"
    RMS_EPS = "attention.layer_norm_rms_epsilon"
    ROPE_FREQ_BASE = "rope.freq_base"
    ROPE_DIM = "rope.dimension_count"
    ROPE_SCALING_TYPE = "rope.scaling.type"
    ROPE_SCALING_FACTOR = "rope.scaling.factor"
    ROPE_SCALING_ORIG_CTX = "rope.scaling.original_context_length"
    ROPE_SCALING_ATTN_FACTOR = "rope.scaling.attn_factor"
    ROPE_SCALING_BETA_FAST = "rope.scaling.beta_fast"
    ROPE_SCALING_BETA_SLOW = "rope.scaling.beta_slow"
    SLIDING_WINDOW = "attention.sliding_window"
    SLIDING_PATTERN = "attention.sliding_window_pattern"
    BLOCK_SIZE = "dflash.block_size"
    N_TARGET_LAYERS = "dflash.n_target_layers"  # tap count (LH name)
    TARGET_LAYER_IDS = "dflash.target_layer_ids"
    N_TARGET_FEATURES = "dflash.n_target_features"
    FEAT_DIM_PER_CAPTURE = "dflash.feat_dim_per_capture"
    TARGET_BLOCK_COUNT = "dflash.target.block_count"  # depth of the target the drafter was trained on
    MASK_TOKEN_ID = "dflash.mask_token_id"
    # specd additions
    FAMILY = "dflash.family"
    ROW_ALIGNMENT = "dflash.row_alignment"
    CAUSAL_PATTERN = "dflash.attention.causal_pattern"
    INPUT_EMBEDDING_SCALE = "dflash.input_embedding_scale"
    OUTPUT_MULTIPLIER = "dflash.output_multiplier"
    FINAL_LOGIT_SOFTCAPPING = "dflash.final_logit_softcapping"  # 0 = off
    # DSpark (LX/DB)
    DSPARK_ENABLED = "dflash.dspark.enabled"
    DSPARK_MARKOV_RANK = "dflash.dspark.markov_rank"
    DSPARK_VOCAB_SIZE = "dflash.dspark.vocab_size"
    DSPARK_MARKOV_TYPE = "dflash.dspark.markov_type"
    DSPARK_CONFIDENCE = "dflash.dspark.confidence.enabled"
    DSPARK_CONFIDENCE_WITH_MARKOV = "dflash.dspark.confidence.with_markov"
    DSPARK_CONFIDENCE_DIM = "dflash.dspark.confidence_dim"
    # DFlash 2 (LX@2562)
    DF2_CONV_KERNEL = "dflash.dflash2.conv_kernel_size"
    DF2_CONV_GROUP = "dflash.dflash2.conv_group_size"
    DF2_SELECTOR_RANK = "dflash.dflash2.selector_rank"
    DF2_SELECTOR_TOP_K = "dflash.dflash2.selector_top_k"
    # provenance
    SOURCE_CONFIG_JSON = "source.config_json"


def key(arch: str, suffix: str) -> str:
    """Full GGUF key for ``suffix`` under ``arch``."""
    return f"{arch}.{suffix}"


# ------------------------------------------------------------------------------------------------
# Tensor names
# ------------------------------------------------------------------------------------------------

HF_LAYER_SUFFIXES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv.base",
    "attention_conv.kernel_projection.weight": "attn_conv.proj.weight",
    "mlp_conv.base_kernel": "ffn_conv.base",
    "mlp_conv.kernel_projection.weight": "ffn_conv.proj.weight",
}

_HF_GLOBAL = {
    "fc.weight": "dflash.fc.weight",
    "hidden_norm.weight": "dflash.hidden_norm.weight",
    "norm.weight": "output_norm.weight",
    # DSpark heads (DS/SF names, then aliases seen in DB/LX converters and SF legacy checkpoints)
    "markov_head.markov_w1.weight": "dflash.dspark.markov.w1",
    "markov_head.markov_w2.weight": "dflash.dspark.markov.w2",
    "logit_head.markov_head.markov_w1.weight": "dflash.dspark.markov.w1",
    "logit_head.markov_head.markov_w2.weight": "dflash.dspark.markov.w2",
    "dspark_markov_head.markov_w1.weight": "dflash.dspark.markov.w1",
    "dspark_markov_head.markov_w2.weight": "dflash.dspark.markov.w2",
    "mtp.2.markov_head.markov_w1.weight": "dflash.dspark.markov.w1",
    "mtp.2.markov_head.markov_w2.weight": "dflash.dspark.markov.w2",
    "confidence_head.proj.weight": "dflash.dspark.confidence.weight",
    "confidence_head.proj.bias": "dflash.dspark.confidence.bias",
    "logit_head.confidence_head.proj.weight": "dflash.dspark.confidence.weight",
    "logit_head.confidence_head.proj.bias": "dflash.dspark.confidence.bias",
    "dspark_confidence_head.weight": "dflash.dspark.confidence.weight",
    "dspark_confidence_head.bias": "dflash.dspark.confidence.bias",
    "mtp.2.confidence_head.proj.weight": "dflash.dspark.confidence.weight",
    "mtp.2.confidence_head.proj.bias": "dflash.dspark.confidence.bias",
    # DFlash 2 selector. Published checkpoints store the codebooks as raw parameters (no
    # ``.weight``); dflash 0.1.0's ``save_pretrained`` writes them with ``.weight``.
    "candidate_selector.hidden_projection.weight": "dflash.selector.hproj.weight",
    "candidate_selector.predecessor_codebook": "dflash.selector.pred_cb",
    "candidate_selector.successor_codebook": "dflash.selector.succ_cb",
    "candidate_selector.predecessor_codebook.weight": "dflash.selector.pred_cb",
    "candidate_selector.successor_codebook.weight": "dflash.selector.succ_cb",
}

HF_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
"""DeepSpec standalone DSpark checkpoints ship frozen copies of the target's embedding and head
(drafters.md §2.4). The draft GGUF has no slot for them: specd always uses the target's own."""

_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def hf_to_gguf_name(name: str) -> str | None:
    """GGUF name for HF tensor ``name``, or None when it is not part of the contract."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in HF_LAYER_SUFFIXES:
        return f"blk.{int(m.group(1))}.{HF_LAYER_SUFFIXES[m.group(2)]}"
    return None


GGUF_ALIASES = {
    "dflash_fc.weight": "dflash.fc.weight",
    "dflash_hidden_norm.weight": "dflash.hidden_norm.weight",
}
"""Alternative GGUF names other writers use (LH loader accepts them)."""

_BLK_ALIAS_RE = re.compile(r"blk\.(\d+)\.post_attention_norm\.weight")


def canonical_gguf_name(name: str) -> str:
    """Map a GGUF alias (``dflash_fc.weight``, ``blk.i.post_attention_norm.weight``) to the
    canonical name; other names are returned unchanged."""
    if name in GGUF_ALIASES:
        return GGUF_ALIASES[name]
    m = _BLK_ALIAS_RE.fullmatch(name)
    if m:
        return f"blk.{m.group(1)}.ffn_norm.weight"
    return name


# ------------------------------------------------------------------------------------------------
# Expected tensors for a set of hyper-parameters
# ------------------------------------------------------------------------------------------------

NORM = "norm"
"""1-D gain vector; F32 only; copied unchanged (plain-gain Qwen3 RMSNorm, no +1)."""
F32_ONLY = "f32"
"""Small tensors that stay F32 (conv base kernels, confidence head): their values enter the
output directly, they are tiny, and none is a GEMM operand worth quantizing."""
MATRIX = "matrix"
"""2-D projection / codebook: F32, F16, BF16 or a block format (Q8_0, K-quants)."""


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor: GGUF name, ggml ``ne`` shape, storage kind (NORM, F32_ONLY, MATRIX)."""

    name: str
    ne: tuple[int, ...]
    kind: str


def expected_tensors(hp: "DrafterHParams") -> dict[str, TensorSpec]:
    """Every tensor a drafter with hyper-parameters ``hp`` must carry, by GGUF name, with its ggml
    ``ne`` shape (drafters.md §7.2). No other tensor is allowed."""
    H, hd = hp.n_embd, hp.head_dim
    q, kv, ff = hp.n_head * hd, hp.n_head_kv * hd, hp.n_ff
    out: list[TensorSpec] = [
        TensorSpec("dflash.fc.weight", (hp.n_taps * H, H), MATRIX),
        TensorSpec("dflash.hidden_norm.weight", (H,), NORM),
        TensorSpec("output_norm.weight", (H,), NORM),
    ]
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        out += [
            TensorSpec(b + "attn_norm.weight", (H,), NORM),
            TensorSpec(b + "ffn_norm.weight", (H,), NORM),
            TensorSpec(b + "attn_q.weight", (H, q), MATRIX),
            TensorSpec(b + "attn_k.weight", (H, kv), MATRIX),
            TensorSpec(b + "attn_v.weight", (H, kv), MATRIX),
            TensorSpec(b + "attn_output.weight", (q, H), MATRIX),
            TensorSpec(b + "attn_q_norm.weight", (hd,), NORM),
            TensorSpec(b + "attn_k_norm.weight", (hd,), NORM),
            TensorSpec(b + "ffn_gate.weight", (H, ff), MATRIX),
            TensorSpec(b + "ffn_up.weight", (H, ff), MATRIX),
            TensorSpec(b + "ffn_down.weight", (ff, H), MATRIX),
        ]
        if hp.dflash2 is not None:
            taps = hp.dflash2.conv_kernel_size
            proj = 2 * taps * (H // hp.dflash2.conv_group_size)
            out += [
                TensorSpec(b + "attn_conv.base", (H, taps, 2), F32_ONLY),
                TensorSpec(b + "attn_conv.proj.weight", (H, proj), MATRIX),
                TensorSpec(b + "ffn_conv.base", (H, taps, 2), F32_ONLY),
                TensorSpec(b + "ffn_conv.proj.weight", (H, proj), MATRIX),
            ]
    if hp.dspark is not None:
        r, V = hp.dspark.markov_rank, hp.n_vocab
        out += [
            TensorSpec("dflash.dspark.markov.w1", (r, V), MATRIX),
            TensorSpec("dflash.dspark.markov.w2", (r, V), MATRIX),
        ]
        if hp.dspark.confidence:
            out += [
                TensorSpec("dflash.dspark.confidence.weight", (hp.dspark.confidence_dim(H), 1), F32_ONLY),
                TensorSpec("dflash.dspark.confidence.bias", (1,), F32_ONLY),
            ]
    if hp.dflash2 is not None:
        R, V = hp.dflash2.selector_rank, hp.n_vocab
        out += [
            TensorSpec("dflash.selector.hproj.weight", (H, R), MATRIX),
            TensorSpec("dflash.selector.pred_cb", (R, V), MATRIX),
            TensorSpec("dflash.selector.succ_cb", (R, V), MATRIX),
        ]
    return {t.name: t for t in out}


def tensor_sort_key(name: str) -> tuple[int, int, str]:
    """Write order: ``dflash.*`` globals, ``output_norm``, then layers in order (LH layout)."""
    if name.startswith("dflash."):
        return (0, 0, name)
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return (2, int(m.group(1)), name)
    return (1, 0, name)


Q8_0_BLOCK = 32


def q8_0_eligible(spec: TensorSpec) -> bool:
    """True when the tensor may be stored as Q8_0: a 2-D MATRIX whose ne0 (input dim) is a
    multiple of 32. Norms, conv base kernels and the confidence head always stay F32."""
    return spec.kind == MATRIX and len(spec.ne) == 2 and spec.ne[0] % Q8_0_BLOCK == 0
