"""Sampled drafting (spec-loop.md §8): the proposal distribution q of each family and the draws.

References: ZL-0.1.0 ``_sampling_probs`` (PyPI ``dflash``, torch; oracle tests) for the
temperature / top-k / top-p truncation, a hand-computed truncation case, and float64 numpy
recomputations from the published math (drafters.md §5.2, §6.3) along the *sampled* chain for the
DSpark and DFlash 2 conditionals.
"""
from __future__ import annotations

import numpy as np
import pytest

import tinydrafters as td
from specd.draft_worker.gguf_loader import load_drafter
from specd.draft_worker.model import DrafterModel, Sampling, _draw, sampling_probs
from specd.native import Tensor


def test_sampling_probs_hand_case():
    s = np.array([[2.0, 1.0, 0.0, -1.0]])
    e = np.exp([2.0, 1.0])
    np.testing.assert_allclose(sampling_probs(s, 1.0, top_k=2), [[e[0] / e.sum(), e[1] / e.sum(), 0, 0]], rtol=1e-6)
    # top-p 0.5 after top-k 2: 0.731 is kept (mass before it 0 < 0.5), 0.269 is not (0.731 >= 0.5)
    np.testing.assert_array_equal(sampling_probs(s, 1.0, top_p=0.5, top_k=2), [[1, 0, 0, 0]])
    # top-p 0.8 without top-k at T = 2: p ∝ e^[1, .5, 0, -.5] = [.455, .276, .167, .102]; keep 3
    p = np.exp([1.0, 0.5, 0.0, -0.5])
    p /= p.sum()
    want = np.array([p[0], p[1], p[2], 0]) / p[:3].sum()
    np.testing.assert_allclose(sampling_probs(s, 2.0, top_p=0.8), [want], rtol=1e-6)
    with pytest.raises(ValueError):
        Sampling(temperature=0.0)
    with pytest.raises(ValueError):
        Sampling(temperature=1.0, top_p=0.0)


def test_draw_frequencies_and_zeros():
    q = np.array([0.1, 0.6, 0.0, 0.3], np.float32)
    rng = np.random.default_rng(0)
    counts = np.bincount([_draw(q, rng) for _ in range(20000)], minlength=4) / 20000
    assert counts[2] == 0 and np.abs(counts - q).max() < 0.015


@pytest.mark.oracle
def test_sampling_probs_matches_dflash():
    """specd's sampling_probs and the tests' float64 port (tinydrafters.f64_sampling_probs) both equal
    dflash 0.1.0's ``_sampling_probs`` (fixed inputs, every truncation mode)."""
    torch = pytest.importorskip("torch")
    dm = pytest.importorskip("dflash.model")
    rng = np.random.default_rng(1)
    x = rng.normal(0, 3, (6, 300)).astype(np.float32)
    for T, top_p, top_k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20), (0.8, 0.95, 20), (1.0, 0.3, 5)):
        ref = dm._sampling_probs(torch.from_numpy(x), T, top_p, top_k).numpy()
        np.testing.assert_allclose(sampling_probs(x, T, top_p, top_k), ref, atol=2e-6)
        # the tests' float64 port of the same math (the oracle of the sampled-draft tests below) is dflash's
        np.testing.assert_allclose(td.f64_sampling_probs(x, T, top_p, top_k), ref, atol=2e-6)


def build(tmp_path, rng, family, **kw):
    folder, cfg, tensors = td.make_drafter(tmp_path / family, family, rng, dtype="F32", scales=td.FORWARD_SCALES, **kw)
    ld = load_drafter(td.convert_tiny(folder, "f32"))
    emb, head = td.target_tables(cfg, rng)
    m = DrafterModel(ld, Tensor(emb), Tensor(head))
    m.test_tables = (emb, head)  # the oracle tests need the float32 tables
    feats = rng.normal(0, 1, (20, ld.hparams.n_taps * ld.hparams.n_embd)).astype(np.float32)
    return cfg, tensors, ld, m, feats


def run(m, feats, seed, **kw):
    seq = m.new_sequence(48)
    seq.ingest(feats, 0)
    return seq.propose(seed, feats.shape[0], return_logits=True, return_hidden=True, **kw)


@pytest.mark.oracle
def test_dflash_sampled(tmp_path, rng):
    """The draft logits equal dflash's own for the same block within 3e-5 of max|ref| (as the greedy
    parity tests), and q is dflash's ``_sampling_probs`` math (tinydrafters.f64_sampling_probs, float64)
    of those logits, to float32 rounding. Not ``_sampling_probs`` of dflash's logits within 1e-5: the
    top-p / top-k cut is discontinuous, and where the mass before a token lies within the logit error
    of top_p (measured down to 1.8e-6 away over 120 seeds, against q errors of 3e-7 to 5e-6) the two
    inputs keep different tokens and q differs by a whole token's probability, a failure by chance."""
    cfg, tensors, ld, m, feats = build(tmp_path, rng, "dflash")
    ref = td.reference_model(cfg, tensors)
    hp = ld.hparams
    emb, head = m.test_tables
    p = run(m, feats, 4, sampling=Sampling(0.9, top_p=0.95, top_k=20, rng=np.random.default_rng(7)))
    block = np.array([4] + [hp.mask_token_id] * (hp.block_size - 1))
    h = td.reference_forward(ref, feats, emb[block], feats.shape[0])
    lr = h[hp.first_proposal_row:] @ head.T.astype(np.float64)
    assert np.abs(p.logits - lr).max() / np.abs(lr).max() < 3e-5
    np.testing.assert_allclose(p.q, td.f64_sampling_probs(p.logits, 0.9, 0.95, 20), rtol=2**-23, atol=1e-12)
    np.testing.assert_allclose(p.q.sum(1), 1, rtol=1e-5)
    assert (p.q[np.arange(len(p.tokens)), p.tokens] > 0).all() and ((p.q > 0).sum(1) <= 20).all()
    again = run(m, feats, 4, sampling=Sampling(0.9, top_p=0.95, top_k=20, rng=np.random.default_rng(7)))
    np.testing.assert_array_equal(p.tokens, again.tokens)  # same generator state, same draws


def test_dspark_sampled_chain_conditions_on_the_sampled_draft(tmp_path, rng):
    cfg, tensors, ld, m, feats = build(tmp_path, rng, "dspark")
    T = 1.5
    p = run(m, feats, 9, sampling=Sampling(T, top_k=50, rng=np.random.default_rng(3)))
    W1 = tensors["markov_head.markov_w1.weight"].astype(np.float64)
    W2 = tensors["markov_head.markov_w2.weight"].astype(np.float64)
    prev = [9] + p.tokens[:-1].tolist()
    ell = p.logits.astype(np.float64) + np.stack([W2 @ W1[x] for x in prev])
    # ℓ = U + W2·W1[prev] in float32: the native matmul's r-term sums (at most ceil(r/16) + 5 roundings,
    # tests/native/test_matmul.py) and one rounding of the add, so (Higham §3.1) |ℓ32 − ℓ| <=
    # γ_m (|U| + |W2| |W1[prev]|), m = ceil(r/16) + 6: measured <= 0.26 of it over 300 seeds. (A fixed
    # atol 1e-5 was reached at 0.88 of itself over 450 seeds: ℓ ~ 70-120 here, whose float32 ulp is 8e-6.)
    nr = -(-W1.shape[1] // 16) + 6
    gamma = nr * 2.0**-24 / (1 - nr * 2.0**-24)
    bound = gamma * (np.abs(p.logits.astype(np.float64)) + np.stack([np.abs(W2) @ np.abs(W1[x]) for x in prev]))
    err = np.abs(p.markov_logits - ell)
    assert (err <= bound).all(), f"max err / bound = {(err / bound).max():.3g}"
    # q = dflash's _sampling_probs math of those very ℓ (float64: tinydrafters.f64_sampling_probs), to float32
    # rounding; on the same input the top-k cut cannot fall differently (against ZL of the float64 ℓ with
    # atol 1e-5 the error reached 0.32 of it over 450 seeds)
    np.testing.assert_allclose(p.q, td.f64_sampling_probs(p.markov_logits, T, 1.0, 50), rtol=2**-23, atol=1e-12)
    assert (p.q[np.arange(len(p.tokens)), p.tokens] > 0).all()
    # confidence uses the sampled previous draft too
    w = tensors["confidence_head.proj.weight"].astype(np.float64)[0]
    b = float(tensors["confidence_head.proj.bias"][0])
    z = np.concatenate([p.hidden.astype(np.float64), W1[prev]], 1) @ w + b
    np.testing.assert_allclose(p.confidence, 1 / (1 + np.exp(-z)), atol=1e-6)


def test_dflash2_sampled_selector_q(tmp_path, rng):
    cfg, tensors, ld, m, feats = build(tmp_path, rng, "dflash2", sliding="all")
    T = 0.7
    p = run(m, feats, 2, sampling=Sampling(T, top_p=0.5, top_k=3, rng=np.random.default_rng(5)))
    K = ld.hparams.dflash2.selector_top_k
    hproj = tensors["candidate_selector.hidden_projection.weight"].astype(np.float64)
    pred = tensors["candidate_selector.predecessor_codebook"].astype(np.float64)
    succ = tensors["candidate_selector.successor_codebook"].astype(np.float64)
    prev = [2] + p.tokens[:-1].tolist()
    for s in range(len(p.tokens)):
        c = np.argsort(-p.logits[s], kind="stable")[:K]
        np.testing.assert_array_equal(p.candidates[s], c)
        sc = p.logits[s, c].astype(np.float64) + succ[c] @ (pred[prev[s]] * (hproj @ p.hidden[s].astype(np.float64)))
        qs = np.exp((sc - sc.max()) / T)
        qs /= qs.sum()
        # q lives on the K candidates only; ZL applies no top-p / top-k to the selector (the
        # request's truncation settings do not shrink it)
        assert set(np.nonzero(p.q[s])[0]) == set(c.tolist())
        np.testing.assert_allclose(p.q[s, c], qs, atol=1e-5)
        assert p.tokens[s] in c
