"""Losslessness: streamed token ids equal a plain greedy run of Qwen35Model (architecture.md invariant 1)
for every acceptance length 0..B, no proposal, random per-step acceptance, draft caps and block edges;
and the drafter's view stays in sync with the target (C09, C10)."""
from __future__ import annotations

import numpy as np
import pytest

from specd.protos.v1 import generate_pb2 as gpb

from .conftest import BLOCK, generate, streamed_ids, token_request


def prompts_for(rng, n, vocab):
    return [[int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 20)))] for _ in range(n)]


@pytest.mark.parametrize("plan", [None, -1] + list(range(BLOCK + 1)))
def test_c10_every_acceptance_length_equals_plain_greedy(stack, reference, rng, plan):
    """C10 too: a verify that rejects at position k, for every k, leaves GDN + conv state exactly at
    the committed position (otherwise the following tokens would differ from the plain run)."""
    vocab = stack.tservicer.model.hp.n_vocab
    for prompt in prompts_for(rng, 3, vocab):
        max_tokens = int(rng.integers(1, 3 * BLOCK + 3))
        ref, _ = reference(prompt, max_tokens + BLOCK + 2)
        stack.drafter.continuations[tuple(prompt)] = ref
        stack.drafter.plan = plan
        chunks, done = generate(stack.stub, token_request(prompt, max_tokens, ignore_eos=True))
        got = streamed_ids(chunks)
        assert got == ref[:max_tokens], f"plan {plan} prompt {prompt}"
        assert list(done.output_ids) == got and done.usage.completion_tokens == len(got)
        assert done.finish_reason == "length"
        sp = done.speculation
        if plan is None and max_tokens > 2:  # the last token of the budget is a plain step
            assert sp.num_accepted_tokens == sp.num_draft_tokens > 0
        if plan is not None and plan >= 0 and sp.num_drafts:
            assert sp.num_accepted_tokens <= plan * sp.num_drafts
        if plan == -1 or max_tokens <= 2:
            assert sp.num_drafts == 0
        assert sum(1 for c in chunks[1:] if c.token_ids) >= (max_tokens - 1) // (BLOCK + 1)


def test_random_acceptance_and_caps_equal_plain_greedy(stack, reference, rng):
    vocab = stack.tservicer.model.hp.n_vocab
    for prompt in prompts_for(rng, 6, vocab):
        choices = [None, -1] + list(range(BLOCK + 1))
        seq = [choices[i] for i in rng.integers(0, len(choices), size=200)]
        stack.drafter.plan = lambda p, step, seq=seq: seq[step]
        max_tokens = int(rng.integers(8, 40))
        ref, _ = reference(prompt, max_tokens + BLOCK + 2)
        stack.drafter.continuations[tuple(prompt)] = ref
        spec = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE)
        cap = int(rng.integers(0, BLOCK + 2))
        if cap:
            spec.max_draft_tokens = cap
        else:
            spec.mode = gpb.SPECULATION_MODE_AUTO  # unset cap: the drafter's block
        chunks, done = generate(stack.stub, token_request(prompt, max_tokens, ignore_eos=True, speculation=spec))
        assert streamed_ids(chunks) == ref[:max_tokens]
        assert len(done.speculation.accepted_per_position) <= (cap or BLOCK)


def test_mode_off_is_plain(stack, reference):
    prompt = [3, 1, 4, 1, 5]
    ref, _ = reference(prompt, 20)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = None
    spec = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_OFF)
    chunks, done = generate(stack.stub, token_request(prompt, 10, ignore_eos=True, speculation=spec))
    assert streamed_ids(chunks) == ref[:10]
    assert done.speculation.num_drafts == 0 and done.speculation.num_plain_steps == 9
    t = done.timing
    assert t.steps == 9 and 0 < t.prefill_s <= t.ttft_s <= t.e2e_s and t.worker_compute_s > 0
    assert t.loop_overhead_s >= 0 and t.decode_s <= t.e2e_s
    # plain runs of plain_steps_per_call (8) steps per call; the request has a deadline (the gRPC timeout),
    # so the first plain step runs alone until a step time is measured: the anchor, 1 token, then 8
    assert [len(c.token_ids) for c in chunks] == [1, 1, 8] and [c.step_index for c in chunks] == [0, 1, 9]


@pytest.mark.parametrize("mode,max_tokens,draft_mode", [("force", 30, gpb.DRAFT_MODE_CHAIN),
                                                       ("force", 30, gpb.DRAFT_MODE_TREE),
                                                       ("off", 30, gpb.DRAFT_MODE_CHAIN),
                                                       ("force", 1, gpb.DRAFT_MODE_CHAIN)])
def test_timing_splits_decode_time(stack, reference, mode, max_tokens, draft_mode):
    """Timing's draft_wait_s + verify_wall_s + bookkeeping_s is decode_s (the coordinator's clock reads
    telescope), each verify's wall time holds the target's handler time, which holds its compute, the
    drafter's compute is the rest of worker_compute_s, and plain steps wait for no drafter. max_tokens 1:
    no step, all bookkeeping."""
    prompt = [2, 7, 1, 8, 2, 8]
    ref, _ = reference(prompt, 30 + BLOCK + 2)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 2  # two drafts right a step: several steps, each with a rejection
    spec = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE if mode == "force" else gpb.SPECULATION_MODE_OFF,
                                 draft_mode=draft_mode)
    chunks, done = generate(stack.stub, token_request(prompt, max_tokens, ignore_eos=True, speculation=spec))
    stack.drafter.plan = None
    assert streamed_ids(chunks) == ref[:max_tokens]
    t = done.timing
    assert t.draft_wait_s + t.verify_wall_s + t.bookkeeping_s == pytest.approx(t.decode_s, rel=1e-9, abs=1e-9)
    drafter = t.worker_compute_s - t.target_compute_s
    if max_tokens == 1:
        assert t.steps == 0 and t.draft_wait_s == t.verify_wall_s == t.worker_compute_s == t.target_handler_s == 0
        assert t.bookkeeping_s == t.decode_s > 0
        return
    assert t.bookkeeping_s > 0 and 0 < t.target_compute_s < t.target_handler_s < t.verify_wall_s
    if mode == "force":
        assert done.speculation.num_drafts >= 5 and drafter > 0 and t.draft_wait_s > 0
        assert (done.speculation.num_tree_steps > 0) == (draft_mode == gpb.DRAFT_MODE_TREE)
    else:
        assert done.speculation.num_drafts == 0 and drafter == pytest.approx(0.0, abs=1e-12) and t.draft_wait_s == 0


def test_timing_without_the_targets_handler_time(stack, reference, monkeypatch):
    """A target that does not report VerifyResponse.handler_s (a worker before the field: 0) leaves
    Timing.target_handler_s at 0, never a partial sum."""
    prompt = [2, 7, 1, 8, 2, 8]
    ref, _ = reference(prompt, 12)
    real, calls = stack.tservicer._verify, []

    def unreported(request, context):
        resp = real(request, context)
        calls.append(resp.handler_s)
        if len(calls) > 1:  # the first verify reports, the later ones do not
            resp.handler_s = 0.0
        return resp

    monkeypatch.setattr(stack.tservicer, "_verify", unreported)
    spec = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_OFF)
    chunks, done = generate(stack.stub, token_request(prompt, 12, ignore_eos=True, speculation=spec))
    assert streamed_ids(chunks) == ref[:12] and len(calls) >= 2 and calls[0] > 0
    assert done.timing.target_handler_s == 0 and done.timing.target_compute_s > 0


def test_c06_spec_never_empty_where_plain_has_text(stack, reference):
    """C06 shape: a tool-calling chat turn; spec and plain (mode OFF) give the same non-empty output."""
    chat = gpb.ChatInput(messages=[
        gpb.ChatMessage(role="system", content="Tools: get_weather(city). Reply with a tool call."),
        gpb.ChatMessage(role="user", content="Weather in Paris?"),
        gpb.ChatMessage(role="assistant", content='<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        gpb.ChatMessage(role="tool", content='{"temp": 21}')])
    out = {}
    for mode in (gpb.SPECULATION_MODE_OFF, gpb.SPECULATION_MODE_FORCE):
        req = gpb.GenerateRequest(chat=chat, stopping=gpb.StoppingParams(max_tokens=24),
                                  speculation=gpb.SpeculationParams(mode=mode))
        stack.drafter.plan = 2
        chunks, done = generate(stack.stub, req)
        out[mode] = (streamed_ids(chunks), done.text, done.finish_reason)
    assert out[gpb.SPECULATION_MODE_OFF] == out[gpb.SPECULATION_MODE_FORCE]
    assert out[gpb.SPECULATION_MODE_OFF][0], "empty completion"


def test_c09_drafter_features_equal_target_after_spec_and_plain_mix(stack, reference, rng):
    """C09: spec steps that accept >= 2 drafts followed by plain steps (the drafter proposes nothing),
    in random order. Output equals plain decoding, and every feature row the drafter ingested equals
    the plain run's row for that position (bitwise), with the right token."""
    vocab = stack.tservicer.model.hp.n_vocab
    for prompt in prompts_for(rng, 3, vocab):
        seq = [[-1, 2, 3, None, 0][i] for i in rng.integers(0, 5, size=200)]
        stack.drafter.plan = lambda p, step, seq=seq: seq[step]
        max_tokens = 30
        ref, feats = reference(prompt, max_tokens + BLOCK + 2)
        stack.drafter.continuations[tuple(prompt)] = ref
        req = token_request(prompt, max_tokens, ignore_eos=True)
        req.request_id = f"c09-{rng.integers(1 << 30)}"
        chunks, done = generate(stack.stub, req)
        assert streamed_ids(chunks) == ref[:max_tokens]
        seq_ids = [s for s in stack.drafter.seen if s.startswith(req.request_id + "#")]
        assert len(seq_ids) == 1
        seen = stack.drafter.seen[seq_ids[0]]
        full = list(prompt) + ref
        assert sorted(seen) == list(range(len(seen))) and len(seen) >= len(prompt)
        for pos, (tok, row) in seen.items():
            assert tok == full[pos]
            np.testing.assert_array_equal(row, feats[pos], err_msg=f"feature row {pos}")


@pytest.mark.parametrize("name", ["smoke", "r3"])
def test_other_tiny_targets_lossless(tmp_path_factory, rng, name):
    """Other layouts: "smoke" (GDN x3 + full, vocab 1024, no tokenizer) and "r3" (interval 2, three
    value heads per key head, tied embeddings): random per-step acceptance equals plain greedy."""
    import specd.native as sn
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.model import Qwen35Model

    from .conftest import CAPTURE, Stack, build_gguf, make_reference

    path = build_gguf(tmp_path_factory, name)
    reference = make_reference(Qwen35Model(load_qwen35(path), capture_layers=CAPTURE, kv_dtype=sn.DType.F32))
    from specd.coordinator.policy import PolicyConfig

    stack = Stack(path, policy=PolicyConfig(step_ratio=0))
    try:
        assert stack.coords[0][0].tok is None  # token-id input only
        vocab = stack.tservicer.model.hp.n_vocab
        for prompt in prompts_for(rng, 4, vocab):
            choices = [None, -1] + list(range(BLOCK + 1))
            seq = [choices[i] for i in rng.integers(0, len(choices), size=100)]
            stack.drafter.plan = lambda p, step, seq=seq: seq[step]
            ref, feats = reference(prompt, 30 + BLOCK)
            stack.drafter.continuations[tuple(prompt)] = ref
            req = token_request(prompt, 30)
            req.request_id = f"{name}-{len(prompt)}-{rng.integers(1 << 30)}"
            chunks, done = generate(stack.stub, req)
            assert streamed_ids(chunks) == ref[:30]
            seen = next(v for k, v in stack.drafter.seen.items() if k.startswith(req.request_id + "#"))
            for pos, (_, row) in seen.items():
                np.testing.assert_array_equal(row, feats[pos])
    finally:
        stack.stop()


@pytest.mark.parametrize("plan", [None, 2, 0, -1])
def test_at_most_two_worker_calls_per_step(stack, reference, monkeypatch, plan):
    """architecture.md: per step the coordinator makes at most two worker calls on the hot path
    (Propose, then Verify with the commit folded in); counted at the coordinator's single RPC gate and
    at its IPC streams' early sends (a Propose sent at the last verify's answer)."""
    from specd.coordinator import server as cserver

    prompt = [3, 1, 4, 1, 5]
    ref, _ = reference(prompt, 40)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = plan
    calls = []
    real = cserver.Coordinator._call

    async def counting(self, fn, msg, deadline, what):
        calls.append(what)
        return await real(self, fn, msg, deadline, what)

    send_early = cserver.IpcStream.send_early

    def counting_early(self, msg, deadline):
        calls.append("propose")  # only Proposes are sent early
        return send_early(self, msg, deadline)

    monkeypatch.setattr(cserver.Coordinator, "_call", counting)
    monkeypatch.setattr(cserver.IpcStream, "send_early", counting_early)
    chunks, done = generate(stack.stub, token_request(prompt, 24, ignore_eos=True))
    assert streamed_ids(chunks) == ref[:24]
    steps = done.timing.steps
    hot = [c for c in calls if c not in ("prefill",)]
    assert steps > 0 and len(hot) <= 2 * steps, (calls, steps)
    assert calls.count("verify") == steps  # one target forward per step
    assert "commit" not in calls  # the commit rides on the verify
    assert calls.count("prefill") == 1
