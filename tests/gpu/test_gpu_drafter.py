"""The drafter forward on the GPU (DrafterModel(..., device=GPU)) against the CPU drafter.

Skipped without a GPU like the other GPU tests. SPECD_TEST_GPU_DRYRUN=1 runs the device code path
(sn.Tensor glue ops: slice / concat / copy_rows / embedding gathers, the device Markov chain and
the tensor form of DFlash 2's grouped dynamic conv) on CPU tensors instead
(DrafterModel(..., tensor_ops=True)); there every comparison below is bitwise (the same native
CPU kernels see the same inputs), which checks that the device graph is exactly the CPU graph.

Properties (GPU: tokens, candidates and top-k ids exact; logits, hidden, corrected logits, top-k
log-probs, candidate scores and confidences within REL = 1e-4 of max|cpu| (REL_F16_KV = 1e-3 with an
F16 context cache, REL_Q8_KV = 5e-3 with a Q8_0 one: see their comments), confidences within ATOL = 1e-5; dry run: all bitwise):
* tiny drafters of every family (DFlash with sliding + full layers, DSpark with YaRN, a
  softcapped DSpark, DFlash 2 with sliding non-causal layers; F32 and Q8_0 context K/V; a
  context_cap run exercising the bounded layers' compaction and windowed views): context ingested in
  pieces of 1..9 rows, a proposal after every piece (several blocks), GPU == CPU;
* the shipped demo drafters (models/demo-{dflash,dspark,dflash2}.gguf) bound to
  models/demo-target.gguf, the same comparison;
* on the device, DSpark Markov fused == unfused bitwise (tokens, logits, corrected logits,
  confidences, top-k) — the device matmul is batch invariant on these row counts (<= 16);
* a same-process GPU target's embedding / lm_head are used by the drafter as they are (no copy).
Row counts are small (block sizes 7..8, ingest pieces <= 9); sn.matmul is exact at any row count by
default (16-row GEMV slices), so the comparison does not depend on them.
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
from specd.draft_worker.model import DrafterModel  # noqa: E402

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
HAVE_GPU = sn.gpu_available() or DRYRUN
MODELS = Path(__file__).resolve().parents[2] / "models"
REL, ATOL = 1e-4, 1e-5
# F16 context K/V: a 1-ulp F32 difference between the backends can flip an F16 rounding of a cached
# element (2^-11 relative) that later blocks attend to: measured 1.7e-4 (dflash2, 7 blocks).
REL_F16_KV = 1e-3
# Q8_0 context K/V: the same F32 difference can move a cached element to the neighbouring Q8_0 step
# (1/127 of its block's maximum): H200, 3 of 8 seeds, logits 4.5e-4 .. 8.0e-4 of max|logit|.
REL_Q8_KV = 5e-3
PIECES = (5, 1, 9, 3, 7, 2)  # context rows per ingest; a proposal after each


def gpu_only(f):
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)


def gpu_drafter(*args, **kw):
    if DRYRUN:
        return DrafterModel(*args, device=sn.Device.CPU, tensor_ops=True, **kw)
    return DrafterModel(*args, device=sn.Device.GPU, **kw)


def close(got, ref, what, rel=REL):
    if got is None or ref is None:
        assert got is None and ref is None, what
        return
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, what
    if DRYRUN or got.dtype.kind in "iu":
        np.testing.assert_array_equal(got, ref, err_msg=what)
    else:
        scale = max(float(np.abs(ref).max()), 1e-30)
        err = float(np.abs(got - ref).max()) / scale
        assert err <= rel, f"{what}: max rel err {err:.3g} > {rel}"


def compare_proposals(cpu, gpu, hp, rng, pieces=PIECES, capacity=96, topk=3, markov="fused", rel=REL, **kw):
    """Ingest the same random features in pieces into both models, propose after every piece, compare."""
    width = hp.n_taps * hp.n_embd
    sc, sg = cpu.new_sequence(capacity), gpu.new_sequence(capacity)
    pos = 0
    topk = min(topk, hp.dflash2.selector_top_k) if hp.dflash2 is not None else topk
    for i, n in enumerate(pieces):
        feats = rng.normal(0, 1, (n, width)).astype(np.float32)
        sc.ingest(feats, pos)
        sg.ingest(feats, pos)
        pos += n
        seed = int(rng.integers(0, hp.n_vocab))
        args = dict(return_logits=True, return_hidden=True, topk=topk, temperature=0.8, markov=markov, **kw)
        a, b = sc.propose(seed, pos, **args), sg.propose(seed, pos, **args)
        what = f"block {i} at {pos}"
        np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=f"{what}: tokens")
        for name in ("logits", "markov_logits", "hidden", "topk_logprobs", "candidate_scores"):
            close(getattr(b, name), getattr(a, name), f"{what}: {name}", rel)
        for name in ("topk_ids", "candidates"):
            close(getattr(b, name), getattr(a, name), f"{what}: {name}")
        if a.confidence is not None:
            if DRYRUN:
                np.testing.assert_array_equal(b.confidence, a.confidence)
            else:
                np.testing.assert_allclose(b.confidence, a.confidence, atol=ATOL)
        else:
            assert b.confidence is None
        # the cached context K/V agree as well (row = position; the last context rows of each layer). A
        # Q8_0 cache may round a value the two devices computed a few F32 ulps apart to neighbouring
        # steps: one step is 1/127 of its block's maximum.
        kv_rel = rel + 1.0 / 127 if gpu.kv_dtype == sn.DType.Q8_0 else rel
        for layer in range(hp.n_layer):
            lo = max(0, pos - 4)
            for x, y in zip(sg.cached_kv(layer, range(lo, pos)), sc.cached_kv(layer, range(lo, pos))):
                close(x, y, f"{what}: layer {layer} K/V", kv_rel)
    return sc, sg


TINY_CASES = {
    # 12 pieces of 8 rows run past the sliding layers' 2·(W−1)+2·B rows: they compact live rows
    "dflash-sliding": dict(family="dflash", sliding="qwen36", pieces=(8,) * 12, capacity=160),
    "dflash-q8kv": dict(family="dflash", kv=sn.DType.Q8_0, dims=dict(td.TINY, head_dim=32)),
    "dflash-cap": dict(family="dflash", cap=6, pieces=(3, 2, 4, 1, 3, 2, 5, 1, 2, 3)),
    "dspark-yarn": dict(family="dspark", yarn=True),
    "dspark-softcap": dict(family="dspark", softcap=True),
    "dflash2": dict(family="dflash2", sliding="all"),
    "dflash2-f16kv": dict(family="dflash2", kv=sn.DType.F16),
}


def build_tiny(tmp_path, rng, family, softcap=False, **cfg_kw):
    cfg = td.make_config(family, **cfg_kw)
    if softcap:
        cfg.setdefault("dflash_config", {}).update(output_multiplier=0.7, final_logit_softcapping=3.0)
    folder, cfg, _ = td.make_drafter(tmp_path / family, family, rng, dtype="F32", scales=td.FORWARD_SCALES, cfg=cfg)
    ld = load_drafter(td.convert_tiny(folder, "f32"))
    emb, head = td.target_tables(cfg, rng)
    return ld, sn.Tensor(emb), sn.Tensor(head)


@pytest.mark.parametrize("case", sorted(TINY_CASES))
@gpu_only
def test_gpu_tiny_drafter_matches_cpu(tmp_path, rng, case):
    c = dict(TINY_CASES[case])
    family, kv, cap = c.pop("family"), c.pop("kv", sn.DType.F32), c.pop("cap", None)
    run = dict(pieces=c.pop("pieces", PIECES), capacity=c.pop("capacity", 96),
               rel={sn.DType.F16: REL_F16_KV, sn.DType.Q8_0: REL_Q8_KV}.get(kv, REL))
    ld, emb, head = build_tiny(tmp_path, rng, family, **c)
    kw = dict(kv_dtype=kv, context_cap=cap)
    compare_proposals(DrafterModel(ld, emb, head, **kw), gpu_drafter(ld, emb, head, **kw), ld.hparams, rng, **run)


@pytest.mark.parametrize("markov", ["unfused", "off"])
@gpu_only
def test_gpu_tiny_dspark_markov_modes_match_cpu(tmp_path, rng, markov):
    ld, emb, head = build_tiny(tmp_path, rng, "dspark")
    compare_proposals(DrafterModel(ld, emb, head), gpu_drafter(ld, emb, head), ld.hparams, rng, markov=markov)


@gpu_only
def test_gpu_block_size_and_threshold_match_cpu(tmp_path, rng):
    ld, emb, head = build_tiny(tmp_path, rng, "dspark")
    compare_proposals(DrafterModel(ld, emb, head), gpu_drafter(ld, emb, head), ld.hparams, rng,
                      pieces=(4, 6), block_size=5, confidence_threshold=0.3)


@pytest.fixture(scope="module")
def demo_target():
    if not (MODELS / "demo-target.gguf").exists():
        pytest.skip("models/demo-target.gguf is not present")
    from specd.target_worker.gguf_loader import load_qwen35

    return load_qwen35(MODELS / "demo-target.gguf")


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
@gpu_only
def test_gpu_demo_drafter_matches_cpu(demo_target, rng, family):
    path = MODELS / f"demo-{family}.gguf"
    if not path.exists():
        pytest.skip(f"{path.name} is not present")
    ld = load_drafter(path)
    cpu = DrafterModel.for_target(ld, demo_target)
    gpu = DrafterModel.for_target(ld, demo_target, device=sn.Device.CPU if DRYRUN else sn.Device.GPU,
                                  tensor_ops=DRYRUN)
    compare_proposals(cpu, gpu, ld.hparams, rng)


@gpu_only
def test_gpu_dspark_fused_equals_unfused_on_device(tmp_path, rng):
    """Bitwise on the device: one lm_head matmul for the block vs one per row inside the chain."""
    for ld, emb, head in (build_tiny(tmp_path / "a", rng, "dspark"),
                          build_tiny(tmp_path / "b", rng, "dspark", softcap=True)):
        model = gpu_drafter(ld, emb, head)
        hp = ld.hparams
        feats = rng.normal(0, 1, (11, hp.n_taps * hp.n_embd)).astype(np.float32)
        seed = int(rng.integers(0, hp.n_vocab))
        out = {}
        for mode in ("fused", "unfused"):
            seq = model.new_sequence(64)
            seq.ingest(feats[:4], 0)
            seq.ingest(feats[4:], 4)
            out[mode] = seq.propose(seed, 11, return_logits=True, return_hidden=True, topk=4, markov=mode)
        f, u = out["fused"], out["unfused"]
        for name in ("tokens", "logits", "markov_logits", "hidden", "confidence", "topk_ids", "topk_logprobs"):
            np.testing.assert_array_equal(getattr(u, name), getattr(f, name), err_msg=name)


@gpu_only
def test_gpu_drafter_shares_a_same_process_target(demo_target, rng):
    """Bound to a Qwen35Model on the same device, the drafter uses its placed embedding / lm_head
    tensors as they are (no second upload); its own weights and K/V caches live on the device."""
    from specd.target_worker.model import Qwen35Model

    path = MODELS / "demo-dspark.gguf"
    if not path.exists():
        pytest.skip(f"{path.name} is not present")
    ld = load_drafter(path)
    dev = sn.Device.CPU if DRYRUN else sn.Device.GPU
    target = Qwen35Model(demo_target, capture_layers=list(ld.hparams.target_layer_ids), device=dev,
                         tensor_ops=DRYRUN)
    dm = DrafterModel.for_target(ld, target, device=dev, tensor_ops=DRYRUN)
    assert dm.token_embd is target.token_embd and dm.lm_head is target.output
    seq = dm.new_sequence(64)
    assert all(lk.k.device == dev and lk.v.device == dev for lk in seq.layers)
    assert dm.layers[0].attn_q.device == dev and dm.fc.device == dev
    # the target's real features drive the drafter (the integration the service runs)
    st = target.new_sequence(64)
    prompt = [int(t) for t in rng.integers(0, demo_target.hparams.n_vocab, size=12)]
    target.prefill(st, prompt)
    feats = st.features.read(0, st.committed)
    seq.ingest(feats, 0)
    p = seq.propose(prompt[-1], st.committed)
    ref = DrafterModel.for_target(ld, demo_target).new_sequence(64)
    ref.ingest(feats, 0)
    np.testing.assert_array_equal(p.tokens, ref.propose(prompt[-1], st.committed).tokens)


def test_drafter_device_argument():
    from specd.target_worker.device import parse_device

    with pytest.raises(ValueError, match="device"):
        parse_device("tpu")
    from specd.draft_worker.server import DraftWorkerConfig

    with pytest.raises(ValueError, match="device"):
        DraftWorkerConfig(drafter="d.gguf", target="t.gguf", device="tpu").validate()
    DraftWorkerConfig(drafter="d.gguf", target="t.gguf", device="cpu").validate()
    assert DraftWorkerConfig(drafter="d.gguf", target="t.gguf").resolved_device == \
        ("cuda" if sn.gpu_available() else "cpu")
    if not sn.gpu_available():
        with pytest.raises(ValueError, match="--device cuda"):
            DraftWorkerConfig(drafter="d.gguf", target="t.gguf", device="cuda").validate()


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
@gpu_only
def test_gpu_sampled_proposals_match_cpu(tmp_path, rng, family):
    """Sampled drafting: the same draws from the same generator state (q within REL; the draws are
    inverse-CDF lookups, equal unless a uniform lands within rounding of a CDF step)."""
    from specd.draft_worker.model import Sampling

    ld, emb, head = build_tiny(tmp_path, rng, family)
    hp = ld.hparams
    cpu, gpu = DrafterModel(ld, emb, head), gpu_drafter(ld, emb, head)
    sc, sg = cpu.new_sequence(64), gpu.new_sequence(64)
    feats = rng.normal(0, 1, (9, hp.n_taps * hp.n_embd)).astype(np.float32)
    sc.ingest(feats, 0)
    sg.ingest(feats, 0)
    seed, draw = int(rng.integers(0, hp.n_vocab)), int(rng.integers(0, 2**31))
    a = sc.propose(seed, 9, sampling=Sampling(0.9, 0.95, 50, np.random.default_rng(draw)))
    b = sg.propose(seed, 9, sampling=Sampling(0.9, 0.95, 50, np.random.default_rng(draw)))
    np.testing.assert_array_equal(b.tokens, a.tokens)
    close(b.q, a.q, "q")


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
@gpu_only
def test_device_tensor_ingest_equals_host_ingest(tmp_path, rng, family):
    """The cuda-ipc transport hands DrafterModel.ingest device tensors (gathered ring rows): bitwise the
    same context and proposals as host rows, including a piece whose leading rows a bounded layer
    skips (view_rows of the tensor) and a CPU drafter given device rows (copied to the host)."""
    c = dict(TINY_CASES["dflash-cap" if family == "dflash" else "dflash2"])
    c.pop("family"), c.pop("pieces", None), c.pop("capacity", None)
    cap = c.pop("cap", None)
    ld, emb, head = build_tiny(tmp_path, rng, family, **c)
    m = gpu_drafter(ld, emb, head, context_cap=cap)
    dev = sn.Device.CPU if DRYRUN else sn.Device.GPU
    hp = ld.hparams
    width = hp.n_taps * hp.n_embd
    sh, sd = m.new_sequence(96), m.new_sequence(96)
    pos = 0
    for n in (5, 1, 12, 3):
        feats = rng.normal(0, 1, (n, width)).astype(np.float32)
        sh.ingest(feats, pos)
        sd.ingest(sn.Tensor(feats).to(dev), pos)
        pos += n
        seed = int(rng.integers(0, hp.n_vocab))
        a, b = sh.propose(seed, pos, return_logits=True), sd.propose(seed, pos, return_logits=True)
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(np.asarray(b.logits), np.asarray(a.logits))
    with pytest.raises(ValueError, match="float32"):
        sd.ingest(sn.Tensor(np.zeros((1, width), np.float16)), pos)
    cpu = DrafterModel(ld, emb, head, context_cap=cap)
    sc = cpu.new_sequence(96)
    feats = rng.normal(0, 1, (4, width)).astype(np.float32)
    sc.ingest(sn.Tensor(feats).to(dev), 0)
    ref = cpu.new_sequence(96)
    ref.ingest(feats, 0)
    np.testing.assert_array_equal(sc.propose(3, 4).tokens, ref.propose(3, 4).tokens)
