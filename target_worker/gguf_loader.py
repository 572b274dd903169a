"""Open a qwen35 GGUF target: typed hyperparameters, validation and zero-copy weight views.

The file format is GGUF v3 as written by llama.cpp's converter for Qwen3.5 dense models
(architecture ``qwen35``); the contract — keys, tensor names, ne shapes, transforms — is
docs/qwen35-target.md §3-§5. Sources: llama.cpp ``src/llama-model.cpp`` (qwen35 hparams and tensor
loading), ``gguf-py/gguf/constants.py``; lucebox-hub ``server/src/qwen35/gguf_target_loader.cpp``
(which layer sets must be present).

Everything here is pure data: :func:`load_qwen35` memory-maps the file with ``gguf.GGUFReader``,
reads every hyperparameter into :class:`Qwen35HParams`, checks every tensor against the shape and
dtype the hyperparameters imply and exposes the weights as :class:`specd.native.Tensor` views of the
mapping (no copies; shapes in numpy order ``(out, in)``). No forward math lives here.

Every problem raises :class:`TargetFileError` (a ``ValueError``) whose message starts with the file
path and names the key or tensor and what was expected.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Iterable, Union

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from specd.native import DType, Tensor

ARCH = "qwen35"

# Formats specd reads for weights (qwen35-target.md §10.1), as ggml type ids.
SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS)

_INT_TYPES = {
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_REQUIRED = object()
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


class TargetFileError(ValueError):
    """A target GGUF specd cannot serve. The message names the file, the key or tensor, and what
    was expected."""


# --------------------------------------------------------------------------------------------
# Hyperparameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen35HParams:
    """Hyperparameters of a qwen35 target (GGUF keys ``qwen35.*``, qwen35-target.md §3).

    Counts are plain integers; dims are elements. ``recurrent[i]`` is True when trunk layer i is a
    Gated DeltaNet layer and False for gated full attention. MTP blocks (``n_nextn``) sit after the
    trunk at indices ``n_layer ..  n_layer + n_nextn - 1``.
    """

    n_layer: int  # trunk decoder layers = block_count - nextn_predict_layers
    n_nextn: int  # nextn_predict_layers (MTP blocks appended after the trunk)
    n_vocab: int  # token_embd.weight ne1 (not a key)
    n_embd: int  # embedding_length, hidden size H
    n_ff: int  # feed_forward_length, dense FFN width I
    n_head: int  # attention.head_count, Hq
    n_head_kv: int  # attention.head_count_kv, Hkv
    head_dim: int  # attention.key_length == attention.value_length, hd
    rms_eps: float  # attention.layer_norm_rms_epsilon
    rope_freq_base: float  # rope.freq_base, theta
    n_rot: int  # rope.dimension_count: rotated dims per head (head_dim * partial_rotary_factor)
    rope_sections: tuple[int, int, int, int]  # rope.dimension_sections (M-RoPE, text uses 1-D)
    context_length: int | None  # context_length (max_position_embeddings); None when absent
    ssm_conv_kernel: int  # ssm.conv_kernel, K
    ssm_state_size: int  # ssm.state_size = GDN key head dim dk (== dv)
    ssm_group_count: int  # ssm.group_count = GDN key heads Hk
    ssm_time_step_rank: int  # ssm.time_step_rank = GDN value heads Hv
    ssm_inner_size: int  # ssm.inner_size = Hv * dv
    full_attention_interval: int  # full_attention_interval
    recurrent: tuple[bool, ...]  # per trunk layer, True = GDN (recurrent_layers or interval rule)
    file_type: int | None = None  # general.file_type (llama_ftype), informational

    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_nextn

    @property
    def head_k_dim(self) -> int:
        return self.ssm_state_size

    @property
    def head_v_dim(self) -> int:
        return self.ssm_inner_size // self.ssm_time_step_rank

    @property
    def n_k_heads(self) -> int:
        return self.ssm_group_count

    @property
    def n_v_heads(self) -> int:
        return self.ssm_time_step_rank

    @property
    def v_per_k(self) -> int:
        """Value heads per key head r = Hv / Hk."""
        return self.n_v_heads // self.n_k_heads

    @property
    def key_dim(self) -> int:
        """Hk * dk: width of the GDN q (and k) channels."""
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """Hv * dv: width of the GDN v channels (= ssm.inner_size)."""
        return self.ssm_inner_size

    @property
    def conv_channels(self) -> int:
        """C = 2 * Hk * dk + Hv * dv."""
        return 2 * self.key_dim + self.value_dim

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if not r)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if r)

    @property
    def n_full(self) -> int:
        return len(self.full_layers)

    @property
    def n_delta(self) -> int:
        return len(self.gdn_layers)


def interval_schedule(n_layer: int, interval: int) -> tuple[bool, ...]:
    """Layer kinds by the interval rule: layer i is full attention iff (i + 1) % interval == 0.
    Returns the per-layer "is GDN" flags."""
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


def check_hparams(hp: Qwen35HParams, where: str) -> None:
    """Consistency rules of qwen35-target.md §3 (dims positive, dk == dv, head divisibility, rope
    sections). Raises TargetFileError naming ``where`` and the key."""
    positive = {
        "block_count - nextn_predict_layers": hp.n_layer, "embedding_length": hp.n_embd,
        "feed_forward_length": hp.n_ff, "attention.head_count": hp.n_head,
        "attention.head_count_kv": hp.n_head_kv, "attention.key_length": hp.head_dim,
        "ssm.conv_kernel": hp.ssm_conv_kernel, "ssm.state_size": hp.ssm_state_size,
        "ssm.group_count": hp.ssm_group_count, "ssm.time_step_rank": hp.ssm_time_step_rank,
        "ssm.inner_size": hp.ssm_inner_size, "full_attention_interval": hp.full_attention_interval,
    }
    for key, value in positive.items():
        _expect(value > 0, where, f"{_k(key)} is {value}; expected a positive value")
    _expect(hp.n_vocab > 0, where, f"tensor 'token_embd.weight' has {hp.n_vocab} rows; expected > 0")
    _expect(hp.n_head % hp.n_head_kv == 0, where,
            f"{_k('attention.head_count')} ({hp.n_head}) is not a multiple of "
            f"{_k('attention.head_count_kv')} ({hp.n_head_kv})")
    _expect(hp.ssm_inner_size % hp.ssm_time_step_rank == 0, where,
            f"{_k('ssm.inner_size')} ({hp.ssm_inner_size}) is not a multiple of "
            f"{_k('ssm.time_step_rank')} ({hp.ssm_time_step_rank})")
    _expect(hp.head_v_dim == hp.ssm_state_size, where,
            f"GDN value head dim {_k('ssm.inner_size')}/{_k('ssm.time_step_rank')} = "
            f"{hp.ssm_inner_size / hp.ssm_time_step_rank:g} differs from the key head dim "
            f"{_k('ssm.state_size')} = {hp.ssm_state_size}; qwen35 GGUFs require dk == dv")
    _expect(hp.n_v_heads % hp.n_k_heads == 0, where,
            f"{_k('ssm.time_step_rank')} ({hp.n_v_heads}) is not a multiple of "
            f"{_k('ssm.group_count')} ({hp.n_k_heads})")
    _expect(0 < hp.n_rot <= hp.head_dim and hp.n_rot % 2 == 0, where,
            f"{_k('rope.dimension_count')} is {hp.n_rot}; expected an even value in [2, {hp.head_dim}]")
    _expect(min(hp.rope_sections) >= 0 and 2 * sum(hp.rope_sections) <= hp.head_dim, where,
            f"{_k('rope.dimension_sections')} is {list(hp.rope_sections)}; expected 4 non-negative "
            f"values with 2*sum <= key_length ({hp.head_dim})")
    _expect(hp.rms_eps > 0 and np.isfinite(hp.rms_eps), where,
            f"{_k('attention.layer_norm_rms_epsilon')} is {hp.rms_eps}; expected a positive finite value")
    _expect(hp.rope_freq_base > 0 and np.isfinite(hp.rope_freq_base), where,
            f"{_k('rope.freq_base')} is {hp.rope_freq_base}; expected a positive finite value")
    _expect(len(hp.recurrent) == hp.n_layer, where,
            f"layer schedule has {len(hp.recurrent)} entries for {hp.n_layer} trunk layers")


def _k(suffix: str) -> str:
    """Quoted GGUF key name for messages."""
    return f"'{ARCH}.{suffix}'"


def _expect(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise TargetFileError(f"{where}: {message}")


class _Keys:
    """Typed access to the metadata of one GGUF file; errors name the file and the key."""

    def __init__(self, reader: GGUFReader, path: str):
        self.fields = reader.fields
        self.path = path

    def _field(self, key: str, default):
        field = self.fields.get(key)
        if field is None and default is _REQUIRED:
            raise TargetFileError(f"{self.path}: required metadata key '{key}' is missing")
        return field

    def _scalar(self, key: str, allowed: set, what: str, default):
        field = self._field(key, default)
        if field is None:
            return default
        if len(field.types) != 1 or field.types[0] not in allowed:
            raise TargetFileError(f"{self.path}: metadata key '{key}' has type "
                                  f"{_type_name(field.types)}; expected {what}")
        return field.contents()

    def int(self, key: str, default=_REQUIRED):
        value = self._scalar(key, _INT_TYPES, "an integer", default)
        return value if value is None else int(value)

    def float(self, key: str, default=_REQUIRED):
        """A float key; float32 values come back as the shortest decimal that rounds to them."""
        field = self.fields.get(key)
        value = self._scalar(key, _FLOAT_TYPES, "a float", default)
        if field is not None and field.types[0] == GGUFValueType.FLOAT32:
            return f32_decimal(value)
        return value if value is None else float(value)

    def string(self, key: str, default=_REQUIRED):
        return self._scalar(key, {GGUFValueType.STRING}, "a string", default)

    def array(self, key: str, allowed: set, what: str, default=_REQUIRED):
        field = self._field(key, default)
        if field is None:
            return default
        if field.types[0] != GGUFValueType.ARRAY or field.types[-1] not in allowed:
            raise TargetFileError(f"{self.path}: metadata key '{key}' has type "
                                  f"{_type_name(field.types)}; expected an array of {what}")
        return list(field.contents())


def f32_decimal(x: float) -> float:
    """Shortest decimal that rounds to the same float32 (1e-06, not 9.99999997e-07)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def _type_name(types: list) -> str:
    return "[" + " of ".join(t.name for t in types) + "]" if types else "unknown"


def read_hparams(reader: GGUFReader, path: str | os.PathLike) -> Qwen35HParams:
    """Read and validate the qwen35 hyperparameters of an open GGUF (qwen35-target.md §3).

    ``n_vocab`` comes from ``token_embd.weight`` ne1. The layer schedule comes from
    ``qwen35.attention.recurrent_layers`` (bool array over block_count, MTP entries False) when
    present, else from the interval rule. Raises TargetFileError for another architecture
    (``qwen35moe`` included), a missing required key, a key of the wrong type, or inconsistent values.
    """
    path = str(path)
    keys = _Keys(reader, path)
    arch = keys.string("general.architecture")
    if arch != ARCH:
        hint = " (the MoE variant is not supported)" if arch == "qwen35moe" else ""
        raise TargetFileError(f"{path}: general.architecture is '{arch}'{hint}; specd serves only "
                              f"'{ARCH}' (dense Qwen3.5) targets")
    block_count = keys.int(f"{ARCH}.block_count")
    n_nextn = keys.int(f"{ARCH}.nextn_predict_layers", 0)
    _expect(0 <= n_nextn < block_count, path,
            f"'{ARCH}.nextn_predict_layers' ({n_nextn}) must be in [0, block_count={block_count})")
    n_layer = block_count - n_nextn
    head_dim = keys.int(f"{ARCH}.attention.key_length")
    value_length = keys.int(f"{ARCH}.attention.value_length")
    _expect(head_dim == value_length, path,
            f"'{ARCH}.attention.key_length' ({head_dim}) != '{ARCH}.attention.value_length' "
            f"({value_length}); qwen35 requires equal attention key and value head dims")
    interval = keys.int(f"{ARCH}.full_attention_interval")
    _expect(interval > 0, path, f"'{ARCH}.full_attention_interval' is {interval}; expected >= 1")
    hp = Qwen35HParams(
        n_layer=n_layer,
        n_nextn=n_nextn,
        n_vocab=_vocab_rows(reader, path),
        n_embd=keys.int(f"{ARCH}.embedding_length"),
        n_ff=keys.int(f"{ARCH}.feed_forward_length"),
        n_head=keys.int(f"{ARCH}.attention.head_count"),
        n_head_kv=keys.int(f"{ARCH}.attention.head_count_kv"),
        head_dim=head_dim,
        rms_eps=keys.float(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_freq_base=keys.float(f"{ARCH}.rope.freq_base", 1e7),
        n_rot=keys.int(f"{ARCH}.rope.dimension_count", 64),
        rope_sections=_rope_sections(keys),
        context_length=keys.int(f"{ARCH}.context_length", None),
        ssm_conv_kernel=keys.int(f"{ARCH}.ssm.conv_kernel"),
        ssm_state_size=keys.int(f"{ARCH}.ssm.state_size"),
        ssm_group_count=keys.int(f"{ARCH}.ssm.group_count"),
        ssm_time_step_rank=keys.int(f"{ARCH}.ssm.time_step_rank"),
        ssm_inner_size=keys.int(f"{ARCH}.ssm.inner_size"),
        full_attention_interval=interval,
        recurrent=_schedule(keys, block_count, n_layer, interval),
        file_type=keys.int("general.file_type", None),
    )
    check_hparams(hp, path)
    return hp


def _rope_sections(keys: _Keys) -> tuple[int, int, int, int]:
    key = f"{ARCH}.rope.dimension_sections"
    values = keys.array(key, _INT_TYPES, "integers")
    _expect(len(values) == 4, keys.path, f"metadata key '{key}' has {len(values)} entries; expected 4")
    return tuple(int(v) for v in values)  # type: ignore[return-value]


def _schedule(keys: _Keys, block_count: int, n_layer: int, interval: int) -> tuple[bool, ...]:
    key = f"{ARCH}.attention.recurrent_layers"
    flags = keys.array(key, {GGUFValueType.BOOL}, "bools", None)
    if flags is None:
        return interval_schedule(n_layer, interval)
    _expect(len(flags) == block_count, keys.path,
            f"metadata key '{key}' has {len(flags)} entries; expected block_count = {block_count}")
    _expect(not any(flags[n_layer:]), keys.path,
            f"metadata key '{key}' marks an MTP block (index >= {n_layer}) as recurrent; "
            "MTP blocks are full attention")
    return tuple(bool(f) for f in flags[:n_layer])


def _vocab_rows(reader: GGUFReader, path: str) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            _expect(len(t.shape) == 2, path, f"tensor 'token_embd.weight' has ne {_ne(t)}; expected 2-D [H, V]")
            return int(t.shape[1])
    raise TargetFileError(f"{path}: required tensor 'token_embd.weight' is missing")


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FullAttnLayer:
    """Gated full-attention decoder layer (qwen35-target.md §4.2-§4.3, §6.3). Field names are the
    GGUF names (``blk.{index}.{field}.weight``); tensors are (out, in) views of the file.

    attn_q is (2*Hq*hd, H) with query and gate packed per head ([q(hd) | gate(hd)] per head);
    attn_k/attn_v (Hkv*hd, H); attn_output (H, Hq*hd); q/k norms (hd,) F32 with the +1 folded in;
    attn_norm/post_attention_norm (H,) F32 (+1 folded in); ffn_gate/ffn_up (I, H); ffn_down (H, I).
    """

    index: int
    attn_norm: Tensor
    attn_q: Tensor
    attn_k: Tensor
    attn_v: Tensor
    attn_output: Tensor
    attn_q_norm: Tensor
    attn_k_norm: Tensor
    post_attention_norm: Tensor
    ffn_gate: Tensor
    ffn_up: Tensor
    ffn_down: Tensor


@dataclass(frozen=True)
class GDNLayer:
    """Gated DeltaNet decoder layer (qwen35-target.md §4.2, §4.4, §6.5), value heads in tiled
    order (value head j uses key head j mod Hk). Field names are the GGUF names; tensors are (out,
    in) views of the file.

    attn_qkv (C, H) with output channels [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]; attn_gate (Hv*dv, H);
    ssm_beta/ssm_alpha (Hv, H); ssm_a (Hv,) F32 = -exp(A_log); ssm_dt (Hv,) F32 dt bias;
    ssm_conv1d (C, K) F32, tap K-1 multiplies the current token; ssm_norm (dv,) F32 plain gain;
    ssm_out (H, Hv*dv); attn_norm/post_attention_norm (H,) F32 (+1 folded in); FFN as FullAttnLayer.
    """

    index: int
    attn_norm: Tensor
    attn_qkv: Tensor
    attn_gate: Tensor
    ssm_beta: Tensor
    ssm_alpha: Tensor
    ssm_a: Tensor
    ssm_dt: Tensor
    ssm_conv1d: Tensor
    ssm_norm: Tensor
    ssm_out: Tensor
    post_attention_norm: Tensor
    ffn_gate: Tensor
    ffn_up: Tensor
    ffn_down: Tensor


Layer = Union[FullAttnLayer, GDNLayer]


@dataclass(frozen=True)
class Qwen35Weights:
    """All trunk weights of a qwen35 GGUF as zero-copy views of its memory map.

    token_embd (V, H); output_norm (H,) F32 (+1 folded in); output (V, H), the same Tensor as
    token_embd when the file has no ``output.weight`` (``output_tied``). ``layers[i]`` is a
    FullAttnLayer or GDNLayer following ``hparams.recurrent``. ``skipped`` lists the MTP tensors
    present in the file and not loaded.
    """

    path: str
    hparams: Qwen35HParams
    token_embd: Tensor
    output_norm: Tensor
    output: Tensor
    output_tied: bool
    layers: tuple[Layer, ...]
    skipped: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor: GGUF name, ne shape (ggml order, ne0 first) and whether it must be F32."""

    name: str
    ne: tuple[int, ...]
    f32_only: bool


def gguf_name(index: int, field: str) -> str:
    """GGUF name of a layer field: ``blk.{i}.{field}.weight``, ``blk.{i}.ssm_a``, ``blk.{i}.ssm_dt.bias``."""
    suffix = {"ssm_a": "", "ssm_dt": ".bias"}.get(field, ".weight")
    return f"blk.{index}.{field}{suffix}"


def layer_ne(hp: Qwen35HParams) -> dict[str, tuple[int, ...]]:
    """ne shape of every layer field (both layer kinds), qwen35-target.md §4.2-§4.4."""
    H, I, hd = hp.n_embd, hp.n_ff, hp.head_dim
    Hv, C = hp.n_v_heads, hp.conv_channels
    return {
        "attn_norm": (H,), "post_attention_norm": (H,),
        "ffn_gate": (H, I), "ffn_up": (H, I), "ffn_down": (I, H),
        "attn_q": (H, 2 * hp.q_dim), "attn_k": (H, hp.kv_dim), "attn_v": (H, hp.kv_dim),
        "attn_output": (hp.q_dim, H), "attn_q_norm": (hd,), "attn_k_norm": (hd,),
        "attn_qkv": (H, C), "attn_gate": (H, hp.value_dim), "ssm_beta": (H, Hv), "ssm_alpha": (H, Hv),
        "ssm_a": (Hv,), "ssm_dt": (Hv,), "ssm_conv1d": (hp.ssm_conv_kernel, C),
        "ssm_norm": (hp.head_v_dim,), "ssm_out": (hp.value_dim, H),
    }


def _f32_only(field: str) -> bool:
    return field.endswith("norm") or field in ("ssm_a", "ssm_dt", "ssm_conv1d")


def layer_class(hp: Qwen35HParams, index: int) -> type:
    return GDNLayer if hp.recurrent[index] else FullAttnLayer


def layer_fields(cls: type) -> list[str]:
    """The tensor fields of a layer dataclass, in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if f.name != "index"]


def expected_tensors(hp: Qwen35HParams) -> dict[str, TensorSpec]:
    """Every trunk tensor a qwen35 GGUF must (or, for ``output.weight``, may) hold, by name."""
    H, V = hp.n_embd, hp.n_vocab
    specs = [TensorSpec("token_embd.weight", (H, V), False), TensorSpec("output_norm.weight", (H,), True),
             TensorSpec("output.weight", (H, V), False)]
    shapes = layer_ne(hp)
    for i in range(hp.n_layer):
        for field in layer_fields(layer_class(hp, i)):
            specs.append(TensorSpec(gguf_name(i, field), shapes[field], _f32_only(field)))
    return {s.name: s for s in specs}


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Memory-map a GGUF file read-only with ``gguf.GGUFReader``.

    Raises TargetFileError when the file is missing, is not GGUF, is truncated (the reader fails,
    or a tensor's data range ends past the end of the file) or is otherwise unreadable.
    """
    path = str(path)
    if not os.path.isfile(path):
        raise TargetFileError(f"{path}: no such file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/KeyError/IndexError on bad bytes
        raise TargetFileError(f"{path}: not a readable GGUF file (truncated or corrupt): "
                              f"{type(exc).__name__}: {exc}") from exc
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        _expect(end <= size, path, f"tensor '{t.name}' data ends at byte {end}, past the end of the "
                                   f"file ({size} bytes): the file is truncated")
    return reader


def load_qwen35(path: str | os.PathLike, reader: GGUFReader | None = None) -> Qwen35Weights:
    """Open, validate and map a qwen35 GGUF target.

    Checks, in order: architecture, hyperparameters (:func:`read_hparams`), then every tensor:
    each expected trunk tensor is present with its exact ne shape and a supported dtype (norms,
    ssm_conv1d, ssm_a and ssm_dt must be F32), ``output.weight`` is optional (tied to
    token_embd), tensors of MTP blocks (``blk.i`` with i >= n_layer) are skipped, any other tensor
    is an error. Raises TargetFileError naming the file and the key or tensor.
    """
    path = str(path)
    reader = reader if reader is not None else open_gguf(path)
    hp = read_hparams(reader, path)
    specs = expected_tensors(hp)
    found, skipped = _index_tensors(reader, hp, specs, path)
    views = {name: _view(t, specs[name], path) for name, t in found.items()}
    for name in specs:
        _expect(name in views or name == "output.weight", path, f"required tensor '{name}' is missing")
    tied = "output.weight" not in views
    layers = tuple(_layer(hp, i, views) for i in range(hp.n_layer))
    return Qwen35Weights(path=path, hparams=hp, token_embd=views["token_embd.weight"],
                         output_norm=views["output_norm.weight"],
                         output=views["token_embd.weight"] if tied else views["output.weight"],
                         output_tied=tied, layers=layers, skipped=tuple(skipped))


def _index_tensors(reader: GGUFReader, hp: Qwen35HParams, specs: dict[str, TensorSpec], path: str):
    found: dict[str, ReaderTensor] = {}
    skipped: list[str] = []
    for t in reader.tensors:
        if t.name in specs:
            found[t.name] = t
        elif _is_mtp(t.name, hp):
            skipped.append(t.name)
        else:
            raise TargetFileError(f"{path}: unexpected tensor '{t.name}' (ne {_ne(t)}, "
                                  f"{t.tensor_type.name}); not part of the qwen35 layout for this file's "
                                  f"layer schedule")
    return found, skipped


def _is_mtp(name: str, hp: Qwen35HParams) -> bool:
    m = _BLK.match(name)
    return m is not None and hp.n_layer <= int(m.group(1)) < hp.block_count


def _ne(t: ReaderTensor) -> list[int]:
    return [int(d) for d in t.shape]


def _view(t: ReaderTensor, spec: TensorSpec, path: str) -> Tensor:
    ne = tuple(_ne(t))
    _expect(ne == spec.ne, path, f"tensor '{t.name}' has ne {list(ne)}; expected {list(spec.ne)}")
    kind = t.tensor_type
    if spec.f32_only:
        _expect(kind == QT.F32, path, f"tensor '{t.name}' is {kind.name}; expected F32")
    else:
        _expect(kind in SUPPORTED_TYPES, path,
                f"tensor '{t.name}' is {kind.name}; supported: {', '.join(q.name for q in SUPPORTED_TYPES)}")
    return native_view(t)


def native_view(t: ReaderTensor) -> Tensor:
    """Zero-copy specd.native.Tensor over a reader tensor's mapped bytes, shape (out, in).

    F32/F16 → float32/float16 arrays; BF16 → uint16 bits with DType.BF16; block formats → raw
    uint8 rows with their DType. (The explicit ``view`` normalises the reader's dtype object.)
    """
    kind = t.tensor_type
    if kind == QT.F32:
        return Tensor(t.data.view(np.float32))
    if kind == QT.F16:
        return Tensor(t.data.view(np.float16))
    if kind == QT.BF16:
        return Tensor(t.data.view(np.uint16), DType.BF16)
    return Tensor(t.data.view(np.uint8), DType(int(kind)))


def _layer(hp: Qwen35HParams, index: int, views: dict[str, Tensor]) -> Layer:
    cls = layer_class(hp, index)
    return cls(index=index, **{f: views[gguf_name(index, f)] for f in layer_fields(cls)})


# --------------------------------------------------------------------------------------------
# Tokenizer metadata
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerMetadata:
    """The ``tokenizer.*`` keys of a GGUF (llama.cpp conventions; qwen35-target.md §3).

    ``token_types`` uses llama.cpp's token types (1 normal, 2 unknown, 3 control, 4 user-defined,
    5 unused, 6 byte). Special ids are None when the key is absent.
    """

    model: str  # tokenizer.ggml.model, "gpt2" for byte-level BPE
    pre: str | None  # tokenizer.ggml.pre, "qwen35"
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    pad_id: int | None
    add_bos: bool | None
    chat_template: str | None

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS and EOT (LH treats both as end tokens), without duplicates."""
        return tuple(dict.fromkeys(i for i in (self.eos_id, self.eot_id) if i is not None))


def read_tokenizer_metadata(source: str | os.PathLike | GGUFReader) -> TokenizerMetadata | None:
    """Tokenizer metadata of a GGUF (path or open reader); None when it has no tokenizer.ggml.model.
    Raises TargetFileError when a tokenizer key has the wrong type."""
    reader = source if isinstance(source, GGUFReader) else open_gguf(source)
    keys = _Keys(reader, str(getattr(reader.data, "filename", source)))
    model = keys.string("tokenizer.ggml.model", None)
    if model is None:
        return None
    ints = lambda key: keys.int(key, None)  # noqa: E731
    add_bos = keys._scalar("tokenizer.ggml.add_bos_token", {GGUFValueType.BOOL}, "a bool", None)
    return TokenizerMetadata(
        model=model,
        pre=keys.string("tokenizer.ggml.pre", None),
        tokens=tuple(keys.array("tokenizer.ggml.tokens", {GGUFValueType.STRING}, "strings", [])),
        token_types=tuple(int(v) for v in keys.array("tokenizer.ggml.token_type", _INT_TYPES, "integers", [])),
        merges=tuple(keys.array("tokenizer.ggml.merges", {GGUFValueType.STRING}, "strings", [])),
        bos_id=ints("tokenizer.ggml.bos_token_id"),
        eos_id=ints("tokenizer.ggml.eos_token_id"),
        eot_id=ints("tokenizer.ggml.eot_token_id"),
        pad_id=ints("tokenizer.ggml.padding_token_id"),
        add_bos=None if add_bos is None else bool(add_bos),
        chat_template=keys.string("tokenizer.chat_template", None),
    )


def iter_layer_tensors(weights: Qwen35Weights) -> Iterable[tuple[str, Tensor]]:
    """(GGUF name, Tensor) for every loaded tensor: globals first, then layers in order."""
    yield "token_embd.weight", weights.token_embd
    yield "output_norm.weight", weights.output_norm
    if not weights.output_tied:
        yield "output.weight", weights.output
    for layer in weights.layers:
        for field in layer_fields(type(layer)):
            yield gguf_name(layer.index, field), getattr(layer, field)
