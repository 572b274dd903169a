"""Runs a benchmark script of tools/bench as a smoke test: its own process group, killed whole (the
script and every server it started) on a timeout."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(cmd: list, timeout: float) -> str:
    """Runs ``cmd`` from the repository root; returns its stdout. Fails the test on a timeout or a
    non-zero exit (with the output's tail)."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"benchmark smoke run took over {timeout:g} s:\n" + stdout[-2000:] + stderr[-2000:])
    assert p.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return stdout
