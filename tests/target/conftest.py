"""Session fixtures for target tests: tiny checkpoints and their converted GGUFs, built once per
session into temporary directories (nothing binary is committed)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from specd.target_worker.convert import convert  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from .gguftools import random_blocks, rewrite_gguf  # noqa: E402
from .tinymodels import SPECS, build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> TinyCheckpoint for a tinymodels.SPECS entry (built on first use)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_checkpoint(SPECS[name], tmp_path_factory.mktemp(f"hf-{name}"))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def converted(checkpoint, tmp_path_factory):
    """converted(name, outtype="f32", mtp=True) -> path of the converted GGUF (cached)."""
    cache = {}

    def get(name: str, outtype: str = "f32", mtp: bool = True):
        key = (name, outtype, mtp)
        if key not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{name}-{outtype}{'' if mtp else '-nomtp'}.gguf"
            convert(checkpoint(name).path, out, outtype, mtp=mtp)
            cache[key] = out
        return cache[key]

    return get


# ---- random valid K-quant / IQ4_XS blocks (oracles.md §4.3) ----

def mixed_type(name: str) -> QT | None:
    """The seed's mix: IQ4_XS body, Q5_K output, Q6_K attn_v/ssm_out; plus Q4_K ffn_up and a Q8_0
    embedding so every block format appears."""
    if name == "output.weight":
        return QT.Q5_K
    if name == "token_embd.weight":
        return QT.Q8_0
    if name.endswith(("attn_v.weight", "ssm_out.weight")):
        return QT.Q6_K
    if name.endswith("ffn_up.weight"):
        return QT.Q4_K
    return QT.IQ4_XS


@pytest.fixture(scope="session")
def mixed_gguf(converted, tmp_path_factory):
    src = converted("main")
    rng = np.random.default_rng(7)
    replace = {}
    for t in gguf.GGUFReader(src).tensors:
        if len(t.shape) == 2 and "ssm_conv1d" not in t.name:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            qtype = mixed_type(t.name)
            replace[t.name] = (random_blocks(rows, cols, qtype, rng), qtype)
    return rewrite_gguf(src, tmp_path_factory.mktemp("mixed") / "mixed.gguf", replace_tensors=replace), replace
