"""Loader tests: qwen35 GGUF → Qwen35HParams + zero-copy Qwen35Weights, and every rejection path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf.quants import dequantize, quantize

import specd.native as sn
from specd.target_worker.convert import to_hf_config, to_hf_state_dict
from specd.target_worker.gguf_loader import (
    FullAttnLayer,
    GDNLayer,
    TargetFileError,
    iter_layer_tensors,
    load_qwen35,
    open_gguf,
    read_hparams,
)

from .gguftools import random_blocks, rewrite_gguf, tensor_payload
from .tinymodels import load_reference, logits64

# Fixtures are built with torch + transformers (the oracle environment).
pytestmark = pytest.mark.oracle

NATIVE = {QT.F32: sn.DType.F32, QT.F16: sn.DType.F16, QT.BF16: sn.DType.BF16, QT.Q8_0: sn.DType.Q8_0,
          QT.Q4_K: sn.DType.Q4_K, QT.Q5_K: sn.DType.Q5_K, QT.Q6_K: sn.DType.Q6_K, QT.IQ4_XS: sn.DType.IQ4_XS}


def _raw(t: gguf.gguf_reader.ReaderTensor) -> np.ndarray:
    """The reader's bytes of a tensor, as the numpy view a native Tensor of it returns."""
    if t.tensor_type == QT.BF16:
        return np.asarray(t.data).view(np.uint16)
    return np.asarray(t.data)


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_weights_structure_and_views(outtype, converted):
    path = converted("smoke", outtype)
    reader = open_gguf(path)
    w = load_qwen35(path, reader=reader)
    hp = w.hparams
    assert [type(layer) for layer in w.layers] == [GDNLayer if r else FullAttnLayer for r in hp.recurrent]
    assert [layer.index for layer in w.layers] == list(range(hp.n_layer))
    by_name = {t.name: t for t in reader.tensors}
    names = [n for n, _ in iter_layer_tensors(w)]
    assert set(names) == set(by_name)
    for name, tensor in iter_layer_tensors(w):
        t = by_name[name]
        assert tensor.dtype == NATIVE[t.tensor_type], name
        assert tuple(tensor.shape) == tuple(int(x) for x in reversed(t.shape)), name
        view = tensor.numpy()
        assert np.shares_memory(view, t.data), name  # zero copy over the memory map
        assert np.array_equal(view, _raw(t)), name
    assert w.layers[0].ssm_conv1d.dtype == sn.DType.F32 and tuple(w.layers[0].ssm_conv1d.shape) == (hp.conv_channels, 4)
    assert not w.output_tied


def test_tied_output_falls_back_to_embedding(converted):
    w = load_qwen35(converted("r3"))
    assert w.output_tied and w.output is w.token_embd


def test_interval_rule_without_recurrent_layers(converted, tmp_path):
    src = converted("main")
    dst = rewrite_gguf(src, tmp_path / "no-rec.gguf", drop_keys={"qwen35.attention.recurrent_layers"})
    assert load_qwen35(dst).hparams == load_qwen35(src).hparams


def test_recurrent_layers_win_over_interval(converted, tmp_path):
    """An explicit per-layer schedule is used as is, even where the interval rule disagrees."""
    src = converted("r3")  # interval 2: G F G F
    flags = [True, False, True, False]
    dst = rewrite_gguf(src, tmp_path / "rec.gguf", set_keys={"qwen35.full_attention_interval": (4, VT.UINT32)})
    hp = load_qwen35(dst).hparams
    assert hp.full_attention_interval == 4 and list(hp.recurrent) == flags


# ---- random valid K-quant / IQ4_XS blocks (oracles.md §4.3) -------------------------------------------


def test_random_block_mixed_gguf(mixed_gguf):
    path, replace = mixed_gguf
    w = load_qwen35(path)
    hp = w.hparams
    for name, tensor in iter_layer_tensors(w):
        if name in replace:
            data, qtype = replace[name]
            assert tensor.dtype == NATIVE[qtype], name
            assert np.array_equal(tensor.numpy(), data), name
        else:
            assert tensor.dtype == sn.DType.F32, name
    # golden-from-GGUF: dequantize + inverse-map, load strictly into transformers, run it
    state = to_hf_state_dict(path)
    model = load_reference(to_hf_config(hp, w.output_tied), state)
    logits = logits64(model, [1, 5, 9, 200, 31, 7])
    assert np.isfinite(logits).all() and logits.std() > 1e-3
    # spot-check the inverse mapping of a column-tiled block tensor (ssm_out, Q6_K)
    out_q, qtype = replace["blk.0.ssm_out.weight"]
    tiled = dequantize(out_q, qtype)
    Hk, r, dv = hp.n_k_heads, hp.v_per_k, hp.head_v_dim
    hf = state["model.layers.0.linear_attn.out_proj.weight"]
    for j in range(Hk * r):
        g, s = divmod(j, r)
        p = s * Hk + g
        assert np.array_equal(hf[:, j * dv:(j + 1) * dv], tiled[:, p * dv:(p + 1) * dv])


def test_random_blocks_have_target_scale():
    rng = np.random.default_rng(3)
    for qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.Q8_0):
        x = dequantize(random_blocks(8, 512, qtype, rng), qtype)
        assert np.isfinite(x).all() and 0.01 < x.std() < 0.1, qtype.name


# ---- rejections: each names the file and the item ------------------------------------------------------


def _smoke_edit(converted, tmp_path, **kw):
    return rewrite_gguf(converted("smoke"), tmp_path / "bad.gguf", **kw)


def _q4_0_ffn_up(converted):
    t = next(t for t in gguf.GGUFReader(converted("smoke")).tensors if t.name == "blk.0.ffn_up.weight")
    return {t.name: (quantize(np.asarray(t.data), QT.Q4_0), QT.Q4_0)}


BAD_CASES = {
    "missing_key": (dict(drop_keys={"qwen35.ssm.state_size"}), ["'qwen35.ssm.state_size'", "missing"]),
    "key_wrong_type": (dict(set_keys={"qwen35.block_count": ("four", VT.STRING)}),
                       ["'qwen35.block_count'", "STRING", "integer"]),
    "sections_wrong_length": (dict(set_keys={"qwen35.rope.dimension_sections": ([2, 1, 1], VT.ARRAY, VT.INT32)}),
                              ["qwen35.rope.dimension_sections", "expected 4"]),
    "recurrent_wrong_length": (dict(set_keys={"qwen35.attention.recurrent_layers": ([True, False], VT.ARRAY, VT.BOOL)}),
                               ["qwen35.attention.recurrent_layers", "block_count = 4"]),
    "dk_ne_dv": (dict(set_keys={"qwen35.ssm.inner_size": (256, VT.UINT32)}),
                 ["'qwen35.ssm.state_size'", "dk == dv"]),
    "kv_ne_v_length": (dict(set_keys={"qwen35.attention.value_length": (64, VT.UINT32)}),
                       ["'qwen35.attention.value_length'"]),
    "moe_arch": (dict(arch="qwen35moe"), ["'qwen35moe'", "MoE"]),
    "other_arch": (dict(arch="llama"), ["'llama'", "general.architecture"]),
    "missing_tensor": (dict(drop_tensors={"blk.3.attn_k_norm.weight"}), ["'blk.3.attn_k_norm.weight'", "missing"]),
    "missing_embedding": (dict(drop_tensors={"token_embd.weight"}), ["'token_embd.weight'", "missing"]),
    "wrong_shape": (dict(replace_tensors={"blk.0.attn_qkv.weight": np.zeros((256, 96), np.float32)}),
                    ["'blk.0.attn_qkv.weight'", "[96, 256]", "expected [128, 256]"]),
    "norm_not_f32": (dict(replace_tensors={"blk.1.attn_norm.weight": np.ones(128, np.float16)}),
                     ["'blk.1.attn_norm.weight'", "F16", "expected F32"]),
    "unknown_tensor": (dict(add_tensors={"blk.0.attn_extra.weight": np.zeros((4, 128), np.float32)}),
                       ["'blk.0.attn_extra.weight'", "unexpected"]),
    "tensor_past_mtp": (dict(add_tensors={"blk.4.attn_q.weight": np.zeros((256, 128), np.float32)}),
                        ["'blk.4.attn_q.weight'", "unexpected"]),
    "gdn_tensor_in_attention_layer": (dict(add_tensors={"blk.3.ssm_a": np.zeros(4, np.float32)}),
                                      ["'blk.3.ssm_a'", "unexpected"]),
}


@pytest.mark.parametrize("case", list(BAD_CASES) + ["unsupported_dtype", "truncated", "not_gguf", "no_file"])
def test_rejects_bad_file(case, converted, tmp_path):
    if case in BAD_CASES:
        kwargs, expect = BAD_CASES[case]
        path = _smoke_edit(converted, tmp_path, **kwargs)
    elif case == "unsupported_dtype":
        path = _smoke_edit(converted, tmp_path, replace_tensors=_q4_0_ffn_up(converted))
        expect = ["'blk.0.ffn_up.weight'", "Q4_0", "IQ4_XS"]
    elif case == "truncated":
        data = converted("smoke").read_bytes()
        path = tmp_path / "trunc.gguf"
        path.write_bytes(data[: len(data) - 4096])
        expect = ["truncated"]
    elif case == "not_gguf":
        path = tmp_path / "junk.gguf"
        path.write_bytes(b"not a gguf file at all" * 10)
        expect = ["not a readable GGUF"]
    else:
        path, expect = tmp_path / "absent.gguf", ["no such file"]
    with pytest.raises(TargetFileError) as info:
        load_qwen35(path)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg
    for item in expect:
        assert item in msg, (item, msg)


def test_truncated_inside_tensor_data(converted, tmp_path):
    """A cut one byte short of the last tensor's data: an error naming the file, never a crash."""
    src = converted("smoke")
    reader = gguf.GGUFReader(src)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    path = tmp_path / "cut.gguf"
    path.write_bytes(src.read_bytes()[: int(last.data_offset) + int(last.n_bytes) - 1])
    with pytest.raises(TargetFileError) as info:
        load_qwen35(path)
    assert str(path) in str(info.value) and "truncated" in str(info.value)


def test_read_hparams_alone(converted):
    path = converted("condgen")
    hp = read_hparams(open_gguf(path), path)
    assert hp.n_layer == 4 and hp.n_nextn == 1 and hp.block_count == 5


def test_payload_roundtrip_is_lossless(converted, tmp_path):
    """The rewrite helper itself copies every tensor byte for byte (so rejections come from the edit)."""
    src = converted("smoke", "bf16")
    dst = rewrite_gguf(src, tmp_path / "copy.gguf")
    a = {t.name: t for t in gguf.GGUFReader(src).tensors}
    for t in gguf.GGUFReader(dst).tensors:
        assert t.tensor_type == a[t.name].tensor_type
        assert np.array_equal(tensor_payload(t)[0], tensor_payload(a[t.name])[0])
