"""Real drafters in the drafter worker (DFlash, DSpark, DFlash 2 over the tiny target) in chain and
DDTree mode, the DSpark confidence gate, and the start-up pair check — real gRPC over Unix sockets.

Every generation's streamed ids must equal a plain greedy run of Qwen35Model (architecture.md
invariant 1). The tiny drafters are random (tests/drafter/tinydrafters.py at the target's dims: H =
128, V = 320, taps = the stack's capture layers (0, 2) < 4 target layers), so their drafts are rarely
accepted; acceptance through tree branches is exercised with the scripted drafter in
test_ddtree.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from specd.draft_worker import server as dserver
from specd.draft_worker.engine import ModelDrafter, open_model_drafter
from specd.draft_worker.gguf_loader import DrafterPairError
from specd.protos.v1 import generate_pb2 as gpb

from .conftest import CAPTURE, generate, streamed_ids, token_request

sys.path.insert(0, str(Path(__file__).parents[1] / "drafter"))
import tinydrafters as td  # noqa: E402

FAMILIES = ("dflash", "dspark", "dflash2")
# the tiny target "condgen": hidden 128, vocab 320, 4 layers; taps = the stack's capture layers
DIMS = dict(vocab=320, hidden=128, inter=128, layers=2, heads=4, kv_heads=2, head_dim=32,
            taps=list(CAPTURE), n_target=4, block=5, mask=300)
PROMPTS = [[5, 17, 3, 99, 250], [1], [42, 42, 7, 300, 12, 8, 19, 77, 2]]
MAX_TOKENS = 14


def make_gguf(tmp, family: str, seed: int = 7, **dims) -> str:
    """A tiny random drafter GGUF of ``family`` (F32) at DIMS overridden by ``dims``."""
    kw = {"sliding": "all"} if family == "dflash2" else {}
    cfg = td.make_config(family, dims={**DIMS, **dims}, **kw)
    folder, _, _ = td.make_drafter(Path(tmp) / f"{family}-{seed}-{len(dims)}", family, np.random.default_rng(seed),
                                   dtype="F32", cfg=cfg, scales=td.FORWARD_SCALES)
    return str(td.convert_tiny(folder, "f32"))


@pytest.fixture(scope="module")
def drafter_stacks(stack, target_gguf, tmp_path_factory):
    """family -> (SpecDecode stub, ModelDrafter): one real drafter worker per family on the shared
    target worker, each with its own coordinator; the drafter servers are stopped at the end."""
    tmp = tmp_path_factory.mktemp("drafters")
    out, servers = {}, []
    try:
        for fam in FAMILIES:
            d = open_model_drafter(make_gguf(tmp, fam), target_gguf)
            svc = dserver.DraftServicer(d)
            addr = f"unix://{stack.dir}/d-{fam}.sock"
            srv, _ = dserver.start_server(svc, addr, 8)
            servers.append((srv, svc))
            out[fam] = (stack.coordinator(drafter_override=addr), d)
        yield out
    finally:
        for srv, svc in servers:
            srv.stop(0).wait()
            svc.close()


def run(stub, prompt, **spec):
    sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, **spec)
    chunks, done = generate(stub, token_request(prompt, MAX_TOKENS, ignore_eos=True, speculation=sp))
    assert list(done.output_ids) == streamed_ids(chunks)
    return streamed_ids(chunks), done


@pytest.mark.parametrize("family", FAMILIES)
def test_chain_mode_equals_plain_greedy(drafter_stacks, reference, family):
    stub, d = drafter_stacks[family]
    for prompt in PROMPTS:
        got, done = run(stub, prompt)
        assert got == reference(prompt, MAX_TOKENS)[0], (family, prompt)
        sp = done.speculation
        assert sp.num_drafts > 0 and sp.num_draft_tokens >= sp.num_drafts and sp.num_tree_steps == 0
        assert len(sp.accepted_per_position) <= d.block_size and not sp.accepted_per_rank
    assert d.live() == []  # released after every request


def test_drafter_info_reports_family_and_capabilities(drafter_stacks):
    for fam, (_, d) in drafter_stacks.items():
        assert d.family == fam and d.target_layer_ids == CAPTURE
        assert d.has_confidence == (fam == "dspark")
        assert d.max_top_k == (td.DF2["selector_top_k"] if fam == "dflash2" else DIMS["vocab"])
        assert d.block_size == (DIMS["block"] if fam == "dspark" else DIMS["block"] - 1)


def test_dspark_confidence_gate(drafter_stacks, reference):
    """With and without the gate the output is the plain greedy run; a high threshold proposes
    fewer drafts (truncated at the first low-confidence one), 0 is off."""
    stub, _ = drafter_stacks["dspark"]
    for prompt in PROMPTS:
        ref = reference(prompt, MAX_TOKENS)[0]
        off, d_off = run(stub, prompt)
        zero, d_zero = run(stub, prompt, confidence_threshold=0.0)
        hi, d_hi = run(stub, prompt, confidence_threshold=0.999)
        mid, d_mid = run(stub, prompt, confidence_threshold=0.5)
        assert off == zero == hi == mid == ref
        assert d_zero.speculation.num_draft_tokens == d_off.speculation.num_draft_tokens
        assert d_hi.speculation.num_draft_tokens <= d_mid.speculation.num_draft_tokens \
            <= d_off.speculation.num_draft_tokens
        assert d_hi.speculation.num_draft_tokens < d_off.speculation.num_draft_tokens


def test_confidence_gate_refused_without_a_confidence_head(drafter_stacks):
    import grpc

    stub, _ = drafter_stacks["dflash"]
    with pytest.raises(grpc.RpcError) as e:
        run(stub, [1, 2], confidence_threshold=0.5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "confidence" in e.value.details()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [2, 5, 12])
def test_ddtree_equals_plain_greedy(drafter_stacks, reference, family, budget):
    stub, d = drafter_stacks[family]
    for prompt in PROMPTS[:2]:
        got, done = run(stub, prompt, draft_mode=gpb.DRAFT_MODE_TREE, tree_budget=budget)
        assert got == reference(prompt, MAX_TOKENS)[0], (family, budget, prompt)
        sp = done.speculation
        assert sp.num_tree_steps == sp.num_drafts > 0
        assert sp.num_draft_tokens <= budget * sp.num_drafts
        assert sum(sp.accepted_per_rank) == sp.num_accepted_tokens == sum(sp.accepted_per_position)


def test_ddtree_options_without_chain_seed_and_explicit_top_k(drafter_stacks, reference):
    stub, _ = drafter_stacks["dflash2"]
    prompt = PROMPTS[0]
    for kw in (dict(tree_chain_seed=False), dict(tree_top_k=2), dict(tree_top_k=1, tree_budget=3)):
        got, done = run(stub, prompt, draft_mode=gpb.DRAFT_MODE_TREE, **kw)
        assert got == reference(prompt, MAX_TOKENS)[0], kw
    import grpc

    with pytest.raises(grpc.RpcError) as e:  # above the DFlash 2 selector's K
        run(stub, prompt, draft_mode=gpb.DRAFT_MODE_TREE, tree_top_k=td.DF2["selector_top_k"] + 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_top_k" in e.value.details()


def test_model_drafter_matches_a_direct_drafter_run(drafter_stacks, reference):
    """What the worker proposes for a sequence equals DrafterModel run directly on the target's
    features (ingest of the committed positions, then one block after the anchor)."""
    prompt = PROMPTS[2]
    ref, feats = reference(prompt, 4)
    for fam, (_, d) in drafter_stacks.items():
        n = len(prompt) + 2  # committed: prompt + 2 generated tokens; anchor = the third
        toks = list(prompt) + ref[:2]
        seq = d.model.new_sequence(64)
        seq.ingest(feats[:n], 0)
        want = seq.propose(ref[2], n, topk=3 if fam != "dflash2" else 2)
        md = ModelDrafter(d.model)
        md.open("x", 32)
        md.ingest("x", 0, toks, feats[:n])
        got = md.propose("x", ref[2], 99, dserver.ProposeOptions(top_k=3 if fam != "dflash2" else 2))
        assert got.tokens == [int(t) for t in want.tokens]
        np.testing.assert_array_equal(got.top_k_ids, want.topk_ids)
        np.testing.assert_array_equal(got.top_k_logprobs, want.topk_logprobs)
        short = md.propose("x", ref[2], 2)  # a smaller block: B' = 2 + first_proposal_row
        assert len(short.tokens) == 2
        assert md.release("x") and md.live() == []


@pytest.mark.parametrize("what, dims, words", [
    ("vocabulary", dict(vocab=512, mask=500), ["vocabulary", "512", "320"]),
    ("hidden", dict(hidden=64, head_dim=16), ["hidden size", "64", "128"]),
    ("taps", dict(taps=[0, 5], n_target=6), ["tap ids", "[5]", "target depth"]),
])
def test_bad_pair_is_a_clear_start_up_error(target_gguf, tmp_path, what, dims, words):
    bad = make_gguf(tmp_path, "dflash", **dims)
    cfg = dserver.DraftWorkerConfig(drafter=bad, target=target_gguf)
    cfg.validate()
    with pytest.raises(DrafterPairError) as e:
        dserver.make_drafter(cfg)
    msg = str(e.value)
    assert bad in msg and target_gguf in msg, msg
    for w in words:
        assert w in msg, (what, msg)


def test_draft_worker_config_validation(target_gguf):
    with pytest.raises(ValueError, match="--target"):
        dserver.DraftWorkerConfig(drafter="d.gguf").validate()
    with pytest.raises(ValueError, match="kv-dtype"):
        dserver.DraftWorkerConfig(drafter="d.gguf", target=target_gguf, drafter_kv_dtype="bf16").validate()
    with pytest.raises(ValueError, match="context-cap"):
        dserver.DraftWorkerConfig(drafter="d.gguf", target=target_gguf, context_cap=-1).validate()
    with pytest.raises(ValueError, match="confidence_threshold"):
        dserver.ProposeOptions(confidence_threshold=1.5)


def test_coordinator_refuses_mismatched_taps_and_unusable_defaults(stack, target_gguf, tmp_path):
    """A drafter whose taps fit the target (< 4 layers) but differ from what the target captures,
    and server defaults the drafter cannot serve, stop the coordinator's start-up (its server is
    stopped again)."""
    cases = [(make_gguf(tmp_path, "dflash", taps=[0, 1]), {}, "capture layers"),
             (make_gguf(tmp_path, "dflash", seed=3), dict(confidence_threshold=0.5), "confidence head")]
    for i, (path, kw, words) in enumerate(cases):
        svc = dserver.DraftServicer(open_model_drafter(path, target_gguf))
        addr = f"unix://{stack.dir}/d-bad{i}.sock"
        srv, _ = dserver.start_server(svc, addr, 4)
        try:
            with pytest.raises(RuntimeError, match=words):
                stack.coordinator(drafter_override=addr, **kw)
        finally:
            srv.stop(0).wait()
            svc.close()


def test_concurrent_requests_with_a_real_drafter(drafter_stacks, reference):
    """Requests in flight together (chain and tree) through one DSpark drafter worker stay exact."""
    from concurrent.futures import ThreadPoolExecutor

    stub, d = drafter_stacks["dspark"]
    jobs = [(p, mode) for p in PROMPTS for mode in (gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        outs = list(ex.map(lambda j: run(stub, j[0], draft_mode=j[1], tree_budget=6)[0], jobs))
    for (p, _), got in zip(jobs, outs):
        assert got == reference(p, MAX_TOKENS)[0]
    assert d.live() == []


def test_coordinator_config_tree_flags():
    import argparse

    from specd.coordinator.config import CoordinatorConfig, add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--draft-mode", "tree", "--tree-budget", "7", "--tree-top-k", "3",
                                         "--no-tree-chain-seed", "--confidence-threshold", "0.25",
                                         "--tree-temperature", "0.5"]))
    assert (cfg.draft_mode, cfg.tree_budget, cfg.tree_top_k, cfg.tree_chain_seed, cfg.confidence_threshold,
            cfg.tree_temperature) == ("tree", 7, 3, False, 0.25, 0.5)
    d = config_from_args(p.parse_args([]))
    assert (d.draft_mode, d.tree_budget, d.tree_top_k, d.tree_chain_seed, d.confidence_threshold) == \
        ("chain", 12, 0, True, 0.0)
    for bad in (dict(draft_mode="bush"), dict(tree_budget=0), dict(tree_top_k=-1), dict(confidence_threshold=1.0),
                dict(tree_temperature=0.0)):
        with pytest.raises(ValueError):
            CoordinatorConfig(**bad).validate()


def test_dspark_tree_with_the_gate_and_a_context_cap(drafter_stacks, reference, stack, target_gguf, tmp_path):
    """DDTree over a gated DSpark proposal (the tree depth is the kept prefix) is exact; so is a
    drafter limited to the last 3 context rows (context_cap, drafters.md §3.7)."""
    stub, _ = drafter_stacks["dspark"]
    for prompt in PROMPTS:
        got, done = run(stub, prompt, draft_mode=gpb.DRAFT_MODE_TREE, tree_budget=5, confidence_threshold=0.5)
        assert got == reference(prompt, MAX_TOKENS)[0]
    d = open_model_drafter(make_gguf(tmp_path, "dflash", seed=11), target_gguf, context_cap=3, kv_dtype="f16")
    svc = dserver.DraftServicer(d)
    addr = f"unix://{stack.dir}/d-cap.sock"
    srv, _ = dserver.start_server(svc, addr, 4)
    try:
        cstub = stack.coordinator(drafter_override=addr)
        for prompt in PROMPTS:
            assert run(cstub, prompt)[0] == reference(prompt, MAX_TOKENS)[0]
    finally:
        srv.stop(0).wait()
        svc.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_output_token_equal_to_the_mask_id(stack, reference, tmp_path, target_gguf, family):
    """A drafter whose mask_token_id is a token the target actually emits (here: the first generated
    token, so it becomes the seed of the first drafted block, next to the mask rows): output still equals
    plain greedy decoding (issue: "a token whose id equals the mask id in the output")."""
    prompt = PROMPTS[0]
    ref = reference(prompt, MAX_TOKENS)[0]
    d = open_model_drafter(make_gguf(tmp_path, family, mask=int(ref[0])), target_gguf)
    assert d.hp.mask_token_id == ref[0]
    svc = dserver.DraftServicer(d)
    addr = f"unix://{stack.dir}/mask-{family}.sock"
    srv, _ = dserver.start_server(svc, addr, 8)
    try:
        got, done = run(stack.coordinator(drafter_override=addr), prompt)
        assert got == ref
        assert done.speculation.num_drafts > 0
    finally:
        srv.stop(0).wait()
        svc.close()


# ---------------------------------------------------------------- DSpark Markov modes (fused / unfused / off)

MARKOV = {"fused": gpb.DSPARK_MARKOV_FUSED, "unfused": gpb.DSPARK_MARKOV_UNFUSED, "off": gpb.DSPARK_MARKOV_OFF}


def _recording(d, monkeypatch):
    """Wraps ``d.propose`` so every call's resolved options and drafts are recorded."""
    calls, real = [], d.propose

    def propose(seq_id, anchor, max_tokens, options=None):
        out = real(seq_id, anchor, max_tokens, options)
        calls.append((options.dspark_markov if options is not None else "", list(out.tokens)))
        return out

    monkeypatch.setattr(d, "propose", propose)
    return calls


@pytest.mark.parametrize("draft_mode", [gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE])
def test_dspark_markov_modes_equal_plain_greedy(drafter_stacks, reference, monkeypatch, draft_mode):
    """Each Markov mode's streamed ids equal plain greedy (chain and DDTree); the mode reaches the
    drafter through SpeculationParams -> ProposeRequest; fused and unfused propose the same drafts
    (bitwise-identical paths), off proposes different ones on this random drafter."""
    stub, d = drafter_stacks["dspark"]
    calls = _recording(d, monkeypatch)
    drafts = {}
    for name, val in [("default", gpb.DSPARK_MARKOV_DEFAULT)] + list(MARKOV.items()):
        calls.clear()
        for prompt in PROMPTS:
            got, done = run(stub, prompt, dspark_markov=val, draft_mode=draft_mode, tree_budget=5)
            assert got == reference(prompt, MAX_TOKENS)[0], (name, prompt)
            assert done.speculation.num_drafts > 0
            assert done.speculation.dspark_markov == (val or gpb.DSPARK_MARKOV_FUSED)  # reported as applied
        assert calls and {c[0] for c in calls} == {"" if name == "default" else name}
        drafts[name] = [c[1] for c in calls]
    assert drafts["default"] == drafts["fused"] == drafts["unfused"]
    assert drafts["off"] != drafts["fused"]


def test_dspark_markov_worker_default_and_info(stack, reference, target_gguf, tmp_path):
    """--dspark-markov off on the worker: Info reports it, unset requests draft the argmax of the
    base logits (as DrafterModel with markov="off"), an explicit request mode overrides it; output
    is plain greedy either way."""
    import grpc

    from specd.protos.v1 import worker_pb2 as wpb
    from specd.protos.v1 import worker_pb2_grpc as wpbg

    d = open_model_drafter(make_gguf(tmp_path, "dspark", seed=3), target_gguf, dspark_markov="off")
    assert d.dspark_markov == "off"
    svc = dserver.DraftServicer(d)
    addr = f"unix://{stack.dir}/d-markov-off.sock"
    srv, _ = dserver.start_server(svc, addr, 4)
    try:
        with grpc.insecure_channel(addr) as ch:
            info = wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest())
        assert info.dspark_markov == wpb.DSPARK_MARKOV_OFF and info.family == "dspark"
        cstub = stack.coordinator(drafter_override=addr)
        for prompt in PROMPTS:
            for val in (gpb.DSPARK_MARKOV_DEFAULT, gpb.DSPARK_MARKOV_FUSED):
                got, done = run(cstub, prompt, dspark_markov=val)
                assert got == reference(prompt, MAX_TOKENS)[0]
                assert done.speculation.dspark_markov == (val or gpb.DSPARK_MARKOV_OFF)  # the worker default
    finally:
        srv.stop(0).wait()
        svc.close()
    # the ModelDrafter's default vs an explicit option, against DrafterModel directly
    prompt = PROMPTS[2]
    ref, feats = reference(prompt, 4)
    n = len(prompt) + 2
    for mode in ("off", "fused", "unfused"):
        seq = d.model.new_sequence(64)
        seq.ingest(feats[:n], 0)
        want = seq.propose(ref[2], n, markov=mode, topk=3)
        md = ModelDrafter(d.model, dspark_markov=mode)
        md.ingest("x", 0, list(prompt) + ref[:2], feats[:n])
        got_default = md.propose("x", ref[2], 99, dserver.ProposeOptions(top_k=3))
        md2 = ModelDrafter(d.model)  # default fused, request overrides
        md2.ingest("x", 0, list(prompt) + ref[:2], feats[:n])
        got_req = md2.propose("x", ref[2], 99, dserver.ProposeOptions(top_k=3, dspark_markov=mode))
        for got in (got_default, got_req):
            assert got.tokens == [int(t) for t in want.tokens]
            np.testing.assert_array_equal(got.top_k_ids, want.topk_ids)
            np.testing.assert_array_equal(got.top_k_logprobs, want.topk_logprobs)
            np.testing.assert_array_equal(got.confidence, want.confidence)


def test_dspark_markov_ignored_for_other_families(drafter_stacks, reference, monkeypatch):
    """vLLM/SGLang style: a Markov mode sent to a DFlash / DFlash 2 drafter is ignored (not refused);
    the worker reports DEFAULT (not applied) and the output is plain greedy."""
    for fam in ("dflash", "dflash2"):
        stub, d = drafter_stacks[fam]
        assert d.dspark_markov == ""
        base = [run(stub, p)[0] for p in PROMPTS]
        for val in MARKOV.values():
            runs = [run(stub, p, dspark_markov=val) for p in PROMPTS]
            assert [r[0] for r in runs] == base == [reference(p, MAX_TOKENS)[0] for p in PROMPTS]
            assert all(r[1].speculation.dspark_markov == gpb.DSPARK_MARKOV_DEFAULT for r in runs)  # not applied


def test_dspark_markov_option_validation(drafter_stacks, target_gguf, tmp_path):
    import argparse

    import grpc

    from specd.coordinator import client, launcher

    with pytest.raises(ValueError, match="dspark_markov"):
        dserver.DraftWorkerConfig(drafter="d.gguf", target=target_gguf, dspark_markov="sequential").validate()
    assert dserver.DraftWorkerConfig().dspark_markov == "fused"
    with pytest.raises(ValueError, match="dspark_markov"):
        dserver.ProposeOptions(dspark_markov="bogus")
    _, d = drafter_stacks["dspark"]
    with pytest.raises(ValueError, match="dspark_markov"):
        ModelDrafter(d.model, dspark_markov="lazy")
    with pytest.raises(ValueError, match="dspark_markov"):
        open_model_drafter("nonexistent.gguf", target_gguf, dspark_markov="x")
    # an unknown enum value over gRPC is INVALID_ARGUMENT at the coordinator
    stub, _ = drafter_stacks["dspark"]
    with pytest.raises(grpc.RpcError) as e:
        run(stub, [1, 2], dspark_markov=7)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dspark_markov" in e.value.details()
    # CLI flags: draft-worker (default fused, choices), serve (forwarded), generate (request field)
    p = argparse.ArgumentParser()
    dserver.add_arguments(p)
    assert p.parse_args([]).dspark_markov == "fused" and p.parse_args(["--dspark-markov", "off"]).dspark_markov == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--dspark-markov", "maybe"])
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    assert p.parse_args(["--target", "t.gguf", "--dspark-markov", "unfused"]).dspark_markov == "unfused"
    assert p.parse_args(["--target", "t.gguf"]).dspark_markov == "fused"
    with pytest.raises(ValueError, match="dspark-markov"):
        launcher.ServeConfig(target=target_gguf, dspark_markov="x").validate()
    p = argparse.ArgumentParser()
    client.add_arguments(p)
    for name, val in [("default", gpb.DSPARK_MARKOV_DEFAULT)] + list(MARKOV.items()):
        args = p.parse_args(["--token-ids", "1,2", "--dspark-markov", name])
        assert client.build_request(args).speculation.dspark_markov == val


def test_drafter_info_reports_memory(drafter_stacks, stack, target_gguf, tmp_path):
    """DrafterInfo.memory: the drafter's own weights and its context K/V per token equal what a
    DraftSequence allocates; a context_cap drafter's full layers become fixed-size (bounded)."""
    from specd.protos.v1 import worker_pb2 as wpb

    for fam, (_, d) in drafter_stacks.items():
        info = dserver.DraftServicer(d).Info(wpb.InfoRequest(), None)
        m, hp = info.memory, d.model.hp
        assert info.HasField("memory") and m.device == "cpu" and m.kv_dtype == "F32"
        assert m.weight_bytes == sum(t.nbytes for t in d.model.drafter.tensors.values()) > 0
        assert sum(m.weight_bytes_by_type.values()) == m.weight_bytes
        seq = d.model.new_sequence(100)
        unbounded = [l for l in seq.layers if l.keep is None]
        assert m.kv_bytes_per_token * 100 == sum(l.k.nbytes + l.v.nbytes for l in unbounded)
        assert m.kv_bytes_per_token == len(unbounded) * 2 * hp.n_head_kv * hp.head_dim * 4
    capped = open_model_drafter(make_gguf(tmp_path, "dflash", seed=11), target_gguf, context_cap=3, kv_dtype="f16")
    m = dserver.DraftServicer(capped).Info(wpb.InfoRequest(), None).memory
    hp = capped.model.hp
    assert m.kv_dtype == "F16"
    assert m.kv_bytes_per_token == 0  # every layer is bounded by its window or the cap
    assert m.bounded_kv_bytes_per_sequence == sum(
        (2 * ((w - 1) if w else 3) + 2 * hp.block_size) * 2 * hp.n_head_kv * hp.head_dim * 2
        for w in capped.model.window)
    # the scripted drafter has no model: no memory field
    assert not dserver.DraftServicer(stack.drafter).Info(wpb.InfoRequest(), None).HasField("memory")
