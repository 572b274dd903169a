"""Drafter forward: cases C20 (feature outliers) and C21 (YaRN beyond the original window), the
grouped dynamic conv on a hand-computed case, a float64 numpy forward that needs no torch, and an
end-to-end run against specd's own qwen35 target (Qwen35Model feature capture → ingest → propose →
verify → commit).

The float64 references here (``tinydrafters.f64_forward``, ``f64_yarn_inv_freq``, ``f64_rope``) are
written from drafters.md §3 and the YaRN paper / transformers' ``_compute_yarn_parameters``
formulas; they share no code with specd.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import tinydrafters as td
from specd.draft_worker.gguf_loader import check_pair, load_drafter
from specd.draft_worker.model import DrafterModel, grouped_dynamic_conv
from specd.native import DType, Tensor
import specd.native as sn


def rel(a, b):
    b = np.asarray(b, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def build(tmp_path, rng, family="dflash", outtype="f32", **kw):
    folder, cfg, tensors = td.make_drafter(tmp_path / family, family, rng, dtype="F32", scales=td.FORWARD_SCALES, **kw)
    ld = load_drafter(td.convert_tiny(folder, outtype))
    emb, head = td.target_tables(cfg, rng)
    return cfg, tensors, ld, emb, head


def test_grouped_dynamic_conv_hand_case():
    """Two taps, H = 4, group 2 (G = 2), L = 3, computed by hand:
    out[t, c] = (base[0, c] + d[t, 0, g]) y[t, c] + (base[1, c] + d[t, 1, g]) y[t−1, c]."""
    y = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 0, -1, 2]], np.float32)
    base = np.array([[1, 1, 0, 0], [0, 1, 2, 0]], np.float32)
    d = np.zeros((3, 2, 2), np.float32)
    d[1, 1, 0] = 10  # row 1, tap 1 (previous row), group 0 (channels 0, 1)
    d[2, 0, 1] = -1  # row 2, tap 0, group 1 (channels 2, 3)
    want = np.array([
        [1 * 1, 1 * 2, 0, 0],                                     # row 0: no previous row
        [1 * 5 + 10 * 1, 1 * 6 + 11 * 2, 2 * 3, 0],               # row 1: tap 1 reads row 0
        [1 * 1 + 0 * 5, 1 * 0 + 1 * 6, -1 * -1 + 2 * 7, -1 * 2],  # row 2
    ], np.float32)
    np.testing.assert_array_equal(grouped_dynamic_conv(y, d, base, 2), want)


def test_forward_matches_float64_numpy_reference(tmp_path, rng):
    """Full DFlash forward (bidirectional) against the float64 numpy forward: hidden within 3e-5
    of max|ref|, proposals equal. Needs neither torch nor dflash."""
    cfg, tensors, ld, emb, head = build(tmp_path, rng)
    hp = ld.hparams
    seq = DrafterModel(ld, Tensor(emb), Tensor(head)).new_sequence(64)
    feats = rng.normal(0, 1, (25, hp.n_taps * hp.n_embd)).astype(np.float32)
    seq.ingest(feats, 0)
    p = seq.propose(17, 25, return_logits=True, return_hidden=True)
    block = np.array([17] + [hp.mask_token_id] * (hp.block_size - 1))
    h64 = td.f64_forward(cfg, tensors, feats, emb[block], 25)[1:]
    assert rel(p.hidden, h64) < 3e-5
    td.assert_greedy_tokens(p.tokens, p.logits, h64 @ head.T.astype(np.float64), 3e-5)


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_ingest_chunking_is_bitwise_invariant(tmp_path, rng, family):
    """Context rows ingested all at once, in uneven pieces, or re-ingested after a rollback give
    bitwise the same caches and proposals (every native op is batch invariant), so a spec loop
    that ingests a+1 rows per round drafts exactly what a one-shot prefill ingest would."""
    kw = dict(sliding="all") if family == "dflash2" else {}
    cfg, tensors, ld, emb, head = build(tmp_path, rng, family=family, **kw)
    hp = ld.hparams
    m = DrafterModel(ld, Tensor(emb), Tensor(head))
    feats = rng.normal(0, 1, (33, hp.n_taps * hp.n_embd)).astype(np.float32)
    one, many = m.new_sequence(48), m.new_sequence(48)
    one.ingest(feats, 0)
    many.ingest(rng.normal(0, 1, (20, hp.n_taps * hp.n_embd)).astype(np.float32), 0)  # to be rolled back
    many.ingest(feats[:7], 0)
    for a, b in ((7, 8), (8, 19), (19, 33)):
        many.ingest(feats[a:b], a)
    for i, lk in enumerate(one.layers):
        held = np.arange(0 if lk.keep is None else 33 - lk.keep, 33)
        for a, b in zip(one.cached_kv(i, held), many.cached_kv(i, held)):
            assert np.array_equal(a, b)
    p1 = one.propose(9, 33, return_logits=True, topk=2)
    p2 = many.propose(9, 33, return_logits=True, topk=2)
    assert np.array_equal(p1.tokens, p2.tokens) and np.array_equal(p1.logits, p2.logits)
    assert np.array_equal(p1.topk_logprobs, p2.topk_logprobs)


def test_c20_feature_outliers_do_not_overflow(tmp_path, rng):
    """C20 (z-lab/dflash #160): taps holding ~1e5 in a few channels. The drafter is stored F16 (as
    published drafters are converted); the fusion must accumulate in F32. Planted so that F16
    arithmetic *would* overflow (fc outputs beyond 65504 in the sum of squares of the norm, and a
    tap value above F16's range after one multiply-add); our context rows are finite and equal the
    float64 reference within 1e-5, and the whole proposal is finite (F32 and F16 KV caches)."""
    cfg, tensors, ld, emb, head = build(tmp_path, rng, outtype="f16")
    hp = ld.hparams
    m = DrafterModel(ld, Tensor(emb), Tensor(head))
    feats = rng.normal(0, 1, (20, hp.n_taps * hp.n_embd)).astype(np.float32)
    cols = rng.choice(feats.shape[1], 6, replace=False)
    feats[:, cols] = rng.choice([-1, 1], (20, 6)) * rng.uniform(0.8e5, 1.2e5, (20, 6))
    fc16 = tensors["fc.weight"].astype(np.float16).astype(np.float64)
    pre = feats.astype(np.float64) @ fc16.T
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16((pre * pre).sum(1).max()))  # an F16 accumulation would overflow here
    c64 = pre / np.sqrt((pre * pre).mean(1, keepdims=True) + hp.rms_eps) * tensors["hidden_norm.weight"]
    c = m.context_rows(feats)
    assert np.isfinite(c).all() and rel(c, c64) < 1e-5
    for kv in (DType.F32, DType.F16):
        seq = DrafterModel(ld, Tensor(emb), Tensor(head), kv_dtype=kv).new_sequence(48)
        seq.ingest(feats, 0)
        p = seq.propose(3, 20, return_logits=True, return_hidden=True)
        assert np.isfinite(p.logits).all() and np.isfinite(p.hidden).all()
        assert ((0 <= p.tokens) & (p.tokens < hp.n_vocab)).all()


@pytest.mark.oracle
@pytest.mark.parametrize("head_dim,theta,factor,orig,betas", [
    (16, 1e7, 32.0, 8192, None),              # the tiny C21 drafter (β absent: transformers' 32 / 1)
    (128, 1e7, 32.0, 8192, (32.0, 1.0)),      # RadixArk DSpark as published
    (128, 1e6, 4.0, 32768, (16.0, 2.0)),
    (64, 5e5, 8.0, 4096, (32.0, 1.0)),
])
def test_c21_f64_yarn_reference_equals_transformers(head_dim, theta, factor, orig, betas):
    """The float64 YaRN reference the C21 test relies on equals transformers'
    ``ROPE_INIT_FUNCTIONS["yarn"]`` (inv_freq and attention_scaling) — it is not its own oracle."""
    pytest.importorskip("torch")
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": orig}
    if betas:
        rp.update(beta_fast=betas[0], beta_slow=betas[1])
    qc = Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                     max_position_embeddings=int(orig * factor), rope_parameters=rp)
    inv_t, scale_t = ROPE_INIT_FUNCTIONS["yarn"](qc, "cpu")
    inv, ms = td.f64_yarn_inv_freq(head_dim, theta, factor, orig, *(betas or ()))
    np.testing.assert_allclose(inv, inv_t.double().numpy(), rtol=1e-6, atol=0)  # transformers: float32
    assert ms == pytest.approx(float(scale_t), rel=1e-12)


def test_c21_yarn_beyond_the_original_window(tmp_path, rng):
    """C21 (jundot/omlx PR #3594): a YaRN drafter (factor 32, original 8192) drafting at positions
    8200..8207. (a) Cached context keys equal float64 YaRN-rotated keys; (b) layer-0 attention
    scores of the block queries over all keys, formed from our rotated queries and our cache, equal
    the float64 reference scores within 1e-4 (absolute; scores are O(1)) — while plain RoPE
    (YaRN dropped) is off by > 0.1; (c) the whole forward matches the float64 reference."""
    cfg, tensors, ld, emb, head = build(tmp_path, rng, yarn=True)
    hp = ld.hparams
    assert hp.yarn is not None and hp.yarn.factor == 32 and hp.yarn.original_context_length == 8192
    m = DrafterModel(ld, Tensor(emb), Tensor(head))
    start = 8200
    seq = m.new_sequence(start + 16)
    feats = rng.normal(0, 1, (start, hp.n_taps * hp.n_embd)).astype(np.float32)
    seq.ingest(feats[:4000], 0)
    seq.ingest(feats[4000:], 4000)
    block = np.array([5] + [hp.mask_token_id] * (hp.block_size - 1))
    h64, s64 = td.f64_forward(cfg, tensors, feats, emb[block], start, return_layer0_scores=True)
    p = seq.propose(5, start, return_logits=True, return_hidden=True)
    # (a) context keys of layer 0 at positions past the original window
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    inv, ms = td.f64_yarn_inv_freq(hp.head_dim, hp.rope_theta, 32.0, 8192)
    sel = np.arange(8150, 8200)
    c64 = feats[sel].astype(np.float64) @ t["fc.weight"].T
    c64 = c64 / np.sqrt((c64 ** 2).mean(1, keepdims=True) + hp.rms_eps) * t["hidden_norm.weight"]
    k64 = (c64 @ t["layers.0.self_attn.k_proj.weight"].T).reshape(len(sel), hp.n_head_kv, hp.head_dim)
    k64 = k64 / np.sqrt((k64 ** 2).mean(-1, keepdims=True) + hp.rms_eps) * t["layers.0.self_attn.k_norm.weight"]
    k64 = td.f64_rope(k64, sel, inv, ms)
    assert np.abs(seq.cached_kv(0, sel)[0] - k64).max() < 1e-5
    # (b) layer-0 scores from our rotated queries and our cached keys (block K/V rows are written
    # by propose at start..start+B-1 and still in the cache)
    l0 = ld.weights.layers[0]
    u = sn.rms_norm(emb[block], l0.attn_norm, hp.rms_eps).numpy()
    q = sn.matmul(u, l0.attn_q).numpy().reshape(len(block), hp.n_head, hp.head_dim)
    q = sn.rms_norm(q, l0.attn_q_norm, hp.rms_eps)
    qr = m.rope(q, start + np.arange(len(block))).numpy()
    g = hp.n_head // hp.n_head_kv
    keys = np.repeat(seq.cached_kv(0, np.arange(start + len(block)))[0].astype(np.float64), g, axis=1)
    ours = np.einsum("qhd,khd->hqk", qr.astype(np.float64), keys) / np.sqrt(hp.head_dim)
    assert np.abs(ours - s64).max() < 1e-4
    plain = sn.rope_neox(q, (start + np.arange(len(block))).astype(np.int32), hp.head_dim, hp.rope_theta).numpy()
    assert np.abs(np.einsum("qhd,khd->hqk", plain.astype(np.float64), keys) / np.sqrt(hp.head_dim) - s64).max() > 0.1
    # (c) the whole forward
    assert rel(p.hidden, h64[1:]) < 1e-4
    td.assert_greedy_tokens(p.tokens, p.logits, h64[1:] @ head.T.astype(np.float64), 1e-4)


# ---------------------------------------------------------------------- end to end with Qwen35Model

E2E_DIMS = dict(vocab=1024, hidden=128, inter=256, heads=4, kv_heads=2, head_dim=32, taps=[0, 1, 2], n_target=4,
                mask=1000, block=6)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "target"))
    import tinymodels

    from specd.target_worker.convert import convert
    from specd.target_worker.gguf_loader import load_qwen35

    ck = tinymodels.build_checkpoint(tinymodels.SPECS["smoke"], tmp_path_factory.mktemp("tgt"))
    out = tmp_path_factory.mktemp("tgtgguf") / "smoke.gguf"
    convert(ck.path, out, "f32")
    return out, load_qwen35(out)


@pytest.mark.oracle
@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_end_to_end_with_qwen35_target(tmp_path, rng, tiny_target, family):
    """Capture the drafter's taps from a tiny qwen35 target, ingest the prefill's features, then
    three greedy speculative rounds: propose → target verify of [seed, drafts] → accept the
    matching prefix → commit → ingest the committed rows. Checks: the pair fits (check_pair),
    proposal shapes per family (B − 1 or B drafts), int32 ids within the vocabulary, the drafter
    context tracks the target's committed length, and the emitted tokens equal the target's own
    plain greedy continuation (lossless whatever the drafter proposes)."""
    from specd.target_worker.model import Qwen35Model

    path, tw = tiny_target
    kw = dict(sliding="all") if family == "dflash2" else {}
    folder, cfg, _ = td.make_drafter(tmp_path / family, family, rng, dtype="F32", scales=td.FORWARD_SCALES,
                                     dims=E2E_DIMS, **kw)
    ld = load_drafter(td.convert_tiny(folder, "f16"))
    hp = ld.hparams
    check_pair(hp, ld.path, tw.hparams, path)
    target = Qwen35Model(tw, capture_layers=hp.target_layer_ids, kv_dtype=DType.F32)
    drafter = DrafterModel.for_target(ld, tw)
    prompt = [int(x) for x in rng.integers(0, 1000, 9)]
    st = target.new_sequence(64)
    seed = int(np.argmax(target.prefill(st, prompt)))
    dseq = drafter.new_sequence(64)
    dseq.ingest(st.features.read(0, st.committed), 0)
    emitted = [seed]
    for _ in range(3):
        c = st.committed
        assert dseq.n_ctx == c
        p = dseq.propose(seed, c, topk=2)
        assert p.tokens.dtype == np.int32 and p.tokens.shape == (hp.n_drafts,)
        assert ((0 <= p.tokens) & (p.tokens < tw.hparams.n_vocab)).all()
        assert p.topk_ids.shape == (hp.n_drafts, 2) and np.isfinite(p.topk_logprobs).all()
        res = target.verify(st, [seed] + p.tokens.tolist())
        a = 0
        while a < len(p.tokens) and p.tokens[a] == res.argmax[a]:
            a += 1
        target.commit(st, res, a + 1)
        dseq.ingest(st.features.read(c, a + 1), c)
        seed = int(res.argmax[a])
        emitted += p.tokens[:a].tolist() + [seed]
    plain = target.new_sequence(64)
    want = [int(np.argmax(target.prefill(plain, prompt)))]
    while len(want) < len(emitted):
        want.append(int(np.argmax(target.decode(plain, want[-1]))))
    assert emitted == want
