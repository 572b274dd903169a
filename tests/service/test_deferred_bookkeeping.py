"""A speculative step's bookkeeping deferred to the next verify (Coordinator._defers): once the next
Propose went out early and none of the step's tokens can finish the request, the coordinator sends the
next Verify before it runs the step's finish rules, text, chunks and stats, and streams the step's
chunks while the target computes. Here: the deferred path is taken and streams exactly the chunks of
the unary path (which never defers), token by token or per step, for chain and tree steps at every
acceptance; a token that may finish the request (stop string, stop token, max_tokens) is never
deferred; a drafter error and an abort after a deferred step still deliver its tokens."""
from __future__ import annotations

import grpc
import pytest

from specd.protos.v1 import generate_pb2 as gpb

from .conftest import generate, streamed_ids, token_request
from .test_propose_early import PROMPT, sends  # noqa: F401 - the fixture
from .test_serving import wait_released
from .test_streams import _spec, via


def _chunks(c):
    return (list(c.token_ids), c.text, c.step_index, c.accepted_in_step, c.completion_tokens)


def _run(stub, req):
    """(every chunk's fields, the complete message's finish, ids and speculation stats)."""
    chunks, done = generate(stub, req)
    sp = done.speculation
    return ([_chunks(c) for c in chunks], done.finish_reason, list(done.output_ids), done.timing.steps,
            sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens, list(sp.accepted_per_position),
            sp.num_tree_steps, list(sp.accepted_per_rank))


@pytest.mark.parametrize("token_by_token", [False, True])
@pytest.mark.parametrize("plan", [None, 2, 0])
@pytest.mark.parametrize("draft_mode", [gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE])
def test_deferred_bookkeeping_streams_the_same_chunks(stack, reference, sends, plan, draft_mode, token_by_token):
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    stack.drafter.plan = plan
    req = token_request(PROMPT, 30, ignore_eos=True, speculation=_spec(draft_mode=draft_mode))
    req.stream_options.token_by_token = token_by_token
    try:
        ipc = _run(stack.stub, req)
        unary = _run(via(stack, "unary"), req)
    finally:
        stack.drafter.plan = None
    assert ipc == unary
    assert streamed_ids([gpb.GenerateChunk(token_ids=c[0]) for c in ipc[0]]) == ref[:30]
    assert len(sends.verifies) >= ipc[3] - 3, (sends.verifies, ipc[3])  # all but the first and last steps
    wait_released(stack)


@pytest.mark.parametrize("finish", ["stop_string", "stop_token", "max_tokens"])
def test_a_step_that_may_finish_is_not_deferred(stack, reference, sends, finish):
    """Stop strings: no step defers (a stop may span tokens in the text). A stop token or max_tokens:
    the steps before it defer, the one that finishes does not; the output is the plain greedy one."""
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    n = 17
    if finish == "stop_string":
        req = token_request(PROMPT, n, ignore_eos=True, stop=["\x00never"], speculation=_spec())
    elif finish == "stop_token":
        req = token_request(PROMPT, 30, stop_token_ids=[ref[n]], speculation=_spec())
        n = ref.index(ref[n])
    else:
        req = token_request(PROMPT, n, ignore_eos=True, speculation=_spec())
    ipc, unary = _run(stack.stub, req), _run(via(stack, "unary"), req)
    assert ipc == unary and ipc[2] == ref[:n]
    assert ipc[1] == ("length" if finish != "stop_token" else "stop")
    if finish == "stop_string":
        assert not sends.verifies and sends  # the Proposes still go out early
    else:
        assert sends.verifies
    wait_released(stack)


def _until_error(stub, req):
    """(the token ids streamed, the error's code) of a request that fails."""
    ids = []
    with pytest.raises(grpc.RpcError) as ei:
        for r in stub.Generate(req, timeout=60):
            if r.HasField("chunk"):
                ids += list(r.chunk.token_ids)
    return ids, ei.value.code()


def test_a_deferred_steps_tokens_reach_the_client_before_a_drafter_error(stack, reference, sends):
    """The drafter fails its 4th Propose: the tokens of the step before it, whose bookkeeping was
    deferred, are streamed before the error, as on the unary path."""
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref

    def plan(prompt, step):
        if step == 3:
            raise ValueError("test: the 4th propose fails")
        return None

    stack.drafter.plan = plan
    req = token_request(PROMPT, 30, ignore_eos=True, speculation=_spec())
    try:
        ipc = _until_error(stack.stub, req)
        assert sends.verifies
        unary = _until_error(via(stack, "unary"), req)
    finally:
        stack.drafter.plan = None
    assert ipc == unary and ipc[1] == grpc.StatusCode.INTERNAL and ipc[0] == ref[:len(ipc[0])]
    assert len(ipc[0]) > 1 + 3 * 6  # the first token and 3 full steps of the oracle's block
    wait_released(stack)


def test_an_abort_after_a_deferred_step_delivers_its_tokens(stack, reference, sends):
    """An Abort while the coordinator waits for a Propose that went out early (the step before it
    deferred): the request ends with "abort" after the same tokens as on the unary path."""
    ref, _ = reference(PROMPT, 40)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    out = {}
    for name, stub in (("ipc", stack.stub), ("unary", via(stack, "unary"))):
        rid = f"abort-deferred-{name}"

        def plan(prompt, step, stub=stub, rid=rid):
            if step == 3:  # from the drafter's handler thread, while the coordinator awaits this Propose
                assert list(stub.Abort(gpb.AbortRequest(request_ids=[rid]), timeout=10).aborted) == [rid]
            return None

        stack.drafter.plan = plan
        req = token_request(PROMPT, 30, ignore_eos=True, speculation=_spec())
        req.request_id = rid
        try:
            chunks, done = generate(stub, req)
        finally:
            stack.drafter.plan = None
        out[name] = (streamed_ids(chunks), done.finish_reason, list(done.output_ids))
    assert out["ipc"] == out["unary"] and out["ipc"][1] == "abort" and out["ipc"][0] == ref[:len(out["ipc"][0])]
    assert len(out["ipc"][0]) > 1 + 3 * 6 and sends.verifies
    wait_released(stack)
