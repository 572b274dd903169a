"""The drafter worker: a gRPC ``specd.worker.v1.DraftWorker`` server around a pluggable drafter.

A drafter object implements :class:`Drafter` (a structural protocol). Two exist:
:class:`specd.draft_worker.engine.ModelDrafter` (the DFlash / DSpark / DFlash 2 forward of a draft
GGUF bound to the target GGUF's embedding and head; ``--drafter D.gguf --target T.gguf``) and
:class:`specd.draft_worker.scripted.ScriptedDrafter` (test support and the oracle drafter). Per Propose the servicer attaches the sequence's feature ring
(first call, from the handle the coordinator forwards), reads the rows of the newly committed
positions [start, start + len(new_tokens)) from shared memory and hands them to the drafter with
their tokens, then asks for proposals. With ``feature_transport = "inline"`` the reader is a private
ring fed from the Propose's ``rows`` (the bytes the target returned, forwarded by the coordinator;
:mod:`specd.target_worker.feature_inline`); a handle of the other transport's kind ->
FAILED_PRECONDITION. Errors: unknown sequence on a non-first call or a row gap ->
FAILED_PRECONDITION; a ring that cannot be attached -> FAILED_PRECONDITION (shared memory not shared).

Per-request drafter options travel in ProposeRequest (:class:`ProposeOptions`): the DSpark
confidence threshold (0 = off), the per-position top-k (with its temperature) for DDTree and the
DSpark Markov mode (``dspark_markov``: fused / unfused / off; DEFAULT = this worker's
``--dspark-markov``, default fused; drafters.md §5.2–5.5). Option errors (threshold without a
confidence head, top_k above the drafter's ``max_top_k``, an unknown Markov mode) ->
INVALID_ARGUMENT. A Markov mode sent to a drafter without a Markov head (DFlash, DFlash 2,
scripted) is ignored, as vLLM / SGLang ignore options of other speculative methods; the response's
``dspark_markov`` then says DEFAULT (not applied) and the worker logs it once.

CLI: ``specd draft-worker --drafter D.gguf --target T.gguf --listen unix:///tmp/specd-draft.sock``
(add ``--target-worker unix:///tmp/specd-target.sock`` to map the target worker's embedding / head on
the same GPU instead of loading a copy; ``--share-target-weights off`` never does);
``specd draft-worker --scripted-block 8 --vocab 1024`` runs the scripted drafter (with no continuations
it proposes wrong tokens: a worst-case drafter for load tests).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import math
import threading
import time
from concurrent import futures

from typing import Protocol, Sequence, runtime_checkable

import grpc
import numpy as np

from specd.protos.v1 import worker_pb2 as pb
from specd.protos.v1 import worker_pb2_grpc as pbg
from specd.target_worker.feature_shm import FeatureHandleInfo, attach_reader, shm_namespace_id
from specd.target_worker.ipc_stream import (AUTO_SPIN_US, IDLE_TIMEOUT_S, PROPOSE_STREAM, ipc_info, ipc_path,
                                            resolve_spin_us)

from .model import DEFAULT_MARKOV, MARKOV_MODES

log = logging.getLogger("specd.draft_worker")
SERVICE_NAME = "specd.worker.v1.DraftWorker"  # the health service name (and "")

# ProposeRequest.dspark_markov / DrafterInfo.dspark_markov (worker.proto DSparkMarkov) <-> model.MARKOV_MODES
_MARKOV_NAME = {0: "", 1: "fused", 2: "unfused", 3: "off"}
_MARKOV_PB = {v: k for k, v in _MARKOV_NAME.items() if v}


@dataclasses.dataclass(frozen=True)
class ProposeOptions:
    """Per-request drafter options (from ProposeRequest).

    confidence_threshold: DSpark confidence gate in [0, 1); 0 = off (default). Drafts are kept up to
        (not including) the first with confidence < threshold (drafters.md §5.3).
    top_k: per-position candidates for DDTree (spec-loop.md §7.1); 0 = none (default).
    top_k_temperature: T of the top-k log-probs log_softmax(logits / T), finite > 0; default 1.0.
    dspark_markov: DSpark Markov mode, "" (default: the drafter's own default, ``--dspark-markov``)
        or one of "fused", "unfused", "off" (model.MARKOV_MODES). Ignored by non-DSpark drafters.
    """

    confidence_threshold: float = 0.0
    top_k: int = 0
    top_k_temperature: float = 1.0
    dspark_markov: str = ""

    def __post_init__(self):
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {self.confidence_threshold}")
        if self.top_k < 0 or not (self.top_k_temperature > 0 and math.isfinite(self.top_k_temperature)):
            raise ValueError(f"top_k must be >= 0 and top_k_temperature finite > 0, got {self.top_k}, "
                             f"{self.top_k_temperature}")
        if self.dspark_markov not in ("",) + MARKOV_MODES:
            raise ValueError(f"dspark_markov must be one of {MARKOV_MODES}, got {self.dspark_markov!r}")


@dataclasses.dataclass
class Draft:
    """One proposal: ``tokens`` [k] draft ids (d_1..d_k); ``confidence`` [k] in [0, 1] or [];
    with top_k: ``top_k_ids`` int32 [k, K] and ``top_k_logprobs`` float32 [k, K] (best first; row i is
    position i + 1), else None."""

    tokens: list
    confidence: list = dataclasses.field(default_factory=list)
    top_k_ids: "np.ndarray | None" = None
    top_k_logprobs: "np.ndarray | None" = None


@runtime_checkable
class Drafter(Protocol):
    """What the drafter worker needs from a drafter (ModelDrafter, ScriptedDrafter). Calls for one sequence never overlap; calls for different sequences may come from different
    threads.

    Attributes: ``name`` (reported by Info), ``block_size`` (most draft tokens per propose),
    ``n_vocab`` (must equal the target's), optionally ``target_layer_ids`` (the coordinator checks them
    against the target's capture layers), ``family``, ``max_top_k`` (0 / absent: no top-k) and
    ``has_confidence``. Optionally ``open(seq_id, capacity)``: called once when a sequence's feature
    ring is attached, with the ring's capacity (positions).
    """

    name: str
    block_size: int
    n_vocab: int

    def ingest(self, seq_id: str, start: int, tokens: Sequence[int], features: np.ndarray) -> None:
        """Committed positions ``start .. start+n-1``: their token ids and feature rows, float32
        ``[n, n_taps * n_embd]`` (the target's residual stream after each tap, tap order). Positions arrive
        in order without gaps, each exactly once, the prompt first. ValueError on a gap. ``features``
        may be a read-only view of the target's shared ring (shm transport) or a device tensor
        (cuda-ipc), valid for this call: a drafter copies what it keeps."""

    def propose(self, seq_id: str, anchor: int, max_tokens: int,
                options: "ProposeOptions | None" = None) -> "Draft | list[int] | tuple[list[int], list[float]]":
        """Up to ``max_tokens`` draft tokens following ``anchor`` (the token at position = ingested
        length): a :class:`Draft`, or a token list, or (tokens, confidences). ValueError on a bad
        option."""

    def release(self, seq_id: str) -> bool:
        """Forgets the sequence; True if it was known."""

    def live(self) -> list[str]:
        """Ids of the sequences held."""


@dataclasses.dataclass
class DraftWorkerConfig:
    """Drafter worker settings (each one a ``specd draft-worker`` flag).

    drafter: drafter GGUF (DFlash, DSpark or DFlash 2); "" runs the scripted drafter. Default "".
    target: the target GGUF whose token_embd / output the drafter reuses (required with drafter).
    drafter_kv_dtype: the drafter's context K/V cache type: "f32" (default), "f16" or "q8_0".
    dspark_markov: default DSpark Markov mode for requests that leave it unset: "fused" (default; one
        lm_head matmul for the block, then the Markov chain), "unfused" (per row: lm_head, bias,
        choice; bitwise identical to fused) or "off" (plain argmax of the base logits). Accepted
        (and ignored) for drafters without a Markov head.
    context_cap: 0 (default: every committed context row visible) or C > 0: full-attention layers
        see only the last C context rows (drafters.md §3.7).
    device: where the drafter runs: "auto" (default: "cuda" when this build has a GPU backend and a
        GPU is present, else "cpu"), "cpu" or "cuda" (DrafterModel(device=GPU): drafter weights, the
        target embedding / lm_head it reuses (mapped from the target worker or uploaded from the
        target GGUF: ``share_target_weights``) and the context K/V on the GPU). "cuda" in a CPU-only build or without a GPU is a clear error. The scripted
        drafter ignores it.
    cuda_graphs: on the GPU, replay greedy proposes as CUDA graphs captured per sequence (default
        True; bitwise the eager results, far less host work per propose; ``--no-cuda-graphs`` runs
        every op from Python). See :mod:`specd.draft_worker.model` (what is captured, what stays eager).
        Ignored on the CPU and by the scripted drafter.
    max_graphs: most captured graphs kept per sequence (least recently used evicted; each holds its
        own device arena, mostly the block's logits), >= 1, default 4. Ignored without cuda_graphs.
    listen: gRPC address, ``unix:///path.sock`` (default) or ``host:port``.
    scripted_block: block of the scripted drafter (drafts per step), default 8.
    vocab: vocabulary size for the scripted drafter (0: required when no drafter GGUF).
    scripted_continuations: JSON-lines file, one ``{"prompt": [ids], "continuation": [ids]}`` per line
        (the target's greedy continuation of that prompt): the oracle drafter of performance.md §6.6.
        Default "": no continuations (every draft wrong).
    scripted_accept: right drafts per step: -1 all (oracle, default), 0 none, k: right up to k.
    threads: RPC threads, default 0 = 72 (the target's default max_sequences 64 + 8); Propose calls take
        at most threads - 2 of them (one more is refused with RESOURCE_EXHAUSTED), so Health and
        Release always find a thread. An open ProposeStream counts as one Propose for its sequence's
        whole generation, so at most threads - 2 sequences speculate at once: size it to the
        target's max_sequences + 8.
    max_concurrent_rpcs: calls admitted at once (RESOURCE_EXHAUSTED beyond), default 0 = 4 x threads.
    max_message_bytes: default 256 MiB.
    idle_ttl_s: a sequence with no call for this long is freed (coordinator gone / Release lost),
        default 900 s; 0 = never.
    tombstone_cap: released ids remembered, default 4096.
    shutdown_grace_s: on SIGTERM, in-flight calls get this long, default 2 s.
    feature_transport: "shm" (default: attach the target's shared-memory ring), "inline" (feature
        rows arrive as bytes in each Propose; the target worker may be on another host) or "cuda-ipc"
        (map the target's device ring through CUDA/HIP IPC: device "cuda", the target's GPU; rows reach
        the drafter as device tensors). Must match the target worker and the coordinator.
    share_target_weights: where the drafter's copy of the target's token_embd / output comes from:
        "auto" (default) maps the target worker's exported tensors (CUDA/HIP IPC; they are alive for
        the target worker's life) when both workers run on the same GPU and ``target_worker`` is
        set and their content fingerprints match ``target``'s, else (CPU, another GPU, no address,
        another file's content or no fingerprint, a refused handle) loads its own copy from
        ``target`` and logs why; "off" always loads its own copy. See
        :mod:`specd.target_worker.shared_weights`. Ignored by the scripted drafter.
    target_worker: gRPC address of the target worker whose Info publishes the shared tensors
        (``specd serve`` passes its target worker's socket). Default "": none (own copy).
    target_watch_s: while the drafter maps the target's tensors, seconds between checks that the
        target worker is still the process that exported them (a restarted or vanished target frees
        that memory: the drafter then refuses Propose with FAILED_PRECONDITION and reports
        NOT_SERVING until restarted; :class:`specd.target_worker.shared_weights.TargetWatch`).
        Default 2 s; > 0.
    ipc_streams: also serve the ProposeStream on a framed Unix socket in a private temporary
        directory, offered with a random token in Info (:mod:`specd.target_worker.ipc_stream`; a
        co-located coordinator's hot path then skips gRPC), default True. At most ``threads``
        connections at once; removed when the server stops. ``--no-ipc-streams``: gRPC only.
    ipc_idle_timeout_s: an IPC stream with no new request for this long is closed and its compute
        slot freed (as target_worker.server.TargetWorkerConfig.ipc_idle_timeout_s). Default 80; 0.001 .. 1e9.
    ipc_spin_us: busy-poll an IPC stream's socket for up to this many microseconds before blocking for
        its next request (as target_worker.server.TargetWorkerConfig.ipc_spin_us). 0..100000 (0 = off)
        or -1 (the default): 1000 on a GPU, off on the CPU.
    ipc_wake_ahead: with ipc_spin_us > 0, a wait predicted to outlast the spin sleeps until shortly
        before the request is due, then spins (as target_worker.server.TargetWorkerConfig.ipc_wake_ahead).
        Default True.
    """

    drafter: str = ""
    target: str = ""
    drafter_kv_dtype: str = "f32"
    dspark_markov: str = DEFAULT_MARKOV
    context_cap: int = 0
    device: str = "auto"
    cuda_graphs: bool = True
    max_graphs: int = 4
    listen: str = "unix:///tmp/specd-draft.sock"
    scripted_block: int = 8
    vocab: int = 0
    scripted_continuations: str = ""
    scripted_accept: int = -1
    threads: int = 0
    max_concurrent_rpcs: int = 0
    max_message_bytes: int = 256 << 20
    idle_ttl_s: float = 900.0
    tombstone_cap: int = 4096
    shutdown_grace_s: float = 2.0
    feature_transport: str = "shm"
    share_target_weights: str = "auto"
    target_worker: str = ""
    target_watch_s: float = 2.0
    ipc_streams: bool = True
    ipc_idle_timeout_s: float = IDLE_TIMEOUT_S
    ipc_spin_us: int = AUTO_SPIN_US
    ipc_wake_ahead: bool = True

    def validate(self) -> None:
        from specd.target_worker.feature_inline import check_transport
        from specd.target_worker.ipc_stream import check_spin_us
        from specd.target_worker.server import check_bool, check_idle_timeout
        from specd.target_worker.shared_weights import check_share_mode

        check_transport(self.feature_transport, "draft-worker")
        check_bool(self.ipc_streams, "ipc_streams", "draft-worker")
        check_bool(self.cuda_graphs, "cuda_graphs", "draft-worker")
        if isinstance(self.max_graphs, bool) or not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise ValueError(f"draft-worker: --max-graphs must be an int >= 1, got {self.max_graphs!r}")
        check_idle_timeout(self.ipc_idle_timeout_s, "draft-worker")
        check_spin_us(self.ipc_spin_us, "draft-worker", auto=True)
        check_bool(self.ipc_wake_ahead, "ipc_wake_ahead", "draft-worker")
        check_share_mode(self.share_target_weights, "draft-worker")
        if not (self.target_watch_s > 0 and math.isfinite(self.target_watch_s)):
            raise ValueError(f"draft-worker: --target-watch-s must be > 0, got {self.target_watch_s}")
        if self.threads < 0 or self.max_message_bytes <= 0 or self.tombstone_cap <= 0:
            raise ValueError("draft-worker: threads >= 0, max_message_bytes and tombstone_cap > 0 required")
        for name in ("max_concurrent_rpcs", "idle_ttl_s", "shutdown_grace_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):  # nan passes a "< 0" test
                raise ValueError(f"draft-worker: {name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.dspark_markov not in MARKOV_MODES:
            raise ValueError(f"draft-worker: dspark_markov must be one of {MARKOV_MODES}, got {self.dspark_markov!r}")
        from specd.target_worker.server import check_device

        check_device(self.device, "draft-worker")
        from specd.target_worker.device import default_device
        from specd.target_worker.feature_cuda_ipc import check_device_transport

        check_device_transport(self.feature_transport, default_device() if self.device == "auto" else self.device,
                               "draft-worker")
        if self.drafter:
            if not self.target:
                raise ValueError("draft-worker: --drafter needs --target (the target GGUF whose embedding and "
                                 "head the drafter reuses)")
            if self.drafter_kv_dtype not in ("f32", "f16", "q8_0"):
                raise ValueError(f"draft-worker: --drafter-kv-dtype must be f32, f16 or q8_0, "
                                 f"got {self.drafter_kv_dtype!r}")
            if self.context_cap < 0:
                raise ValueError(f"draft-worker: --context-cap must be >= 0, got {self.context_cap}")
            if self.scripted_continuations:
                raise ValueError("draft-worker: --scripted-continuations is for the scripted drafter, not --drafter")
            return
        if self.scripted_block < 1 or self.vocab < 2:
            raise ValueError(f"draft-worker: --scripted-block >= 1 and --vocab >= 2 required, "
                             f"got {self.scripted_block}, {self.vocab}")
        if self.scripted_accept < -1:
            raise ValueError(f"draft-worker: --scripted-accept must be >= -1, got {self.scripted_accept}")

    @property
    def resolved_device(self) -> str:
        """"cpu" or "cuda" ("auto" resolved against this build and machine)."""
        from specd.target_worker.device import default_device

        return default_device() if self.device == "auto" else self.device


class _Seq:
    def __init__(self, reader):
        self.reader, self.synced = reader, 0
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        # (the last Propose's option fields, their checked ProposeOptions): a sequence sends the same
        # options every step, so they are parsed and checked once; one tuple, so concurrent Proposes
        # never pair one request's fields with another's options
        self.options: tuple[tuple, ProposeOptions] | None = None


class DraftServicer(pbg.DraftWorkerServicer):
    """Implements worker.proto DraftWorker over one drafter object (see the module docstring)."""

    def __init__(self, drafter: Drafter, idle_ttl_s: float = 0.0, tombstone_cap: int = 4096,
                 feature_transport: str = "shm"):
        if not isinstance(drafter, Drafter):
            raise TypeError(f"{type(drafter).__name__} does not implement the Drafter protocol")
        from specd.target_worker.feature_inline import check_transport

        self.transport = check_transport(feature_transport, "draft-worker")
        self.drafter = drafter
        self.idle_ttl_s, self.tombstone_cap = float(idle_ttl_s), int(tombstone_cap)
        self.seqs: dict[str, _Seq] = {}
        self.lock = threading.Lock()
        self.namespace = shm_namespace_id()
        self._markov_ignored_logged = False  # a Markov mode sent to a drafter without a Markov head: logged once
        self.head_lost = ""  # why the mapped target tensors are gone (target_lost); "" while fine
        self.health = None  # the server's health servicer (run() sets it): NOT_SERVING once head_lost
        self.target_watch = None  # the TargetWatch while the target's tensors are mapped
        # released ids: a Propose overtaken by its sequence's Release must not re-create it
        self.tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()
        from specd.target_worker.server import ComputeSlots

        self.slots = ComputeSlots(0)  # set by start_server from its thread count
        self.ipc_stream = None  # the IpcStreamServer Info offers (start_server sets it unless ipc_streams is off)

    def Info(self, request, context):
        with self.lock:
            live = sorted(self.seqs)
        return pb.DrafterInfo(name=self.drafter.name, block_size=self.drafter.block_size,
                              vocab_size=self.drafter.n_vocab, shm_namespace_id=self.namespace,
                              live_sequences=live,
                              target_layer_ids=list(getattr(self.drafter, "target_layer_ids", ())),
                              family=str(getattr(self.drafter, "family", self.drafter.name)),
                              max_top_k=int(getattr(self.drafter, "max_top_k", 0)),
                              has_confidence=bool(getattr(self.drafter, "has_confidence", False)),
                              feature_transport=self.transport,
                              dspark_markov=_MARKOV_PB.get(getattr(self.drafter, "dspark_markov", ""), 0),
                              memory=self.memory_proto(), compute_slots=self.slots.n, **ipc_info(self))

    def memory(self):
        """The drafter's :class:`specd.target_worker.memory.DrafterMemory`, or None (no model)."""
        from specd.draft_worker.model import DrafterModel
        from specd.target_worker.memory import drafter_memory

        model = getattr(self.drafter, "model", None)
        return (drafter_memory(model, getattr(self.drafter, "head_sharing", None)) if isinstance(model, DrafterModel)
                else None)

    def memory_proto(self):
        try:
            mem = self.memory()
        except Exception:  # noqa: BLE001 - Info must answer even if the accounting fails
            log.exception("drafter memory report failed")
            return None
        return None if mem is None else mem.to_proto(pb)

    def Propose(self, request, context):
        return self.slots.run(context, self._propose, request, context)

    def ProposeStream(self, request_iterator, context):
        """Propose over one stream per sequence: one ProposeResponse per ProposeRequest, in order
        (worker.proto; :meth:`specd.target_worker.server.ComputeSlots.stream`)."""
        return self.slots.stream(context, self._propose, request_iterator)

    def target_lost(self, reason: str) -> None:
        """The target worker whose tensors this drafter maps is gone (TargetWatch): every Propose from
        now on is refused with FAILED_PRECONDITION naming ``reason``, and health reports NOT_SERVING."""
        self.head_lost = reason
        health = self.health
        if health is not None:
            from grpc_health.v1 import health_pb2

            for svc in ("", SERVICE_NAME):
                health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _propose(self, request, context):
        if self.head_lost:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{self.head_lost}; this drafter worker maps freed memory and must be restarted")
        seq_id = request.seq_id
        with self.lock:
            s = self.seqs.get(seq_id)
        if s is None:
            if not request.HasField("features"):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"sequence {seq_id!r} is new to the drafter but carries no feature handle")
            h = request.features
            want = {"inline": "inline", "cuda-ipc": "cuda_ipc"}.get(self.transport, "posix_shm")
            if h.kind != want:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"feature handle kind {h.kind!r} does not match this drafter's feature_transport "
                              f"{self.transport!r} (expects {want!r})")
            try:
                reader = attach_reader(FeatureHandleInfo.from_proto(h))
            except (OSError, ValueError, RuntimeError) as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot attach feature ring {h.name}: {exc}")
            s = _Seq(reader)
            with self.lock:
                dead = seq_id in self.tombstones
                if not dead:
                    self.seqs[seq_id] = s
            if dead:
                reader.close()
                context.abort(grpc.StatusCode.CANCELLED, f"sequence {seq_id!r} was released")
            opener = getattr(self.drafter, "open", None)
            if opener is not None:
                opener(seq_id, int(h.capacity))
        key = (request.confidence_threshold, request.top_k, request.top_k_temperature, request.dspark_markov)
        cached = s.options
        if cached is not None and cached[0] == key:
            opts = cached[1]
        else:
            opts = self._options(request, context)
            s.options = (key, opts)
        t0 = time.perf_counter()
        s.last_used = time.monotonic()
        with s.lock:
            new = list(request.new_tokens)
            if request.start != s.synced:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"sequence {seq_id!r}: drafter is synced to {s.synced}, request starts at {request.start}")
            try:
                s.reader.feed(request.rows)  # inline rows (shm: must be none)
                feats = s.reader.read(request.start, len(new))
                if new:
                    self.drafter.ingest(seq_id, request.start, new, feats)
                del feats  # a view of the ring: gone before a Release can close the reader (s.lock)
                s.synced += len(new)
            except ValueError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"propose: {exc}")
            try:
                out = self.drafter.propose(seq_id, request.anchor, int(request.max_tokens), opts) \
                    if request.max_tokens else []
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"propose: {exc}")
        d = out if isinstance(out, Draft) else Draft(*out) if isinstance(out, tuple) else Draft(list(out))
        toks, conf = list(d.tokens), list(d.confidence)
        if len(toks) > request.max_tokens or (conf and len(conf) != len(toks)):
            context.abort(grpc.StatusCode.INTERNAL, f"drafter returned {len(toks)} tokens / {len(conf)} confidences "
                                                    f"for max_tokens {request.max_tokens}")
        applied = getattr(self.drafter, "dspark_markov", "")  # "" = no Markov head
        if opts.dspark_markov and not applied and not self._markov_ignored_logged:
            self._markov_ignored_logged = True
            log.warning("draft-worker: dspark_markov=%s ignored: the %s drafter has no Markov head", opts.dspark_markov,
                        getattr(self.drafter, "family", self.drafter.name))
        resp = pb.ProposeResponse(tokens=[int(t) for t in toks], confidence=[float(c) for c in conf],
                                  compute_s=time.perf_counter() - t0,
                                  dspark_markov=_MARKOV_PB[(opts.dspark_markov or applied)] if applied else 0)
        if opts.top_k and toks:
            ids, lps = d.top_k_ids, d.top_k_logprobs
            if ids is None or lps is None or np.shape(ids) != (len(toks), opts.top_k) \
                    or np.shape(lps) != (len(toks), opts.top_k):
                context.abort(grpc.StatusCode.INTERNAL, f"drafter returned top-k of shape {np.shape(ids)} / "
                                                        f"{np.shape(lps)} for {len(toks)} drafts and top_k {opts.top_k}")
            # one C-level conversion each (tolist), not a Python loop per element
            resp.top_k_ids.extend(np.asarray(ids, np.int64).reshape(-1).tolist())
            resp.top_k_logprobs.extend(np.asarray(lps, np.float64).reshape(-1).tolist())
        return resp

    def _options(self, request, context) -> ProposeOptions:
        """The request's ProposeOptions; aborts INVALID_ARGUMENT for options this drafter cannot serve."""
        try:
            mk = int(request.dspark_markov)
            if mk not in _MARKOV_NAME:
                raise ValueError(f"unknown dspark_markov {mk}")
            opts = ProposeOptions(float(request.confidence_threshold), int(request.top_k),
                                  float(request.top_k_temperature) or 1.0, _MARKOV_NAME[mk])
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"propose: {exc}")
        if opts.top_k > int(getattr(self.drafter, "max_top_k", 0)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"propose: top_k {opts.top_k} exceeds the drafter's max_top_k "
                          f"{int(getattr(self.drafter, 'max_top_k', 0))}")
        if opts.confidence_threshold and not getattr(self.drafter, "has_confidence", False):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "propose: confidence_threshold needs a DSpark drafter with a confidence head")
        return opts

    def Release(self, request, context):
        with self.lock:
            s = self.seqs.pop(request.seq_id, None)
            self.tombstones[request.seq_id] = None
            while len(self.tombstones) > self.tombstone_cap:
                self.tombstones.popitem(last=False)
        if s is not None:
            with s.lock:
                s.reader.close()
        existed = self.drafter.release(request.seq_id)
        return pb.ReleaseResponse(existed=s is not None or existed)

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Frees sequences with no call for longer than ``idle_ttl_s``; returns their ids."""
        if not self.idle_ttl_s:
            return []
        now = time.monotonic() if now is None else now
        reaped = []
        with self.lock:
            idle = [k for k, s in self.seqs.items() if now - s.last_used > self.idle_ttl_s]
        for seq_id in idle:
            with self.lock:
                s = self.seqs.get(seq_id)
                if s is None or not s.lock.acquire(blocking=False):
                    continue
                try:
                    if now - s.last_used <= self.idle_ttl_s:
                        continue
                    del self.seqs[seq_id]
                    self.tombstones[seq_id] = None
                    while len(self.tombstones) > self.tombstone_cap:
                        self.tombstones.popitem(last=False)
                    s.reader.close()
                finally:
                    s.lock.release()
            self.drafter.release(seq_id)
            reaped.append(seq_id)
        if reaped:
            log.warning("freed %d idle sequence(s) (no call for %.0f s): %s", len(reaped), self.idle_ttl_s, reaped[:8])
        return reaped

    def close(self) -> None:
        """Shutdown: closes every sequence's feature ring, then the drafter (``close``, when it has
        one: a ModelDrafter closes its mapping of the target's shared embedding / head)."""
        if self.target_watch is not None:
            self.target_watch.close()
        with self.lock:
            seqs, self.seqs = list(self.seqs.items()), {}
        for seq_id, s in seqs:
            s.reader.close()
            self.drafter.release(seq_id)
        closer = getattr(self.drafter, "close", None)
        if closer is not None:
            closer()


def start_server(servicer: DraftServicer, listen: str, threads: int = 72, max_message_bytes: int = 256 << 20,
                 max_concurrent_rpcs: int = 0, ipc_streams: bool = True,
                 ipc_idle_timeout_s: float = IDLE_TIMEOUT_S, ipc_spin_us: int = 0, ipc_wake_ahead: bool = True):
    """Starts the drafter worker's server (Propose admitted by compute slots; the idle reaper when the
    servicer has a TTL; the ProposeStream also on an IPC stream socket with ``ipc_streams``, spinning up
    to ``ipc_spin_us`` before each blocking read of a request, timed by ``ipc_wake_ahead``; see
    target_worker.server.start_worker_server); returns (server, bound port)."""
    from specd.target_worker.server import start_worker_server

    return start_worker_server(servicer, listen, pbg.add_DraftWorkerServicer_to_server, SERVICE_NAME,
                               "draft-worker", threads, max_message_bytes, max_concurrent_rpcs, servicer.idle_ttl_s,
                               PROPOSE_STREAM if ipc_streams else None, ipc_idle_timeout_s, ipc_spin_us,
                               ipc_wake_ahead)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DraftWorkerConfig()
    p.add_argument("--drafter", default=d.drafter,
                   help="drafter GGUF: DFlash, DSpark or DFlash 2 (default none: the scripted drafter)")
    p.add_argument("--target", default=d.target, help="target GGUF whose embedding/head the drafter reuses "
                                                      "(required with --drafter)")
    p.add_argument("--drafter-kv-dtype", default=d.drafter_kv_dtype, choices=["f32", "f16", "q8_0"],
                   help=f"drafter context K/V cache type (default {d.drafter_kv_dtype})")
    p.add_argument("--dspark-markov", default=d.dspark_markov, choices=list(MARKOV_MODES),
                   help=f"default DSpark Markov mode (default {d.dspark_markov}): fused = one lm_head matmul "
                        "then the chain; unfused = per-row lm_head (bitwise identical); off = argmax of the "
                        "base logits. Ignored for non-DSpark drafters")
    p.add_argument("--context-cap", type=int, default=d.context_cap,
                   help="full-attention drafter layers see only the last C context rows (default 0: all)")
    from specd.target_worker.server import add_device_argument

    add_device_argument(p, d.device, "drafter")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                   help="on the GPU, replay greedy proposes as CUDA graphs captured per sequence (default on)")
    p.add_argument("--max-graphs", type=int, default=d.max_graphs,
                   help=f"most captured CUDA graphs kept per sequence, LRU-evicted, >= 1 (default {d.max_graphs})")
    p.add_argument("--listen", default=d.listen, help=f"gRPC address (default {d.listen})")
    p.add_argument("--scripted-block", type=int, default=d.scripted_block,
                   help=f"scripted drafter: drafts per step (default {d.scripted_block})")
    p.add_argument("--vocab", type=int, default=d.vocab,
                   help="scripted drafter: vocabulary size (required without --drafter)")
    p.add_argument("--scripted-continuations", default=d.scripted_continuations,
                   help='scripted drafter: JSONL of {"prompt": [...], "continuation": [...]} (oracle drafter)')
    p.add_argument("--scripted-accept", type=int, default=d.scripted_accept,
                   help="scripted drafter: right drafts per step (-1 all, default; 0 none; k up to k)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="RPC threads (default 0: 72 = the target's default max-sequences + 8)")
    add_share_argument(p, d.share_target_weights)
    p.add_argument("--target-worker", default=d.target_worker,
                   help="gRPC address of the target worker whose exported token_embd / output the drafter maps "
                        "(--share-target-weights auto; default none: own copy)")
    p.add_argument("--target-watch-s", type=float, default=d.target_watch_s,
                   help=f"seconds between checks that the target worker whose tensors are mapped is still the "
                        f"exporting process (default {d.target_watch_s:g}; a restarted target makes the drafter "
                        "refuse Propose until restarted)")
    from specd.target_worker.server import add_worker_server_arguments

    add_worker_server_arguments(p, d)


def add_share_argument(p: argparse.ArgumentParser, default: str = "auto") -> None:
    from specd.target_worker.shared_weights import SHARE_MODES

    p.add_argument("--share-target-weights", default=default, choices=list(SHARE_MODES),
                   help=f"target token_embd / output for the drafter (default {default}): auto = map the target "
                        "worker's copy (CUDA IPC) when both workers are on the same GPU, else load an own copy "
                        "(the reason is logged); off = always an own copy")


def load_continuations(path: str) -> dict:
    """prompt tuple -> continuation from a JSON-lines file (see DraftWorkerConfig); {} for ""."""
    import json

    out = {}
    if not path:
        return out
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[tuple(int(t) for t in rec["prompt"])] = [int(t) for t in rec["continuation"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected {{\"prompt\": [ids], \"continuation\": [ids]}}: {exc}") from exc
    return out


def make_drafter(cfg: DraftWorkerConfig) -> Drafter:
    """The drafter a validated config names: a ModelDrafter over ``cfg.drafter`` bound to
    ``cfg.target`` (pair-checked; DrafterPairError names both files), else the scripted drafter."""
    if cfg.drafter:
        from .engine import open_model_drafter

        d = open_model_drafter(cfg.drafter, cfg.target, kv_dtype=cfg.drafter_kv_dtype, context_cap=cfg.context_cap,
                               dspark_markov=cfg.dspark_markov, device=cfg.resolved_device,
                               cuda_graphs=cfg.cuda_graphs, max_graphs=cfg.max_graphs,
                               share_target_weights=cfg.share_target_weights, target_worker=cfg.target_worker)
        hs = d.head_sharing
        log.info("draft-worker: %s (device %s; target token_embd / output: %s)", d.hp.summary(), cfg.resolved_device,
                 "mapped from the target worker" if hs is not None and hs.shared else "own copy")
        return d
    from .scripted import ScriptedDrafter

    return ScriptedDrafter(cfg.scripted_block, cfg.vocab, load_continuations(cfg.scripted_continuations),
                           plan=None if cfg.scripted_accept < 0 else cfg.scripted_accept, record_features=False)


def run(args) -> int:
    from specd.target_worker.server import serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = DraftWorkerConfig(drafter=args.drafter, target=args.target, drafter_kv_dtype=args.drafter_kv_dtype,
                            dspark_markov=getattr(args, "dspark_markov", DEFAULT_MARKOV),
                            context_cap=args.context_cap, device=getattr(args, "device", "auto"),
                            cuda_graphs=getattr(args, "cuda_graphs", True), max_graphs=getattr(args, "max_graphs", 4),
                            listen=args.listen, scripted_block=args.scripted_block,
                            vocab=args.vocab, scripted_continuations=args.scripted_continuations,
                            scripted_accept=args.scripted_accept, threads=args.threads,
                            max_concurrent_rpcs=args.max_concurrent_rpcs, max_message_bytes=args.max_message_bytes,
                            idle_ttl_s=args.idle_ttl_s, tombstone_cap=args.tombstone_cap,
                            shutdown_grace_s=args.shutdown_grace_s, feature_transport=args.feature_transport,
                            share_target_weights=getattr(args, "share_target_weights", "auto"),
                            target_worker=getattr(args, "target_worker", ""),
                            target_watch_s=getattr(args, "target_watch_s", 2.0), ipc_streams=args.ipc_streams,
                            ipc_idle_timeout_s=getattr(args, "ipc_idle_timeout_s", IDLE_TIMEOUT_S),
                            ipc_spin_us=getattr(args, "ipc_spin_us", AUTO_SPIN_US),
                            ipc_wake_ahead=getattr(args, "ipc_wake_ahead", True))
    cfg.validate()
    servicer = DraftServicer(make_drafter(cfg), cfg.idle_ttl_s, cfg.tombstone_cap, cfg.feature_transport)
    server, _ = start_server(servicer, cfg.listen, cfg.threads or 72, cfg.max_message_bytes, cfg.max_concurrent_rpcs,
                             cfg.ipc_streams, cfg.ipc_idle_timeout_s,
                             resolve_spin_us(cfg.ipc_spin_us, cfg.resolved_device), cfg.ipc_wake_ahead)
    servicer.health = server.health
    head = getattr(servicer.drafter, "shared_head", None)
    if head is not None:
        from specd.target_worker.shared_weights import TargetWatch

        servicer.target_watch = TargetWatch(cfg.target_worker, head.owner_id, cfg.target_watch_s,
                                            servicer.target_lost).start()
    log.info("draft-worker: %s drafter (block %d) on %s (IPC stream socket %s)", servicer.drafter.name,
             servicer.drafter.block_size, cfg.listen, ipc_path(server))
    try:
        mem = servicer.memory()
        if mem is not None:
            log.info("draft-worker %s", "\n".join(mem.lines()))
    except Exception:  # noqa: BLE001 - reporting must not stop the worker
        log.exception("drafter memory report failed")
    print(f"READY {cfg.listen}", flush=True)
    return serve_forever(server, servicer.close, "draft-worker", cfg.shutdown_grace_s)
