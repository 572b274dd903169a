"""Finish rules applied exactly inside an accepted block (C01, C02, C04), stop strings across tokens,
special-token stop strings (C24), incremental UTF-8-safe text."""
from __future__ import annotations

import pytest

from specd.coordinator.finish import Finisher, IncrementalDetokenizer
from specd.protos.v1 import generate_pb2 as gpb

from .conftest import BLOCK, generate, streamed_ids, token_request

PROMPT = [11, 42, 7, 99, 3, 250, 18]


def first_unique_positions(ref, upto):
    """Positions j < upto whose token does not occur earlier in ref."""
    return [j for j in range(upto) if ref[j] not in ref[:j]]


@pytest.mark.parametrize("include_stop", [False, True])
def test_c01_c02_stop_token_at_every_position_of_an_accepted_block(stack, reference, include_stop):
    """All drafts right (they continue past the stop, C02); the stop id sits at position j. Output is
    ref[:j] (+ the stop token with include_stop), finish "stop", usage == what was sent, and nothing
    after the stop (not even the bonus) reaches the client."""
    ref, _ = reference(PROMPT, 3 * BLOCK + 4)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    stack.drafter.plan = None
    positions = first_unique_positions(ref, 2 * BLOCK + 2)
    assert len(positions) >= 4, "degenerate reference continuation"
    for j in positions:
        stop = ref[j]
        chunks, done = generate(stack.stub, token_request(PROMPT, 3 * BLOCK, stop_token_ids=[stop],
                                                          include_stop=include_stop, ignore_eos=True))
        want = ref[: j + 1] if include_stop else ref[:j]
        assert streamed_ids(chunks) == want, f"stop at {j}"
        assert done.finish_reason == "stop" and done.finish == gpb.FINISH_REASON_STOP
        assert done.matched_token_id == stop
        assert done.usage.completion_tokens == len(want) == len(done.output_ids)


def test_c01_stop_beyond_budget_is_length(stack, reference):
    ref, _ = reference(PROMPT, 3 * BLOCK + 4)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    stack.drafter.plan = None
    later = [j for j in first_unique_positions(ref, len(ref)) if j >= 5]
    assert later
    chunks, done = generate(stack.stub, token_request(PROMPT, 5, stop_token_ids=[ref[later[0]]], ignore_eos=True))
    assert streamed_ids(chunks) == ref[:5]
    assert done.finish_reason == "length" and done.usage.completion_tokens == 5


@pytest.mark.parametrize("max_tokens", range(1, 2 * BLOCK + 4))
def test_c04_budget_cut_inside_a_block(stack, reference, max_tokens):
    """The budget ends inside what the drafter offers: exactly max_tokens tokens are sent, usage and
    stats agree (accepted drafts + one target token per step == tokens sent)."""
    ref, _ = reference(PROMPT, 3 * BLOCK + 4)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    stack.drafter.plan = None
    chunks, done = generate(stack.stub, token_request(PROMPT, max_tokens, ignore_eos=True))
    assert streamed_ids(chunks) == ref[:max_tokens]
    assert done.usage.completion_tokens == max_tokens == len(done.output_ids)
    assert chunks[-1].completion_tokens == max_tokens
    sp = done.speculation
    steps = sp.num_drafts + sp.num_plain_steps
    assert 1 + steps + sp.num_accepted_tokens == max_tokens  # prefill token + one per step + accepted


def _text_case(stack, reference, n=40):
    tok = stack.default_tokenizer()
    prompt = tok.encode("The quick brown fox", add_special_tokens=False).ids
    ref, _ = reference(prompt, n + BLOCK + 2)
    stack.drafter.continuations[tuple(prompt)] = ref
    return tok, prompt, ref


def test_stop_string_split_across_tokens(stack, reference):
    tok, prompt, ref = _text_case(stack, reference)
    pieces = [tok.decode([t]) for t in ref[:30]]
    # a stop string made of the end of token i's text and the start of token i+1's text
    cands = [(i, pieces[i][-1] + pieces[i + 1][0]) for i in range(1, 29)
             if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]]
    assert cands, "no printable token pair in the continuation"
    for plan, include in ((None, False), (1, False), (None, True)):
        stack.drafter.plan = plan
        for _, stop in cands[:4]:
            n = next(n for n in range(1, 31) if stop in tok.decode(ref[:n]))  # tokens until the match
            full = tok.decode(ref[:n])
            cut = full.index(stop) + (len(stop) if include else 0)
            req = gpb.GenerateRequest(tokenized=gpb.TokenizedInput(input_ids=prompt),
                                      stopping=gpb.StoppingParams(max_tokens=40, stop=[stop], ignore_eos=True,
                                                                  include_stop=include))
            chunks, done = generate(stack.stub, req)
            assert streamed_ids(chunks) == ref[:n], repr(stop)
            assert done.text == full[:cut] == "".join(c.text for c in chunks)
            assert done.finish_reason == "stop" and done.matched_stop_str == stop
            assert done.usage.completion_tokens == n


def test_text_deltas_concatenate_to_the_decoded_output(stack, reference):
    tok, prompt, ref = _text_case(stack, reference)
    stack.drafter.plan = 3
    req = gpb.GenerateRequest(text="The quick brown fox", stopping=gpb.StoppingParams(max_tokens=30, ignore_eos=True))
    chunks, done = generate(stack.stub, req)
    assert streamed_ids(chunks) == ref[:30]
    assert "".join(c.text for c in chunks) == done.text == tok.decode(ref[:30])


def test_incremental_detokenizer_never_splits_a_character(stack):
    tok = stack.default_tokenizer()
    ids = tok.encode("é€😀 ok", add_special_tokens=False).ids
    # byte-level BPE: make sure at least one character spans several tokens
    byte_ids = [tok.token_to_id(c) for c in "Ã©"]  # the two byte tokens of "é" (C3 A9)
    for seq in (ids, byte_ids):
        d = IncrementalDetokenizer(tok)
        out = [d.push(t) for t in seq]
        assert all("\ufffd" not in o for o in out)
        assert "".join(out) + d.flush() == tok.decode(seq)
    d = IncrementalDetokenizer(tok)
    assert d.push(byte_ids[0]) == "" and d.push(byte_ids[1]) == "é"


def test_stop_string_is_held_back_until_decided(stack):
    tok = stack.default_tokenizer()
    ids = tok.encode("abcdef", add_special_tokens=False).ids
    f = Finisher(50, {}, ["cdX"], tokenizer=tok)
    sent = ""
    for t in ids:
        f.push(t)
        sent += f.take_text()
    assert not f.done and sent == "abcd"  # the last len("cdX") - 1 characters are held back
    f2 = Finisher(50, {}, ["cd"], tokenizer=tok)
    sent = ""
    for t in ids:
        if f2.push(t):
            break
        sent += f2.take_text()
    sent += f2.take_text()
    assert sent == "ab" and f2.reason == "stop"


def test_c24_special_tokens_single_ids_and_stop_string(stack):
    """<|im_start|>/<|im_end|>/<think> in a rendered chat template encode to one id each, and a stop
    string "<|im_end|>" matches that id even though special tokens are skipped in the text."""
    tok = stack.default_tokenizer()
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    for name in ("<|im_start|>", "<|im_end|>", "<think>"):
        assert added[name] in ids
    coord = stack.coords[0][0]
    req = gpb.GenerateRequest(tokenized=gpb.TokenizedInput(input_ids=[1, 2]),
                              stopping=gpb.StoppingParams(max_tokens=8, stop=["<|im_end|>"]))
    fin = coord._finisher(req, 2)
    a = tok.encode("ab", add_special_tokens=False).ids
    for t in a:
        assert not fin.push(t)
    assert fin.push(added["<|im_end|>"])
    assert fin.reason == "stop" and fin.matched == "<|im_end|>" and fin.ids == a
    assert fin.take_text() == "ab"


def test_c02_model_eos_inside_an_accepted_block(stack, reference):
    """C02 with the model's own EOS path (not a request stop id): the coordinator's EOS set is pointed
    at a token the greedy run reaches at draft position 3, the drafter continues past it correctly.
    Generation ends at that token, excluded; with ignore_eos it is generated through."""
    ref, _ = reference(PROMPT, 3 * BLOCK + 4)
    stack.drafter.continuations[tuple(PROMPT)] = ref
    stack.drafter.plan = None
    j = next(j for j in first_unique_positions(ref, len(ref)) if j >= 4)  # inside the first verify block
    coord = stack.coords[0][0]
    saved = list(coord.eos_ids)
    coord.eos_ids = [ref[j]]
    try:
        chunks, done = generate(stack.stub, token_request(PROMPT, 3 * BLOCK))
        assert streamed_ids(chunks) == ref[:j] and done.finish_reason == "stop"
        assert done.matched_token_id == ref[j] and done.usage.completion_tokens == j
        chunks, done = generate(stack.stub, token_request(PROMPT, 3 * BLOCK, ignore_eos=True))
        assert streamed_ids(chunks) == ref[: 3 * BLOCK] and done.finish_reason == "length"
    finally:
        coord.eos_ids = saved


@pytest.mark.parametrize("stop_at", [None, 9])
def test_token_by_token_streaming(stack, reference, stop_at):
    """stream_options.token_by_token: one token per chunk, same ids, text and finish as per-step chunks."""
    tok, prompt, ref = _text_case(stack, reference)
    stack.drafter.plan = None
    out = []
    for tbt in (False, True):
        req = gpb.GenerateRequest(tokenized=gpb.TokenizedInput(input_ids=prompt),
                                  stopping=gpb.StoppingParams(max_tokens=20, ignore_eos=True))
        if stop_at is not None and ref[stop_at] not in ref[:stop_at]:
            req.stopping.stop_token_ids.append(ref[stop_at])
        req.stream_options.token_by_token = tbt
        chunks, done = generate(stack.stub, req)
        if tbt:
            assert all(len(c.token_ids) <= 1 for c in chunks)
            assert [c.completion_tokens for c in chunks if c.token_ids] == list(range(1, len(done.output_ids) + 1))
        else:
            assert max(len(c.token_ids) for c in chunks) > 1
        out.append((streamed_ids(chunks), "".join(c.text for c in chunks), done.text, done.finish_reason))
    assert out[0] == out[1]


def test_first_token_is_a_stop(stack, reference):
    """The prefill's token is itself a stop id: no token is sent, finish "stop", usage 0."""
    ref, _ = reference(PROMPT, 4)
    chunks, done = generate(stack.stub, token_request(PROMPT, 8, stop_token_ids=[ref[0]], ignore_eos=True))
    assert streamed_ids(chunks) == [] and done.finish_reason == "stop" and done.usage.completion_tokens == 0
    chunks, done = generate(stack.stub, token_request(PROMPT, 1, ignore_eos=True))
    assert streamed_ids(chunks) == ref[:1] and done.finish_reason == "length"
