"""Session fixtures for target tests: tiny checkpoints and their converted GGUFs, built once per
session into temporary directories (nothing binary is committed)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from specd.target_worker.convert import convert  # noqa: E402

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
