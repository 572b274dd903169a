"""tools/bench/random_qwen35.py: the benchmark's random-weight qwen35 GGUFs load in specd's validating
loader with the storage types of each mix, and a forward gives finite logits (the F16 scales of every
block format are finite). Run on the tiny config (same structure as the 27B)."""
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
import random_qwen35 as rq  # noqa: E402

import specd.native as sn  # noqa: E402
from specd.target_worker.gguf_loader import load_qwen35  # noqa: E402
from specd.target_worker.model import Qwen35Model  # noqa: E402


@pytest.mark.parametrize("mix", rq.MIXES)
def test_random_gguf_loads_and_runs(tmp_path, mix):
    out = tmp_path / f"{mix}.gguf"
    info = rq.write(out, "tiny", mix, seed=1)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.ssm_a"] == "F32"
    assert types["blk.0.ssm_alpha.weight"] != "F32" and types["blk.0.ssm_conv1d.weight"] == "F32"
    if mix == "iq4xs":
        assert types["blk.0.ffn_up.weight"] == "IQ4_XS" and types["output.weight"] == "Q5_K"
        assert types["blk.0.ssm_out.weight"] == "Q6_K" and types["blk.3.attn_v.weight"] == "Q6_K"
    if mix == "q4km":
        assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q4_K"
    assert info["bytes"] == out.stat().st_size
    m = Qwen35Model(load_qwen35(out))
    st = m.new_sequence(16)
    logits = m.prefill(st, [1, 2, 3])
    assert logits.shape == (1024,) and np.isfinite(logits).all()
    assert np.isfinite(m.decode(st, int(np.argmax(logits)))).all()


@pytest.mark.parametrize("mix", ["iq4xs", "q8_0"])
def test_tiled_tensors_keep_finite_scales(tmp_path, monkeypatch, mix):
    """Tensors larger than the byte pool are tiled from a block boundary: every decoded weight is
    finite (a misaligned start would read scale fields from quant bytes)."""
    monkeypatch.setattr(rq, "POOL_BYTES", 1 << 14)  # smaller than most tiny-config matrices
    out = tmp_path / f"{mix}.gguf"
    rq.write(out, "tiny", mix, seed=3)
    w = load_qwen35(out)
    for layer in w.layers:
        for t in (layer.ffn_up, layer.ffn_down):
            assert np.isfinite(sn.dequantize(t).numpy()).all()


def test_gpu_decode_benchmark_smoke_on_cpu(tmp_path):
    """tools/bench/gpu_decode.py end to end on the CPU (tiny config, with capture layers): every section
    is reported and the scripted loop's verify rows predict the greedy continuation (verify == decode)."""
    import json

    import gpu_decode
    gguf_path = tmp_path / "tiny.gguf"
    assert gpu_decode.main(["--gguf", str(gguf_path), "--config", "tiny", "--mix", "q8_0", "--device", "cpu",
                            "--decode-tokens", "4", "--prefill", "16", "--decode-context", "40",
                            "--capture-layers", "0", "1", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "gpu_decode_q8_0.json").read_text())
    assert rep["capture_layers"] == [0, 1] and "capture layers 0, 1" in gpu_decode.markdown(rep)
    assert rep["decode_tok_s"] > 0 and len(rep["verify_ms"]) == 17 and rep["prefill_tok_s"]
    assert rep["prefill_cold_tok_s"].keys() == rep["prefill_tok_s"].keys()
    assert rep["decode_at_context_tok_s"]["40"] > 0
    assert all(v["steps_not_matching_greedy"] == 0 and v["steps"] > 0 for v in rep["loop"].values())


def test_gpu_decode_kernel_summary():
    """The per-kernel profile summary of gpu_decode.py --profile: names shortened (namespaces,
    argument lists), calls and time summed per kernel, per step, sorted, shares summing to 1."""
    import gpu_decode
    ev = [("void specd::gpu::(anonymous namespace)::rms_norm_kernel<4>(float const*, float*)", 2.0),
          ("void specd::gpu::detail::mma::mma_gemv_kernel<specd::gpu::detail::mma::IQ4U, 1>(unsigned char const*)", 30.0),
          ("void specd::gpu::(anonymous namespace)::rms_norm_kernel<4>(float const*, float*)", 4.0),
          ("Memcpy DtoH (Device -> Pinned)", 1.0)]
    rows = gpu_decode.summarise_kernels(ev, steps=2)
    assert [r["kernel"] for r in rows] == ["mma::mma_gemv_kernel<mma::IQ4U, 1>", "rms_norm_kernel<4>", "Memcpy DtoH"]
    assert rows[1]["calls"] == 2 and rows[1]["us_per_step"] == 3.0
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-12
    md = gpu_decode.markdown({"config": "27b", "mix": "iq4xs", "device": "x", "date": "d", "weight_bytes": 1,
                              "load_s": 1.0, "decode_tok_s": 1.0, "verify_ms": {1: 1.0}, "prefill_tok_s": {},
                              "loop": {}, "streamed_bytes_per_token": 1, "profile": rows, "profile_steps": 2,
                              "verify_profile": {8: {"calls": 2, "kernels": rows}}})
    assert "| `mma::mma_gemv_kernel<mma::IQ4U, 1>` | 0 | 15 | 81.1 % |" in md
    verify = md[md.index("GPU time per verify of 8 rows"):]  # --profile-verify 8: calls per verify
    assert "| kernel | calls / verify | us / verify | share |" in verify
    assert "| `rms_norm_kernel<4>` | 1 | 3 | 16.2 % |" in verify
    for bad in (["0"], ["17"], ["4", "4"], []):  # widths 1..16, distinct, at least one
        with pytest.raises(SystemExit):
            gpu_decode.main(["--gguf", "unused.gguf", "--profile-verify", *bad])
    for bad in (["--profile-commit", "4"], ["--profile-commit"],  # the scripted loop's acceptance lengths 3, 5, 7
                ["--profile-commit", "5", "--device", "cpu"], ["--profile", "4", "--device", "cpu"]):  # GPU kernels only
        with pytest.raises(SystemExit):
            gpu_decode.main(["--gguf", "unused.gguf", *bad])
    md = gpu_decode.markdown({"config": "27b", "mix": "iq4xs", "device": "x", "date": "d", "weight_bytes": 1,
                              "load_s": 1.0, "decode_tok_s": 1.0, "verify_ms": {1: 1.0}, "prefill_tok_s": {},
                              "loop": {}, "streamed_bytes_per_token": 1, "commit_profile": {5: {"calls": 2, "kernels": rows}}})
    assert "| kernel | calls / commit | us / commit | share |" in md[md.index("per commit of 5 of a verify's 8 rows"):]


def test_gpu_decode_exclusive_kernel_times():
    """With programmatic dependent launch a kernel's span starts while the one before it runs; the
    profile counts each kernel from the end of every kernel that started before it, so the times add
    up to the GPU's busy time (gaps excluded) and a kernel wholly inside another's span counts 0."""
    import gpu_decode
    spans = [(0.0, 10.0, "a"), (2.0, 15.0, "b"), (3.0, 12.0, "c"), (20.0, 25.0, "d")]
    assert gpu_decode.exclusive_times(spans) == [("a", 10.0), ("b", 5.0), ("c", 0.0), ("d", 5.0)]


def test_gpu_decode_idle_gaps():
    """The prefill's idle-gap summary: busy time is the union of the GPU spans (overlapping PDL spans
    counted once), gaps under 5 us are not listed, each listed gap names the kernels around it and the
    host API calls overlapping it (by overlap), and the API totals cover every call."""
    import gpu_decode
    gpu = [(0.0, 10.0, "void a()"), (2.0, 12.0, "void b()"), (14.0, 20.0, "void c()"), (150.0, 160.0, "void d()"),
           (1300.0, 1310.0, "void e()")]
    api = [(5.0, 6.0, "cudaLaunchKernel"), (30.0, 140.0, "cudaStreamSynchronize"),
           (145.0, 148.0, "cudaLaunchKernel"), (400.0, 500.0, "cudaMallocAsync")]
    g = gpu_decode.idle_gaps(gpu, api, top=2)
    assert g["span_us"] == 1310.0 and g["busy_us"] == 12.0 + 6.0 + 10.0 + 10.0
    assert g["idle_us"] == 1310.0 - 38.0
    assert g["gaps"]["5-20 us"] == [0, 0] and g["gaps"]["0.1-1 ms"] == [1, 130.0] and g["gaps"][">= 1 ms"] == [1, 1140.0]
    assert [t["us"] for t in g["top"]] == [1140.0, 130.0]
    assert g["top"][0]["before"] == "d" and g["top"][0]["after"] == "e" and g["top"][0]["api"] == {"cudaMallocAsync": 100.0}
    assert g["top"][1]["api"] == {"cudaStreamSynchronize": 110.0, "cudaLaunchKernel": 3.0}
    assert g["api"]["cudaLaunchKernel"] == [2, 4.0]
    assert gpu_decode.idle_gaps([], api)["busy_us"] == 0.0
