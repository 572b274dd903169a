"""The next step's Propose sent at a speculative step's verify answer, before the step's bookkeeping
(Coordinator._propose_early, IpcStream.send_early / answer): the drafter computes while the
coordinator runs the finish rules and builds the chunk. Here: the early path is taken and changes no
token, step or acceptance (against the unary path, which never sends early); requests that finish with
an early Propose outstanding release everything; a failed early send fails only a request that goes on;
IpcStream's two halves of a call, their errors, and a close past an answer nobody awaits."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specd.coordinator.server import IpcOffer, IpcStream, RequestError, status_error
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.target_worker import ipc_stream
from specd.target_worker.ipc_stream import FRAME, STATUS, VERIFY_STREAM, IpcStreamServer

from .conftest import generate, streamed_ids, token_request
from .test_ipc_spin import _SlowServicer
from .test_ipc_streams import _read_exact, _Servicer, fake_worker
from .test_serving import wait_released
from .test_streams import _spec, greedy_runs, via

PROMPT = [7, 1, 8, 2, 8]


@pytest.fixture
def sends(monkeypatch):
    """Counts IpcStream.send_early calls (list of the requests' max_tokens)."""
    seen = []
    send_early = IpcStream.send_early

    def spy(self, msg, deadline):
        seen.append(msg.max_tokens)
        return send_early(self, msg, deadline)

    monkeypatch.setattr(IpcStream, "send_early", spy)
    return seen


@pytest.mark.parametrize("plan", [None, 2, 0])
@pytest.mark.parametrize("draft_mode", [gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE])
def test_early_proposes_change_nothing(stack, reference, sends, plan, draft_mode):
    """Chain and tree steps at full, partial and no acceptance: the IPC path sends most Proposes
    early and streams exactly the plain greedy tokens with the unary path's steps and acceptance."""
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    stack.drafter.plan = plan
    try:
        ipc, unary = greedy_runs((stack.stub, via(stack, "unary")), PROMPT, ref, _spec(draft_mode=draft_mode))
    finally:
        stack.drafter.plan = None
    assert ipc == unary
    steps = ipc[0]
    assert len(sends) >= steps - 2, (sends, steps)  # every step but the first (and maybe the last) early
    wait_released(stack)


@pytest.mark.parametrize("max_tokens", [3, 7, 12])
def test_requests_ending_with_an_early_propose_outstanding_release_everything(stack, reference, sends, max_tokens):
    """max_tokens and a stop token met while the next Propose is already out: the request completes
    with exactly the plain tokens, every sequence is released, and the next request is served right."""
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    chunks, done = generate(stack.stub, token_request(PROMPT, max_tokens, ignore_eos=True, speculation=_spec()))
    assert streamed_ids(chunks) == ref[:max_tokens] and done.finish == gpb.FINISH_REASON_LENGTH
    stop = ref[max_tokens]
    chunks, done = generate(stack.stub, token_request(PROMPT, 30, stop_token_ids=[stop], speculation=_spec()))
    assert streamed_ids(chunks) == ref[:ref.index(stop)] and done.finish == gpb.FINISH_REASON_STOP
    assert sends
    wait_released(stack)
    chunks, done = generate(stack.stub, token_request(PROMPT, 20, ignore_eos=True, speculation=_spec()))
    assert streamed_ids(chunks) == ref[:20]
    wait_released(stack)


def test_a_failed_early_send_fails_only_a_request_that_goes_on(stack, reference, monkeypatch):
    """An early send that fails (here: UNAVAILABLE) is raised by the step that needs its answer; a
    request that finishes at that verify completes normally."""
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref

    def broken(self, msg, deadline):
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "propose: worker unavailable: test")

    monkeypatch.setattr(IpcStream, "send_early", broken)
    with pytest.raises(grpc.RpcError) as ei:
        generate(stack.stub, token_request(PROMPT, 30, ignore_eos=True, speculation=_spec()))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "test" in ei.value.details()
    # max_tokens 3: the first token, then one step of one draft emits the other two: no next Propose is sent
    chunks, done = generate(stack.stub, token_request(PROMPT, 3, ignore_eos=True, speculation=_spec()))
    assert streamed_ids(chunks) == ref[:3]
    wait_released(stack)


# ---- IpcStream.send_early / answer / close


class _Aborting(_Servicer):
    """Answers like _Servicer, but aborts a request for token 99 with NOT_FOUND."""

    def _verify(self, request, context):
        if request.tokens[0] == 99:
            context.abort(grpc.StatusCode.NOT_FOUND, "token 99 refused")
        return super()._verify(request, context)


def _on_stream(servicer, body):
    """Runs ``body(stream)`` (async) on an IpcStream to a worker with ``servicer``, its connection
    opened by one call first; returns (body's result, the server's open connections after it)."""
    ipc = IpcStreamServer(servicer, VERIFY_STREAM, "test-worker", 1 << 20, 4)

    async def run():
        st = IpcStream(IpcOffer(ipc.path, ipc.token, VERIFY_STREAM), 10.0, 1 << 20)
        assert not st.can_send_early()  # not opened yet
        assert list((await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)).emitted) == [1]
        assert st.can_send_early()
        return await body(st)

    try:
        out = asyncio.run(run())
        return out, set(ipc.conns)
    finally:
        ipc.close()


def test_send_early_then_answer_gives_the_calls_answers():
    async def body(st):
        got = []
        for t in (5, 6, 7):
            sent = st.send_early(wpb.VerifyRequest(seq_id="s", tokens=[t]), None)
            assert sent > 0 and not st.can_send_early()  # one call in flight
            got.append(list((await st.answer(sent, None)).emitted))
        await st.close(True, 5.0)
        return got

    got, conns = _on_stream(_Servicer(), body)
    assert got == [[5], [6], [7]] and not conns


def test_answer_raises_the_workers_error_and_a_passed_deadline():
    """A worker's error frame is raised by answer() (the stream ends); a deadline that passes between
    send_early and answer() raises DEADLINE_EXCEEDED and closes the connection."""
    async def refused(st):
        sent = st.send_early(wpb.VerifyRequest(seq_id="s", tokens=[99]), None)
        with pytest.raises(RequestError) as ei:
            await st.answer(sent, None)
        return ei.value, st.sock

    (err, sock), _ = _on_stream(_Aborting(), refused)
    want = status_error(grpc.StatusCode.NOT_FOUND, "token 99 refused", "verify")  # call()'s mapping
    assert (err.code, err.message) == (want.code, want.message) and "token 99 refused" in err.message and sock is None

    async def late(st):
        deadline = time.monotonic() + 0.05
        sent = st.send_early(wpb.VerifyRequest(seq_id="s", tokens=[2]), deadline)
        await asyncio.sleep(0.1)
        with pytest.raises(RequestError) as ei:
            await st.answer(sent, deadline)
        return ei.value.code, st.sock

    (code, sock), _ = _on_stream(_Servicer(), late)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and sock is None


def test_close_waits_for_the_worker_past_an_answer_nobody_awaits():
    """A request that ends with an early call still out (its answer slower than the close): close
    drops that answer and still waits for the worker's end of stream, so the worker's connection
    (and compute slot) is free once close returns."""
    async def body(st):
        st.send_early(wpb.VerifyRequest(seq_id="s", tokens=[2]), None)
        t0 = time.monotonic()
        await st.close(True, 5.0)
        return time.monotonic() - t0

    took, conns = _on_stream(_SlowServicer(0.1), body)
    assert took >= 0.05 and not conns


@pytest.mark.parametrize("flood", ["unasked", "oversized"])
def test_a_worker_flooding_an_early_calls_answer_is_cut_off_at_one_frame(tmp_path, flood):
    """A broken worker streams bytes while the coordinator is busy elsewhere (its verify) between
    send_early and answer(): unasked bytes after the early call's answer, or an answer over the
    coordinator's limit. The client buffers at most one whole frame's worth (as between calls) and
    closes the connection: answer() still returns the whole answer before the unasked bytes (the next
    call raises UNAVAILABLE, as between calls), or raises RESOURCE_EXHAUSTED for the oversized answer
    (as a call() does)."""
    limit = 1 << 10

    def serve(c):
        for answer in (ipc_stream.OK_FRAME, ipc_stream.OK_FRAME if flood == "unasked" else b""):
            _read_exact(c, FRAME.unpack(_read_exact(c, FRAME.size))[0])  # the first call, the early one
            c.sendall(answer)
        c.sendall((b"" if flood == "unasked" else STATUS.pack((1 << 20) + 1, 0)) + bytes(1 << 20))
        while c.recv(4096):
            pass

    path, lsock = fake_worker(tmp_path, serve)

    async def run():
        st = IpcStream(IpcOffer(path, bytes(16), VERIFY_STREAM), 5.0, limit)
        assert await st.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None) == wpb.VerifyResponse()
        sent = st.send_early(wpb.VerifyRequest(seq_id="s", tokens=[2]), None)
        for _ in range(200):  # the verify meanwhile: the reader callback takes what the worker sends
            if st.sock is None:
                break
            await asyncio.sleep(0.01)
        buffered, sock = len(st.buf), st.sock
        try:
            got = await st.answer(sent, None)
        except RequestError as exc:
            return buffered, sock, exc, None
        with pytest.raises(RequestError) as ei:
            await st.call(wpb.VerifyRequest(seq_id="s", tokens=[3]), None)
        return buffered, sock, got, ei.value.code

    try:
        buffered, sock, got, then = asyncio.run(run())
    finally:
        lsock.close()
    assert buffered <= STATUS.size and sock is None  # the answer (an empty frame) or the oversized one's head
    if flood == "unasked":
        assert got == wpb.VerifyResponse() and then == grpc.StatusCode.UNAVAILABLE
    else:
        assert isinstance(got, RequestError) and got.code == grpc.StatusCode.RESOURCE_EXHAUSTED, got
