"""Greedy proposes replayed as CUDA graphs (DrafterModel(cuda_graphs=True), draft_worker/model.py's
module docstring) against the eager device path (cuda_graphs=False) of the same drafter.

Skipped without a GPU like the other GPU tests; SPECD_TEST_GPU_DRYRUN=1 runs the graph path's CPU
stand-in (tensor_ops: the graph body re-run on the fixed input buffer at every replay, with the same
keys and captures), which checks the formulation (input buffer, per-layer key ranges, causal limit
with the block's last position, per-row windows, heads split between device and host) with the CPU
kernels.

Properties, per tiny drafter of every family and attention kind (non-causal full, causal sliding,
non-causal sliding with its per-row form, context_cap non-causal and causal, an F16 cache of head_dim
64 for the tensor-core chunk pass, DSpark Markov fused and off):
* a sequence of many ingest / propose steps — accepted counts drawn per step, a rollback, windows
  compacting the sliding layers' rows, the attention bound crossing 1024 — gives bitwise the eager
  proposals (tokens, confidences, candidates and scores; logits, Markov logits, hidden and top-k on
  every third step);
* captures happen exactly when the key (bound, per-row form) first appears; the kept graphs stay
  within max_graphs;
* proposes that stay eager (sampling, a shrunk block, DSpark unfused, cuda_graphs switched off)
  capture nothing and still equal the eager model's;
* a shrunk block is captured once it repeats; a failed capture runs eagerly and is not retried;
* releasing the sequence (directly or through ModelDrafter) frees its graphs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafter"))
import tinydrafters as td  # noqa: E402

from specd.draft_worker.gguf_loader import load_drafter  # noqa: E402
from specd.draft_worker.model import DrafterModel, Sampling  # noqa: E402

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
HAVE_GPU = sn.gpu_available() or DRYRUN
STEP = 1024  # the full layers' attention bound step (target_worker.memory.GRAPH_KV_STEP)
W = 32  # the tiny configs' sliding window


def gpu_only(f):
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)


def device_model(ld, emb, head, **kw):
    if DRYRUN:
        return DrafterModel(ld, emb, head, device=sn.Device.CPU, tensor_ops=True, **kw)
    return DrafterModel(ld, emb, head, device=sn.Device.GPU, **kw)


# family, config options, kv dtype, context_cap; ``unbounded``: some layer keeps every row (the key
# has a bound); ``per_row(start, B)``: when a bounded layer needs its per-row attention form.
CASES = {
    "dflash": dict(family="dflash", unbounded=True, per_row=lambda s, b: False),
    "dflash-sliding": dict(family="dflash", sliding="qwen36", unbounded=True, per_row=lambda s, b: False),
    "dflash-cap": dict(family="dflash", cap=40, unbounded=False, per_row=lambda s, b: False),
    "dflash-causal-cap": dict(family="dflash", sliding="qwen36_noflag", cap=40, unbounded=False,
                              per_row=lambda s, b: s > 40),
    "dflash-f16kv-hd64": dict(family="dflash", kv=sn.DType.F16, dims=dict(td.TINY, head_dim=64), unbounded=True,
                              per_row=lambda s, b: False),
    "dflash-q8kv": dict(family="dflash", kv=sn.DType.Q8_0, dims=dict(td.TINY, head_dim=32), unbounded=True,
                        per_row=lambda s, b: False),
    "dspark": dict(family="dspark", unbounded=True, per_row=lambda s, b: False),
    "dspark-yarn-off": dict(family="dspark", yarn=True, markov="off", unbounded=True, per_row=lambda s, b: False),
    "dflash2": dict(family="dflash2", sliding="all", unbounded=False, per_row=lambda s, b: s + b > W),
}


def build(tmp_path, rng, case):
    c = dict(CASES[case])
    family, kv, cap = c.pop("family"), c.pop("kv", sn.DType.F32), c.pop("cap", None)
    markov, unbounded, per_row = c.pop("markov", "fused"), c.pop("unbounded"), c.pop("per_row")
    cfg = td.make_config(family, **c)
    folder, cfg, _ = td.make_drafter(tmp_path / case, family, rng, dtype="F32", scales=td.FORWARD_SCALES, cfg=cfg)
    ld = load_drafter(td.convert_tiny(folder, "f32"))
    emb, head = td.target_tables(cfg, rng)
    kw = dict(kv_dtype=kv, context_cap=cap)
    emb, head = sn.Tensor(emb), sn.Tensor(head)
    return ld, device_model(ld, emb, head, **kw), device_model(ld, emb, head, cuda_graphs=False, **kw), \
        dict(markov=markov, unbounded=unbounded, per_row=per_row)


def assert_same(a, b, what):
    for name in ("tokens", "confidence", "candidates", "candidate_scores", "logits", "markov_logits", "hidden",
                 "topk_ids", "topk_logprobs", "q"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, f"{what}: {name}"
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what}: {name}")


@pytest.mark.parametrize("case", sorted(CASES))
@gpu_only
def test_graph_proposes_equal_eager(tmp_path, rng, case):
    ld, gm, em, c = build(tmp_path, rng, case)
    hp = ld.hparams
    B = hp.block_size
    width = hp.n_taps * hp.n_embd
    capacity = 1100
    gs, es = gm.new_sequence(capacity), em.new_sequence(capacity)
    keys: set = set()
    pos, step = 0, 0

    def ingest(n, start):
        feats = rng.normal(0, 1, (n, width)).astype(np.float32)
        gs.ingest(feats, start)
        es.ingest(feats, start)
        return start + n

    def propose():
        nonlocal step
        seed = int(rng.integers(0, hp.n_vocab))
        extras = step % 3 == 2
        topk = min(3, hp.dflash2.selector_top_k) if hp.dflash2 is not None else 3
        kw = dict(markov=c["markov"], return_logits=extras, return_hidden=extras, topk=topk if extras else 0,
                  temperature=0.7)
        a, b = gs.propose(seed, pos, **kw), es.propose(seed, pos, **kw)
        assert_same(a, b, f"{case} step {step} at {pos}")
        bound = min(capacity, -(-(pos + B) // STEP) * STEP) if c["unbounded"] else 0
        keys.add((bound, c["per_row"](pos, B)))
        assert gs.graph_captures == len(keys), f"step {step} at {pos}: captures {gs.graph_captures} keys {keys}"
        assert es.graph_captures == 0 and 1 <= gs.graph_count <= gm.max_graphs
        step += 1

    pos = ingest(5, 0)
    propose()
    for _ in range(14):  # short context: the sliding layers compact, the per-row forms switch on
        pos = ingest(int(rng.integers(1, B + 1)), pos)  # 1 + accepted drafts
        propose()
    pos = ingest(3, pos - 3)  # a rollback: re-ingest the last 3 rows (behind them a sliding layer may keep nothing)
    propose()
    pos = ingest(1000 - pos, pos)
    propose()
    while pos + B <= STEP + 3 * B:  # across the 1024 bound edge
        pos = ingest(int(rng.integers(1, B + 1)), pos)
        propose()
    if c["unbounded"]:  # the bound stepped past 1024 (a re-capture)
        assert any(bound > STEP for bound, _ in keys)
    if not DRYRUN:
        arena = gs.graph_arena_bytes()
        assert arena > 0
        print(f"[{case}] {gs.graph_count} graphs kept, arena {arena / 2**20:.1f} MiB, {gs.graph_captures} captured")
    kept = gs.graph_count
    assert gs.release() == kept
    assert gs.graph_count == 0 and gs.graph_arena_bytes() == 0
    with pytest.raises(ValueError, match="released"):
        gs.propose(1, pos)
    with pytest.raises(ValueError, match="released"):
        gs.ingest(np.zeros((1, width), np.float32), pos)


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
@gpu_only
def test_eager_proposes_capture_nothing(tmp_path, rng, family):
    """Sampling, a shrunk block (once; repeated, it is captured), DSpark unfused and cuda_graphs
    switched off run eagerly on a graph model: no capture, and the same proposals as the eager model."""
    ld, gm, em, _ = build(tmp_path, rng, family)
    hp = ld.hparams
    width = hp.n_taps * hp.n_embd
    gs, es = gm.new_sequence(96), em.new_sequence(96)
    feats = rng.normal(0, 1, (20, width)).astype(np.float32)
    gs.ingest(feats, 0)
    es.ingest(feats, 0)
    seed = int(rng.integers(0, hp.n_vocab))
    assert_same(gs.propose(seed, 20), es.propose(seed, 20), "greedy")
    assert gs.graph_captures == 1
    draw = int(rng.integers(0, 2**31))
    runs = [lambda: dict(sampling=Sampling(0.9, 0.95, 50, np.random.default_rng(draw))),  # the same draws
            lambda: dict(block_size=hp.block_size - 2, return_logits=True)]
    if family == "dspark":
        runs.append(lambda: dict(markov="unfused", return_logits=True, topk=2))
    for kw in runs:
        assert_same(gs.propose(seed, 20, **kw()), es.propose(seed, 20, **kw()), str(kw()))
        assert gs.graph_captures == 1
    # a shrunk block that repeats (a draft cap) is captured from its second propose on
    shrunk = dict(block_size=hp.block_size - 2, return_logits=True)
    for _ in range(2):
        assert_same(gs.propose(seed, 20, **shrunk), es.propose(seed, 20, **shrunk), "repeated shrunk block")
    assert gs.graph_captures == 2
    gs.propose(seed, 20)  # the full block again: its graph is kept
    assert gs.graph_captures == 2
    gm.cuda_graphs = False
    assert_same(gs.propose(seed, 20), es.propose(seed, 20), "switched off")
    assert gs.graph_captures == 2
    gm.cuda_graphs = True
    assert_same(gs.propose(seed, 20), es.propose(seed, 20), "switched on again: a replay")
    assert gs.graph_captures == 2


@gpu_only
def test_max_graphs_bounds_a_sequence(tmp_path, rng):
    """With max_graphs=1 a new key evicts the kept graph; proposals still equal the eager ones."""
    ld, _, em, _ = build(tmp_path, rng, "dflash")
    hp = ld.hparams
    gm = device_model(ld, em.token_embd, em.lm_head, max_graphs=1)  # the eager model's placed tables, shared
    width = hp.n_taps * hp.n_embd
    gs, es = gm.new_sequence(2200), em.new_sequence(2200)
    pos = 0
    # bounds 1024, 2048, 2048 (a replay), then a rollback to 5 rows: 1024 again, captured anew
    for start, n, captures in ((0, 10, 1), (10, 1100, 2), (1110, 1, 2), (5, 1, 3)):
        feats = rng.normal(0, 1, (n, width)).astype(np.float32)
        gs.ingest(feats, start)
        es.ingest(feats, start)
        pos = start + n
        assert_same(gs.propose(7, pos), es.propose(7, pos), f"at {pos}")
        assert gs.graph_count == 1 and gs.graph_captures == captures


@gpu_only
def test_model_drafter_release_frees_graphs(tmp_path, rng):
    from specd.draft_worker.engine import ModelDrafter

    ld, gm, _, _ = build(tmp_path, rng, "dspark")
    hp = ld.hparams
    md = ModelDrafter(gm)
    md.open("a", 64)
    md.ingest("a", 0, [1] * 9, rng.normal(0, 1, (9, hp.n_taps * hp.n_embd)).astype(np.float32))
    assert len(md.propose("a", 3, hp.n_drafts).tokens) == hp.n_drafts
    seq = md.seqs["a"]
    assert seq.graph_count == 1
    assert md.release("a") and seq.released and seq.graph_count == 0
    assert not md.release("a")
    md.open("b", 64)
    md.close()
    assert not md.seqs


@gpu_only
def test_failed_capture_runs_eagerly(tmp_path, rng, monkeypatch, caplog):
    """A capture that fails (e.g. no device memory for its arena) does not fail the propose: it runs
    eagerly, equal to the eager model, the failure is logged once and that key is not tried again."""
    from specd.draft_worker.model import DraftSequence

    ld, gm, em, _ = build(tmp_path, rng, "dflash")
    hp = ld.hparams
    gs, es = gm.new_sequence(96), em.new_sequence(96)
    feats = rng.normal(0, 1, (12, hp.n_taps * hp.n_embd)).astype(np.float32)
    gs.ingest(feats, 0)
    es.ingest(feats, 0)
    tries = []

    def refuse(self, key):
        tries.append(key)
        raise RuntimeError("out of memory (test)")

    monkeypatch.setattr(DraftSequence, "_graph", refuse)
    for seed in (3, 5):
        assert_same(gs.propose(seed, 12), es.propose(seed, 12), f"seed {seed}")
    assert len(tries) == 1 and gs.graph_captures == 0 and gs.graph_count == 0
    assert sum("capture" in r.getMessage() and "eagerly" in r.getMessage() for r in caplog.records) == 1
