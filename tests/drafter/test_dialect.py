"""C15: the mainline llama.cpp ``dflash`` GGUF dialect is refused at load (naming the dialect and the
key) and translated only explicitly (``convert-drafter SRC.gguf OUT.gguf --tap-offset 1``)."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from specd.coordinator.cli import main as specd_main
from specd.draft_worker.contract import DrafterFormatError
from specd.draft_worker.dialect import translate_mainline
from specd.draft_worker.gguf_loader import load_drafter
from specd.draft_worker.gguf_meta import write_gguf_atomic

_SPECD_TO_MAINLINE = {
    "dflash.fc.weight": "fc.weight", "dflash.hidden_norm.weight": "enc.output_norm.weight",
    "dflash.selector.hproj.weight": "selector_hidden.weight", "dflash.selector.pred_cb": "selector_predecessor.weight",
    "dflash.selector.succ_cb": "selector_successor.weight", "dflash.dspark.markov.w1": "markov_w1.weight",
    "dflash.dspark.markov.w2": "markov_w2.weight", "dflash.dspark.confidence.weight": "conf_proj.weight",
    "dflash.dspark.confidence.bias": "conf_proj.bias",
}


def mainline_name(n: str) -> str:
    n = _SPECD_TO_MAINLINE.get(n, n)
    return n.replace("attn_conv.base", "attn_conv_base").replace("ffn_conv.base", "ffn_conv_base") \
            .replace("attn_conv.proj", "attn_conv_proj").replace("ffn_conv.proj", "ffn_conv_proj")


def write_mainline(specd_path, out, *, tap_offset=1, mask_key="tokenizer.ggml.mask_token_id", causal=True,
                   extra_tensors=None, with_vocab=True, extra_kv=None, skip_kv=()):
    """A mainline-dialect rendering of a specd drafter GGUF (what llama.cpp's converter writes)."""
    ld = load_drafter(specd_path)
    hp = ld.hparams
    reader = ld.reader

    def fill(w):
        a = "dflash."
        for k, v in (extra_kv or {}).items():
            (w.add_string if isinstance(v, str) else w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
        if skip_kv:  # drop keys by name: wrap the writer's adders
            for adder in ("add_uint32", "add_float32", "add_array", "add_bool"):
                orig = getattr(w, adder)
                setattr(w, adder, (lambda o: lambda k, v: None if k in skip_kv else o(k, v))(orig))
        w.add_uint32(a + "embedding_length", hp.n_embd)
        w.add_uint32(a + "block_count", hp.n_layer)
        w.add_uint32(a + "feed_forward_length", hp.n_ff)
        w.add_uint32(a + "attention.head_count", hp.n_head)
        w.add_uint32(a + "attention.head_count_kv", hp.n_head_kv)
        w.add_uint32(a + "attention.key_length", hp.head_dim)
        w.add_float32(a + "attention.layer_norm_rms_epsilon", hp.rms_eps)
        w.add_float32(a + "rope.freq_base", hp.rope_theta)
        w.add_uint32(a + "context_length", hp.context_length)
        w.add_uint32(a + "block_size", hp.block_size)
        w.add_array(a + "target_layers", [i + tap_offset for i in hp.target_layer_ids])
        if with_vocab:
            w.add_uint32(a + "vocab_size", hp.n_vocab)
        if mask_key:
            w.add_uint32(mask_key, hp.mask_token_id)
        if hp.sliding_window:
            w.add_uint32(a + "attention.sliding_window", hp.sliding_window)
        w.add_array(a + "attention.sliding_window_pattern", [int(s) for s in hp.sliding_pattern])
        if causal:
            assert len(set(hp.causal_pattern)) == 1
            w.add_bool(a + "attention.causal", hp.causal_pattern[0])
        if hp.dflash2:
            for f in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                w.add_uint32(a + f, getattr(hp.dflash2, f))
        for t in reader.tensors:
            data = np.asarray(t.data)
            name = mainline_name(t.name)
            if t.tensor_type == QT.F32:
                w.add_tensor(name, data.view(np.float32))
            elif t.tensor_type == QT.F16:
                w.add_tensor(name, data.view(np.float16))
            else:
                w.add_tensor(name, data.view(np.uint8), raw_dtype=t.tensor_type)
        for name, arr in (extra_tensors or {}).items():
            w.add_tensor(name, arr)

    write_gguf_atomic(out, "dflash", fill)
    return out


def test_c15_mainline_dialect_refused_at_load(converted, tmp_path):
    path, *_ = converted("dflash2", sliding="all")
    ml = write_mainline(path, tmp_path / "mainline.gguf")
    with pytest.raises(DrafterFormatError) as ei:
        load_drafter(ml)
    msg = str(ei.value)
    assert "general.architecture = 'dflash' is the mainline llama.cpp dialect" in msg
    assert "dflash.block_size" in msg and "dflash.target_layers = [2, 4, 6]" in msg
    assert "--tap-offset 1" in msg and str(ml) in msg


def test_c15_translation_requires_tap_offset(converted, tmp_path):
    path, *_ = converted("dflash2", sliding="all")
    ml = write_mainline(path, tmp_path / "mainline.gguf")
    with pytest.raises(DrafterFormatError, match=r"dflash\.target_layers = \[2, 4, 6\]: the mainline dialect does not record"):
        translate_mainline(ml, tmp_path / "out.gguf", tap_offset=None, log=lambda s: None)
    assert specd_main(["convert-drafter", str(ml), str(tmp_path / "cli.gguf")]) == 1


@pytest.mark.parametrize("family,sliding", [("dflash2", "all"), ("dflash", "qwen36"), ("dflash", "none")])
def test_c15_translation_matches_hf_conversion(converted, tmp_path, family, sliding):
    path, _, _, hp = converted(family, sliding=sliding)
    ml = write_mainline(path, tmp_path / "mainline.gguf", causal=(family == "dflash2"))
    out = tmp_path / "translated.gguf"
    assert specd_main(["convert-drafter", str(ml), str(out), "--tap-offset", "1"]) == 0
    got = load_drafter(out)
    # mainline files do not carry the target depth; everything else must match the HF conversion
    assert got.hparams == dataclasses.replace(hp, n_target_layers=None)
    assert got.hparams.target_layer_ids == (1, 3, 5)
    ref = load_drafter(path)
    for name, t in ref.tensors.items():
        assert np.asarray(got.tensors[name].numpy()).tobytes() == np.asarray(t.numpy()).tobytes(), name


def test_c15_tap_offset_zero_and_negative(converted, tmp_path):
    path, *_ = converted("dflash")
    ml0 = write_mainline(path, tmp_path / "m0.gguf", tap_offset=0)
    assert translate_mainline(ml0, tmp_path / "o0.gguf", tap_offset=0, log=lambda s: None).target_layer_ids == (1, 3, 5)
    bad = write_mainline(path, tmp_path / "neg.gguf", tap_offset=-1)  # ids 0, 2, 4
    with pytest.raises(DrafterFormatError, match=r"subtracting --tap-offset 1 gives negative ids"):
        translate_mainline(bad, tmp_path / "o1.gguf", tap_offset=1, log=lambda s: None)


def test_c15_mask_id_from_dialect_key_or_flag(converted, tmp_path):
    path, *_ = converted("dflash")
    nomask = write_mainline(path, tmp_path / "nomask.gguf", mask_key=None)
    with pytest.raises(DrafterFormatError, match=r"no mask token id .*pass --mask-token-id"):
        translate_mainline(nomask, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)
    assert translate_mainline(nomask, tmp_path / "b.gguf", tap_offset=1, mask_token_id=500,
                              log=lambda s: None).mask_token_id == 500
    own = write_mainline(path, tmp_path / "own.gguf", mask_key="dflash.mask_token_id")
    with pytest.raises(DrafterFormatError, match=r"dflash\.mask_token_id = 500 contradicts --mask-token-id = 7"):
        translate_mainline(own, tmp_path / "c.gguf", tap_offset=1, mask_token_id=7, log=lambda s: None)


def test_c15_vocab_needed(converted, tmp_path):
    path, *_ = converted("dflash")
    ml = write_mainline(path, tmp_path / "nv.gguf", with_vocab=False)
    with pytest.raises(DrafterFormatError, match=r"no vocabulary size .*pass --vocab-size"):
        translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)
    assert translate_mainline(ml, tmp_path / "b.gguf", tap_offset=1, vocab_size=512, log=lambda s: None).n_vocab == 512


def test_c15_unknown_tensor_and_dropped_target_copies(converted, tmp_path):
    path, *_ = converted("dflash")
    ml = write_mainline(path, tmp_path / "u.gguf", extra_tensors={"blk.0.attn_gate.weight": np.zeros((64, 64), np.float16)})
    with pytest.raises(DrafterFormatError, match=r"unknown tensor\(s\) in the mainline dialect: blk\.0\.attn_gate\.weight"):
        translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)
    ml2 = write_mainline(path, tmp_path / "e.gguf", extra_tensors={"token_embd.weight": np.zeros((512, 64), np.float16)})
    logs = []
    translate_mainline(ml2, tmp_path / "b.gguf", tap_offset=1, log=logs.append)
    assert any("dropped token_embd.weight" in s for s in logs)
    assert "token_embd.weight" not in {t.name for t in gguf.GGUFReader(tmp_path / "b.gguf").tensors}


def test_c15_dspark_needs_row_alignment(converted, tmp_path):
    path, _, _, hp = converted("dspark")
    ml = write_mainline(path, tmp_path / "ds.gguf", causal=False)
    with pytest.raises(DrafterFormatError, match=r"does not record its slot convention; pass --row-alignment"):
        translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)
    got = translate_mainline(ml, tmp_path / "b.gguf", tap_offset=1, row_alignment="proposals_only", log=lambda s: None)
    assert got == dataclasses.replace(hp, n_target_layers=None)
    assert load_drafter(tmp_path / "b.gguf").weights.dspark.confidence_weight.shape == (1, 64 + 32)


@pytest.mark.parametrize("key,match", [
    ("dflash.logit_scale", r"dflash\.logit_scale.*not a documented key.*dflash\.output_multiplier"),
    ("dflash.embedding_scale", r"dflash\.embedding_scale.*not a documented key.*dflash\.input_embedding_scale"),
    ("dflash.attention.gate", r"dflash\.attention\.gate.*not a key the mainline-dialect translator knows"),
])
def test_c15_unknown_or_undocumented_keys_refused(converted, tmp_path, key, match):
    path, *_ = converted("dflash")
    ml = write_mainline(path, tmp_path / "k.gguf", extra_kv={key: 2.0})
    with pytest.raises(DrafterFormatError, match=match):
        translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)


def test_c15_documented_logit_transform_keys(converted, tmp_path):
    path, *_ = converted("dflash")
    ml = write_mainline(path, tmp_path / "k.gguf", extra_kv={"dflash.input_embedding_scale": 2.5,
                                                            "dflash.output_multiplier": 0.5,
                                                            "dflash.final_logit_softcapping": 30.0})
    hp = translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)
    assert (hp.input_embedding_scale, hp.output_multiplier, hp.final_logit_softcapping) == (2.5, 0.5, 30.0)
    assert load_drafter(tmp_path / "a.gguf").hparams == hp


def test_c15_window_with_all_false_pattern_refused(converted, tmp_path):
    path, *_ = converted("dflash")
    ml = write_mainline(path, tmp_path / "w.gguf", extra_kv={"dflash.attention.sliding_window": 32})
    with pytest.raises(DrafterFormatError, match=r"dflash\.attention\.sliding_window.*= 32 but .*all false: contradictory"):
        translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)


def test_c15_dflash2_detected_by_selector_top_k(converted, tmp_path):
    """llama.cpp's rule: DFlash 2 iff selector_top_k > 0. A zero top_k with DFlash 2 tensors, or
    DFlash 2 keys on a top_k-less file, is a contradiction."""
    path, *_ = converted("dflash2", sliding="all")
    zero = write_mainline(path, tmp_path / "z.gguf", skip_kv=("dflash.selector_top_k",),
                          extra_kv={"dflash.selector_top_k": 0})
    with pytest.raises(DrafterFormatError, match=r"dflash\.selector_top_k.*= 0 \(DFlash 1\) but the file has DFlash 2 tensors"):
        translate_mainline(zero, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)
    p1, *_ = converted("dflash")
    stray = write_mainline(p1, tmp_path / "s.gguf", extra_kv={"dflash.conv_kernel_size": 2})
    with pytest.raises(DrafterFormatError, match=r"dflash\.conv_kernel_size.*selector_top_k is not > 0"):
        translate_mainline(stray, tmp_path / "b.gguf", tap_offset=1, log=lambda s: None)


def test_c15_key_length_required(converted, tmp_path):
    path, *_ = converted("dflash")
    ml = write_mainline(path, tmp_path / "h.gguf", skip_kv=("dflash.attention.key_length",))
    with pytest.raises(DrafterFormatError, match=r"dflash\.attention\.key_length"):
        translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=lambda s: None)


def test_c15_yarn_defaults_stated(converted, tmp_path):
    """Absent YaRN β / attn_factor keys take ggml's defaults (the published values, drafters.md §3.4)
    and the translator says so; two spellings of one β that disagree are refused."""
    path, *_ = converted("dflash")
    yarn = {"dflash.rope.scaling.type": "yarn", "dflash.rope.scaling.factor": 32.0,
            "dflash.rope.scaling.original_context_length": 8192}
    ml = write_mainline(path, tmp_path / "y.gguf", extra_kv=yarn)
    logs = []
    hp = translate_mainline(ml, tmp_path / "a.gguf", tap_offset=1, log=logs.append)
    assert (hp.yarn.beta_fast, hp.yarn.beta_slow, hp.yarn.attn_factor) == (32.0, 1.0, 1.0)
    for k in ("beta_fast absent: using ggml's default 32", "beta_slow absent: using ggml's default 1",
              "attn_factor absent: using ggml's default 1"):
        assert any(k in s for s in logs), k
    bad = write_mainline(path, tmp_path / "b.gguf", extra_kv={**yarn, "dflash.rope.scaling.beta_fast": 32.0,
                                                             "dflash.rope.scaling.yarn_beta_fast": 16.0})
    with pytest.raises(DrafterFormatError, match=r"yarn_beta_fast = 16\.0 contradicts dflash\.rope\.scaling\.beta_fast = 32\.0: ambiguous"):
        translate_mainline(bad, tmp_path / "c.gguf", tap_offset=1, log=lambda s: None)
