"""Oracle: the tiny checkpoints match PyPI ``dflash==0.1.0``'s DFlash / DFlash 2 model classes
(oracles.md §2), and the reference loader reads them (published layout: codebooks without
``.weight``). Skipped when ``dflash`` / torch are not installed."""
from __future__ import annotations

import pytest

import tinydrafters as td

pytestmark = pytest.mark.oracle

dflash = pytest.importorskip("dflash")
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("family,sliding", [("dflash", "none"), ("dflash", "qwen36"), ("dflash2", "all")])
def test_documented_tensor_list_matches_reference_class(family, sliding):
    cfg = td.make_config(family, sliding=sliding)
    ref = td.reference_names(cfg)
    assert ref is not None
    assert ref == td.documented_names(cfg)


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_reference_loader_reads_tiny_checkpoint(make, family):
    from dflash import DFlash2DraftModel, DFlashDraftModel

    folder, cfg, tensors = make(family, dtype="F32", sliding="all" if family == "dflash2" else "none")
    cls = DFlash2DraftModel if family == "dflash2" else DFlashDraftModel
    model = cls.from_pretrained(str(folder), dtype=torch.float32)
    state = model.state_dict()
    for name, arr in tensors.items():
        key = name + ".weight" if name.endswith("_codebook") else name
        assert torch.equal(state[key], torch.from_numpy(arr)), name
    assert model.block_size == 8 and model.mask_token_id == 500 and list(model.target_layer_ids) == [1, 3, 5]
    if family == "dflash2":  # is_causal: false overrides the sliding layers' causality (ZL-0.1.0)
        assert all(layer.self_attn.is_causal is False for layer in model.layers)
        assert all(layer.self_attn.sliding_window == 32 for layer in model.layers)
