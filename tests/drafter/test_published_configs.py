"""Published 27B-class drafter configs (drafters.md §2.2, §5.6, §6.1) read through the converter's
config reader against shape-only tensor tables (no weights are read), and the resulting tensor
contract cross-checked with the documented parameter counts."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import tinydrafters as td
from specd.draft_worker.contract import expected_tensors
from specd.draft_worker.hf_config import read_hf_drafter
from specd.draft_worker.safetensors_io import StTensor

QWEN38_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
    "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 248070,
                      "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61]},
    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5,
    "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "use_sliding_window": True,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_target_layers": 64,
    "vocab_size": 248320, "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
    "rms_norm_eps": 1e-6, "transformers_version": "5.15.0",
}

RADIXARK_DSPARK = {
    "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "block_size": 7, "num_hidden_layers": 5,
    "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 10240, "num_target_layers": 64, "vocab_size": 248320, "rms_norm_eps": 1e-6,
    "dflash_config": {"target_layer_ids": [4, 16, 28, 40, 52], "markov_rank": 256, "projector_type": "dspark",
                      "mask_token_id": 248070},
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000000.0, "factor": 32.0,
                        "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0},
}

QWEN35_DFLASH = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_hidden_layers": 5,
    "hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "num_target_layers": 64, "vocab_size": 248320, "rms_norm_eps": 1e-6,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
}


def shape_only(cfg: dict) -> dict[str, StTensor]:
    """A tensor table with the documented names and shapes and no data behind it."""
    return {n: StTensor(n, "BF16", s, Path("/nonexistent"), 0, 2 * math.prod(s))
            for n, s in td.documented_names(cfg).items()}


def read(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = read_hf_drafter(tmp_path / "config.json", shape_only(cfg))
    params = sum(math.prod(s.ne) for s in expected_tensors(d.hparams).values())
    return d.hparams, params


def test_qwen38_27b_dflash2(tmp_path):
    hp, params = read(tmp_path, QWEN38_DFLASH2)
    assert (hp.family, hp.block_size, hp.n_drafts, hp.verify_width) == ("dflash2", 8, 7, 8)
    assert hp.target_layer_ids == (5, 19, 33, 47, 61) and hp.mask_token_id == 248070
    assert hp.sliding_pattern == (True,) * 5 and hp.sliding_window == 2048
    assert hp.causal_pattern == (False,) * 5  # is_causal: false (ZL-0.1.0 rule)
    assert hp.dflash2.selector_top_k == 16 and hp.dflash2.conv_group_size == 16
    assert params == pytest.approx(1.924e9, rel=1e-3)  # drafters.md §6.4


def test_radixark_qwen38_27b_dspark(tmp_path):
    hp, params = read(tmp_path, RADIXARK_DSPARK)
    assert (hp.family, hp.row_alignment, hp.block_size, hp.n_drafts, hp.verify_width) == \
        ("dspark", "proposals_only", 7, 7, 8)
    assert hp.yarn.factor == 32 and hp.yarn.original_context_length == 8192
    assert hp.yarn.attention_factor == pytest.approx(1 + 0.1 * math.log(32), rel=1e-6)
    assert hp.dspark.markov_rank == 256 and not hp.dspark.confidence
    assert params == pytest.approx(1.3593e9, rel=1e-3)  # drafters.md §5.6: 2,718,576,122-byte bf16 shard


def test_qwen35_27b_dflash(tmp_path):
    hp, params = read(tmp_path, QWEN35_DFLASH)
    assert (hp.family, hp.block_size, hp.n_drafts) == ("dflash", 16, 15)
    assert hp.causal_pattern == (False,) * 5 and hp.sliding_window is None
    assert params == pytest.approx(1.73e9, rel=1e-2)  # drafters.md §2.3
