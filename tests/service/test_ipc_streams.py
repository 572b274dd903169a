"""IPC streams (specd.target_worker.ipc_stream): the workers' VerifyStream / ProposeStream on a framed
Unix socket and the coordinator's IpcStream client. The stream semantics shared with the gRPC streams
(exactness, one stream per sequence, deadlines, errors mid-stream, cancel) are parametrized over both
transports in test_streams.py; here: the socket protocol (hello, error frames, bad input), the worker's
bounds and clean-up, the coordinator's transport choice and fallback, and the flags."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import struct
import threading
import time
import types

import grpc
import pytest

from specd.coordinator.policy import PolicyConfig
from specd.draft_worker import server as dserver
from specd.draft_worker.scripted import ScriptedDrafter
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg
from specd.target_worker import ipc_stream
from specd.target_worker import server as tserver
from specd.target_worker.ipc_stream import (FRAME, MAGIC, PROBE, PROPOSE_STREAM, VERIFY_STREAM, IpcStreamServer,
                                            hello_frame, parse_error)

from .conftest import generate, streamed_ids, token_request
from .test_serving import wait_released
from .test_streams import _wait_slots_free


def _connect(ipc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(ipc.path)
    return s


def _frame(data: bytes) -> bytes:
    return FRAME.pack(len(data)) + data


def _read_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def fake_worker(tmp_path, serve):
    """A fake worker's IPC socket at tmp_path / "w.sock" that accepts one connection, answers its hello
    with OK and runs serve(conn) on a daemon thread (an OSError, the client gone, ends it quietly).
    Returns (path, the listening socket: the test closes it)."""
    path = str(tmp_path / "w.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(1)

    def run():
        c, _ = lsock.accept()
        with c:
            try:
                _read_exact(c, FRAME.size + 25)
                c.sendall(ipc_stream.OK_FRAME)
                serve(c)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()
    return path, lsock


def _answer(s: socket.socket):
    """One status frame: ("ok", body bytes) or (grpc.StatusCode, details)."""
    (n,) = FRAME.unpack(_read_exact(s, FRAME.size))
    payload = _read_exact(s, n)
    return ("ok", payload[1:]) if payload[0] == 0 else parse_error(payload[1:])


def _closed(s: socket.socket) -> bool:
    return s.recv(1) == b""


def _hello(ipc, method: int, token: bytes | None = None):
    s = _connect(ipc)
    s.sendall(hello_frame(ipc.token if token is None else token, method))
    return s, _answer(s)


def _verify_unknown_sequence_answers_not_found(ipc) -> None:
    """A full verify stream on ``ipc``: admitted, one request, the worker's NOT_FOUND, closed."""
    s, ans = _hello(ipc, VERIFY_STREAM.id)
    with s:
        assert ans == ("ok", b"")
        s.sendall(_frame(wpb.VerifyRequest(seq_id="no-such-seq", tokens=[1]).SerializeToString()))
        code, details = _answer(s)
        assert code == grpc.StatusCode.NOT_FOUND and "no-such-seq" in details
        assert _closed(s)


def _round_trip(ipc, token: int) -> None:
    """A whole stream to a _Servicer: hello, one request answered ok (``token`` echoed), half-close,
    the worker closes."""
    s, ans = _hello(ipc, VERIFY_STREAM.id)
    with s:
        assert ans == ("ok", b"")
        s.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[token]).SerializeToString()))
        code, body = _answer(s)
        assert code == "ok" and list(wpb.VerifyResponse.FromString(body).emitted) == [token]
        s.shutdown(socket.SHUT_WR)
        assert _closed(s)


def test_info_offers_a_private_socket_and_a_random_token(stack):
    """Both workers offer their IPC stream socket in Info: in a 0700 directory of its own, with a
    16-byte token (different per worker); a probe hello is answered ok and closed."""
    t = wpbg.TargetWorkerStub(grpc.insecure_channel(f"unix://{stack.dir}/t.sock")).Info(wpb.InfoRequest(), timeout=10)
    d = wpbg.DraftWorkerStub(grpc.insecure_channel(f"unix://{stack.dir}/d.sock")).Info(wpb.InfoRequest(), timeout=10)
    for info, ipc in ((t, stack.tservicer.ipc_stream), (d, stack.dservicer.ipc_stream)):
        assert info.ipc_stream_socket == ipc.path and info.ipc_stream_token == ipc.token and len(ipc.token) == 16
        assert stat.S_ISSOCK(os.stat(ipc.path).st_mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(ipc.path)).st_mode) == 0o700
        s, ans = _hello(ipc, PROBE)
        with s:
            assert ans == ("ok", b"") and _closed(s)
    assert t.ipc_stream_token != d.ipc_stream_token


def test_worker_error_on_the_socket_maps_like_the_grpc_stream(stack):
    """A Verify of a sequence the target does not know: NOT_FOUND in an error frame, as the gRPC
    stream's status (test_streams.test_stream_worker_error_maps_like_the_unary_call); the connection
    closes and its slot is free."""
    _verify_unknown_sequence_answers_not_found(stack.tservicer.ipc_stream)
    _wait_slots_free(stack)


BAD_INPUT = {  # name -> (bytes sent after connecting (None: a good hello), then a request frame, code, words)
    "magic": (FRAME.pack(25) + b"HTTP/1.1" + bytes(17), None, grpc.StatusCode.INVALID_ARGUMENT, "magic"),
    "token": ("bad-token", None, grpc.StatusCode.PERMISSION_DENIED, "token"),
    "method": ("propose", None, grpc.StatusCode.UNIMPLEMENTED, "method 2"),
    "hello length": (FRAME.pack(7) + b"SPECDIS", None, grpc.StatusCode.INVALID_ARGUMENT, "hello of 7 bytes"),
    "oversized hello": (FRAME.pack(0xFFFFFFFF), None, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_message_bytes"),
    "oversized request": (None, FRAME.pack(0xFFFFFFF0), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_message_bytes"),
    "garbage protobuf": (None, _frame(b"\xff\xff\xff\xff\x0f"), grpc.StatusCode.INVALID_ARGUMENT,
                         "not a VerifyRequest"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gets_a_clear_error_and_only_that_connection_ends(stack, case):
    """Wrong magic, token or method, a bad or oversized length, unparsable protobuf: an error frame
    naming what was wrong, the connection closed, its slot free; an open stream alongside and new
    connections are served as before."""
    ipc = stack.tservicer.ipc_stream
    hello, request, code, words = BAD_INPUT[case]
    other, ans = _hello(ipc, VERIFY_STREAM.id)  # a stream alongside, admitted before
    assert ans == ("ok", b"")
    with other, _connect(ipc) as s:
        if hello is None:
            s.sendall(hello_frame(ipc.token, VERIFY_STREAM.id))
            assert _answer(s) == ("ok", b"")
        else:
            s.sendall({"bad-token": hello_frame(bytes(16), VERIFY_STREAM.id),
                       "propose": hello_frame(ipc.token, PROPOSE_STREAM.id)}.get(hello, hello))
        if request is not None:
            s.sendall(request)
        got, details = _answer(s)
        assert got == code and words in details and details.startswith("target-worker: "), details
        assert _closed(s)
        other.sendall(_frame(wpb.VerifyRequest(seq_id="still-served", tokens=[1]).SerializeToString()))
        assert _answer(other)[0] == grpc.StatusCode.NOT_FOUND
    _verify_unknown_sequence_answers_not_found(ipc)
    _wait_slots_free(stack)


def test_a_vanished_client_frees_its_slot(stack):
    """A client whose socket closes while its stream waits for the next request (process gone: the
    kernel closes its end): the worker's handler ends and gives the compute slot back."""
    _wait_slots_free(stack)
    s, ans = _hello(stack.dservicer.ipc_stream, PROPOSE_STREAM.id)
    assert ans == ("ok", b"")
    slots = stack.dservicer.slots
    assert slots.n - slots.sem._value == 1  # admitted: the stream holds a slot
    s.close()
    _wait_slots_free(stack)


class _Servicer:
    """A stand-in servicer: ComputeSlots and a verify handler answering ``answer`` (or blocking on
    ``gate`` first)."""

    def __init__(self, slots=2, answer=None, gate=None):
        self.slots, self.answer, self.gate, self.ipc_stream = tserver.ComputeSlots(slots), answer, gate, None

    def _verify(self, request, context):
        if self.gate is not None:
            self.gate.wait(10)
        return self.answer or wpb.VerifyResponse(accepted=0, emitted=[int(request.tokens[0])])


def test_a_client_that_stops_reading_is_dropped_after_the_write_bound(monkeypatch):
    """A live client that sends requests but stops reading the answers (the socket buffer fills):
    the worker's blocked write gives up after WRITE_TIMEOUT_S, ends the stream and frees its slot."""
    monkeypatch.setattr(ipc_stream, "WRITE_TIMEOUT_S", 1)
    big = wpb.VerifyResponse(argmax=list(range(1 << 20)))  # ~3.5 MB: more than the socket buffers hold
    sv = _Servicer(answer=big)
    ipc = IpcStreamServer(sv, VERIFY_STREAM, "test-worker", 16 << 20, 4)
    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        assert ans == ("ok", b"")
        s.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[1]).SerializeToString()))
        time.sleep(0.2)
        assert sv.slots.sem._value == 1  # the handler is blocked in its write
        end = time.monotonic() + 10
        while sv.slots.sem._value != 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert sv.slots.sem._value == 2 and not ipc.conns
        s.close()
    finally:
        ipc.close()


def test_connections_beyond_the_limit_are_refused_and_refused_slots_keep_the_grpc_message():
    """At most max_connections connections (RESOURCE_EXHAUSTED beyond); a stream the compute slots
    refuse gets ComputeSlots' RESOURCE_EXHAUSTED message, as on the gRPC stream."""
    ipc = IpcStreamServer(_Servicer(slots=1), VERIFY_STREAM, "test-worker", 1 << 20, 2)
    try:
        first, ans = _hello(ipc, VERIFY_STREAM.id)
        assert ans == ("ok", b"")
        second, ans = _hello(ipc, VERIFY_STREAM.id)  # a connection, but no compute slot
        assert ans[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "compute slots are taken" in ans[1]
        assert _closed(second)
        third = _connect(ipc)
        other = _connect(ipc)  # two connections open: the third is refused at once
        code, details = _answer(other)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "all 2 IPC stream connections are taken" in details
        for s in (first, second, third, other):
            s.close()
    finally:
        ipc.close()


def test_close_drains_for_the_grace_then_cuts_joins_and_removes_the_socket_and_directory():
    """close(grace): new connections are refused; open streams may go on for the grace (as gRPC's
    stop(grace): a sequence mid-generation keeps its steps), so a stream in a handler finishes its
    answer; then every stream is cut off (EOF to the client), the threads end, and the socket and its
    directory are gone; a second close is a no-op."""
    gate = threading.Event()
    sv = _Servicer(gate=gate)
    before = set(threading.enumerate())
    ipc = IpcStreamServer(sv, VERIFY_STREAM, "test-worker", 1 << 20, 4)
    assert sv.ipc_stream is ipc
    idle, _ = _hello(ipc, VERIFY_STREAM.id)
    busy, _ = _hello(ipc, VERIFY_STREAM.id)
    busy.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[5]).SerializeToString()))
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    ipc.close(grace_s=1.0)
    assert 0.9 < time.monotonic() - t0 < 1.0 + ipc_stream.JOIN_TIMEOUT_S
    assert _answer(busy)[0] == "ok" and _closed(busy) and _closed(idle)
    assert not os.path.exists(ipc.path) and not os.path.exists(ipc.dir)
    assert sv.ipc_stream is None and not ipc.acceptor.is_alive() and not ipc.conns
    end = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < end:
        time.sleep(0.02)
    assert not set(threading.enumerate()) - before  # connection threads, idle or not, have exited
    with pytest.raises(OSError):
        _connect(ipc)
    ipc.close()
    idle.close()
    busy.close()


def test_worker_stop_removes_the_socket_and_directory():
    """A worker's server.stop (the SIGTERM path of serve_forever and the tests' stop) closes its IPC
    stream server: socket and directory removed."""
    servicer = dserver.DraftServicer(ScriptedDrafter(4, 64))
    server, port = dserver.start_server(servicer, "127.0.0.1:0", 4)
    ipc = servicer.ipc_stream
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest(), timeout=10)
        assert info.ipc_stream_socket == ipc.path and os.path.exists(ipc.path)
    finally:
        server.stop(0).wait()
    assert not os.path.exists(ipc.dir) and servicer.ipc_stream is None


def test_a_long_tmpdir_uses_a_short_base_and_a_socket_that_cannot_be_created_only_turns_ipc_off(
        tmp_path, monkeypatch, caplog):
    """A temp directory whose path is too long for a Unix socket (a long TMPDIR): the socket's directory
    goes under SHORT_BASE instead and IPC works. When no socket can be made at all (SHORT_BASE too long
    as well): IpcStreamServer raises RuntimeError naming the reason and leaves no directory, and a
    worker still starts, with a warning naming the reason, offering no socket in Info."""
    long = tmp_path / ("d" * 120)
    long.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(long))
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4)
    try:
        assert os.path.dirname(ipc.dir) == ipc_stream.SHORT_BASE and len(ipc.path) <= ipc_stream.SUN_PATH_MAX
        _round_trip(ipc, 3)
    finally:
        ipc.close()
    monkeypatch.setattr(ipc_stream, "SHORT_BASE", str(long))
    with pytest.raises(RuntimeError, match="test-worker: cannot listen on the IPC stream socket .*too long"):
        IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4)
    monkeypatch.setattr(ipc_stream, "SHORT_BASE", str(long / "missing"))
    with pytest.raises(RuntimeError, match="cannot create the IPC stream socket's directory under .*missing"):
        IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4)
    assert list(long.iterdir()) == []
    caplog.set_level(logging.WARNING, logger="specd.ipc_stream")
    servicer = dserver.DraftServicer(ScriptedDrafter(4, 64))
    server, port = dserver.start_server(servicer, "127.0.0.1:0", 4)
    try:
        assert servicer.ipc_stream is None and not hasattr(server, "ipc_stream")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest(), timeout=10).ipc_stream_socket == ""
        warned = [r.getMessage() for r in caplog.records if "serving without an IPC stream socket" in r.getMessage()]
        assert len(warned) == 1 and "draft-worker" in warned[0] and "missing" in warned[0], warned
    finally:
        server.stop(0).wait()
        servicer.close()
    assert list(long.iterdir()) == []


def test_worker_without_ipc_streams_offers_none_and_the_coordinator_uses_grpc(stack, reference):
    """A drafter worker started with ipc_streams off: Info offers no socket, a coordinator reaches it
    over gRPC streams (and the target over IPC), with the plain greedy output."""
    servicer = dserver.DraftServicer(ScriptedDrafter(6, stack.tservicer.model.hp.n_vocab),
                                     feature_transport=stack.transport)
    server, _ = dserver.start_server(servicer, f"unix://{stack.dir}/d-noipc.sock", 8, ipc_streams=False)
    try:
        assert servicer.ipc_stream is None
        with grpc.insecure_channel(f"unix://{stack.dir}/d-noipc.sock") as ch:
            assert wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest(), timeout=10).ipc_stream_socket == ""
        stub = stack.coordinator(policy=PolicyConfig(step_ratio=0), drafter_override=f"unix://{stack.dir}/d-noipc.sock")
        coord = stack.coords[-1][0]
        assert coord.hot_path == {"target": "ipc-stream", "drafter": "grpc-stream"}
        info = stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10)
        assert (info.target_hot_path, info.drafter_hot_path) == ("ipc-stream", "grpc-stream")
        prompt = [3, 3, 7]
        ref, _ = reference(prompt, 12)
        chunks, done = generate(stub, token_request(prompt, 12, ignore_eos=True,
                                                    speculation=gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE)))
        assert streamed_ids(chunks) == ref and done.speculation.num_drafts > 0
        wait_released(stack)
    finally:
        server.stop(0).wait()
        servicer.close()


def test_coordinator_without_ipc_streams_uses_grpc_streams_even_when_offered(stack, reference):
    """--no-ipc-streams on the coordinator: gRPC streams for both workers (no IPC connection), same
    output; the transport is in GetModelInfo and the specd_worker_hot_path gauge."""
    stub = stack.coordinator(policy=PolicyConfig(step_ratio=0), ipc_streams=False)
    coord = stack.coords[-1][0]
    assert coord.hot_path == {"target": "grpc-stream", "drafter": "grpc-stream"}
    reg = coord.metrics.registry
    lab = {"model": "condgen.gguf", "drafter": "scripted"}
    assert reg.get_sample_value("specd_worker_hot_path", {**lab, "worker": "target", "transport": "grpc-stream"}) == 1
    default = stack.coords[0][0].metrics.registry
    assert default.get_sample_value("specd_worker_hot_path",
                                    {**lab, "worker": "drafter", "transport": "ipc-stream"}) == 1
    ipcs = (stack.tservicer.ipc_stream, stack.dservicer.ipc_stream)
    before = [i.connections for i in ipcs]
    prompt = [1, 2, 3, 4]
    ref, _ = reference(prompt, 10)
    chunks, _ = generate(stub, token_request(prompt, 10, ignore_eos=True))
    assert streamed_ids(chunks) == ref
    assert [i.connections for i in ipcs] == before
    assert stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10).target_hot_path == "grpc-stream"
    wait_released(stack)


@pytest.mark.parametrize("how", ["missing", "wrong token"])
def test_an_unreachable_socket_falls_back_to_grpc_streams(stack, reference, monkeypatch, caplog, how):
    """A socket this host cannot use (another host's path; a socket whose worker refuses the token):
    the coordinator logs one INFO line naming it and uses gRPC streams for that worker."""
    real = stack.tservicer.ipc_stream
    fake = types.SimpleNamespace(path="/nonexistent/specd-ipc/stream.sock" if how == "missing" else real.path,
                                 token=real.token if how == "missing" else bytes(16))
    monkeypatch.setattr(stack.tservicer, "ipc_stream", fake)
    caplog.set_level(logging.INFO, logger="specd.coordinator")
    stub = stack.coordinator(policy=PolicyConfig(step_ratio=0))
    assert stack.coords[-1][0].hot_path == {"target": "grpc-stream", "drafter": "ipc-stream"}
    lines = [r.getMessage() for r in caplog.records if "target worker" in r.getMessage()]
    assert len(lines) == 1 and "gRPC streams" in lines[0] and fake.path in lines[0], lines
    assert ("FileNotFoundError" if how == "missing" else "PERMISSION_DENIED") in lines[0]
    assert "target" not in stack.coords[-1][0]._ipc_lost  # it will not change: not probed again
    monkeypatch.undo()
    prompt = [6, 1, 6]
    ref, _ = reference(prompt, 8)
    chunks, _ = generate(stub, token_request(prompt, 8, ignore_eos=True))
    assert streamed_ids(chunks) == ref
    wait_released(stack)


def _ipc_stream(path, token=bytes(16), timeout=5.0):
    from specd.coordinator.server import IpcOffer, IpcStream

    return IpcStream(IpcOffer(str(path), token, VERIFY_STREAM), timeout, 1 << 20)


def test_client_maps_a_missing_socket_to_unavailable(tmp_path):
    """The worker's socket is gone (worker stopped): UNAVAILABLE naming the call, nothing left open."""
    from specd.coordinator.server import RequestError

    async def run():
        st = _ipc_stream(tmp_path / "gone.sock")
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)
        await st.close(True, 1.0)
        return ei.value, st.sock

    err, sock = asyncio.run(run())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "verify: worker unavailable" in err.message and sock is None


class _RawWorker:
    """A Unix socket 'worker' that admits one connection (ok hello) and then does ``then`` with it:
    "hang" (reads, never answers or closes), "reset" (closes after the first request)."""

    def __init__(self, path, then):
        self.path, self.then = str(path), then
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(self.path)
        self.lsock.listen()
        self.conns = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            c, _ = self.lsock.accept()
        except OSError:
            return
        self.conns.append(c)
        _read_exact(c, FRAME.size + 25)
        c.sendall(ipc_stream.OK_FRAME)
        if self.then == "reset":
            _read_exact(c, FRAME.size)
            c.close()
            return
        while c.recv(4096):
            pass

    def close(self):
        self.lsock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("deadline", [False, True])
def test_client_call_is_bounded_and_closes_its_connection(tmp_path, deadline):
    """A worker that never answers: the call ends with DEADLINE_EXCEEDED after worker_timeout_s (no
    request deadline) or the request's deadline, and the connection is closed."""
    from specd.coordinator.server import RequestError

    w = _RawWorker(tmp_path / "w.sock", "hang")

    async def run():
        st = _ipc_stream(w.path, timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), time.monotonic() + 0.3 if deadline else None)
        return ei.value, time.monotonic() - t0, st.sock

    try:
        err, took, sock = asyncio.run(run())
    finally:
        w.close()
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 2.0 and sock is None
    assert ("deadline exceeded during verify" if deadline else "worker_timeout_s 0.3") in err.message


def test_client_bounds_what_a_worker_sends_between_calls(tmp_path):
    """A broken worker that answers a call and then streams unasked bytes: the client buffers at most one
    whole frame's worth, closes the connection, and the next call raises UNAVAILABLE."""
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    limit = 1 << 10

    def serve(c):
        n = FRAME.unpack(_read_exact(c, FRAME.size))[0]
        _read_exact(c, n)
        c.sendall(ipc_stream.OK_FRAME)  # the answer, then (between calls) unasked bytes
        time.sleep(0.1)
        c.sendall(bytes(4 * limit))
        while c.recv(4096):
            pass

    path, lsock = fake_worker(tmp_path, serve)

    async def run():
        st = IpcStream(IpcOffer(path, bytes(16), VERIFY_STREAM), 5.0, limit)
        first = await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)
        for _ in range(100):  # the reader callback takes the unasked bytes
            if st.sock is None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[2]), None)
        return first, ei.value, len(st.buf), st.sock

    try:
        first, err, buffered, sock = asyncio.run(run())
    finally:
        lsock.close()
    assert first == wpb.VerifyResponse() and err.code == grpc.StatusCode.UNAVAILABLE
    assert buffered == 0 and sock is None


def test_client_maps_a_reset_mid_call_to_unavailable(tmp_path):
    """The worker closes the connection without an answer (it crashed): UNAVAILABLE."""
    from specd.coordinator.server import RequestError

    w = _RawWorker(tmp_path / "w.sock", "reset")

    async def run():
        st = _ipc_stream(w.path)
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)
        return ei.value

    try:
        err = asyncio.run(run())
    finally:
        w.close()
    assert err.code == grpc.StatusCode.UNAVAILABLE


def test_client_close_is_bounded_and_leaves_nothing_open(tmp_path):
    """close(ok=True) half-closes and waits for the worker to close at most its timeout; a worker that
    never closes is cut off then. No task or connection is left behind."""
    w = _RawWorker(tmp_path / "w.sock", "hang")

    async def run():
        st = _ipc_stream(w.path)
        st.loop = asyncio.get_running_loop()
        await st._hello()
        t0 = time.monotonic()
        await st.close(True, 0.3)
        took = time.monotonic() - t0
        await asyncio.sleep(0.05)
        return took, st.sock, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        took, sock, left = asyncio.run(run())
    finally:
        w.close()
    assert 0.25 < took < 2.0 and sock is None and left == []


def test_ipc_stream_flags_defaults_validation_and_serve_forwarding(serve_argvs):
    """--ipc-streams / --no-ipc-streams on target-worker, draft-worker and coordinator (default on,
    typed fields validated); specd serve forwards its value to both workers and the coordinator."""
    from specd.coordinator.cli import build_parser
    from specd.coordinator.config import CoordinatorConfig, config_from_args

    p = build_parser()
    assert tserver.TargetWorkerConfig().ipc_streams and dserver.DraftWorkerConfig().ipc_streams
    assert CoordinatorConfig().ipc_streams
    assert tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf"])).ipc_streams
    assert not tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf",
                                                      "--no-ipc-streams"])).ipc_streams
    assert p.parse_args(["draft-worker", "--vocab", "8"]).ipc_streams
    assert not p.parse_args(["draft-worker", "--vocab", "8", "--no-ipc-streams"]).ipc_streams
    assert config_from_args(p.parse_args(["coordinator"])).ipc_streams
    assert not config_from_args(p.parse_args(["coordinator", "--no-ipc-streams"])).ipc_streams
    for bad in (tserver.TargetWorkerConfig(target="t.gguf", ipc_streams="no"),
                dserver.DraftWorkerConfig(vocab=8, ipc_streams=1), CoordinatorConfig(ipc_streams=None)):
        with pytest.raises(ValueError, match="ipc_streams must be true or false"):
            bad.validate()
    for flag, want in (([], "--ipc-streams"), (["--no-ipc-streams"], "--no-ipc-streams"),
                       (["--no-worker-streams"], "--no-ipc-streams")):  # unary calls: a socket would go unused
        seen = serve_argvs(*flag)
        for argv in seen if not flag or flag[0] != "--no-worker-streams" else seen[:2]:
            assert want in argv and ({"--ipc-streams", "--no-ipc-streams"} - {want}).isdisjoint(argv), argv
        assert ("--no-worker-streams" in seen[2]) == (flag == ["--no-worker-streams"])
    # --ipc-idle-timeout-s: a typed, validated worker field (default gRPC keepalive's 80 s)
    assert tserver.TargetWorkerConfig().ipc_idle_timeout_s == dserver.DraftWorkerConfig().ipc_idle_timeout_s == 80.0
    assert tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--ipc-idle-timeout-s",
                                                  "5"])).ipc_idle_timeout_s == 5.0
    assert p.parse_args(["draft-worker", "--vocab", "8", "--ipc-idle-timeout-s", "7"]).ipc_idle_timeout_s == 7.0
    for bad in (tserver.TargetWorkerConfig(target="t.gguf", ipc_idle_timeout_s=0),
                dserver.DraftWorkerConfig(vocab=8, ipc_idle_timeout_s="80"),
                dserver.DraftWorkerConfig(vocab=8, ipc_idle_timeout_s=-1.0)):
        with pytest.raises(ValueError, match="ipc_idle_timeout_s must be a number > 0"):
            bad.validate()


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e20, 1e-7])
def test_an_idle_timeout_the_socket_cannot_carry_is_refused_at_validation(value):
    """--ipc-idle-timeout-s becomes each stream's SO_RCVTIMEO: a value it cannot carry (infinite, NaN,
    past a timeval's seconds) would fail every stream after its hello with INTERNAL (the probe, answered
    before, still passes, so the coordinator would choose the socket), and one under a microsecond
    packs to a zero timeval, which means no idle bound at all. Both are refused when the worker's
    config is validated; the accepted range packs to a non-zero timeval."""
    for cfg in (tserver.TargetWorkerConfig(target="t.gguf", ipc_idle_timeout_s=value),
                dserver.DraftWorkerConfig(vocab=8, ipc_idle_timeout_s=value)):
        with pytest.raises(ValueError, match="ipc_idle_timeout_s must be a number > 0"):
            cfg.validate()
    for ok in (ipc_stream.MIN_IDLE_TIMEOUT_S, ipc_stream.MAX_IDLE_TIMEOUT_S):
        tserver.check_idle_timeout(ok, "target-worker")
        assert ipc_stream._timeval(ok) != ipc_stream._timeval(0)


def test_hello_and_error_frames_round_trip():
    """The frame helpers: a hello is 4 + 25 bytes with the magic, token and method; an error frame's
    code and details parse back (an unknown code value -> UNKNOWN)."""
    h = hello_frame(b"t" * 16, 2)
    assert len(h) == 29 and h[4:12] == MAGIC and h[12:28] == b"t" * 16 and h[28] == 2
    f = ipc_stream.error_frame(grpc.StatusCode.NOT_FOUND, "no sequence \u00e9")
    assert parse_error(f[5:]) == (grpc.StatusCode.NOT_FOUND, "no sequence \u00e9")
    assert parse_error(struct.pack("<I", 99))[0] == grpc.StatusCode.UNKNOWN


def test_context_is_active_until_the_client_closes():
    """IpcContext.is_active (a plain run checks it between steps): True while the client is connected,
    also with its next request already waiting and after its half-close (the stream's normal end, as
    gRPC's done_writing); False once it closed its socket (cancel) or reset."""
    a, b = socket.socketpair()
    ctx = ipc_stream.IpcContext(a)
    assert ctx.is_active()
    b.sendall(b"next")
    assert ctx.is_active() and a.recv(4) == b"next"
    b.shutdown(socket.SHUT_WR)
    assert ctx.is_active() and a.recv(1) == b"" and ctx.is_active()
    b.close()
    assert not ctx.is_active()
    a.close()
    with pytest.raises(ipc_stream.IpcAbort) as ei:
        ctx.abort(grpc.StatusCode.NOT_FOUND, "gone")
    assert (ei.value.code, ei.value.details) == (grpc.StatusCode.NOT_FOUND, "gone")


def test_a_worker_restarted_with_a_new_socket_is_found_again(stack, reference):
    """The drafter's IPC socket goes away and the worker offers a new one (as after a restart): the
    request that meets the dead socket cannot open it (nothing of its request was sent), so it goes on
    over a gRPC stream and succeeds; the next ones run over gRPC streams, and once the readiness loop
    has re-read the worker's Info the hot path is back on IPC, over the new socket; every output
    equals plain greedy."""
    servicer = dserver.DraftServicer(ScriptedDrafter(6, stack.tservicer.model.hp.n_vocab),
                                     feature_transport=stack.transport)
    addr = f"unix://{stack.dir}/d-restart.sock"
    server, _ = dserver.start_server(servicer, addr, 8)
    try:
        stub = stack.coordinator(policy=PolicyConfig(step_ratio=0), drafter_override=addr, health_poll_s=0.2)
        coord = stack.coords[-1][0]
        old = servicer.ipc_stream
        assert coord.hot_path["drafter"] == "ipc-stream" and coord.ipc_offers["propose"].path == old.path
        prompt, force = [4, 6, 8], gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE)
        ref, _ = reference(prompt, 8)
        assert streamed_ids(generate(stub, token_request(prompt, 8, ignore_eos=True, speculation=force))[0]) == ref
        old.close()  # the socket is gone; a new one is offered
        new = IpcStreamServer(servicer, PROPOSE_STREAM, "draft-worker", 1 << 20, 8)
        try:
            chunks, done = generate(stub, token_request(prompt, 8, ignore_eos=True, speculation=force))
            assert streamed_ids(chunks) == ref and done.speculation.num_drafts > 0
            # The fallback went over gRPC: the new socket is unused unless the readiness loop (0.2 s) has
            # already re-read the Info (a loaded machine) and moved the hot path back to IPC.
            assert new.connections == 0 or coord.hot_path["drafter"] == "ipc-stream"
            end = time.monotonic() + 30  # a loaded machine: the readiness loop and streams run late
            while coord.hot_path["drafter"] != "ipc-stream" and time.monotonic() < end:
                assert streamed_ids(generate(stub, token_request(prompt, 8, ignore_eos=True,
                                                                 speculation=force))[0]) == ref
                time.sleep(0.05)
            assert coord.hot_path["drafter"] == "ipc-stream" and coord.ipc_offers["propose"].path == new.path
            before = new.connections
            assert streamed_ids(generate(stub, token_request(prompt, 8, ignore_eos=True, speculation=force))[0]) == ref
            assert new.connections == before + 1
            reg = coord.metrics.registry
            lab = {"model": "condgen.gguf", "drafter": "scripted", "worker": "drafter"}
            assert reg.get_sample_value("specd_worker_hot_path", {**lab, "transport": "ipc-stream"}) == 1
            assert reg.get_sample_value("specd_worker_hot_path", {**lab, "transport": "grpc-stream"}) == 0
        finally:
            new.close()
        wait_released(stack)
    finally:
        server.stop(0).wait()
        servicer.close()


def test_connection_threads_are_kept_for_the_next_connections():
    """Sequences one after another are served by the same connection thread (its native per-thread
    state, e.g. an OpenMP team, is kept, as in gRPC's thread pool); two at once by two threads."""
    class Recording(_Servicer):
        def _verify(self, request, context):
            self.seen.append(threading.get_ident())
            return super()._verify(request, context)

    sv = Recording(slots=4)
    sv.seen = []
    ipc = IpcStreamServer(sv, VERIFY_STREAM, "test-worker", 1 << 20, 4)
    req = _frame(wpb.VerifyRequest(seq_id="s", tokens=[1]).SerializeToString())
    try:
        for _ in range(3):
            s, _ = _hello(ipc, VERIFY_STREAM.id)
            s.sendall(req)
            assert _answer(s)[0] == "ok"
            s.shutdown(socket.SHUT_WR)  # the client's half-close ends the stream; the worker closes
            assert _closed(s)
            s.close()
        a, _ = _hello(ipc, VERIFY_STREAM.id)
        b, _ = _hello(ipc, VERIFY_STREAM.id)
        for c in (a, b):
            c.sendall(req)
            assert _answer(c)[0] == "ok"
            c.close()
    finally:
        ipc.close()
    assert len(set(sv.seen[:3])) == 1 and len(set(sv.seen)) == 2


def test_an_answer_over_the_message_limit_is_resource_exhausted_on_both_sides(tmp_path):
    """A response larger than the worker's max_message_bytes is not sent (RESOURCE_EXHAUSTED, as gRPC's
    send limit); an answer frame larger than the coordinator's internal_max_message_bytes is refused
    with RESOURCE_EXHAUSTED (gRPC's receive limit) and the connection closed."""
    big = wpb.VerifyResponse(argmax=list(range(1000)))
    ipc = IpcStreamServer(_Servicer(answer=big), VERIFY_STREAM, "test-worker", 1000, 4)
    try:
        s, _ = _hello(ipc, VERIFY_STREAM.id)
        s.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[1]).SerializeToString()))
        code, details = _answer(s)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds max_message_bytes 1000" in details
        s.close()
    finally:
        ipc.close()
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    ipc = IpcStreamServer(_Servicer(answer=big), VERIFY_STREAM, "test-worker", 1 << 20, 4)

    async def run():
        st = IpcStream(IpcOffer(ipc.path, ipc.token, VERIFY_STREAM), 5.0, 100)
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)
        return ei.value, st.sock

    try:
        err, sock = asyncio.run(run())
    finally:
        ipc.close()
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "IPC answer frame" in err.message and sock is None


class _FlakyListener:
    """Wraps a listening socket: its next ``fail`` accept() calls raise EMFILE (out of descriptors)."""

    def __init__(self, real, fail):
        self.real, self.fail, self.failed = real, fail, 0

    def accept(self):
        if self.failed < self.fail:
            self.failed += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.real.accept()

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_the_acceptor_survives_a_failed_accept(caplog):
    """accept() failing while the server is open (EMFILE) is transient: logged once, retried, and a
    connection made meanwhile waits in the backlog and is served; close() still ends the acceptor."""
    caplog.set_level(logging.WARNING, logger="specd.ipc_stream")
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4)
    try:
        ipc.listener = _FlakyListener(ipc.listener, 3)
        _round_trip(ipc, 1)  # taken by the accept() already waiting; the next three fail
        _round_trip(ipc, 2)
        assert ipc.listener.failed == 3 and ipc.acceptor.is_alive()
        warned = [r for r in caplog.records if "accept on the IPC stream socket failed" in r.getMessage()]
        assert len(warned) == 1 and "Too many open files" in warned[0].getMessage()
    finally:
        ipc.close()
    assert not ipc.acceptor.is_alive()


def test_a_connection_thread_that_cannot_start_refuses_only_that_connection(monkeypatch, caplog):
    """Starting a connection thread fails (RuntimeError "can't start new thread": the process's thread
    or memory limit): that connection gets RESOURCE_EXHAUSTED and is closed, its place is freed, and
    the acceptor goes on serving the next connections."""
    caplog.set_level(logging.WARNING, logger="specd.ipc_stream")
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 1)
    failures = [RuntimeError("can't start new thread")]

    class _Thread(threading.Thread):
        def start(self):
            if failures:
                raise failures.pop()
            super().start()

    monkeypatch.setattr(ipc_stream, "threading", types.SimpleNamespace(Thread=_Thread))  # _dispatch's threads only
    try:
        s = _connect(ipc)
        with s:
            s.settimeout(5)
            code, details = _answer(s)  # refused at the accept, as beyond max_connections (no hello needed)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "can't start new thread" in details
            assert _closed(s)
        assert ipc.acceptor.is_alive() and not failures
        _round_trip(ipc, 3)  # the only connection place was given back
        assert any("connection thread" in r.getMessage() for r in caplog.records)
    finally:
        ipc.close()
    assert not ipc.conns and not ipc.acceptor.is_alive()


class _Fallback:
    """A stand-in for the gRPC WorkerStream an IpcStream falls back to: records its calls."""

    def __init__(self, seen):
        self.seen = seen

    async def call(self, msg, deadline):
        self.seen.append(("call", msg.seq_id))
        return wpb.VerifyResponse(accepted=7)

    async def close(self, ok, timeout=None):
        self.seen.append(("close", ok))


@pytest.mark.parametrize("how,fallback", [("backlog", True), ("missing", True), ("backlog", False)])
def test_a_socket_that_cannot_be_opened_is_found_fast_and_the_call_falls_back(tmp_path, how, fallback):
    """A socket whose hello is never answered (a worker whose acceptor is gone: the connection waits in
    the backlog) or that is gone: found within open_timeout_s, not the call's 60 s budget; on_lost is
    told, and the call (nothing of it was sent) goes to the fallback stream, which also gets the rest of
    the sequence and the close; without a fallback the call raises UNAVAILABLE."""
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    path = str(tmp_path / "w.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if how == "backlog":
        lsock.bind(path)
        lsock.listen(4)  # never accepts
    seen = []

    async def run():
        st = IpcStream(IpcOffer(path, bytes(16), VERIFY_STREAM), 60.0, 1 << 20, 0.3,
                       fallback=(lambda: _Fallback(seen)) if fallback else None,
                       on_lost=lambda offer: seen.append(("lost", offer.path)))
        t0 = time.monotonic()
        try:
            got = await st.call(wpb.VerifyRequest(seq_id="s1", tokens=[1]), None)
        except RequestError as exc:
            got = exc
        took = time.monotonic() - t0
        if fallback:
            assert (await st.call(wpb.VerifyRequest(seq_id="s2", tokens=[1]), None)).accepted == 7
        await st.close(True, 1.0)
        return got, took, st.sock

    try:
        got, took, sock = asyncio.run(run())
    finally:
        lsock.close()
    assert took < 2.0 and sock is None
    if fallback:
        assert got.accepted == 7
        assert seen == [("lost", path), ("call", "s1"), ("call", "s2"), ("close", True)]
    else:
        assert got.code == grpc.StatusCode.UNAVAILABLE and "cannot be opened within 0.3 s" in got.message
        assert seen == [("lost", path)]


@pytest.mark.parametrize("deadline", [False, True])
def test_a_budget_shorter_than_the_open_bound_ends_a_pending_hello_with_deadline_exceeded(tmp_path, deadline):
    """A hello never answered while the call's own budget (its deadline, or worker_timeout_s) is shorter than
    open_timeout_s: the call raises DEADLINE_EXCEEDED when that budget runs out; the socket is not reported
    lost and the fallback is not used (the worker may be busy, not gone)."""
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    path = str(tmp_path / "w.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(4)  # never accepts: the hello waits
    seen = []

    async def run():
        st = IpcStream(IpcOffer(path, bytes(16), VERIFY_STREAM), 0.2 if not deadline else 60.0, 1 << 20, 2.0,
                       fallback=lambda: _Fallback(seen), on_lost=lambda offer: seen.append(("lost", offer.path)))
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s1", tokens=[1]), time.monotonic() + 0.2 if deadline else None)
        took = time.monotonic() - t0
        await st.close(False)
        return ei.value, took, st.sock

    try:
        err, took, sock = asyncio.run(run())
    finally:
        lsock.close()
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 1.5 and sock is None
    assert seen == []


def test_a_socket_that_breaks_mid_stream_is_reported_once(tmp_path):
    """A worker that answers the hello, then closes while a request waits (it stopped): the call raises
    UNAVAILABLE and on_lost is told once, so new sequences stop using that socket; no fallback is taken
    (part of the request may have run)."""
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    path, lsock = fake_worker(tmp_path, lambda c: c.recv(64))  # the request; then the worker is gone
    seen = []

    async def run():
        st = IpcStream(IpcOffer(path, bytes(16), VERIFY_STREAM), 60.0, 1 << 20, 1.0,
                       fallback=lambda: _Fallback(seen), on_lost=lambda offer: seen.append(("lost", offer.path)))
        try:
            await st.call(wpb.VerifyRequest(seq_id="s1", tokens=[1]), None)
        except RequestError as exc:
            return exc
        finally:
            await st.close(False)

    try:
        got = asyncio.run(run())
    finally:
        lsock.close()
    assert got.code == grpc.StatusCode.UNAVAILABLE
    assert seen == [("lost", path)]


class _PlainRun(_Servicer):
    """A plain run's shape (TargetServicer._plain_run): up to plain_steps steps, each checking first
    that the call is still active; records the steps it ran."""

    def _verify(self, request, context):
        emitted = []
        for i in range(request.plain_steps):
            if emitted and not context.is_active():
                break
            time.sleep(0.03)
            emitted.append(i)
        self.ran.append(len(emitted))
        return wpb.VerifyResponse(accepted=len(emitted) - 1, emitted=emitted)


@pytest.mark.parametrize("end", ["half-close", "close"])
def test_a_half_close_lets_a_plain_run_finish_and_a_close_cancels_it(end):
    """A raw client sends a plain run of 8 steps and at once half-closes (SHUT_WR, the stream's normal
    end, as gRPC's done_writing): all 8 steps run and are answered, then the worker closes. A client
    that closes its socket instead cancels the run: it stops at its next step."""
    sv = _PlainRun()
    sv.ran = []
    ipc = IpcStreamServer(sv, VERIFY_STREAM, "test-worker", 1 << 20, 4)
    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        assert ans == ("ok", b"")
        s.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[1], plain_steps=8).SerializeToString()))
        if end == "half-close":
            s.shutdown(socket.SHUT_WR)
            code, body = _answer(s)
            assert code == "ok" and len(wpb.VerifyResponse.FromString(body).emitted) == 8
            assert _closed(s) and sv.ran == [8]
        else:
            time.sleep(0.05)
            s.close()
            end_by = time.monotonic() + 5
            while not sv.ran and time.monotonic() < end_by:
                time.sleep(0.02)
            assert sv.ran and sv.ran[0] < 8
        s.close()
    finally:
        ipc.close()


def test_the_hello_has_one_deadline_a_trickling_client_is_dropped(monkeypatch):
    """A client sending its hello a byte at a time, each byte well within the hello timeout: the whole
    hello is bounded (one deadline), so the worker drops it after HELLO_TIMEOUT_S and frees the
    connection; a prompt hello is served as before."""
    monkeypatch.setattr(ipc_stream, "HELLO_TIMEOUT_S", 0.5)
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4)
    s = _connect(ipc)
    stop = threading.Event()

    def trickle():
        for b in hello_frame(ipc.token, VERIFY_STREAM.id):  # 29 bytes, 0.15 s apart: 4.4 s in all
            try:
                s.sendall(bytes([b]))
            except OSError:  # the worker closed the connection
                return
            if stop.wait(0.15):
                return

    t = threading.Thread(target=trickle)
    try:
        t0 = time.monotonic()
        t.start()
        while (ipc.connections == 0 or ipc.conns) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert not ipc.conns and 0.4 < took < 1.5, took
        _round_trip(ipc, 4)
    finally:
        stop.set()
        t.join(5)
        s.close()
        ipc.close()


def test_a_stream_without_requests_for_the_idle_timeout_is_closed_and_frees_its_slot():
    """A coordinator that holds a stream open but sends nothing (hung): after idle_timeout_s without a
    request the worker sends DEADLINE_EXCEEDED naming --ipc-idle-timeout-s, closes the connection and
    frees its compute slot and connection; requests coming within the bound keep the stream."""
    sv = _Servicer(slots=2)
    ipc = IpcStreamServer(sv, VERIFY_STREAM, "test-worker", 1 << 20, 4, idle_timeout_s=0.5)
    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        assert ans == ("ok", b"")
        for token in (1, 2, 3):  # 0.3 s apart: each within the bound
            time.sleep(0.3)
            s.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[token]).SerializeToString()))
            assert _answer(s)[0] == "ok"
        assert sv.slots.sem._value == 1
        t0 = time.monotonic()
        code, details = _answer(s)  # nothing sent any more
        took = time.monotonic() - t0
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "--ipc-idle-timeout-s" in details and 0.3 < took < 2.0
        assert _closed(s)
        end = time.monotonic() + 5
        while (sv.slots.sem._value != 2 or ipc.conns) and time.monotonic() < end:
            time.sleep(0.02)
        assert sv.slots.sem._value == 2 and not ipc.conns
        s.close()
        _round_trip(ipc, 5)
    finally:
        ipc.close()


@pytest.mark.parametrize("failure", ["timeout", "exhausted"])
def test_a_transient_probe_failure_is_probed_again(stack, reference, monkeypatch, failure):
    """The probe at connect fails in a way that may pass (no answer in time while the worker warms up;
    RESOURCE_EXHAUSTED: all its connections taken): gRPC streams at first, but the worker stays in the
    re-probe set, and the readiness loop's next probe puts its hot path on IPC."""
    from specd.coordinator import server as cserver

    real, probes = cserver.probe_ipc, []

    async def flaky(offer, timeout):
        probes.append(offer.method.what)
        if offer.method is VERIFY_STREAM and probes.count("verify") == 1:
            if failure == "timeout":
                raise asyncio.TimeoutError()
            raise cserver.RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: all taken")
        return await real(offer, timeout)

    monkeypatch.setattr(cserver, "probe_ipc", flaky)
    stub = stack.coordinator(policy=PolicyConfig(step_ratio=0), health_poll_s=0.2)
    coord = stack.coords[-1][0]
    end = time.monotonic() + 10
    while coord.hot_path["target"] != "ipc-stream" and time.monotonic() < end:
        time.sleep(0.05)
    assert coord.hot_path["target"] == "ipc-stream" and probes.count("verify") >= 2 and not coord._ipc_lost
    before = stack.tservicer.ipc_stream.connections
    prompt = [5, 2, 5]
    ref, _ = reference(prompt, 8)
    assert streamed_ids(generate(stub, token_request(prompt, 8, ignore_eos=True))[0]) == ref
    assert stack.tservicer.ipc_stream.connections > before
    wait_released(stack)


def test_send_parts_sends_everything_across_partial_sends():
    """send_parts (the worker's answer, head and body without joining them): a body larger than the
    socket buffer goes out in several partial sendmsg calls, in order and complete."""
    a, b = socket.socketpair()
    body = bytes(range(256)) * 20000  # 5 MB: more than the socket buffers take at once
    got = bytearray()

    def read():
        while len(got) < 4 + len(body):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    t = threading.Thread(target=read)
    t.start()
    try:
        ipc_stream.send_parts(a, (FRAME.pack(len(body)), b"", body))
    finally:
        t.join(10)
        a.close()
        b.close()
    assert bytes(got) == FRAME.pack(len(body)) + body


class _Sizes(_Servicer):
    """Answers each request with its token count and a ``big`` argmax list (answers larger than the
    socket buffers)."""

    def __init__(self, big=0):
        super().__init__()
        self.big = big

    def _verify(self, request, context):
        return wpb.VerifyResponse(accepted=len(request.tokens), argmax=list(range(self.big)))


def test_client_sends_and_receives_messages_larger_than_the_socket_buffers():
    """IpcStream's non-blocking socket: a request larger than the socket buffer is finished by the
    writer callback while the call waits, an answer larger than one recv is buffered until complete,
    and small calls before and after on the same connection are unaffected."""
    from specd.coordinator.server import IpcOffer, IpcStream

    ipc = IpcStreamServer(_Sizes(big=1 << 20), VERIFY_STREAM, "test-worker", 64 << 20, 4)

    async def run():
        st = IpcStream(IpcOffer(ipc.path, ipc.token, VERIFY_STREAM), 30.0, 64 << 20)
        got = []
        for n in (1, 2_000_000, 3):  # ~8 MB of varints in the middle request
            r = await st.call(wpb.VerifyRequest(seq_id="s", tokens=[7] * n), None)
            got.append((r.accepted, len(r.argmax)))
        assert not st.unsent and not st.buf
        await st.close(True, 5.0)
        return got, st.sock

    try:
        got, sock = asyncio.run(run())
    finally:
        ipc.close()
    assert got == [(1, 1 << 20), (2_000_000, 1 << 20), (3, 1 << 20)] and sock is None


def test_client_deadline_timer_follows_each_call(tmp_path):
    """One timer per connection, moved only when it fires: a call that starts after earlier calls used
    part of the bound still gets its whole worker_timeout_s (the timer armed by the first call re-arms
    for it), and a call that is never answered ends with DEADLINE_EXCEEDED at its own bound."""
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    path = str(tmp_path / "w.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(1)
    ok = _frame(b"\0" + wpb.VerifyResponse(accepted=1).SerializeToString())

    def worker():  # answers the first request after 0.25 s, the second at once, never the third
        c, _ = lsock.accept()
        with c:
            _read_exact(c, FRAME.size + 25)
            c.sendall(ipc_stream.OK_FRAME)
            for delay in (0.25, 0.0):
                (n,) = FRAME.unpack(_read_exact(c, FRAME.size))
                _read_exact(c, n)
                time.sleep(delay)
                c.sendall(ok)
            while c.recv(4096):
                pass

    t = threading.Thread(target=worker, daemon=True)
    t.start()

    async def run():
        st = IpcStream(IpcOffer(path, bytes(16), VERIFY_STREAM), 0.4, 1 << 20)
        req = wpb.VerifyRequest(seq_id="s", tokens=[1])
        for _ in range(2):
            assert (await st.call(req, None)).accepted == 1  # 0.25 s, then at once: within 0.4 s each
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            await st.call(req, None)
        return ei.value, time.monotonic() - t0, st.sock

    try:
        err, took, sock = asyncio.run(run())
    finally:
        lsock.close()
        t.join(5)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "worker_timeout_s 0.4" in err.message
    assert 0.35 < took < 1.5 and sock is None


def call_after_idle(ipc, idle_s, spin=None):
    """One verify call over a coordinator IpcStream to ``ipc`` (its _Servicer echoes), then ``idle_s`` of
    silence (past the worker's idle bound: it sends an error frame and closes), then a second call:
    returns the RequestError that call raised (pytest fails if none)."""
    from specd.coordinator.server import IpcOffer, IpcStream, RequestError

    async def run():
        st = IpcStream(IpcOffer(ipc.path, ipc.token, VERIFY_STREAM), 10.0, 1 << 20, spin=spin)
        assert list((await st.call(wpb.VerifyRequest(seq_id="s", tokens=[4]), None)).emitted) == [4]
        await asyncio.sleep(idle_s)
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[5]), None)
        await st.close(True, 1.0)
        return ei.value

    return asyncio.run(run())


def test_client_does_not_reopen_a_connection_the_worker_closed():
    """The worker ended the stream between two calls (here its idle bound): the next call gets the
    worker's error frame (DEADLINE_EXCEEDED), not a new connection."""
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, idle_timeout_s=0.3)
    try:
        err = call_after_idle(ipc, 0.8)
        assert ipc.connections == 1
    finally:
        ipc.close()
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
