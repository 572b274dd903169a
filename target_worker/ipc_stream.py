"""IPC streams: a worker's per-sequence VerifyStream / ProposeStream also served over a framed Unix socket.

Why: per speculative step the coordinator makes two worker calls, and a gRPC stream message's round
trip (0.39-0.42 ms on the H200 host, tools/bench/grpc_floor.py) is 5-7 % of a 12-16 ms step. The same
protobuf messages as length-prefixed frames on a Unix socket (a non-blocking socket on the coordinator's
event loop, a blocking socket thread here) take about a quarter of that (grpc_floor.py rows sync / ipc:
261-285 vs 68-71 us on the 2-core dev VM, BENCHMARKS.md). gRPC stays for everything else (Info,
Prefill, Commit, Release, Health) and for workers on another host.

Set-up (:class:`IpcStreamServer`, started by ``start_worker_server`` unless ``--no-ipc-streams``): a
private directory (``tempfile.mkdtemp``, mode 0700) holding ``stream.sock`` (AF_UNIX, SOCK_STREAM)
and a random 16-byte token, both published in Info (``ipc_stream_socket`` / ``ipc_stream_token``):
only a peer that may call Info over gRPC and can open the directory (same host, same user or root)
gets in. The directory is made under the temp directory (TMPDIR), or under SHORT_BASE when that path
would not fit a Unix socket address (SUN_PATH_MAX). A socket that cannot be set up at all does not stop
the worker: :func:`serve_ipc_streams` logs a warning with the reason and the worker serves without IPC
(its Info offers no socket; coordinators use gRPC streams).

Protocol, version 1 (integers little-endian):

* frame = u32 length | payload (length bytes; at most the worker's ``max_message_bytes``).
* The client's first frame is the hello (25 bytes): ``b"SPECDIS1"`` | the 16-byte token | u8 method:
  0 = probe (the worker answers ok and closes: the coordinator's reachability check at connect),
  1 = verify stream (target worker), 2 = propose stream (drafter worker); a worker accepts only its
  own method and the probe.
* The worker answers the hello with a status frame once the stream is admitted (it then holds one of
  the worker's compute slots until it ends, :meth:`ComputeSlots.stream`).
* Then each client frame is one serialized VerifyRequest / ProposeRequest, and each answer, in order,
  a status frame: u8 0 | the serialized VerifyResponse / ProposeResponse (ok), or u8 1 | u32 gRPC
  status code value | UTF-8 details (error; the worker closes the connection after it).
* The client ends the stream by half-closing (``shutdown(SHUT_WR)``): the requests already sent are
  answered (a plain run in progress runs all its steps, as after gRPC's ``done_writing``), then the
  handler returns and the worker closes the connection. A client that closes its socket entirely
  cancels the stream (a plain run in progress stops at its next step: ``context.is_active()`` sees the
  hang-up).

Semantics are the gRPC stream's (worker.proto header): each request is answered by the servicer's
``_verify`` / ``_propose`` with an :class:`IpcContext` standing in for the gRPC context (``abort``,
``is_active``), the first error ends the stream with the status the gRPC stream would have, and an
unexpected exception ends it with INTERNAL (logged). Errors of the connection itself, each ending
that connection only: a hello of the wrong length or magic -> INVALID_ARGUMENT, a wrong token ->
PERMISSION_DENIED, another worker's method -> UNIMPLEMENTED, a frame over max_message_bytes, more
connections than ``max_connections`` or a connection thread that cannot start -> RESOURCE_EXHAUSTED, an
unparsable request -> INVALID_ARGUMENT.

Bounds: at most ``max_connections`` connections (the worker's RPC thread count), each served by one
thread (kept for later connections, like gRPC's pool threads: :meth:`IpcStreamServer._worker`);
the whole hello must arrive within HELLO_TIMEOUT_S of the accept (one deadline over all its reads, so
a client trickling bytes cannot hold a connection); a write the client does not take within
WRITE_TIMEOUT_S ends the connection (SO_SNDTIMEO; a peer process that dies closes its end at once, so
this covers a live peer that stopped reading); a connection with no new request for ``idle_timeout_s``
(the workers' ``--ipc-idle-timeout-s``, default IDLE_TIMEOUT_S = gRPC keepalive's 80 s) gets a
DEADLINE_EXCEEDED error frame and is closed, which frees its compute slot and thread (SO_RCVTIMEO: the
liveness bound gRPC's keepalive gives its streams, for a coordinator that hangs without closing). The
acceptor survives a failed accept() (EMFILE, ENOBUFS: logged, retried after ACCEPT_RETRY_S); it ends
only at close().

Spin-then-block (``spin_us``, the workers' ``--ipc-spin-us``, default -1 = auto: 1000 us on a GPU, off on
the CPU, :func:`resolve_spin_us`): before the blocking
read of a stream's next request, a connection thread with nothing buffered busy-polls its socket for
up to spin_us (:class:`FrameReader`), so a request arriving meanwhile skips the thread's (and, on a
VM, the vCPU's) wake-up; then it blocks as before. The idle bound starts after the spin, so it fires
up to spin_us late. Cost: a busy core for up to spin_us per request, per open stream. With wake-ahead
(``wake_ahead``, the workers' ``--ipc-wake-ahead``, default on) a wait expected to last longer than half
the spin window first sleeps in a blocking poll until shortly before the request is due
(:class:`WakeAhead`), so the drafter's wait across a whole verify ends in a spin too, not only a short wait.

:meth:`IpcStreamServer.close` refuses new connections, gives open ones the stop's grace, cuts the
rest and removes the socket and its directory (also at interpreter exit when close was never called).
It blocks: up to JOIN_TIMEOUT_S for the acceptor thread, then ``grace_s`` plus up to JOIN_TIMEOUT_S
for the connections to leave their handlers (their threads end right after; idle ones are woken to
exit and not joined). The wrapped ``server.stop(grace)`` (:func:`serve_ipc_streams`) starts the gRPC
stop first and returns gRPC's Event, but only after this close returned, i.e. it blocks up to
``grace + 2 * JOIN_TIMEOUT_S`` where gRPC's own stop returns at once.
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import os
import queue
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
import weakref

import grpc
from google.protobuf.message import DecodeError

from specd.protos.v1 import worker_pb2 as pb

log = logging.getLogger("specd.ipc_stream")

MAGIC = b"SPECDIS1"  # "specd IPC stream", protocol version 1
TOKEN_BYTES = 16
PROBE = 0  # hello method: reachability check only
FRAME = struct.Struct("<I")  # the length prefix
STATUS = struct.Struct("<IB")  # length prefix + status byte of a status frame
ERROR = struct.Struct("<BI")  # an error frame's payload head: status 1, gRPC status code value
HELLO = struct.Struct(f"<I{len(MAGIC)}s{TOKEN_BYTES}sB")  # the hello frame: length, magic, token, method
OK_FRAME = STATUS.pack(1, 0)  # a status frame without a body: the hello's answer
HELLO_TIMEOUT_S = 10.0  # a connection's whole hello must arrive within this (it holds a connection thread meanwhile)
IDLE_TIMEOUT_S = 80.0  # default wait for a stream's next request: gRPC keepalive's bound on a silent peer
MIN_IDLE_TIMEOUT_S = 1e-3  # smallest idle_timeout_s: under 1 us SO_RCVTIMEO's timeval is 0, i.e. no bound at all
MAX_IDLE_TIMEOUT_S = 1e9  # largest (~31 years): finite, so it fits a timeval (inf would fail every stream)
ACCEPT_RETRY_S = 0.1  # pause after a failed accept() (EMFILE...): the backlog waits, the thread is kept
SUN_PATH_MAX = 107  # longest Unix socket path (Linux sun_path is 108 bytes with the NUL)
SHORT_BASE = "/tmp"  # the socket directory's base when the temp directory's path is too long for one
DIR_PREFIX = "specd-ipc-"
DISCARD_BYTES = 1 << 20  # unread input dropped before closing a connection after an error frame
WRITE_TIMEOUT_S = 20.0  # a peer that takes no data for this long is dropped (the gRPC side's keepalive ack bound)
JOIN_TIMEOUT_S = 5.0  # close(): how long connections cut off get to end their thread
JOIN_BYTES = 1 << 16  # an answer up to this size is joined with its head and sent by one sendall (larger: send_parts)
READ_BYTES = 1 << 16  # most bytes one read of a frame head takes: the small request behind it (and any pipelined) too
MAX_SPIN_US = 100_000  # largest --ipc-spin-us: a spin is a busy core, so it stays short next to any step
AUTO_SPIN_US = -1  # the workers' default --ipc-spin-us: GPU_SPIN_US on a GPU, 0 (off) on the CPU (resolve_spin_us)
GPU_SPIN_US = 1000  # a GPU worker's spin window: H200, 27B, AL 5 (BENCHMARKS.md, session of 2026-12-02 11:53 UTC)
MAX_WAKE_SLEEP_NS = 1_000_000_000  # WakeAhead's longest sleep: a stream idle longer spins at once, as without it


@dataclasses.dataclass(frozen=True)
class IpcMethod:
    """One stream method on the IPC socket: hello ``id``, the servicer attribute answering one
    request (``handler``, called as ``handler(request, context)``), the request / response classes
    and the call's name in errors."""

    id: int
    handler: str
    request: type
    response: type
    what: str


VERIFY_STREAM = IpcMethod(1, "_verify", pb.VerifyRequest, pb.VerifyResponse, "verify")
PROPOSE_STREAM = IpcMethod(2, "_propose", pb.ProposeRequest, pb.ProposeResponse, "propose")
CODES = {c.value[0]: c for c in grpc.StatusCode}  # wire value -> grpc.StatusCode


def hello_frame(token: bytes, method: int) -> bytes:
    """The client's hello frame for ``method`` (PROBE or an IpcMethod id)."""
    return HELLO.pack(HELLO.size - FRAME.size, MAGIC, token, method)


def error_frame(code: grpc.StatusCode, details: str) -> bytes:
    """A status frame carrying an error: ``code`` and UTF-8 ``details``."""
    text = details.encode("utf-8", "replace")
    return FRAME.pack(ERROR.size + len(text)) + ERROR.pack(1, code.value[0]) + text


def parse_error(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """(code, details) of an error frame's payload after its status byte; UNKNOWN for a code this
    grpc does not know, INTERNAL for a payload too short to hold one."""
    if len(payload) < ERROR.size - 1:
        return grpc.StatusCode.INTERNAL, f"malformed IPC error frame ({len(payload)} bytes)"
    (value,) = FRAME.unpack_from(payload)
    return CODES.get(value, grpc.StatusCode.UNKNOWN), bytes(payload[FRAME.size:]).decode("utf-8", "replace")


class IpcAbort(Exception):
    """Raised by :meth:`IpcContext.abort`: ends the stream with ``code`` / ``details``. Not a
    ValueError / RuntimeError, so the handlers' own ``except`` clauses let it through, as they do
    grpc's abort exception."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class IpcContext:
    """What the stream handlers use of a ``grpc.ServicerContext``, for one IPC connection."""

    __slots__ = ("sock", "poller")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)  # POLLHUP / POLLERR are always reported

    def abort(self, code: grpc.StatusCode, details: str):
        """Ends the stream with ``code`` / ``details`` (raises IpcAbort, like grpc's abort)."""
        raise IpcAbort(code, details)

    def is_active(self) -> bool:
        """False once the client closed its socket (cancel) or the connection broke: POLLHUP /
        POLLERR. A half-close (SHUT_WR, the stream's normal end) is only EOF to read, with no hang-up:
        the stream stays active and the requests already sent run to their end, as after gRPC's
        done_writing. One poll(0) system call."""
        events = self.poller.poll(0)
        return not events or not events[0][1] & (select.POLLHUP | select.POLLERR)


def poll_until(poll, end_ns: int) -> bool:
    """Busy-polls ``poll`` (a select.poll object's poll method, one socket registered for POLLIN) with
    timeout 0 until it reports input or a hang-up (True) or time.monotonic_ns() reaches ``end_ns``
    (False). It polls at least once, so a thread that resumes after ``end_ns`` (a loaded machine) still
    takes a frame that is already there. The spin of the workers (FrameReader.spin) and of the
    coordinator (IpcStream._spin).

    Between polls the thread yields its CPU: Linux places a task woken by a Unix-socket write on the
    writer's CPU when it can (a "sync" wake-up: the writer is expected to sleep), so the peer this
    thread just woke with its request or answer may be queued behind the spin; sched_yield lets it
    run now (a no-op when nothing else is runnable here)."""
    clock, pause = time.monotonic_ns, os.sched_yield
    while not poll(0):
        if clock() >= end_ns:
            return False
        pause()
    return True


class WakeAhead:
    """When a stream's waiter should start busy-polling for its next frame: hybrid polling (sleep, then
    spin), as Linux's NVMe driver sleeps through most of an I/O's expected time before it polls.

    Why: a spin right after a request or answer catches only frames due within the spin window. A longer
    wait (the coordinator's for a 10 ms verify; a drafter's for the next Propose, across a whole verify)
    still ends in a blocked thread's wake-up, ~0.15 ms on the H200 host (a hypervisor round trip). One
    stream's waits repeat closely from step to step, so the shortest of its last DEPTH waits predicts the
    next one from below: the waiter sleeps until half a spin window before that (in a blocking wait that
    the frame itself still ends, with the usual wake-up, when it comes earlier), then spins for the window.

    Cost: the same busy core as the spin, once per wait, for about half a window plus how late the frame
    is against the prediction; a prediction off by more than the window costs the window and no more.

    Args:
        window_ns: the spin window (the process's ``ipc_spin_us``, in nanoseconds), > 0.
    """

    DEPTH = 8  # waits remembered
    MIN_WAITS = 3  # waits seen before any sleep: the first after a stream opens is not a step's

    __slots__ = ("window_ns", "waits")

    def __init__(self, window_ns: int):
        if window_ns <= 0:
            raise ValueError(f"WakeAhead: the spin window must be > 0 ns, got {window_ns}")
        self.window_ns = int(window_ns)
        self.waits: collections.deque[int] = collections.deque(maxlen=self.DEPTH)

    def record(self, waited_ns: int) -> None:
        """Adds one wait: nanoseconds from the waiter's start to its frame (with any wake-up in it)."""
        self.waits.append(max(0, int(waited_ns)))

    def sleep_ns(self) -> int:
        """Nanoseconds the next wait sleeps before it spins: the shortest recent wait less half a window;
        0 (spin at once) before MIN_WAITS waits, when that is not positive, or when it exceeds
        MAX_WAKE_SLEEP_NS (an idle stream: no spin is worth planning)."""
        if len(self.waits) < self.MIN_WAITS:
            return 0
        sleep = min(self.waits) - self.window_ns // 2
        return sleep if 0 < sleep <= MAX_WAKE_SLEEP_NS else 0


class FrameReader:
    """Reads one connection's request frames from its blocking socket through its own buffer, and
    busy-polls for the next one before blocking (``spin_us``).

    Why its own buffer and not ``sock.makefile("rb")``: the spin must know whether the next request
    is already here (pipelined behind the last one) without a system call, and a BufferedReader cannot
    tell how much it holds without ``peek``, which blocks on an empty buffer.

    Why a spin: a worker thread blocked in recv sleeps, and on a VM its idle vCPU halts; the wake-up
    when the request comes costs ~0.15 ms on the H200 host (a hypervisor round trip), per request.
    Polling the socket without blocking for up to ``spin_us`` first keeps the thread (and vCPU)
    running, so a request arriving within the spin is read at once. The cost is a busy core for up to
    ``spin_us`` per wait; each poll is one system call that releases the GIL, so the worker's other
    threads (gRPC, the idle reaper, other connections) still run.

    Args:
        sock: the connection (blocking; SO_RCVTIMEO, when set, bounds each read's wait: the idle bound).
        spin_us: most microseconds :meth:`spin` polls, 0 (off) .. MAX_SPIN_US.
        wake_ahead: with spin_us > 0, a wait predicted to outlast the spin sleeps first (:class:`WakeAhead`,
            fed by :meth:`arrived`).
    """

    __slots__ = ("sock", "buf", "spin_ns", "poll", "ahead", "wait_from")

    def __init__(self, sock: socket.socket, spin_us: int = 0, wake_ahead: bool = True):
        self.sock = sock
        self.buf = bytearray()  # bytes received beyond the frames read so far
        self.spin_ns = int(spin_us) * 1000
        self.poll = None
        self.ahead = WakeAhead(self.spin_ns) if self.spin_ns and wake_ahead else None
        self.wait_from = 0  # time.monotonic_ns() at which the current wait began (0: none being timed)
        if self.spin_ns:
            poller = select.poll()
            poller.register(sock, select.POLLIN)  # POLLHUP / POLLERR are always reported: they end a spin too
            self.poll = poller.poll

    def spin(self) -> bool:
        """Polls the socket without blocking until it has input (or a hang-up) or ``spin_us`` passed;
        returns at once when a byte is already buffered or spinning is off. With wake-ahead it first
        sleeps in a blocking poll (whole milliseconds) for :meth:`WakeAhead.sleep_ns`, then spins until
        a window after that. True when input is ready (the next read does not block), False otherwise.
        At most spin_us (plus the sleep's sub-millisecond rest) of busy CPU."""
        if self.buf or not self.spin_ns:
            return bool(self.buf)
        start = time.monotonic_ns()
        sleep = 0
        if self.ahead is not None:
            self.wait_from = start
            sleep = self.ahead.sleep_ns()
            if sleep >= 1_000_000 and self.poll(sleep // 1_000_000):
                return True
        return poll_until(self.poll, start + sleep + self.spin_ns)

    def arrived(self) -> None:
        """Tells the wake-ahead that the frame the last :meth:`spin` waited for has begun to arrive
        (call after reading its head): records the wait. No-op without wake-ahead or a timed wait."""
        if self.wait_from:
            self.ahead.record(time.monotonic_ns() - self.wait_from)
            self.wait_from = 0

    def read(self, n: int) -> bytes | bytearray | None:
        """Exactly ``n`` bytes (n >= 0; bytes, or a bytearray for a frame read past the buffer); fewer
        at EOF, or when the socket's SO_RCVTIMEO passed after some of them; None when it passed with
        none (the idle bound: EAGAIN). A read that finds fewer than ``n`` bytes buffered reads ahead
        (up to READ_BYTES) when the missing part is small, else straight into the result (one copy of
        a large frame). OSError when the connection fails."""
        buf = self.buf
        have = len(buf)
        if have >= n:
            out = bytes(buf[:n])
            del buf[:n]  # bytearray drops its head in O(1)
            return out
        if n - have < READ_BYTES:
            while len(buf) < n:
                try:
                    data = self.sock.recv(READ_BYTES)
                except BlockingIOError:  # SO_RCVTIMEO passed
                    data = None
                if not data:  # EOF or the idle bound: what there is
                    out, got = bytes(buf), len(buf)
                    buf.clear()
                    return None if data is None and not got else out
                buf += data
            out = bytes(buf[:n])
            del buf[:n]
            return out
        out = bytearray(n)
        view = memoryview(out)
        view[:have] = buf
        buf.clear()
        got = have
        with view:
            while got < n:
                try:
                    k = self.sock.recv_into(view[got:])
                except BlockingIOError:  # SO_RCVTIMEO passed
                    k = -1
                if k <= 0:
                    return None if k < 0 and not got else bytes(view[:got])
                got += k
        return out


class IpcStreamServer:
    """Serves ``method`` of ``servicer`` on a new private Unix socket (module docstring).

    Args:
        servicer: the worker's servicer: ``servicer.slots`` (:class:`ComputeSlots`) admits each
            connection, ``getattr(servicer, method.handler)`` answers its requests (both looked up
            per connection, as the gRPC stream handlers do). The first server started for a servicer
            is published as ``servicer.ipc_stream`` (Info offers it) until it closes.
        method: VERIFY_STREAM or PROPOSE_STREAM.
        name: the worker's name in logs and errors ("target-worker").
        max_message_bytes: largest request frame accepted and response sent (> 0).
        max_connections: connections at once, more are refused with RESOURCE_EXHAUSTED (> 0).
        idle_timeout_s: a stream with no new request for this long is closed (> 0; module docstring).
        spin_us: before blocking for a stream's next request, busy-poll its socket for up to this many
            microseconds (0 = off, at most MAX_SPIN_US; :class:`FrameReader`).
        wake_ahead: with spin_us > 0, a wait predicted to outlast the spin sleeps first (:class:`WakeAhead`).

    Raises RuntimeError naming the reason when the socket cannot be created (no directory is left),
    ValueError for a spin_us out of range.
    """

    def __init__(self, servicer, method: IpcMethod, name: str, max_message_bytes: int, max_connections: int,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, spin_us: int = 0, wake_ahead: bool = True):
        check_spin_us(spin_us, name)
        self.servicer, self.method, self.name = servicer, method, name
        self.max_message_bytes, self.max_connections = max_message_bytes, max_connections
        self.idle_timeout_s, self.spin_us, self.wake_ahead = idle_timeout_s, spin_us, bool(wake_ahead)
        self.dir = _socket_dir(name)  # mode 0700: only this user (and root) reach the socket
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)  # also at exit
        self.path = os.path.join(self.dir, "stream.sock")
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a connection ends
        self.conns: set[socket.socket] = set()
        self.connections = 0  # connections accepted so far (probes included)
        self.idle = 0  # connection threads waiting for their next connection on ``pending``
        self.pending: queue.SimpleQueue = queue.SimpleQueue()  # at most ``idle`` entries; None = exit
        self.closed = False
        try:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # EMFILE...
            self._remove_dir()
            raise RuntimeError(f"{name}: cannot create the IPC stream socket: {exc}") from None
        try:
            self.listener.bind(self.path)
            self.listener.listen(max(16, max_connections))
        except OSError as exc:
            self.listener.close()
            self._remove_dir()
            raise RuntimeError(f"{name}: cannot listen on the IPC stream socket {self.path}: {exc}") from None
        self.acceptor = threading.Thread(target=self._accept_loop, name=f"specd-ipc-accept-{method.what}",
                                         daemon=True)
        self.acceptor.start()
        if getattr(servicer, "ipc_stream", None) is None:
            servicer.ipc_stream = self

    def _accept_loop(self) -> None:
        """Accepts until close(). A failed accept() while open (EMFILE, ENOBUFS, ECONNABORTED) is
        transient: returning would leave the socket bound with nobody accepting, and new connections
        would hang in the backlog; so it is logged (once per run of failures) and retried."""
        failing = False
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                if self.closed:  # close() shut the listener down
                    return
                if not failing:
                    log.warning("%s: accept on the IPC stream socket failed (%s); retrying every %.1f s",
                                self.name, exc, ACCEPT_RETRY_S)
                failing = True
                time.sleep(ACCEPT_RETRY_S)
                continue
            failing = False
            with self.lock:
                admitted = not self.closed and len(self.conns) < self.max_connections
                if admitted:
                    self.conns.add(conn)
                    self.connections += 1
            if not admitted:
                if self.closed:
                    _refuse(conn, grpc.StatusCode.UNAVAILABLE, f"{self.name}: stopping")
                else:
                    _refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name}: all "
                            f"{self.max_connections} IPC stream connections are taken")
                continue
            self._dispatch(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        """Hands an admitted connection to an idle connection thread, or to a new one. A thread that
        cannot start (RuntimeError: the process's thread or memory limit) refuses only this connection
        with RESOURCE_EXHAUSTED and gives its place back: raised here, it would end the acceptor (new
        connections would hang in the backlog) and leave the connection counted and open."""
        with self.lock:
            reuse = self.idle > 0
            if reuse:
                self.idle -= 1
        if reuse:
            self.pending.put(conn)
            return
        try:
            threading.Thread(target=self._worker, args=(conn,), name=f"specd-ipc-{self.method.what}",
                             daemon=True).start()
        except RuntimeError as exc:
            log.warning("%s: cannot start an IPC stream connection thread (%s); connection refused", self.name, exc)
            with self.lock:
                self.conns.discard(conn)
                self.changed.notify_all()
            _refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name}: cannot start an IPC stream connection "
                                                              f"thread: {exc}")

    def _worker(self, conn: socket.socket | None) -> None:
        """A connection thread: serves one connection after another until close(). Kept between
        connections, as gRPC's thread pool keeps its threads: a new thread per sequence would build the
        native library's per-thread state again (on the CPU an OpenMP thread team, whose churn cost the
        steps of the demo benchmark up to twice their time). At most max_connections threads exist."""
        while conn is not None:
            self._serve(conn)
            with self.lock:  # one step: close() shuts connections down under the lock, never a closed one
                self.conns.discard(conn)
                conn.close()  # the client sees EOF only once this thread counts as idle
                self.changed.notify_all()
                if self.closed:
                    return
                self.idle += 1
            conn = self.pending.get()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: hello, then the stream (module docstring); always frees its slot (the
        caller closes the connection)."""
        responses = None
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(WRITE_TIMEOUT_S))
            method = self._hello(conn, time.monotonic() + HELLO_TIMEOUT_S)
            conn.settimeout(None)  # blocking again: writes are bounded by SO_SNDTIMEO
            if method == PROBE:
                conn.sendall(OK_FRAME)
                return
            # A read waiting longer than idle_timeout_s fails with EAGAIN (the reader returns None /
            # a short read): the coordinator is gone or hung (module docstring).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.idle_timeout_s))
            ctx = IpcContext(conn)
            responses = self.servicer.slots.stream(ctx, getattr(self.servicer, self.method.handler),
                                                   self._requests(conn, FrameReader(conn, self.spin_us,
                                                                                       self.wake_ahead)))
            for resp in responses:
                body = resp.SerializeToString()
                if len(body) > self.max_message_bytes:  # as gRPC's max_send_message_length
                    raise IpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name}: response of {len(body)} "
                                                                       f"bytes exceeds max_message_bytes "
                                                                       f"{self.max_message_bytes}")
                if len(body) <= JOIN_BYTES:  # the common answer: one joined frame, one C-level sendall
                    conn.sendall(STATUS.pack(len(body) + 1, 0) + body)
                else:
                    send_parts(conn, (STATUS.pack(len(body) + 1, 0), body))
        except IpcAbort as exc:
            _send_quietly(conn, error_frame(exc.code, exc.details))
            _discard_input(conn)
        except OSError as exc:  # the client went away, or stopped reading for WRITE_TIMEOUT_S
            log.debug("%s: IPC %s stream ended: %s", self.name, self.method.what, exc)
        except Exception as exc:  # noqa: BLE001 - a handler bug: INTERNAL to the client, logged here
            log.exception("%s: IPC %s stream failed", self.name, self.method.what)
            _send_quietly(conn, error_frame(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            if responses is not None:
                responses.close()  # a stream suspended at its yield gives its compute slot back

    def _frame_length(self, reader: FrameReader, what: str) -> int | None:
        """The next frame's length, or None at a clean end of stream; IpcAbort when it exceeds
        max_message_bytes, or with DEADLINE_EXCEEDED when no frame started within idle_timeout_s."""
        head = reader.read(FRAME.size)
        if head is None:  # the SO_RCVTIMEO idle bound passed with nothing read (EAGAIN)
            raise IpcAbort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name}: no {what} for {self.idle_timeout_s} s "
                                                              "(--ipc-idle-timeout-s); the IPC stream is closed")
        return None if len(head) < FRAME.size else self._check_length(FRAME.unpack(head)[0], what)

    def _check_length(self, n: int, what: str) -> int:
        if n > self.max_message_bytes:
            raise IpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{self.name}: {what} frame of {n} bytes exceeds max_message_bytes {self.max_message_bytes}")
        return n

    def _hello(self, conn: socket.socket, deadline: float) -> int:
        """Reads and checks the hello (all of it by ``deadline``, time.monotonic()); returns its method
        (PROBE or this server's). IpcAbort on a bad one, OSError (socket.timeout) when it does not
        come in time. Read from the socket itself, exactly its bytes, so the stream's buffered reader
        starts at the first request."""
        head = _recv_by(conn, FRAME.size, deadline)
        if len(head) < FRAME.size:
            raise OSError("closed before its hello")
        n = self._check_length(FRAME.unpack(head)[0], "hello")
        want = HELLO.size - FRAME.size
        if n != want:
            raise IpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: IPC hello of {n} bytes, expected {want}")
        data = _recv_by(conn, n, deadline)
        if len(data) < n:
            raise OSError("closed inside its hello")
        _, magic, token, method = HELLO.unpack(FRAME.pack(n) + data)
        if magic != MAGIC:
            raise IpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: bad IPC hello magic {magic!r}, expected "
                                                             f"{MAGIC!r}")
        if not hmac.compare_digest(token, self.token):
            raise IpcAbort(grpc.StatusCode.PERMISSION_DENIED, f"{self.name}: wrong IPC stream token")
        if method not in (PROBE, self.method.id):
            raise IpcAbort(grpc.StatusCode.UNIMPLEMENTED,
                           f"{self.name}: IPC method {method} not served here (this socket serves {self.method.id}, "
                           f"the {self.method.what} stream)")
        return method

    def _requests(self, conn: socket.socket, reader: FrameReader):
        """The stream's requests. Its first step runs once ComputeSlots admitted the stream: it answers
        the hello then. Ends at the client's half-close (or a close mid-frame: the client is gone).
        Before each request it spins (``spin_us``, :meth:`FrameReader.spin`, with its wake-ahead sleep)
        unless one is buffered, then blocks as before: the idle bound counts from the spin's end (at most
        spin_us plus the sleep, itself at most MAX_WAKE_SLEEP_NS, later)."""
        conn.sendall(OK_FRAME)
        parse = self.method.request.FromString
        while True:
            reader.spin()
            n = self._frame_length(reader, "request")
            if n is None:
                return
            reader.arrived()
            data = reader.read(n)
            if data is None or len(data) < n:  # closed mid-frame, or stalled there for idle_timeout_s
                return
            try:
                request = parse(data)
            except DecodeError as exc:
                raise IpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{self.name}: request frame of {n} bytes is not a "
                               f"{self.method.request.DESCRIPTOR.name}: {exc}") from None
            yield request

    def close(self, grace_s: float = 0.0) -> None:
        """Stops accepting (waits at most JOIN_TIMEOUT_S for the acceptor thread), lets open
        connections end on their own for ``grace_s`` seconds, shuts the others down, waits at most
        JOIN_TIMEOUT_S more for them to leave their handlers (their threads exit right after; idle
        threads are woken to exit, not joined) and removes the socket and its directory. Blocks up to
        grace_s + 2 * JOIN_TIMEOUT_S. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux)
        except OSError:
            pass
        self.acceptor.join(JOIN_TIMEOUT_S)
        self.listener.close()
        with self.lock:  # no dispatch any more: wake the idle connection threads to exit
            idle, self.idle = self.idle, 0
        for _ in range(idle):
            self.pending.put(None)
        if getattr(self.servicer, "ipc_stream", None) is self:
            self.servicer.ipc_stream = None
        with self.lock:
            self.changed.wait_for(lambda: not self.conns, timeout=grace_s)
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)  # its blocked read returns EOF, its writes fail
                except OSError:
                    pass
            if not self.changed.wait_for(lambda: not self.conns, timeout=JOIN_TIMEOUT_S):
                log.warning("%s: %d IPC stream connection(s) still in a handler after %.0f s", self.name,
                            len(self.conns), JOIN_TIMEOUT_S)
        self._remove_dir()


def check_spin_us(value, who: str, field: str = "ipc_spin_us", auto: bool = False) -> None:
    """ValueError unless ``value`` (the spin field ``field`` of ``who``'s config) is an int in 0..MAX_SPIN_US,
    or AUTO_SPIN_US where ``auto`` (a worker's field)."""
    valid = isinstance(value, int) and not isinstance(value, bool) and (
        0 <= value <= MAX_SPIN_US or (auto and value == AUTO_SPIN_US))
    if not valid:
        also = f" or {AUTO_SPIN_US} (auto)" if auto else ""
        raise ValueError(f"{who}: {field} must be an integer in 0..{MAX_SPIN_US} (microseconds){also}, got {value!r}")


def resolve_spin_us(value: int, device: str) -> int:
    """A worker's spin window in microseconds: ``value``, or for AUTO_SPIN_US GPU_SPIN_US when the worker
    computes on a GPU (``device`` "cuda": its host cores idle during the compute, so a spin costs no compute)
    and 0 on the CPU (a spinning thread would take a core from the compute: +27 % loop overhead on the
    2-core VM, BENCHMARKS.md, session of 2026-12-02 06:00 UTC)."""
    if value != AUTO_SPIN_US:
        return value
    return GPU_SPIN_US if device == "cuda" else 0


def _timeval(seconds: float) -> bytes:
    """A struct timeval for SO_SNDTIMEO / SO_RCVTIMEO."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _recv_by(conn: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes from ``conn`` (fewer at EOF), all by ``deadline`` (time.monotonic()):
    the time left is set before each recv, so a peer sending a byte at a time cannot stretch it.
    socket.timeout once it passes."""
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"no complete hello within {HELLO_TIMEOUT_S} s")
        conn.settimeout(left)
        chunk = conn.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def send_parts(conn: socket.socket, parts) -> None:
    """sendall of the concatenation of ``parts`` without building it (one copy of a large answer
    less): sendmsg gathers them; a partial send goes on from where it stopped. Raises OSError like
    sendall (SO_SNDTIMEO's EAGAIN included)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        sent = conn.sendmsg(views)
        if sent <= 0:  # a blocking stream socket sends something or raises: never loop without progress
            raise OSError("sendmsg sent nothing")
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _socket_dir(name: str) -> str:
    """A new private directory for the socket: under the temp directory, or under SHORT_BASE when the
    socket path there would exceed SUN_PATH_MAX (a long TMPDIR). RuntimeError naming the reason when
    neither works (the caller serves without IPC)."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, DIR_PREFIX + "x" * 8, "stream.sock")) > SUN_PATH_MAX:  # mkdtemp adds 8 chars
        base = SHORT_BASE
    try:
        return tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base)
    except OSError as exc:
        raise RuntimeError(f"{name}: cannot create the IPC stream socket's directory under {base}: {exc}") from None


def _discard_input(conn: socket.socket) -> None:
    """Reads (at most DISCARD_BYTES of) what the client sent and nobody will read, without waiting: a
    Unix socket closed with unread input resets the connection, and the client would get ECONNRESET
    instead of the error frame's clean end."""
    try:
        conn.setblocking(False)
        for _ in range(DISCARD_BYTES >> 16):
            if not conn.recv(1 << 16):
                return
    except OSError:  # nothing more pending (BlockingIOError), or the client is gone
        pass


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    """Sends a last frame to a connection that is about to be closed (the peer may be gone)."""
    try:
        conn.sendall(data)
    except OSError:
        pass


def _refuse(conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
    """Ends a connection the acceptor will not serve: its error frame (best effort), then the close."""
    _send_quietly(conn, error_frame(code, details))
    conn.close()


def ipc_info(servicer) -> dict:
    """The Info fields offering ``servicer``'s IPC stream socket (none when it has no open one)."""
    ipc = getattr(servicer, "ipc_stream", None)
    return {} if ipc is None else {"ipc_stream_socket": ipc.path, "ipc_stream_token": ipc.token}


def ipc_path(server) -> str:
    """The IPC stream socket of a worker's grpc.Server for logs ("off" without one)."""
    ipc = getattr(server, "ipc_stream", None)
    return "off" if ipc is None else ipc.path


def serve_ipc_streams(server, servicer, method: IpcMethod, name: str, max_message_bytes: int,
                      max_connections: int, idle_timeout_s: float = IDLE_TIMEOUT_S,
                      spin_us: int = 0, wake_ahead: bool = True) -> IpcStreamServer | None:
    """Starts an :class:`IpcStreamServer` for ``servicer`` beside the grpc.Server ``server`` and ties its
    life to it: ``server.stop(grace)`` also closes it (after starting the gRPC stop, so both drain at
    once), on every path that stops the server (serve_forever's SIGTERM, tests). The wrapped stop
    blocks until the IPC side is closed (up to grace + 2 * JOIN_TIMEOUT_S, :meth:`IpcStreamServer.close`)
    and then returns gRPC's Event. Returns the IpcStreamServer, or None when the socket cannot be set
    up: IPC is an optimisation on by default, so a warning names the reason and the worker serves
    its streams over gRPC only (Info offers no socket). ``spin_us``, ``wake_ahead``: :class:`IpcStreamServer`
    (ValueError for a spin_us out of range)."""
    try:
        ipc = IpcStreamServer(servicer, method, name, max_message_bytes, max_connections, idle_timeout_s, spin_us,
                              wake_ahead)
    except RuntimeError as exc:
        log.warning("%s: serving without an IPC stream socket (streams over gRPC only): %s", name, exc)
        return None
    grpc_stop = server.stop

    def stop(grace=None):
        done = grpc_stop(grace)
        ipc.close(grace or 0.0)
        return done

    server.stop = stop
    server.ipc_stream = ipc
    return ipc
