"""Wake-ahead on the IPC streams (``--ipc-wake-ahead``, hybrid polling): a stream's waiter predicts
its next frame from its last waits (WakeAhead), sleeps until half a spin window before it and spins
from there, so a wait longer than the spin (the coordinator's for a verify, a drafter's across a
verify) is caught by a spin too. Here: the prediction, the worker's sleep-then-spin (FrameReader), the
coordinator's timed spin (IpcStream), exact answers either way, and the flags."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from specd.coordinator.server import IpcOffer, IpcSpin, IpcStream
from specd.draft_worker import server as dserver
from specd.protos.v1 import worker_pb2 as wpb
from specd.target_worker import ipc_stream
from specd.target_worker import server as tserver
from specd.target_worker.ipc_stream import (MAX_WAKE_SLEEP_NS, VERIFY_STREAM, FrameReader, IpcStreamServer,
                                            WakeAhead)

from .test_ipc_spin import _EndlessInput, _SlowServicer
from .test_ipc_streams import _Servicer, _answer, _frame, _hello

MS = 1_000_000  # ns


# ---- the prediction


def test_wake_ahead_sleeps_until_half_a_window_before_the_shortest_recent_wait():
    """No sleep before MIN_WAITS waits; then the shortest of the last DEPTH waits less half a window;
    none when that is not positive or beyond MAX_WAKE_SLEEP_NS; older waits fall out."""
    w = WakeAhead(4 * MS)
    for _ in range(WakeAhead.MIN_WAITS - 1):
        w.record(30 * MS)
        assert w.sleep_ns() == 0
    w.record(25 * MS)
    assert w.sleep_ns() == 23 * MS
    w.record(1 * MS)  # shorter than half a window: spin at once
    assert w.sleep_ns() == 0
    for _ in range(WakeAhead.DEPTH):
        w.record(10 * MS)
    assert w.sleep_ns() == 8 * MS and len(w.waits) == WakeAhead.DEPTH  # the 1 ms wait fell out
    for _ in range(WakeAhead.DEPTH):
        w.record(MAX_WAKE_SLEEP_NS + 10 * MS)
    assert w.sleep_ns() == 0  # an idle stream: no planned spin
    w.record(-5)
    assert min(w.waits) == 0
    with pytest.raises(ValueError, match="spin window must be > 0"):
        WakeAhead(0)


# ---- the worker side (FrameReader)


class _Polls:
    """Records a FrameReader's poll timeouts (ms) around the real poll."""

    def __init__(self, poll):
        self.poll, self.timeouts = poll, []

    def __call__(self, timeout):
        self.timeouts.append(timeout)
        return self.poll(timeout)


def _reader(sock, window_us, waits_ms, wake_ahead=True):
    r = FrameReader(sock, window_us, wake_ahead)
    for ms in waits_ms:
        r.ahead.record(ms * MS)
    r.poll = _Polls(r.poll)
    return r


def test_reader_sleeps_then_spins_for_a_request_due_later_than_the_window():
    """Waits of 60 ms and a 20 ms window: the reader sleeps 50 ms in one blocking poll, then polls
    without blocking; a request sent once the spin has begun is taken by that spin, and the wait is
    recorded. The request is sent from the first non-blocking poll, which comes even when the thread
    resumes after the window (poll_until polls at least once), so no thread's timing decides it."""
    a, b = socket.socketpair()
    with a, b:
        r = _reader(a, 20_000, [60, 60, 60])
        real = r.poll.poll

        def send_at_spin(timeout):
            if timeout == 0 and r.poll.timeouts.count(0) == 1:
                b.sendall(b"x")
            return real(timeout)

        r.poll.poll = send_at_spin
        t0 = time.monotonic_ns()
        assert r.spin() is True
        assert r.poll.timeouts[0] == 50 and set(r.poll.timeouts[1:]) == {0}
        assert r.read(1) == b"x"
        r.arrived()
        assert len(r.ahead.waits) == 4 and r.ahead.waits[-1] >= 50 * MS and r.wait_from == 0
        assert time.monotonic_ns() - t0 >= 50 * MS


def test_reader_sleep_ends_at_an_early_request_and_buffered_input_skips_it():
    """A request sent during the sleep ends it (one blocking poll, no spin); a byte already buffered
    returns at once without any poll; without wake-ahead the spin starts at once (no blocking poll)."""
    a, b = socket.socketpair()
    with a, b:
        r = _reader(a, 20_000, [500, 500, 500])
        timer = threading.Timer(0.02, b.sendall, (b"xy",))
        t0 = time.monotonic()
        timer.start()
        assert r.spin() is True
        timer.join()
        assert time.monotonic() - t0 < 0.4 and r.poll.timeouts == [490]
        assert r.read(1) == b"x"
        r.poll.timeouts.clear()
        assert r.spin() is True and r.poll.timeouts == []  # "y" is buffered
        fixed = FrameReader(a, 20_000, wake_ahead=False)
        assert fixed.ahead is None
        fixed.poll = _Polls(fixed.poll)
        b.sendall(b"z")
        assert fixed.spin() is True and set(fixed.poll.timeouts) == {0} and fixed.read(1) == b"z"
        fixed.arrived()  # nothing to record without wake-ahead
        assert fixed.wait_from == 0


def test_worker_with_wake_ahead_answers_like_a_blocking_one(monkeypatch):
    """A worker with a 10 ms spin and wake-ahead, requests 40 ms apart: every answer right and in
    order, and once three waits are known the reader plans sleeps (about 40 - 5 ms)."""
    planned = []
    sleep_ns = WakeAhead.sleep_ns

    def spy(self):
        planned.append(sleep_ns(self))
        return planned[-1]

    monkeypatch.setattr(WakeAhead, "sleep_ns", spy)
    ipc = IpcStreamServer(_Servicer(), VERIFY_STREAM, "test-worker", 1 << 20, 4, spin_us=10_000, wake_ahead=True)
    try:
        c, ans = _hello(ipc, VERIFY_STREAM.id)
        with c:
            assert ans == ("ok", b"")
            got = []
            for t in range(7):
                time.sleep(0.04)
                c.sendall(_frame(wpb.VerifyRequest(seq_id="s", tokens=[t]).SerializeToString()))
                code, body = _answer(c)
                assert code == "ok"
                got.append(list(wpb.VerifyResponse.FromString(body).emitted))
    finally:
        ipc.close()
    assert got == [[t] for t in range(7)]
    assert planned[:WakeAhead.MIN_WAITS] == [0] * WakeAhead.MIN_WAITS and max(planned) >= 20 * MS


# ---- the coordinator side (IpcStream)


def _calls(spin: IpcSpin, delay_s: float, n: int):
    """n verify calls on one IpcStream to a worker answering after ``delay_s``: (answers, the stream)."""
    ipc = IpcStreamServer(_SlowServicer(delay_s), VERIFY_STREAM, "test-worker", 1 << 20, 4)

    async def run():
        st = IpcStream(IpcOffer(ipc.path, ipc.token, VERIFY_STREAM), 10.0, 1 << 20, spin=spin)
        got = [list((await st.call(wpb.VerifyRequest(seq_id="s", tokens=[t]), None)).emitted) for t in range(n)]
        await st.close(True, 1.0)
        return got, st

    try:
        return asyncio.run(run())
    finally:
        ipc.close()


def test_client_wake_ahead_catches_a_slow_answer_with_a_timed_spin(monkeypatch):
    """A worker answering after 60 ms, a 30 ms spin: after three calls the stream plans timed spins,
    which catch answers (the call's future completed inside the spin); the answers are exact. The
    window is wide so that a loaded machine's late timer still starts the spin before the answer."""
    caught = []
    timed_spin = IpcStream._timed_spin

    def spy(self, end_ns):
        waiting = self.waiter is not None
        timed_spin(self, end_ns)
        caught.append(waiting and self.waiter is None)

    monkeypatch.setattr(IpcStream, "_timed_spin", spy)
    spin = IpcSpin(30_000)
    got, st = _calls(spin, 0.06, 8)
    assert got == [[t] for t in range(8)] and spin.waiting == 0
    assert len(st.ahead.waits) == 8 and min(st.ahead.waits) >= 55 * MS
    assert caught and any(caught)


def test_client_without_wake_ahead_spins_right_after_the_request_only(monkeypatch):
    """--no-ipc-wake-ahead: no stream prediction and no timed spin; the immediate spin and its hit
    record work as before."""
    monkeypatch.setattr(IpcStream, "_timed_spin", lambda self, end_ns: pytest.fail("timed spin without wake-ahead"))
    spin = IpcSpin(10_000, wake_ahead=False)
    got, st = _calls(spin, 0.03, 6)
    assert got == [[t] for t in range(6)] and st.ahead is None
    assert spin.hits["verify"] < IpcSpin.HIT_MIN  # 30 ms answers miss a 10 ms spin


def test_timed_spin_yields_to_other_waiting_calls():
    """A timed spin does nothing while another IPC call of the coordinator waits (its answer would
    queue behind the spin) or once its own call was answered."""
    spin = IpcSpin(50_000)
    st = IpcStream(IpcOffer("/nonexistent", b"t" * 16, VERIFY_STREAM), 10.0, 1 << 20, spin=spin)
    st.poll = lambda timeout: pytest.fail("polled")
    st.waiter = object()
    spin.waiting = 2
    t0 = time.monotonic()
    st._timed_spin(time.monotonic_ns() + 10 ** 9)
    st.waiter, spin.waiting = None, 1
    st._timed_spin(time.monotonic_ns() + 10 ** 9)
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("how", ["eagain", "trickle"])
def test_timed_spin_ends_at_its_bound_while_input_keeps_coming_without_a_frame(how):
    """A timed spin holds the event loop like the immediate one: it ends at its end time even when the
    socket stays readable without completing the awaited answer (EAGAIN, or a worker trickling bytes);
    the call then waits in the event loop, under its deadline timer."""
    conn = _EndlessInput(how)
    spin = IpcSpin(2_000)
    st = conn.stream(spin)
    st.waiter, spin.waiting = object(), 1  # the call waiting in the event loop (IpcStream._wait)
    t0 = time.monotonic()
    st._timed_spin(time.monotonic_ns() + 2 * MS)
    assert time.monotonic() - t0 < 1.0 and conn.calls >= 1 and st.waiter is not None and st.sock is conn


# ---- flags


def test_wake_ahead_flags_defaults_validation_and_serve_forwarding(serve_argvs):
    """--ipc-wake-ahead / --no-ipc-wake-ahead: a bool field of both workers and the coordinator
    (default on), validated; specd serve passes the coordinator's to both workers."""
    from specd.coordinator.cli import build_parser
    from specd.coordinator.config import CoordinatorConfig, config_from_args

    assert tserver.TargetWorkerConfig().ipc_wake_ahead and dserver.DraftWorkerConfig().ipc_wake_ahead
    assert CoordinatorConfig().ipc_wake_ahead
    p = build_parser()
    assert not tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf",
                                                      "--no-ipc-wake-ahead"])).ipc_wake_ahead
    assert p.parse_args(["draft-worker", "--vocab", "8", "--no-ipc-wake-ahead"]).ipc_wake_ahead is False
    assert config_from_args(p.parse_args(["coordinator", "--no-ipc-wake-ahead"])).ipc_wake_ahead is False
    for cfg in (tserver.TargetWorkerConfig(target="t.gguf", ipc_wake_ahead=1),
                dserver.DraftWorkerConfig(vocab=8, ipc_wake_ahead="yes"), CoordinatorConfig(ipc_wake_ahead=None)):
        with pytest.raises(ValueError, match="ipc_wake_ahead"):
            cfg.validate()
    for flags, want in (((), "--ipc-wake-ahead"), (("--no-ipc-wake-ahead",), "--no-ipc-wake-ahead")):
        argvs = serve_argvs(*flags)
        workers = [a for a in argvs if a[0] in ("target-worker", "draft-worker")]
        assert len(workers) == 2 and all(want in a for a in workers), workers
        coord = next(a for a in argvs if a[0] == "coordinator")
        assert ("--no-ipc-wake-ahead" in coord) == bool(flags)
