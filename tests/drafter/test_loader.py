"""Draft GGUF loader: typed hparams, zero-copy native views, required / contradictory keys, pair check."""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT

from ggufedit import rewrite
from specd.draft_worker.contract import ARCH, DrafterFormatError, DrafterPairError
from specd.draft_worker.gguf_loader import (
    TargetHParamsLike, check_pair, load_drafter, read_drafter_hparams,
)
from specd.draft_worker.quantize import quantize_drafter
from specd.native import DType


def k(suffix):
    return f"{ARCH}.{suffix}"


@dataclass
class Target:
    """Stand-in for specd.target_worker.gguf_loader.Qwen35HParams (only what check_pair reads)."""

    n_embd: int = 64
    n_vocab: int = 512
    n_layer: int = 6


def test_weights_are_zero_copy_views(converted, tmp_path):
    path, cfg, tensors, hp = converted("dflash2")
    ld = load_drafter(path)
    mm = ld.reader.data  # the file's memory map
    for name, t in ld.tensors.items():
        assert np.shares_memory(t.numpy(), mm), name
    w = ld.weights
    assert w.fc.shape == (64, 192) and w.fc.dtype == DType.F16
    assert w.layers[0].attn_norm.dtype == DType.F32 and w.layers[0].attn_norm.shape == (64,)
    assert w.layers[1].attn_output.shape == (64, 64) and w.layers[1].ffn_down.shape == (64, 128)
    assert w.layers[0].ffn_conv_base.shape == (2, 2, 64) and w.layers[0].ffn_conv_base.dtype == DType.F32
    np.testing.assert_array_equal(w.layers[0].attn_conv_base.numpy(), tensors["layers.0.attention_conv.base_kernel"])
    np.testing.assert_array_equal(w.output_norm.numpy(), tensors["norm.weight"])
    assert w.dspark is None

    q = tmp_path / "q8.gguf"
    quantize_drafter(path, q, log=lambda s: None)
    lq = load_drafter(q)
    assert lq.weights.fc.dtype == DType.Q8_0 and lq.weights.fc.shape == (64, 192)
    assert lq.weights.layers[0].attn_q.shape == (64, 64)
    assert np.shares_memory(lq.weights.fc.numpy(), lq.reader.data)
    assert lq.weights.fc.numpy().shape == (64, 192 // 32 * 34)  # raw Q8_0 rows


def test_read_hparams_only(converted):
    path, _, _, hp = converted("dspark")
    assert read_drafter_hparams(path) == hp


REQUIRED = ["dflash.family", "dflash.row_alignment", "dflash.target_layer_ids", "dflash.mask_token_id",
            "dflash.block_size", "rope.freq_base", "dflash.attention.causal_pattern",
            "attention.sliding_window_pattern", "embedding_length", "vocab_size", "dflash.n_target_layers",
            "dflash.output_multiplier"]


@pytest.mark.parametrize("suffix", REQUIRED)
def test_missing_required_key_named(converted, tmp_path, suffix):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf", drop_keys={k(suffix)})
    with pytest.raises(DrafterFormatError, match=rf"bad\.gguf: {k(suffix).replace('.', '[.]')} is missing"):
        load_drafter(bad)


@pytest.mark.parametrize("suffix", ["dflash.dspark.markov_rank", "dflash.dspark.confidence.enabled"])
def test_missing_dspark_key_named(converted, tmp_path, suffix):
    path, *_ = converted("dspark")
    bad = rewrite(path, tmp_path / "bad.gguf", drop_keys={k(suffix)})
    with pytest.raises(DrafterFormatError, match=rf"{k(suffix).replace('.', '[.]')} is missing"):
        load_drafter(bad)


def test_missing_dflash2_key_named(converted, tmp_path):
    path, *_ = converted("dflash2")
    bad = rewrite(path, tmp_path / "bad.gguf", drop_keys={k("dflash.dflash2.selector_top_k")})
    with pytest.raises(DrafterFormatError, match=r"dflash\.dflash2\.selector_top_k is missing"):
        load_drafter(bad)


def test_missing_yarn_key_named(converted, tmp_path):
    path, *_ = converted("dflash", yarn=True)
    bad = rewrite(path, tmp_path / "bad.gguf", drop_keys={k("rope.scaling.original_context_length")})
    with pytest.raises(DrafterFormatError, match=r"rope\.scaling\.original_context_length is missing"):
        load_drafter(bad)


@pytest.mark.parametrize("suffix,value,match", [
    ("dflash.n_target_layers", (4, VT.UINT32), r"dflash\.n_target_layers = 4 contradicts the length of"),
    ("rope.dimension_count", (8, VT.UINT32), r"rope\.dimension_count = 8 contradicts"),
    ("dflash.n_target_features", (100, VT.UINT32), r"dflash\.n_target_features = 100 contradicts"),
    ("dflash.row_alignment", ("proposals_only", VT.STRING), r"row_alignment = 'proposals_only' contradicts family 'dflash'"),
    ("attention.sliding_window", (32, VT.UINT32), r"attention\.sliding_window = 32 but no layer is a sliding layer"),
    ("attention.sliding_window_pattern", ([True], VT.ARRAY, VT.BOOL), r"sliding_window_pattern has 1 entries for 2 layers"),
    ("dflash.target_layer_ids", ([3, 1, 5], VT.ARRAY, VT.INT32), r"target_layer_ids = \[3, 1, 5\]: expected strictly increasing"),
    ("dflash.mask_token_id", (512, VT.UINT32), r"mask_token_id = 512 is outside the drafter vocabulary"),
    ("dflash.block_size", (1, VT.UINT32), r"block_size = 1: a block holds the anchor"),
    ("dflash.family", ("dspark", VT.STRING), r"dflash\.dspark\.enabled is missing"),
    ("dflash.dflash2.conv_kernel_size", (2, VT.UINT32), r"conv_kernel_size is present but .*dflash\.family = 'dflash'"),
    ("rope.scaling.factor", (4.0, VT.FLOAT32), r"rope\.scaling\.factor is present but .* is not 'yarn'"),
])
def test_contradictory_keys(converted, tmp_path, suffix, value, match):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf", set_keys={k(suffix): value})
    with pytest.raises(DrafterFormatError, match=match):
        load_drafter(bad)


def test_dspark_vocab_contradiction(converted, tmp_path):
    path, *_ = converted("dspark")
    bad = rewrite(path, tmp_path / "bad.gguf", set_keys={k("dflash.dspark.vocab_size"): (1000, VT.UINT32)})
    with pytest.raises(DrafterFormatError, match=r"dflash\.dspark\.vocab_size = 1000 contradicts qwen35-dflash-draft\.vocab_size = 512"):
        load_drafter(bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_c18c_theta_not_finite_in_gguf(converted, tmp_path, value):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf", set_keys={k("rope.freq_base"): (value, VT.FLOAT32)})
    with pytest.raises(DrafterFormatError, match=r"rope\.freq_base = (nan|inf) is not finite"):
        load_drafter(bad)


def test_c18b_theta_zero_in_gguf(converted, tmp_path):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf", set_keys={k("rope.freq_base"): (0.0, VT.FLOAT32)})
    with pytest.raises(DrafterFormatError, match=r"rope\.freq_base = 0\.0: the RoPE base must be > 1"):
        load_drafter(bad)


def test_unknown_tensor_in_gguf(converted, tmp_path):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf", rename_tensors={"blk.1.attn_q_norm.weight": "blk.1.attn_gate.weight"})
    with pytest.raises(DrafterFormatError, match=r"unknown tensor\(s\) blk\.1\.attn_gate\.weight"):
        load_drafter(bad)


@pytest.mark.parametrize("family,tensor", [("dspark", "dflash.dspark.markov.w1"), ("dspark", "dflash.dspark.confidence.bias"),
                                           ("dflash2", "dflash.selector.hproj.weight"), ("dflash2", "blk.0.attn_conv.proj.weight")])
def test_missing_head_tensor_in_gguf(converted, tmp_path, family, tensor):
    path, *_ = converted(family)
    bad = rewrite(path, tmp_path / "bad.gguf", drop_tensors={tensor})
    with pytest.raises(DrafterFormatError, match=rf"missing tensor\(s\) {tensor.replace('.', '[.]')}"):
        load_drafter(bad)


def test_wrong_tensor_shape(converted, tmp_path):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf",
                  replace_tensors={"blk.0.ffn_up.weight": np.zeros((96, 64), np.float16)})
    with pytest.raises(DrafterFormatError, match=r"blk\.0\.ffn_up\.weight has ne \[64, 96\]; the metadata implies \[64, 128\]"):
        load_drafter(bad)


def test_norm_must_be_f32(converted, tmp_path):
    path, *_ = converted("dflash")
    bad = rewrite(path, tmp_path / "bad.gguf",
                  replace_tensors={"output_norm.weight": np.ones(64, np.float16)})
    with pytest.raises(DrafterFormatError, match=r"output_norm\.weight is F16; norms must be F32"):
        load_drafter(bad)


def test_aliases_accepted(converted, tmp_path):
    path, *_ = converted("dflash")
    alias = rewrite(path, tmp_path / "alias.gguf", rename_tensors={
        "dflash.fc.weight": "dflash_fc.weight", "blk.0.ffn_norm.weight": "blk.0.post_attention_norm.weight"})
    ld = load_drafter(alias)
    assert ld.weights.fc.shape == (64, 192) and ld.weights.layers[0].ffn_norm.shape == (64,)


def test_db_dflash_draft_and_foreign_arch_refused(converted, tmp_path):
    path, *_ = converted("dflash")
    with pytest.raises(DrafterFormatError, match=r"general\.architecture = 'dflash-draft' .*convert-drafter"):
        load_drafter(rewrite(path, tmp_path / "db.gguf", arch="dflash-draft"))
    with pytest.raises(DrafterFormatError, match=r"general\.architecture = 'qwen35' is not a drafter"):
        load_drafter(rewrite(path, tmp_path / "t.gguf", arch="qwen35"))


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf at all")
    with pytest.raises(DrafterFormatError, match=r"x\.gguf: not a readable GGUF file"):
        load_drafter(p)


@pytest.mark.parametrize("where", ["header", "data"])
def test_truncated_gguf_names_the_file(converted, tmp_path, where):
    """A GGUF cut inside its header (the reader fails with IndexError/ValueError) or inside the tensor
    data (ranges past the end of the file) is refused naming the file, by the loader and the
    mainline translator alike (both open through target_worker's open_gguf)."""
    from specd.draft_worker.dialect import translate_mainline
    path, *_ = converted("dflash")
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:200] if where == "header" else raw[:-64])
    # gguf's reader itself fails on most data cuts; open_gguf's range check catches the rest
    match = (r"cut\.gguf: not a readable GGUF file \(truncated or corrupt\)" if where == "header"
             else r"cut\.gguf: (not a readable GGUF file \(truncated|tensor '.*' data ends at byte \d+, past the end)")
    with pytest.raises(DrafterFormatError, match=match):
        load_drafter(cut)
    with pytest.raises(DrafterFormatError, match=match):
        translate_mainline(cut, tmp_path / "o.gguf", tap_offset=1, log=lambda s: None)


# -- pair check ----------------------------------------------------------------------------------------------


def test_check_pair_ok(converted):
    path, _, _, hp = converted("dspark")
    assert isinstance(Target(), TargetHParamsLike)
    check_pair(hp, path, Target(), "target.gguf")


@pytest.mark.parametrize("target,match", [
    (Target(n_embd=128), r"hidden size: drafter qwen35-dflash-draft\.embedding_length = 64, target n_embd = 128"),
    (Target(n_vocab=1024), r"vocabulary: drafter qwen35-dflash-draft\.vocab_size = 512, target n_vocab = 1024"),
    (Target(n_vocab=400), r"mask token: drafter qwen35-dflash-draft\.dflash\.mask_token_id = 500 is not a target token id"),
    (Target(n_layer=5), r"tap ids: .*\[5\] outside the target's 5 layers"),
    (Target(n_layer=8), r"target depth: drafter qwen35-dflash-draft\.dflash\.target\.block_count = 6"),
])
def test_check_pair_mismatch(converted, target, match):
    path, _, _, hp = converted("dflash")
    with pytest.raises(DrafterPairError, match=match) as ei:
        check_pair(hp, path, target, "/models/target-27b.gguf")
    msg = str(ei.value)
    assert str(path) in msg and "/models/target-27b.gguf" in msg


def test_check_pair_reports_every_problem(converted):
    path, _, _, hp = converted("dflash")
    with pytest.raises(DrafterPairError) as ei:
        check_pair(hp, path, Target(n_embd=32, n_vocab=256, n_layer=4), "t.gguf")
    msg = str(ei.value)
    for what in ("hidden size", "vocabulary", "mask token", "tap ids", "target depth"):
        assert what in msg


def test_c17_weights_only_gguf_mask_from_metadata(converted, tmp_path):
    """C17: a drafter GGUF without any tokenizer: the mask id comes from the drafter metadata and is
    checked against the target's vocabulary size, with no vocabulary lookup."""
    path, _, _, hp = converted("dflash2")
    kv = gguf.GGUFReader(path).fields
    assert not any(name.startswith("tokenizer.") for name in kv)
    ld = load_drafter(path)
    assert ld.hparams.mask_token_id == 500
    check_pair(ld.hparams, path, Target(), "target.gguf")
    # same drafter, mask id beyond a smaller target vocabulary (and vocab mismatch) → pair error
    with pytest.raises(DrafterPairError, match=r"dflash\.mask_token_id = 500 is not a target token id \(target vocabulary 500\)"):
        check_pair(ld.hparams, path, Target(n_vocab=500), "target.gguf")
    # and without the key there is no fallback lookup: a clear load error
    with pytest.raises(DrafterFormatError, match=r"dflash\.mask_token_id is missing"):
        load_drafter(rewrite(path, tmp_path / "nomask.gguf", drop_keys={k("dflash.mask_token_id")}))


def test_summary_reports_effective_values(converted):
    _, _, _, hp = converted("dspark", yarn=True)
    s = hp.summary()
    assert "block_size=8 (8 drafts, verify 9, proposals_only)" in s and "yarn(factor=32" in s and "mask=500" in s
