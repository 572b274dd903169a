"""tools/bench/random_drafter.py and tools/bench/gpu_drafter.py on the CPU (issue 7 benchmark harness).

* the tiny random drafter of each family, in each storage type, loads in the validating drafter loader,
  pairs with random_qwen35's tiny target, and its block forward gives finite logits;
* the HF layout the generator feeds the converter's reader agrees with tinydrafters' documented one;
* the 27B configs, read by the converter's reader (no file written), have the published shapes and
  parameter counts (drafters.md §2.3, §5.6, §6.4);
* gpu_drafter.py --device cpu --config tiny runs end to end and writes its JSON.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
import random_drafter as rd  # noqa: E402
import random_qwen35 as rq  # noqa: E402

import tinydrafters as td  # noqa: E402
from specd.draft_worker.contract import DrafterPairError, expected_tensors  # noqa: E402
from specd.draft_worker.engine import open_model_drafter  # noqa: E402
from specd.draft_worker.gguf_loader import check_pair  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "tiny-q8_0.gguf"
    rq.write(path, "tiny", "q8_0", seed=3)
    return path


@pytest.mark.parametrize("outtype", rd.TYPES)
@pytest.mark.parametrize("family", rd.FAMILIES)
def test_tiny_drafter_loads_pairs_and_runs(tmp_path, tiny_target, family, outtype):
    out = tmp_path / f"{family}.gguf"
    info = rd.write(out, family, "tiny", outtype, seed=1)
    loaded = rd.validate(out, "tiny", tiny_target)  # loader + check_pair against the file
    rd.validate(out, "tiny")  # ... and against random_qwen35's tiny hyperparameters
    hp = loaded.hparams
    assert hp.family == family and info["params"] == rd.param_count(family, "tiny")
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert set(types) == set(expected_tensors(hp))
    assert types["output_norm.weight"] == "F32" and types["blk.1.ffn_down.weight"] == outtype.upper()
    if family == "dflash2":
        assert types["blk.0.attn_conv.base"] == "F32"
        assert hp.causal_pattern == (False, False) and hp.sliding_window == 64
    if family == "dspark":
        assert hp.dspark.confidence and hp.dspark.confidence_with_markov and hp.yarn.factor == 32
        assert types["dflash.dspark.confidence.weight"] == "F32"
    d = open_model_drafter(str(out), str(tiny_target))
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((24, hp.n_taps * hp.n_embd), dtype=np.float32)
    d.ingest("s", 0, list(range(24)), feats)
    seq = d.seqs["s"]
    p = seq.propose(7, seq.n_ctx, return_logits=True)
    assert np.isfinite(p.logits).all() and len(p.tokens) == hp.n_drafts
    assert 0.1 < float(np.std(p.logits)) < 100
    # the device code path (sn.Tensor ops, as on the GPU) run on the CPU gives the same drafts
    from specd.draft_worker.model import DrafterModel
    from specd.target_worker.gguf_loader import load_qwen35

    dev = DrafterModel.for_target(loaded, load_qwen35(tiny_target), tensor_ops=True).new_sequence(64)
    dev.ingest(feats, 0)
    assert np.array_equal(dev.propose(7, 24).tokens, p.tokens)


def test_tiny_drafter_refuses_the_27b_target(tmp_path):
    out = tmp_path / "d.gguf"
    rd.write(out, "dflash", "tiny", "bf16")
    with pytest.raises(DrafterPairError, match="hidden size"):
        check_pair(rd.validate(out, "tiny").hparams, out, rd.target_hparams("27b"), "27b")


@pytest.mark.parametrize("config", sorted(rd.CONFIGS))
@pytest.mark.parametrize("family", rd.FAMILIES)
def test_hf_layout_matches_documented(family, config):
    cfg = rd.CONFIGS[config][family]
    assert rd.hf_shapes(cfg) == td.documented_names(cfg)


@pytest.mark.parametrize("family", rd.FAMILIES)
def test_27b_shapes_and_parameter_counts(family):
    hp = rd.drafter_description(family, "27b").hparams
    t = rd.target_hparams("27b")
    check_pair(hp, f"27b {family}", t, "random_qwen35 27b")
    assert (hp.n_embd, hp.n_vocab, hp.n_layer, hp.head_dim, hp.n_head_kv, hp.mask_token_id, hp.rope_theta) == \
        (5120, 248320, 5, 128, 8, 248070, 1e7)
    want = {"dflash": (16, 32, 17408, (1, 16, 31, 46, 61)), "dspark": (7, 40, 10240, (4, 16, 28, 40, 52)),
            "dflash2": (8, 32, 17408, (5, 19, 33, 47, 61))}[family]
    assert (hp.block_size, hp.n_head, hp.n_ff, hp.target_layer_ids) == want
    assert rd.param_count(family, "27b") == pytest.approx(rd.PUBLISHED_PARAMS[family], rel=1e-3)
    if family == "dflash":
        assert hp.causal_pattern == (False,) * 5 and hp.sliding_window is None and hp.yarn is None
    if family == "dspark":
        assert hp.dspark.markov_rank == 256 and hp.yarn.factor == 32 and hp.yarn.original_context_length == 8192
        # the confidence head adds H + r + 1 parameters; without it the count is the shard's exactly
        assert rd.param_count(family, "27b") - (5120 + 256 + 1) == pytest.approx(1.3593e9, rel=1e-4)
    if family == "dflash2":
        assert hp.sliding_pattern == (True,) * 5 and hp.sliding_window == 2048 and hp.causal_pattern == (False,) * 5
        d2 = hp.dflash2
        assert (d2.conv_group_size, d2.conv_kernel_size, d2.selector_rank, d2.selector_top_k) == (16, 2, 256, 16)


def test_27b_bytes_per_type():
    """BF16 / Q8_0 storage sizes of the 27B DFlash drafter (matrices only; 34 bytes per 32 Q8_0 values)."""
    hp = rd.drafter_description("dflash", "27b").hparams
    specs = expected_tensors(hp).values()
    mat = sum(math.prod(s.ne) for s in specs if s.kind == "matrix")
    f32 = sum(math.prod(s.ne) for s in specs if s.kind != "matrix")
    for t, per in (("bf16", 2.0), ("q8_0", 34 / 32)):
        got = sum(rq.nbytes_of(s.ne, rd.storage_type(s, t)) for s in specs)
        assert got == int(mat * per) + 4 * f32


def test_gpu_drafter_smoke_on_cpu(tmp_path):
    import gpu_drafter

    target = tmp_path / "t.gguf"
    assert gpu_drafter.main(["--device", "cpu", "--config", "tiny", "--mix", "q8_0", "--target", str(target),
                             "--context", "40", "--steps", "2", "--warmup", "1", "--ingest-reps", "1",
                             "--verify-ms", "25", "--out", str(tmp_path / "o")]) == 0
    rep = json.loads((tmp_path / "o" / "gpu_drafter_bf16.json").read_text())
    assert set(rep["families"]) == set(rd.FAMILIES) and rep["context"] == 40
    for fam, r in rep["families"].items():
        assert r["propose_ms"] > 0 and r["ingest_ms"] > 0 and r["forward_ms"] > 0 and r["logits_finite"]
        assert r["propose_ratio_to_verify"] == pytest.approx(r["propose_ms"] / 25)
        assert r["n_tokens"] == r["drafts"] and r["stream_bytes_per_propose"] > 0
        assert not Path(r["drafter"]).exists()  # written by the run, removed after (no --keep)
    # --decode-json: verify time at each family's verify width
    (tmp_path / "dec.json").write_text(json.dumps({"verify_ms": {str(w): float(w) for w in range(1, 18)}}))
    assert gpu_drafter.main(["--device", "cpu", "--config", "tiny", "--target", str(target), "--families", "dspark",
                             "--type", "q8_0", "--context", "16", "--steps", "1", "--warmup", "0",
                             "--decode-json", str(tmp_path / "dec.json"), "--profile", "1", "--out", str(tmp_path / "o")]) == 0
    r = json.loads((tmp_path / "o" / "gpu_drafter_q8_0.json").read_text())["families"]["dspark"]
    assert r["verify_ms"] == 8.0 and r["verify_width"] == 8
    # --profile: the host profile of the proposes (the CPU run has no GPU kernels to list)
    assert r["host_profile"]["wall_ms_per_propose"] > 0 and r["host_profile"]["top"] and "profile_busy_ms" in r


@pytest.mark.parametrize("argv", [["--context", "0"], ["--verify-ms", "-1"], ["--families", "eagle"],
                                  ["--top-k", "-2"], ["--decode-json", "/nonexistent.json"]])
def test_gpu_drafter_argument_validation(tmp_path, argv):
    import gpu_drafter

    with pytest.raises(SystemExit) as e:
        gpu_drafter.main(["--device", "cpu", "--config", "tiny", "--target", str(tmp_path / "t.gguf")] + argv)
    assert e.value.code == 2
