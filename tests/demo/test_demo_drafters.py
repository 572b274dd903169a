"""The shipped demo drafters (models/demo-{dflash,dflash2,dspark}.gguf, trained by
tools/demo/train_drafters.py on the demo target's features): each loads and pairs with the demo
target, speculative output equals plain greedy output on held-out prompts (chain and DDTree), and
acceptance length on held-out code is above 1.5 for every family.

The stack is the service tests' in-process one (target worker + real drafter worker + coordinator
over Unix sockets), speculating on every step (adaptive policy off) so the acceptance length is the
drafter's, not the policy's. The prompts are the first code and prose records of
tools/bench/demo_prompts.jsonl (held-out documents, never trained on)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

import specd.native as sn
from specd.coordinator.policy import PolicyConfig
from specd.draft_worker import server as dserver
from specd.draft_worker.engine import open_model_drafter
from specd.protos.v1 import generate_pb2 as gpb
from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata
from specd.target_worker.model import Qwen35Model
from specd.target_worker.tokenizer import build_tokenizer

from service.conftest import Stack, generate, streamed_ids, token_request

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "demo-target.gguf"
FAMILIES = {"dflash": 7, "dflash2": 7, "dspark": 7}  # family -> drafts per step
TAPS = (1, 3, 5)
MAX_TOKENS = 48
MIN_CODE_AL = 1.5


def drafter_path(family: str) -> Path:
    return ROOT / "models" / f"demo-{family}.gguf"


def prompts(kind: str, n: int) -> list[str]:
    recs = [json.loads(line) for line in (ROOT / "tools" / "bench" / "demo_prompts.jsonl").open()]
    return [r["prompt"] for r in recs if r["kind"] == kind][:n]


@contextlib.contextmanager
def demo_drafter_stack(device: str = "auto"):
    """The demo target's stack with one real drafter worker per family (adaptive policy off);
    yields family -> (SpecDecode stub, ModelDrafter); every server is stopped at the end."""
    missing = [p for p in [TARGET, *map(drafter_path, FAMILIES)] if not p.is_file()]
    if missing:
        pytest.skip(f"not present: {missing}")
    stack, servers, stubs = None, [], {}
    try:
        stack = Stack(str(TARGET), capture_layers=TAPS, max_seq_len=1024, device=device,
                      policy=PolicyConfig(step_ratio=0))
        for fam in FAMILIES:
            d = open_model_drafter(str(drafter_path(fam)), str(TARGET))
            svc = dserver.DraftServicer(d)
            addr = f"unix://{stack.dir}/d-{fam}.sock"
            srv, _ = dserver.start_server(svc, addr, 4)
            servers.append((srv, svc))
            stubs[fam] = (stack.coordinator(drafter_override=addr), d)
        yield stubs
    finally:
        for srv, svc in servers:
            srv.stop(0).wait()
            svc.close()
        if stack is not None:
            stack.stop()


@pytest.fixture(scope="module")
def demo_stack():
    with demo_drafter_stack(device="cpu") as stubs:
        yield stubs


def plain_greedy(device: str = "cpu", n: int = MAX_TOKENS):
    """run(text) -> (prompt ids, the demo target's n plain greedy tokens) on ``device`` (F32 KV, as
    the stacks), cached per text."""
    model = Qwen35Model(load_qwen35(str(TARGET)), kv_dtype=sn.DType.F32, device=device)
    tok = build_tokenizer(read_tokenizer_metadata(str(TARGET)), str(TARGET))
    cache = {}

    def run(text: str) -> tuple[list[int], list[int]]:
        if text not in cache:
            ids = tok.encode(text).ids
            st = model.new_sequence(len(ids) + n + 1)
            logits, out = model.prefill(st, ids), []
            for _ in range(n):
                out.append(int(np.argmax(logits)))
                logits = model.decode(st, out[-1])
            cache[text] = (ids, out)
        return cache[text]
    return run


@pytest.fixture(scope="module")
def plain():
    return plain_greedy("cpu")


def speculate(stub, ids, mode=gpb.DRAFT_MODE_CHAIN):
    sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, draft_mode=mode)
    chunks, done = generate(stub, token_request(ids, MAX_TOKENS, ignore_eos=True, speculation=sp), timeout=120)
    return streamed_ids(chunks), done.speculation


def test_shipped_models_fit_the_budget():
    files = [TARGET, *map(drafter_path, FAMILIES)]
    total = sum(p.stat().st_size for p in files if p.is_file())
    assert total <= 80 * 10**6, f"shipped models take {total} bytes (budget 80 MB)"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_drafter_loads_and_pairs(demo_stack, family):
    _, d = demo_stack[family]
    assert d.family == family and d.block_size == FAMILIES[family]
    assert d.target_layer_ids == TAPS and d.n_vocab == 8192
    assert d.has_confidence == (family == "dspark")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_spec_equals_plain_and_code_acceptance(demo_stack, plain, family):
    """Chain drafting on 3 held-out code prompts: every output equals plain greedy, and the
    acceptance length (1 + accepted drafts per speculative step) is above MIN_CODE_AL."""
    stub, _ = demo_stack[family]
    drafts = accepted = 0
    for text in prompts("code", 3):
        ids, ref = plain(text)
        got, sp = speculate(stub, ids)
        assert got == ref, (family, text[:40])
        drafts += sp.num_drafts
        accepted += sp.num_accepted_tokens
    al = 1 + accepted / drafts
    print(f"{family}: code AL {al:.2f} over {drafts} speculative steps")
    assert al > MIN_CODE_AL, f"{family}: acceptance length {al:.2f} on held-out code"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tree_and_prose_equal_plain(demo_stack, plain, family):
    stub, _ = demo_stack[family]
    for text in prompts("prose", 2):
        ids, ref = plain(text)
        assert speculate(stub, ids, gpb.DRAFT_MODE_TREE)[0] == ref, (family, "tree", text[:40])
        assert speculate(stub, ids)[0] == ref, (family, "chain", text[:40])


def test_serve_defaults_are_the_embedded_models(tmp_path):
    from specd.coordinator.launcher import ServeConfig
    cfg = ServeConfig()
    cfg.validate()
    assert Path(cfg.target).name == "demo-target.gguf" and Path(cfg.drafter_gguf).name == "demo-dflash2.gguf"
    other = ServeConfig(target=str(tmp_path / "other.gguf"))
    other.resolve_models()
    assert other.drafter_gguf == ""  # "auto" attaches the demo drafter only to the demo target
    off = ServeConfig(drafter_gguf="none")
    off.resolve_models()
    assert off.drafter_gguf == "" and Path(off.target).name == "demo-target.gguf"
    scripted = ServeConfig(scripted_block=4)
    scripted.validate()
    assert scripted.drafter_gguf == ""
