"""Fixtures for the drafter tests: tiny random checkpoints (tinydrafters) and their conversions."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tinydrafters  # noqa: E402

from specd.draft_worker.convert import convert_hf  # noqa: E402


@pytest.fixture
def make(tmp_path, rng):
    """make(family, name=None, **kw) -> (folder, config, float32 tensors as stored)."""
    counter = iter(range(1000))

    def _make(family: str, name: str | None = None, **kw):
        return tinydrafters.make_drafter(tmp_path / (name or f"{family}{next(counter)}"), family, rng, **kw)

    return _make


@pytest.fixture
def converted(make, tmp_path):
    """converted(family, outtype="f16", **kw) -> (gguf path, config, tensors, hparams)."""

    def _conv(family: str, outtype: str = "f16", **kw):
        folder, cfg, tensors = make(family, **kw)
        out = folder.parent / f"{folder.name}.{outtype}.gguf"
        hp = convert_hf(folder, out, outtype, log=lambda s: None)
        return out, cfg, tensors, hp

    return _conv


@pytest.fixture(scope="session")
def np_rng():
    return np.random.default_rng(12345)
