"""Converter tests: transformers Qwen3.5 checkpoint → qwen35 GGUF → specd loader / inverse mapping.

Expected names, shapes and transforms are written out here from docs/qwen35-target.md §3-§5
(independently of the converter's own tables); the golden round trips follow oracles.md §1.3.
"""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

import specd.native as sn
from specd.coordinator.cli import main as cli_main
from specd.target_worker.convert import (
    ConversionError,
    convert,
    tiled_head_order,
    to_gguf_layout,
    to_hf_layout,
    to_hf_state_dict,
)
from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata

from .tinymodels import CHAT_TEMPLATE, SPECS, load_reference, logits64

# Fixtures are built with torch + transformers (the oracle environment).
pytestmark = pytest.mark.oracle

QTYPE = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}


# ---- expectations written from the spec tables -------------------------------------------------


def spec_dims(name):
    t = SPECS[name].text
    rope = t["rope_parameters"]
    return dict(
        H=t["hidden_size"], I=t["intermediate_size"], V=t["vocab_size"], L=t["num_hidden_layers"],
        Hq=t["num_attention_heads"], Hkv=t["num_key_value_heads"], hd=t["head_dim"],
        Hk=t["linear_num_key_heads"], Hv=t["linear_num_value_heads"], dk=t["linear_key_head_dim"],
        dv=t["linear_value_head_dim"], K=t["linear_conv_kernel_dim"], interval=t["full_attention_interval"],
        tied=t["tie_word_embeddings"], eps=t["rms_norm_eps"], theta=rope["rope_theta"],
        n_rot=int(t["head_dim"] * rope["partial_rotary_factor"]),
        sections=tuple(rope.get("mrope_section", [11, 11, 10])) + (0,), mtp=SPECS[name].mtp)


def is_full(i, interval):
    return (i + 1) % interval == 0


def expected_ne(name) -> dict[str, tuple]:
    """GGUF name → ne for every tensor (qwen35-target.md §4), MTP block included."""
    d = spec_dims(name)
    H, I, V, hd, Hv, dv = d["H"], d["I"], d["V"], d["hd"], d["Hv"], d["dv"]
    C = 2 * d["Hk"] * d["dk"] + Hv * dv
    ne = {"token_embd.weight": (H, V), "output_norm.weight": (H,)}
    if not d["tied"]:
        ne["output.weight"] = (H, V)
    full = {"attn_q.weight": (H, 2 * d["Hq"] * hd), "attn_k.weight": (H, d["Hkv"] * hd),
            "attn_v.weight": (H, d["Hkv"] * hd), "attn_output.weight": (d["Hq"] * hd, H),
            "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    gdn = {"attn_qkv.weight": (H, C), "attn_gate.weight": (H, Hv * dv), "ssm_beta.weight": (H, Hv),
           "ssm_alpha.weight": (H, Hv), "ssm_a": (Hv,), "ssm_dt.bias": (Hv,), "ssm_conv1d.weight": (d["K"], C),
           "ssm_norm.weight": (dv,), "ssm_out.weight": (Hv * dv, H)}
    common = {"attn_norm.weight": (H,), "post_attention_norm.weight": (H,), "ffn_gate.weight": (H, I),
              "ffn_up.weight": (H, I), "ffn_down.weight": (I, H)}
    for i in range(d["L"]):
        for k, v in {**common, **(full if is_full(i, d["interval"]) else gdn)}.items():
            ne[f"blk.{i}.{k}"] = v
    if d["mtp"]:
        L = d["L"]
        for k, v in {**common, **full}.items():
            ne[f"blk.{L}.{k}"] = v
        ne.update({f"blk.{L}.nextn.eh_proj.weight": (2 * H, H), f"blk.{L}.nextn.enorm.weight": (H,),
                   f"blk.{L}.nextn.hnorm.weight": (H,), f"blk.{L}.nextn.shared_head_norm.weight": (H,)})
    return ne


def expected_qtype(name: str, ne: tuple, outtype: str) -> QT:
    if len(ne) == 1 or "ssm_conv1d" in name:
        return QT.F32
    if outtype == "q8_0" and ne[0] % 32:
        return QT.F16
    return QTYPE[outtype]


def tile(x, axis, Hk, r, unit):
    """Grouped → tiled by explicit loops: HF head j = g*r + s moves to position s*Hk + g."""
    out = np.empty_like(x)
    for j in range(Hk * r):
        g, s = divmod(j, r)
        p = s * Hk + g
        src = [slice(None)] * x.ndim
        dst = [slice(None)] * x.ndim
        src[axis], dst[axis] = slice(j * unit, (j + 1) * unit), slice(p * unit, (p + 1) * unit)
        out[tuple(dst)] = x[tuple(src)]
    return out


def gguf_tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


# ---- hyperparameters and metadata ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_hparams_match_config(name, converted):
    d = spec_dims(name)
    hp = load_qwen35(converted(name)).hparams
    assert (hp.n_layer, hp.n_nextn, hp.n_vocab, hp.n_embd, hp.n_ff) == (d["L"], int(d["mtp"]), d["V"], d["H"], d["I"])
    assert (hp.n_head, hp.n_head_kv, hp.head_dim) == (d["Hq"], d["Hkv"], d["hd"])
    assert (hp.rms_eps, hp.rope_freq_base) == (d["eps"], d["theta"])
    assert (hp.n_rot, hp.rope_sections) == (d["n_rot"], d["sections"])
    assert (hp.ssm_conv_kernel, hp.ssm_state_size, hp.ssm_group_count) == (d["K"], d["dk"], d["Hk"])
    assert (hp.ssm_time_step_rank, hp.ssm_inner_size) == (d["Hv"], d["Hv"] * d["dv"])
    assert hp.full_attention_interval == d["interval"] and hp.context_length == 32768
    assert hp.recurrent == tuple(not is_full(i, d["interval"]) for i in range(d["L"]))
    assert (hp.head_k_dim, hp.head_v_dim, hp.v_per_k) == (d["dk"], d["dv"], d["Hv"] // d["Hk"])
    assert hp.conv_channels == 2 * d["Hk"] * d["dk"] + d["Hv"] * d["dv"]
    assert hp.n_full == d["L"] // d["interval"] and hp.n_delta == d["L"] - hp.n_full


@pytest.mark.parametrize("name", ["smoke", "condgen"])
def test_metadata_keys_literal(name, converted):
    fields = gguf.GGUFReader(converted(name, "q8_0")).fields
    d = spec_dims(name)
    block_count = d["L"] + int(d["mtp"])
    assert fields["general.architecture"].contents() == "qwen35"
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert fields["qwen35.block_count"].contents() == block_count
    rec = fields["qwen35.attention.recurrent_layers"]
    assert [t.name for t in rec.types] == ["ARRAY", "BOOL"]
    assert rec.contents() == [not is_full(i, d["interval"]) for i in range(d["L"])] + [False] * d["mtp"]
    assert fields["qwen35.rope.dimension_sections"].contents() == list(d["sections"])
    assert ("qwen35.nextn_predict_layers" in fields) == d["mtp"]
    assert fields["qwen35.attention.key_length"].contents() == fields["qwen35.attention.value_length"].contents()


# ---- names, shapes, dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize("name,outtype", [("smoke", "f32"), ("smoke", "f16"), ("smoke", "bf16"), ("smoke", "q8_0"),
                                          ("r3", "q8_0"), ("condgen", "f32"), ("main", "f32")])
def test_names_shapes_dtypes(name, outtype, converted):
    tensors = gguf_tensors(converted(name, outtype))
    want = expected_ne(name)
    assert set(tensors) == set(want)
    for tname, t in tensors.items():
        assert tuple(int(x) for x in t.shape) == want[tname], tname
        assert t.tensor_type == expected_qtype(tname, want[tname], outtype), tname


# ---- transforms, element-wise against the HF tensors ------------------------------------------------


def _gguf_f32(t) -> np.ndarray:
    assert t.tensor_type == QT.F32
    return np.asarray(t.data)


@pytest.mark.parametrize("name", list(SPECS))
def test_transforms_exact(name, converted, checkpoint):
    ck = checkpoint(name)
    d = spec_dims(name)
    Hk, r, dv = d["Hk"], d["Hv"] // d["Hk"], d["dv"]
    qk = 2 * Hk * d["dk"]
    g = {n: _gguf_f32(t) for n, t in gguf_tensors(converted(name)).items()}
    hf = ck.hf
    one = np.float32(1)
    assert np.array_equal(g["token_embd.weight"], hf["model.embed_tokens.weight"])
    assert np.array_equal(g["output_norm.weight"], hf["model.norm.weight"] + one)
    if not d["tied"]:
        assert np.array_equal(g["output.weight"], hf["lm_head.weight"])
    for i in range(d["L"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        assert np.array_equal(g[b + "attn_norm.weight"], hf[p + "input_layernorm.weight"] + one)
        assert np.array_equal(g[b + "post_attention_norm.weight"], hf[p + "post_attention_layernorm.weight"] + one)
        for mlp, ff in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            assert np.array_equal(g[b + ff + ".weight"], hf[p + "mlp." + mlp + ".weight"])
        if is_full(i, d["interval"]):
            _check_attention(g, hf, p + "self_attn.", b)
            continue
        la = p + "linear_attn."
        qkv = hf[la + "in_proj_qkv.weight"]
        assert np.array_equal(g[b + "attn_qkv.weight"][:qk], qkv[:qk])
        assert np.array_equal(g[b + "attn_qkv.weight"][qk:], tile(qkv[qk:], 0, Hk, r, dv))
        assert np.array_equal(g[b + "attn_gate.weight"], tile(hf[la + "in_proj_z.weight"], 0, Hk, r, dv))
        assert np.array_equal(g[b + "ssm_beta.weight"], tile(hf[la + "in_proj_b.weight"], 0, Hk, r, 1))
        assert np.array_equal(g[b + "ssm_alpha.weight"], tile(hf[la + "in_proj_a.weight"], 0, Hk, r, 1))
        assert np.array_equal(g[b + "ssm_dt.bias"], tile(hf[la + "dt_bias"], 0, Hk, r, 1))
        ssm_a = tile(-np.exp(hf[la + "A_log"].astype(np.float64)), 0, Hk, r, 1)
        np.testing.assert_allclose(g[b + "ssm_a"], ssm_a, rtol=6e-8, atol=0)
        assert (g[b + "ssm_a"] < 0).all()
        conv = hf[la + "conv1d.weight"][:, 0, :]  # (C, 1, K) → (C, K)
        assert np.array_equal(g[b + "ssm_conv1d.weight"][:qk], conv[:qk])
        assert np.array_equal(g[b + "ssm_conv1d.weight"][qk:], tile(conv[qk:], 0, Hk, r, dv))
        assert np.array_equal(g[b + "ssm_norm.weight"], hf[la + "norm.weight"])  # no +1
        assert np.array_equal(g[b + "ssm_out.weight"], tile(hf[la + "out_proj.weight"], 1, Hk, r, dv))
    if d["mtp"]:
        _check_mtp(g, ck.mtp, d["L"])


def _check_attention(g, hf, p, b):
    one = np.float32(1)
    # q_proj keeps its per-head [q | gate] packing: copied unchanged
    for proj, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        assert np.array_equal(g[b + name + ".weight"], hf[p + proj + ".weight"])
    assert np.array_equal(g[b + "attn_q_norm.weight"], hf[p + "q_norm.weight"] + one)
    assert np.array_equal(g[b + "attn_k_norm.weight"], hf[p + "k_norm.weight"] + one)


def _check_mtp(g, mtp, L):
    one = np.float32(1)
    b = f"blk.{L}."
    assert np.array_equal(g[b + "nextn.eh_proj.weight"], mtp["mtp.fc.weight"])
    assert np.array_equal(g[b + "nextn.enorm.weight"], mtp["mtp.pre_fc_norm_embedding.weight"] + one)
    assert np.array_equal(g[b + "nextn.hnorm.weight"], mtp["mtp.pre_fc_norm_hidden.weight"] + one)
    assert np.array_equal(g[b + "nextn.shared_head_norm.weight"], mtp["mtp.norm.weight"] + one)
    assert np.array_equal(g[b + "attn_norm.weight"], mtp["mtp.layers.0.input_layernorm.weight"] + one)
    _check_attention(g, {k.replace("mtp.layers.0.", ""): v for k, v in mtp.items()}, "self_attn.", b)


# ---- golden round trips (oracles.md §1.3) ---------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_golden_roundtrip_f32(name, converted, checkpoint):
    """F32 GGUF → to_hf_state_dict → fresh float64 Qwen3_5ForCausalLM: identical effective weights,
    identical logits (tolerance 1e-10; observed 0)."""
    ck = checkpoint(name)
    state = to_hf_state_dict(converted(name))
    want = dict(ck.hf)
    if ck.config.tie_word_embeddings:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    assert_same_weights(state, want)
    diff = np.abs(logits64(load_reference(ck.config, state), ck.prompt) - ck.logits64).max()
    assert diff <= 1e-10


def assert_same_weights(state: dict, want: dict) -> None:
    """Inverse-mapped weights equal the originals bit for bit, except zero-centred norms: the GGUF
    stores 1 + w rounded to float32, so w comes back on the float32 grid near 1 while the factor
    the model multiplies by, float32(1 + w), is exactly the original's."""
    assert set(state) == set(want)
    one = np.float32(1)
    for k, v in want.items():
        assert state[k].dtype == np.float32 and state[k].shape == v.shape, k
        if k.endswith("norm.weight") and "linear_attn" not in k or k.startswith("mtp.pre_fc_norm_"):
            assert np.array_equal(state[k] + one, v + one), k
            assert np.abs(state[k] - v).max() <= 2.0 ** -24, k
        else:
            assert np.array_equal(state[k], v), k


def _quantize_dequantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    return dequantize(quantize(x, qtype), qtype).astype(np.float32)


# Max |Δlogit| of the quantized file against the *unquantized* model (main, max |logit| ≈ 3):
# sanity bounds only, about 3x what was observed (f16 0.015, bf16 0.10, q8_0 0.61).
UNQUANTIZED_BOUND = {"f16": 0.05, "bf16": 0.3, "q8_0": 2.0}


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_golden_roundtrip_quantized(outtype, converted, checkpoint):
    """A quantized GGUF inverse-maps to exactly the HF weights passed through the same gguf
    quantize/dequantize (2-D weights other than the conv kernel; 1-D stay F32): identical effective
    weights and logits within 1e-10 (observed 0)."""
    ck = checkpoint("main")
    qtype = QTYPE[outtype]
    ref = {k: (_quantize_dequantize(v, qtype) if v.ndim == 2 else v) for k, v in ck.hf.items()}
    state = to_hf_state_dict(converted("main", outtype))
    assert_same_weights(state, ref)
    got = logits64(load_reference(ck.config, state), ck.prompt)
    assert np.abs(got - logits64(load_reference(ck.config, ref), ck.prompt)).max() <= 1e-10
    assert np.abs(got - ck.logits64).max() < UNQUANTIZED_BOUND[outtype]


def test_mtp_roundtrip_and_drop(converted, checkpoint):
    ck = checkpoint("condgen")
    L = ck.config.num_hidden_layers
    state = to_hf_state_dict(converted("condgen"), include_mtp=True)
    assert_same_weights({k: v for k, v in state.items() if k.startswith("mtp.")}, ck.mtp)
    weights = load_qwen35(converted("condgen"))
    assert len(weights.layers) == L and len(weights.skipped) == len(ck.mtp)
    assert all(n.startswith(f"blk.{L}.") for n in weights.skipped)
    fields = gguf.GGUFReader(converted("condgen", mtp=False)).fields
    assert fields["qwen35.block_count"].contents() == L and "qwen35.nextn_predict_layers" not in fields
    assert not any(n.startswith(f"blk.{L}.") for n in gguf_tensors(converted("condgen", mtp=False)))


# ---- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_metadata(converted, checkpoint):
    ck = checkpoint("condgen")
    ids = ck.token_ids
    tok = read_tokenizer_metadata(converted("condgen"))
    assert tok.model == "gpt2" and tok.pre == "qwen35"
    assert len(tok.tokens) == len(tok.token_types) == ck.config.vocab_size
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.tokens[ids[t]] == t and tok.token_types[ids[t]] == gguf.TokenType.CONTROL
    for t in ("<think>", "</think>"):
        assert tok.tokens[ids[t]] == t and tok.token_types[ids[t]] == gguf.TokenType.USER_DEFINED
    tj = json.loads((ck.path / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    n_real = len(vocab) + len([a for a in tj["added_tokens"] if a["content"] not in vocab])
    assert tok.tokens[-1] == f"[PAD{ck.config.vocab_size - 1}]" and tok.token_types[-1] == gguf.TokenType.UNUSED
    assert tok.token_types.count(gguf.TokenType.UNUSED) == ck.config.vocab_size - n_real
    some = next(t for t, i in tj["model"]["vocab"].items() if t not in ids)
    assert tok.token_types[tj["model"]["vocab"][some]] == gguf.TokenType.NORMAL
    assert list(tok.merges) == [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    assert (tok.eos_id, tok.eot_id, tok.pad_id) == (ids["<|im_end|>"], ids["<|endoftext|>"], ids["<|endoftext|>"])
    assert tok.end_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert tok.chat_template == CHAT_TEMPLATE and tok.add_bos is False


def test_no_tokenizer(converted):
    assert read_tokenizer_metadata(converted("smoke")) is None


# ---- command line ------------------------------------------------------------------------------------


def test_cli_end_to_end(checkpoint, tmp_path, capsys):
    out = tmp_path / "smoke-q8.gguf"
    assert cli_main(["convert-target", str(checkpoint("smoke").path), str(out), "--outtype", "q8_0"]) == 0
    assert "wrote" in capsys.readouterr().out
    w = load_qwen35(out)
    assert w.layers[0].attn_qkv.dtype == sn.DType.Q8_0 and w.layers[0].attn_norm.dtype == sn.DType.F32
    assert w.hparams.file_type == gguf.LlamaFileType.MOSTLY_Q8_0
    missing = tmp_path / "nowhere"
    assert cli_main(["convert-target", str(missing), str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "config.json" in err
    assert not (tmp_path / "x.gguf").exists()
    # an existing output is kept unless --force
    assert cli_main(["convert-target", str(checkpoint("smoke").path), str(out)]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert load_qwen35(out).layers[0].attn_qkv.dtype == sn.DType.Q8_0
    assert cli_main(["convert-target", str(checkpoint("smoke").path), str(out), "--outtype", "f32", "--force"]) == 0
    assert load_qwen35(out).layers[0].attn_qkv.dtype == sn.DType.F32


def test_outtype_auto(checkpoint, tmp_path):
    bf16 = convert(checkpoint("condgen").path, tmp_path / "a.gguf")  # bf16 checkpoint → bf16
    f32 = convert(checkpoint("smoke").path, tmp_path / "b.gguf")  # f32 checkpoint → f16 (llama.cpp)
    assert bf16.type_counts.keys() == {"BF16", "F32"} and f32.type_counts.keys() == {"F16", "F32"}


# ---- bad checkpoints -------------------------------------------------------------------------------


def _copy(checkpoint, tmp_path, name="smoke"):
    dst = tmp_path / f"{name}-copy"
    shutil.copytree(checkpoint(name).path, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, drop=(), add=None):
    tensors = load_file(str(path / "model.safetensors"))
    for k in drop:
        del tensors[k]
    tensors.update(add or {})
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("case", ["dk_ne_dv", "missing_tensor", "extra_tensor", "wrong_shape", "scaled_rope",
                                  "missing_config_key", "bad_outtype"])
def test_bad_checkpoint(case, checkpoint, tmp_path):
    src = _copy(checkpoint, tmp_path)
    outtype, expect = "f32", []
    if case == "dk_ne_dv":
        _edit_config(src, linear_value_head_dim=16)
        expect = ["config.json", "linear_key_head_dim", "linear_value_head_dim"]
    elif case == "missing_tensor":
        _edit_weights(src, drop=["model.layers.1.linear_attn.A_log"])
        expect = ["model.layers.1.linear_attn.A_log"]
    elif case == "extra_tensor":
        _edit_weights(src, add={"model.layers.0.linear_attn.extra.weight": torch.zeros(2, 2)})
        expect = ["model.layers.0.linear_attn.extra.weight"]
    elif case == "wrong_shape":
        _edit_config(src, intermediate_size=384)
        expect = ["mlp.gate_proj.weight", "ffn_gate"]
    elif case == "scaled_rope":
        _edit_config(src, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7})
        expect = ["rope_type", "yarn"]
    elif case == "missing_config_key":
        cfg = json.loads((src / "config.json").read_text())
        del cfg["linear_num_key_heads"]
        (src / "config.json").write_text(json.dumps(cfg))
        expect = ["linear_num_key_heads"]
    elif case == "bad_outtype":
        outtype, expect = "q4_0", ["q4_0"]
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError) as info:
        convert(src, out, outtype)
    msg = str(info.value)
    for item in expect:
        assert item in msg, (item, msg)
    if case != "bad_outtype":
        assert str(src) in msg
    assert not out.exists() and not (tmp_path / "out.gguf.tmp").exists()


# ---- unit checks of the mapping helpers ---------------------------------------------------------------


def test_tiled_order_27b_example():
    """qwen35-target.md §5.1 step 3 with the 27B numbers (Hk = 16, Hv = 48, r = 3): HF order
    [k0v0, k0v1, k0v2, k1v0, ...] becomes [k0v0, k1v0, ..., k15v0, k0v1, ...]."""
    order = tiled_head_order(16, 3)  # tiled position → HF head
    assert list(order[:17]) == [3 * g for g in range(16)] + [1]
    assert sorted(order) == list(range(48))
    assert all(order[p] // 3 == p % 16 for p in range(48))  # tiled head p uses key head p mod Hk


def test_a_log_roundtrip_unsnapped():
    """Without the fixture's snapping, A_log survives the F32 GGUF to float32 precision of the decay
    rate exp(A_log): |ΔA_log| (= relative error of exp(A_log)) ≤ 2^-23."""
    hp = load_qwen35_hparams_like(n_k_heads=2, v_per_k=3)
    x = np.log(np.random.default_rng(0).uniform(0.05, 1.0, size=6)).astype(np.float32)
    back = to_hf_layout("a_log", to_gguf_layout("a_log", x, hp), hp)
    assert np.abs(back.astype(np.float64) - x).max() <= 2.0 ** -23


def load_qwen35_hparams_like(n_k_heads: int, v_per_k: int):
    from specd.target_worker.gguf_loader import Qwen35HParams

    return Qwen35HParams(n_layer=1, n_nextn=0, n_vocab=8, n_embd=8, n_ff=8, n_head=1, n_head_kv=1, head_dim=8,
                         rms_eps=1e-6, rope_freq_base=1e7, n_rot=4, rope_sections=(1, 1, 0, 0),
                         context_length=None, ssm_conv_kernel=4, ssm_state_size=4, ssm_group_count=n_k_heads,
                         ssm_time_step_rank=n_k_heads * v_per_k, ssm_inner_size=4 * n_k_heads * v_per_k,
                         full_attention_interval=2, recurrent=(True,))


def test_conversion_streams_one_tensor_at_a_time(checkpoint, tmp_path, monkeypatch):
    """Each tensor is read, transformed and written before the next one is read."""
    import specd.target_worker.convert as conv

    events = []
    read, write = conv.read_tensor, gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(conv, "read_tensor", lambda local: events.append("r") or read(local))
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data",
                        lambda self, t, *a, **k: events.append("w") or write(self, t, *a, **k))
    result = convert(checkpoint("smoke").path, tmp_path / "s.gguf", "q8_0")
    assert "".join(events) == "rw" * len(result.tensors)
