"""Shared pytest fixtures.

Random inputs use a fresh seed per test (so every CI run explores new inputs); the seed is printed
in the failure report so a failing case can be replayed with SPECD_TEST_SEED=<seed>.
"""
import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("SPECD_TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    print(f"[seed] {request.node.nodeid}: SPECD_TEST_SEED={seed}")
    return np.random.default_rng(seed)
