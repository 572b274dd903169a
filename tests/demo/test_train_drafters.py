"""tools/demo/train_drafters.py on the CPU with synthetic data (no GPU, no corpus): for each family
the objective is finite and falls over a few steps, the training forward equals dflash's reference
forward on one block, and the exported checkpoint (published HF layout) converts with
``specd convert-drafter`` and loads, paired with the demo target, in specd's drafter loader.

The data are a deterministic token pattern (token at t = (7 t) mod 97 + 10) with random features,
so the labels the objective reads at anchor + k are checkable: a drafter that learned the pattern
proposes it (checked through ``propose`` after training a few dozen steps on DFlash)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("dflash")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "demo"))
import train_drafters as T  # noqa: E402

from specd.draft_worker.convert import convert_hf  # noqa: E402
from specd.draft_worker.engine import open_model_drafter  # noqa: E402

S, LEN, P = 4, 64, 16  # sequences, tokens each, "prompt" rows before the anchors


def synthetic(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(LEN)
    tokens = ((7 * t) % 97 + 10).expand(S, LEN).clone()
    feats = torch.randn(S, LEN, len(T.TAPS) * T.DRAFT["hidden_size"], generator=g).bfloat16()
    last = torch.randn(S, LEN, T.DRAFT["hidden_size"], generator=g).bfloat16()
    embed = torch.randn(T.DRAFT["vocab_size"], T.DRAFT["hidden_size"], generator=g) * 0.05
    return tokens, feats, last, embed


@pytest.mark.parametrize("family", sorted(T.FAMILIES))
def test_objective_falls_reference_matches_and_export_loads(tmp_path, family):
    torch.manual_seed(0)
    tokens, feats, last, embed = synthetic()
    B = T.FAMILIES[family]["block"]
    model, heads = T.build_drafter(family)
    params = list(model.parameters()) + (list(heads.parameters()) if heads is not None else [])
    opt = torch.optim.AdamW(params, lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(12):
        anchors = T.sample_anchors(S, 3, P, LEN - B - 1, g, torch.device("cpu"))
        loss, _ = T.losses(family, model, heads, embed, {"tokens": tokens, "feats": feats, "last": last,
                                                        "anchors": anchors}, B)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])
    data = {"tokens": tokens, "feats": feats, "prompt": P}
    model.eval()
    assert T.reference_check(family, model, embed, data, B, torch.device("cpu")) < 1e-4
    out = T.export(family, model, heads, tmp_path)
    gguf = tmp_path / f"{family}.gguf"
    convert_hf(out, gguf, "f32")
    d = open_model_drafter(str(gguf), str(ROOT / "models" / "demo-target.gguf"))
    assert d.family == family and d.target_layer_ids == tuple(T.TAPS)


def test_labels_follow_the_anchor():
    """A DFlash drafter trained on the pattern proposes it: draft k of a block at anchor a is the
    token at a + k (the objective's labels are not shifted)."""
    torch.manual_seed(0)
    tokens, feats, last, embed = synthetic()
    B = T.FAMILIES["dflash"]["block"]
    model, heads = T.build_drafter("dflash")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        anchors = T.sample_anchors(S, 4, P, LEN - B - 1, g, torch.device("cpu"))
        loss, _ = T.losses("dflash", model, heads, embed, {"tokens": tokens, "feats": feats, "last": last,
                                                          "anchors": anchors}, B)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    al = T.block_acceptance("dflash", model, heads, embed, {"tokens": tokens, "feats": feats, "prompt": P}, B,
                            torch.device("cpu"), stride=4)
    assert al > 3.0, f"acceptance {al:.2f} on a learnable pattern"
