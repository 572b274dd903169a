"""Memory accounting of the target worker (issue 7): what the weights and every sequence take.

All sizes are bytes. The state a sequence holds (qwen35-target.md §8, model.py's module docstring):

* **KV cache** (model device): per full-attention layer a K and a V cache ``[capacity, Hkv, hd]`` of
  ``kv_dtype``; per token ``n_attn_layers * 2 * row_bytes(kv_dtype, Hkv * hd)``.
* **GDN recurrent state** (model device): per GDN layer S, float32 ``[Hv, dv, dk]``.
* **Conv state** (model device): per GDN layer the last K-1 conv inputs, float32 ``[K-1, C]``.
* **Verify buffers** (model device): what a deferred-commit verify of w rows keeps until Commit
  (``GDNPending``): per GDN layer conv inputs ``[w, C]``, q and k ``[w, Hk, dk]``, v ``[w, Hv, dv]``,
  g and beta ``[w, Hv]`` (float32) and, for a chain, the final S and conv state. With defer_commit
  every sequence may hold one, so it is counted per sequence at w = max_verify.
* **Feature ring** (host, POSIX shared memory with the shm transport): ``capacity`` float32 rows of
  ``n_taps * n_embd`` plus the slot table (:func:`.feature_shm.segment_bytes`). It does not count
  against device memory, but it does against /dev/shm. With the cuda-ipc transport
  (:mod:`.feature_cuda_ipc`) the rows (``4 * capacity * n_taps * n_embd``) are device memory, counted
  in ``sequence_bytes`` (``feature_ring_on_device``), and only the slot table (8 bytes per position
  plus a 64-byte header) stays in /dev/shm.
* **Kept state slots** (GPU with ``cuda_graphs``): a sequence's K/V caches have its capacity rounded up
  to 1024 rows, and up to ``slot_cache`` released sequences' states (K/V, GDN, conv) stay allocated for
  the next sequences with their captured graphs; counted in the workspace at ``max_seq_len``.
* **CUDA graph arenas** (GPU with ``cuda_graphs``): each captured chain verify keeps its own outputs
  (activations, logits, deferred-commit buffers of its width) in an arena; at most ``max_graphs``
  are kept, each counted at the widest captured width (16 rows). Part of the workspace. An estimate
  (:func:`cuda_graph_bytes` says what it leaves out); with ``measure`` the report also carries the
  measured arenas of the live graphs, commit graphs included (``cuda_graph_measured_bytes``).

``fits`` = how many sequences at ``max_seq_len`` fit a device of ``device_bytes`` after the weights
and a workspace reserve (:func:`workspace_bytes`: the widest forward in flight — a verify's
activations, logits and tree-verify state copies, or a prefill chunk's activations, transient
deferred-commit buffers and feature rows — plus a fixed allowance for the CUDA context and pool
fragmentation).

Worked example (tests/target/test_memory.py::test_27b_iq4xs_fits_one_h200): the 27B shapes of
tools/bench/random_qwen35.py CONFIGS["27b"] in the ``iq4xs`` mix (IQ4_XS body, Q5_K output, Q6_K
attn_v / ssm_out) are 14.96 GB of weights (13.93 GiB: IQ4_XS 12.77 GB, Q6_K 1.31, Q5_K 0.87, F32
0.01). At max_seq_len 32768 with an F16 KV cache one sequence takes 2.0 GiB of KV (64 KiB per
token), 144 MiB of recurrent state, 5.6 MiB of conv state and 274 MiB of verify buffers at
max_verify 33 (of which 144 MiB is the chain verify's final-S copy), 2.41 GiB in all. The workspace
reserve is 9.99 GiB with the default 2048-token prefill chunks (1.17 GiB for verifies alone; 3.36 GiB
with ``--prefill-chunk 512``): the chunk's 0.80 GiB of activations, 0.12 GiB of chunked-GDN scratch, 7.68 GiB of deferred-commit buffers
(48 GDN layers x 2048 rows) and 0.39 GiB of feature rows (5 taps), plus the 1 GiB reserve. On a
"141 GB" H200 counted as 141e9 bytes (131.3 GiB; the device itself reports ~139.8 GiB, so this is
conservative) **44** such sequences fit next to the weights (47 with 512-token chunks; Q8_0 KV: 72;
42 with the default 16 CUDA graph arenas, 40 with the 2 kept state slots of the default ``slot_cache``
too). The feature ring (5 taps: 100 KiB per position, 3.1 GiB per 32k sequence) is host shared
memory, not device memory, but 44 x 3.1 GiB = 138 GiB of /dev/shm is more than most hosts' /dev/shm
holds: at 32k, long-context serving needs a bounded ring (future work). With the cuda-ipc transport
the ring holds the whole sequence on the device instead (the capacity contract in feature_cuda_ipc):
2.41 + 3.13 = 5.54 GiB per 32k sequence, so about 19 sequences fit instead of 44.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import gguf

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

GRAPH_KV_STEP = 1024  # a captured verify's attention bound step (model.py); K/V rows with CUDA graphs: multiples


def graph_rows(positions: int) -> int:
    """``positions`` rounded up to a multiple of GRAPH_KV_STEP: a captured forward's attention bound
    (committed + w), and with CUDA graphs a sequence's K/V rows (its capacity)."""
    return -(-int(positions) // GRAPH_KV_STEP) * GRAPH_KV_STEP


# Fixed device reserve for the CUDA context, cuBLAS workspace and pool fragmentation (bytes).
CONTEXT_RESERVE_BYTES = 1 * GiB
H200_BYTES = 141 * 10**9  # "141 GB" of HBM3e (decimal), as NVIDIA states it; cudaMemGetInfo reports a bit less


def type_name(dtype) -> str:
    """GGML type name ("F16", "Q8_0", "IQ4_XS", ...) of an ``sn.DType``, a gguf type or a name."""
    if isinstance(dtype, str):
        return dtype.upper()
    return str(getattr(dtype, "name", dtype)).upper()


def tensor_bytes(shape: Iterable[int], dtype) -> int:
    """Bytes of a row-major tensor of ``shape`` (numpy order, last dim innermost) stored as ``dtype``;
    block types need a last dim that is a multiple of their block size (ValueError otherwise)."""
    shape = [int(s) for s in shape]
    name = type_name(dtype)
    try:
        blk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    except KeyError as exc:
        raise ValueError(f"unknown storage type {name!r}") from exc
    last = shape[-1] if shape else 1
    if last % blk:
        raise ValueError(f"last dim {last} is not a multiple of the {name} block ({blk})")
    return math.prod(shape[:-1]) * (last // blk) * size


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-sequence state sizes of a qwen35 target (bytes), from the hparams alone.

    kv_per_token: K + V of every full-attention layer for one position.
    recurrent: GDN S of every GDN layer (float32 [Hv, dv, dk]).
    conv: conv state of every GDN layer (float32 [K-1, C]).
    verify: the deferred-commit buffers of one chain verify of ``verify_width`` rows.
    feature_per_token: one feature-ring row (float32, n_taps * n_embd) plus its slot entry (8).
    """

    kv_per_token: int
    recurrent: int
    conv: int
    verify: int
    verify_width: int
    feature_per_token: int


def state_bytes(hp, kv_dtype, verify_width: int, n_taps: int) -> StateBytes:
    """:class:`StateBytes` for hparams ``hp``, KV type ``kv_dtype``, verifies of ``verify_width`` rows
    and ``n_taps`` capture layers (0 counts as 1: the ring then holds n_embd zeros per row)."""
    n_gdn = sum(1 for r in hp.recurrent if r)
    n_attn = hp.n_layer - n_gdn
    hk, hv, dk, dv, c = hp.n_k_heads, hp.n_v_heads, hp.head_k_dim, hp.head_v_dim, hp.conv_channels
    kv_tok = n_attn * 2 * tensor_bytes([hp.n_head_kv, hp.head_dim], kv_dtype)
    s = hv * dv * dk * 4
    conv = (hp.ssm_conv_kernel - 1) * c * 4
    w = int(verify_width)
    pending = 4 * w * (c + 2 * hk * dk + hv * dv + 2 * hv) + s + conv
    return StateBytes(kv_per_token=kv_tok, recurrent=n_gdn * s, conv=n_gdn * conv, verify=n_gdn * pending,
                      verify_width=w, feature_per_token=4 * max(1, n_taps) * hp.n_embd + 8)


def workspace_bytes(hp, verify_width: int, prefill_chunk: int = 0, n_taps: int = 0) -> int:
    """Device workspace estimate (bytes) for the widest forward in flight, a verify of
    ``verify_width`` rows or a prefill chunk of ``prefill_chunk`` rows: the normed hidden rows and
    logits (float32 [w, n_vocab] twice; a prefill chunk keeps one row of logits) and the widest layer
    activations (float32, a few [w, max(n_ff, C, q+gate)] buffers); for a verify, the tree verify's
    per-node state copies of one GDN layer (w * Hv*dv*dk*4); for a prefill chunk (a chain: one
    out-of-place S per GDN layer, no per-row states) its transient deferred-commit buffers (a prefill
    commits at once, so they are not per sequence) and its ``n_taps`` captured feature rows (float32
    [p, n_embd] per tap and their concatenation) and the chunked GDN recurrence's scratch (float32 U, W, G
    [Hv, p, dv + dk + 1] and P [Hv, ceil(p / 64), 64, 64]); plus :data:`CONTEXT_RESERVE_BYTES`. Forwards
    run one at a time (one model lock)."""
    widest = max(hp.n_ff, hp.conv_channels, 2 * hp.n_head * hp.head_dim, hp.n_embd)

    def act(w: int, logit_rows: int) -> int:
        return 2 * 4 * logit_rows * hp.n_vocab + 6 * 4 * w * widest

    w = int(verify_width)
    p = int(prefill_chunk)
    verify = act(w, w) + w * hp.n_v_heads * hp.head_v_dim * hp.head_k_dim * 4
    gdn_chunked = 4 * hp.n_v_heads * (p * (hp.head_v_dim + hp.head_k_dim + 1) + -(-p // 64) * 64 * 64)
    prefill = (act(p, 1) + state_bytes(hp, "F32", p, 1).verify + 2 * 4 * p * int(n_taps) * hp.n_embd + gdn_chunked
               if p > 0 else 0)
    return max(verify, prefill) + CONTEXT_RESERVE_BYTES


def cuda_graph_bytes(hp, max_graphs: int, n_taps: int, graph_width: int = 16) -> int:
    """Device bytes the arenas of ``max_graphs`` captured chain verifies may hold, each counted at
    ``graph_width`` rows: one verify's activations and logits (:func:`workspace_bytes` without the
    context reserve) plus its deferred-commit buffers (:func:`state_bytes` ``.verify``).

    An estimate, not a bound: it leaves out the arenas of the commit graphs (one per committed
    length n of each verify graph, each at least the 2 MiB minimum chunk when it allocates), the
    slack of the arena's chunks (the 64 MiB reservation and chunks of 2 to 64 MiB are rarely full),
    blocks the arena could not reuse, and graphs that results still hold after eviction. The
    measured figure is ``MemoryReport.cuda_graph_measured_bytes`` (live graphs only)."""
    one = (workspace_bytes(hp, graph_width) - CONTEXT_RESERVE_BYTES
           + state_bytes(hp, "F32", graph_width, n_taps).verify)
    return int(max_graphs) * one


def weight_bytes_from_types(hp, types: Mapping[str, object] | None = None, default="F32") -> dict[str, int]:
    """Bytes per storage type of the trunk weights that the loader loads (``expected_tensors``,
    output.weight included; pass ``types["output.weight"] = None`` for a tied head) when tensor
    ``name`` is stored as ``types[name]`` (else ``default``). GGUF ne is reversed to numpy order."""
    from .gguf_loader import expected_tensors

    types = dict(types or {})
    out: dict[str, int] = {}
    for name, spec in expected_tensors(hp).items():
        t = types.get(name, default)
        if t is None:
            continue
        n = type_name(t)
        out[n] = out.get(n, 0) + tensor_bytes(tuple(reversed(spec.ne)), n)
    return out


def fits(device_bytes: int, weight_bytes: int, sequence_bytes: int, workspace: int) -> int:
    """Sequences of ``sequence_bytes`` each that fit in ``device_bytes`` after the weights and the
    workspace (0 when not even the weights fit)."""
    room = int(device_bytes) - int(weight_bytes) - int(workspace)
    return max(0, room // max(1, int(sequence_bytes)))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Memory of a target worker (bytes; "device" = where the model runs: host RAM on the CPU).

    Fields: device ("cpu" / "cuda"); weight_bytes and weight_bytes_by_type (as stored on the model's
    device: stored types on either device); kv_dtype; kv_bytes_per_token;
    max_seq_len; kv_bytes_per_sequence (at max_seq_len); recurrent_bytes_per_sequence;
    conv_bytes_per_sequence; verify_width and verify_bytes_per_sequence (deferred-commit buffers of
    one verify of that width); sequence_bytes (device bytes per sequence: KV + recurrent + conv +
    verify); feature_ring_bytes_per_sequence (host shared memory at max_seq_len); workspace_bytes
    (:func:`workspace_bytes`); max_sequences and total_bytes (weights + workspace + max_sequences *
    sequence_bytes); host_feature_bytes (max_sequences rings); device_total_bytes /
    device_free_bytes / pool_used_bytes / pool_reserved_bytes (measured, GPU only; 0 unknown);
    fits_sequences (sequences at max_seq_len that fit device_total_bytes; -1 unknown, e.g. CPU);
    cuda_graph_bytes (the estimate of :func:`cuda_graph_bytes` at max_graphs, part of workspace_bytes);
    cuda_graph_measured_bytes (measured, with ``measure`` on a model with CUDA graphs: the arenas of
    its live verify and commit graphs, GpuGraph.arena_bytes; 0 otherwise); feature_ring_on_device
    (cuda-ipc transport: the ring's rows are device memory, included in sequence_bytes, and
    host_feature_bytes counts only the slot tables); slot_cache_bytes (with CUDA graphs: the states of
    the model's slot_cache kept released sequences at max_seq_len, part of workspace_bytes).
    """

    device: str
    weight_bytes: int
    weight_bytes_by_type: dict
    kv_dtype: str
    kv_bytes_per_token: int
    max_seq_len: int
    kv_bytes_per_sequence: int
    recurrent_bytes_per_sequence: int
    conv_bytes_per_sequence: int
    verify_width: int
    verify_bytes_per_sequence: int
    sequence_bytes: int
    feature_ring_bytes_per_sequence: int
    workspace_bytes: int
    max_sequences: int
    total_bytes: int
    host_feature_bytes: int
    device_total_bytes: int = 0
    device_free_bytes: int = 0
    pool_used_bytes: int = 0
    pool_reserved_bytes: int = 0
    fits_sequences: int = -1
    cuda_graph_bytes: int = 0
    cuda_graph_measured_bytes: int = 0
    feature_ring_on_device: bool = False
    slot_cache_bytes: int = 0
    feature_transport: str = "shm"  # "inline": no ring at all (rows travel in the messages)

    def fits_on(self, device_bytes: int) -> int:
        """Sequences at max_seq_len that fit ``device_bytes`` next to the weights and workspace."""
        return fits(device_bytes, self.weight_bytes, self.sequence_bytes, self.workspace_bytes)

    def lines(self) -> list[str]:
        """A readable block (one item per line) for logs and the CLI."""
        types = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(self.weight_bytes_by_type.items(), key=lambda kv: -kv[1]))
        out = [f"memory ({self.device}):",
               f"  weights            {_fmt(self.weight_bytes)} ({types})",
               f"  KV cache           {_fmt(self.kv_bytes_per_token)} per token ({self.kv_dtype}), "
               f"{_fmt(self.kv_bytes_per_sequence)} per sequence at {self.max_seq_len}",
               f"  recurrent state    {_fmt(self.recurrent_bytes_per_sequence)} per sequence",
               f"  conv state         {_fmt(self.conv_bytes_per_sequence)} per sequence",
               f"  verify buffers     {_fmt(self.verify_bytes_per_sequence)} per sequence (width {self.verify_width})",
               f"  per sequence       {_fmt(self.sequence_bytes)} on the device",
               f"  feature ring       {_fmt(self.feature_ring_bytes_per_sequence)} per sequence "
               + ("(device, cuda-ipc; in per sequence)" if self.feature_ring_on_device
                  else "(none: inline transport)" if self.feature_transport == "inline" else "(host shm)"),
               f"  workspace          {_fmt(self.workspace_bytes)}"
               + (f" (of which CUDA graph arenas {_fmt(self.cuda_graph_bytes)})" if self.cuda_graph_bytes else "")
               + (f" (of which kept state slots {_fmt(self.slot_cache_bytes)})" if self.slot_cache_bytes else "")
               + (f", graph arenas now {_fmt(self.cuda_graph_measured_bytes)}"
                  if self.cuda_graph_measured_bytes else ""),
               f"  total              {_fmt(self.total_bytes)} for {self.max_sequences} sequences "
               f"(+ {_fmt(self.host_feature_bytes)} host feature rings)"]
        if self.device_total_bytes:
            out.append(f"  device             {_fmt(self.device_total_bytes)} total, {_fmt(self.device_free_bytes)} free, "
                       f"pool {_fmt(self.pool_used_bytes)} used / {_fmt(self.pool_reserved_bytes)} reserved")
        if self.fits_sequences >= 0:
            out.append(f"  fits               {self.fits_sequences} sequences at {self.max_seq_len}"
                       + ("" if self.fits_sequences >= self.max_sequences else
                          f"  (WARNING: below max_sequences {self.max_sequences})"))
        return out

    def to_proto(self, pb):
        """A ``specd.worker.v1.MemoryReport`` of module ``pb`` (worker_pb2)."""
        skip = ("weight_bytes_by_type", "feature_transport")  # the latter is TargetInfo.feature_transport
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return pb.MemoryReport(weight_bytes_by_type=dict(self.weight_bytes_by_type), **fields)


def _fmt(n: int) -> str:
    n = int(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def gpu_memory() -> dict | None:
    """``sn.gpu_memory_info()`` when this build and machine have a usable GPU, else None."""
    import specd.native as sn

    try:
        if not sn.gpu_available():
            return None
        return dict(sn.gpu_memory_info())
    except (RuntimeError, AttributeError):
        return None


def model_weight_bytes(model) -> dict[str, int]:
    """Bytes per storage type of the weights a :class:`~.model.Qwen35Model` holds on its device
    (each tensor once: a tied head is the embedding; on the CPU the loader's memory-mapped tensors
    plus the transposed conv kernels; on the device path the uploaded copies)."""
    import numpy as np

    import specd.native as sn

    seen: set[int] = set()
    out: dict[str, int] = {}

    def add(t) -> None:
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        if isinstance(t, np.ndarray):
            name, nb = "F32" if t.dtype == np.float32 else type_name(t.dtype.name), int(t.nbytes)
        else:
            name, nb = type_name(t.dtype), int(t.nbytes)
        out[name] = out.get(name, 0) + nb

    add(model.token_embd)
    add(model.output_norm)
    add(model.output)
    for layer in model.layers:
        loaded = dataclasses.is_dataclass(layer)  # the loader's layer (CPU path) vs a placed copy
        items = ([(f.name, getattr(layer, f.name)) for f in dataclasses.fields(layer)] if loaded
                 else list(vars(layer).items()))
        for name, t in items:
            if isinstance(t, sn.Tensor) and not (loaded and name in ("ssm_conv1d", "ssm_a", "ssm_dt")):
                add(t)  # (the model uses conv_w / gdn_vecs, counted below, for those three)
    for c in model.conv_w.values():
        add(c)
    for dt, a in model.gdn_vecs.values():
        add(dt)
        add(a)
    return out


def report(model, max_seq_len: int, max_sequences: int, verify_width: int, measure: bool = True,
           feature_transport: str = "shm") -> MemoryReport:
    """The :class:`MemoryReport` of a loaded :class:`~.model.Qwen35Model` for sequences of
    ``max_seq_len`` positions, ``max_sequences`` of them and verifies of ``verify_width`` rows (the
    workspace also covers one of the model's prefill chunks). ``feature_transport`` "cuda-ipc" puts
    the feature ring's rows on the device (counted per sequence). With
    ``measure`` and a GPU model, the device's measured memory (``sn.gpu_memory_info``) and the fit
    on it are filled in."""
    import specd.native as sn

    from .feature_shm import segment_bytes

    hp = model.hp
    n_taps = len(model.capture_layers)
    sb = state_bytes(hp, model.kv_dtype, verify_width, n_taps)
    by_type = model_weight_bytes(model)
    weights = sum(by_type.values())
    graphed = getattr(model, "cuda_graphs", False)
    # with CUDA graphs a sequence's K/V rows are its capacity rounded up to the graphs' attention step, and
    # up to slot_cache released sequences' states stay allocated for reuse (model.py: _StateSlot)
    kv_rows = graph_rows(max_seq_len) if graphed else max_seq_len
    kv_seq = sb.kv_per_token * kv_rows
    seq = kv_seq + sb.recurrent + sb.conv + sb.verify
    graphs = cuda_graph_bytes(hp, model.max_graphs, n_taps) if graphed else 0
    slots = getattr(model, "slot_cache", 0) * (kv_seq + sb.recurrent + sb.conv) if graphed else 0
    ws = workspace_bytes(hp, verify_width, getattr(model, "prefill_chunk", 0), n_taps) + graphs + slots
    ring = segment_bytes(max_seq_len, max(1, n_taps) * hp.n_embd)
    host_ring = ring
    on_device = feature_transport == "cuda-ipc"
    if feature_transport == "inline":  # rows travel in the Verify / Propose messages: no ring anywhere
        ring = host_ring = 0
    if on_device:
        from .feature_cuda_ipc import device_bytes, table_bytes

        ring = device_bytes(max_seq_len, max(1, n_taps) * hp.n_embd)
        host_ring = table_bytes(max_seq_len)
        seq += ring
    gpu = model.device == sn.Device.GPU
    mem = gpu_memory() if (measure and gpu) else None
    extra = {}
    if measure and getattr(model, "cuda_graphs", False) and hasattr(model, "graph_arena_bytes"):
        extra["cuda_graph_measured_bytes"] = int(model.graph_arena_bytes())
    if mem:
        total = int(mem["total_bytes"])
        extra = dict(device_total_bytes=total, device_free_bytes=int(mem["free_bytes"]),
                     pool_used_bytes=int(mem.get("pool_used_bytes", 0)),
                     pool_reserved_bytes=int(mem.get("pool_reserved_bytes", 0)),
                     fits_sequences=fits(total, weights, seq, ws))
    return MemoryReport(device="cuda" if gpu else "cpu", weight_bytes=weights, weight_bytes_by_type=by_type,
                        kv_dtype=type_name(model.kv_dtype), kv_bytes_per_token=sb.kv_per_token,
                        max_seq_len=int(max_seq_len), kv_bytes_per_sequence=kv_seq,
                        recurrent_bytes_per_sequence=sb.recurrent, conv_bytes_per_sequence=sb.conv,
                        verify_width=sb.verify_width, verify_bytes_per_sequence=sb.verify, sequence_bytes=seq,
                        feature_ring_bytes_per_sequence=ring, workspace_bytes=ws, max_sequences=int(max_sequences),
                        total_bytes=weights + ws + max_sequences * seq, host_feature_bytes=max_sequences * host_ring,
                        cuda_graph_bytes=graphs, feature_ring_on_device=on_device, slot_cache_bytes=slots,
                        feature_transport=feature_transport, **extra)


# Device bytes a drafter graph capture reserves for its activations and attention scratch on top of
# the block's logits (draft_worker/model.py: DraftSequence._arena_reserve).
DRAFTER_GRAPH_SCRATCH_BYTES = 16 * MiB


def drafter_graph_arena_bytes(hp, markov: bool | None = None) -> int:
    """Device bytes one captured drafter propose (draft_worker/model.py, module docstring) reserves
    for its arena: the F32 logits of the proposal rows [B − first_proposal_row, n_vocab] (``markov``,
    by default DSpark's: x4, the Markov chain's per-row base and corrected rows besides) plus
    :data:`DRAFTER_GRAPH_SCRATCH_BYTES` of activations and attention scratch. An estimate: the arena
    grows past its reservation by more chunks when a capture needs them (the measured figure is
    ``DraftSequence.graph_arena_bytes``)."""
    if markov is None:
        markov = hp.dspark is not None
    n = int(hp.block_size) - int(hp.first_proposal_row)
    return (4 if markov else 1) * n * int(hp.n_vocab) * 4 + DRAFTER_GRAPH_SCRATCH_BYTES


def drafter_graph_bytes(hp, max_graphs: int, n_layer: int | None = None) -> int:
    """Device bytes the CUDA graphs of one drafter sequence may hold: ``max_graphs`` arenas of
    :func:`drafter_graph_arena_bytes` (the most a sequence keeps; it normally holds one, two across a
    1024-position step of the attention bound, more only when a DSpark request switches the Markov
    mode) plus the graphs' int32 input buffer ((2 + 2 * n_layer) x block_size)."""
    n_layer = int(hp.n_layer if n_layer is None else n_layer)
    return int(max_graphs) * drafter_graph_arena_bytes(hp) + (2 + 2 * n_layer) * int(hp.block_size) * 4


@dataclasses.dataclass(frozen=True)
class DrafterMemory:
    """Memory of a model drafter (bytes): weight_bytes / weight_bytes_by_type (the drafter GGUF's own
    tensors), kv_dtype, kv_bytes_per_token (context K + V of the layers that keep every row: full
    attention without context_cap), bounded_kv_bytes_per_sequence (sliding-window and context_cap
    layers: a fixed 2 * keep + 2 * block_size rows each, whatever the sequence length), and the
    target's token_embd / output the drafter uses: ``target_head`` "own" (its own copy,
    ``target_head_bytes``: this process's memory; on the CPU a view of the mapped GGUF) or "shared"
    (mapped from the target worker through CUDA IPC, ``shared_head_bytes``: the target worker's
    memory, counted there, not here); "" when unknown. Each distinct tensor counted once (a tied head
    is the embedding). ``cuda_graph_bytes_per_sequence``: on the GPU with ``cuda_graphs``, the estimate
    of :func:`drafter_graph_bytes` at ``max_graphs`` (the arenas of a sequence's captured proposes;
    0 without graphs, as on the CPU)."""

    device: str
    weight_bytes: int
    weight_bytes_by_type: dict
    kv_dtype: str
    kv_bytes_per_token: int
    bounded_kv_bytes_per_sequence: int
    target_head: str = ""
    target_head_bytes: int = 0
    shared_head_bytes: int = 0
    cuda_graph_bytes_per_sequence: int = 0
    max_graphs: int = 0

    def lines(self) -> list[str]:
        types = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(self.weight_bytes_by_type.items(), key=lambda kv: -kv[1]))
        out = [f"drafter memory ({self.device}):",
               f"  weights            {_fmt(self.weight_bytes)} ({types})"]
        if self.target_head == "shared":
            out.append(f"  target embd/head   {_fmt(self.shared_head_bytes)} shared (mapped from the target worker; "
                       "counted there, not here)")
        elif self.target_head == "own":
            out.append(f"  target embd/head   {_fmt(self.target_head_bytes)} own copy")
        out.append(f"  context K/V        {_fmt(self.kv_bytes_per_token)} per token ({self.kv_dtype}) "
                   f"+ {_fmt(self.bounded_kv_bytes_per_sequence)} per sequence (bounded layers)")
        if self.cuda_graph_bytes_per_sequence:
            out.append(f"  CUDA graph arenas  {_fmt(self.cuda_graph_bytes_per_sequence)} per sequence "
                       f"(at most {self.max_graphs} graphs; estimate)")
        return out

    def to_proto(self, pb):
        """A ``specd.worker.v1.DrafterMemory`` of module ``pb`` (worker_pb2)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "weight_bytes_by_type"}
        return pb.DrafterMemory(weight_bytes_by_type=dict(self.weight_bytes_by_type), **fields)


def drafter_memory(model, head_sharing=None) -> DrafterMemory:
    """:class:`DrafterMemory` of a :class:`specd.draft_worker.model.DrafterModel` (its
    ``drafter.tensors``, kv_dtype, per-layer window and context_cap; its token_embd / lm_head as an
    own copy, or as shared when ``head_sharing`` (a :class:`.shared_weights.HeadSharing`) says they are
    mapped from the target worker)."""
    hp = model.hp
    by_type: dict[str, int] = {}
    for t in model.drafter.tensors.values():
        n = type_name(t.dtype)
        by_type[n] = by_type.get(n, 0) + int(t.nbytes)
    row = 2 * tensor_bytes([hp.n_head_kv, hp.head_dim], model.kv_dtype)  # K + V of one position, one layer
    per_token, bounded = 0, 0
    for i in range(hp.n_layer):
        keep = model.window[i] - 1 if model.window[i] else model.context_cap
        if keep is None:
            per_token += row
        else:
            bounded += (2 * keep + 2 * int(hp.block_size)) * row
    import specd.native as sn

    on_gpu = getattr(model, "device", sn.Device.CPU) == sn.Device.GPU
    head: dict[int, int] = {}
    for t in (getattr(model, "token_embd", None), getattr(model, "lm_head", None)):
        if isinstance(t, sn.Tensor):
            head[id(t)] = int(t.nbytes)
    shared = head_sharing is not None and head_sharing.shared
    head_bytes = int(head_sharing.nbytes) if shared else sum(head.values())
    graphed = on_gpu and getattr(model, "cuda_graphs", False)
    max_graphs = int(getattr(model, "max_graphs", 0)) if graphed else 0
    graphs = drafter_graph_bytes(hp, max_graphs) if graphed else 0
    return DrafterMemory(device="cuda" if on_gpu else "cpu", weight_bytes=sum(by_type.values()),
                         weight_bytes_by_type=by_type, kv_dtype=type_name(model.kv_dtype),
                         kv_bytes_per_token=per_token, bounded_kv_bytes_per_sequence=bounded,
                         target_head="shared" if shared else "own",
                         target_head_bytes=0 if shared else head_bytes, shared_head_bytes=head_bytes if shared else 0,
                         cuda_graph_bytes_per_sequence=graphs, max_graphs=max_graphs)
