"""quantize-drafter: Q8_0 round trip, kept tensors, report, CLI."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from specd.coordinator.cli import main as specd_main
from specd.draft_worker.contract import DrafterFormatError
from specd.draft_worker.gguf_loader import load_drafter
from specd.draft_worker.quantize import quantize_drafter


def tensors_of(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_q8_0_roundtrip_error_bound(converted, tmp_path, family):
    """Q8_0 relative error < 1e-2 per tensor on N(0, 0.05) weights; norms and other F32 tensors
    (conv base kernels, confidence head) are byte-identical."""
    src, _, hf, hp = converted(family, outtype="f32", dtype="F32")
    out = tmp_path / "q.gguf"
    logs = []
    rep = quantize_drafter(src, out, log=logs.append)
    a, b = tensors_of(src), tensors_of(out)
    assert set(a) == set(b)
    quantized = {r.name: r for r in rep.tensors if r.dst_type == "Q8_0"}
    assert "dflash.fc.weight" in quantized and "blk.1.ffn_down.weight" in quantized
    for name, t in b.items():
        if name in quantized:
            assert t.tensor_type == QT.Q8_0
            w = np.asarray(a[name].data)
            # the bytes are gguf's reference Q8_0 encoding of the source tensor
            assert np.asarray(t.data).tobytes() == gguf.quants.quantize(w, QT.Q8_0).tobytes(), name
            dq = gguf.quants.dequantize(np.asarray(t.data), QT.Q8_0).reshape(w.shape)
            # the reported error is checked against a direct float64 computation (not relative_error)
            w64, d64 = w.astype(np.float64), dq.astype(np.float64)
            err = float(np.sqrt(((w64 - d64) ** 2).sum() / (w64 ** 2).sum()))
            assert 0 < err < 1e-2, (name, err)
            assert quantized[name].rel_error == pytest.approx(err, rel=1e-9)
        else:
            assert t.tensor_type == a[name].tensor_type
            assert np.asarray(t.data).tobytes() == np.asarray(a[name].data).tobytes(), name
    norms = [n for n in b if n.endswith("norm.weight")]
    assert norms and all(b[n].tensor_type == QT.F32 for n in norms)
    if family == "dflash2":
        assert b["blk.0.attn_conv.base"].tensor_type == QT.F32
        assert b["blk.0.attn_conv.proj.weight"].tensor_type == QT.Q8_0
        assert b["dflash.selector.pred_cb"].tensor_type == QT.F32  # ne0 = rank 8: not a multiple of 32
    if family == "dspark":
        assert b["dflash.dspark.markov.w1"].tensor_type == QT.Q8_0  # ne0 = rank 32
        assert b["dflash.dspark.confidence.weight"].tensor_type == QT.F32
    assert rep.size_after < rep.size_before
    assert any(s.strip().startswith("size:") for s in logs)
    assert any("rel err" in s for s in logs) and any("norm: kept F32" in s for s in logs)
    ld = load_drafter(out)
    assert ld.hparams == hp
    kv = gguf.GGUFReader(out).fields
    assert kv["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert kv["general.quantization_version"].contents() == gguf.GGML_QUANT_VERSION


def test_keep_regex_and_already_quantized(converted, tmp_path):
    src, *_ = converted("dflash2")
    once = tmp_path / "once.gguf"
    rep = quantize_drafter(src, once, keep=[r"_conv\.proj", r"^dflash\.selector\."], log=lambda s: None)
    kinds = {r.name: (r.dst_type, r.reason) for r in rep.tensors}
    assert kinds["blk.0.attn_conv.proj.weight"] == ("F16", "--keep: kept")
    assert kinds["dflash.selector.hproj.weight"] == ("F16", "--keep: kept")
    assert kinds["blk.0.attn_q.weight"][0] == "Q8_0"
    twice = quantize_drafter(once, tmp_path / "twice.gguf", log=lambda s: None)
    assert {r.name: r.reason for r in twice.tensors}["blk.0.attn_q.weight"] == "already block-quantized: kept"
    a, b = tensors_of(once), tensors_of(tmp_path / "twice.gguf")
    assert np.asarray(a["blk.0.attn_q.weight"].data).tobytes() == np.asarray(b["blk.0.attn_q.weight"].data).tobytes()


def test_quantize_refuses_invalid_drafter(tmp_path, converted):
    from ggufedit import rewrite

    src, *_ = converted("dflash")
    bad = rewrite(src, tmp_path / "bad.gguf", drop_keys={"qwen35-dflash-draft.dflash.family"})
    with pytest.raises(DrafterFormatError, match=r"dflash\.family is missing"):
        quantize_drafter(bad, tmp_path / "out.gguf", log=lambda s: None)
    assert not (tmp_path / "out.gguf").exists()


def test_cli_convert_then_quantize(make, tmp_path, capsys):
    folder, _, _ = make("dspark")
    f16, q8 = tmp_path / "d.gguf", tmp_path / "d.q8.gguf"
    assert specd_main(["convert-drafter", str(folder), str(f16)]) == 0
    assert specd_main(["quantize-drafter", str(f16), str(q8), "--scheme", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert "block_size = 8 (from block_size)" in out
    assert "size:" in out and "rel err" in out
    assert load_drafter(q8).hparams.family == "dspark"
    # refuses to overwrite without --force; errors go to stderr with exit status 1
    assert specd_main(["quantize-drafter", str(f16), str(q8)]) == 1
    assert specd_main(["convert-drafter", str(tmp_path / "missing"), str(tmp_path / "x.gguf")]) == 1
    assert "specd convert-drafter: error:" in capsys.readouterr().err


def test_quantize_bf16_source(converted, tmp_path):
    src, _, _, hp = converted("dflash", outtype="bf16")
    rep = quantize_drafter(src, tmp_path / "q.gguf", log=lambda s: None)
    errs = [r.rel_error for r in rep.tensors if r.src_type == "BF16"]
    assert errs and all(r.dst_type == "Q8_0" for r in rep.tensors if r.src_type == "BF16")
    assert max(errs) < 1e-2
    assert load_drafter(tmp_path / "q.gguf").hparams == hp
