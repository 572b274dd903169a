"""Plain runs: several plain decode steps per target Verify call (worker.proto ``plain_steps``,
coordinator ``plain_steps_per_call``). The tokens must be exactly those of one call per step at every
edge — run lengths around max_tokens, stop tokens inside a run, token-by-token chunks, the adaptive
policy's bursts and probes, the reasoning budget, deadlines, tree mode, an older worker without runs —
and the counters (steps, plain steps, step indices, metrics) must count the steps that were used."""
from __future__ import annotations

import time

import grpc
import pytest

from specd.coordinator.config import CoordinatorConfig
from specd.coordinator.policy import AdaptivePolicy, PolicyConfig
from specd.coordinator.reasoning import ReasoningBudget
from specd.coordinator.server import Coordinator
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg

from .conftest import Stack, generate, streamed_ids, token_request

PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9, 8], [1], [5, 4, 3, 2, 1, 6, 7]]
OFF = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_OFF)


@pytest.fixture(scope="module")
def mstack(target_gguf):
    s = Stack(target_gguf, policy=PolicyConfig(step_ratio=0), reply_reserve=8)
    s.by_steps = {}
    yield s
    s.stop()


def coordinator(stack, n, fresh=False, **kw):
    """(stub, Coordinator) over the stack's workers with plain_steps_per_call n, the policy off unless
    given and reply_reserve 8; cached per n and options unless ``fresh``."""
    kw.setdefault("policy", PolicyConfig(step_ratio=0))
    kw.setdefault("reply_reserve", 8)
    key = (n, repr(sorted(kw.items())))
    if fresh or key not in stack.by_steps:
        made = (stack.coordinator(plain_steps_per_call=n, **kw), stack.coords[-1][0])
        if fresh:
            return made
        stack.by_steps[key] = made
    return stack.by_steps[key]


def run_no_deadline(stub, req):
    """Generate without a gRPC timeout (a deadline makes the first plain step of a request run alone)."""
    chunks, done = [], None
    for r in stub.Generate(req):
        if r.HasField("chunk"):
            chunks.append(r.chunk)
        else:
            done = r.complete
    return chunks, done


def expected_runs(n, max_tokens):
    """Chunk sizes of a plain request without a deadline: the prefill's token, then runs of n."""
    sizes, left = [1], max_tokens - 1
    while left > 0:
        sizes.append(min(n, left))
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("n", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("token_by_token", [False, True])
def test_plain_runs_equal_single_steps_at_every_edge(mstack, reference, n, token_by_token):
    stub, coord = coordinator(mstack, n, fresh=True)  # its own step metrics
    for prompt in PROMPTS:
        for max_tokens in (1, 2, n, n + 1, 2 * n + 1, 40):
            ref, _ = reference(prompt, max_tokens)
            req = token_request(prompt, max_tokens, ignore_eos=True, speculation=OFF)
            req.stream_options.token_by_token = token_by_token
            chunks, done = run_no_deadline(stub, req)
            assert streamed_ids(chunks) == ref == list(done.output_ids), (prompt, max_tokens)
            sizes = [len(c.token_ids) for c in chunks]
            if token_by_token:
                assert sizes == [1] * max_tokens and [c.step_index for c in chunks] == list(range(max_tokens))
            else:
                assert sizes == expected_runs(n, max_tokens)
                ends = [sum(sizes[: i + 1]) - 1 for i in range(len(sizes))]
                assert [c.step_index for c in chunks] == ends  # each run's last step
            assert done.timing.steps == done.speculation.num_plain_steps == max_tokens - 1
            assert all(c.accepted_in_step == 0 for c in chunks)
    mx = coord.metrics
    labels = {"model": mx._lv[0], "drafter": mx._lv[1], "phase": "verify"}
    time.sleep(0.05)  # the step metrics are recorded by call_soon on the coordinator's loop
    assert mx.registry.get_sample_value("specd_step_seconds_count", labels) == sum(
        mt - 1 for mt in (1, 2, n, n + 1, 2 * n + 1, 40)) * len(PROMPTS) * 1.0


@pytest.fixture
def count_steps(mstack, monkeypatch):
    """Counts the target model's plain steps (Qwen35Model.step: every plain step the worker runs)."""
    model = mstack.tservicer.model
    calls = []
    real = model.step

    def step(st, token):
        calls.append(1)
        return real(st, token)

    monkeypatch.setattr(model, "step", step)
    return calls


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_token_inside_a_run_ends_it_on_the_worker(mstack, reference, count_steps, include_stop):
    stub, _ = coordinator(mstack, 8)
    prompt = PROMPTS[0]
    ref, _ = reference(prompt, 30)
    for j in range(1, 20):
        if ref[j] in ref[:j]:
            continue  # the stop token must first occur at j
        count_steps.clear()
        req = token_request(prompt, 30, stop_token_ids=[ref[j]], include_stop=include_stop, ignore_eos=True,
                            speculation=OFF)
        chunks, done = run_no_deadline(stub, req)
        assert streamed_ids(chunks) == ref[: j + 1 if include_stop else j]
        assert done.finish_reason == "stop" and done.matched_token_id == ref[j]
        assert done.timing.steps == done.speculation.num_plain_steps == j
        assert len(count_steps) == j, "the worker ran steps past the stop token"


def scripted_run(stack, stub, reference, prompt, n_tokens, plan):
    """Generate n_tokens with the scripted drafter's ``plan`` over the greedy continuation; checks the
    tokens against plain greedy decoding and returns (chunks, complete)."""
    stack.drafter.plan = plan
    ref, _ = reference(prompt, n_tokens + 8)
    stack.drafter.continuations[tuple(prompt)] = ref
    chunks, done = run_no_deadline(stub, token_request(prompt, n_tokens, ignore_eos=True))
    assert streamed_ids(chunks) == ref[:n_tokens], plan
    return chunks, done


def test_policy_bursts_and_probes_land_on_the_same_steps(mstack, reference):
    """Gate -> plain burst -> probe: plain runs are cut at the burst's end, so every switch, count and
    token is the same as with one call per plain step."""
    pol = PolicyConfig(step_ratio=1.9, burst_len=5, max_burst_len=12, accept_prior=0.0, measure_times=False)
    results = []
    for n in (1, 8):
        stub, _ = coordinator(mstack, n, policy=pol)
        for plan in (0, 1, None):
            chunks, done = scripted_run(mstack, stub, reference, PROMPTS[1], 60, plan)
            sp = done.speculation
            results.append((n, plan, [(s.step_index, s.to_speculative, s.reason) for s in sp.policy_switches],
                            sp.num_drafts, sp.num_plain_steps, sp.num_accepted_tokens, done.timing.steps))
            if plan == 0:
                assert [s.reason for s in sp.policy_switches][:4] == ["gate", "probe", "gate", "probe"]
                if n == 8:  # runs no longer than the burst: 5, then the doubled 10 as 8 + 2
                    sizes = [len(c.token_ids) for c in chunks]
                    assert sizes[1:5] == [1, 5, 1, 8] and sizes[5] == 2
    one, eight = results[:3], results[3:]
    assert [r[2:] for r in one] == [r[2:] for r in eight]


def test_tree_mode_bursts_use_plain_runs(mstack, reference):
    pol = PolicyConfig(step_ratio=1.9, burst_len=6, accept_prior=0.0, measure_times=False)
    stub, _ = coordinator(mstack, 4, policy=pol, draft_mode="tree")
    mstack.drafter.topk_ranks = None
    for plan in (0, 2):
        mstack.drafter.plan = plan
        for prompt in PROMPTS[:3]:
            ref, _ = reference(prompt, 40 + 8)
            mstack.drafter.continuations[tuple(prompt)] = ref
            chunks, done = run_no_deadline(stub, token_request(prompt, 40, ignore_eos=True))
            assert streamed_ids(chunks) == ref[:40]
            if plan == 0:
                assert done.speculation.num_plain_steps > 0 and max(len(c.token_ids) for c in chunks) == 4


def test_an_older_worker_without_runs_gets_single_steps(mstack, reference):
    stub, coord = coordinator(mstack, 8, fresh=True)
    coord.tinfo.max_plain_steps = 0  # what a worker from before plain runs reports
    ref, _ = reference(PROMPTS[2], 12)
    chunks, done = run_no_deadline(stub, token_request(PROMPTS[2], 12, ignore_eos=True, speculation=OFF))
    assert streamed_ids(chunks) == ref and [len(c.token_ids) for c in chunks] == [1] * 12
    assert done.timing.steps == 11


def test_deadline_request_with_runs(mstack, reference):
    """With a deadline the first plain step runs alone (no step time yet), the rest in runs."""
    stub, _ = coordinator(mstack, 8)
    ref, _ = reference(PROMPTS[0], 20)
    chunks, done = generate(stub, token_request(PROMPTS[0], 20, ignore_eos=True, speculation=OFF), timeout=60)
    assert streamed_ids(chunks) == ref
    assert [len(c.token_ids) for c in chunks] == [1, 1, 8, 8, 2]


# ---------------------------------------------------------------------- run length


def run_len(n=8, max_plain=33, remaining=100, policy=None, deadline=None, inline_room=None):
    coord = Coordinator(CoordinatorConfig(plain_steps_per_call=n), tokenizer_info=None)
    coord.tinfo = wpb.TargetInfo(max_plain_steps=max_plain)
    return coord._plain_run(remaining, policy or AdaptivePolicy(PolicyConfig(step_ratio=0)), deadline, inline_room)


def test_run_length_caps():
    assert run_len() == 8 and run_len(n=1) == 1 and run_len(n=40) == 33
    assert run_len(max_plain=0) == 1 and run_len(max_plain=5) == 5  # an older / smaller worker
    assert run_len(remaining=3) == 3 and run_len(remaining=1) == 1
    assert run_len(inline_room=5) == 5 and run_len(inline_room=0) == 1 and run_len(inline_room=-3) == 1
    p = AdaptivePolicy(PolicyConfig(step_ratio=1.9, burst_len=3, accept_prior=0.0, measure_times=False))
    p.record_spec(0, 0, None)  # gate: a burst of 3
    assert p.plain_left() == 3 and run_len(policy=p) == 3
    p.record_plain_run(1, 2, 0.01)
    assert p.plain_left() == 1 and run_len(policy=p) == 1
    p.record_plain(3, 0.01)
    assert p.plain_left() is None and p.switches[-1] == (4, True, "probe") and run_len(policy=p) == 8


def test_run_length_under_a_deadline():
    p = AdaptivePolicy(PolicyConfig())
    assert run_len(policy=p, deadline=time.monotonic() + 100) == 1  # no step time measured yet
    p.t_spec = 0.02  # only a speculative step time: used as the bound
    assert run_len(policy=p, deadline=time.monotonic() + 0.105) == 4  # 5 steps fit, one kept for the round trip
    p.t_plain = 0.01
    assert run_len(policy=p, deadline=time.monotonic() + 0.0555) == 4
    assert run_len(policy=p, deadline=time.monotonic() + 0.001) == 1
    assert run_len(policy=p, deadline=time.monotonic() + 100) == 8


def test_record_plain_run_shares_the_call_time():
    p = AdaptivePolicy(PolicyConfig(time_alpha=1.0))
    p.record_plain_run(5, 4, 0.25)
    assert p.t_plain == pytest.approx(0.25)


# ---------------------------------------------------------------------- reasoning budget


def test_reasoning_budget_with_plain_runs(mstack, plain_model, monkeypatch):
    """Speculation off, a thinking prompt and budgets 1..9: runs are capped at room + 1 steps so only
    the last can overflow; the forced close and the answer equal the hand-driven reference, and every
    run carries <think> as a stop token."""
    from .test_reasoning import budget_reference, chat_request, think_ids

    stub, coord = coordinator(mstack, 8)
    open_id, close_id, close = think_ids(coord.tok.tokenizer)
    seen_stops = []
    real = mstack.tservicer._plain_run

    def spy(s, request, context, t_in):
        seen_stops.append(set(request.stop_token_ids))
        return real(s, request, context, t_in)

    monkeypatch.setattr(mstack.tservicer, "_plain_run", spy)
    n = 30
    for budget in (1, 2, 4, 9):
        req = chat_request(n, True, budget, OFF, rid=f"run-rb-{budget}")
        prompt = coord._prompt(req)
        ref, count, forced = budget_reference(plain_model, prompt, budget, close, n, open_id, close_id)
        assert count == budget and forced == len(close)
        seen_stops.clear()
        chunks, done = run_no_deadline(stub, req)
        assert streamed_ids(chunks) == ref
        sp = done.speculation
        assert sp.reasoning_budget_closed and sp.thinking_tokens == budget and sp.forced_tokens == len(close)
        assert seen_stops and all(open_id in s for s in seen_stops)
        sizes = [len(c.token_ids) for c in chunks]
        assert max(sizes[1:]) == 8  # runs resume after the close


def test_clip_and_run_stop():
    rb = ReasoningBudget(2, open_id=1, close_id=2, close_seq=[9, 2], in_think=False)
    assert rb.run_stop == 1
    assert rb.clip([5, 1, 6, 7, 8]) == [5, 1, 6, 7]  # <think>, 2 thinking tokens, then the edge
    assert rb.clip([5, 6, 7]) == [5, 6, 7] and rb.count == 0  # simulated: the tracker is unchanged
    rb.apply([1, 5, 6])
    assert rb.clip([7]) == [] and rb.clip([]) == []
    rb = ReasoningBudget(3, 1, 2, [9, 2], in_think=True)
    assert rb.clip([5, 2, 6, 1, 7, 8, 3]) == [5, 2, 6, 1, 7, 8]  # a close frees no budget: 5, 7, 8 count
    assert ReasoningBudget(0, 1, 2, [9, 2], in_think=True).clip([5, 6]) == [5, 6]
    assert ReasoningBudget(0, 1, 2, [9, 2], in_think=True).run_stop is None


# ---------------------------------------------------------------------- worker


@pytest.fixture
def target(mstack):
    channel = grpc.insecure_channel(f"unix://{mstack.dir}/t.sock")
    yield wpbg.TargetWorkerStub(channel)
    channel.close()


def test_verify_reports_its_handler_time(mstack, target, reference):
    """VerifyResponse.handler_s, the handler's own wall time with its compute in it, on every path: a
    chain, a tree, a deferred commit and a plain run."""
    prompt = PROMPTS[3]
    ref, _ = reference(prompt, 12)
    seq = "handler-time-1"
    target.Prefill(wpb.PrefillRequest(seq_id=seq, tokens=prompt, capacity=len(prompt) + 20))
    chain = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[0], ref[1], 7], max_accept=2))
    tree = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[chain.emitted[-1], 5, 6], parents=[-1, 0, 0],
                                           max_accept=1))
    deferred = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[tree.emitted[-1]], defer_commit=True))
    target.Commit(wpb.CommitRequest(seq_id=seq, n=1))
    run = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[deferred.argmax[0] if deferred.argmax else 1],
                                          plain_steps=3))
    for r in (chain, tree, deferred, run):
        assert r.handler_s >= r.compute_s > 0, r
    target.Release(wpb.ReleaseRequest(seq_id=seq))


def test_worker_plain_run_and_its_errors(mstack, target, reference):
    prompt = PROMPTS[4]
    ref, _ = reference(prompt, 20)
    assert target.Info(wpb.InfoRequest()).max_plain_steps == mstack.tservicer.cfg.max_verify == 33
    seq = "run-worker-1"
    pre = target.Prefill(wpb.PrefillRequest(seq_id=seq, tokens=prompt, capacity=len(prompt) + 20))
    assert pre.first_token == ref[0]
    r = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[0]], plain_steps=5))
    assert list(r.emitted) == ref[1:6] and r.accepted == 4 and r.committed == len(prompt) + 5
    # over the per-sequence stream: two runs, the second ending at a stop token
    out = list(target.VerifyStream(iter([
        wpb.VerifyRequest(seq_id=seq, tokens=[ref[5]], plain_steps=3),
        wpb.VerifyRequest(seq_id=seq, tokens=[ref[8]], plain_steps=6, stop_token_ids=[ref[10]])])))
    assert list(out[0].emitted) == ref[6:9]
    stop_at = ref.index(ref[10], 9)  # the first occurrence from position 9 on
    assert list(out[1].emitted) == ref[9 : stop_at + 1] and out[1].committed == len(prompt) + stop_at
    anchor = ref[stop_at]
    bad = [
        (wpb.VerifyRequest(seq_id=seq, tokens=[anchor, 1], plain_steps=2), grpc.StatusCode.INVALID_ARGUMENT),
        (wpb.VerifyRequest(seq_id=seq, tokens=[anchor], parents=[-1], plain_steps=2), grpc.StatusCode.INVALID_ARGUMENT),
        (wpb.VerifyRequest(seq_id=seq, tokens=[anchor], defer_commit=True, plain_steps=2),
         grpc.StatusCode.INVALID_ARGUMENT),
        (wpb.VerifyRequest(seq_id=seq, tokens=[anchor], plain_steps=34), grpc.StatusCode.INVALID_ARGUMENT),
        (wpb.VerifyRequest(seq_id=seq, tokens=[anchor], plain_steps=2, stop_token_ids=[0] * 4097),
         grpc.StatusCode.INVALID_ARGUMENT),
        (wpb.VerifyRequest(seq_id="run-worker-none", tokens=[anchor], plain_steps=2), grpc.StatusCode.NOT_FOUND),
    ]
    for req, code in bad:
        with pytest.raises(grpc.RpcError) as err:
            target.Verify(req)
        assert err.value.code() == code, req
    # a deferred verify pending: the run is refused and nothing moved
    target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[anchor], defer_commit=True))
    with pytest.raises(grpc.RpcError) as err:
        target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[anchor], plain_steps=3))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert target.Commit(wpb.CommitRequest(seq_id=seq, n=1)).committed == len(prompt) + stop_at + 1
    # past the sequence's capacity: INVALID_ARGUMENT naming the step, the steps before it committed
    with pytest.raises(grpc.RpcError) as err:
        target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[stop_at + 1]], plain_steps=33))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "plain run step" in err.value.details()
    target.Release(wpb.ReleaseRequest(seq_id=seq))
    with pytest.raises(grpc.RpcError) as err:
        target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[anchor], plain_steps=2))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("tree", [False, True])
def test_drafted_think_outside_a_section_is_clipped(mstack, plain_model, monkeypatch, tree):
    """Budget 2, thinking off in the prompt, and a drafter that drafts <think> then more tokens than
    the budget allows: the chain is clipped after the budget's edge (a tree falls back to that chain),
    so no accepted token passes the budget; the output equals the hand-driven reference."""
    from .test_reasoning import budget_reference, chat_request, think_ids

    stub, coord = coordinator(mstack, 8)
    open_id, close_id, close = think_ids(coord.tok.tokenizer)
    verifies = []
    real = mstack.tservicer._verify

    def spy(request, context):
        verifies.append((list(request.tokens), list(request.parents)))
        return real(request, context)

    monkeypatch.setattr(mstack.tservicer, "_verify", spy)
    spec = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE,
                                 draft_mode=gpb.DRAFT_MODE_TREE if tree else gpb.DRAFT_MODE_CHAIN)
    req = chat_request(30, False, 2, spec, rid=f"run-think-draft-{tree}")
    prompt = coord._prompt(req)
    ref, _, _ = budget_reference(plain_model, prompt, 2, close, 30, open_id, close_id)
    cont = list(ref) + [5] * 20
    cont[1] = open_id  # the first step drafts <think> and 5 more tokens
    mstack.drafter.plan, mstack.drafter.topk_ranks = None, None
    mstack.drafter.continuations[tuple(prompt)] = cont
    chunks, done = run_no_deadline(stub, req)
    assert streamed_ids(chunks) == ref
    first, parents = verifies[0]
    assert first == [ref[0], open_id, cont[2], cont[3]] and not parents  # <think> + 2 thinking drafts, a chain


def test_stop_string_inside_a_run_counts_only_what_was_sent(mstack):
    """A stop string (not one token, so the worker's run goes past it): the reasoning stats, steps and
    output are those of one call per step."""
    from .test_reasoning import chat_request

    res = {}
    for n in (1, 8):
        stub, coord = coordinator(mstack, n)
        _, base = run_no_deadline(stub, chat_request(30, True, 6, OFF, rid=f"run-ss-base-{n}"))
        text = coord.tok.tokenizer.decode(list(base.output_ids)[:3], skip_special_tokens=True)
        req = chat_request(30, True, 6, OFF, rid=f"run-ss-{n}")
        req.stopping.stop.append(text[-2:])
        _, done = run_no_deadline(stub, req)
        sp = done.speculation
        assert done.finish_reason == "stop"
        res[n] = (list(done.output_ids), done.text, sp.thinking_tokens, sp.reasoning_budget_closed, sp.forced_tokens,
                  done.timing.steps, sp.num_plain_steps)
    assert res[1] == res[8]


def test_token_by_token_stop_inside_a_run(mstack, reference):
    stub, _ = coordinator(mstack, 8)
    prompt = PROMPTS[3]
    ref, _ = reference(prompt, 30)
    j = next(i for i in range(5, 30) if ref[i] not in ref[:i])
    req = token_request(prompt, 30, stop_token_ids=[ref[j]], ignore_eos=True, speculation=OFF)
    req.stream_options.token_by_token = True
    chunks, done = run_no_deadline(stub, req)
    assert streamed_ids(chunks) == ref[:j] and [c.step_index for c in chunks if c.token_ids] == list(range(j))
    assert done.timing.steps == j


def test_worker_run_argmax_and_single_step_stop_ids(mstack, target, reference):
    prompt = PROMPTS[1]
    ref, _ = reference(prompt, 12)
    seq = "run-worker-2"
    target.Prefill(wpb.PrefillRequest(seq_id=seq, tokens=prompt, capacity=len(prompt) + 12))
    r = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[0]], plain_steps=4, return_argmax=True))
    assert list(r.emitted) == list(r.argmax) == ref[1:5]
    with pytest.raises(grpc.RpcError) as err:  # a run has no drafts to cap
        target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[4]], plain_steps=4, max_accept=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_accept" in err.value.details()
    # plain_steps 0 / 1: one ordinary step, the stop ids unused
    r = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[4]], plain_steps=1, stop_token_ids=[ref[5]]))
    assert list(r.emitted) == [ref[5]]
    r = target.Verify(wpb.VerifyRequest(seq_id=seq, tokens=[ref[5]], stop_token_ids=[ref[6]]))
    assert list(r.emitted) == [ref[6]]
    target.Release(wpb.ReleaseRequest(seq_id=seq))


def test_abort_lands_after_the_current_run(mstack, reference):
    """Abort during a long plain generation: the request ends with "abort" after at most one more run,
    and what was sent is a prefix of the plain greedy tokens."""
    stub, _ = coordinator(mstack, 8)
    prompt = PROMPTS[0]
    ref, _ = reference(prompt, 200)
    req = token_request(prompt, 200, ignore_eos=True, speculation=OFF)
    req.request_id = "run-abort-1"
    got, done, at = [], None, None
    for r in stub.Generate(req):
        if r.HasField("chunk"):
            got.extend(r.chunk.token_ids)
            if at is None and len(got) >= 9:
                at = len(got)
                assert list(stub.Abort(gpb.AbortRequest(request_ids=[req.request_id])).aborted) == [req.request_id]
        else:
            done = r.complete
    assert done.finish_reason == "abort" and got == ref[: len(got)]
    assert len(got) <= at + 2 * 8  # the run in flight and at most one more (the abort races the next call)


def test_measured_step_times_with_runs_stay_lossless(mstack, reference):
    """With measured step times (the default policy) t_plain of a run is its share of the call, so the
    policy's switches may differ from one call per step; the tokens may not."""
    pol = PolicyConfig(step_ratio=1.9, burst_len=6, accept_prior=0.0)  # measure_times on
    for n in (1, 8):
        stub, _ = coordinator(mstack, n, policy=pol)
        for plan in (0, 2, None):
            _, done = scripted_run(mstack, stub, reference, PROMPTS[4], 50, plan)
            assert done.timing.steps == done.speculation.num_drafts + done.speculation.num_plain_steps
