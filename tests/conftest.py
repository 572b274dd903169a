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


@pytest.fixture
def serve_children(monkeypatch):
    """``run(args, stop_at="draft-worker")`` runs ``specd serve <args>`` with its children recorded instead
    of started, and returns the argv of each child up to ``stop_at``'s, whose launch stops the run (a
    child "starts" at once: READY on its stdout, alive until stopped)."""
    import types

    from specd.coordinator import launcher
    from specd.coordinator.cli import build_parser

    class Stop(Exception):
        pass

    class Proc:
        stdout = types.SimpleNamespace(readline=lambda: "READY\n")

        def poll(self):
            return None

        def send_signal(self, sig):
            pass

        def wait(self, timeout=None):
            return 0

    def run(args, stop_at: str = "draft-worker"):
        seen = []

        def child(argv, *a, **k):
            seen.append(list(argv))
            if argv[0] == stop_at:
                raise Stop
            return Proc()

        monkeypatch.setattr(launcher, "_child", child)
        with pytest.raises(Stop):
            launcher.run(build_parser().parse_args(["serve", *args]))
        return seen

    return run
