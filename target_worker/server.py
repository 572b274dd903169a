"""The target worker: a gRPC ``specd.worker.v1.TargetWorker`` server around :class:`Qwen35Model`.

Holds many sequences keyed by the coordinator's sequence id (string). Per sequence: the model's
:class:`SequenceState` (KV, GDN and conv state), a feature ring in POSIX shared memory
(:mod:`.feature_shm`, read by the drafter worker) and the last deferred verify, if any. Model calls are
serialised by one lock (one model, one device; batching across sequences is later work), RPC threads
only parse and format messages.

Greedy chain acceptance (spec-loop.md §3): verify ``[a, d_1..d_k]`` at positions c..c+k, t_i = argmax
of row i, m = longest prefix with d_{j} = t_{j-1}, capped by ``max_accept``; emitted = d_1..d_m, t_m;
commit rows 0..m (anchor + m drafts) so c <- c + m + 1 and the bonus t_m becomes the next anchor.

Plain runs (``plain_steps`` n > 1, worker.proto): up to n plain steps in one call, each the same
one-row verify + commit as a single plain call, so the tokens are those of n calls; the model lock is
taken per step (other sequences' calls interleave) and the run ends early at a stop token or when the
call is cancelled. One call instead of n saves the coordinator round trip per plain token.

Tree verify (spec-loop.md §7): ``Verify`` with ``parents`` runs the tree with an ancestor-only mask,
walks it from the root along the per-node argmax and commits the accepted path (KV / feature
compaction, recurrent state re-run along the path: :meth:`Qwen35Model.commit` with a path).

Errors: unknown sequence -> NOT_FOUND; duplicate Prefill -> ALREADY_EXISTS; bad tokens, capacity
overflow, bad commit -> INVALID_ARGUMENT / FAILED_PRECONDITION. The worker keeps serving after any of
them (architecture.md invariant 5).

CLI: ``specd target-worker --target T.gguf --listen unix:///tmp/specd-target.sock --capture-layers 1,3``.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import math
import signal
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from specd.protos.v1 import worker_pb2 as pb
from specd.protos.v1 import worker_pb2_grpc as pbg

from specd.coordinator.ddtree import walk_tree

from .feature_inline import InlineFeatureWriter, check_transport, encode_rows, inline_max_rows
from .feature_shm import FeatureWriter, ShmExhausted, shm_namespace_id
from .ipc_stream import (AUTO_SPIN_US, GPU_SPIN_US, IDLE_TIMEOUT_S, MAX_IDLE_TIMEOUT_S, MAX_SPIN_US,
                         MIN_IDLE_TIMEOUT_S, VERIFY_STREAM, IpcMethod, check_spin_us, ipc_info, ipc_path,
                         resolve_spin_us, serve_ipc_streams)

log = logging.getLogger("specd.target_worker")


@dataclasses.dataclass
class TargetWorkerConfig:
    """Target worker settings (each one a ``specd target-worker`` flag).

    target: path of the qwen35 GGUF (required).
    listen: gRPC address, ``unix:///path.sock`` (co-located, default) or ``host:port``.
    capture_layers: the drafter's target_layer_ids (empty: no drafter features; rows are then n_embd
        zeros so the ring protocol still works).
    max_seq_len: positions per sequence (0: the GGUF context_length, else 4096).
    max_verify: most rows per Verify (1 + drafts), default 33; also the most steps of a plain run
        (``VerifyRequest.plain_steps``, reported as ``TargetInfo.max_plain_steps``).
    max_sequences: live sequences at once (RESOURCE_EXHAUSTED beyond), default 64.
    kv_dtype: "f16" (default), "q8_0" or "f32".
    prefill_chunk: tokens per prefill forward, > 0, default 2048 (on the GPU each chunk dequantizes
        every weight matrix to BF16 once, so longer chunks prefill faster; the workspace reserve grows
        with the chunk: :func:`.memory.workspace_bytes`; a cancelled prefill stops at the next chunk
        boundary, so shorter chunks stop sooner).
    device: where the target runs: "auto" (default: "cuda" when this build has a GPU backend and a
        GPU is present, else "cpu"), "cpu" or "cuda" (Qwen35Model(device=GPU): weights, KV cache and
        recurrent state on the GPU). "cuda" in a CPU-only build or without a GPU is a clear error.
    cuda_graphs: on the GPU, replay chain verifies of up to 16 rows as captured CUDA graphs (default
        True; bitwise the eager results, far less host work per step). Ignored on the CPU.
    max_graphs: most captured verify graphs kept (least recently used evicted; each holds its own
        device arena), >= 1, default 16. Ignored without cuda_graphs.
    slot_cache: released sequences' device states (K/V caches, GDN and conv states, capacity rounded
        up to 1024 positions) kept with their captured graphs for the next sequences of the same
        capacity class, so a new request replays graphs instead of capturing them, >= 0, default 2
        (0: freed at release). Ignored without cuda_graphs.
    gemv_tiles: on a CUDA GPU, place the layers' IQ4_XS, Q4_K, Q5_K and Q6_K matrices (and an untied output head
        of those types) in the tensor-core GEMV's tiled layouts (default True; same bytes, bit-identical results, faster decode). Ignored elsewhere.
    export_head: on the GPU, place token_embd / output in IPC-exported buffers and publish their
        handles in Info, so a drafter worker on the same GPU maps them instead of a second copy
        (default True; :mod:`.shared_weights`). The mapping is writable (CUDA's legacy IPC): False
        keeps them private to this process.
    threads: RPC threads, default 0 = max_sequences + 8. Compute calls (Prefill/Verify/Commit) take
        at most threads - 2 (one more is refused at once with RESOURCE_EXHAUSTED), so Health, Release
        and Info always find a thread; every live sequence can have its one compute call in flight.
        An open VerifyStream counts as one compute call for its sequence's whole generation (its
        thread waits for the next step), so max_sequences generating sequences fit. The worker's
        keepalive (KEEPALIVE_TIME_MS 60 s, ack within KEEPALIVE_TIMEOUT_MS 20 s) ends the streams of a
        coordinator that vanished without closing its connection, which frees their slots.
    max_concurrent_rpcs: calls admitted at once (RESOURCE_EXHAUSTED beyond), default 0 = 4 x threads.
    max_message_bytes: gRPC send/receive limit, default 256 MiB.
    idle_ttl_s: a sequence with no call for this long is freed (leases against a coordinator that
        crashed or whose Release failed), default 900 s; 0 = never.
    tombstone_cap: released ids remembered (so a Prefill overtaken by its Release does not
        resurrect the sequence), default 4096.
    shutdown_grace_s: on SIGTERM, in-flight calls get this long before the server stops, default 2 s.
    feature_transport: how feature rows reach the drafter: "shm" (default; a POSIX shared-memory ring
        per sequence, both workers on one host) or "inline" (the rows each call commits are returned
        as bytes in its response and the coordinator forwards them in the next Propose; workers on
        different hosts). See :mod:`.feature_inline`. "cuda-ipc": the ring in device memory shared with
        the drafter worker on the same GPU through CUDA/HIP IPC (:mod:`.feature_cuda_ipc`); needs
        device "cuda" here and on the drafter worker (ValueError otherwise).
    ipc_streams: also serve the VerifyStream on a framed Unix socket in a private temporary directory,
        offered with a random token in Info (:mod:`.ipc_stream`; a co-located coordinator's hot path
        then skips gRPC), default True. At most ``rpc_threads`` connections at once; the socket and
        its directory are removed when the server stops. ``--no-ipc-streams``: gRPC only.
    ipc_idle_timeout_s: an IPC stream with no new request for this long is closed and its compute
        slot freed (a coordinator that hangs without closing; gRPC streams get the same from keepalive,
        whose bound is also 80 s). Default 80; 0.001 .. 1e9 (each stream's SO_RCVTIMEO), and longer than
        any pause of the coordinator between a sequence's steps (its send_stall_timeout_s, 60 s by default).
    ipc_spin_us: before blocking for an IPC stream's next request, busy-poll its socket for up to this
        many microseconds (:class:`.ipc_stream.FrameReader`): a request arriving within the spin skips
        the connection thread's wake-up (~0.15 ms on the H200 host, a VM). Costs a busy core for up to
        that long per request and open stream. An int in 0..100000 (MAX_SPIN_US; 0 = off) or -1
        (AUTO_SPIN_US, the default): 1000 on a GPU, off on the CPU (:func:`.ipc_stream.resolve_spin_us`;
        on the H200 the workers' spin with wake-ahead took the AL 5 step's loop overhead from 6.6 to
        5.7 %, BENCHMARKS.md).
    ipc_wake_ahead: with ipc_spin_us > 0, a wait predicted (from the stream's last waits) to outlast
        the spin sleeps until shortly before the request is due, then spins
        (:class:`.ipc_stream.WakeAhead`): a drafter's wait across a whole verify ends in a spin too.
        Default True; ``--no-ipc-wake-ahead`` spins right after each answer only.
    """

    target: str = ""
    listen: str = "unix:///tmp/specd-target.sock"
    capture_layers: tuple[int, ...] = ()
    max_seq_len: int = 0
    max_verify: int = 33
    max_sequences: int = 64
    kv_dtype: str = "f16"
    prefill_chunk: int = 2048
    device: str = "auto"
    cuda_graphs: bool = True
    max_graphs: int = 16
    slot_cache: int = 2
    gemv_tiles: bool = True
    export_head: bool = True
    threads: int = 0
    max_concurrent_rpcs: int = 0
    max_message_bytes: int = 256 << 20
    idle_ttl_s: float = 900.0
    tombstone_cap: int = 4096
    shutdown_grace_s: float = 2.0
    feature_transport: str = "shm"
    ipc_streams: bool = True
    ipc_idle_timeout_s: float = IDLE_TIMEOUT_S
    ipc_spin_us: int = AUTO_SPIN_US
    ipc_wake_ahead: bool = True

    def validate(self) -> None:
        if not self.target:
            raise ValueError("target-worker: --target is required")
        check_bool(self.ipc_streams, "ipc_streams", "target-worker")
        check_bool(self.ipc_wake_ahead, "ipc_wake_ahead", "target-worker")
        check_idle_timeout(self.ipc_idle_timeout_s, "target-worker")
        check_spin_us(self.ipc_spin_us, "target-worker", auto=True)
        check_transport(self.feature_transport, "target-worker")
        for name in ("max_verify", "max_sequences", "prefill_chunk", "max_message_bytes", "tombstone_cap",
                     "max_graphs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"target-worker: {name} must be > 0, got {getattr(self, name)}")
        for name in ("threads", "max_concurrent_rpcs", "idle_ttl_s", "shutdown_grace_s", "slot_cache"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):  # nan passes a "< 0" test
                raise ValueError(f"target-worker: {name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.max_seq_len < 0:
            raise ValueError(f"target-worker: max_seq_len must be >= 0, got {self.max_seq_len}")
        if self.kv_dtype not in ("f16", "q8_0", "f32"):
            raise ValueError(f"target-worker: kv_dtype must be f16, q8_0 or f32, got {self.kv_dtype!r}")
        check_device(self.device, "target-worker")
        from .feature_cuda_ipc import check_device_transport

        check_device_transport(self.feature_transport, self.device if self.device != "auto" else self.resolved_device,
                               "target-worker")

    @property
    def resolved_device(self) -> str:
        """"cpu" or "cuda" ("auto" resolved against this build and machine)."""
        from .device import default_device

        return default_device() if self.device == "auto" else self.device

    @property
    def rpc_threads(self) -> int:
        return self.threads or self.max_sequences + 8


def check_idle_timeout(value, who: str) -> None:
    """ValueError unless ``value`` (ipc_idle_timeout_s) is a number in MIN_IDLE_TIMEOUT_S..MAX_IDLE_TIMEOUT_S:
    each IPC stream's SO_RCVTIMEO, which a larger or infinite value cannot be packed into (every stream
    would fail after its hello) and a smaller one rounds to 0 (no idle bound)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not MIN_IDLE_TIMEOUT_S <= value <= MAX_IDLE_TIMEOUT_S):
        raise ValueError(f"{who}: ipc_idle_timeout_s must be a number > 0 ({MIN_IDLE_TIMEOUT_S:g}.."
                         f"{MAX_IDLE_TIMEOUT_S:g} seconds), got {value!r}")


def check_bool(value, name: str, who: str) -> None:
    """ValueError unless ``value`` is a bool (a typed on/off field set from code or a config file)."""
    if not isinstance(value, bool):
        raise ValueError(f"{who}: {name} must be true or false, got {value!r}")


def _abort(context, code, msg):
    context.abort(code, msg)


class _Seq:
    def __init__(self, st, handle):
        self.st, self.handle, self.pending = st, handle, None
        self.released = False  # set (under lock) when Release / the reaper / close freed it
        self.lock = threading.Lock()
        self.last_used = time.monotonic()


MAX_RUN_STOP_IDS = 4096  # most stop_token_ids of a plain run (worker.proto)
LIGHT_RESERVE = 2  # RPC threads kept free of compute calls (Health, Release, Info always find one)


class ComputeSlots:
    """Admission of compute calls (Prefill / Verify / Commit / Propose): at most ``n`` run at once and
    one more is refused at once with RESOURCE_EXHAUSTED instead of queueing, so the
    ``LIGHT_RESERVE`` remaining RPC threads stay free for Health, Release and Info. ``n`` 0: no limit."""

    def __init__(self, n: int = 0):
        self.n = n
        self.sem = threading.BoundedSemaphore(n) if n else None

    @classmethod
    def for_threads(cls, threads: int) -> "ComputeSlots":
        return cls(threads - LIGHT_RESERVE if threads > LIGHT_RESERVE else 0)

    def _acquire(self, context) -> None:
        if not self.sem.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"worker busy: all {self.n} compute slots are taken (threads - {LIGHT_RESERVE} reserved "
                          "for health/release)")

    def run(self, context, fn, *args):
        if self.sem is None:
            return fn(*args)
        self._acquire(context)
        try:
            return fn(*args)
        finally:
            self.sem.release()

    def stream(self, context, fn, request_iterator):
        """A per-sequence request stream (VerifyStream / ProposeStream): yields ``fn(request,
        context)`` for each request, in order. The stream holds one slot from its start to its end
        (its thread is taken while it waits for the next request), so it is admitted like one compute
        call; the first error (``context.abort``) ends the stream with that status."""
        if self.sem is not None:
            self._acquire(context)
        try:
            for request in request_iterator:
                yield fn(request, context)
        finally:
            if self.sem is not None:
                self.sem.release()


class IdleReaper:
    """A daemon thread calling ``servicer.reap_idle()`` every min(ttl / 4, 30) s until ``stop()``."""

    def __init__(self, servicer, ttl_s: float):
        self._stop = threading.Event()
        self.period = max(0.01, min(ttl_s / 4.0, 30.0))

        def loop():
            while not self._stop.wait(self.period):
                try:
                    servicer.reap_idle()
                except Exception:  # noqa: BLE001 - the reaper must outlive one bad sweep
                    log.exception("idle sweep failed")

        self.thread = threading.Thread(target=loop, name="specd-idle-reaper", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()


class TargetServicer(pbg.TargetWorkerServicer):
    """Implements worker.proto TargetWorker over one :class:`Qwen35Model`.

    Args:
        model: the loaded model (its ``capture_layers`` define the feature width).
        config: limits (max_seq_len, max_verify, max_sequences) and the model path for Info.
        eos_ids: EOS then EOT token ids reported by Info (from the GGUF tokenizer metadata).
    """

    def __init__(self, model, config: TargetWorkerConfig, eos_ids=()):
        self.model, self.cfg = model, config
        hp = model.hp
        self.max_seq_len = config.max_seq_len or (hp.context_length or 4096)
        self.width = max(1, len(model.capture_layers)) * hp.n_embd
        self.eos_ids = [int(e) for e in eos_ids if e is not None and e >= 0]
        self.transport = check_transport(getattr(config, "feature_transport", "shm"), "target-worker")
        self.inline = self.transport == "inline"
        if self.transport == "cuda-ipc":
            from .feature_cuda_ipc import CudaIpcFeatureWriter

            self.features = CudaIpcFeatureWriter()
        else:
            self.features = InlineFeatureWriter() if self.inline else FeatureWriter()
        self.inline_max_rows = inline_max_rows(config.max_message_bytes, self.width)
        self.seqs: dict[str, _Seq] = {}
        self.seqs_lock = threading.Lock()
        self.model_lock = threading.Lock()
        self.namespace = shm_namespace_id()
        # ids released before (or while) their Prefill ran: a cancelled request's Release can overtake
        # its Prefill; the Prefill then frees what it built instead of leaking it (bounded memory)
        self.tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.slots = ComputeSlots(0)  # set by start_server from its thread count
        self.ipc_stream = None  # the IpcStreamServer Info offers (start_server sets it unless --no-ipc-streams)
        self._memory = None  # MemoryReport without device measurements (static after load)

    def memory_report(self, measure: bool = True):
        """The worker's :class:`.memory.MemoryReport` at max_seq_len / max_sequences / max_verify
        (with ``measure``, the GPU's current memory figures too)."""
        from .memory import report

        if measure or self._memory is None:
            rep = report(self.model, self.max_seq_len, self.cfg.max_sequences, self.cfg.max_verify, measure=measure,
                         feature_transport=self.transport)
            if not measure:
                self._memory = rep
            return rep
        return self._memory

    # ------------------------------------------------------------------ helpers

    def _tombstone(self, seq_id: str) -> None:
        self.tombstones[seq_id] = None
        while len(self.tombstones) > self.cfg.tombstone_cap:
            self.tombstones.popitem(last=False)

    def _get(self, seq_id, context) -> _Seq:
        with self.seqs_lock:
            s = self.seqs.get(seq_id)
        if s is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"unknown sequence {seq_id!r}")
        s.last_used = time.monotonic()
        return s

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Frees sequences idle for longer than ``idle_ttl_s`` (their coordinator is gone or its
        Release was lost); returns their ids. A sequence with a call in flight is skipped."""
        ttl = self.cfg.idle_ttl_s
        if not ttl:
            return []
        now = time.monotonic() if now is None else now
        with self.seqs_lock:
            idle = [k for k, s in self.seqs.items() if s is not None and now - s.last_used > ttl]
        reaped = []
        for seq_id in idle:
            with self.seqs_lock:
                s = self.seqs.get(seq_id)
                if s is None or not s.lock.acquire(blocking=False):
                    continue
                try:
                    if now - s.last_used <= ttl:
                        continue
                    del self.seqs[seq_id]
                    self._tombstone(seq_id)
                finally:
                    s.lock.release()
            with s.lock:  # a call that found it just before the removal finishes first
                self._free_seq(s)
            self.features.release(seq_id)
            reaped.append(seq_id)
        if reaped:
            log.warning("freed %d idle sequence(s) (no call for %.0f s): %s", len(reaped), ttl, reaped[:8])
        return reaped

    def _free_state(self, st, seq: "_Seq | None" = None) -> None:
        """Releases a sequence's device state (model.release: freed, or kept with its captured graphs
        for a later sequence, --slot-cache) and drops ``seq``'s pending verify under model_lock, the
        lock of every forward and capture: a graph's destructor waits for its last replay, and no
        buffer is freed beside another call's capture."""
        with self.model_lock:
            if seq is not None:
                seq.pending = None
            release = getattr(self.model, "release", None)
            if st is not None and release is not None:
                release(st)

    def _free_seq(self, s: "_Seq") -> None:
        """Marks a removed sequence released (calls that still hold it are refused) and releases its
        pending verify and device state under model_lock (:meth:`_free_state`). Call with ``s.lock`` held."""
        s.released = True
        self._free_state(s.st, s)

    def _drop_reserved(self, seq_id: str, st=None) -> None:
        """Undoes a Prefill's reservation and frees the ring it may have created (and ``st``, the
        state it built, under model_lock)."""
        with self.seqs_lock:
            if self.seqs.get(seq_id, 0) is None:
                del self.seqs[seq_id]
        self._free_state(st)
        self.features.release(seq_id)

    def _create_ring(self, seq_id: str, cap: int, context):
        return self.features.create(seq_id, cap, self.width)


    def close(self) -> None:
        """Frees every sequence and unlinks every shared-memory segment."""
        with self.seqs_lock:
            live = [s for s in self.seqs.values() if s is not None]
            self.seqs.clear()
        for s in live:  # without s.lock: the server has stopped; model_lock still orders the frees
            s.released = True
            self._free_state(s.st, s)
        self.features.close_all()
        # the exported token_embd / output: unpublished and unregistered (the model keeps its tensors;
        # the memory is freed with the model, after the drafter worker, stopped first, closed its mapping)
        exporter, self.model.head_exporter = getattr(self.model, "head_exporter", None), None
        if exporter is not None:
            exporter.close()

    # ------------------------------------------------------------------ RPCs

    def Info(self, request, context):
        hp = self.model.hp
        with self.seqs_lock:
            live = sorted(self.seqs)
        return pb.TargetInfo(model_path=str(self.cfg.target), vocab_size=hp.n_vocab, n_embd=hp.n_embd,
                             max_seq_len=self.max_seq_len, max_verify=self.cfg.max_verify,
                             capture_layers=list(self.model.capture_layers), feature_width=self.width,
                             eos_token_ids=self.eos_ids, shm_namespace_id=self.namespace,
                             live_sequences=live, live_shm_segments=len(self.features.live()),
                             feature_transport=self.transport,
                             inline_max_rows=self.inline_max_rows if self.inline else 0,
                             memory=self._memory_proto(), shared_tensors=self._shared_tensors(),
                             max_sequences=self.cfg.max_sequences, compute_slots=self.slots.n,
                             max_plain_steps=self.cfg.max_verify, **ipc_info(self))

    def _shared_tensors(self):
        """TargetInfo.shared_tensors: the exported token_embd / output (shared_weights), or none."""
        exporter = getattr(self.model, "head_exporter", None)
        return [] if exporter is None else [i.to_proto(pb) for i in exporter.infos]

    def _memory_proto(self):
        """The memory report for Info, or None (logged) when it cannot be computed: Info must answer."""
        try:
            return self.memory_report().to_proto(pb)
        except Exception:  # noqa: BLE001 - accounting must never take Info down
            log.exception("target-worker: memory report failed")
            return None

    def _rows(self, seq_id: str):
        """Inline transport: the FeatureRows of what the sequence committed since the last call
        (one message; the writes of one call are contiguous). None with shm."""
        if not self.inline:
            return None
        parts = self.features.take(seq_id)
        if not parts:
            return None
        start = parts[0][0]
        rows = parts[0][1] if len(parts) == 1 else np.concatenate([r for _, r in parts])
        st, n, w, data = encode_rows(start, rows)
        return pb.FeatureRows(start=st, n=n, width=w, data=data)

    def Prefill(self, request, context):
        return self.slots.run(context, self._prefill, request, context)

    def _prefill(self, request, context):
        seq_id, tokens = request.seq_id, list(request.tokens)
        if not seq_id:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "seq_id is empty")
        if not tokens:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        cap = int(request.capacity) or self.max_seq_len
        if self.inline and len(tokens) > self.inline_max_rows:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"prompt of {len(tokens)} tokens: its feature rows exceed the {self.inline_max_rows} rows one "
                   f"inline message carries (max_message_bytes {self.cfg.max_message_bytes})")
        if cap > self.max_seq_len or len(tokens) >= cap:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"prompt of {len(tokens)} tokens with capacity {cap} does not fit max_seq_len {self.max_seq_len}")
        with self.seqs_lock:
            if seq_id in self.tombstones:
                _abort(context, grpc.StatusCode.CANCELLED, f"sequence {seq_id!r} was released")
            if seq_id in self.seqs:
                _abort(context, grpc.StatusCode.ALREADY_EXISTS, f"sequence {seq_id!r} exists")
            if len(self.seqs) >= self.cfg.max_sequences:
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{len(self.seqs)} live sequences (max_sequences {self.cfg.max_sequences})")
            self.seqs[seq_id] = None  # reserve the id
        from .model import PrefillCancelled

        def cancelled() -> bool:  # checked between prefill chunks
            with self.seqs_lock:
                dead = seq_id in self.tombstones
            return dead or not context.is_active()

        st = None
        try:
            with self.model_lock:  # allocates and zeroes device state: never during another call's graph capture
                st = self.model.new_sequence(cap)
            ring, handle = self._create_ring(seq_id, cap, context)
            st.features = ring
            t0 = time.perf_counter()
            with self.model_lock:
                logits = self.model.prefill(st, tokens, cancelled=cancelled)
            dt = time.perf_counter() - t0
        except PrefillCancelled:
            logits = None
        except ShmExhausted as exc:
            self._drop_reserved(seq_id, st)
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill: {exc}")
        except ValueError as exc:
            self._drop_reserved(seq_id, st)
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"prefill: {exc}")
        except BaseException:
            self._drop_reserved(seq_id, st)
            raise
        # Release of a reserved id only tombstones it (the ring is still being written): Prefill frees
        with self.seqs_lock:
            released = logits is None or seq_id in self.tombstones or self.seqs.get(seq_id, 0) is not None
            if released:
                if self.seqs.get(seq_id, 0) is None:
                    del self.seqs[seq_id]
            else:
                self.seqs[seq_id] = _Seq(st, handle)
        if released:
            self._free_state(st)
            self.features.release(seq_id)
            _abort(context, grpc.StatusCode.CANCELLED, f"sequence {seq_id!r} was released during prefill")
        first = int(np.argmax(logits))  # greedy; ties -> lowest id, like sn.argmax
        return pb.PrefillResponse(first_token=first, committed=st.committed, compute_s=dt,
                                  features=handle.to_proto(pb),
                                  rows=self._rows(seq_id))

    def Verify(self, request, context):
        return self.slots.run(context, self._verify, request, context)

    def VerifyStream(self, request_iterator, context):
        """Verify over one stream per sequence: one VerifyResponse per VerifyRequest, in order
        (worker.proto; :meth:`ComputeSlots.stream`)."""
        return self.slots.stream(context, self._verify, request_iterator)

    def _verify(self, request, context):
        """Chain verify (module docstring), or with ``parents`` a tree verify (spec-loop.md §7.3,
        §7.5): every node's argmax, the walk from the root along the argmax (at most max_accept
        moves, :func:`specd.coordinator.ddtree.walk_tree`) and the commit of that path's rows."""
        t_in = time.perf_counter()  # the handler's own time: VerifyResponse.handler_s
        s = self._get(request.seq_id, context)
        tokens = list(request.tokens)
        parents = list(request.parents)
        if not tokens:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "verify needs at least the anchor token")
        if len(tokens) > self.cfg.max_verify:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"{len(tokens)} verify rows exceed max_verify {self.cfg.max_verify}")
        if parents:
            bad = len(parents) != len(tokens) or parents[0] != -1 or any(
                not 0 <= p < i for i, p in enumerate(parents) if i)
            if bad:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                       f"tree verify: parents must have one entry per token ({len(tokens)}), parents[0] = -1 and "
                       f"0 <= parents[i] < i, got {parents[:16]}")
        if request.plain_steps > 1:
            return self._plain_run(s, request, context, t_in)
        k = len(tokens) - 1
        limit = min(k, int(request.max_accept)) if request.HasField("max_accept") else k
        with s.lock:
            self._check_idle(s, request.seq_id, context)
            t0 = time.perf_counter()
            path: list[int] = []
            try:
                plain = len(tokens) == 1 and not parents and not request.defer_commit
                with self.model_lock:
                    if plain:  # verify + commit of one row, fused (Qwen35Model.step)
                        t = [self.model.step(s.st, tokens[0])]
                    else:
                        res = self.model.verify(s.st, tokens, parents or None)
                        t = res.argmax
                    if parents:
                        path = walk_tree(tokens, parents, [int(x) for x in t], limit)
                        m = len(path) - 1
                    else:
                        m = 0
                        while m < limit and tokens[m + 1] == int(t[m]):
                            m += 1
                    if request.defer_commit:
                        s.pending = res
                    elif not plain:
                        self.model.commit(s.st, res, path if parents else m + 1)
            except ValueError as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"verify: {exc}")
            dt = time.perf_counter() - t0
            if parents:
                emitted = [int(tokens[r]) for r in path[1:]] + [int(t[path[-1]])]
            else:
                emitted = [int(x) for x in tokens[1 : m + 1]] + [int(t[m])]
            resp = pb.VerifyResponse(accepted=m, emitted=emitted, committed=s.st.committed, compute_s=dt,
                                     argmax=[int(x) for x in t] if (request.return_argmax or parents) else [],
                                     path=path, rows=self._rows(request.seq_id))
            resp.handler_s = time.perf_counter() - t_in
            return resp

    @staticmethod
    def _check_idle(s: _Seq, seq_id: str, context) -> None:
        """Aborts unless the sequence (its lock held) is live with no deferred verify pending (the model
        releases a sequence itself when a plain step fails inside its forward: Qwen35Model.step)."""
        if s.released or s.st.released:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"sequence {seq_id!r} was released")
        if s.pending is not None:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "a deferred verify is pending; Commit first")

    def _plain_run(self, s: _Seq, request, context, t_in: float):
        """A plain run (worker.proto ``plain_steps``): up to n one-row verify + commit steps, the
        argmax of each the anchor of the next. Stops after a token of ``stop_token_ids`` or when the
        call is no longer active. Aborts INVALID_ARGUMENT on a request that is not a plain run.
        ``t_in``: the handler's start (time.perf_counter(), for ``handler_s``)."""
        n, stop = int(request.plain_steps), set(request.stop_token_ids)
        if len(request.tokens) != 1 or request.parents or request.defer_commit or request.HasField("max_accept"):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"a plain run (plain_steps {n}) takes the anchor only, without parents, defer_commit or max_accept; "
                   f"got {len(request.tokens)} tokens, {len(request.parents)} parents, defer_commit "
                   f"{request.defer_commit}, max_accept {'set' if request.HasField('max_accept') else 'unset'}")
        if n > self.cfg.max_verify or len(request.stop_token_ids) > MAX_RUN_STOP_IDS:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"plain run: plain_steps {n} exceeds max_plain_steps {self.cfg.max_verify} or "
                   f"{len(request.stop_token_ids)} stop_token_ids exceed {MAX_RUN_STOP_IDS}")
        anchor, emitted = int(request.tokens[0]), []
        with s.lock:
            self._check_idle(s, request.seq_id, context)
            t0 = time.perf_counter()
            try:
                for _ in range(n):
                    if emitted and (emitted[-1] in stop or not context.is_active()):
                        break
                    with self.model_lock:  # per step: other sequences' calls run between the steps
                        anchor = self.model.step(s.st, anchor)
                    emitted.append(anchor)
            except ValueError as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"plain run step {len(emitted) + 1}: {exc}")
            resp = pb.VerifyResponse(accepted=len(emitted) - 1, emitted=emitted, committed=s.st.committed,
                                     compute_s=time.perf_counter() - t0, rows=self._rows(request.seq_id),
                                     argmax=emitted if request.return_argmax else [])  # each step's argmax
            resp.handler_s = time.perf_counter() - t_in
            return resp

    def Commit(self, request, context):
        return self.slots.run(context, self._commit, request, context)

    def _commit(self, request, context):
        s = self._get(request.seq_id, context)
        with s.lock:
            if s.released:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"sequence {request.seq_id!r} was released")
            if s.pending is None:
                _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "no deferred verify to commit")
            tree = s.pending.parents is not None
            if tree:
                what = [int(r) for r in request.path]
                if not what:
                    _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the pending verify is a tree: commit a path")
            else:
                what = int(request.n)
                if not 1 <= what <= len(s.pending.tokens):
                    _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                           f"commit n must be in 1..{len(s.pending.tokens)}")
            try:
                with self.model_lock:
                    self.model.commit(s.st, s.pending, what)
            except ValueError as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"commit: {exc}")
            s.pending = None
            return pb.CommitResponse(committed=s.st.committed, rows=self._rows(request.seq_id))

    def Release(self, request, context):
        """Frees the sequence; for an id whose Prefill is still running only tombstones it (the
        Prefill sees the tombstone between chunks, stops and frees the ring itself)."""
        with self.seqs_lock:
            reserved = request.seq_id in self.seqs and self.seqs[request.seq_id] is None
            s = None if reserved else self.seqs.pop(request.seq_id, None)
            self._tombstone(request.seq_id)
        if reserved:
            return pb.ReleaseResponse(existed=True)
        if s is not None:
            with s.lock:  # an in-flight Verify/Commit finishes writing its rows first
                self._free_seq(s)  # under model_lock: device state (kept or freed) and graphs
                freed = self.features.release(request.seq_id)
        else:
            freed = self.features.release(request.seq_id)
        return pb.ReleaseResponse(existed=s is not None or freed)


# ---------------------------------------------------------------------- process entry points

def load_servicer(cfg: TargetWorkerConfig) -> TargetServicer:
    """Loads the GGUF (weights memory-mapped) and its tokenizer's EOS ids."""
    import specd.native as sn

    from .gguf_loader import load_qwen35, open_gguf, read_tokenizer_metadata
    from .model import Qwen35Model

    reader = open_gguf(cfg.target)
    weights = load_qwen35(cfg.target, reader)
    kv = {"f16": sn.DType.F16, "q8_0": sn.DType.Q8_0, "f32": sn.DType.F32}[cfg.kv_dtype]
    from .device import parse_device
    from .shared_weights import HeadExporter, make_backend

    # On the GPU, token_embd / output go into exported (IPC) buffers a drafter worker on the same GPU
    # maps (shared_weights; the backend decides: the native one exports only from a GPU model).
    backend = make_backend()
    exporter = HeadExporter(backend) if cfg.export_head and parse_device(cfg.resolved_device) == backend.device else None
    model = Qwen35Model(weights, capture_layers=cfg.capture_layers, kv_dtype=kv, prefill_chunk=cfg.prefill_chunk,
                        device=cfg.resolved_device, cuda_graphs=cfg.cuda_graphs, max_graphs=cfg.max_graphs,
                        slot_cache=cfg.slot_cache, gemv_tiles=cfg.gemv_tiles, head_exporter=exporter)
    meta = read_tokenizer_metadata(reader)
    eos = list(meta.end_ids) if meta is not None else []
    return TargetServicer(model, cfg, eos)


def log_memory(servicer: TargetServicer) -> None:
    """Logs the worker's memory report as one block; warns when fewer than max_sequences sequences
    at max_seq_len fit the GPU (never fails start-up)."""
    try:
        rep = servicer.memory_report()
    except Exception:  # noqa: BLE001 - reporting must not stop the worker
        log.exception("memory report failed")
        return
    log.info("target-worker %s", "\n".join(rep.lines()))
    if 0 <= rep.fits_sequences < rep.max_sequences:
        log.warning("target-worker: only %d sequences of %d positions fit the device (max_sequences %d)",
                    rep.fits_sequences, rep.max_seq_len, rep.max_sequences)


# The worker pings each coordinator connection after this long without traffic and drops it when the
# ack does not come within KEEPALIVE_TIMEOUT_MS: an open VerifyStream / ProposeStream holds a compute
# slot and an RPC thread while it waits for its next step, so a coordinator that vanished without
# closing its connection (host down, network partition) must not keep them for gRPC's default 2 h.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Internal-link gRPC options: large messages; peers may ping every 5 s while no data flows; the
    worker's own keepalive pings (KEEPALIVE_TIME_MS / KEEPALIVE_TIMEOUT_MS) end the streams of a dead
    peer, which frees their compute slots."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # what gRPC >= 1.6x waits for the ack
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that waits for its next step
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", 0)]  # a second server on a taken address fails instead of sharing it


def new_server(threads: int, max_message_bytes: int, max_concurrent_rpcs: int = 0):
    """A grpc.Server whose worker service runs on ``threads`` threads (admitting at most
    ``max_concurrent_rpcs`` calls, 0 = 4 x threads) and a HealthServicer (its Watch streams on their
    own thread pool). Compute calls are admitted by :class:`ComputeSlots` so Check finds a thread.
    Returns (server, health servicer)."""
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=server_options(max_message_bytes),
                         maximum_concurrent_rpcs=max_concurrent_rpcs or 4 * threads)
    hs = health.HealthServicer(experimental_non_blocking=True,
                               experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    return server, hs


def start_worker_server(servicer, listen: str, register, service: str, name: str, threads: int,
                        max_message_bytes: int, max_concurrent_rpcs: int, idle_ttl_s: float,
                        ipc_method: IpcMethod | None = None, ipc_idle_timeout_s: float = IDLE_TIMEOUT_S,
                        ipc_spin_us: int = 0, ipc_wake_ahead: bool = True):
    """Starts a worker's grpc.Server: ``register(servicer, server)`` adds its service, a health
    service reports ``service`` (and "") SERVING, compute calls are admitted by ComputeSlots, and an
    IdleReaper runs when ``idle_ttl_s`` > 0. With ``ipc_method`` the stream method is also served on
    an IPC stream socket (:func:`.ipc_stream.serve_ipc_streams`: at most ``threads`` connections,
    idle ones closed after ``ipc_idle_timeout_s``, a spin of up to ``ipc_spin_us`` before each blocking
    read of a request (timed by ``ipc_wake_ahead``), all closed by ``server.stop``; a socket that cannot
    be set up only logs a warning: streams over gRPC only). Shared by the target and drafter workers.
    Returns (server, bound port); RuntimeError naming ``name`` when ``listen`` cannot be bound."""
    from grpc_health.v1 import health_pb2

    server, hs = new_server(threads, max_message_bytes, max_concurrent_rpcs)
    register(servicer, server)
    servicer.slots = ComputeSlots.for_threads(threads)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:  # grpcio raises on a bind failure (address in use, bad address)
        raise RuntimeError(f"{name}: cannot listen on {listen}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"{name}: cannot listen on {listen}")
    try:
        if ipc_method is not None:
            serve_ipc_streams(server, servicer, ipc_method, name, max_message_bytes, threads, ipc_idle_timeout_s,
                              ipc_spin_us, ipc_wake_ahead)
        server.start()
    except BaseException:
        server.stop(0)  # also closes the IPC socket when it was created
        raise
    for svc in ("", service):
        hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
    server.health = hs
    if idle_ttl_s:
        server.reaper = IdleReaper(servicer, idle_ttl_s)
    return server, port


def start_server(servicer: TargetServicer, listen: str, threads: int | None = None,
                 max_message_bytes: int = 256 << 20, max_concurrent_rpcs: int | None = None):
    """Starts the target worker's server (see start_worker_server); threads / max_concurrent_rpcs
    default from the servicer's config, the VerifyStream's IPC socket follows ``cfg.ipc_streams``.
    Returns (server, bound port)."""
    cfg = servicer.cfg
    return start_worker_server(servicer, listen, pbg.add_TargetWorkerServicer_to_server, "specd.worker.v1.TargetWorker",
                               "target-worker", threads or cfg.rpc_threads, max_message_bytes,
                               cfg.max_concurrent_rpcs if max_concurrent_rpcs is None else max_concurrent_rpcs,
                               cfg.idle_ttl_s, VERIFY_STREAM if cfg.ipc_streams else None, cfg.ipc_idle_timeout_s,
                               resolve_spin_us(cfg.ipc_spin_us, cfg.resolved_device), cfg.ipc_wake_ahead)


def serve_forever(server, close, name: str, grace_s: float = 2.0) -> int:
    """Blocks until SIGTERM/SIGINT, then stops the server and runs ``close`` (frees shared memory)."""
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
        logging.getLogger(f"specd.{name.replace('-', '_')}").info("%s: stopping", name)  # the worker's own logger
        if hasattr(server, "health"):
            server.health.enter_graceful_shutdown()
        if hasattr(server, "reaper"):
            server.reaper.stop()
        server.stop(grace=grace_s).wait()
    finally:
        close()
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TargetWorkerConfig()
    p.add_argument("--target", required=True, help="qwen35 target GGUF")
    p.add_argument("--listen", default=d.listen, help=f"gRPC address (default {d.listen})")
    p.add_argument("--capture-layers", default="", help="comma-separated drafter target_layer_ids (default none)")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help="positions per sequence (default 0: GGUF context_length, else 4096)")
    p.add_argument("--max-verify", type=int, default=d.max_verify, help=f"rows per Verify, and steps per plain run (default {d.max_verify})")
    p.add_argument("--max-sequences", type=int, default=d.max_sequences,
                   help=f"live sequences (default {d.max_sequences})")
    p.add_argument("--kv-dtype", default=d.kv_dtype, choices=["f16", "q8_0", "f32"], help="KV cache type (default f16)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help=f"tokens per prefill forward, > 0 (default {d.prefill_chunk})")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                   help="on the GPU, replay chain verifies of up to 16 rows as CUDA graphs (default on)")
    p.add_argument("--max-graphs", type=int, default=d.max_graphs,
                   help=f"most captured CUDA graphs kept, LRU-evicted, >= 1 (default {d.max_graphs})")
    p.add_argument("--slot-cache", type=int, default=d.slot_cache,
                   help="released sequences' device states kept, with their CUDA graphs, for the next sequences "
                        f"of the same capacity class (1024-position steps), >= 0 (default {d.slot_cache}; 0: freed "
                        "at release)")
    p.add_argument("--gemv-tiles", action=argparse.BooleanOptionalAction, default=d.gemv_tiles,
                   help="on a CUDA GPU, place the layers' IQ4_XS / Q4_K / Q5_K / Q6_K matrices and an untied output "
                        "head in the GEMV's tiled layouts (default on; bit-identical results)")
    p.add_argument("--export-head", action=argparse.BooleanOptionalAction, default=d.export_head,
                   help="on the GPU, export token_embd / output over CUDA IPC for a drafter worker on the same "
                        "GPU (default on; the mapping is writable: --no-export-head keeps them private)")
    add_device_argument(p, d.device)
    p.add_argument("--threads", type=int, default=d.threads,
                   help="RPC threads (default 0: max-sequences + 8; health has its own threads)")
    add_worker_server_arguments(p, d)


def add_worker_server_arguments(p: argparse.ArgumentParser, d) -> None:
    """The server flags both workers share (admission, message size, idle reaper, tombstones, drain,
    IPC streams, feature transport); ``d`` is the worker's default config, whose fields give the defaults."""
    p.add_argument("--max-concurrent-rpcs", type=int, default=d.max_concurrent_rpcs,
                   help="calls admitted at once, RESOURCE_EXHAUSTED beyond (default 0: 4 x threads)")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="default 256 MiB")
    p.add_argument("--idle-ttl-s", type=float, default=d.idle_ttl_s,
                   help=f"free a sequence with no call for this long (default {d.idle_ttl_s}; 0 = never)")
    p.add_argument("--tombstone-cap", type=int, default=d.tombstone_cap,
                   help=f"released ids remembered (default {d.tombstone_cap})")
    p.add_argument("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
                   help=f"on SIGTERM, in-flight calls get this long (default {d.shutdown_grace_s})")
    p.add_argument("--ipc-streams", action=argparse.BooleanOptionalAction, default=d.ipc_streams,
                   help="also serve the per-sequence stream on a framed Unix socket in a private temp dir, offered "
                        "with a random token in Info, for a coordinator on this host (default on; "
                        "--no-ipc-streams: gRPC only)")
    p.add_argument("--ipc-idle-timeout-s", type=float, default=d.ipc_idle_timeout_s,
                   help="close an IPC stream with no new request for this long, freeing its compute slot (a hung "
                        f"coordinator; default {d.ipc_idle_timeout_s:g}, as gRPC keepalive; {MIN_IDLE_TIMEOUT_S:g}.."
                        f"{MAX_IDLE_TIMEOUT_S:g}; must exceed the coordinator's send_stall_timeout_s)")
    p.add_argument("--ipc-spin-us", type=int, default=d.ipc_spin_us,
                   help="before blocking for an IPC stream's next request, busy-poll its socket for up to this many "
                        "microseconds, so a request arriving meanwhile skips the thread's wake-up (costs a busy core "
                        f"for up to that long per request and stream; 0..{MAX_SPIN_US}, 0 = off; default "
                        f"{AUTO_SPIN_US} = auto: {GPU_SPIN_US} on a GPU, off on the CPU)")
    p.add_argument("--ipc-wake-ahead", action=argparse.BooleanOptionalAction, default=d.ipc_wake_ahead,
                   help="with --ipc-spin-us, a wait predicted from the stream's last waits to outlast half the spin "
                        "window sleeps until half a window before the request is due, then spins (default on; "
                        "--no-ipc-wake-ahead: spin right after each answer only)")
    add_transport_argument(p, d.feature_transport)


def add_transport_argument(p: argparse.ArgumentParser, default: str = "shm") -> None:
    """``--feature-transport shm|inline|cuda-ipc`` (shared by the workers, the coordinator and serve)."""
    p.add_argument("--feature-transport", default=default, choices=["shm", "inline", "cuda-ipc"],
                   help="how drafter feature rows travel: shm (shared-memory ring, one host; default), "
                        "inline (bytes in the gRPC messages via the coordinator; workers on different hosts) or "
                        "cuda-ipc (a device-memory ring shared through CUDA/HIP IPC; both workers --device cuda "
                        "on one GPU)")


DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str, who: str) -> None:
    """ValueError unless ``device`` is auto/cpu/cuda and, for cuda, this build and machine have a GPU."""
    if device not in DEVICES:
        raise ValueError(f"{who}: device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda":
        from .device import parse_device

        try:
            parse_device("cuda")
        except RuntimeError as exc:
            raise ValueError(f"{who}: --device cuda: {exc}") from exc


def add_device_argument(p: argparse.ArgumentParser, default: str = "auto", what: str = "target") -> None:
    """``--device auto|cpu|cuda`` (target worker, draft worker, serve: ``what`` names the model(s))."""
    p.add_argument("--device", default=default, choices=list(DEVICES),
                   help=f"where to run the {what}: auto (default: cuda when built with a GPU backend and a GPU "
                        "is present, else cpu), cpu or cuda")


def config_from_args(args) -> TargetWorkerConfig:
    layers = tuple(int(x) for x in args.capture_layers.split(",") if x.strip()) if args.capture_layers else ()
    cfg = TargetWorkerConfig(target=args.target, listen=args.listen, capture_layers=layers,
                             max_seq_len=args.max_seq_len, max_verify=args.max_verify,
                             max_sequences=args.max_sequences, kv_dtype=args.kv_dtype,
                             prefill_chunk=args.prefill_chunk, device=args.device,
                             cuda_graphs=args.cuda_graphs, max_graphs=args.max_graphs,
                             slot_cache=getattr(args, "slot_cache", TargetWorkerConfig.slot_cache),
                             gemv_tiles=getattr(args, "gemv_tiles", True),
                             export_head=getattr(args, "export_head", True), threads=args.threads,
                             max_concurrent_rpcs=args.max_concurrent_rpcs,
                             max_message_bytes=args.max_message_bytes, idle_ttl_s=args.idle_ttl_s,
                             tombstone_cap=args.tombstone_cap, shutdown_grace_s=args.shutdown_grace_s,
                             feature_transport=args.feature_transport, ipc_streams=args.ipc_streams,
                             ipc_idle_timeout_s=getattr(args, "ipc_idle_timeout_s", IDLE_TIMEOUT_S),
                             ipc_spin_us=getattr(args, "ipc_spin_us", AUTO_SPIN_US),
                             ipc_wake_ahead=getattr(args, "ipc_wake_ahead", True))
    cfg.validate()
    return cfg


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = config_from_args(args)
    servicer = load_servicer(cfg)
    server, _ = start_server(servicer, cfg.listen, cfg.rpc_threads, cfg.max_message_bytes)
    log.info("target-worker: %s on %s (capture %s, device %s; IPC stream socket %s)", cfg.target, cfg.listen,
             list(cfg.capture_layers), servicer.model.device, ipc_path(server))
    log_memory(servicer)
    print(f"READY {cfg.listen}", flush=True)
    return serve_forever(server, servicer.close, "target-worker", cfg.shutdown_grace_s)
