"""The qwen35 target forward on specd.native: prefill, chain and tree verify, commit, features.

Math: qwen35-target.md §6 (gated full attention, Gated DeltaNet, SwiGLU MLP, partial NeoX RoPE),
checked against transformers' ``Qwen3_5ForCausalLM`` in tests/target. Weights come from
:mod:`specd.target_worker.gguf_loader` in GGUF layout (norms already +1, ``ssm_a = -exp(A_log)``,
tiled value heads: value head j reads key head ``j % Hk``).

State and commit (spec-loop.md §4-5). Per sequence the model keeps, for ``committed`` positions:
the K/V rows of every full-attention layer (cache row = absolute position), and per Gated DeltaNet
layer the recurrent state S (float32 [Hv, dv, dk], ggml layout) and the conv state (the last K-1
conv inputs, float32 [K-1, C]). A verify runs w tokens on *copies* of S and the conv state and keeps
each token's recurrence inputs (q, k, v after conv and L2 norm, g, beta) and conv inputs; nothing
committed changes. Committing n of them is the deferred-commit strategy ("C" in spec-loop.md §5.4):

* KV: rows past ``committed`` are invisible (masked by position) and overwritten later; a tree path
  is compacted by copying its K/V rows to consecutive positions;
* conv state: the K-1 conv inputs ending at the last committed token (gathered along the path);
* S: the recurrence re-run over the n committed tokens' saved inputs from the committed S, with the
  same token arithmetic, so the result is bitwise what a plain run computes (every op is batch invariant).
  A chain prefix updates every GDN layer at once (sn.conv1d_causal_states, sn.gated_delta_net_states:
  one launch each on the GPU, not two a layer).

Cost model per committed step, per GDN layer: one state copy for the verify (Hv*dv*dk*4 bytes, 3 MiB
for the 27B), n recurrence steps without any weight traffic (~n*4*Hv*dv*dk flops), and w*(2*Hk*dk +
Hv*dv + 2*Hv) saved floats; no second forward (strategy A would re-stream every weight) and no
per-token state checkpoints (strategy B writes w states). When all w tokens are accepted the
verify's final copies are copied into the sequence's state (which keeps its device addresses; every
layer's in one sn.copy_tensors).

CUDA graphs (GPU, ``cuda_graphs``, default on). An exact chain verify of width w <= 16 is recorded
once per (state slot, w, key bound) as a GPU graph (sn.gpu_graph_begin / end) and replayed afterwards:
its token ids and positions are read from one fixed device buffer of the model, refreshed by a single
asynchronous host -> device copy before each replay, and it reads the sequence's KV caches and GDN /
conv states at their fixed addresses (commit updates them in place). Attention inside the graph runs
over the first ``bound`` cache rows, bound = committed + w rounded up to a multiple of 1024, with the
causal limit (row i sees keys up to its own position): exactly the keys of the eager call, so graph
and eager results are bitwise equal, while the split-K grid stays within 16 chunks of the eager one (a
slot re-captures each width once per 1024 positions). Outputs (logits, argmax, features, GDN pending
tensors) live in the graph's arena and are overwritten by its next replay: a VerifyResult of a graph
refuses ``logits`` once a newer replay of that graph ran, and commit already refuses all but a
sequence's newest verify. At most ``max_graphs`` graphs are kept (least recently used evicted);
capturing a (slot, w) graph for a larger bound drops that pair's graphs of smaller bounds.
Committing n rows of a graph's verify is itself recorded once per (graph, n) (it reads the arena's
pending tensors and updates the states in place) and replayed: one launch instead of a few native calls
per GDN layer. Tree verify and prefill (exact=False) run eagerly, and so do their commits.

State slots: a sequence's K/V caches, GDN and conv states are a :class:`_StateSlot` whose K/V rows are
the capacity rounded up to 1024 (so any graph bound fits). :meth:`Qwen35Model.release` keeps up to
``slot_cache`` released slots with their graphs, and a new sequence whose capacity rounds to the same
rows takes one (its GDN / conv states zeroed in place): a new request replays the graphs of an earlier
one instead of capturing its own (each capture records the whole forward, tens of milliseconds for
the 27B). Beyond ``slot_cache`` the oldest kept slot is dropped with its graphs.

Plain decode steps (:meth:`Qwen35Model.step`, what ``decode`` and the target worker's plain steps run)
fuse the one-row verify with its commit: the GDN recurrence and the conv write the sequence's states
in place (their ``state_out`` is the state itself), so there are no pending copies to keep or copy
back, and on the GPU each (slot, key bound) has one captured step graph (keyed as the verify graphs
with ``in_place`` set) replayed alone, without a commit graph.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

import specd.native as sn

from .device import _HostOps, _TensorOps, _Uploader, default_device, parse_device  # noqa: F401
from .features import FeatureRing
from .memory import graph_rows  # a captured verify's attention bound: committed + w rounded up


@dataclasses.dataclass
class GDNPending:
    """What a verify keeps per Gated DeltaNet layer to commit any prefix or tree path later."""

    conv_in: np.ndarray  # float32 [w, C]: the layer's conv inputs (the qkv projection) per row
    q: np.ndarray  # float32 [w, Hk, dk] (L2-normalised)
    k: np.ndarray  # float32 [w, Hk, dk] (L2-normalised)
    v: np.ndarray  # float32 [w, Hv, dv]
    g: np.ndarray  # float32 [w, Hv] log-decay
    beta: np.ndarray  # float32 [w, Hv]
    final_state: np.ndarray | None  # chain verify: S after all w rows
    final_conv: np.ndarray | None  # chain verify: conv state after all w rows


@dataclasses.dataclass
class VerifyResult:
    """Output of :meth:`Qwen35Model.verify` for w rows (row i predicts the token after row i)."""

    tokens: np.ndarray  # int32 [w]
    parents: np.ndarray | None  # int32 [w] tree parents (-1: the committed prefix), None for a chain
    raw_logits: object  # logits where they were computed: numpy (CPU) or an sn.Tensor on the device
    argmax: np.ndarray  # int32, one per row of logits
    raw_features: object  # float32 [w, n_taps * n_embd]: numpy, or an sn.Tensor where computed (GPU);
    # None for a model without capture layers (its rows are zeros: ``features`` makes them when asked)
    start: int  # committed length when the verify ran
    pending: list  # per layer: GDNPending for GDN layers, None for attention layers
    sequence: "SequenceState"  # the sequence it ran on
    generation: int  # that sequence's verify count when it ran: only the newest verify can commit
    graph: "_CapturedVerify | None" = None  # the graph whose arena holds raw_logits and pending
    replay: int = 0  # that graph's replay count when it ran

    @property
    def logits(self) -> np.ndarray:
        """float32 [w, n_vocab], or [1, n_vocab] (last row only) when asked for; on the GPU copied to
        the host on first use only (greedy verification needs just ``argmax``). RuntimeError when the
        verify ran as a CUDA graph that has been replayed since (its logits were overwritten)."""
        if not isinstance(self.raw_logits, np.ndarray):
            self._check_graph("logits")
            self.raw_logits = self.raw_logits.numpy()
        return self.raw_logits

    @property
    def features(self) -> np.ndarray:
        """float32 [w, n_taps * n_embd] on the host, copied from the device on first use only (commit
        never asks: it copies the committed rows of the device tensor, ``raw_features``, into the ring).
        RuntimeError when the verify's CUDA graph has been replayed since (as for ``logits``). A model
        without capture layers (``raw_features`` None) gets a new zeros array [w, n_embd] (the ring's
        width) on every call, whatever graph replays followed."""
        if self.raw_features is None:  # no capture layers: zero rows of the ring's width
            return np.zeros((len(self.tokens), self.sequence.features.width), np.float32)
        if not isinstance(self.raw_features, np.ndarray):
            self._check_graph("features")
            self.raw_features = self.raw_features.numpy()
        return self.raw_features

    def _check_graph(self, what: str) -> None:
        """RuntimeError when the verify ran as a CUDA graph that has been replayed since (its arena
        tensors ``raw_logits`` / ``raw_features`` / ``pending`` were overwritten)."""
        if self.graph is not None and self.graph.replays != self.replay:
            raise RuntimeError(f"VerifyResult.{what}: a newer forward of this state slot and width replayed the "
                               f"CUDA graph holding these {what}; read them before the next verify")


@dataclasses.dataclass
class _CapturedVerify:
    """A recorded chain forward of one state slot and width (a verify, or with ``in_place`` a plain
    step), and the arena tensors it writes."""

    graph: object  # sn.GpuGraph
    logits: object
    argmax: object
    features: object  # sn.Tensor or None
    pending: list
    replays: int = 0
    commits: dict = dataclasses.field(default_factory=dict)  # n -> sn.GpuGraph committing rows 0..n-1


class PrefillCancelled(Exception):
    """A chunked prefill stopped because its ``cancelled`` callback said so (sequence released or
    caller gone)."""


class _StateSlot:
    """The device buffers of one sequence's state: K/V caches of ``rows`` rows per attention layer,
    GDN and conv states per GDN layer. Captured graphs bake in these addresses, so they are keyed by
    the slot, and a released sequence's slot (kept by :meth:`Qwen35Model.release` up to
    ``slot_cache``) serves a later sequence with the same ``rows`` together with its graphs."""

    _uids = itertools.count()

    def __init__(self, model: "Qwen35Model", rows: int):
        hp, ops, dev = model.hp, model._ops, model.device
        self.uid = next(self._uids)  # never reused: keys the model's captured graphs
        self.rows = rows
        self.kv: dict[int, tuple[sn.Tensor, sn.Tensor]] = {}
        self.ssm: dict = {}  # np.ndarray on the CPU, sn.Tensor on the GPU
        self.conv: dict = {}
        for i in range(hp.n_layer):
            if hp.recurrent[i]:
                self.ssm[i] = ops.zeros((hp.n_v_heads, hp.head_v_dim, hp.head_k_dim))
                self.conv[i] = ops.zeros((hp.ssm_conv_kernel - 1, hp.conv_channels))
            else:
                shape = [rows, hp.n_head_kv, hp.head_dim]
                self.kv[i] = (sn.Tensor.zeros(shape, model.kv_dtype, dev), sn.Tensor.zeros(shape, model.kv_dtype, dev))


class SequenceState:
    """Per-sequence target state (see the module docstring). ``committed`` counts final positions;
    the K/V caches, GDN and conv states are those of its :class:`_StateSlot` (``slot``)."""

    def __init__(self, model: "Qwen35Model", capacity: int, slot: _StateSlot):
        hp = model.hp
        self.released = False  # set by Qwen35Model.release: device state given back, verify refused
        self.capacity = capacity
        self.committed = 0
        self.verifies = 0  # a verify overwrites K/V rows past `committed`: only the newest may commit
        self.slot = slot
        self.kv, self.ssm, self.conv = dict(slot.kv), dict(slot.ssm), dict(slot.conv)
        self.features = FeatureRing(capacity, max(1, len(model.capture_layers)) * hp.n_embd)


class Qwen35Model:
    """A qwen35 target over GGUF weights.

    Args:
        weights: ``Qwen35Weights`` from the GGUF loader.
        capture_layers: the drafter's ``target_layer_ids`` (0-based output indices; each must be a
            trunk layer below the last); features are the residual stream after those layers.
        kv_dtype: KV cache type, ``DType.F16`` (default) or ``DType.Q8_0`` (or F32).
        prefill_chunk: tokens per prefill forward, > 0; default 2048 (``specd target-worker
            --prefill-chunk``). On the GPU each chunk of over 16 rows dequantizes every weight matrix to
            BF16 once for its GEMMs, so longer chunks amortize that; the workspace grows with the chunk
            (:func:`.memory.workspace_bytes`).
        device: ``sn.Device.CPU`` (default) or ``sn.Device.GPU`` (or "cpu" / "cuda" / "gpu"). On the GPU
            the weights are uploaded once here in their stored types, the KV caches, GDN and conv
            states and every activation stay on the device, and only the outputs (logits, argmax,
            features) come back to the host. Verify rows are computed exactly at any width (each
            equals decode bitwise); prefill chunks over 16 rows use the 2^-8-accurate BF16 GEMM and,
            from 64 rows on F16 K/V caches, the tensor-core flash attention (~1e-3; sn.attention's
            ``exact``) and from 64 rows the chunked Gated DeltaNet recurrence (sn.gated_delta_net's
            ``exact``) (so GPU greedy output depends on ``prefill_chunk``, as in llama.cpp on the batch size). Same API and semantics as on the CPU (prefill, decode, chain and tree verify,
            commit). Raises RuntimeError when the GPU is asked for and none is usable.
        tensor_ops: run the device code path (sn.Tensor glue ops instead of numpy) even on the CPU;
            for tests on machines without a GPU (``SPECD_TEST_GPU_DRYRUN``). Implied by the GPU.
        head_exporter: a :class:`.shared_weights.HeadExporter` or None (default): token_embd and output
            are placed by ``head_exporter.place`` (exported device buffers a drafter worker on the same
            GPU maps) instead of the usual upload; the target worker passes one on the GPU.
        cuda_graphs: on the GPU, replay exact chain verifies of width <= 16 as captured CUDA graphs
            (module docstring; bitwise the eager results). Ignored on the CPU.
        gemv_tiles: on a CUDA GPU, the layers' IQ4_XS, Q4_K, Q5_K and Q6_K matrices, and an output head of those
            types not tied to the embedding (in the head exporter's buffer too), are placed in the tensor-core
            GEMV's tiled layouts (``sn.tile_for_gemv``: bit-identical results, faster GEMV); default True.
        max_graphs: most captured chain-verify graphs kept (least recently used evicted), >= 1;
            default 16 (``specd target-worker --max-graphs``). Each keeps its own arena (activations,
            logits, commit graphs): see :func:`.memory.cuda_graph_bytes`.
        slot_cache: with CUDA graphs, released sequences' state slots (K/V caches, GDN and conv states)
            kept for later sequences, with the graphs captured on them (module docstring), >= 0; default
            2 (``specd target-worker --slot-cache``); 0 frees a sequence's state and graphs at release.
    """

    def __init__(self, weights, capture_layers: Sequence[int] = (), kv_dtype=sn.DType.F16, prefill_chunk: int = 2048,
                 device=sn.Device.CPU, tensor_ops: bool = False, cuda_graphs: bool = True, max_graphs: int = 16,
                 head_exporter=None, gemv_tiles: bool = True, slot_cache: int = 2):
        self.w, self.hp = weights, weights.hparams
        hp = self.hp
        for lid in capture_layers:
            if not 0 <= lid < hp.n_layer - 1:
                raise ValueError(f"capture layer {lid} is outside the target's trunk layers 0..{hp.n_layer - 2}")
        if kv_dtype not in (sn.DType.F16, sn.DType.Q8_0, sn.DType.F32):
            raise ValueError(f"kv_dtype must be F16, Q8_0 or F32, got {kv_dtype}")
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be > 0, got {prefill_chunk}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        if slot_cache < 0:
            raise ValueError(f"slot_cache must be >= 0, got {slot_cache}")
        self.capture_layers = list(capture_layers)
        self.kv_dtype, self.prefill_chunk = kv_dtype, prefill_chunk
        self.device = parse_device(device)
        output = weights.output if weights.output is not None else weights.token_embd
        # ssm_conv1d is GGUF ne [K, C] = numpy (C, K); the conv op wants taps outermost.
        conv_w = {i: np.ascontiguousarray(l.ssm_conv1d.numpy().T) for i, l in enumerate(weights.layers)
                  if hp.recurrent[i]}
        if self.device == sn.Device.CPU and not tensor_ops:
            self._ops = _HostOps()
            self.token_embd, self.output_norm, self.output = weights.token_embd, weights.output_norm, output
            head = self._export_head(head_exporter, weights.token_embd, output) if head_exporter is not None else None
            if head is not None:  # (only with a CPU stand-in of the IPC backend: tests)
                self.token_embd, self.output = head
            self.layers = list(weights.layers)
            self.conv_w = conv_w
            self.gdn_vecs = {i: (l.ssm_dt.numpy(), l.ssm_a.numpy()) for i, l in enumerate(weights.layers)
                             if hp.recurrent[i]}
        else:
            self._ops = _TensorOps(self.device)
            up = _Uploader(self.device, gemv_tiles)
            head = (self._export_head(head_exporter, weights.token_embd, output, up.tiles_head(output, weights.token_embd))
                    if head_exporter is not None else None)
            self.token_embd = up.embedding(weights.token_embd) if head is None else head[0]
            self.output_norm = up.plain(weights.output_norm)
            self.layers = [up.layer(l) for l in weights.layers]
            self.conv_w = {i: up.plain(sn.Tensor(c)) for i, c in conv_w.items()}
            # [1, Hv] tables (sn.gdn_gates takes [Hv] or [1, Hv] and broadcasts them over the rows)
            self.gdn_vecs = {i: (up.plain(l.ssm_dt).reshape([1, hp.n_v_heads]),
                                 up.plain(l.ssm_a).reshape([1, hp.n_v_heads]))
                             for i, l in enumerate(weights.layers) if hp.recurrent[i]}
            up.release_staging()  # before the head's temporary copy (tiled last): one of them at a time
            self.output = up.head(output, weights.token_embd) if head is None else head[1]
            if up.gemv_tiles:  # the staging buffers and the head's temporary stay cached in the pool otherwise
                sn.gpu_trim_pool()  # (H200, 27B IQ4_XS: 1.85 GB of the process's device memory)
            elif self.device == sn.Device.GPU:
                sn.gpu_synchronize()
        # the exporter whose tensors this model computes with (published by the target worker's Info),
        # or None (not exported, or the export failed)
        self.head_exporter = head_exporter if head_exporter is not None and head_exporter.infos else None
        self.cuda_graphs = bool(cuda_graphs) and self.device == sn.Device.GPU
        self.max_graphs = max_graphs
        self.slot_cache = slot_cache
        self._free_slots: list[_StateSlot] = []  # released sequences' slots kept for reuse, oldest first
        self._graphs: collections.OrderedDict[tuple[int, int, bool, int], _CapturedVerify] = collections.OrderedDict()
        # Inputs of every captured verify: token ids at [0, 16), positions (= KV rows) at [16, 32).
        self._graph_in = (sn.Tensor.zeros([2 * _GRAPH_MAX_W], sn.DType.I32, self.device) if self.cuda_graphs
                          else None)

    @staticmethod
    def _export_head(exporter, token_embd, output, tile_output=False):
        """(token_embd, output) placed by ``exporter`` (a tied output once; ``tile_output``: the output in
        the GEMV's tiled layout), or None when the export fails (logged; the caller places them as usual
        and nothing is published)."""
        import logging

        try:
            return (exporter.place("token_embd.weight", token_embd),
                    exporter.place("output.weight", output, tiled=tile_output))
        except Exception as exc:  # noqa: BLE001 - e.g. a runtime without IPC: the target still runs
            exporter.close()
            logging.getLogger(__name__).warning("target-worker: cannot export token_embd / output for the drafter "
                                                "worker (it will load its own copy): %s", exc)
            return None

    # ------------------------------------------------------------------ public API

    def release(self, st: SequenceState, keep_slot: bool = True) -> int:
        """Ends a finished sequence; later verifies of ``st`` raise ValueError. With CUDA graphs its
        state slot and that slot's captured graphs are kept for the next sequence of the same
        capacity class (``keep_slot``; at most ``slot_cache`` kept, the oldest dropped beyond);
        otherwise (or for a dropped slot) the captured verify graphs (and their commit graphs) and the
        device state (KV caches, GDN and conv states) are freed. Returns the number of graphs dropped.
        Call it under the lock that serialises forwards and captures: a dropped graph's destructor
        waits for its last replay, and its arena or the states are freed now (a VerifyResult still
        held keeps only its own graph's arena). Idempotent."""
        if st.released:
            return 0
        st.released = True
        slot, st.slot = st.slot, None
        st.kv, st.ssm, st.conv = {}, {}, {}
        if not (keep_slot and self.cuda_graphs and self.slot_cache):
            return self._drop_slot(slot)
        self._free_slots.append(slot)
        dropped = 0
        while len(self._free_slots) > self.slot_cache:
            dropped += self._drop_slot(self._free_slots.pop(0))
        return dropped

    def _drop_slot(self, slot: _StateSlot) -> int:
        """Drops the graphs captured on ``slot`` (its buffers go with the last reference)."""
        keys = [k for k in self._graphs if k[0] == slot.uid]
        for k in keys:
            del self._graphs[k]
        return len(keys)

    def _slot_for(self, capacity: int) -> _StateSlot:
        """A state slot for ``capacity`` positions, states zeroed: with CUDA graphs a kept slot of the
        same rows (capacity rounded up to the graphs' attention step, so a graph's attention bound,
        committed + w rounded up to that step, never passes the cache) when one is free, else a new one."""
        if not self.cuda_graphs:
            return _StateSlot(self, capacity)
        rows = graph_rows(capacity)
        for j, slot in enumerate(self._free_slots):
            if slot.rows == rows:
                del self._free_slots[j]
                try:
                    for t in [*slot.ssm.values(), *slot.conv.values()]:  # in place: the graphs read these addresses
                        self._ops.assign(t, self._ops.zeros(t.shape))
                except BaseException:
                    self._drop_slot(slot)
                    raise
                # K/V rows need no reset: attention reads only positions up to each row's own, all written
                # by this sequence (prefill / verify write a row's K/V before any row attends to it)
                return slot
        try:
            return _StateSlot(self, rows)
        except (MemoryError, RuntimeError):
            if not self._free_slots:
                raise
            while self._free_slots:  # kept slots of other sizes give their memory back first
                self._drop_slot(self._free_slots.pop())
            return _StateSlot(self, rows)

    def graph_arena_bytes(self) -> int:
        """Measured device bytes held by the arenas of the live captured graphs (verify graphs and
        their commit graphs; GpuGraph.arena_bytes); 0 without CUDA graphs."""
        total = 0
        for cv in list(self._graphs.values()):  # a snapshot: may run beside a verify (Info)
            total += int(cv.graph.arena_bytes)
            total += sum(int(g.arena_bytes) for g in list(cv.commits.values()))
        return total

    def new_sequence(self, capacity: int) -> SequenceState:
        """Fresh state for a sequence of at most ``capacity`` positions (KV rows and feature slots)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        return SequenceState(self, capacity, self._slot_for(capacity))

    def prefill(self, st: SequenceState, tokens: Sequence[int], cancelled=None) -> np.ndarray:
        """Runs and commits ``tokens`` after the committed prefix in chunks; returns the last row's
        logits (float32 [n_vocab]). ``cancelled``: optional callable checked before every chunk after
        the first; when it returns True the prefill stops with :class:`PrefillCancelled`."""
        tokens = self._check_tokens(tokens, st)
        logits = None
        for s in range(0, len(tokens), self.prefill_chunk):
            if s and cancelled is not None and cancelled():
                raise PrefillCancelled(f"prefill cancelled after {s} of {len(tokens)} tokens")
            res = self.verify(st, tokens[s : s + self.prefill_chunk], last_only=True, exact=False)
            self.commit(st, res, len(res.tokens))
            logits = res.logits[0]
            del res  # its pending buffers go before the next chunk's (one chunk's worth at a time)
        return logits

    def decode(self, st: SequenceState, token: int) -> np.ndarray:
        """Runs and commits one token (:meth:`step`); returns its logits (float32 [n_vocab])."""
        logits = self._step(st, token)[1]
        return (logits if isinstance(logits, np.ndarray) else logits.numpy())[0]

    def step(self, st: SequenceState, token: int) -> int:
        """A plain decode step: runs ``token`` at the next position, commits it and returns its greedy
        successor (the argmax of its logits, int). Equals ``verify(st, [token])`` + ``commit(st, res, 1)``
        bitwise (logits, states, KV rows, feature rows) but updates the GDN and conv states in place
        (no pending copies: 2 state copies per GDN layer fewer, ~0.3 GB of device traffic for the 27B) and
        on the GPU replays one captured graph per (state slot, key bound) instead of a verify and a
        commit graph. Outstanding verifies of ``st`` can no longer commit. Raises ValueError as verify
        (bad token, capacity, released sequence); an error inside the forward leaves the states half
        updated, so the sequence is released before the error propagates."""
        return self._step(st, token)[0]

    def _step(self, st, token):
        """(argmax int, logits: numpy [1, n_vocab] or a device tensor valid until the next replay)."""
        tokens = self._check_tokens([token], st)
        c = st.committed
        # a capture failing here has run nothing: the sequence stays as it was
        g = self._chain_graph(st, 1, c, in_place=True) if self.cuda_graphs else None
        st.verifies += 1  # pending verifies ran against the states this step overwrites
        try:
            if g is not None:
                self._replay(g, tokens, c)
                logits, argmax, feats = g.logits, g.argmax, g.features
            else:
                idx = self._ops.indices(tokens, np.array([c], np.int32), np.array([c], np.int32))
                logits, argmax, feats, _ = self._forward(st, *idx, c + 1, None, False, _EXACT, in_place=True)
            best = int(argmax.numpy()[0])
            self._ring_write(st, c, 1, feats)
        except BaseException:
            self.release(st, keep_slot=False)  # its states may hold part of this step
            raise
        st.committed += 1
        return best, logits

    def verify(self, st: SequenceState, tokens: Sequence[int], parents: Sequence[int] | None = None,
               last_only: bool = False, exact: bool = True) -> VerifyResult:
        """Runs w tokens after the committed prefix without committing anything.

        Chain (``parents`` None): row i sits at position committed + i. Tree: ``parents[i]`` is the
        row index of node i's parent (< i) or -1 for a child of the committed prefix; node i sits at
        position committed + depth(i) and attends to the prefix and its own ancestors only. Returns
        logits and argmax of every row (only the last row with ``last_only``) and every row's features.
        ``exact`` (default): every row is bit-identical to computing it alone (decode), on every device
        — what makes speculative output equal plain output. ``exact=False`` lets the GPU run matmuls of
        more than 16 rows as a BF16 GEMM (2^-8-accurate, not batch invariant) and the causal attention
        of 64 or more rows over F16 K/V caches through the tensor-core flash-attention kernel (F16 q and
        softmax weights, ~1e-3 of max|v|; sn.attention's ``exact``) and the Gated DeltaNet recurrence of
        64 or more rows in chunks of 64 tokens (sn.gated_delta_net's ``exact``): prefill only.
        """
        tokens = self._check_tokens(tokens, st)
        w, c = len(tokens), st.committed
        tree = None if parents is None else _Tree(parents, w, c)
        st.verifies += 1
        if self.cuda_graphs and tree is None and exact and not last_only and w <= _GRAPH_MAX_W:
            return self._verify_graph(st, tokens)
        positions = (c + np.arange(w) if tree is None else c + tree.depth).astype(np.int32)
        rows = (c + np.arange(w)).astype(np.int32)  # tree nodes live at row c + index until compaction
        mm = _EXACT if exact else _INEXACT  # the CPU is always exact
        # Every index value is known and checked here (tokens by _check_tokens, positions and rows
        # from st.committed within capacity): one packed upload, passed to the ops as trusted.
        idx = self._ops.indices(tokens, positions, rows)
        logits, argmax, feats, pending = self._forward(st, *idx, c + w, tree, last_only, mm)
        return VerifyResult(tokens, None if tree is None else tree.parents, logits, argmax.numpy(),
                            feats, c, pending, st, st.verifies)

    def commit(self, st: SequenceState, res: VerifyResult, n_or_path) -> None:
        """Makes a prefix (chain: an int n in 0..w) or a tree path (a list of row indices, each the
        parent of the next, the first a child of the prefix) of a verify final. Afterwards every
        state equals a plain run over the committed tokens."""
        if res.sequence is not st:
            raise ValueError("commit: this verify ran on another sequence")
        if st.released:
            raise ValueError("commit: this sequence was released")
        if st.committed != res.start:
            raise ValueError(f"commit: the sequence moved from {res.start} to {st.committed} since this verify")
        if res.generation != st.verifies:
            raise ValueError("commit: a newer verify ran on this sequence and overwrote this one's K/V rows")
        rows = self._commit_rows(res, n_or_path)
        n = len(rows)
        if n == 0:
            return
        # A stale graph raises before anything moves. Device rows are staged into the ring before the
        # states (device to device into a device ring; into a host ring only the committed rows cross,
        # a copy that waits for the verify alone while the state updates queued after it run as this
        # call answers) and published after them, so a failure between publishes nothing.
        feats = res.raw_features  # None: zero rows (no capture layers)
        staged = None
        if feats is not None and not isinstance(feats, np.ndarray):
            res._check_graph("features")
            staged = st.features.stage_rows(res.start, feats, rows)
        elif feats is not None:  # host rows; a chain's leading ones as a view (a prefill chunk's are tens of MB)
            feats = feats[: len(rows)] if res.parents is None else feats[rows]
        if res.graph is not None:  # the state updates read fixed addresses: one graph per n
            g = res.graph.commits.get(n)
            if g is None:
                g = res.graph.commits[n] = self._capture(lambda: self._commit_states(st, res, rows), 0)[0]
            g.replay()
        else:
            self._commit_states(st, res, rows)
        if staged is not None:
            st.features.publish_rows(staged)
        else:
            self._ring_write(st, res.start, n, feats)
        st.committed += n

    @staticmethod
    def _ring_write(st, start, n, feats) -> None:
        """Stores the n feature rows ``feats`` at positions start, start + 1, .... None is n zero rows (a
        model without capture layers): the ring marks them without copying (its rows are zero unless
        written). A device tensor goes into the ring through its ``write_rows``: device to device into
        a device ring (cuda-ipc), to the host into a host ring (shm, inline)."""
        if feats is None:
            st.features.write_zeros(start, n)
        elif isinstance(feats, np.ndarray):
            st.features.write(start, feats)
        else:
            st.features.write_rows(start, feats, range(int(feats.shape[0])))

    def _commit_states(self, st, res, rows) -> None:
        """The device (or numpy) part of commit: KV compaction and GDN / conv state updates."""
        full_chain = res.parents is None and len(rows) == len(res.tokens)
        ops = self._ops
        gdn = [i for i, p in enumerate(res.pending) if p is not None]
        pend = [res.pending[i] for i in gdn]
        for i, p in enumerate(res.pending):
            if p is None:
                self._compact_kv(st, i, res.start, rows)
        # Every GDN layer at once (on the GPU a launch or two, not small ones a layer after another), in place:
        # states keep their addresses (captured graphs read them there).
        if full_chain:  # the verify's final states
            sn.copy_tensors([st.ssm[i] for i in gdn] + [st.conv[i] for i in gdn],
                            [p.final_state for p in pend] + [p.final_conv for p in pend])
        elif res.parents is None:  # a chain prefix: its leading rows, read where the verify left them
            # the conv states take the accepted inputs' last K-1 rows, the recurrence reruns the accepted rows
            n = len(rows)
            sn.conv1d_causal_states([ops.lead_rows(p.conv_in, n) for p in pend], [st.conv[i] for i in gdn])
            inputs = ([ops.lead_rows(getattr(p, f), n) for p in pend] for f in ("q", "k", "v", "g", "beta"))
            sn.gated_delta_net_states(*inputs, [st.ssm[i] for i in gdn], self._gdn_scale)
        else:
            for i in gdn:
                p = res.pending[i]
                st.conv[i] = ops.assign(st.conv[i], self._conv_state_after(st.conv[i], p.conv_in, rows))
                sn.gated_delta_net(ops.take(p.q, rows), ops.take(p.k, rows), ops.take(p.v, rows),
                                   ops.take(p.g, rows), ops.take(p.beta, rows), st.ssm[i], self._gdn_scale)

    # ------------------------------------------------------------------ CUDA graphs

    def _verify_graph(self, st, tokens) -> VerifyResult:
        """Chain verify by replaying the (slot, w) graph, capturing it first if needed."""
        w, c = len(tokens), st.committed
        g = self._chain_graph(st, w, c, in_place=False)
        self._replay(g, tokens, c)
        return VerifyResult(tokens, None, g.logits, g.argmax.numpy(), g.features, c,
                            g.pending, st, st.verifies, g, g.replays)

    def _chain_graph(self, st, w, c, in_place: bool) -> _CapturedVerify:
        """The graph of a chain forward of w rows after c committed positions on st's slot
        (``in_place``: :meth:`step`'s, which commits its GDN / conv states), captured now if needed
        (nothing runs). Graphs are keyed (state slot, w, in_place, key bound); see the module docstring."""
        bound = min(st.slot.rows, graph_rows(c + w))
        key = (st.slot.uid, w, in_place, bound)
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        g = self._capture_chain(st, w, bound, in_place)
        # within a sequence a slot's bound only grows; a later sequence on the slot starts again below
        for old in [k for k in self._graphs if k[:3] == key[:3] and k[3] < bound]:
            del self._graphs[old]
        self._graphs[key] = g
        kept = {slot.uid for slot in self._free_slots}
        while len(self._graphs) > self.max_graphs:  # kept slots' graphs go first, then the least recently used
            old = next((k for k in self._graphs if k[0] in kept), next(iter(self._graphs)))
            del self._graphs[old]  # its arena lives on while results still hold tensors
        return g

    def _replay(self, g: _CapturedVerify, tokens, c: int) -> None:
        """Replays g on tokens at positions c, c + 1, ... (one asynchronous upload of the inputs)."""
        w = len(tokens)
        inputs = np.zeros(2 * _GRAPH_MAX_W, np.int32)
        inputs[:w] = tokens
        inputs[_GRAPH_MAX_W : _GRAPH_MAX_W + w] = c + np.arange(w)
        sn.gpu_write_async(self._graph_in, inputs)  # ordered after every replay already queued
        g.graph.replay()
        g.replays += 1

    def _capture_chain(self, st, w, bound, in_place) -> _CapturedVerify:
        tokens = self._graph_in.view_rows(0, w)
        positions = self._graph_in.view_rows(_GRAPH_MAX_W, _GRAPH_MAX_W + w)
        # kv_len = bound >= c + w at every replay of this key: with the causal limit each row sees
        # exactly the keys of the eager call (positions up to its own, c + i < c + w).
        graph, (logits, argmax, feats, pending) = self._capture(
            lambda: self._forward(st, tokens, positions, positions, bound, None, False, _EXACT, in_place), 64 << 20)
        return _CapturedVerify(graph, logits, argmax, feats, pending)

    @staticmethod
    def _capture(fn, arena_bytes):
        """(sn.GpuGraph of the device work fn enqueues, fn's result); nothing runs until a replay.
        arena_bytes: device memory reserved up front (the arena grows past it when needed)."""
        sn.gpu_graph_begin(arena_bytes)
        try:
            out = fn()
            return sn.gpu_graph_end(), out
        except BaseException:
            sn.gpu_graph_abort()
            raise

    # ------------------------------------------------------------------ layers

    def _forward(self, st, tokens, positions, rows, kv_len, tree, last_only, mm, in_place=False):
        """The verify forward on index tensors of the ops' kind (numpy, or device tensors whose values
        the caller checked): (logits, argmax tensor, features on the device or None, pending).
        ``in_place`` (chain only: :meth:`step`): the GDN and conv states are updated in place, so the
        forward commits its rows' states (pending then holds no states of its own). Nothing in it reads
        the device back, so on the GPU it can be captured in a graph."""
        ops, eps = self._ops, self.hp.rms_eps
        # The residual stream after layer i is h + ffn_out; that sum is formed by the norm that reads
        # it next (rms_norm's residual input: the same single F32 add, one launch fewer per layer).
        # The out projections' and the FFN's outputs pass from op to op as split-K partials where mm
        # hands them over so (mm.partials): the norm or SwiGLU reading them sums them, no sum launch.
        h, d, d_parts = None, ops.a(sn.embedding(self.token_embd, tokens, trusted=True)), False
        taps, pending = {}, []
        for i, layer in enumerate(self.layers):
            # the attn_norm-ed stream's projections (the norm fused with their GEMV's input split)
            proj = [layer.attn_qkv, layer.attn_gate, layer.ssm_beta, layer.ssm_alpha] if self.hp.recurrent[i] \
                else [layer.attn_q, layer.attn_k, layer.attn_v]
            ys, x = mm.norm_group(d, layer.attn_norm, eps, proj, residual=h, in_partials=d_parts)
            if i - 1 in self.capture_layers:
                taps[i - 1] = ops.a(x)
            ys = [ops.a(y) for y in ys]
            if self.hp.recurrent[i]:
                mix, p = self._gdn(i, layer, *ys, st, tree, mm, in_place)
            else:
                mix, p = self._attention(i, layer, *ys, st, positions, rows, kv_len, tree, mm), None
            pending.append(p)
            (gate, up), h = mm.norm_group(mix, layer.post_attention_norm, eps, [layer.ffn_gate, layer.ffn_up],
                                          residual=x, in_partials=mm.partials, partials=mm.partials)
            d = ops.a(mm.swiglu(gate, up, layer.ffn_down, in_partials=mm.partials, partials=mm.partials))
            d_parts = mm.partials
        feats = ops.cat([taps[i] for i in self.capture_layers], axis=1) if self.capture_layers else None
        if last_only:
            if d_parts:  # the rows of the value, not of its partials
                d, d_parts = ops.a(sn.sum_partials(d)), False
            h, d = ops.last_row(ops.a(h)) if h is not None else None, ops.last_row(d)
        logits = self._logits(d, h, d_parts)
        return logits, sn.argmax(logits), feats, pending  # the logits stay on the device until asked for

    @property
    def _gdn_scale(self) -> float:
        return 1.0 / math.sqrt(self.hp.head_k_dim)

    def _attention(self, i, layer, qg, k, v, st, positions, rows, kv_len, tree, mm):
        """Gated full attention of layer i from the q / gate, k and v projections of its attn_norm-ed
        residual stream; ``mm.exact`` False (prefill) lets a chain's attention take the inexact GPU path."""
        hp, w = self.hp, qg.shape[0]
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        ops = self._ops
        # qg: per head [q | gate]. q and k: head RMS norm then RoPE, one op that also writes the roped k and v
        # into the caches at rows (kv_write's bytes; on the GPU in the same launch); gate: a view of qg's gate half.
        kc, vc = st.kv[i]
        q, gate, _ = sn.qk_norm_rope(ops.reshape(qg, w, nh, 2 * hd), ops.reshape(k, w, nkv, hd), layer.attn_q_norm,
                                     layer.attn_k_norm, positions, hp.n_rot, hp.rope_freq_base, hp.rms_eps,
                                     trusted=True, k_cache=kc, v_cache=vc, v=ops.reshape(v, w, nkv, hd), rows=rows)
        if tree is None:  # exact=False (prefill chunks) may take the GPU's flash-attention path
            a = sn.attention(q, kc, vc, kv_len, positions, causal=True, trusted=True, exact=mm.exact)
        else:
            a = sn.attention(q, kc, vc, kv_len, positions, causal=False, mask=tree.mask, trusted=True)
        return ops.a(mm.gated(a, gate, layer.attn_output, partials=mm.partials))  # the output gate fused with the split

    def _gdn(self, i, layer, m, z, b, a, st, tree, mm, in_place=False):
        """Gated DeltaNet of layer i from the qkv, gate (z), beta and alpha projections of its
        attn_norm-ed residual stream: (output, pending states); ``in_place``: see :meth:`_forward`."""
        hp, w = self.hp, m.shape[0]
        hk, hv, dk, dv = hp.n_k_heads, hp.n_v_heads, hp.head_k_dim, hp.head_v_dim
        ops = self._ops
        z = ops.reshape(z, w, hv, dv)
        if tree is None:  # pending states out of place (the committed ones stay untouched) unless in_place
            conv_state = st.conv[i] if in_place else ops.empty(st.conv[i].shape)
            cv = ops.a(sn.conv1d_causal(m, self.conv_w[i], st.conv[i], apply_silu=True, state_out=conv_state))
        else:
            cv = ops.cat([ops.a(sn.conv1d_causal(ops.take(m, [j]), self.conv_w[i],
                                                 self._conv_state_after(st.conv[i], m, tree.path(j)[:-1]),
                                                 apply_silu=True)) for j in range(w)])
            conv_state = None
        state = None if tree is not None else st.ssm[i] if in_place else ops.empty(st.ssm[i].shape)
        if tree is None and mm.exact:  # decode / chain verify: qkv, gates, recurrence, output norm and split in one op
            (out,), *pend = sn.gdn_step_gated_matmul(
                cv, a, b, *self.gdn_vecs[i], st.ssm[i], hk, dk, hv, dv, hp.rms_eps, self._gdn_scale, layer.ssm_norm, z,
                [layer.ssm_out], exact=True, partials=mm.partials, state_out=state)
            q, k, v, g, beta = (ops.a(t) for t in pend)
        else:
            q, k, v = (ops.a(t) for t in sn.gdn_qkv(cv, hk, dk, hv, dv, hp.rms_eps))  # L2-normed q, k heads; v
            g, beta = (ops.a(t) for t in sn.gdn_gates(a, b, *self.gdn_vecs[i]))  # ssm_a * softplus(a + dt), sigmoid(b)
            if tree is None:  # prefill (inexact): the GPU's chunked recurrence
                o = ops.a(sn.gated_delta_net(q, k, v, g, beta, st.ssm[i], self._gdn_scale, state_out=state,
                                             exact=False))
            else:
                o = self._gdn_tree(st.ssm[i], q, k, v, g, beta, tree)
            # the norm fused with the out projection's split
            out = mm.gated_norm(o, layer.ssm_norm, hp.rms_eps, z, layer.ssm_out, partials=mm.partials)
        return ops.a(out), GDNPending(m, q, k, v, g, beta, state, conv_state)

    def _gdn_tree(self, s0, q, k, v, g, beta, tree):
        """Each node's recurrence starts from its parent's state (the committed S for roots)."""
        ops, states, outs = self._ops, [], []
        for j in range(len(tree.parents)):
            p = tree.parents[j]
            s = ops.copy(s0 if p < 0 else states[p])
            outs.append(ops.a(sn.gated_delta_net(ops.take(q, [j]), ops.take(k, [j]), ops.take(v, [j]),
                                                 ops.take(g, [j]), ops.take(beta, [j]), s, self._gdn_scale)))
            states.append(s)
        return ops.cat(outs)

    def _logits(self, d, h, d_parts=False):
        """Logits of the rows of the final hidden state h + d (summed by the output norm; d alone when
        h is None: no layers; d as split-K partials with ``d_parts``), on the model's device (numpy on the CPU)."""
        (logits,), _ = _EXACT.norm_group(d, self.output_norm, self.hp.rms_eps, [self.output], residual=h,
                                         in_partials=d_parts)
        return self._ops.a(logits)

    # ------------------------------------------------------------------ commit helpers

    def _conv_state_after(self, conv_state, conv_in, rows):
        """The K-1 conv inputs ending at the last of ``rows`` (a chain prefix or a tree path)."""
        ops = self._ops
        if len(rows) == 0:
            return ops.copy(conv_state)
        hist = ops.cat([conv_state, ops.take(conv_in, rows)])
        return ops.tail_rows(hist, conv_state.shape[0])

    def _compact_kv(self, st, i, c, rows):
        """Moves K/V of committed tree rows to consecutive cache rows c, c+1, ... (chains: no-op)."""
        moved = [(c + r, c + d) for d, r in enumerate(rows) if r != d]
        for cache in st.kv[i]:
            self._ops.move_rows(cache, moved)

    def _commit_rows(self, res: VerifyResult, n_or_path) -> list[int]:
        w = len(res.tokens)
        if res.parents is None:
            n = int(n_or_path)
            if not 0 <= n <= w:
                raise ValueError(f"commit: n must be in 0..{w}, got {n}")
            return list(range(n))
        path = [int(r) for r in n_or_path]
        for d, r in enumerate(path):
            want = -1 if d == 0 else path[d - 1]
            if not 0 <= r < w or res.parents[r] != want:
                raise ValueError(f"commit: {path} is not a root-to-node path of the verified tree")
        return path

    def _check_tokens(self, tokens, st: SequenceState) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int64)
        n = arr.shape[0] if arr.ndim == 1 else 0
        if n == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence of token ids")
        bad = arr[(arr < 0) | (arr >= self.hp.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.hp.n_vocab})")
        if st.released:
            raise ValueError("this sequence was released")
        if st.committed + n > st.capacity:
            raise ValueError(f"{n} tokens after {st.committed} committed exceed the sequence capacity {st.capacity}")
        return arr.astype(np.int32)


_GRAPH_MAX_W = 16  # widest captured chain verify (the exact GEMV's row slice)


class _Tree:
    """Parent indices of a verify tree after ``committed`` positions: depths, paths, and the
    attention mask (built once per verify)."""

    def __init__(self, parents, w: int, committed: int):
        self.parents = np.asarray(parents, np.int32)
        if self.parents.shape != (w,):
            raise ValueError(f"parents must have one entry per token ({w}), got {self.parents.shape}")
        self.depth = np.zeros(w, np.int32)
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"parents[{j}] = {p}: a parent must be -1 or an earlier row")
            self.depth[j] = 0 if p < 0 else self.depth[p] + 1
        # int32 [w, committed + w]: the whole prefix plus each node's ancestors and itself
        self.mask = np.zeros((w, committed + w), np.int32)
        self.mask[:, :committed] = 1
        for j in range(w):
            self.mask[j, committed + np.asarray(self.path(j))] = 1

    def path(self, j: int) -> list[int]:
        """Rows from the prefix's child down to row j."""
        out = []
        while j >= 0:
            out.append(j)
            j = int(self.parents[j])
        return out[::-1]


class _Linear:
    """The matmuls of one forward: ``exact`` (batch invariant: verify / decode) or not (the GPU may
    run more than 16 rows as a BF16 GEMM: prefill chunks; see Qwen35Model.verify). ``norm_group``
    runs the projections of one normed input together (one GEMV launch per format, bit-identical to
    separate calls), ``gated`` the attention's out projection of its sigmoid-gated output, ``gated_norm``
    the Gated DeltaNet's out projection of its gated-normed output,
    ``swiglu`` the FFN down projection of the SwiGLU.

    ``partials`` (exact forwards: the GEMV's decode / verify widths): the forward hands the out
    projections' and the FFN's outputs to the next op as split-K partials (it passes this as the
    methods' ``partials`` and ``in_partials``): on the GPU the norm or SwiGLU that reads them sums them,
    bit for bit as the GEMV's own sum kernel would, and that kernel's launch (one per GEMV) goes."""

    def __init__(self, exact: bool):
        self.exact = exact
        self.partials = exact

    def __call__(self, x, w):
        return sn.matmul(x, w, exact=self.exact)

    def norm_group(self, x, weight, eps, ws, residual=None, in_partials=False, partials=False):
        """(sn.matmul_group(u, ws), h) with (u, h) = rms_norm of h = x + residual (or x): sn.rms_norm_matmul,
        whose GPU norm kernel also writes the GEMV's input split (one launch fewer, bit-identical)."""
        return sn.rms_norm_matmul(x, weight, eps, ws, residual=residual, exact=self.exact, partials=partials,
                                  in_partials=in_partials)

    def gated(self, a, gate, w, partials=False):
        """mul_sigmoid(a, gate) (a [n, heads, d]) @ w^T: sn.mul_sigmoid_matmul, whose GPU x split computes the
        gate (one launch fewer, bit-identical)."""
        return sn.mul_sigmoid_matmul(a, gate, [w], exact=self.exact, partials=partials)[0]

    def gated_norm(self, x, weight, eps, z, w, partials=False):
        """rms_norm_gated(x, weight, eps, z) (x, z [n, heads, d]) @ w^T: sn.rms_norm_gated_matmul, whose GPU
        x split computes the gated norm (one launch fewer, bit-identical)."""
        return sn.rms_norm_gated_matmul(x, weight, eps, z, [w], exact=self.exact, partials=partials)[0]

    def swiglu(self, gate, up, w, in_partials=False, partials=False):
        """swiglu(gate, up) @ w^T: sn.swiglu_matmul (the GEMV's input split, or in prefill the BF16 GEMM's
        input conversion, computes the SwiGLU)."""
        return sn.swiglu_matmul(gate, up, [w], exact=self.exact, partials=partials, in_partials=in_partials)[0]


_EXACT, _INEXACT = _Linear(True), _Linear(False)
