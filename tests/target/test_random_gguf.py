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
