"""Drafter hyper-parameters: one typed, frozen description shared by the converter (built from an
HF ``config.json`` + tensor shapes), the GGUF writer and the loader (read back from GGUF metadata).

Source of every field: docs/drafters.md §2.1 (config keys), §3.3 (masks), §3.4 (RoPE / YaRN),
§4 (row alignment), §5 (DSpark), §6 (DFlash 2), §7.1 (GGUF keys).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import gguf
import numpy as np

from .contract import ARCH, FAMILIES, ROW_ALIGNMENTS, DrafterFormatError, K, key
from .gguf_meta import GGUFMeta


@dataclass(frozen=True)
class YarnParams:
    """YaRN RoPE scaling (Peng et al. 2023; transformers ``_compute_yarn_parameters``).

    factor: context extension factor s (dimensionless, > 0; YaRN only changes frequencies for s > 1).
    original_context_length: the pre-extension training window, tokens (L_orig).
    beta_fast, beta_slow: ramp boundaries in rotations (HF defaults 32 and 1).
    attn_factor: **ggml-relative** attention factor, as ggml / LX@2562 read
        ``rope.scaling.attn_factor``: ggml multiplies cos/sin by ``attn_factor · (1 + 0.1·ln s)``.
        1.0 reproduces the HF default; a config-declared HF ``attention_factor`` a is stored as
        ``a / (1 + 0.1·ln s)``.
    """

    factor: float
    original_context_length: int
    beta_fast: float
    beta_slow: float
    attn_factor: float

    @property
    def attention_factor(self) -> float:
        """Total multiplier on cos/sin (HF ``attention_factor`` semantics). Apply exactly once
        (drafters.md §3.4)."""
        return self.attn_factor * yarn_mscale(self.factor)


def f32(x: float) -> float:
    """``x`` rounded to float32, the precision GGUF stores float keys with (so hyper-parameters
    built from a config compare equal to the ones read back from the file)."""
    return float(np.float32(x))


def yarn_mscale(factor: float) -> float:
    """YaRN's default attention scale ``1 + 0.1·ln s`` (1 for s <= 1)."""
    return 1.0 if factor <= 1.0 else 1.0 + 0.1 * math.log(factor)


@dataclass(frozen=True)
class DSparkParams:
    """DSpark heads (drafters.md §5.2–5.4).

    markov_rank: r of the low-rank bigram W2·W1[prev] (W1, W2 stored [V, r]).
    markov_type: only ``vanilla`` is supported (all published Qwen heads).
    confidence: whether the confidence head is present.
    confidence_with_markov: its input is [h ; W1[prev]] (H + r) rather than h (H).
    """

    markov_rank: int
    markov_type: str
    confidence: bool
    confidence_with_markov: bool

    def confidence_dim(self, n_embd: int) -> int:
        """Input width of the confidence head."""
        return n_embd + (self.markov_rank if self.confidence_with_markov else 0)


@dataclass(frozen=True)
class DFlash2Params:
    """DFlash 2 grouped dynamic convs and candidate selector (drafters.md §6).

    conv_kernel_size: taps per conv (2 published). conv_group_size: channels per dynamic-coefficient
    group (must divide n_embd; G = n_embd / group). selector_rank: R of the codebooks.
    selector_top_k: K candidates per slot (1..n_vocab).
    """

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class DrafterHParams:
    """Everything the draft worker needs to know about a drafter, read from its own file.

    Shapes: n_embd H, n_layer, n_ff (SwiGLU width), n_head / n_head_kv query / KV heads of
    head_dim each, n_vocab (the target vocabulary the drafter was trained with).
    rms_eps: ε of every RMSNorm (plain gain, no +1). rope_theta: θ (full-head NeoX RoPE).
    yarn: YaRN scaling or None. sliding_window: W in tokens (None when no layer slides);
    sliding_pattern[i]: layer i uses the window; causal_pattern[i]: layer i is causal inside the
    block (resolved from ``is_causal`` / ``layer_types`` at conversion, ZL-0.1.0 rule).
    block_size: B including the anchor. mask_token_id: M (target vocabulary id).
    target_layer_ids: 0-based target layer *outputs* concatenated in this order into fc
    (transformers ``hidden_states[id + 1]``). n_target_layers: depth of the target the drafter
    was trained for, or None when the source did not say. context_length: the drafter config's
    max_position_embeddings or None. input_embedding_scale / output_multiplier /
    final_logit_softcapping: ZL-0.1.0 logit transforms (1, 1, None = off for Qwen).
    """

    family: str
    row_alignment: str
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    rms_eps: float
    rope_theta: float
    yarn: YarnParams | None
    sliding_window: int | None
    sliding_pattern: tuple[bool, ...]
    causal_pattern: tuple[bool, ...]
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    n_target_layers: int | None
    context_length: int | None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    dspark: DSparkParams | None = None
    dflash2: DFlash2Params | None = None

    # -- derived ----------------------------------------------------------------------------------
    @property
    def n_taps(self) -> int:
        """Number of tapped target layers N (fc input = N·H)."""
        return len(self.target_layer_ids)

    @property
    def n_drafts(self) -> int:
        """Draft tokens per block: B − 1 (seed_then_proposals) or B (proposals_only)."""
        return self.block_size - 1 if self.row_alignment == "seed_then_proposals" else self.block_size

    @property
    def verify_width(self) -> int:
        """Target rows verified per round: anchor + drafts."""
        return self.n_drafts + 1

    @property
    def first_proposal_row(self) -> int:
        """First block row whose output is a proposal (1 or 0)."""
        return 1 if self.row_alignment == "seed_then_proposals" else 0

    def summary(self) -> str:
        """One start-up line with the effective values (C19 asks the block size be reported)."""
        rope = f"θ={self.rope_theta:g}"
        if self.yarn:
            rope += (f" yarn(factor={self.yarn.factor:g}, orig={self.yarn.original_context_length}, "
                     f"attn={self.yarn.attention_factor:.6g})")
        slid = "".join("S" if s else "F" for s in self.sliding_pattern)
        caus = "".join("c" if c else "b" for c in self.causal_pattern)
        extra = ""
        if self.dspark:
            extra = (f" markov({self.dspark.markov_type}, rank={self.dspark.markov_rank})"
                     f" confidence={self.dspark.confidence}")
        if self.dflash2:
            d = self.dflash2
            extra = (f" conv(k={d.conv_kernel_size}, group={d.conv_group_size})"
                     f" selector(rank={d.selector_rank}, top_k={d.selector_top_k})")
        return (f"{self.family} drafter: block_size={self.block_size} ({self.n_drafts} drafts, verify "
                f"{self.verify_width}, {self.row_alignment}) mask={self.mask_token_id} "
                f"taps={list(self.target_layer_ids)} H={self.n_embd} layers={self.n_layer} "
                f"heads={self.n_head}/{self.n_head_kv}x{self.head_dim} ffn={self.n_ff} vocab={self.n_vocab} "
                f"{rope} layers=[{slid}] causal=[{caus}]"
                + (f" window={self.sliding_window}" if self.sliding_window else "") + extra)

    # -- validation -------------------------------------------------------------------------------
    def validate(self, source: str, names: Mapping[str, str] | None = None) -> None:
        """Check internal consistency; raise DrafterFormatError naming ``source`` and the key.

        ``names`` maps field names (and ``dspark.*`` / ``dflash2.*`` / ``yarn.*`` sub-fields) to the
        key spelling the user knows (HF config paths at conversion, GGUF keys at load); unmapped
        fields fall back to the GGUF key of this contract.
        """
        nm = dict(GGUF_FIELD_KEYS)
        if names:
            nm.update(names)

        def fail(fieldname: str, msg: str) -> DrafterFormatError:
            return DrafterFormatError(f"{source}: {nm.get(fieldname, fieldname)} {msg}")

        if self.family not in FAMILIES:
            raise fail("family", f"= {self.family!r}: expected one of {FAMILIES}")
        if self.row_alignment not in ROW_ALIGNMENTS:
            raise fail("row_alignment", f"= {self.row_alignment!r}: expected one of {ROW_ALIGNMENTS}")
        if self.family in ("dflash", "dflash2") and self.row_alignment != "seed_then_proposals":
            raise fail("row_alignment", f"= {self.row_alignment!r} contradicts family {self.family!r} "
                       "(DFlash / DFlash 2 propose from block row 1: seed_then_proposals)")
        for f in ("n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim", "n_vocab"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise fail(f, f"= {v!r}: expected a positive integer")
        if self.n_head % self.n_head_kv:
            raise fail("n_head", f"= {self.n_head} is not a multiple of the KV head count {self.n_head_kv}")
        if not (math.isfinite(self.rms_eps) and self.rms_eps > 0):
            raise fail("rms_eps", f"= {self.rms_eps!r}: expected a finite positive float")
        if not math.isfinite(self.rope_theta):
            raise fail("rope_theta", f"= {self.rope_theta!r} is not finite (NaN/inf RoPE base)")
        if self.rope_theta <= 1.0:
            raise fail("rope_theta", f"= {self.rope_theta!r}: the RoPE base must be > 1")
        if self.yarn is not None:
            y = self.yarn
            for f in ("factor", "beta_fast", "beta_slow", "attn_factor"):
                v = getattr(y, f)
                if not (math.isfinite(v) and v > 0):
                    raise fail("yarn." + f, f"= {v!r}: expected a finite positive float")
            if y.original_context_length <= 0:
                raise fail("yarn.original_context_length", f"= {y.original_context_length}: expected > 0")
        if len(self.sliding_pattern) != self.n_layer:
            raise fail("sliding_pattern", f"has {len(self.sliding_pattern)} entries for {self.n_layer} layers")
        if len(self.causal_pattern) != self.n_layer:
            raise fail("causal_pattern", f"has {len(self.causal_pattern)} entries for {self.n_layer} layers")
        if any(self.sliding_pattern):
            if self.sliding_window is None or self.sliding_window <= 0:
                raise fail("sliding_window", f"= {self.sliding_window!r}: sliding layers need a positive window")
        elif self.sliding_window is not None:
            raise fail("sliding_window", f"= {self.sliding_window} but no layer is a sliding layer "
                       f"({nm['sliding_pattern']} is all false): contradictory")
        if self.block_size < 2:
            raise fail("block_size", f"= {self.block_size}: a block holds the anchor plus at least one draft")
        if not 0 <= self.mask_token_id < self.n_vocab:
            raise fail("mask_token_id", f"= {self.mask_token_id} is outside the drafter vocabulary "
                       f"[0, {self.n_vocab})")
        ids = self.target_layer_ids
        if not ids:
            raise fail("target_layer_ids", "is empty")
        if any(i < 0 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
            raise fail("target_layer_ids", f"= {list(ids)}: expected strictly increasing non-negative "
                       "0-based target layer ids")
        if self.n_target_layers is not None and ids[-1] >= self.n_target_layers:
            raise fail("target_layer_ids", f"= {list(ids)} reaches beyond the {self.n_target_layers} "
                       f"target layers declared by {nm['n_target_layers']}")
        for f in ("input_embedding_scale", "output_multiplier"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v != 0):
                raise fail(f, f"= {v!r}: expected a finite non-zero float")
        if self.final_logit_softcapping is not None and not (
                math.isfinite(self.final_logit_softcapping) and self.final_logit_softcapping > 0):
            raise fail("final_logit_softcapping", f"= {self.final_logit_softcapping!r}: expected > 0 (or off)")
        if (self.family == "dspark") != (self.dspark is not None):
            raise fail("family", f"= {self.family!r} but DSpark head parameters are "
                       f"{'absent' if self.dspark is None else 'present'}")
        if (self.family == "dflash2") != (self.dflash2 is not None):
            raise fail("family", f"= {self.family!r} but DFlash 2 parameters are "
                       f"{'absent' if self.dflash2 is None else 'present'}")
        if self.dspark is not None:
            d = self.dspark
            if d.markov_rank <= 0:
                raise fail("dspark.markov_rank", f"= {d.markov_rank}: expected > 0")
            if d.markov_type != "vanilla":
                raise fail("dspark.markov_type", f"= {d.markov_type!r}: only 'vanilla' Markov heads are supported")
            if d.confidence_with_markov and not d.confidence:
                raise fail("dspark.confidence_with_markov", "is true but the confidence head is disabled")
        if self.dflash2 is not None:
            d = self.dflash2
            if d.conv_kernel_size <= 0:
                raise fail("dflash2.conv_kernel_size", f"= {d.conv_kernel_size}: expected > 0")
            if d.conv_group_size <= 0 or self.n_embd % d.conv_group_size:
                raise fail("dflash2.conv_group_size", f"= {d.conv_group_size} does not divide the hidden size {self.n_embd}")
            if d.selector_rank <= 0:
                raise fail("dflash2.selector_rank", f"= {d.selector_rank}: expected > 0")
            if not 1 <= d.selector_top_k <= self.n_vocab:
                raise fail("dflash2.selector_top_k", f"= {d.selector_top_k}: expected 1..{self.n_vocab}")

    # -- GGUF ---------------------------------------------------------------------------------------
    def write_gguf_kv(self, writer: gguf.GGUFWriter, arch: str = ARCH) -> None:
        """Add every contract key (drafters.md §7.1 + specd additions) to ``writer``."""
        a = lambda s: key(arch, s)  # noqa: E731
        if self.context_length is not None:
            writer.add_uint32(a(K.CONTEXT_LENGTH), self.context_length)
        writer.add_uint32(a(K.EMBEDDING_LENGTH), self.n_embd)
        writer.add_uint32(a(K.BLOCK_COUNT), self.n_layer)
        writer.add_uint32(a(K.FEED_FORWARD_LENGTH), self.n_ff)
        writer.add_uint32(a(K.HEAD_COUNT), self.n_head)
        writer.add_uint32(a(K.HEAD_COUNT_KV), self.n_head_kv)
        writer.add_uint32(a(K.KEY_LENGTH), self.head_dim)
        writer.add_uint32(a(K.VALUE_LENGTH), self.head_dim)
        writer.add_uint32(a(K.VOCAB_SIZE), self.n_vocab)
        writer.add_float32(a(K.RMS_EPS), self.rms_eps)
        writer.add_float32(a(K.ROPE_FREQ_BASE), self.rope_theta)
        writer.add_uint32(a(K.ROPE_DIM), self.head_dim)
        if self.yarn is not None:
            writer.add_string(a(K.ROPE_SCALING_TYPE), "yarn")
            writer.add_float32(a(K.ROPE_SCALING_FACTOR), self.yarn.factor)
            writer.add_uint32(a(K.ROPE_SCALING_ORIG_CTX), self.yarn.original_context_length)
            writer.add_float32(a(K.ROPE_SCALING_ATTN_FACTOR), self.yarn.attn_factor)
            writer.add_float32(a(K.ROPE_SCALING_BETA_FAST), self.yarn.beta_fast)
            writer.add_float32(a(K.ROPE_SCALING_BETA_SLOW), self.yarn.beta_slow)
        if self.sliding_window is not None:
            writer.add_uint32(a(K.SLIDING_WINDOW), self.sliding_window)
        writer.add_array(a(K.SLIDING_PATTERN), [bool(s) for s in self.sliding_pattern])
        writer.add_array(a(K.CAUSAL_PATTERN), [bool(c) for c in self.causal_pattern])
        writer.add_uint32(a(K.BLOCK_SIZE), self.block_size)
        writer.add_uint32(a(K.N_TARGET_LAYERS), self.n_taps)
        writer.add_array(a(K.TARGET_LAYER_IDS), [int(i) for i in self.target_layer_ids])
        writer.add_uint32(a(K.N_TARGET_FEATURES), self.n_taps * self.n_embd)
        writer.add_uint32(a(K.FEAT_DIM_PER_CAPTURE), self.n_embd)
        if self.n_target_layers is not None:
            writer.add_uint32(a(K.TARGET_BLOCK_COUNT), self.n_target_layers)
        writer.add_uint32(a(K.MASK_TOKEN_ID), self.mask_token_id)
        writer.add_string(a(K.FAMILY), self.family)
        writer.add_string(a(K.ROW_ALIGNMENT), self.row_alignment)
        writer.add_float32(a(K.INPUT_EMBEDDING_SCALE), self.input_embedding_scale)
        writer.add_float32(a(K.OUTPUT_MULTIPLIER), self.output_multiplier)
        writer.add_float32(a(K.FINAL_LOGIT_SOFTCAPPING), self.final_logit_softcapping or 0.0)
        if self.dspark is not None:
            d = self.dspark
            writer.add_uint32(a(K.DSPARK_ENABLED), 1)
            writer.add_uint32(a(K.DSPARK_MARKOV_RANK), d.markov_rank)
            writer.add_uint32(a(K.DSPARK_VOCAB_SIZE), self.n_vocab)
            writer.add_string(a(K.DSPARK_MARKOV_TYPE), d.markov_type)
            writer.add_bool(a(K.DSPARK_CONFIDENCE), d.confidence)
            writer.add_bool(a(K.DSPARK_CONFIDENCE_WITH_MARKOV), d.confidence_with_markov)
            if d.confidence:
                writer.add_uint32(a(K.DSPARK_CONFIDENCE_DIM), d.confidence_dim(self.n_embd))
        if self.dflash2 is not None:
            d2 = self.dflash2
            writer.add_uint32(a(K.DF2_CONV_KERNEL), d2.conv_kernel_size)
            writer.add_uint32(a(K.DF2_CONV_GROUP), d2.conv_group_size)
            writer.add_uint32(a(K.DF2_SELECTOR_RANK), d2.selector_rank)
            writer.add_uint32(a(K.DF2_SELECTOR_TOP_K), d2.selector_top_k)

    @classmethod
    def read_gguf_kv(cls, meta: GGUFMeta, arch: str) -> "DrafterHParams":
        """Read and validate the contract keys of ``arch`` from ``meta``.

        Raises DrafterFormatError naming the file and the full key when a required key is missing
        (family, alignment, taps, mask id, block size, θ, causality, shapes, …), has the wrong
        type, or contradicts another key (tap count vs ``dflash.target_layer_ids``, feature width,
        RoPE dimension, value length, DSpark vocabulary, confidence width).
        """
        a = lambda s: key(arch, s)  # noqa: E731
        n_embd = meta.get_int(a(K.EMBEDDING_LENGTH))
        n_layer = meta.get_int(a(K.BLOCK_COUNT))
        head_dim = meta.get_int(a(K.KEY_LENGTH))
        family = meta.get_str(a(K.FAMILY))
        theta = meta.get_float(a(K.ROPE_FREQ_BASE), finite=False)
        if not math.isfinite(theta):
            raise meta.error(a(K.ROPE_FREQ_BASE), f"= {theta} is not finite (NaN/inf RoPE base)")

        yarn = None
        rtype = meta.get_str(a(K.ROPE_SCALING_TYPE), required=False)
        if rtype is not None and rtype not in ("none", "yarn"):
            raise meta.error(a(K.ROPE_SCALING_TYPE), f"= {rtype!r}: only 'yarn' (or 'none') is supported")
        if rtype == "yarn":
            yarn = YarnParams(
                factor=meta.get_float(a(K.ROPE_SCALING_FACTOR)),
                original_context_length=meta.get_int(a(K.ROPE_SCALING_ORIG_CTX)),
                beta_fast=meta.get_float(a(K.ROPE_SCALING_BETA_FAST)),
                beta_slow=meta.get_float(a(K.ROPE_SCALING_BETA_SLOW)),
                attn_factor=meta.get_float(a(K.ROPE_SCALING_ATTN_FACTOR)),
            )
        else:
            for s in (K.ROPE_SCALING_FACTOR, K.ROPE_SCALING_ORIG_CTX):
                if meta.has(a(s)):
                    raise meta.error(a(s), f"is present but {a(K.ROPE_SCALING_TYPE)} is not 'yarn': contradictory")

        sliding = tuple(meta.get_bool_array(a(K.SLIDING_PATTERN)))
        causal = tuple(meta.get_bool_array(a(K.CAUSAL_PATTERN)))
        ids = tuple(meta.get_int_array(a(K.TARGET_LAYER_IDS)))
        softcap = meta.get_float(a(K.FINAL_LOGIT_SOFTCAPPING))

        dspark = None
        if meta.has(a(K.DSPARK_ENABLED)) or family == "dspark":
            if family != "dspark":
                raise meta.error(a(K.DSPARK_ENABLED), f"is present but {a(K.FAMILY)} = {family!r}: contradictory")
            if meta.get_int(a(K.DSPARK_ENABLED)) != 1:
                raise meta.error(a(K.DSPARK_ENABLED), "must be 1 for family 'dspark'")
            conf = meta.get_bool(a(K.DSPARK_CONFIDENCE))
            dspark = DSparkParams(
                markov_rank=meta.get_int(a(K.DSPARK_MARKOV_RANK)),
                markov_type=meta.get_str(a(K.DSPARK_MARKOV_TYPE)),
                confidence=conf,
                confidence_with_markov=meta.get_bool(a(K.DSPARK_CONFIDENCE_WITH_MARKOV)),
            )
        dflash2 = None
        df2_keys = (K.DF2_CONV_KERNEL, K.DF2_CONV_GROUP, K.DF2_SELECTOR_RANK, K.DF2_SELECTOR_TOP_K)
        if family == "dflash2" or any(meta.has(a(s)) for s in df2_keys):
            if family != "dflash2":
                present = next(a(s) for s in df2_keys if meta.has(a(s)))
                raise meta.error(present, f"is present but {a(K.FAMILY)} = {family!r}: contradictory")
            dflash2 = DFlash2Params(*(meta.get_int(a(s)) for s in df2_keys))

        hp = cls(
            family=family,
            row_alignment=meta.get_str(a(K.ROW_ALIGNMENT)),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=meta.get_int(a(K.FEED_FORWARD_LENGTH)),
            n_head=meta.get_int(a(K.HEAD_COUNT)),
            n_head_kv=meta.get_int(a(K.HEAD_COUNT_KV)),
            head_dim=head_dim,
            n_vocab=meta.get_int(a(K.VOCAB_SIZE)),
            rms_eps=meta.get_float(a(K.RMS_EPS)),
            rope_theta=theta,
            yarn=yarn,
            sliding_window=meta.get_int(a(K.SLIDING_WINDOW), required=False),
            sliding_pattern=sliding,
            causal_pattern=causal,
            block_size=meta.get_int(a(K.BLOCK_SIZE)),
            mask_token_id=meta.get_int(a(K.MASK_TOKEN_ID)),
            target_layer_ids=ids,
            n_target_layers=meta.get_int(a(K.TARGET_BLOCK_COUNT), required=False),
            context_length=meta.get_int(a(K.CONTEXT_LENGTH), required=False),
            input_embedding_scale=meta.get_float(a(K.INPUT_EMBEDDING_SCALE)),
            output_multiplier=meta.get_float(a(K.OUTPUT_MULTIPLIER)),
            final_logit_softcapping=None if softcap == 0.0 else softcap,
            dspark=dspark,
            dflash2=dflash2,
        )
        hp.validate(meta.path, {f: a(s) for f, s in _FIELD_SUFFIX.items()})

        # cross-checks between redundant keys
        def same(suffix: str, expected: int | None, what: str, required: bool = False) -> None:
            got = meta.get_int(a(suffix), required=required)
            if got is not None and expected is not None and got != expected:
                raise meta.error(a(suffix), f"= {got} contradicts {what} = {expected}")

        same(K.N_TARGET_LAYERS, hp.n_taps, f"the length of {a(K.TARGET_LAYER_IDS)}", required=True)
        same(K.N_TARGET_FEATURES, hp.n_taps * hp.n_embd, "taps × hidden size")
        same(K.FEAT_DIM_PER_CAPTURE, hp.n_embd, a(K.EMBEDDING_LENGTH))
        same(K.VALUE_LENGTH, hp.head_dim, a(K.KEY_LENGTH))
        same(K.ROPE_DIM, hp.head_dim, f"{a(K.KEY_LENGTH)} (drafters rotate the full head)")
        if dspark is not None:
            same(K.DSPARK_VOCAB_SIZE, hp.n_vocab, a(K.VOCAB_SIZE))
            same(K.DSPARK_CONFIDENCE_DIM, dspark.confidence_dim(hp.n_embd) if dspark.confidence else None,
                 "hidden (+ markov rank when the confidence head takes the Markov feature)")
        return hp


# field (or sub-field) → GGUF key suffix, for error messages and validate()
_FIELD_SUFFIX = {
    "family": K.FAMILY, "row_alignment": K.ROW_ALIGNMENT, "n_embd": K.EMBEDDING_LENGTH,
    "n_layer": K.BLOCK_COUNT, "n_ff": K.FEED_FORWARD_LENGTH, "n_head": K.HEAD_COUNT,
    "n_head_kv": K.HEAD_COUNT_KV, "head_dim": K.KEY_LENGTH, "n_vocab": K.VOCAB_SIZE,
    "rms_eps": K.RMS_EPS, "rope_theta": K.ROPE_FREQ_BASE,
    "yarn.factor": K.ROPE_SCALING_FACTOR, "yarn.original_context_length": K.ROPE_SCALING_ORIG_CTX,
    "yarn.beta_fast": K.ROPE_SCALING_BETA_FAST, "yarn.beta_slow": K.ROPE_SCALING_BETA_SLOW,
    "yarn.attn_factor": K.ROPE_SCALING_ATTN_FACTOR,
    "sliding_window": K.SLIDING_WINDOW, "sliding_pattern": K.SLIDING_PATTERN,
    "causal_pattern": K.CAUSAL_PATTERN, "block_size": K.BLOCK_SIZE, "mask_token_id": K.MASK_TOKEN_ID,
    "target_layer_ids": K.TARGET_LAYER_IDS, "n_target_layers": K.TARGET_BLOCK_COUNT,
    "context_length": K.CONTEXT_LENGTH, "input_embedding_scale": K.INPUT_EMBEDDING_SCALE,
    "output_multiplier": K.OUTPUT_MULTIPLIER, "final_logit_softcapping": K.FINAL_LOGIT_SOFTCAPPING,
    "dspark.markov_rank": K.DSPARK_MARKOV_RANK, "dspark.markov_type": K.DSPARK_MARKOV_TYPE,
    "dspark.confidence_with_markov": K.DSPARK_CONFIDENCE_WITH_MARKOV,
    "dflash2.conv_kernel_size": K.DF2_CONV_KERNEL, "dflash2.conv_group_size": K.DF2_CONV_GROUP,
    "dflash2.selector_rank": K.DF2_SELECTOR_RANK, "dflash2.selector_top_k": K.DF2_SELECTOR_TOP_K,
}
GGUF_FIELD_KEYS = {f: key(ARCH, s) for f, s in _FIELD_SUFFIX.items()}
