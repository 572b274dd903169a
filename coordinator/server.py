"""The coordinator: public ``specd.v1.SpecDecode`` server (grpc.aio) running the speculative loop.

Per request (spec-loop.md §2-§3, §9):

1. validate and tokenize (text, chat messages rendered with the GGUF chat template, or token ids);
2. target ``Prefill`` -> the greedy first token (the anchor; it is emitted at once) and the sequence's
   feature-ring handle;
3. steps: the policy chooses speculative or plain. Speculative: drafter ``Propose`` (carrying the
   committed tokens the drafter has not seen, so it ingests their feature rows from the ring) then
   target ``Verify([anchor, drafts])`` which accepts the greedy-matching prefix and commits it in the
   same call — two worker calls per step. Plain: ``Verify([anchor])`` only (features are still
   captured, the drafter catches up on its next Propose), as a plain run of up to
   ``plain_steps_per_call`` steps in one call (:meth:`Coordinator._plain_run` sets its length;
   worker.proto ``plain_steps``), streamed as one chunk (one per token with token-by-token output);
4. the emitted tokens d_1..d_m, bonus go through :class:`Finisher` one by one (EOS, stop ids, stop
   strings, max_tokens cut exactly inside the block); a chunk carries what may be sent;
   DDTree steps (spec-loop.md §7; draft mode "tree"): ``Propose`` asks for per-position top-k
   log-probs, the coordinator builds the best-first tree under the node budget
   (:func:`~specd.coordinator.ddtree.build_tree`) and sends one tree ``Verify`` (tokens + parents);
   the target walks it along its argmax, commits the accepted path and returns the per-node argmax
   and the path, which the coordinator re-walks (:func:`~specd.coordinator.ddtree.walk_tree`) and
   checks — still two worker calls per step;
   thinking (:mod:`~specd.coordinator.reasoning`): with a reasoning budget, each step's drafts are
   clipped to the thinking tokens left; when the budget is spent the step's bonus (not yet fed to the
   target) is replaced by the first close-sequence token and the rest are forced by plain steps;
   feature transport ``inline`` (workers on different hosts): the FeatureRows the target returns in
   Prefill / Verify are kept unread and forwarded in the next Propose (no extra call); a step is made
   speculative before the pending rows plus one verify could exceed ``TargetInfo.inline_max_rows``;
5. a final ``complete`` with finish reason, usage (= what was sent) and speculation stats.

Hot path (``worker_streams``, default on): a sequence's Verify and Propose calls travel over one
``VerifyStream`` and one ``ProposeStream`` (worker.proto; :class:`WorkerStream`), opened at its first
step and closed before its Release: a message on an open stream costs about half a unary call's round
trip. With ``ipc_streams`` (default on) a worker whose Info offers an IPC stream socket that this host
reaches (probed at connect) gets the same messages as length-prefixed frames on that Unix socket
instead (:class:`IpcStream`, specd.target_worker.ipc_stream): about a quarter of a gRPC stream
message's round trip, same semantics; which transport each worker's hot path uses is logged at
connect and reported by GetModelInfo and the ``specd_worker_hot_path`` gauge; a socket that fails
with UNAVAILABLE (worker stopped or restarted) sends new sequences to gRPC streams until the readiness
loop has read that worker's Info again and probed what it offers then. Each chunk's client
write runs while the loop makes the next step's worker calls (at most one write in flight, each
bounded by ``send_stall_timeout_s``).

Both workers' sequences are released on every exit path (finish, error, client cancel, deadline).
Deadlines: each worker call gets the request's remaining time; a speculative step is skipped for a
plain one when the remaining time is below the measured speculative step time; when the time runs out
the stream ends with DEADLINE_EXCEEDED. Worker failures end the stream with UNAVAILABLE (worker unreachable) or INTERNAL.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import select
import socket
import time
import uuid

import grpc
from google.protobuf.message import DecodeError

from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import generate_pb2_grpc as gpbg
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg
from specd.target_worker.ipc_stream import (FRAME, PROBE, PROPOSE_STREAM, STATUS, VERIFY_STREAM, IpcMethod, WakeAhead,
                                            hello_frame, parse_error, poll_until)
from specd.target_worker.server import MAX_RUN_STOP_IDS  # most stop_token_ids of a plain run

from .config import CoordinatorConfig
from .ddtree import auto_top_k, build_tree, walk_tree
from .finish import Finisher
from .metrics import CoordinatorMetrics
from .policy import AdaptivePolicy
from .reasoning import BudgetError, ReasoningBudget

log = logging.getLogger("specd.coordinator")

SERVICE_NAME = "specd.v1.SpecDecode"
MODE_NAMES = {gpb.SPECULATION_MODE_AUTO: "auto", gpb.SPECULATION_MODE_OFF: "off", gpb.SPECULATION_MODE_FORCE: "force"}


class RequestError(Exception):
    """A request-level failure with its gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """A request's resolved speculation options (request fields over the server defaults).

    cap: most drafts per step (tree: the tree depth); tree: DDTree on; budget: node budget (already
    clipped to max_verify - 1); chain_seed; top_k: 0 = auto per step; temperature: top-k log-prob
    temperature; confidence_threshold: DSpark gate (0 = off); dspark_markov: worker.proto DSparkMarkov
    value forwarded to Propose (0 = the drafter worker's default)."""

    cap: int
    tree: bool = False
    budget: int = 0
    chain_seed: bool = True
    top_k: int = 0
    temperature: float = 1.0
    confidence_threshold: float = 0.0
    dspark_markov: int = 0


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> RequestError:
    """The request-level error for a failed worker call ``what`` ("prefill", "propose", "verify"):
    :func:`status_error` of its status."""
    return status_error(exc.code(), exc.details(), what)


def status_error(code: grpc.StatusCode, details: str, what: str) -> RequestError:
    """The request-level error for worker call ``what`` ending with ``code`` / ``details``:
    DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED (retryable) and UNAVAILABLE keep their code, as does
    INVALID_ARGUMENT of a prefill (a prompt the worker refuses); anything else is INTERNAL."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestError(code, f"deadline exceeded during {what}")
    if code == grpc.StatusCode.INVALID_ARGUMENT and what == "prefill":
        return RequestError(code, f"{what}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full worker / busy compute slots: retryable
        return RequestError(code, f"{what}: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return RequestError(code, f"{what}: worker unavailable: {details}")
    return RequestError(grpc.StatusCode.INTERNAL, f"{what} failed: {code.name}: {details}")


class SequenceStream:
    """A sequence's hot-path stream to one worker: :class:`WorkerStream` (gRPC) or :class:`IpcStream`
    (the worker's IPC stream socket). ``await call(msg, deadline)`` returns the answer to one request
    (in order), ``await close(ok, timeout)`` ends the stream; both set ``what`` (the call's name in
    errors) and ``worker_timeout_s``."""

    __slots__ = ("what", "worker_timeout_s")

    def _budget(self, deadline: float | None) -> float:
        """Seconds the next call may take: the request's time left (``deadline``: time.monotonic()
        seconds), or worker_timeout_s without one. Raises DEADLINE_EXCEEDED when none is left."""
        if deadline is None:
            return self.worker_timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded before {self.what}")
        return left

    def _timed_out(self, deadline: float | None) -> RequestError:
        """The error of a call that ran out of time (the request's deadline, else worker_timeout_s)."""
        if deadline is not None:
            return status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "", self.what)
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{self.what}: no answer within worker_timeout_s {self.worker_timeout_s}")


class WorkerStream(SequenceStream):
    """One sequence's request stream to a worker (``VerifyStream`` / ``ProposeStream``, worker.proto):
    ``await call(msg, deadline)`` writes one request and returns its response (one response per
    request, in order). A message on the open stream costs about half a unary call's round trip.

    The stream opens at the first call, with the request's deadline as its gRPC deadline (none
    without one). Without a request deadline each call is bounded by ``worker_timeout_s`` like a
    unary call: a timer cancels the stream and the call raises DEADLINE_EXCEEDED. Worker errors map
    like unary calls (:func:`rpc_error`); the first error ends the stream (and the request).
    :meth:`close` half-closes it after a normal end, or cancels it.

    Args:
        method: the stub's stream-stream method (e.g. ``TargetWorkerStub.VerifyStream``).
        what: the call's name in errors ("verify", "propose").
        worker_timeout_s: per-call bound without a request deadline (seconds, > 0).
    """

    __slots__ = ("method", "rpc", "loop", "expired")

    def __init__(self, method, what: str, worker_timeout_s: float):
        self.method, self.what, self.worker_timeout_s = method, what, worker_timeout_s
        self.rpc = None  # the grpc.aio StreamStreamCall once opened
        self.loop = None  # its event loop (asyncio.get_running_loop() costs a getpid() system call)
        self.expired = False

    def _expire(self) -> None:
        self.expired = True
        self.rpc.cancel()

    async def call(self, msg, deadline: float | None):
        """Sends ``msg`` and returns the worker's response. ``deadline``: time.monotonic() seconds
        or None. Raises RequestError (DEADLINE_EXCEEDED when the deadline or ``worker_timeout_s``
        passes, else as :func:`rpc_error`; INTERNAL when the worker ends the stream early)."""
        timer = None
        left = self._budget(deadline)
        if self.rpc is None:
            self.rpc = self.method(timeout=None if deadline is None else left)
            self.loop = asyncio.get_running_loop()
        if deadline is None:
            timer = self.loop.call_later(left, self._expire)
        # The read is posted before the write's completion comes back: that completion reaches the
        # event loop after whatever else is ready there (the client's chunk write, metrics), and
        # a read posted only then would add that wait to a fast worker's answer.
        read = self.loop.create_task(self.rpc.read())
        try:
            await self.rpc.write(msg)
            resp = await read
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a worker from before the stream methods
                raise RequestError(grpc.StatusCode.INTERNAL,
                                   f"{self.what} failed: the worker does not implement the per-sequence stream "
                                   f"({exc.details()}); start the coordinator with --no-worker-streams") from exc
            raise rpc_error(exc, self.what) from exc
        except (asyncio.CancelledError, asyncio.InvalidStateError) as exc:
            if self.expired:
                raise self._timed_out(None) from None
            if isinstance(exc, asyncio.InvalidStateError):  # the stream ended between two steps (worker gone)
                raise status_error(await self.rpc.code(), await self.rpc.details(), self.what) from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if not read.done():  # the write failed or this call was cancelled: the stream ends
                read.cancel()
            elif not read.cancelled():
                read.exception()  # retrieved: the error raised here already reports the stream's end
        if resp is grpc.aio.EOF:
            raise RequestError(grpc.StatusCode.INTERNAL, f"{self.what}: the worker ended the stream without an answer")
        return resp

    async def close(self, ok: bool, timeout: float | None = None) -> None:
        """Half-closes the stream (``ok``: the request ended normally; the worker's handler then
        returns) or cancels it; never raises. ``timeout``: bound on the half-close (seconds; then
        it cancels), so a stuck connection cannot hold up the Releases that follow."""
        rpc, self.rpc = self.rpc, None
        if rpc is None or rpc.done():
            return
        if not ok:
            rpc.cancel()
            return
        try:
            await asyncio.wait_for(rpc.done_writing(), timeout)
        except Exception:  # noqa: BLE001 - the stream already failed (or timed out): nothing to close
            rpc.cancel()


@dataclasses.dataclass(frozen=True)
class IpcOffer:
    """A worker's IPC stream socket as its Info offers it (path, token) and the stream ``method``
    served there (VERIFY_STREAM / PROPOSE_STREAM)."""

    path: str
    token: bytes
    method: IpcMethod


async def read_status(reader: asyncio.StreamReader, max_bytes: int, what: str) -> tuple[int, bytes]:
    """One status frame from a worker's IPC stream socket: (status byte, the rest). RESOURCE_EXHAUSTED
    when its body exceeds ``max_bytes`` (as gRPC's max_receive_message_length), INTERNAL for an empty
    frame (a broken worker); EOFError / OSError when the connection ends."""
    n, status = STATUS.unpack(await reader.readexactly(STATUS.size))
    if n == 0 or n - 1 > max_bytes:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED if n else grpc.StatusCode.INTERNAL,
                           f"{what}: IPC answer frame of {n} bytes (limit {max_bytes + 1})")
    return status, await reader.readexactly(n - 1)


OPEN_TIMEOUT_S = 2.0  # IpcStream's default bound on connect + hello (the coordinator passes health_timeout_s)
RECV_BYTES = 1 << 18  # most bytes one IpcStream recv takes (asyncio's transports read as much)
LOOP_TIMER_EARLY_S = 0.001  # a wake-ahead timer fires this early: epoll's timeout is whole ms, rounded up


class IpcSpin:
    """A coordinator's bounded busy-poll for IPC answers that are due soon (``ipc_spin_us``), shared by
    its :class:`IpcStream` s.

    Why: a coordinator waiting for a worker's answer in the event loop sleeps in epoll; on a VM its idle
    vCPU halts, and the wake-up when the answer comes costs ~0.15 ms on the H200 host, per worker call.
    A call whose answer is not there right after its request was sent may instead poll its socket
    without blocking for up to ``spin_us`` (:meth:`IpcStream._spin`); an answer that comes meanwhile is
    taken without the wake-up. The event loop runs nothing else during a spin, so a call spins only:

    * when no other IPC call of this coordinator waits for its answer (``waiting == 0``): the answers of
      other sequences' calls would wait behind the spin (other work, e.g. a client write, waits at most
      spin_us);
    * when spinning has paid for this kind of call ("verify" / "propose") lately: an EMA of the spins'
      hits (answer within the spin: 1, else 0; weight HIT_ALPHA, starting at 1) is at least HIT_MIN.
      A verify that takes longer than the spin (most targets) stops spinning after a few misses; one
      call in PROBE_EVERY spins anyway, so a kind whose answers got faster starts again.

    Cost: a busy core for up to spin_us per spinning call. ``spin_us`` 0 turns it off (the default is
    1000, CoordinatorConfig.ipc_spin_us): the coordinator then builds no IpcSpin.

    With ``wake_ahead`` (CoordinatorConfig.ipc_wake_ahead, default on) each stream predicts its next
    answer's arrival from its last ones (:class:`specd.target_worker.ipc_stream.WakeAhead`); a call
    whose answer is due later than half a window after its request sleeps in the event loop instead
    and spins from half a window before the predicted arrival (:meth:`IpcStream._timed_spin`; the
    same rule on other calls waiting), so the answer to a verify longer than the spin is caught too.
    """

    HIT_ALPHA = 0.25
    HIT_MIN = 0.5
    PROBE_EVERY = 16

    __slots__ = ("spin_ns", "wake_ahead", "hits", "skipped", "waiting")

    def __init__(self, spin_us: int, wake_ahead: bool = True):
        self.spin_ns = int(spin_us) * 1000
        self.wake_ahead = bool(wake_ahead)
        self.hits: dict[str, float] = {}  # call kind -> EMA of its spins' hits
        self.skipped: dict[str, int] = {}  # call kind -> calls not spun since its last spin
        self.waiting = 0  # IPC calls of this coordinator waiting for their answer in the event loop

    def should_spin(self, what: str) -> bool:
        """Whether a ``what`` call whose answer is not there yet spins now (class docstring)."""
        if self.waiting:
            return False
        if self.hits.get(what, 1.0) >= self.HIT_MIN:
            return True
        n = self.skipped.get(what, 0) + 1
        self.skipped[what] = 0 if n >= self.PROBE_EVERY else n
        return n >= self.PROBE_EVERY

    def record(self, what: str, hit: bool) -> None:
        """Counts a spin of a ``what`` call: ``hit`` when its answer came within the spin."""
        self.hits[what] = (1 - self.HIT_ALPHA) * self.hits.get(what, 1.0) + self.HIT_ALPHA * hit


async def probe_ipc(offer: IpcOffer, timeout: float) -> None:
    """Checks that this host reaches ``offer``'s socket and that the worker there takes its token: a
    hello with the probe method, answered ok (at most ``timeout`` seconds). Raises OSError / EOFError /
    asyncio.TimeoutError, or RequestError with the worker's refusal."""
    async def run():
        reader, writer = await asyncio.open_unix_connection(offer.path)
        try:
            writer.write(hello_frame(offer.token, PROBE))
            status, body = await read_status(reader, 1 << 16, "probe")
            if status:
                code, details = parse_error(body)
                raise RequestError(code, f"{code.name}: {details}")
        finally:
            writer.transport.abort()

    await asyncio.wait_for(run(), timeout)


class IpcStream(SequenceStream):
    """One sequence's VerifyStream / ProposeStream over the worker's IPC stream socket
    (specd.target_worker.ipc_stream: the same messages as length-prefixed frames on a Unix socket),
    with :class:`WorkerStream`'s interface and semantics.

    The connection opens at the first call (a hello with the worker's token, answered once the stream
    holds one of the worker's compute slots; admission never waits for a slot, so the answer is
    immediate from a live worker). Connect and hello together are bounded by ``open_timeout_s``: a
    socket that is gone or refused, or a worker that does not answer the hello in time (a dead acceptor,
    a stopped process), means the socket cannot be used; no request byte was sent then, so with a
    ``fallback`` the sequence goes on over it (a gRPC :class:`WorkerStream`: the same call succeeds)
    after ``on_lost(offer)`` is told (the coordinator's :meth:`Coordinator._ipc_failed`), and without
    one the call raises UNAVAILABLE. Each call is bounded by the request's time left or,
    without a deadline, ``worker_timeout_s``: a timer aborts the connection and the call raises
    DEADLINE_EXCEEDED. A worker's error frame maps like the gRPC stream's status (:func:`status_error`;
    e.g. RESOURCE_EXHAUSTED for a refused slot); a socket that is gone, refused or reset ->
    UNAVAILABLE. A failed or cancelled call closes the connection (the request ends with it).

    Hot path (per call; no asyncio transport, protocol or stream reader between the socket and the
    call): the request goes out with one ``sendmsg`` on the non-blocking socket (a request larger than
    the socket buffer is finished by a writer callback); one ``recv`` right after it takes an answer
    that is already there (a fast worker on a busy host) without a trip through the event loop, else
    the socket's reader callback (registered once per connection) completes the call's future with
    the answer frame. One deadline timer per connection is re-armed only when it fires early (each
    call's bound only moves it later), not set and cancelled per call. With ``spin`` (an
    :class:`IpcSpin`), an answer not there after that recv may be busy-polled for (:meth:`_spin`)
    before the call waits in the event loop, or, when the stream's last answers predict it later than
    half a spin window, from half a window before it (:meth:`_timed_spin`, the IpcSpin's wake-ahead).

    Args:
        offer: the worker's socket, token and stream method.
        worker_timeout_s: per-call bound without a request deadline (seconds, > 0).
        max_message_bytes: largest request or answer (internal_max_message_bytes; RESOURCE_EXHAUSTED
            for a larger request, like gRPC).
        open_timeout_s: bound on connect + hello (the coordinator's health_timeout_s; default
            OPEN_TIMEOUT_S), far below worker_timeout_s so a dead socket is found before the request's
            budget is spent.
        fallback: makes the stream that takes over when the socket cannot be opened (None: UNAVAILABLE).
        on_lost: called with ``offer`` when the socket cannot be opened or fails with UNAVAILABLE.
        spin: the coordinator's :class:`IpcSpin` (None: never spin).
    """

    __slots__ = ("offer", "max_bytes", "sock", "loop", "expired", "open_timeout_s", "fallback", "on_lost",
                 "instead", "buf", "waiter", "unsent", "timer", "expiry", "opened", "spin", "poll", "ahead")

    def __init__(self, offer: IpcOffer, worker_timeout_s: float, max_message_bytes: int,
                 open_timeout_s: float = OPEN_TIMEOUT_S, fallback=None, on_lost=None, spin: IpcSpin | None = None):
        self.offer, self.what, self.worker_timeout_s = offer, offer.method.what, worker_timeout_s
        self.max_bytes, self.open_timeout_s = max_message_bytes, open_timeout_s
        self.fallback, self.on_lost = fallback, on_lost
        self.instead: SequenceStream | None = None  # the fallback stream once the socket failed to open
        self.sock: socket.socket | None = None  # the non-blocking connection once opened; None when closed
        self.loop = None  # its event loop (asyncio.get_running_loop() costs a getpid() system call)
        self.buf = bytearray()  # bytes received and not yet taken as a frame
        self.waiter: asyncio.Future | None = None  # the pending call's (or close's) answer
        self.unsent: list[memoryview] = []  # the rest of a request the socket did not take at once
        self.timer = None  # the connection's deadline timer (asyncio.TimerHandle) while armed
        self.expiry: float | None = None  # loop.time() by which the call in flight must be answered
        self.opened = False  # the hello was answered (a connection lost after that is not opened again)
        self.expired = False
        self.spin = spin
        self.poll = None  # with spin: poll() of a select.poll on the connection, for _spin
        # with the spin's wake-ahead: when this stream's answers come (IpcSpin's docstring)
        self.ahead = WakeAhead(spin.spin_ns) if spin is not None and spin.wake_ahead and spin.spin_ns > 0 else None

    # ---- connection plumbing (event-loop callbacks)

    def _abort(self) -> None:
        """Closes the connection now (idempotent); a pending call's future fails with EOFError."""
        sock, self.sock = self.sock, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if sock is None:
            return
        self.loop.remove_reader(sock)
        if self.unsent:
            self.loop.remove_writer(sock)
            self.unsent = []
        sock.close()
        self._fail(EOFError("IPC stream connection closed"))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _on_timer(self) -> None:
        """The deadline timer: expires the call in flight once its bound has passed, else re-arms for it.
        A bound that passed without a call waiting for its answer (answered in this loop iteration, or
        still connecting, which ``_open``'s wait_for bounds by the same time) expires nothing."""
        self.timer = None
        if self.expiry is None or self.sock is None:
            return
        if self.loop.time() >= self.expiry:
            if self.waiter is None:
                return
            self.expired = True
            self._abort()  # the pending call reports DEADLINE_EXCEEDED
        else:
            self.timer = self.loop.call_at(self.expiry, self._on_timer)

    def _arm(self, left: float) -> None:
        """Bounds the call starting now by ``left`` seconds."""
        self.expiry = self.loop.time() + left
        if self.timer is not None:
            if self.timer.when() <= self.expiry:
                return  # it fires first and re-arms for this call
            self.timer.cancel()
        self.timer = self.loop.call_at(self.expiry, self._on_timer)

    def _recv(self) -> None:
        """Takes what the socket holds (non-blocking) and completes the pending future with a whole
        frame; EOF or a socket error fails it. Without a pending future the buffer holds at most one
        whole frame (a call's answer not awaited yet: send_early's until answer()); more is a broken
        worker: the connection is closed, and only the first frame of a call in flight is kept (its
        answer, or the head whose error :meth:`_frame` raises: RESOURCE_EXHAUSTED over max_bytes). The
        next call raises UNAVAILABLE."""
        try:
            data = self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort_with(exc)
            return
        if not data:
            self._abort_with(EOFError("the worker closed the IPC stream connection"))
            return
        self.buf += data
        if self.waiter is not None:
            self._complete()
        elif len(self.buf) > FRAME.size + self.max_bytes + 1:  # a broken worker (above): bounded
            n = STATUS.unpack_from(self.buf)[0]
            keep = 0 if self.expiry is None else FRAME.size + n if 0 < n <= self.max_bytes + 1 else STATUS.size
            del self.buf[keep:]
            self._abort()

    def _abort_with(self, exc: BaseException) -> None:
        self._fail(exc)
        self._abort()

    def _complete(self) -> None:
        """Completes the pending future with the next frame once all of it is buffered."""
        try:
            frame = self._frame()
        except RequestError as exc:
            self._abort_with(exc)
            return
        if frame is not None:
            waiter, self.waiter = self.waiter, None
            if not waiter.done():
                waiter.set_result(frame)

    def _frame(self) -> tuple[int, bytes] | None:
        """The next status frame in the buffer, (status byte, the rest), or None while incomplete.
        RESOURCE_EXHAUSTED when its body exceeds max_bytes (as gRPC's max_receive_message_length),
        INTERNAL for an empty frame (a broken worker)."""
        buf = self.buf
        if len(buf) < STATUS.size:
            return None
        n, status = STATUS.unpack_from(buf)
        if n == 0 or n - 1 > self.max_bytes:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED if n else grpc.StatusCode.INTERNAL,
                               f"{self.what}: IPC answer frame of {n} bytes (limit {self.max_bytes + 1})")
        end = FRAME.size + n
        if len(buf) < end:
            return None
        with memoryview(buf) as view:  # one copy of the body, not two
            body = bytes(view[STATUS.size:end])
        del buf[:end]
        return status, body

    def _send(self, parts) -> None:
        """Sends ``parts`` (a frame) without waiting: what the socket does not take at once is finished
        by a writer callback while the call waits for its answer. OSError when the socket fails."""
        views = [memoryview(p) for p in parts if len(p)]
        try:
            sent = self.sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            sent = 0
        self.unsent = _advance(views, sent)
        if self.unsent:
            self.loop.add_writer(self.sock, self._flush)

    def _flush(self) -> None:
        try:
            sent = self.sock.sendmsg(self.unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort_with(exc)
            return
        self.unsent = _advance(self.unsent, sent)
        if not self.unsent:
            self.loop.remove_writer(self.sock)

    def _spin(self) -> tuple[int, bytes] | None:
        """Polls the socket without blocking for up to the IpcSpin's spin_us (the event loop waits) and
        takes what comes; returns the answer frame once complete, else None (spin over, or the
        connection failed: ``sock`` is None then). Raises like :meth:`_frame`. The clock is checked after
        each read too: poll_until returns on readiness without looking at it, so a socket that stays
        readable without completing a frame (a worker trickling its answer) would hold the loop, and its
        deadline timer, for as long as it trickles."""
        end = time.monotonic_ns() + self.spin.spin_ns
        while self.sock is not None and poll_until(self.poll, end):
            self._recv()
            frame = self._frame()
            if frame is not None:
                return frame
            if time.monotonic_ns() >= end:
                break
        return None

    def _timed_spin(self, end_ns: int) -> None:
        """The wake-ahead timer of a call waiting in the event loop: polls the socket without blocking
        until its answer completes the call's future (through :meth:`_recv`) or time.monotonic_ns()
        reaches ``end_ns``. Skipped once the call is answered or when another IPC call of this
        coordinator waits too (its answer would queue behind the spin, as for :meth:`_spin`)."""
        if self.waiter is None or self.spin.waiting > 1:
            return
        while self.waiter is not None and self.sock is not None and poll_until(self.poll, end_ns):
            self._recv()
            if time.monotonic_ns() >= end_ns:  # bounded while input keeps coming without a frame (_spin)
                break

    def _wake_timer(self, sent_ns: int):
        """The wake-ahead timer of the call whose request went out at ``sent_ns`` (time.monotonic_ns(),
        the loop's clock), or None when its answer is due within half a spin window (spin at once, as
        without wake-ahead) or too little is known of this stream's answers (:class:`WakeAhead`). The
        timer fires LOOP_TIMER_EARLY_S early: the event loop wakes from epoll in whole milliseconds,
        rounded up, and the spin runs to half a window past the predicted arrival (so up to a window
        plus LOOP_TIMER_EARLY_S in all). None too when that time has passed already."""
        sleep = self.ahead.sleep_ns() if sent_ns and self.ahead is not None else 0
        when = (sent_ns + sleep) / 1e9 - LOOP_TIMER_EARLY_S
        if not sleep or when <= time.monotonic():  # (an early call's answer taken late: spin now)
            return None
        return self.loop.call_at(when, self._timed_spin, sent_ns + sleep + self.spin.spin_ns)

    async def _answer(self, sent_ns: int = 0) -> tuple[int, bytes]:
        """The next frame: from the buffer, after one non-blocking recv (an answer already there skips
        the event loop; the reader callback then finds nothing), after a spin (:class:`IpcSpin`), or
        from the reader callback, after a wake-ahead spin (:meth:`_wake_timer`) when the request went
        out at ``sent_ns`` (time.monotonic_ns(); 0: none, the hello's answer). EOFError once the
        connection is gone without one."""
        frame = self._frame()
        timer = None
        if frame is None and self.sock is not None and not self.unsent:
            self._recv()
            frame = self._frame()
            spin = self.spin
            if frame is None and spin is not None and self.sock is not None:
                timer = self._wake_timer(sent_ns)
                if timer is None and spin.should_spin(self.what):
                    frame = self._spin()
                    spin.record(self.what, frame is not None)
        if frame is None:
            if self.sock is None:
                raise EOFError("IPC stream connection closed")
            frame = await self._wait(timer)
        if sent_ns and self.ahead is not None:
            self.ahead.record(time.monotonic_ns() - sent_ns)
        return frame

    async def _wait(self, timer) -> tuple[int, bytes]:
        """The answer frame through the reader callback (or ``timer``'s spin, cancelled at the end)."""
        self.waiter = self.loop.create_future()
        if self.spin is None:
            return await self.waiter
        self.spin.waiting += 1
        try:
            return await self.waiter
        finally:
            self.spin.waiting -= 1
            if timer is not None:
                timer.cancel()

    # ---- the stream

    async def _hello(self) -> tuple[int, bytes]:
        """Connects and says hello; returns the worker's answer (status byte, rest)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        self.sock = sock
        await self.loop.sock_connect(sock, self.offer.path)
        if self.sock is not sock:  # aborted meanwhile
            raise EOFError("IPC stream connection closed")
        self.loop.add_reader(sock, self._recv)
        if self.spin is not None:
            poller = select.poll()
            poller.register(sock, select.POLLIN)  # POLLHUP / POLLERR are always reported: they end a spin too
            self.poll = poller.poll
        self._send((hello_frame(self.offer.token, self.offer.method.id),))
        return await self._answer()

    async def _open(self, left: float) -> bool:
        """Opens the connection within min(``left``, open_timeout_s). False when the socket cannot be
        used (connect error, EOF or no answer to the hello in time: nothing of the request was sent;
        the connection is closed); DEADLINE_EXCEEDED when the request's own budget ran out first; a
        worker's refusal (error frame) raises like :meth:`call`."""
        bound = min(left, self.open_timeout_s)
        try:
            status, body = await asyncio.wait_for(self._hello(), bound)
        except (OSError, EOFError, asyncio.TimeoutError) as exc:
            self._abort()
            if self.expired or (isinstance(exc, asyncio.TimeoutError) and bound >= left):
                self.expired = True  # the call's budget, not the worker's hello bound, ran out (the deadline
                raise  # timer aborts a pending hello with EOFError)
            log.debug("%s: IPC stream socket %s cannot be opened: %s", self.what, self.offer.path,
                      exc or type(exc).__name__)
            return False
        except BaseException:
            self._abort()
            raise
        if status:
            raise status_error(*parse_error(body), self.what)
        self.opened = True
        return True

    async def _fall_back(self, msg, deadline: float | None):
        """The socket could not be opened: tells ``on_lost`` and sends ``msg`` (and the rest of the
        sequence) over the fallback stream, or raises UNAVAILABLE without one (:meth:`call` tells
        ``on_lost`` then)."""
        if self.fallback is None:
            raise status_error(grpc.StatusCode.UNAVAILABLE, f"IPC stream socket {self.offer.path} cannot be "
                                                            f"opened within {self.open_timeout_s} s", self.what)
        if self.on_lost is not None:
            self.on_lost(self.offer)
        self.instead = self.fallback()
        return await self.instead.call(msg, deadline)

    async def call(self, msg, deadline: float | None):
        """Sends ``msg`` and returns the worker's response. ``deadline``: time.monotonic() seconds or
        None. Raises RequestError (see the class docstring); an UNAVAILABLE one (the socket broke, or
        its worker is stopping) is also told to ``on_lost``, so new sequences stop using the socket."""
        if self.instead is not None:
            return await self.instead.call(msg, deadline)
        try:
            return await self._call_ipc(msg, deadline)
        except RequestError as exc:
            self._lost(exc)
            raise

    def can_send_early(self) -> bool:
        """Whether :meth:`send_early` may send now: the connection is open and no call is in flight."""
        return (self.instead is None and self.opened and self.sock is not None and self.waiter is None
                and self.expiry is None and not self.unsent)

    def send_early(self, msg, deadline: float | None) -> int:
        """The first half of a call, synchronous: sends ``msg`` now (:meth:`can_send_early` must hold)
        so that the worker computes while the caller does other work; :meth:`answer` takes the
        response. Returns the send time (time.monotonic_ns()) for it. Raises RequestError like
        :meth:`call` (the connection is closed then)."""
        try:
            left = self._budget(deadline)
            data = self._serialized(msg)
            self.expired = False
            self._arm(left)
            return self._put(data)
        except BaseException as exc:
            self.expiry = None
            raise self._reported(exc, deadline) from None

    async def answer(self, sent_ns: int, deadline: float | None):
        """The second half of a call begun by :meth:`send_early` (``sent_ns``: its return): the
        worker's response, under the call's bound re-armed from now. Raises like :meth:`call`."""
        try:
            self._arm(self._budget(deadline))
            return await self._response(sent_ns)
        except BaseException as exc:
            raise self._reported(exc, deadline) from None
        finally:
            self.expiry = None

    def _lost(self, exc: RequestError) -> None:
        """Tells ``on_lost`` of an UNAVAILABLE error on the socket (not of the fallback stream's)."""
        if exc.code == grpc.StatusCode.UNAVAILABLE and self.instead is None and self.on_lost is not None:
            self.on_lost(self.offer)

    def _serialized(self, msg) -> bytes:
        data = msg.SerializeToString()
        if len(data) > self.max_bytes:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.what}: request of {len(data)} bytes exceeds "
                                                                   f"internal_max_message_bytes {self.max_bytes}")
        return data

    def _put(self, data: bytes) -> int:
        """Sends one request frame; returns the send time (time.monotonic_ns()), 0 when the worker
        closed the connection already (its last frame, an error, or EOF answers)."""
        if self.sock is None:
            return 0
        self._send((FRAME.pack(len(data)), data))  # no joined copy of a large request
        return time.monotonic_ns()

    async def _response(self, sent_ns: int):
        status, body = await self._answer(sent_ns)
        if status:
            raise status_error(*parse_error(body), self.what)
        return self.offer.method.response.FromString(body)

    def _failed(self, exc: BaseException, deadline: float | None) -> BaseException:
        """What a failed call raises (the connection is closed first: its state is unknown): the
        connection's own failure as DEADLINE_EXCEEDED (expired) or UNAVAILABLE, an unparsable answer
        as INTERNAL, anything else (a worker's error, a cancellation) as it is. Telling ``on_lost`` is
        the caller's (:meth:`call`, :meth:`_reported`)."""
        self._abort()
        if isinstance(exc, (OSError, EOFError, asyncio.TimeoutError)):
            if self.expired:
                return self._timed_out(deadline)
            exc = status_error(grpc.StatusCode.UNAVAILABLE, f"IPC stream socket {self.offer.path}: "
                                                            f"{exc or type(exc).__name__}", self.what)
        elif isinstance(exc, DecodeError):
            return RequestError(grpc.StatusCode.INTERNAL, f"{self.what}: unparsable IPC answer: {exc}")
        return exc

    def _reported(self, exc: BaseException, deadline: float | None) -> BaseException:
        """:meth:`_failed`, with an UNAVAILABLE error told to ``on_lost`` (as :meth:`call` does)."""
        err = self._failed(exc, deadline)
        if isinstance(err, RequestError):
            self._lost(err)
        return err

    async def _call_ipc(self, msg, deadline: float | None):
        """:meth:`call` over the socket (or, when it cannot be opened, :meth:`_fall_back`)."""
        left = self._budget(deadline)
        data = self._serialized(msg)
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self.expired = False
        self._arm(left)
        try:
            if not self.opened and not await self._open(left):
                self.expiry = None  # the fallback stream bounds its own call
                return await self._fall_back(msg, deadline)
            return await self._response(self._put(data))
        except BaseException as exc:
            raise self._failed(exc, deadline) from None
        finally:
            self.expiry = None

    async def close(self, ok: bool, timeout: float | None = None) -> None:
        """Half-closes the connection and waits (at most ``timeout`` seconds) for the worker to close
        its end, i.e. for its handler to return and free the compute slot (``ok``: the request ended
        normally), or closes it at once; never raises and never leaves the connection open. Answers
        still coming for calls sent and not awaited (an early Propose the request no longer needs,
        :meth:`send_early`) are dropped on the way. After a fall-back, closes the fallback stream instead."""
        if self.instead is not None:
            await self.instead.close(ok, timeout)
            return
        if self.sock is None:
            return
        try:
            if ok:
                self.sock.shutdown(socket.SHUT_WR)
                end = None if timeout is None else self.loop.time() + timeout
                while True:  # each answer frame completes a waiter; the worker's close fails one with EOFError
                    self.waiter = self.loop.create_future()
                    await asyncio.wait_for(self.waiter, None if end is None else max(0.0, end - self.loop.time()))
        except Exception:  # noqa: BLE001 - EOF (the worker closed), a failed connection or no close in time
            pass
        finally:
            self._abort()


def _advance(views: list, sent: int) -> list:
    """``views`` (memoryviews) less their first ``sent`` bytes."""
    while sent and views:
        if sent >= len(views[0]):
            sent -= len(views.pop(0))
        else:
            views[0], sent = views[0][sent:], 0
    return views


def _transient(exc: Exception) -> bool:
    """Whether a failed IPC probe may succeed later: no answer in time (a worker still warming up),
    all connections or slots taken (RESOURCE_EXHAUSTED), a worker stopping (UNAVAILABLE), a full
    backlog (BlockingIOError). A missing socket or a refused token stays as it is."""
    if isinstance(exc, RequestError):
        return exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
    return isinstance(exc, (asyncio.TimeoutError, BlockingIOError))


class _Live:
    """A live request's control flags (Abort sets ``aborted``; the loop checks it once per worker call:
    a step or a plain run) and ``held``: the last step's :meth:`CoordinatorMetrics.record_step`
    arguments, recorded while the next verify is in flight (or when the request ends)."""

    __slots__ = ("aborted", "held")

    def __init__(self):
        self.aborted = False
        self.held: tuple | None = None


class Coordinator(gpbg.SpecDecodeServicer):
    """The public servicer. Call :meth:`connect` before serving (reads both workers' Info).

    Args:
        cfg: CoordinatorConfig.
        tokenizer_info: a :class:`TokenizerInfo` (tokenizer, end ids, chat template), None (only
            token-id input, no text), or "auto": read it at connect from ``cfg.tokenizer`` or else the
            target worker's GGUF (None when that file has no tokenizer).
    """

    def __init__(self, cfg: CoordinatorConfig, tokenizer_info="auto"):
        self.cfg, self.tok = cfg, tokenizer_info
        self.target = self.drafter = None
        self.tinfo = self.dinfo = None
        self.live: dict[str, asyncio.Task | None] = {}
        self._ids = itertools.count(1)
        self._instance = uuid.uuid4().hex[:12]
        self.eos_ids: list[int] = []
        self.connected = False  # calls before connect() finished get UNAVAILABLE
        # per worker: how the hot path reaches it ("ipc-stream", "grpc-stream", "unary"; "" no drafter)
        self.hot_path = {"target": "", "drafter": ""}
        self.ipc_offers: dict[str, IpcOffer] = {}  # "verify" / "propose" -> the IPC socket in use
        # shared by its IpcStreams
        self.ipc_spin = IpcSpin(cfg.ipc_spin_us, cfg.ipc_wake_ahead) if cfg.ipc_spin_us else None
        self._ipc_lost: set[str] = set()  # workers whose IPC socket failed: re-chosen by the readiness loop
        self._releases: set[asyncio.Task] = set()  # Releases in flight (close() waits for them)

    async def connect(self) -> None:
        """Opens the worker channels and checks the pair (vocabulary, shared-memory namespace)."""
        opts = self.cfg.channel_options()
        self.target_channel = grpc.aio.insecure_channel(self.cfg.target, options=opts)
        self.target = wpbg.TargetWorkerStub(self.target_channel)
        self.tinfo = await self.target.Info(wpb.InfoRequest(), timeout=self.cfg.worker_timeout_s, wait_for_ready=True)
        self.eos_ids = list(self.tinfo.eos_token_ids)
        await self._choose_hot_path(self.tinfo, "target", VERIFY_STREAM)
        want = self.cfg.feature_transport
        if (self.tinfo.feature_transport or "shm") != want:
            raise RuntimeError(f"coordinator feature_transport is {want!r} but the target worker at {self.cfg.target} runs "
                               f"{self.tinfo.feature_transport or 'shm'!r}; start all three with the same "
                               "--feature-transport")
        if isinstance(self.tok, str):
            self.tok = await asyncio.to_thread(load_tokenizer, self.cfg.tokenizer or self.tinfo.model_path)
        if self.tok is not None:
            self.eos_ids += [e for e in self.tok.end_ids if e not in self.eos_ids]
        if self.cfg.drafter:
            self.draft_channel = grpc.aio.insecure_channel(self.cfg.drafter, options=opts)
            self.drafter = wpbg.DraftWorkerStub(self.draft_channel)
            self.dinfo = await self.drafter.Info(wpb.InfoRequest(), timeout=self.cfg.worker_timeout_s,
                                                 wait_for_ready=True)
            await self._choose_hot_path(self.dinfo, "drafter", PROPOSE_STREAM)
            if (self.dinfo.feature_transport or "shm") != want:
                raise RuntimeError(f"coordinator feature_transport is {want!r} but the drafter worker at "
                                   f"{self.cfg.drafter} runs {self.dinfo.feature_transport or 'shm'!r}; start all "
                                   "three with the same --feature-transport")
            if want == "shm" and self.dinfo.shm_namespace_id != self.tinfo.shm_namespace_id:
                raise RuntimeError(f"target ({self.tinfo.shm_namespace_id}) and drafter ({self.dinfo.shm_namespace_id}) "
                                   "do not share /dev/shm; the feature ring needs one tmpfs "
                                   "(use --feature-transport inline across hosts)")
            if self.dinfo.vocab_size != self.tinfo.vocab_size:
                raise RuntimeError(f"drafter vocabulary {self.dinfo.vocab_size} != target {self.tinfo.vocab_size}")
            if self.dinfo.target_layer_ids and list(self.dinfo.target_layer_ids) != list(self.tinfo.capture_layers):
                raise RuntimeError(f"drafter taps {list(self.dinfo.target_layer_ids)} != target capture layers "
                                   f"{list(self.tinfo.capture_layers)} (start the target with the drafter's taps)")
            if self.cfg.confidence_threshold and not self.dinfo.has_confidence:
                raise RuntimeError(f"--confidence-threshold {self.cfg.confidence_threshold} needs a DSpark drafter "
                                   f"with a confidence head; the drafter is {self.dinfo.family or self.dinfo.name}")
            self._check_drafter_slots()
            if self.cfg.draft_mode == "tree" and not self.dinfo.max_top_k:
                raise RuntimeError(f"--draft-mode tree needs a drafter that returns top-k candidates; "
                                   f"{self.dinfo.name} does not")
        self.metrics = CoordinatorMetrics(os.path.basename(self.tinfo.model_path),
                                          self.dinfo.name if self.dinfo is not None else "")
        for worker, kind in self.hot_path.items():
            if kind:
                self.metrics.hot_path.labels(*self.metrics.l(worker, kind)).set(1)  # chosen before the metrics existed
        self.connected = True

    async def _choose_hot_path(self, info, worker: str, method: IpcMethod) -> None:
        """Sets ``hot_path[worker]`` (and ``ipc_offers[method.what]`` for "ipc-stream"): the worker's
        IPC stream socket when worker_streams and ipc_streams are on, its Info offers one and a probe
        hello from this host is answered ok; else gRPC streams, or unary calls without worker_streams.
        A probe failure that may pass (:func:`_transient`: no answer in time while the worker warms up,
        all its connections taken) puts the worker in ``_ipc_lost``, so the readiness loop probes it
        again; one that will not (another host's path, a wrong token) does not. Logs the choice, with
        the reason when an offered socket is not used."""
        addr = self.cfg.target if worker == "target" else self.cfg.drafter
        if not self.cfg.worker_streams:
            kind, why = "unary", "--no-worker-streams"
        elif not info.ipc_stream_socket:
            kind, why = "grpc-stream", "the worker offers no IPC stream socket"
        elif not self.cfg.ipc_streams:
            kind, why = "grpc-stream", "--no-ipc-streams"
        else:
            offer = IpcOffer(info.ipc_stream_socket, bytes(info.ipc_stream_token), method)
            try:
                await probe_ipc(offer, self.cfg.health_timeout_s)
            except (OSError, EOFError, asyncio.TimeoutError, RequestError) as exc:  # another host, no permission
                kind = "grpc-stream"
                why = f"its IPC stream socket {offer.path} cannot be used from here: {type(exc).__name__}: {exc}"
                if _transient(exc):
                    self._ipc_lost.add(worker)
                    why += "; probed again by the readiness loop"
            else:
                self._set_hot_path(worker, "ipc-stream", method, offer)
                log.info("coordinator: %s worker at %s: hot path over its IPC stream socket %s", worker, addr,
                         offer.path)
                return
        same = self.hot_path[worker] == kind  # a re-probe that changed nothing: not worth an INFO line each round
        self._set_hot_path(worker, kind, method)
        log.log(logging.DEBUG if same else logging.INFO, "coordinator: %s worker at %s: hot path over %s (%s)", worker,
                addr, "gRPC streams" if kind == "grpc-stream" else "unary calls", why)

    def _set_hot_path(self, worker: str, kind: str, method: IpcMethod, offer: IpcOffer | None = None) -> None:
        """Records ``worker``'s hot-path transport ``kind`` (with its IPC ``offer`` for "ipc-stream")
        and moves the specd_worker_hot_path gauge (once the metrics exist: connect sets them after)."""
        old, self.hot_path[worker] = self.hot_path[worker], kind
        if offer is None:
            self.ipc_offers.pop(method.what, None)
        else:
            self.ipc_offers[method.what] = offer
        mx = getattr(self, "metrics", None)
        if mx is not None:
            if old:
                mx.hot_path.labels(*mx.l(worker, old)).set(0)
            mx.hot_path.labels(*mx.l(worker, kind)).set(1)

    def _ipc_failed(self, offer: IpcOffer) -> None:
        """A sequence found ``offer``'s socket unusable (UNAVAILABLE: its worker stopped, or restarted
        with a new socket and token): new sequences take that worker's gRPC stream, whose channel
        reconnects by itself, until the readiness loop has read the worker's Info again and chosen its
        hot path anew (:meth:`_rechoose_lost`)."""
        if self.ipc_offers.get(offer.method.what) is not offer:
            return  # another sequence reported it first
        worker = "target" if offer.method is VERIFY_STREAM else "drafter"
        self._set_hot_path(worker, "grpc-stream", offer.method)
        self._ipc_lost.add(worker)
        log.warning("coordinator: the %s worker's IPC stream socket %s failed; new requests use gRPC streams until "
                    "its Info is read again", worker, offer.path)

    async def _rechoose_lost(self) -> None:
        """Reads the Info of each worker whose IPC socket failed and chooses its hot path again (a
        restarted worker offers a new socket); a worker that does not answer is tried next round."""
        for worker in list(self._ipc_lost):
            stub, method = (self.target, VERIFY_STREAM) if worker == "target" else (self.drafter, PROPOSE_STREAM)
            try:
                info = await stub.Info(wpb.InfoRequest(), timeout=self.cfg.health_timeout_s)
            except grpc.aio.AioRpcError:
                continue
            self._ipc_lost.discard(worker)
            await self._choose_hot_path(info, worker, method)

    def _check_drafter_slots(self) -> None:
        """Warns when worker streams are on and the drafter has fewer compute slots than the target
        admits sequences: each speculating sequence then holds a drafter slot for its whole generation,
        so sequences beyond the drafter's slots would fail with RESOURCE_EXHAUSTED after their prefill."""
        slots, seqs = self.dinfo.compute_slots, self.tinfo.max_sequences
        if self.cfg.worker_streams and slots and seqs and slots < seqs:
            log.warning("coordinator: the drafter worker at %s has %d compute slots but the target admits %d "
                        "sequences; with worker streams each speculating sequence holds one drafter slot, so "
                        "start the drafter with --threads >= %d (or use --no-worker-streams)",
                        self.cfg.drafter, slots, seqs, seqs + 2)

    async def workers_serving(self) -> bool:
        """True when every configured worker answers grpc.health.v1 Check("") with SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        chans = [self.target_channel] + ([self.draft_channel] if self.drafter is not None else [])
        for ch in chans:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=self.cfg.health_timeout_s)
            except grpc.aio.AioRpcError:
                return False
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        return True

    def watch_workers(self, health_servicer) -> None:
        """Starts the readiness loop: SpecDecode is SERVING only while both workers are; while they
        are, it also re-chooses the hot path of a worker whose IPC socket failed."""
        from grpc_health.v1 import health_pb2

        async def loop():
            while True:
                ok = await self.workers_serving()
                if ok and self._ipc_lost:
                    await self._rechoose_lost()
                await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ok
                                          else health_pb2.HealthCheckResponse.NOT_SERVING)
                await asyncio.sleep(self.cfg.health_poll_s)

        self._watch = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        http = getattr(self, "metrics_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()
        await self.wait_releases()
        for ch in ("target_channel", "draft_channel"):
            if hasattr(self, ch):
                await getattr(self, ch).close()

    async def wait_releases(self, timeout: float | None = None) -> None:
        """Waits (at most ``timeout``, default release_timeout_s) for the worker Releases still in
        flight, so closing the channels does not cut them off (the workers' idle TTL is the backstop)."""
        timeout = self.cfg.release_timeout_s if timeout is None else timeout
        end = time.monotonic() + timeout
        while self.live and time.monotonic() < end:  # cancelled handlers still on their way to the finally
            await asyncio.sleep(0.01)
        pending = [t for t in self._releases if not t.done()]
        if pending:
            done, left = await asyncio.wait(pending, timeout=max(0.0, end - time.monotonic()))
            if left:
                log.warning("close: %d worker Release call(s) still pending; the workers' idle TTL frees them",
                            len(left))

    async def _check_connected(self, context) -> None:
        if not self.connected:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is still connecting to its workers")

    # ------------------------------------------------------------------ GetModelInfo

    async def GetModelInfo(self, request, context):
        await self._check_connected(context)
        fits = self.tinfo.memory.fits_sequences if self.tinfo.HasField("memory") else -1
        return gpb.GetModelInfoResponse(
            target_path=self.tinfo.model_path, vocab_size=self.tinfo.vocab_size, max_seq_len=self.tinfo.max_seq_len,
            eos_token_ids=self.eos_ids, drafter_name=self.dinfo.name if self.dinfo else "",
            max_draft_tokens=self._server_draft_cap(), has_tokenizer=self.tok is not None,
            target_weight_bytes=self.tinfo.memory.weight_bytes, target_sequence_bytes=self.tinfo.memory.sequence_bytes,
            target_fits_sequences=fits if fits >= 0 else None,
            drafter_weight_bytes=self.dinfo.memory.weight_bytes if self.dinfo else 0,
            drafter_target_head_bytes=self.dinfo.memory.target_head_bytes if self.dinfo else 0,
            drafter_shared_head_bytes=self.dinfo.memory.shared_head_bytes if self.dinfo else 0,
            target_hot_path=self.hot_path["target"], drafter_hot_path=self.hot_path["drafter"])

    def _server_draft_cap(self) -> int:
        if self.dinfo is None:
            return 0
        cap = min(self.dinfo.block_size, self.tinfo.max_verify - 1)
        return min(cap, self.cfg.max_draft_tokens) if self.cfg.max_draft_tokens else cap

    # ------------------------------------------------------------------ admission

    def _prompt(self, req) -> list[int]:
        kind = req.WhichOneof("input")
        if kind is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request has no input (text, tokenized or chat)")
        if kind == "tokenized":
            ids = list(req.tokenized.input_ids)
            bad = [t for t in ids if not 0 <= t < self.tinfo.vocab_size]
            if bad:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"input_ids: token {bad[0]} outside the vocabulary [0, {self.tinfo.vocab_size})")
        else:
            if self.tok is None:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the model has no tokenizer; send token ids")
            limit_b = self.cfg.max_prompt_bytes
            if kind == "text":
                text = req.text
                if len(text) > limit_b or len(text.encode("utf-8", "surrogatepass")) > limit_b:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"text input exceeds max_prompt_bytes {limit_b}")
            else:
                n_b = sum(len(m.content.encode("utf-8", "surrogatepass")) + len(m.role.encode("utf-8", "surrogatepass"))
                          for m in req.chat.messages)
                if n_b > limit_b:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"chat input of {n_b} bytes exceeds max_prompt_bytes {limit_b}")
                if not self.tok.chat_template:
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the model has no chat template")
                import jinja2

                msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
                agp = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
                extra = {"enable_thinking": req.chat.enable_thinking} if req.chat.HasField("enable_thinking") else {}
                try:
                    text = self._chat_template().render(messages=msgs, add_generation_prompt=agp, **extra)
                except jinja2.TemplateError as exc:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"chat template: {exc}") from exc
                if len(text.encode("utf-8", "surrogatepass")) > 4 * limit_b:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"rendered chat prompt exceeds {4 * limit_b} bytes")
            ids = self.tok.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        limit = self.cfg.max_prompt_tokens or (self.tinfo.max_seq_len - 1)
        if len(ids) > min(limit, self.tinfo.max_seq_len - 1):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt of {len(ids)} tokens exceeds the limit {min(limit, self.tinfo.max_seq_len - 1)}")
        return ids

    def _chat_template(self):
        """The GGUF chat template compiled like transformers' ``apply_chat_template``: a sandboxed
        jinja2 environment, trim_blocks + lstrip_blocks, loop controls, ``raise_exception``."""
        if getattr(self, "_template", None) is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.tok.chat_template)
        return self._template

    def _check_sizes(self, req) -> None:
        """INVALID_ARGUMENT for request-controlled sizes over their caps (request_id, stop strings),
        checked before any tokenising."""
        cfg = self.cfg
        if len(req.request_id.encode("utf-8", "surrogatepass")) > cfg.max_request_id_bytes:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id exceeds max_request_id_bytes {cfg.max_request_id_bytes}")
        stop = req.stopping.stop
        if len(stop) > cfg.max_stop_strings:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{len(stop)} stop strings exceed max_stop_strings {cfg.max_stop_strings}")
        for s_ in stop:
            if len(s_.encode("utf-8", "surrogatepass")) > cfg.max_stop_string_bytes:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"a stop string exceeds max_stop_string_bytes {cfg.max_stop_string_bytes}")

    def _finisher(self, req, n_prompt: int) -> Finisher:
        s = req.sampling
        if s.HasField("temperature") and s.temperature != 0.0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               "only greedy decoding (temperature 0) is implemented; sampled speculation is not")
        for f in ("top_p", "top_k", "seed"):
            if s.HasField(f):
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{f} is not supported (greedy only)")
        st = req.stopping
        room = self.tinfo.max_seq_len - n_prompt
        if st.HasField("max_tokens"):
            if st.max_tokens < 1:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")
            if st.max_tokens > room:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"prompt ({n_prompt}) + max_tokens ({st.max_tokens}) exceeds the context "
                                   f"{self.tinfo.max_seq_len}")
            max_tokens = st.max_tokens
        else:
            max_tokens = min(self.cfg.default_max_tokens, room)
        stop_ids: dict[int, object] = {}
        if not st.ignore_eos:
            stop_ids.update({e: e for e in self.eos_ids})
        for t in st.stop_token_ids:
            if not 0 <= t < self.tinfo.vocab_size:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"stop_token_ids: {t} outside the vocabulary")
            stop_ids[t] = t
        strings = []
        self._check_sizes(req)
        if st.stop:
            if self.tok is None:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a tokenizer")
            added = {tok.content: i for i, tok in self.tok.tokenizer.get_added_tokens_decoder().items()}
            for s_ in st.stop:
                if not s_:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty stop string")
                if s_ in added:  # a special/added token: match its id (it may be skipped in the text)
                    stop_ids[added[s_]] = s_
                strings.append(s_)
        skip = req.skip_special_tokens if req.HasField("skip_special_tokens") else True
        return Finisher(max_tokens, stop_ids, strings, st.include_stop,
                        self.tok.tokenizer if self.tok is not None else None, skip)

    def _draft_cap(self, req) -> tuple[int, SpecOptions]:
        """(speculation mode, resolved :class:`SpecOptions`); INVALID_ARGUMENT for an option the
        drafter cannot serve (tree without top-k, top-k above its max, a confidence gate without a
        confidence head, a threshold outside [0, 1), a zero budget)."""
        sp = req.speculation
        mode = sp.mode
        if mode not in MODE_NAMES:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown speculation mode {mode}")
        cap = self._server_draft_cap()
        if sp.HasField("max_draft_tokens"):
            cap = min(cap, sp.max_draft_tokens)
        if mode == gpb.SPECULATION_MODE_FORCE and cap == 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               "speculation FORCE needs a drafter and max_draft_tokens >= 1")
        if mode == gpb.SPECULATION_MODE_OFF:
            cap = 0
        cfg = self.cfg
        if sp.draft_mode not in (gpb.DRAFT_MODE_DEFAULT, gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown draft mode {sp.draft_mode}")
        tree = sp.draft_mode == gpb.DRAFT_MODE_TREE or (sp.draft_mode == gpb.DRAFT_MODE_DEFAULT
                                                         and cfg.draft_mode == "tree")
        thr = sp.confidence_threshold if sp.HasField("confidence_threshold") else cfg.confidence_threshold
        if not 0.0 <= thr < 1.0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"confidence_threshold must be in [0, 1), got {thr}")
        if thr and cap and not self.dinfo.has_confidence:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               "confidence_threshold needs a DSpark drafter with a confidence head")
        markov = int(sp.dspark_markov)
        if markov not in (gpb.DSPARK_MARKOV_DEFAULT, gpb.DSPARK_MARKOV_FUSED, gpb.DSPARK_MARKOV_UNFUSED,
                          gpb.DSPARK_MARKOV_OFF):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown dspark_markov {markov}")
        if markov and cap and self.dinfo.family != "dspark":
            # vLLM / SGLang style: an option of another drafter family is ignored, not refused; reported in the log
            log.info("request: dspark_markov=%s ignored: the drafter is %s (no Markov head)",
                     gpb.DSparkMarkov.Name(markov), self.dinfo.family or self.dinfo.name)
        budget = sp.tree_budget if sp.HasField("tree_budget") else cfg.tree_budget
        top_k = sp.tree_top_k if sp.HasField("tree_top_k") else cfg.tree_top_k
        chain_seed = sp.tree_chain_seed if sp.HasField("tree_chain_seed") else cfg.tree_chain_seed
        if tree and cap:
            if budget < 1:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "tree_budget must be >= 1")
            if not self.dinfo.max_top_k:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"tree mode needs a drafter with top-k candidates; {self.dinfo.name} has none")
            if top_k > self.dinfo.max_top_k:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"tree_top_k {top_k} exceeds the drafter's max_top_k {self.dinfo.max_top_k}")
            budget = min(budget, self.tinfo.max_verify - 1)
        return mode, SpecOptions(cap=cap, tree=tree and cap > 0, budget=budget, chain_seed=chain_seed, top_k=top_k,
                                 temperature=cfg.tree_temperature, confidence_threshold=float(thr),
                                 dspark_markov=markov)

    def _think_ids(self) -> tuple[int, int, list[int]] | None:
        """(``<think>`` id, ``</think>`` id, close sequence ids) of the tokenizer, or None when it has
        no such tokens (or no tokenizer)."""
        if self.tok is None:
            return None
        if getattr(self, "_think", False) is False:
            added = {t.content: i for i, t in self.tok.tokenizer.get_added_tokens_decoder().items()}
            if "<think>" not in added or "</think>" not in added:
                self._think = None
            else:
                close = self.tok.tokenizer.encode(self.cfg.reasoning_close, add_special_tokens=False).ids
                if added["</think>"] not in close:
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"reasoning_close {self.cfg.reasoning_close!r} does not contain </think>")
                self._think = (added["<think>"], added["</think>"], list(close))
        return self._think

    def _reasoning(self, req, prompt, fin: Finisher) -> tuple[ReasoningBudget | None, bool]:
        """(the request's thinking tracker, budget_not_armed). The tracker always counts thinking
        tokens when the model has <think>/</think>; it forces a close only when the budget is armed:
        budget > 0 and max_tokens > budget + reply_reserve (spec-loop.md §10)."""
        asked = req.HasField("reasoning_budget")
        budget = req.reasoning_budget if asked else self.cfg.reasoning_budget
        ids = self._think_ids()
        if ids is None:
            if asked and budget > 0:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "reasoning_budget needs a tokenizer with <think> and </think> tokens")
            return None, False
        open_id, close_id, close = ids
        unarmed = budget > 0 and fin.max_tokens <= budget + self.cfg.reply_reserve
        if unarmed:
            budget = 0
        rb = ReasoningBudget(budget, open_id, close_id, close,
                             ReasoningBudget.prompt_in_think(prompt, open_id, close_id))
        return rb, unarmed

    # ------------------------------------------------------------------ Generate

    async def Generate(self, request, context):
        """Streams chunks then one ``complete`` (module docstring); admission errors are
        INVALID_ARGUMENT / FAILED_PRECONDITION / ALREADY_EXISTS before anything runs. The request's id
        (the caller's or an assigned random one) goes back as initial metadata ``specd-request-id``
        (the key for Abort). Each message is written with a bound (send_stall_timeout_s): a client
        that stops reading ends with RESOURCE_EXHAUSTED."""
        await self._check_connected(context)
        rid = request.request_id
        try:
            self._check_sizes(request)
            # tokenising / chat-template rendering can take a while: off the event loop
            prompt = await asyncio.to_thread(self._prompt, request)
            fin = self._finisher(request, len(prompt))
            mode, opts = self._draft_cap(request)
            reasoning = self._reasoning(request, prompt, fin)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        rid = rid or f"req-{uuid.uuid4().hex}"  # unguessable: another client cannot Abort it by counting
        if rid in self.live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is live")
        self.live[rid] = live = _Live()
        # unique across coordinators sharing the workers and across restarts (workers keep tombstones)
        seq_id = f"{rid}#{self._instance}-{next(self._ids)}"
        started = {"target": False, "drafter": False}
        # the sequence's VerifyStream / ProposeStream (opened at its first step; None: unary calls)
        streams = None
        if self.cfg.worker_streams:
            streams = {"verify": self._stream("verify", self.target.VerifyStream)}
            if self.drafter is not None:
                streams["propose"] = self._stream("propose", self.drafter.ProposeStream)
        deadline = None if context.time_remaining() is None else time.monotonic() + context.time_remaining()
        t_start = time.perf_counter()
        mx = self.metrics
        lv = mx.l()
        mx.running.labels(*lv).inc()
        mx.spec_requests.labels(*mx.l(MODE_NAMES[mode])).inc()
        loop = asyncio.get_running_loop()
        outcome = ("abort", "CANCELLED")  # client cancel lands here
        last_sent = None
        # the client write in flight (at most one): it completes while the loop runs the next step's
        # worker calls instead of adding its gRPC round trip to every step; awaited before the next
        # write and at the end, each bounded by send_stall_timeout_s
        writing = None
        ended = False
        try:
            await context.send_initial_metadata((("specd-request-id", rid),))
            async for msg in self._loop(seq_id, prompt, fin, mode, opts, deadline, started, t_start,
                                        request.stream_options.token_by_token, live, reasoning, streams):
                if writing is not None:
                    await self._written(writing)
                writing = loop.create_task(context.write(msg))
                now = time.perf_counter()
                if msg.HasField("complete"):
                    outcome = (msg.complete.finish_reason, "OK")
                else:  # latency metrics from chunks handed to gRPC
                    # recorded off the step's critical path, like _loop's record_step
                    loop.call_soon(mx.record_chunk, now - (t_start if last_sent is None else last_sent),
                                   last_sent is None)
                    last_sent = now
            if writing is not None:
                await self._written(writing)
            ended = True
        except RequestError as exc:
            outcome = ("error", exc.code.name)
            if writing is not None and not writing.done():  # the chunks before the error still reach the client
                try:
                    await self._written(writing)
                except Exception:  # noqa: BLE001 - the error below is the one reported
                    pass
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            if deadline is not None and time.monotonic() >= deadline:
                outcome = ("error", "DEADLINE_EXCEEDED")
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: INTERNAL, counted as such
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("request %s failed", rid)
            outcome = ("error", "INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        finally:
            if writing is not None and not writing.done():
                writing.cancel()
            self.live.pop(rid, None)
            task = asyncio.ensure_future(self._release(seq_id, started, streams, ended))  # first: whatever follows
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
            if live.held is not None:  # the last step's metrics (held for a next verify)
                mx.record_step(*live.held)
            mx.running.labels(*lv).dec()
            mx.requests.labels(*mx.l(*outcome)).inc()
            mx.generation_tokens.labels(*lv).inc(len(fin.ids))
            mx.e2e.labels(*lv).observe(time.perf_counter() - t_start)
            await asyncio.shield(task)

    def _stream(self, what: str, grpc_method) -> SequenceStream:
        """A new sequence's stream for ``what`` ("verify" / "propose"): over the worker's IPC stream
        socket when connect chose it, else the gRPC stream ``grpc_method``."""
        offer = self.ipc_offers.get(what)
        if offer is not None:
            return IpcStream(offer, self.cfg.worker_timeout_s, self.cfg.internal_max_message_bytes,
                             self.cfg.health_timeout_s,
                             fallback=lambda: WorkerStream(grpc_method, what, self.cfg.worker_timeout_s),
                             on_lost=self._ipc_failed, spin=self.ipc_spin)
        return WorkerStream(grpc_method, what, self.cfg.worker_timeout_s)

    async def _written(self, writing: asyncio.Future) -> None:
        """Waits for a client write started by Generate (at most send_stall_timeout_s: a client that
        stops reading ends with RESOURCE_EXHAUSTED) and re-raises its error."""
        if not writing.done():
            try:
                await asyncio.wait_for(writing, self.cfg.send_stall_timeout_s)
            except asyncio.TimeoutError:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"client did not read for {self.cfg.send_stall_timeout_s} s "
                                   "(send_stall_timeout_s)") from None
        else:
            writing.result()

    async def _release(self, seq_id: str, started: dict, streams: dict | None = None, ended: bool = False) -> None:
        """Closes the sequence's worker streams (half-close after a normal end, else cancel), then
        releases the sequence on the workers that hold it; a failed call is retried once (the
        workers' idle TTL frees what still leaks). Concurrently (shm, inline: the drafter only ever
        holds its own copy); with cuda-ipc the drafter first, and the target only once the drafter's
        Release has returned (closed its mapping of the ring after its stream drained) or failed
        twice: the target's Release frees the ring's device memory (cudaFree). Runs as a shielded
        task of Generate, so a client cancel cannot cut it short."""
        for st in (streams or {}).values():
            await st.close(ended, self.cfg.release_timeout_s)
        async def one(stub, name):
            for attempt in (1, 2):
                try:
                    await stub.Release(wpb.ReleaseRequest(seq_id=seq_id), timeout=self.cfg.release_timeout_s)
                    return
                except Exception as exc:  # noqa: BLE001
                    log.warning("release of %s on the %s failed (attempt %d): %s", seq_id, name, attempt, exc)

        if self.cfg.feature_transport == "cuda-ipc":
            if started["drafter"]:
                await one(self.drafter, "drafter")  # never raises: failures are logged
            if started["target"]:
                await one(self.target, "target")
            return
        calls = []
        if started["target"]:
            calls.append(one(self.target, "target"))
        if started["drafter"]:
            calls.append(one(self.drafter, "drafter"))
        await asyncio.gather(*calls, return_exceptions=True)

    def _timeout(self, deadline):
        if deadline is None:
            return self.cfg.worker_timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return left

    async def _call(self, fn, msg, deadline, what: str):
        """The coordinator's single gate for worker calls: ``fn`` is a unary stub method or the
        sequence's :class:`SequenceStream`; returns the response, raises RequestError (:func:`rpc_error`)."""
        if isinstance(fn, SequenceStream):
            return await fn.call(msg, deadline)
        try:
            return await fn(msg, timeout=self._timeout(deadline))
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, what) from exc

    def _propose_request(self, seq_id: str, start: int, new_tokens, anchor: int, k: int, opts: SpecOptions,
                         rows=()) -> tuple:
        """(the ProposeRequest of a step drafting up to ``k`` tokens after ``anchor``, with the drafter
        synced from ``start`` to ``start + len(new_tokens)``; its top_k: DDTree's candidates per draft)."""
        top_k = opts.top_k or auto_top_k(opts.budget, k, self.dinfo.max_top_k) if opts.tree else 0
        req = wpb.ProposeRequest(seq_id=seq_id, start=start, new_tokens=new_tokens, anchor=anchor, max_tokens=k,
                                 confidence_threshold=opts.confidence_threshold, top_k=top_k,
                                 top_k_temperature=opts.temperature if top_k else 0.0,
                                 dspark_markov=opts.dspark_markov, rows=rows)
        return req, top_k

    def _propose_early(self, stream, seq_id: str, start: int, new_tokens: list[int], anchor: int, k: int,
                       opts: SpecOptions, policy: AdaptivePolicy, force: bool, deadline):
        """Sends the next step's Propose at a speculative step's verify answer, before the step's
        bookkeeping (finish rules, detokenisation, chunks, stats): the drafter computes meanwhile, so
        the bookkeeping leaves the loop's critical path. Only where the next step is already known:
        an IPC stream with nothing in flight, no armed reasoning budget (which may rewrite tokens; the
        caller checks it), room for a draft (``k`` > 0), the policy speculating next, and the deadline
        fitting a speculative step. The request is the one the next step would build (``new_tokens``
        from ``start``: the anchor and the accepted drafts; the new ``anchor``, the bonus token); if
        the request finishes instead, its answer is dropped with the stream.
        Returns the next step's (k, top_k, send time in ns), None when not sent, or the RequestError
        of a failed send, raised by the next step (not by a request that finishes)."""
        if not isinstance(stream, IpcStream) or not stream.can_send_early():
            return None
        if not self._speculates(k, force, policy, deadline):
            return None
        req, top_k = self._propose_request(seq_id, start, new_tokens, anchor, k, opts)
        try:
            return k, top_k, stream.send_early(req, deadline)
        except RequestError as exc:
            return exc

    @staticmethod
    def _speculates(k: int, force: bool, policy: AdaptivePolicy, deadline: float | None) -> bool:
        """Whether a step of up to ``k`` drafts speculates: room for a draft, FORCE or the adaptive
        policy, and (deadline: time.monotonic() seconds) time left for a speculative step, else
        plain steps to the end."""
        if k <= 0 or not (force or policy.speculate_next()):
            return False
        return deadline is None or policy.t_spec is None or deadline - time.monotonic() >= policy.t_spec

    def _tree(self, anchor: int, prop, rows: int, top_k: int, budget: int, chain_seed: bool):
        """The DDTree of one step from a ProposeResponse's row-major top-k ([rows, top_k]) under
        ``budget`` nodes (>= k, as the sequence capacity leaves room for the chain); INTERNAL when
        the drafter's top-k is malformed."""
        ids, lps = list(prop.top_k_ids), list(prop.top_k_logprobs)
        if len(ids) != rows * top_k or len(lps) != rows * top_k:
            raise RequestError(grpc.StatusCode.INTERNAL, f"drafter returned {len(ids)} top-k ids / {len(lps)} "
                                                         f"log-probs for {rows} rows x top_k {top_k}")
        if any(not 0 <= t < self.tinfo.vocab_size for t in ids):
            raise RequestError(grpc.StatusCode.INTERNAL, "drafter returned a top-k id outside the vocabulary")
        return build_tree(anchor, [ids[i * top_k:(i + 1) * top_k] for i in range(rows)],
                          [lps[i * top_k:(i + 1) * top_k] for i in range(rows)], budget, chain_seed)

    @staticmethod
    def _check_tree(tree, vr, k: int) -> None:
        """Re-walks the verified tree from the worker's per-node argmax (spec-loop.md §7.5) and checks
        the worker's path and emitted tokens against it; INTERNAL on a disagreement."""
        argmax = list(vr.argmax)
        if len(argmax) != len(tree.tokens):
            raise RequestError(grpc.StatusCode.INTERNAL, f"tree verify returned {len(argmax)} argmax for "
                                                         f"{len(tree.tokens)} nodes")
        path = walk_tree(tree.tokens, tree.parents, argmax, k)
        want = [tree.tokens[r] for r in path[1:]] + [argmax[path[-1]]]
        if list(vr.path) != path or list(vr.emitted) != want:
            raise RequestError(grpc.StatusCode.INTERNAL, f"tree verify path {list(vr.path)} / emitted "
                                                         f"{list(vr.emitted)} != walk {path} / {want}")

    async def Abort(self, request, context):
        """Flags the named live requests; each ends after its current step (or plain run) with "abort"."""
        aborted = []
        for rid in request.request_ids:
            live = self.live.get(rid)
            if live is not None:
                live.aborted = True
                aborted.append(rid)
        return gpb.AbortResponse(aborted=aborted)

    def _plain_run(self, remaining: int, policy: AdaptivePolicy, deadline, inline_room: int | None) -> int:
        """Plain steps for the next Verify call (a plain run, worker.proto ``plain_steps``): at most
        ``plain_steps_per_call`` and the worker's ``max_plain_steps``, cut to ``remaining`` (tokens
        left, already clipped to the reasoning budget's emit room), the policy's plain burst (the probe
        keeps its step), ``inline_room`` (inline transport: feature rows that may still pile up before
        the next Propose, None otherwise) and the deadline (the measured step time, with one step of
        margin for the call's round trip; 1 before any step time is known). >= 1."""
        n = min(self.cfg.plain_steps_per_call, self.tinfo.max_plain_steps or 1, remaining)
        burst = policy.plain_left()
        if burst is not None:
            n = min(n, burst)
        if inline_room is not None:
            n = min(n, inline_room)
        if deadline is not None and n > 1:
            t = policy.t_plain or policy.t_spec
            n = 1 if t is None else min(n, int((deadline - time.monotonic()) / t) - 1)
        return max(1, n)

    async def _loop(self, seq_id, prompt, fin: Finisher, mode, opts: SpecOptions, deadline, started, t_start,
                    token_by_token, live, reasoning=(None, False), streams=None):
        n_prompt = len(prompt)
        rb, budget_unarmed = reasoning
        cap = opts.cap
        stats = gpb.SpeculationStats(mode_used=mode)
        per_pos: list[int] = []
        per_rank: list[int] = []
        policy = AdaptivePolicy(self.cfg.policy)
        step = 0

        mx = self.metrics
        lv = mx.l()
        mx.prompt_tokens.labels(*lv).inc(n_prompt)
        call_soon = asyncio.get_running_loop().call_soon
        def chunk(new_ids, accepted):
            return gpb.GenerateResponse(chunk=gpb.GenerateChunk(
                token_ids=new_ids, text=fin.take_text(), prompt_tokens=n_prompt, completion_tokens=len(fin.ids),
                step_index=step, accepted_in_step=accepted))

        timing = gpb.Timing()
        started["target"] = True
        t0 = time.perf_counter()
        # a tree verify writes budget + 1 rows after the committed prefix (compacted at commit): room for
        # them past the completion budget, clipped to the context (then the per-step budget shrinks)
        capacity = n_prompt + fin.max_tokens
        if opts.tree:
            capacity = min(self.tinfo.max_seq_len, capacity + opts.budget)
        pre = await self._call(self.target.Prefill,
                               wpb.PrefillRequest(seq_id=seq_id, tokens=prompt, capacity=capacity),
                               deadline, "prefill")
        timing.prefill_s = time.perf_counter() - t0
        tokens = list(prompt)  # token at every position, committed ones then the anchor
        # inline transport: the target's FeatureRows since the last Propose, forwarded unread
        inline = self.cfg.feature_transport == "inline" and cap > 0  # cap 0: no Propose, keep no rows
        rows_out = [pre.rows] if inline and pre.HasField("rows") else []
        inline_cap = self.tinfo.inline_max_rows
        anchor = pre.first_token
        committed = pre.committed
        if rb is not None:
            anchor = rb.apply([anchor])[0]
        tokens.append(anchor)
        before = len(fin.ids)
        fin.push(anchor)
        first = chunk(fin.ids[before:], 0)
        if first.chunk.token_ids or first.chunk.text:  # the first token may itself be an excluded stop
            yield first
        t_first = time.perf_counter()
        timing.ttft_s = t_first - t_start
        t_answer = t_first  # the last verify's answer: from it to the next step's start is bookkeeping
        wait_s = verify_s = book_s = target_s = handler_s = 0.0  # Timing's split, summed here (a proto += costs more)
        handler_known = True  # every verify reported its handler time (a worker before VerifyResponse.handler_s: 0)
        synced = 0  # positions the drafter has ingested
        # a plain run stops early at these (an optimisation only: the Finisher decides what is sent)
        run_stops = list(fin.stop_ids) if len(fin.stop_ids) < MAX_RUN_STOP_IDS else []
        early = None  # the next step's Propose when sent at the last verify's answer (_propose_early)
        if rb is not None and rb.run_stop is not None:  # and at a <think> (reasoning.py)
            run_stops.append(rb.run_stop)
        while not fin.done:
            if live.aborted:
                fin.abort()
                last = chunk([], 0)
                if last.chunk.text:
                    yield last
                break
            step += 1
            remaining = fin.max_tokens - len(fin.ids)
            force = mode == gpb.SPECULATION_MODE_FORCE
            catch_up = committed - synced
            t0 = time.perf_counter()
            book_s += t0 - t_answer
            sent, early = early, None
            if sent is not None:  # this step's Propose went out at the last verify's answer (_propose_early)
                if isinstance(sent, BaseException):
                    raise sent
                k, top_k, sent_ns = sent
                speculate = True
            else:
                k = min(cap, remaining - 1)
                room = rb.room() if rb is not None else None
                if room is not None:  # clip to the thinking tokens left; 0 = a forced close token is next
                    k = min(k, room)
                    remaining = min(remaining, room + 1)  # a plain run too: only its last token may overflow
                speculate = self._speculates(k, force, policy, deadline)
                if inline and k > 0 and catch_up + cap + 1 > inline_cap:
                    speculate = True  # drain the rows pending for the drafter before they outgrow one message
            drafts: list[int] = []
            tree = None
            if sent is not None:
                prop = await streams["propose"].answer(sent_ns, deadline)
            elif speculate:
                req, top_k = self._propose_request(seq_id, synced, tokens[synced:committed], anchor, k, opts, rows_out)
                rows_out = []
                if not started["drafter"]:
                    req.features.CopyFrom(pre.features)
                    started["drafter"] = True
                prop = await self._call(streams["propose"] if streams else self.drafter.Propose, req, deadline,
                                        "propose")
            if speculate:
                stats.dspark_markov = int(prop.dspark_markov)  # worker.proto and generate.proto share the values
                synced = committed
                drafts = list(prop.tokens)[:k]
                if any(not 0 <= d < self.tinfo.vocab_size for d in drafts):
                    raise RequestError(grpc.StatusCode.INTERNAL, f"drafter returned a token outside the vocabulary: {drafts}")
                if rb is not None:  # drafts past a drafted <think> may not pass the budget
                    cut = rb.clip(drafts)
                    if top_k and (len(cut) < len(drafts) or (rb.armed and not rb.in_think
                                                              and rb.open_id in prop.top_k_ids)):
                        top_k = 0  # a candidate could open a thinking section past the budget: verify the chain
                    drafts = cut
                if top_k and drafts:
                    tree = self._tree(anchor, prop, len(drafts), top_k,
                                      min(opts.budget, capacity - committed - 1), opts.chain_seed)
                    drafts = tree.tokens[1:]
            t1 = time.perf_counter()
            run = 1 if speculate else self._plain_run(remaining, policy, deadline,
                                                      inline_cap - catch_up - cap - 1 if inline else None)
            if run > 1:
                vreq = wpb.VerifyRequest(seq_id=seq_id, tokens=[anchor], plain_steps=run, stop_token_ids=run_stops)
            elif tree is None:
                vreq = wpb.VerifyRequest(seq_id=seq_id, tokens=[anchor] + drafts, max_accept=len(drafts))
            else:
                vreq = wpb.VerifyRequest(seq_id=seq_id, tokens=tree.tokens, parents=tree.parents, max_accept=k)
            if live.held is not None:  # the last step's metrics: the event loop runs them during this verify
                call_soon(mx.record_step, *live.held)
                live.held = None
            vr = await self._call(streams["verify"] if streams else self.target.Verify, vreq, deadline, "verify")
            t2 = t_answer = time.perf_counter()
            dt = t2 - t0
            compute = vr.compute_s + (prop.compute_s if speculate else 0.0)
            timing.worker_compute_s += compute
            target_s += vr.compute_s
            handler_s += vr.handler_s
            handler_known = handler_known and vr.handler_s > 0
            if speculate:
                wait_s += t1 - t0
                verify_s += t2 - t1
            else:  # no drafter to wait for: the step's set-up is part of its verify
                verify_s += dt
            timing.loop_overhead_s += max(0.0, dt - compute)
            m = vr.accepted
            emitted = list(vr.emitted)
            if len(emitted) != m + 1 or vr.committed != committed + m + 1 or len(emitted) > run + len(drafts):
                raise RequestError(grpc.StatusCode.INTERNAL,
                                   f"target verify returned {len(emitted)} tokens / committed {vr.committed} "
                                   f"for {m} accepted at {committed} ({len(drafts)} drafts, {run} plain steps)")
            if not speculate:
                m = 0  # a plain run's emitted tokens are target steps, not accepted drafts
            if tree is not None:
                self._check_tree(tree, vr, k)
            committed = vr.committed
            if inline and vr.HasField("rows"):
                rows_out.append(vr.rows)
            if speculate:
                # a Propose that also ingested the prompt or a catch-up after plain steps is slower
                # than a steady-state step: its time stays out of t_spec
                policy.record_spec(step, m, dt if catch_up <= cap + 1 else None, gate=not force)
                if streams is not None and (rb is None or not rb.armed) and not inline and not live.aborted:
                    # the next step's k and new tokens, as it finds them once every emitted token is taken
                    k_next = min(cap, fin.max_tokens - len(fin.ids) - len(emitted) - 1)
                    early = self._propose_early(streams["propose"], seq_id, synced,
                                                (tokens[synced:] + emitted)[:committed - synced], emitted[-1],
                                                k_next, opts, policy, force, deadline)
            # Token by token up to the finish: the reasoning budget (an overflowing bonus, never fed to
            # the target, becomes a close token) and the stop / max_tokens cut inside the block; only
            # the tokens up to the cut count (accepted drafts, thinking tokens, a run's steps), so the
            # stats and metrics agree with what was sent (C01, C04)
            out, used, taken = [], 0, []
            first_step = step  # a plain run's tokens are steps first_step, first_step + 1, ...
            before = len(fin.ids)
            for t in emitted:
                if rb is not None:
                    try:
                        t = rb.take(t, used == len(emitted) - 1)
                    except BudgetError as exc:
                        raise RequestError(grpc.StatusCode.INTERNAL, str(exc)) from exc
                taken.append(t)
                used += 1
                if not speculate:
                    step = first_step + used - 1
                if token_by_token:
                    b = len(fin.ids)
                    fin.push(t)
                    c = chunk(fin.ids[b:], m)
                    if c.chunk.token_ids or c.chunk.text:
                        out.append(c)
                    if fin.done:
                        break
                elif fin.push(t):
                    break
            if not token_by_token:
                c = chunk(fin.ids[before:], m)
                if not fin.done or c.chunk.token_ids or c.chunk.text:
                    out.append(c)
            tokens.extend(taken)  # all of emitted unless the request finished inside it
            anchor = taken[-1]
            m_sent = min(m, used)
            for c in out:
                c.chunk.accepted_in_step = m_sent
            # Prometheus updates take ~3 us (counter) to ~10 us (histogram) each, up to ~20 per step: they
            # are held until the next verify is in flight (the step's longest wait), so they run neither
            # between this verify's answer and the next call nor during a short Propose
            steps, share = (1, 1) if speculate else (used, len(emitted))  # a run's steps after the finish are not counted
            timing.steps += steps
            live.held = (len(drafts), m_sent, t1 - t0, (t2 - t1) / share, max(0.0, dt - compute) / share, steps)
            if speculate:
                if drafts:
                    stats.num_drafts += 1
                    stats.num_draft_tokens += len(drafts)
                    stats.num_accepted_tokens += m_sent
                    depth = len(drafts) if tree is None else max(tree.depth)
                    per_pos.extend([0] * (depth - len(per_pos)))
                    for i in range(m_sent):
                        per_pos[i] += 1
                    if tree is not None:
                        stats.num_tree_steps += 1
                        for r in list(vr.path)[1:1 + m_sent]:
                            rk = tree.rank[r]
                            per_rank.extend([0] * (rk + 1 - len(per_rank)))
                            per_rank[rk] += 1
                else:
                    stats.num_plain_steps += 1
            else:
                stats.num_plain_steps += steps
                policy.record_plain_run(first_step, steps, dt / share)
            for c in out:
                yield c
        t_end = time.perf_counter()
        timing.decode_s = t_end - t_first
        timing.draft_wait_s, timing.verify_wall_s, timing.target_compute_s = wait_s, verify_s, target_s
        timing.target_handler_s = handler_s if handler_known else 0.0
        timing.bookkeeping_s = book_s + (t_end - t_answer)
        if fin.take_text():  # nothing may remain unsent
            raise RequestError(grpc.StatusCode.INTERNAL, "text left unsent at finish")
        stats.accepted_per_position.extend(per_pos)
        stats.accepted_per_rank.extend(per_rank)
        stats.mean_acceptance_length = (1.0 + stats.num_accepted_tokens / stats.num_drafts) if stats.num_drafts else 0.0
        switches = list(policy.switches)
        if budget_unarmed:
            switches.insert(0, (0, True, "budget"))  # counted as decision to_spec_budget
        if rb is not None:
            stats.reasoning_budget_armed = rb.armed
            stats.thinking_tokens = rb.count
            stats.reasoning_budget_closed = rb.closed
            stats.forced_tokens = rb.forced
        for s, to_spec, reason in switches:
            stats.policy_switches.add(step_index=s, to_speculative=to_spec, reason=reason)
            mx.decisions.labels(*mx.l(("to_spec_" if to_spec else "to_plain_") + reason)).inc()
        if stats.num_draft_tokens:
            mx.acceptance_ratio.labels(*lv).observe(stats.num_accepted_tokens / stats.num_draft_tokens)
        timing.e2e_s = time.perf_counter() - t_start
        done = gpb.GenerateComplete(
            timing=timing, output_ids=fin.ids, text=fin.final_text, finish_reason=fin.reason,
            finish={"stop": gpb.FINISH_REASON_STOP, "length": gpb.FINISH_REASON_LENGTH,
                    "abort": gpb.FINISH_REASON_ABORT}[fin.reason],
            usage=gpb.Usage(prompt_tokens=n_prompt, completion_tokens=len(fin.ids)), speculation=stats)
        if isinstance(fin.matched, str):
            done.matched_stop_str = fin.matched
        elif fin.matched is not None:
            done.matched_token_id = fin.matched
        yield gpb.GenerateResponse(complete=done)


# ---------------------------------------------------------------------- server assembly

async def start_server(coord: Coordinator, listen: str | None = None):
    """Connects the coordinator and starts a grpc.aio server with SpecDecode, health (readiness =
    both workers answered Info) and reflection. Returns (server, bound port)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    cfg = coord.cfg
    server = grpc.aio.server(options=cfg.server_options())
    gpbg.add_SpecDecodeServicer_to_server(coord, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if cfg.reflection:
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            [gpb.DESCRIPTOR.services_by_name["SpecDecode"].full_name, reflection.SERVICE_NAME, "grpc.health.v1.Health"],
            server)
    try:
        port = server.add_insecure_port(listen or cfg.listen)
    except RuntimeError as exc:  # grpcio raises on a bind failure (address in use, bad address)
        raise RuntimeError(f"coordinator: cannot listen on {listen or cfg.listen}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"coordinator: cannot listen on {listen or cfg.listen}")
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    await hs.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    try:
        await coord.connect()
    except BaseException:  # a bad worker pair: stop what was started before raising
        await server.stop(0)
        await coord.close()
        raise
    if cfg.metrics_port:
        import prometheus_client

        try:
            coord.metrics_http, _ = prometheus_client.start_http_server(cfg.metrics_port, cfg.metrics_addr,
                                                                        registry=coord.metrics.registry)
        except OSError as exc:
            await server.stop(0)
            await coord.close()
            raise RuntimeError(f"coordinator: cannot serve metrics on {cfg.metrics_addr}:{cfg.metrics_port}: "
                               f"{exc.strerror or exc} (--metrics-port 0 turns them off)") from None
    await hs.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    coord.watch_workers(hs)
    server.health = hs
    return server, port


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What the coordinator needs from the target GGUF's tokenizer metadata."""

    tokenizer: object  # tokenizers.Tokenizer
    end_ids: tuple[int, ...]  # EOS then EOT (generation ends there unless ignore_eos)
    chat_template: str | None


def load_tokenizer(path: str) -> TokenizerInfo | None:
    """TokenizerInfo from a GGUF (``tokenizer.*`` keys), or None when the file carries no tokenizer.
    Raises TargetFileError naming the file and key when the tokenizer is unusable."""
    from specd.target_worker.gguf_loader import read_tokenizer_metadata
    from specd.target_worker.tokenizer import build_tokenizer

    meta = read_tokenizer_metadata(path)
    if meta is None:
        return None
    return TokenizerInfo(build_tokenizer(meta, path), tuple(meta.end_ids), meta.chat_template)
