"""Thinking on/off and the reasoning budget (spec-loop.md §10), over real gRPC.

(a) ``enable_thinking`` renders like transformers' ``apply_chat_template`` (tiny-model template and the
    shipped demo target's template); (b) with a budget B the output equals a hand-driven greedy
    Qwen35Model run in which the close sequence is forced after exactly B thinking tokens, with the
    scripted oracle drafter at several acceptance lengths (chain and tree) so the edge falls at every
    place of a block; (c) max_tokens <= B + reply_reserve: not armed, plain greedy, PolicySwitch
    "budget"; (d) thinking that closes by itself before the budget is unaffected (demo target).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specd.native as sn
from specd.coordinator.config import CoordinatorConfig
from specd.coordinator.policy import PolicyConfig
from specd.coordinator.reasoning import ReasoningBudget
from specd.coordinator.server import Coordinator, load_tokenizer
from specd.protos.v1 import generate_pb2 as gpb
from specd.target_worker.gguf_loader import load_qwen35
from specd.target_worker.model import Qwen35Model

from .conftest import CAPTURE, Stack, generate, make_reference, streamed_ids

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-target.gguf"
CLOSE_TEXT = "\n</think>\n\n"
MSGS = [("system", "You are terse."), ("user", "The quick brown fox")]


def chat_request(max_tokens, enable_thinking=None, budget=None, speculation=None, rid="", msgs=MSGS):
    req = gpb.GenerateRequest(request_id=rid, stopping=gpb.StoppingParams(max_tokens=max_tokens, ignore_eos=True))
    for role, content in msgs:
        req.chat.messages.add(role=role, content=content)
    if enable_thinking is not None:
        req.chat.enable_thinking = enable_thinking
    if budget is not None:
        req.reasoning_budget = budget
    if speculation is not None:
        req.speculation.CopyFrom(speculation)
    return req


def hf_render(tokenizer, template, enable_thinking):
    """transformers' apply_chat_template over the same template (the oracle)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return hf.apply_chat_template([{"role": r, "content": c} for r, c in MSGS], chat_template=template,
                                  tokenize=False, add_generation_prompt=True, **kw)


def think_ids(tok):
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    return added["<think>"], added["</think>"], tok.encode(CLOSE_TEXT, add_special_tokens=False).ids


def budget_reference(model, prompt, budget, close, n, open_id, close_id):
    """Greedy Qwen35Model run, driven by hand: greedy until ``budget`` thinking tokens (inside an open
    <think>, the markers not counted), then the close ids forced (fed like generated tokens), then
    greedy again. Returns (tokens [n], thinking tokens, forced)."""
    st = model.new_sequence(len(prompt) + n + 2)
    logits = model.prefill(st, list(prompt))
    in_think = ReasoningBudget.prompt_in_think(prompt, open_id, close_id)
    out, queue, count, forced = [], [], 0, 0
    while len(out) < n:
        if budget and not queue and in_think and count >= budget:
            queue = list(close)
        if queue:
            t = queue.pop(0)
            forced += 1
            if t == close_id:
                in_think = False
        else:
            t = int(logits.argmax())
            if t == close_id:
                in_think = False
            elif t == open_id:
                in_think = True
            elif in_think:
                count += 1
        out.append(t)
        logits = model.decode(st, t)
    return out, count, forced


@pytest.fixture(scope="module")
def rstack(target_gguf):
    """The tiny-model stack with a coordinator whose reply_reserve is small (short runs)."""
    s = Stack(target_gguf, policy=PolicyConfig(step_ratio=0), reply_reserve=8)
    yield s
    s.stop()


def coord_prompt(stack, req):
    return stack.coords[0][0]._prompt(req)


# ---------------------------------------------------------------------- (a) rendering


@pytest.mark.parametrize("enable", [None, True, False])
def test_enable_thinking_renders_like_transformers(rstack, reference, enable):
    coord = rstack.coords[0][0]
    tok = coord.tok.tokenizer
    text = hf_render(tok, coord.tok.chat_template, enable)
    if enable is False:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert text.endswith("<|im_start|>assistant\n<think>\n")
    want = tok.encode(text, add_special_tokens=False).ids
    req = chat_request(6, enable)
    assert coord_prompt(rstack, req) == want
    # end to end: the served output is the greedy continuation of exactly that prompt
    chunks, done = generate(rstack.stub, req)
    assert done.usage.prompt_tokens == len(want)
    assert streamed_ids(chunks) == reference(want, 6)[0]


@pytest.mark.parametrize("enable", [None, True, False])
def test_demo_template_enable_thinking_like_transformers(enable):
    if not DEMO.is_file():
        pytest.skip(f"{DEMO} not present")
    info = load_tokenizer(str(DEMO))
    coord = Coordinator(CoordinatorConfig(), tokenizer_info=info)
    msgs = [{"role": r, "content": c} for r, c in MSGS]
    kw = {} if enable is None else {"enable_thinking": enable}
    ours = coord._chat_template().render(messages=msgs, add_generation_prompt=True, **kw)
    assert ours == hf_render(info.tokenizer, info.chat_template, enable)
    assert ours.endswith("<think>\n\n</think>\n\n") == (enable is False)


# ---------------------------------------------------------------------- (b) budget forced


CASES = [  # (budget, max_draft_tokens, plan, tree)
    (b, cap, plan, False) for b in (1, 4, 7, 9) for cap, plan in ((6, None), (4, None), (6, 2), (3, 1), (6, 0))
] + [(5, 6, None, True), (8, 6, 2, True)]


@pytest.mark.parametrize("past", ["forced", "plain"])
@pytest.mark.parametrize("budget,cap,plan,tree", CASES)
def test_budget_forces_close_after_exactly_b_thinking_tokens(rstack, plain_model, budget, cap, plan, tree, past):
    coord = rstack.coords[0][0]
    tok = coord.tok.tokenizer
    open_id, close_id, close = think_ids(tok)
    assert close_id in close and len(close) >= 2
    n = 30
    req = chat_request(n, True, budget, gpb.SpeculationParams(
        mode=gpb.SPECULATION_MODE_FORCE, max_draft_tokens=cap,
        draft_mode=gpb.DRAFT_MODE_TREE if tree else gpb.DRAFT_MODE_CHAIN), rid=f"rb-{budget}-{cap}-{plan}-{tree}")
    prompt = coord_prompt(rstack, req)
    assert ReasoningBudget.prompt_in_think(prompt, open_id, close_id)
    ref, count, forced = budget_reference(plain_model, prompt, budget, close, n, open_id, close_id)
    assert count == budget and forced == len(close), "the tiny model closed thinking by itself"
    plain = budget_reference(plain_model, prompt, 0, close, n, open_id, close_id)[0]
    assert plain[:budget] == ref[:budget] and plain[budget] != ref[budget]
    # drafts past the edge: "plain" = the model's own thinking continuation (the target would accept
    # it, so the drafts must be clipped at the edge); "forced" = the oracle of the forced output
    rstack.drafter.continuations[tuple(prompt)] = plain if past == "plain" else ref
    rstack.drafter.plan = plan
    rstack.drafter.topk_ranks = None
    req.request_id += "-" + past
    chunks, done = generate(rstack.stub, req)
    assert streamed_ids(chunks) == ref == list(done.output_ids)
    sp = done.speculation
    assert sp.reasoning_budget_armed and sp.reasoning_budget_closed
    assert sp.thinking_tokens == budget and sp.forced_tokens == len(close)
    assert not [s for s in sp.policy_switches if s.reason == "budget"]
    assert sp.num_drafts > 0  # speculation ran (before and after the close)
    if plan is None and budget > 1:
        assert sp.num_accepted_tokens > 0
    # only the close tokens after the first needed plain steps (plus budget-edge steps with k = 0)
    assert 1 + sp.num_drafts + sp.num_plain_steps + sp.num_accepted_tokens == n
    # the drafter ingested the forced tokens like any committed token
    seq = next(k for k in rstack.drafter.seen if k.startswith(req.request_id + "#"))
    seen = rstack.drafter.seen[seq]
    for p, (t, _) in seen.items():
        if p >= len(prompt):
            assert t == ref[p - len(prompt)]
    assert {len(prompt) + budget + i for i in range(len(close))} <= set(seen)


def test_budget_step_clipping_keeps_speculating(rstack, plain_model):
    """Oracle drafter, budget 9 with 6-token blocks: the drafts are clipped at the edge (3 drafts in
    the second step), never abandoned for plain steps; the only plain steps feed close tokens."""
    coord = rstack.coords[0][0]
    open_id, close_id, close = think_ids(coord.tok.tokenizer)
    n, budget = 30, 9
    req = chat_request(n, True, budget, gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, max_draft_tokens=6),
                       rid="rb-clip")
    prompt = coord_prompt(rstack, req)
    ref, _, _ = budget_reference(plain_model, prompt, budget, close, n, open_id, close_id)
    rstack.drafter.continuations[tuple(prompt)] = ref
    rstack.drafter.plan = None
    chunks, done = generate(rstack.stub, req)
    assert streamed_ids(chunks) == ref
    sizes = [len(c.token_ids) for c in chunks]
    # prefill token (thinking 1), 6 drafts + bonus (8), then 1 draft (the 9th) + the bonus replaced by
    # close[0]; the rest of the close sequence takes one plain step per token, then speculation resumes
    assert sizes[:3] == [1, 7, 2]
    assert done.speculation.num_plain_steps == len(close) - 1


# ---------------------------------------------------------------------- (c) not armed


@pytest.mark.parametrize("max_tokens", [12, 16, 20])
def test_budget_not_armed_when_max_tokens_leaves_no_reply_room(rstack, reference, max_tokens):
    budget = 12  # reply_reserve 8: armed only for max_tokens > 20
    req = chat_request(max_tokens, True, budget, gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE))
    prompt = coord_prompt(rstack, req)
    ref = reference(prompt, max_tokens)[0]
    rstack.drafter.continuations[tuple(prompt)] = ref
    rstack.drafter.plan = None
    chunks, done = generate(rstack.stub, req)
    assert streamed_ids(chunks) == ref
    sp = done.speculation
    assert not sp.reasoning_budget_armed and not sp.reasoning_budget_closed and sp.forced_tokens == 0
    sw = [s for s in sp.policy_switches if s.reason == "budget"]
    assert len(sw) == 1 and sw[0].step_index == 0 and sw[0].to_speculative
    assert sp.num_accepted_tokens > 0  # speculation unaffected


def test_budget_zero_and_thinking_off_are_unmanaged(rstack, reference):
    for enable, budget in ((True, 0), (False, 3)):
        req = chat_request(24, enable, budget, gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE))
        prompt = coord_prompt(rstack, req)
        ref = reference(prompt, 24)[0]
        rstack.drafter.continuations[tuple(prompt)] = ref
        rstack.drafter.plan = None
        chunks, done = generate(rstack.stub, req)
        assert streamed_ids(chunks) == ref
        sp = done.speculation
        assert not sp.reasoning_budget_closed and sp.forced_tokens == 0
        assert not [s for s in sp.policy_switches if s.reason == "budget"]


def test_server_default_budget_and_validation(target_gguf, plain_model):
    """--reasoning-budget as the server default; a request's 0 turns it off."""
    s = Stack(target_gguf, policy=PolicyConfig(step_ratio=0), reply_reserve=8, reasoning_budget=4)
    try:
        coord = s.coords[0][0]
        open_id, close_id, close = think_ids(coord.tok.tokenizer)
        req = chat_request(24, True)
        prompt = coord_prompt(s, req)
        ref, _, _ = budget_reference(plain_model, prompt, 4, close, 24, open_id, close_id)
        s.drafter.continuations[tuple(prompt)] = ref
        chunks, done = generate(s.stub, req)
        assert streamed_ids(chunks) == ref and done.speculation.reasoning_budget_closed
        chunks, done = generate(s.stub, chat_request(24, True, 0))
        assert not done.speculation.reasoning_budget_armed
    finally:
        s.stop()
    with pytest.raises(ValueError):
        CoordinatorConfig(reasoning_close="\n\n").validate()


# ---------------------------------------------------------------------- (d) closes by itself


@pytest.fixture(scope="module")
def demo_stack():
    if not DEMO.is_file():
        pytest.skip(f"{DEMO} not present")
    s = Stack(str(DEMO), policy=PolicyConfig(step_ratio=0), reply_reserve=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def demo_model():
    return Qwen35Model(load_qwen35(str(DEMO)), capture_layers=CAPTURE, kv_dtype=sn.DType.F32)


DEMO_TEXT = "<|im_start|>user\nWhat does ls do?<|im_end|>\n<|im_start|>assistant\n<think>\n"


def text_request(text, max_tokens, budget=None, speculation=None):
    req = gpb.GenerateRequest(text=text, stopping=gpb.StoppingParams(max_tokens=max_tokens, ignore_eos=True))
    if budget is not None:
        req.reasoning_budget = budget
    if speculation is not None:
        req.speculation.CopyFrom(speculation)
    return req


def test_thinking_that_closes_before_the_budget_is_unaffected(demo_stack, demo_model):
    """The demo target, given a generation prompt that opens <think> (a text prompt), thinks ~16 tokens
    and closes by itself; a larger budget changes nothing, a smaller one forces the close. (With its
    own template it opens and closes an empty thinking section itself: <think> generated, 1 token.)"""
    coord = demo_stack.coords[0][0]
    open_id, close_id, close = think_ids(coord.tok.tokenizer)
    n = 40
    force = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE)
    prompt = coord_prompt(demo_stack, text_request(DEMO_TEXT, n))
    assert ReasoningBudget.prompt_in_think(prompt, open_id, close_id)
    plain, natural, forced = budget_reference(demo_model, prompt, 0, close, n, open_id, close_id)
    assert close_id in plain and forced == 0 and natural >= 4, "the demo model no longer closes by itself"
    demo_stack.drafter.continuations[tuple(prompt)] = plain
    for plan in (None, 2):
        demo_stack.drafter.plan = plan
        chunks, done = generate(demo_stack.stub, text_request(DEMO_TEXT, n, natural + 3, force))
        assert streamed_ids(chunks) == plain
        sp = done.speculation
        assert sp.reasoning_budget_armed and not sp.reasoning_budget_closed and sp.forced_tokens == 0
        assert sp.thinking_tokens == natural
    # a budget below the natural length: forced after exactly that many thinking tokens
    small = natural // 2
    ref, count, forced = budget_reference(demo_model, prompt, small, close, n, open_id, close_id)
    assert count == small and forced == len(close)
    demo_stack.drafter.continuations[tuple(prompt)] = ref
    demo_stack.drafter.plan = None
    chunks, done = generate(demo_stack.stub, text_request(DEMO_TEXT, n, small, force))
    assert streamed_ids(chunks) == ref and done.speculation.reasoning_budget_closed
    assert done.speculation.thinking_tokens == small


def test_demo_template_generated_think_is_tracked(demo_stack, demo_model):
    """The demo template's generation prompt opens nothing; the model writes <think> itself and the
    tracker follows it (thinking counted, never forced under a budget it does not reach)."""
    coord = demo_stack.coords[0][0]
    open_id, close_id, close = think_ids(coord.tok.tokenizer)
    req = chat_request(24, msgs=[("user", "What does ls do?")], budget=5,
                       speculation=gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE))
    prompt = coord_prompt(demo_stack, req)
    assert not ReasoningBudget.prompt_in_think(prompt, open_id, close_id)
    plain, natural, forced = budget_reference(demo_model, prompt, 0, close, 24, open_id, close_id)
    assert open_id in plain and close_id in plain and natural < 5
    demo_stack.drafter.continuations[tuple(prompt)] = plain
    demo_stack.drafter.plan = None
    chunks, done = generate(demo_stack.stub, req)
    assert streamed_ids(chunks) == plain
    assert done.speculation.thinking_tokens == natural and not done.speculation.reasoning_budget_closed


def test_tracker_generated_think_open_and_close():
    rb = ReasoningBudget(3, open_id=1, close_id=2, close_seq=[9, 2, 9], in_think=False)
    assert rb.room() is None
    assert rb.apply([5, 1, 6]) == [5, 1, 6] and rb.in_think and rb.count == 1
    assert rb.room() == 2
    assert rb.apply([7, 2]) == [7, 2] and not rb.in_think and not rb.closed  # closed by itself
    rb = ReasoningBudget(2, 1, 2, [9, 2, 9], in_think=True)
    assert rb.apply([5, 6, 7]) == [5, 6, 9] and rb.closed and rb.room() == 0
    assert rb.apply([3]) == [2] and rb.apply([3]) == [9] and rb.room() is None and rb.forced == 3


def test_cli_generate_no_thinking_and_budget(rstack, capsys):
    """`specd generate --chat ... --no-thinking --reasoning-budget N` against the running stack, and
    `specd coordinator` flags for the server defaults."""
    import argparse
    import json

    from specd.coordinator import app, client

    coord = rstack.coords[0][0]
    p = argparse.ArgumentParser()
    client.add_arguments(p)
    args = p.parse_args(["--server", coord.cfg.listen, "--chat", "The quick brown fox", "--no-thinking",
                         "--reasoning-budget", "3", "--max-tokens", "24", "--ignore-eos", "--json"])
    req = client.build_request(args)
    assert req.chat.HasField("enable_thinking") and not req.chat.enable_thinking and req.reasoning_budget == 3
    assert client.run(args) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["usage"]["completion_tokens"] == 24
    sp = done["speculation"]
    assert sp.get("reasoning_budget_armed") and not sp.get("reasoning_budget_closed")  # thinking off: nothing to close
    args = p.parse_args(["--chat", "hi", "--thinking"])
    assert client.build_request(args).chat.enable_thinking
    with pytest.raises(ValueError):
        client.build_request(p.parse_args(["--prompt", "hi", "--no-thinking"]))
    q = argparse.ArgumentParser()
    app.add_arguments(q)
    cfg = app.config_from_args(q.parse_args(["--reasoning-budget", "256", "--reply-reserve", "32"]))
    assert cfg.reasoning_budget == 256 and cfg.reply_reserve == 32 and cfg.reasoning_close == "\n</think>\n\n"
