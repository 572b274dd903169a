"""convert-drafter: HF DFlash / DSpark / DFlash 2 checkpoints → draft GGUF (drafters.md §2, §7)."""
from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import tinydrafters as td
from specd.draft_worker.contract import ARCH, DrafterFormatError, hf_to_gguf_name
from specd.draft_worker.convert import convert_hf
from specd.draft_worker.gguf_loader import load_drafter


def fields(path):
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}, {t.name: t for t in r.tensors}


def k(suffix):
    return f"{ARCH}.{suffix}"


def rewrite_config(folder, mutate):
    cfg = json.loads((folder / "config.json").read_text())
    mutate(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


def convert_err(folder, tmp_path, match):
    with pytest.raises(DrafterFormatError, match=match) as ei:
        convert_hf(folder, tmp_path / "bad.gguf", log=lambda s: None)
    assert not (tmp_path / "bad.gguf").exists()
    return str(ei.value)


# -- layouts ----------------------------------------------------------------------------------------------


def check_roundtrip(path, cfg, tensors, hp):
    """Every HF tensor is in the GGUF under its contract name with the reversed shape and the same
    values (F16 rounding for matrices, exact F32 for norms / conv bases / confidence head)."""
    kv, ts = fields(path)
    assert kv["general.architecture"] == ARCH
    expected = {hf_to_gguf_name(n): n for n in tensors if hf_to_gguf_name(n)}
    assert set(ts) == set(expected)
    for g, hf in expected.items():
        t = ts[g]
        src = tensors[hf]
        assert tuple(int(x) for x in t.shape) == tuple(reversed(src.shape)), g
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(src.shape)
        if src.ndim == 1 or "conv.base" in g or "confidence" in g:
            assert t.tensor_type == QT.F32, g
            np.testing.assert_array_equal(got, src, err_msg=g)
        else:
            assert t.tensor_type == QT.F16, g
            np.testing.assert_allclose(got, src.astype(np.float16).astype(np.float32), rtol=0, atol=0, err_msg=g)
    ld = load_drafter(path)
    assert ld.hparams == hp
    return kv, ld


def test_dflash_layout_roundtrip(converted):
    path, cfg, tensors, hp = converted("dflash")
    kv, ld = check_roundtrip(path, cfg, tensors, hp)
    assert (hp.family, hp.row_alignment, hp.n_drafts, hp.verify_width) == ("dflash", "seed_then_proposals", 7, 8)
    assert kv[k("dflash.block_size")] == 8 and kv[k("dflash.mask_token_id")] == 500
    assert kv[k("dflash.target_layer_ids")] == [1, 3, 5] and kv[k("dflash.n_target_layers")] == 3
    assert kv[k("dflash.n_target_features")] == 3 * 64 and kv[k("dflash.target.block_count")] == 6
    assert kv[k("rope.freq_base")] == 1e7 and kv[k("rope.dimension_count")] == 16
    assert kv[k("attention.sliding_window_pattern")] == [False, False]
    assert kv[k("dflash.attention.causal_pattern")] == [False, False]  # no layer_types: bidirectional
    assert k("attention.sliding_window") not in kv and k("rope.scaling.type") not in kv
    assert kv[k("dflash.family")] == "dflash"
    assert json.loads(kv[k("source.config_json")]) == cfg


def test_dspark_single_file_specforge(make, tmp_path):
    folder, cfg, tensors = make("dspark")
    out = tmp_path / "dspark.gguf"
    hp = convert_hf(folder / "model.safetensors", out, log=lambda s: None)  # a single file, config beside it
    kv, ld = check_roundtrip(out, cfg, tensors, hp)
    assert (hp.family, hp.row_alignment, hp.n_drafts, hp.verify_width) == ("dspark", "proposals_only", 8, 9)
    assert hp.dspark.markov_rank == td.DSPARK_RANK and hp.dspark.confidence and hp.dspark.confidence_with_markov
    assert kv[k("dflash.dspark.confidence_dim")] == 64 + td.DSPARK_RANK
    assert kv[k("dflash.dspark.vocab_size")] == 512 and kv[k("dflash.dspark.markov_type")] == "vanilla"
    assert ld.weights.dspark.markov_w1.shape == (512, td.DSPARK_RANK)
    assert ld.weights.dspark.confidence_weight.shape == (1, 64 + td.DSPARK_RANK)


def test_dspark_deepspec_drops_target_copies(make, tmp_path):
    folder, cfg, tensors = make("dspark", packaging="deepspec", confidence=True, with_markov=False)
    assert "embed_tokens.weight" in tensors and "lm_head.weight" in tensors
    logs = []
    hp = convert_hf(folder, tmp_path / "ds.gguf", log=logs.append)
    assert any("dropped embed_tokens.weight, lm_head.weight" in s for s in logs)
    _, ts = fields(tmp_path / "ds.gguf")
    assert not any("embed" in n or "lm_head" in n for n in ts)
    assert hp.dspark.confidence and not hp.dspark.confidence_with_markov
    assert ts["dflash.dspark.confidence.weight"].shape.tolist() == [64, 1]


def test_dflash2_layout(converted):
    path, cfg, tensors, hp = converted("dflash2", sliding="all")
    assert "candidate_selector.predecessor_codebook" in tensors  # published: no .weight
    kv, ld = check_roundtrip(path, cfg, tensors, hp)
    assert hp.family == "dflash2"
    d2 = hp.dflash2
    assert (d2.conv_kernel_size, d2.conv_group_size, d2.selector_rank, d2.selector_top_k) == (2, 16, 8, 4)
    assert kv[k("attention.sliding_window")] == 32
    assert kv[k("attention.sliding_window_pattern")] == [True, True]
    assert kv[k("dflash.attention.causal_pattern")] == [False, False]  # is_causal: false overrides
    assert kv[k("dflash.dflash2.selector_top_k")] == 4
    L0 = ld.weights.layers[0]
    assert L0.attn_conv_base.shape == (2, 2, 64) and L0.attn_conv_proj.shape == (2 * 2 * 4, 64)
    assert ld.weights.selector.pred_cb.shape == (512, 8) and ld.weights.selector.hproj.shape == (8, 64)


def test_dflash2_codebooks_saved_with_weight_suffix(make, tmp_path):
    """dflash 0.1.0's save_pretrained writes the codebooks as ``*.weight``; both spellings load."""
    folder, cfg, tensors = make("dflash2")
    renamed = {(n + ".weight" if n.endswith("_codebook") else n): v for n, v in tensors.items()}
    td.write_checkpoint(folder, cfg, renamed)
    hp = convert_hf(folder, tmp_path / "d2.gguf", log=lambda s: None)
    assert hp.dflash2.selector_rank == 8


def test_qwen36_sliding_pattern(converted):
    _, _, _, hp = converted("dflash", sliding="qwen36")
    assert hp.sliding_pattern == (True, False) and hp.sliding_window == 32
    assert hp.causal_pattern == (True, False)  # sliding → causal, full → bidirectional


def test_sharded_checkpoint_with_index(converted):
    path, cfg, tensors, hp = converted("dflash", shards=3)
    check_roundtrip(path, cfg, tensors, hp)


@pytest.mark.parametrize("outtype,qtype", [("f32", QT.F32), ("bf16", QT.BF16), ("q8_0", QT.Q8_0)])
def test_outtypes(converted, outtype, qtype):
    path, cfg, tensors, hp = converted("dflash2", outtype=outtype)
    ld = load_drafter(path)
    _, ts = fields(path)
    assert ts["blk.0.attn_q.weight"].tensor_type == qtype
    assert ts["blk.0.attn_norm.weight"].tensor_type == QT.F32
    if outtype == "q8_0":  # codebooks have ne0 = rank 8, not a multiple of 32: F16
        assert ts["dflash.selector.pred_cb"].tensor_type == QT.F16
    w = gguf.quants.dequantize(np.asarray(ts["dflash.fc.weight"].data), qtype).reshape(64, 192)
    rel = np.linalg.norm(w - tensors["fc.weight"]) / np.linalg.norm(tensors["fc.weight"])
    assert rel < (1e-6 if outtype == "f32" else 1e-2)
    assert ld.hparams == hp


# -- config keys ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope", ["nested", "toplevel"])
def test_rope_theta_nested_or_toplevel(converted, rope):
    path, cfg, _, hp = converted("dflash", rope=rope)
    assert ("rope_parameters" in cfg) == (rope == "nested")
    assert hp.rope_theta == 1e7 and hp.yarn is None
    assert fields(path)[0][k("rope.freq_base")] == 1e7


@pytest.mark.parametrize("rope", ["nested", "toplevel"])
def test_yarn_carried(converted, rope):
    """C21 prerequisite: YaRN (factor 32 over 8192) is carried into the GGUF, never dropped."""
    path, _, _, hp = converted("dspark", rope=rope, yarn=True)
    kv, _ = fields(path)
    assert kv[k("rope.scaling.type")] == "yarn"
    assert kv[k("rope.scaling.factor")] == 32.0 and kv[k("rope.scaling.original_context_length")] == 8192
    assert kv[k("rope.scaling.beta_fast")] == 32.0 and kv[k("rope.scaling.beta_slow")] == 1.0
    assert kv[k("rope.scaling.attn_factor")] == 1.0  # ggml-relative: HF default
    assert hp.yarn.attention_factor == pytest.approx(1 + 0.1 * math.log(32), rel=1e-6)
    assert load_drafter(path).hparams.yarn == hp.yarn


def test_yarn_explicit_attention_factor(make, tmp_path):
    folder, _, _ = make("dflash", yarn=True)
    rewrite_config(folder, lambda c: c["rope_parameters"].update(attention_factor=1.5))
    hp = convert_hf(folder, tmp_path / "y.gguf", log=lambda s: None)
    assert hp.yarn.attention_factor == pytest.approx(1.5, rel=1e-6)
    assert hp.yarn.attn_factor == pytest.approx(1.5 / (1 + 0.1 * math.log(32)), rel=1e-6)


def test_yarn_missing_original_context(make, tmp_path):
    folder, _, _ = make("dflash", yarn=True)
    rewrite_config(folder, lambda c: c["rope_parameters"].pop("original_max_position_embeddings"))
    convert_err(folder, tmp_path, r"rope_parameters\.original_max_position_embeddings is missing")


def test_unsupported_rope_type(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c["rope_parameters"].update(rope_type="linear", factor=2.0))
    convert_err(folder, tmp_path, r"RoPE scaling type 'linear' is not supported")


def test_c19_block_size_inside_dflash_config(make, tmp_path):
    """C19: DFlash 2 with block_size 8 only inside dflash_config is read, and reported."""
    folder, cfg, _ = make("dflash2", block_at="dflash_config")
    assert "block_size" not in cfg and cfg["dflash_config"]["block_size"] == 8
    logs = []
    hp = convert_hf(folder, tmp_path / "c19a.gguf", log=logs.append)
    assert hp.block_size == 8
    assert any("block_size = 8 (from dflash_config.block_size)" in s for s in logs)
    assert load_drafter(tmp_path / "c19a.gguf").hparams.summary().startswith("dflash2 drafter: block_size=8")


def test_c19_block_size_top_level(make, tmp_path):
    """C19: an older DFlash config with block_size 16 at top level is read, and reported."""
    folder, _, _ = make("dflash", block_at="top")
    rewrite_config(folder, lambda c: c.update(block_size=16))
    logs = []
    hp = convert_hf(folder, tmp_path / "c19b.gguf", log=logs.append)
    assert hp.block_size == 16 and hp.n_drafts == 15
    assert any("block_size = 16 (from block_size)" in s for s in logs)


def test_c19_block_size_contradiction(make, tmp_path):
    folder, _, _ = make("dflash2")
    rewrite_config(folder, lambda c: c.update(block_size=16))
    convert_err(folder, tmp_path, r"dflash_config\.block_size = 8 contradicts block_size = 16")


def test_c16_missing_target_layer_ids(make, tmp_path):
    """C16: no target_layer_ids anywhere → error naming the key, no spread-formula fallback."""
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c["dflash_config"].pop("target_layer_ids"))
    msg = convert_err(folder, tmp_path, r"target_layer_ids is missing")
    assert "dflash_config.target_layer_ids" in msg and "aux_hidden_state_layer_ids" in msg


def test_c16_top_level_target_layer_ids_read(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c.update(target_layer_ids=c["dflash_config"].pop("target_layer_ids")))
    assert convert_hf(folder, tmp_path / "t.gguf", log=lambda s: None).target_layer_ids == (1, 3, 5)


def test_c18a_theta_carried_from_config(converted):
    """C18a: the converter carries the config's θ (1e7), not a hardcoded 1e6 (LH converter bug)."""
    path, _, _, hp = converted("dflash")
    assert hp.rope_theta == 1e7 != 1e6
    assert fields(path)[0][k("rope.freq_base")] == 1e7


def test_c18b_theta_missing(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c["rope_parameters"].pop("rope_theta"))
    convert_err(folder, tmp_path, r"RoPE base θ is missing: looked for rope_parameters\.rope_theta and rope_theta")


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("rope", ["nested", "toplevel"])
def test_c18c_theta_not_finite(make, tmp_path, bad, rope):
    folder, _, _ = make("dflash", rope=rope)
    text = (folder / "config.json").read_text().replace("10000000.0", bad)
    (folder / "config.json").write_text(text)
    key = "rope_parameters.rope_theta" if rope == "nested" else "rope_theta"
    convert_err(folder, tmp_path, rf"{key.replace('.', '[.]')} = [-a-zA-Z]+ is not finite")


def test_theta_nested_and_toplevel_contradict(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c.update(rope_theta=1e6))
    convert_err(folder, tmp_path, r"rope_parameters\.rope_theta = 10000000\.0 contradicts rope_theta = 1000000\.0")


def test_mask_out_of_vocab(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c["dflash_config"].update(mask_token_id=512))
    convert_err(folder, tmp_path, r"dflash_config\.mask_token_id = 512 is outside the drafter vocabulary \[0, 512\)")


def test_missing_mask(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c["dflash_config"].pop("mask_token_id"))
    convert_err(folder, tmp_path, r"mask_token_id is missing: looked for dflash_config\.mask_token_id")


def test_taps_beyond_declared_target_depth(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c.update(num_target_layers=5))
    convert_err(folder, tmp_path, r"dflash_config\.target_layer_ids = \[1, 3, 5\] reaches beyond the 5 target layers")


def test_tap_count_disagrees_with_fc(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c["dflash_config"].update(target_layer_ids=[1, 3]))
    convert_err(folder, tmp_path, r"lists 2 taps but fc\.weight has 192 inputs")


def test_config_shape_contradicts_tensors(make, tmp_path):
    folder, _, _ = make("dflash")
    rewrite_config(folder, lambda c: c.update(intermediate_size=96))
    convert_err(folder, tmp_path, r"intermediate_size = 96 contradicts the checkpoint")


def test_shape_keys_absent_taken_from_tensors(make, tmp_path):
    folder, _, _ = make("dspark")
    rewrite_config(folder, lambda c: [c.pop(x) for x in ("head_dim", "intermediate_size", "num_key_value_heads")])
    logs = []
    hp = convert_hf(folder, tmp_path / "s.gguf", log=logs.append)
    assert (hp.head_dim, hp.n_ff, hp.n_head_kv) == (16, 128, 2)
    assert any("head_dim = 16 (absent from config" in s for s in logs)


@pytest.mark.parametrize("flag", [False, None])
def test_sliding_layers_without_use_sliding_window(make, tmp_path, flag):
    """transformers' Qwen3Config drops sliding_window unless use_sliding_window is true (dflash
    0.1.0 then runs those layers causal without a window): specd does the same and says so."""
    folder, _, _ = make("dflash", sliding="qwen36")
    rewrite_config(folder, lambda c: c.update(use_sliding_window=False) if flag is False else c.pop("use_sliding_window"))
    logs = []
    hp = convert_hf(folder, tmp_path / "s.gguf", log=logs.append)
    assert hp.sliding_window is None and not any(hp.sliding_pattern)
    assert hp.causal_pattern == (True,) * (hp.n_layer - 1) + (False,)
    assert any("get no window" in s for s in logs)


# -- tensors ----------------------------------------------------------------------------------------------------


def test_unknown_tensor_refused(make, tmp_path):
    folder, cfg, tensors = make("dflash")
    td.write_checkpoint(folder, cfg, tensors | {"layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    convert_err(folder, tmp_path, r"unknown tensor\(s\) .*layers\.0\.self_attn\.q_proj\.bias")


@pytest.mark.parametrize("family,drop,match", [
    ("dspark", "markov_head.markov_w2.weight", r"missing tensor.*dflash\.dspark\.markov\.w2 \(HF markov_head\.markov_w2\.weight\)"),
    ("dspark", "confidence_head.proj.weight", r"missing DSpark head tensor confidence_head\.proj\.weight"),
    ("dflash2", "candidate_selector.successor_codebook", r"missing tensor.*dflash\.selector\.succ_cb"),
    ("dflash2", "layers.1.mlp_conv.base_kernel", r"missing tensor.*blk\.1\.ffn_conv\.base \(HF layers\.1\.mlp_conv\.base_kernel\)"),
    ("dflash", "hidden_norm.weight", r"missing tensor.*dflash\.hidden_norm\.weight"),
])
def test_missing_head_tensors(make, tmp_path, family, drop, match):
    folder, cfg, tensors = make(family)
    td.write_checkpoint(folder, cfg, {n: v for n, v in tensors.items() if n != drop})
    convert_err(folder, tmp_path, match)


def test_family_contradicts_tensors(make, tmp_path):
    folder, _, _ = make("dflash2")
    rewrite_config(folder, lambda c: c.update(architectures=["DFlashDraftModel"]))
    convert_err(folder, tmp_path, r"architectures = \['DFlashDraftModel'\] \(family dflash\) but the checkpoint has DFlash 2")


def test_family_inferred_without_architectures(make, tmp_path):
    folder, _, _ = make("dflash2")
    rewrite_config(folder, lambda c: c.pop("architectures"))
    logs = []
    assert convert_hf(folder, tmp_path / "f.gguf", log=logs.append).family == "dflash2"
    assert any("inferred from the tensor set" in s for s in logs)


def test_f16_overflow_refused(make, tmp_path):
    folder, cfg, tensors = make("dflash", dtype="F32")
    big = tensors["fc.weight"].copy()
    big[0, 0] = 1e5
    td.write_checkpoint(folder, cfg, tensors | {"fc.weight": big}, dtype="F32")
    convert_err(folder, tmp_path, r"dflash\.fc\.weight has \|w\| = 100000 > 65504")
    assert convert_hf(folder, tmp_path / "ok.gguf", "bf16", log=lambda s: None).n_embd == 64


# -- safetensors header validation ----------------------------------------------------------------------------


def _raw_safetensors(path, header: dict, data: bytes):
    import struct
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


@pytest.mark.parametrize("entry,match", [
    ([1, 2], r"tensor 'w': header entry is list, expected an object"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": None}, r"tensor 'w' has data_offsets None"),
    ({"dtype": "F32", "shape": "2,2", "data_offsets": [0, 16]}, r"tensor 'w' has shape '2,2'"),
    ({"dtype": "F32", "shape": [2, True], "data_offsets": [0, 8]}, r"tensor 'w' has shape"),
    ({"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}, r"tensor 'w' has dtype 'I64'"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [-16, 0]}, r"tensor 'w' has byte range \[-16, 0\] outside"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}, r"tensor 'w' has byte range \[16, 0\] outside"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}, r"tensor 'w' starts at data byte 8, expected 0"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 24]}, r"tensor 'w' has 24 bytes for F32 \[2, 2\]"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 40]}, r"tensor 'w' has byte range \[0, 40\] outside"),
])
def test_safetensors_header_entries_validated(tmp_path, entry, match):
    from specd.draft_worker.safetensors_io import read_header
    p = _raw_safetensors(tmp_path / "m.safetensors", {"w": entry}, bytes(24))
    with pytest.raises(DrafterFormatError, match=r"m\.safetensors: " + match):
        read_header(p)


def test_safetensors_shifted_ranges_refused(tmp_path):
    """Two tensors whose ranges overlap (the second shifted by 4 bytes) would read the wrong bytes."""
    from specd.draft_worker.safetensors_io import read_header
    hdr = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    p = _raw_safetensors(tmp_path / "m.safetensors", hdr, bytes(12))
    with pytest.raises(DrafterFormatError, match=r"tensor 'b' starts at data byte 4, expected 8"):
        read_header(p)
    ok = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F16", "shape": [2], "data_offsets": [8, 12]}, "__metadata__": {"format": "pt"}}
    t = read_header(_raw_safetensors(tmp_path / "ok.safetensors", ok, bytes(12)))
    assert t["b"].read_f32().tolist() == [0.0, 0.0]


def test_documented_defaults_are_stated(make, tmp_path):
    """Keys whose absence specd fills with the documented published value (hidden_act silu,
    markov_head_type vanilla, YaRN β 32 / 1 and attention factor) are said in the conversion log."""
    folder, _, _ = make("dspark", yarn=True)

    def strip(c):
        c.pop("hidden_act")
        c["dflash_config"].pop("markov_head_type")
        for k in ("beta_fast", "beta_slow"):
            c["rope_parameters"].pop(k)
    rewrite_config(folder, strip)
    logs = []
    hp = convert_hf(folder, tmp_path / "d.gguf", log=logs.append)
    assert hp.dspark.markov_type == "vanilla" and (hp.yarn.beta_fast, hp.yarn.beta_slow) == (32.0, 1.0)
    text = "\n".join(logs)
    for needle in ("hidden_act absent: silu", "markov_head_type absent: vanilla", "beta_fast absent: 32",
                   "beta_slow absent: 1", "attention_factor absent", "markov(vanilla, rank="):
        assert needle in text, needle
