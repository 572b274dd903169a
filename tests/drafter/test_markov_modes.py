"""DSpark Markov modes (``DraftSequence.propose(markov=...)``, drafters.md §5.2–5.5).

* fused (default: one lm_head matmul for the block, then the chain) and unfused (per row: lm_head of
  that row, then bias and choice) are **bitwise** equal — tokens, base logits, corrected logits,
  confidences, top-k ids/log-probs, sampled drafts and q — on several random DSpark drafters (every
  native op is batch invariant; model.MARKOV_MODES).
* off = plain argmax of the base logits (top-k from the base logits), and differs from fused on a
  fixture where the Markov bias changes a choice.
* the mode is validated; DFlash / DFlash 2 ignore it (no Markov head).
"""
from __future__ import annotations

import numpy as np
import pytest

import tinydrafters as td
from specd.draft_worker.gguf_loader import load_drafter
from specd.draft_worker.model import MARKOV_MODES, DEFAULT_MARKOV, DrafterModel, Sampling
from specd.native import Tensor


# larger than the default tiny dims (V, H, B), so the block matmul spans several kernel tiles
BIG = dict(vocab=2048, hidden=256, inter=256, layers=1, heads=4, kv_heads=2, head_dim=64, taps=[0, 1], n_target=4,
           block=16, mask=2000)


def build(tmp_path, rng, family="dspark", softcap=False, **kw):
    cfg = td.make_config(family, **kw)
    if softcap:  # output_multiplier and the tanh softcap: element-wise, applied per row or per block alike
        cfg.setdefault("dflash_config", {}).update(output_multiplier=0.7, final_logit_softcapping=3.0)
    folder, cfg, tensors = td.make_drafter(tmp_path / family, family, rng, dtype="F32", scales=td.FORWARD_SCALES,
                                           cfg=cfg)
    ld = load_drafter(td.convert_tiny(folder, "f32"))
    if softcap:
        assert ld.hparams.final_logit_softcapping == np.float32(3.0) and ld.hparams.output_multiplier != 1.0
    emb, head = td.target_tables(cfg, rng)
    return ld, emb, head


def propose_all(ld, emb, head, rng, C=30, **kw):
    hp = ld.hparams
    feats = rng.normal(0, 1, (C, hp.n_taps * hp.n_embd)).astype(np.float32)
    seed = int(rng.integers(0, hp.n_vocab))
    out = {}
    for mode in MARKOV_MODES:
        seq = DrafterModel(ld, Tensor(emb), Tensor(head)).new_sequence(64)
        seq.ingest(feats, 0)
        out[mode] = seq.propose(seed, C, return_logits=True, return_hidden=True, markov=mode, **kw)
    return out


def test_default_is_fused():
    assert DEFAULT_MARKOV == "fused" and MARKOV_MODES == ("fused", "unfused", "off")


@pytest.mark.parametrize("variant", [dict(), dict(with_markov=False), dict(confidence=False),
                                     dict(packaging="deepspec"), dict(softcap=True), dict(yarn=True),
                                     dict(dims=BIG)])
@pytest.mark.parametrize("draw", range(3))
def test_fused_and_unfused_are_bitwise_equal(tmp_path, variant, draw):
    rng = np.random.default_rng(1000 + draw)
    ld, emb, head = build(tmp_path, rng, **variant)
    for kw in (dict(topk=4, temperature=0.8), dict(block_size=3), dict()):
        p = propose_all(ld, emb, head, rng, **kw)
        f, u = p["fused"], p["unfused"]
        for name in ("tokens", "logits", "markov_logits", "hidden", "confidence", "topk_ids", "topk_logprobs"):
            a, b = getattr(f, name), getattr(u, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert a.tobytes() == b.tobytes(), f"{name} differs between fused and unfused"


def test_fused_and_unfused_sampled_are_bitwise_equal(tmp_path):
    rng = np.random.default_rng(7)
    ld, emb, head = build(tmp_path, rng)
    hp = ld.hparams
    feats = rng.normal(0, 1, (20, hp.n_taps * hp.n_embd)).astype(np.float32)
    got = []
    for mode in ("fused", "unfused"):
        seq = DrafterModel(ld, Tensor(emb), Tensor(head)).new_sequence(64)
        seq.ingest(feats, 0)
        got.append(seq.propose(5, 20, markov=mode, sampling=Sampling(0.9, rng=np.random.default_rng(3))))
    assert got[0].tokens.tobytes() == got[1].tokens.tobytes() and got[0].q.tobytes() == got[1].q.tobytes()


def test_off_is_argmax_of_base_logits(tmp_path):
    rng = np.random.default_rng(11)
    ld, emb, head = build(tmp_path, rng)
    p = propose_all(ld, emb, head, rng, topk=3, temperature=0.9)
    off, fused = p["off"], p["fused"]
    assert off.logits.tobytes() == fused.logits.tobytes()  # same backbone and head
    np.testing.assert_array_equal(off.tokens, off.logits.argmax(1))
    assert (fused.tokens != off.tokens).any()  # the Markov bias changes a choice in this fixture
    np.testing.assert_array_equal(off.markov_logits, off.logits)  # no correction
    # DDTree top-k from the base logits; column 0 is the argmax chain
    z = off.logits.astype(np.float64) / 0.9
    lse = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    order = np.argsort(-lse, 1, kind="stable")[:, :3]
    np.testing.assert_array_equal(off.topk_ids, order)
    np.testing.assert_allclose(off.topk_logprobs, np.take_along_axis(lse, order, 1), atol=1e-5)
    assert off.confidence is not None and off.confidence.shape == off.tokens.shape


def test_mode_is_validated_and_ignored_by_other_families(tmp_path):
    rng = np.random.default_rng(5)
    ld, emb, head = build(tmp_path, rng)
    seq = DrafterModel(ld, Tensor(emb), Tensor(head)).new_sequence(64)
    hp = ld.hparams
    seq.ingest(rng.normal(0, 1, (4, hp.n_taps * hp.n_embd)).astype(np.float32), 0)
    with pytest.raises(ValueError, match="markov"):
        seq.propose(1, 4, markov="sequential")
    ld2, emb2, head2 = build(tmp_path, rng, family="dflash")
    hp2 = ld2.hparams
    feats = rng.normal(0, 1, (4, hp2.n_taps * hp2.n_embd)).astype(np.float32)
    got = []
    for mode in MARKOV_MODES:
        s = DrafterModel(ld2, Tensor(emb2), Tensor(head2)).new_sequence(64)
        s.ingest(feats, 0)
        got.append(s.propose(1, 4, markov=mode).tokens.tolist())
    assert got[0] == got[1] == got[2]
