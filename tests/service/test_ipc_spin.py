"""Spin-then-block on the IPC streams (``--ipc-spin-us``): the workers' FrameReader busy-polls for a
stream's next request before its blocking read, the coordinator's IpcStream busy-polls for an answer
that is due soon (IpcSpin). Here: the reader's spin and read semantics, the worker serving identically
with a spin (requests arriving during / after the spin, pipelined requests, the idle bound), the
coordinator's gate, the end-to-end exactness with every process spinning, and the flags."""
from __future__ import annotations

import asyncio
import errno
import select
import socket
import struct
import threading
import time

import grpc
import pytest

from specd.coordinator.policy import PolicyConfig
from specd.coordinator.server import IpcOffer, IpcSpin, IpcStream
from specd.draft_worker import server as dserver
from specd.protos.v1 import worker_pb2 as wpb
from specd.target_worker import ipc_stream
from specd.target_worker import server as tserver
from specd.target_worker.ipc_stream import (AUTO_SPIN_US, GPU_SPIN_US, MAX_SPIN_US, STATUS, VERIFY_STREAM,
                                            FrameReader, IpcStreamServer, resolve_spin_us)

from .test_ipc_streams import _Servicer, _answer, _closed, _frame, _hello, call_after_idle
from .test_serving import wait_released
from .test_streams import _spec, greedy_runs


def _req(token: int) -> bytes:
    return _frame(wpb.VerifyRequest(seq_id="s", tokens=[token]).SerializeToString())


LONG_SPIN_US = 2_000_000  # a spin far longer than any answer here, so timing checks hold on a loaded machine


def _emitted(ans) -> list[int]:
    code, body = ans
    assert code == "ok", ans
    return list(wpb.VerifyResponse.FromString(body).emitted)


# ---- FrameReader


def test_reader_spin_returns_at_once_for_buffered_input_and_polls_only_an_empty_buffer():
    """Two frames sent at once: after the first is read the second is in the reader's buffer, so the
    spin returns True without polling (far inside its 2 s); with nothing buffered or sent it polls
    for the whole spin (0.1 s) and returns False; with spin 0 it never polls."""
    a, b = socket.socketpair()
    with a, b:
        r = FrameReader(a, LONG_SPIN_US)
        b.sendall(b"\x01\x02\x03" + b"\x04\x05")
        assert r.read(3) == b"\x01\x02\x03" and bytes(r.buf) == b"\x04\x05"
        t0 = time.monotonic()
        assert r.spin() is True
        assert time.monotonic() - t0 < 1.0
        assert r.read(2) == b"\x04\x05" and not r.buf
        t0 = time.monotonic()
        assert FrameReader(a, MAX_SPIN_US).spin() is False
        assert 0.09 < time.monotonic() - t0 < 5.0
        off = FrameReader(a, 0)
        t0 = time.monotonic()
        assert off.spin() is False and off.poll is None and time.monotonic() - t0 < 0.05


def test_reader_spin_ends_when_input_or_a_hang_up_arrives():
    """A byte sent 20 ms into a 2 s spin ends it then (True); so does the peer's close (EOF is
    input: the read that follows returns it at once)."""
    a, b = socket.socketpair()
    with a, b:
        r = FrameReader(a, LONG_SPIN_US)
        timer = threading.Timer(0.02, b.sendall, (b"x",))
        t0 = time.monotonic()
        timer.start()
        assert r.spin() is True
        took = time.monotonic() - t0
        timer.join()
        assert took < 1.5 and r.read(1) == b"x"
        b.close()
        assert r.spin() is True and r.read(4) == b""


def test_reader_reads_exact_frames_small_large_and_short():
    """read(n): exactly n bytes from the buffer and the socket (a large frame straight into its
    result), fewer at EOF (the rest of what came), None when SO_RCVTIMEO passes with nothing read and
    the part read when it passes after some bytes (as the BufferedReader it replaces)."""
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
        r = FrameReader(a, 0)
        big = bytes(range(256)) * ((3 * ipc_stream.READ_BYTES) // 256)
        sender = threading.Thread(target=b.sendall, args=(b"head" + big + b"tail",))
        sender.start()
        assert r.read(4) == b"head"
        assert bytes(r.read(len(big))) == big  # larger than READ_BYTES: read past the buffer
        sender.join()
        assert r.read(4) == b"tail"
        t0 = time.monotonic()
        assert r.read(4) is None  # the idle bound: nothing came
        assert 0.15 < time.monotonic() - t0 < 2.0
        b.sendall(b"ab")
        assert r.read(4) == b"ab"  # the bound passed after 2 bytes: what came (the caller ends the stream)
        b.sendall(b"xyz")
        b.shutdown(socket.SHUT_WR)
        assert r.read(8) == b"xyz" and r.read(4) == b""  # EOF: the rest, then nothing


def test_reader_large_frame_cut_by_the_idle_bound_or_eof():
    """A frame larger than READ_BYTES (read straight into its result) whose body stops coming: the part
    read when SO_RCVTIMEO passes after some bytes, None when it passes with none read, the part read at
    EOF (the caller ends the stream on any short read)."""
    n = 3 * ipc_stream.READ_BYTES
    body = bytes(range(256)) * (n // 256)
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
        r = FrameReader(a, 0)
        assert r.read(n) is None  # nothing came within the bound
        sender = threading.Thread(target=b.sendall, args=(body[: n // 2],))
        sender.start()
        part = r.read(n)  # half came, then the bound passed
        sender.join()
        assert bytes(part) == body[: len(part)] and 0 < len(part) <= n // 2
        rest = r.read(n // 2 - len(part)) if len(part) < n // 2 else b""
        assert bytes(part) + bytes(rest) == body[: n // 2]
        b.sendall(body[: n // 3])
        b.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < n // 3:
            chunk = r.read(n)
            assert chunk and len(chunk) <= n // 3
            got += bytes(chunk)
        assert got == body[: n // 3] and r.read(n) == b""  # EOF: the part, then nothing


# ---- the worker side (IpcStreamServer)


def test_spinning_worker_answers_like_a_blocking_one():
    """The same requests on a stream with a spin and one without get the same answers."""
    out = []
    for spin in (0, 20_000):
        ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=spin)
        try:
            s, ans = _hello(ipc, VERIFY_STREAM.id)
            with s:
                assert ans == ("ok", b"")
                got = []
                for token in (5, 1, 9, 3):
                    s.sendall(_req(token))
                    got.append(_emitted(_answer(s)))
                s.shutdown(socket.SHUT_WR)
                assert _closed(s)
            out.append(got)
        finally:
            ipc.close()
    assert out[0] == out[1] == [[5], [1], [9], [3]]


def test_requests_during_and_after_the_spin_are_answered(monkeypatch):
    """A request sent while the worker spins (10 ms into a 2 s spin) is answered well before the
    spin would have ended; one sent after a 5 ms spin is over is answered by the blocking read."""
    monkeypatch.setattr(ipc_stream, "MAX_SPIN_US", LONG_SPIN_US)
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=LONG_SPIN_US)
    late = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=5_000)
    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        with s:
            assert ans == ("ok", b"")
            s.sendall(_req(1))
            assert _emitted(_answer(s)) == [1]  # the worker now spins for the next request
            time.sleep(0.01)
            t0 = time.monotonic()
            s.sendall(_req(2))
            assert _emitted(_answer(s)) == [2]
            assert time.monotonic() - t0 < 1.5
        s, ans = _hello(late, VERIFY_STREAM.id)
        with s:
            assert ans == ("ok", b"")
            for token in (3, 4):
                time.sleep(0.2)  # far past the spin: the worker blocks in recv
                s.sendall(_req(token))
                assert _emitted(_answer(s)) == [token]
            s.shutdown(socket.SHUT_WR)
            assert _closed(s)
    finally:
        ipc.close()
        late.close()


def test_pipelined_requests_already_buffered_are_answered_without_spinning(monkeypatch):
    """Five requests in one write: the first read takes them all into the reader's buffer, and each
    later one is answered at once, not after a 2 s spin on the (empty) socket."""
    monkeypatch.setattr(ipc_stream, "MAX_SPIN_US", LONG_SPIN_US)
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=LONG_SPIN_US)
    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        with s:
            assert ans == ("ok", b"")
            t0 = time.monotonic()
            s.sendall(b"".join(_req(t) for t in range(1, 6)))
            assert [_emitted(_answer(s)) for _ in range(5)] == [[1], [2], [3], [4], [5]]
            assert time.monotonic() - t0 < 4.0  # a spin per buffered request would take >= 8 s
            s.shutdown(socket.SHUT_WR)
            assert _closed(s)
    finally:
        ipc.close()


def test_the_idle_bound_still_fires_with_a_spin():
    """No request for idle_timeout_s (0.3 s) after a 50 ms spin: DEADLINE_EXCEEDED naming the flag,
    the connection closed and its compute slot freed, as without a spin."""
    sv = _Servicer(slots=2)
    ipc = IpcStreamServer(sv, VERIFY_STREAM, "test-worker", 1 << 20, 4, idle_timeout_s=0.3, spin_us=50_000)
    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        with s:
            assert ans == ("ok", b"")
            s.sendall(_req(7))
            assert _emitted(_answer(s)) == [7]
            t0 = time.monotonic()
            code, details = _answer(s)
            took = time.monotonic() - t0
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "--ipc-idle-timeout-s" in details
            assert 0.3 < took < 2.0 and _closed(s)
        end = time.monotonic() + 5
        while (sv.slots.sem._value != 2 or ipc.conns) and time.monotonic() < end:
            time.sleep(0.02)
        assert sv.slots.sem._value == 2 and not ipc.conns
    finally:
        ipc.close()


def test_a_spinning_connection_leaves_the_gil_to_other_threads():
    """While a connection thread spins all the time (a request every 50 ms, a 0.1 s spin), a
    pure-Python thread of the same process finishes its 200000 steps (each poll releases the GIL),
    and the stream keeps answering meanwhile."""
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=MAX_SPIN_US)
    done = threading.Event()

    def busy():
        n = 0
        for _ in range(200_000):
            n += 1
        done.set()

    try:
        s, ans = _hello(ipc, VERIFY_STREAM.id)
        with s:
            assert ans == ("ok", b"")
            s.sendall(_req(0))
            assert _emitted(_answer(s)) == [0]  # the connection thread spins from here on
            t = threading.Thread(target=busy)
            t.start()
            end = time.monotonic() + 30
            token = 0
            while not done.is_set() and time.monotonic() < end:
                token += 1
                s.sendall(_req(token))
                assert _emitted(_answer(s)) == [token]
                time.sleep(0.05)
            t.join(5)
            assert done.is_set()
            s.shutdown(socket.SHUT_WR)
            assert _closed(s)
    finally:
        ipc.close()


# ---- the coordinator side (IpcSpin, IpcStream)


def test_ipc_spin_gate():
    """IpcSpin spins a kind of call while its spins hit (EMA >= HIT_MIN, starting at 1), stops after
    misses but probes one call in PROBE_EVERY, and never spins while another IPC call waits."""
    g = IpcSpin(300)
    assert g.spin_ns == 300_000 and g.should_spin("verify")
    g.waiting = 1
    assert not g.should_spin("verify")
    g.waiting = 0
    for _ in range(3):
        g.record("verify", False)
    assert g.hits["verify"] < IpcSpin.HIT_MIN
    decisions = [g.should_spin("verify") for _ in range(2 * IpcSpin.PROBE_EVERY)]
    assert sum(decisions) == 2 and decisions[IpcSpin.PROBE_EVERY - 1] and decisions[-1]
    assert g.should_spin("propose")  # each kind has its own record
    for _ in range(5):
        g.record("verify", True)
    assert g.should_spin("verify")


class _SlowServicer(_Servicer):
    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def _verify(self, request, context):
        time.sleep(self.delay_s)
        return super()._verify(request, context)


@pytest.mark.parametrize("delay_s", [0.0, 0.03])
def test_client_spin_gives_the_same_answers_fast_or_slow(delay_s):
    """An IpcStream with an IpcSpin gets every answer right: a fast worker's answers come within the
    spin (its hit record stays up); a worker slower than the spin (30 ms vs 5 ms) stops the spin after
    a few misses, and its answers come through the event loop."""
    ipc = IpcStreamServer(_SlowServicer(delay_s), VERIFY_STREAM, "test-worker", 1 << 20, 4)
    spin = IpcSpin(5_000)

    async def run():
        st = IpcStream(IpcOffer(ipc.path, ipc.token, VERIFY_STREAM), 10.0, 1 << 20, spin=spin)
        got = [list((await st.call(wpb.VerifyRequest(seq_id="s", tokens=[t]), None)).emitted) for t in range(8)]
        await st.close(True, 1.0)
        return got

    try:
        assert asyncio.run(run()) == [[t] for t in range(8)]
    finally:
        ipc.close()
    assert spin.waiting == 0
    if delay_s:
        assert spin.hits["verify"] < IpcSpin.HIT_MIN
    else:
        assert spin.hits["verify"] >= IpcSpin.HIT_MIN


def test_client_spin_sees_a_worker_that_closes():
    """A worker ending the stream (its idle bound) while the client spins for an answer: the call gets
    the worker's error frame, not a hang or a spin past the connection's end."""
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, idle_timeout_s=0.3)
    try:
        err = call_after_idle(ipc, 0.6, IpcSpin(MAX_SPIN_US))
    finally:
        ipc.close()
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED


class _EndlessInput:
    """A worker connection that always polls ready (``poll``) and never completes a frame: its recv raises
    EAGAIN ("eagain") or returns the head of a 128 MiB answer (within the default 256 MiB limit) and then
    one byte per call ("trickle": a slow or broken worker). Fails the test, instead of hanging it, when a
    spin still reads after 5 s."""

    def __init__(self, how: str):
        self.how, self.calls, self.end = how, 0, time.monotonic() + 5.0

    def poll(self, timeout):
        return [(0, select.POLLIN)]

    def recv(self, n):
        self.calls += 1
        if time.monotonic() > self.end:
            raise AssertionError(f"the spin still reads after 5 s ({self.calls} reads)")
        if self.how == "eagain":
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return STATUS.pack(128 << 20, 0) if self.calls == 1 else b"x"

    def stream(self, spin: IpcSpin) -> IpcStream:
        """An IpcStream reading from this connection, as after its hello."""
        st = IpcStream(IpcOffer("/nonexistent", b"t" * 16, VERIFY_STREAM), 10.0, 256 << 20, spin=spin)
        st.sock, st.poll = self, self.poll
        return st


@pytest.mark.parametrize("how", ["eagain", "trickle"])
def test_client_spin_ends_at_its_bound_while_input_keeps_coming_without_a_frame(how):
    """The coordinator's spin holds the event loop (no deadline timer, no other sequence runs), so it
    must end at spin_us even when the socket stays readable without ever completing the answer: a recv
    that finds nothing (EAGAIN) or a worker trickling the answer a byte at a time."""
    conn = _EndlessInput(how)
    st = conn.stream(IpcSpin(2_000))
    t0 = time.monotonic()
    assert st._spin() is None
    assert time.monotonic() - t0 < 1.0 and conn.calls >= 1 and st.sock is conn


# ---- through the service


def test_spinning_service_gives_the_plain_greedy_output(stack, reference, monkeypatch):
    """Both workers and a coordinator spinning (2 ms): chain steps at full and partial acceptance
    stream exactly the plain greedy tokens, with the steps and acceptance of the stack's coordinator
    without a spin."""
    monkeypatch.setattr(stack.tserver.ipc_stream, "spin_us", 2_000)  # read per new connection
    monkeypatch.setattr(stack.dserver.ipc_stream, "spin_us", 2_000)
    spinning = stack.coordinator(policy=PolicyConfig(step_ratio=0), ipc_spin_us=2_000)
    coord = stack.coords[-1][0]
    assert coord.hot_path == {"target": "ipc-stream", "drafter": "ipc-stream"} and coord.ipc_spin.spin_ns == 2_000_000
    prompt = [7, 1, 8, 2, 8]
    ref, _ = reference(prompt, 40)
    stack.drafter.continuations[tuple(prompt)] = ref
    try:
        for plan in (None, 2):
            stack.drafter.plan = plan
            a, b = greedy_runs((spinning, stack.stub), prompt, ref, _spec())
            assert a == b
    finally:
        stack.drafter.plan = None
    assert coord.ipc_spin.waiting == 0 and set(coord.ipc_spin.hits) <= {"verify", "propose"}
    wait_released(stack)


# ---- flags


def test_ipc_spin_flags_defaults_validation_and_serve_forwarding(serve_argvs):
    """--ipc-spin-us: a typed field of both workers (default -1 = auto: 1000 us on a GPU, off on the CPU)
    and the coordinator (default 1000), an int in 0..MAX_SPIN_US (or -1 for a worker; ValueError naming
    the field otherwise, also from IpcStreamServer), and specd serve passes --worker-ipc-spin-us (default
    -1) to both workers as their --ipc-spin-us."""
    from specd.coordinator import launcher
    from specd.coordinator.cli import build_parser
    from specd.coordinator.config import CoordinatorConfig, config_from_args

    assert MAX_SPIN_US == 100_000
    assert tserver.TargetWorkerConfig().ipc_spin_us == dserver.DraftWorkerConfig().ipc_spin_us == AUTO_SPIN_US == -1
    assert CoordinatorConfig().ipc_spin_us == 1000 and launcher.ServeConfig().worker_ipc_spin_us == -1
    assert resolve_spin_us(-1, "cuda") == GPU_SPIN_US == 1000 and resolve_spin_us(-1, "cpu") == 0
    assert resolve_spin_us(300, "cuda") == resolve_spin_us(300, "cpu") == 300
    tserver.TargetWorkerConfig(target="t.gguf").validate()  # auto is a worker's valid value...
    with pytest.raises(ValueError, match="coordinator: ipc_spin_us"):
        CoordinatorConfig(ipc_spin_us=-1).validate()  # ... not the coordinator's
    p = build_parser()
    assert tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--ipc-spin-us",
                                                  "300"])).ipc_spin_us == 300
    assert p.parse_args(["draft-worker", "--vocab", "8", "--ipc-spin-us", "40"]).ipc_spin_us == 40
    assert config_from_args(p.parse_args(["coordinator", "--ipc-spin-us", "200"])).ipc_spin_us == 200
    for bad in (-2, MAX_SPIN_US + 1, 1.5, "5", True):
        for cfg in (tserver.TargetWorkerConfig(target="t.gguf", ipc_spin_us=bad),
                    dserver.DraftWorkerConfig(vocab=8, ipc_spin_us=bad), CoordinatorConfig(ipc_spin_us=bad)):
            with pytest.raises(ValueError, match=r"ipc_spin_us must be an integer in 0\.\.100000"):
                cfg.validate()
    with pytest.raises(ValueError, match="ipc_spin_us"):
        IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=-5)
    with pytest.raises(ValueError, match="ipc_spin_us"):
        config_from_args(p.parse_args(["coordinator", "--ipc-spin-us", "-1"]))
    with pytest.raises(ValueError, match=r"serve: worker_ipc_spin_us must be an integer in 0\.\.100000"):
        launcher.ServeConfig(target="t.gguf", worker_ipc_spin_us=MAX_SPIN_US + 1).validate()

    for flags, workers, coordinator in (((), "-1", "1000"),
                                        (("--ipc-spin-us", "250", "--worker-ipc-spin-us", "40"), "40", "250")):
        for argv in serve_argvs(*flags):
            want = coordinator if argv[0] == "coordinator" else workers
            assert argv[argv.index("--ipc-spin-us") + 1] == want, argv
