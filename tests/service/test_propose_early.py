"""The next step's Propose sent at a speculative step's verify answer, before the step's bookkeeping
(Coordinator._propose_early, IpcStream.send_early / answer): the drafter computes while the
coordinator runs the finish rules and builds the chunk. Here: the early path is taken and changes no
token, step or acceptance (against the unary path, which never sends early); requests that finish with
an early Propose outstanding release everything; a failed early send fails only a request that goes on."""
from __future__ import annotations

import grpc
import pytest

from specd.coordinator.server import IpcStream, RequestError
from specd.protos.v1 import generate_pb2 as gpb

from .conftest import generate, streamed_ids, token_request
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
