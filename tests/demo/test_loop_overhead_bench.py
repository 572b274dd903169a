"""Smoke test of the spec-loop benchmark (tools/bench/loop_overhead.py) on the demo target: 8 tokens,
AL 3 and 5, over the IPC stream sockets (default; with capture layers, so feature rows travel), gRPC
streams (--no-ipc-streams) and unary calls (--no-worker-streams). One target worker serves every
mode; the script checks every run's tokens against plain greedy decoding itself (it fails
otherwise), so a zero exit and the table's rows are the check."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .script_run import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "loop_overhead.py"
TARGET = ROOT / "models" / "demo-target.gguf"


# the IPC run also gives the target capture layers: real feature rows then travel through the shm ring
HOT_PATHS = {"ipc": (["--capture-layers", "0,1"], "one IPC stream per sequence and worker"),
             "grpc": (["--no-ipc-streams"], "one gRPC stream per sequence and worker"),
             "unary": (["--no-worker-streams"], "one unary call per worker call")}


@pytest.mark.parametrize("hot_path", sorted(HOT_PATHS))
def test_loop_overhead_bench_smoke(tmp_path, hot_path):
    if not TARGET.is_file():
        pytest.skip(f"missing {TARGET}")
    md = tmp_path / "B.md"
    cmd = [sys.executable, str(SCRIPT), "--target", str(TARGET), "--device", "cpu", "--tokens", "8",
           "--al", "3", "5", "--block", "6", "--write", str(md)] + HOT_PATHS[hot_path][0]
    run_script(cmd, timeout=180)
    text = md.read_text(encoding="utf-8")
    main, split = text.split("Where a step's wall time")

    def rows(part):
        return [line for line in part.splitlines() if line.startswith("| plain") or line.startswith("| oracle")]

    labels = ["plain (speculation off), 1 step per call", "plain (speculation off), 8 steps per call",
              "oracle drafter, AL 3, exact (width 3)", "oracle drafter, AL 3, block 6 (width 7)",
              "oracle drafter, AL 5, exact (width 5)", "oracle drafter, AL 5, block 6 (width 7)"]
    assert [r.split("|")[1].strip() for r in rows(main)] == labels
    calls = [float(r.split("|")[5]) for r in rows(main)]
    # 8 tokens = the prefill's + 7 plain steps: one call each, or one plain run of 7 in one call
    assert calls[0] == 1.0 and calls[1] == round(1 / 7, 2) and all(1.0 < c <= 2.0 for c in calls[2:])
    assert HOT_PATHS[hot_path][1] in text
    assert ("--capture-layers 0,1" in text) == (hot_path == "ipc")
    # the split of each step's time: bookkeeping, draft wait, the verify outside the target's handler, the
    # handler beyond its compute, drafter compute
    assert [r.split("|")[1].strip() for r in rows(split)] == labels
    cells = [[float(c) for c in r.split("|")[2:7]] for r in rows(split)]
    assert all(min(c) >= 0 for c in cells)
    assert all(c[1] == 0 and c[4] == 0 for c in cells[:2])  # plain steps: no draft wait, no drafter
    assert all(c[1] > 0 and c[4] > 0 and c[2] > 0 and c[3] > 0 for c in cells[2:])


def test_grpc_floor_bench_smoke(tmp_path):
    """tools/bench/grpc_floor.py: every server kind (gRPC sync and aio, the IPC stream socket) answers
    over one stream and the table has a row each with positive medians."""
    md = tmp_path / "F.md"
    run_script([sys.executable, str(ROOT / "tools" / "bench" / "grpc_floor.py"), "--calls", "5", "--handler-ms", "0",
                "--write", str(md)], timeout=120)
    rows = [line.split("|") for line in md.read_text(encoding="utf-8").splitlines() if line.startswith("| sync")
            or line.startswith("| aio") or line.startswith("| ipc")]
    assert [r[1].strip() for r in rows] == ["sync", "aio", "ipc"]
    assert all(float(c.strip().split()[0]) > 0 for r in rows for c in r[2:5])
    assert "## Transport floor of one worker round trip: gRPC and IPC streams" in md.read_text(encoding="utf-8")
    both = tmp_path / "B.md"  # --server both: the name from before the ipc row, still sync and aio
    run_script([sys.executable, str(ROOT / "tools" / "bench" / "grpc_floor.py"), "--calls", "2", "--handler-ms", "0",
                "--server", "both", "--write", str(both)], timeout=120)
    assert [line.split("|")[1].strip() for line in both.read_text(encoding="utf-8").splitlines()
            if line.startswith(("| sync", "| aio", "| ipc"))] == ["sync", "aio"]


def test_loop_overhead_bench_spin_values(tmp_path):
    """--ipc-spin-us with several values (N for every process, W:C for workers / coordinators apart):
    one service run and table each, in order, every run's tokens checked, and the side-by-side table."""
    if not TARGET.is_file():
        pytest.skip(f"missing {TARGET}")
    md = tmp_path / "S.md"
    run_script([sys.executable, str(SCRIPT), "--target", str(TARGET), "--device", "cpu", "--tokens", "8", "--al", "3",
                "--block", "6", "--ipc-spin-us", "0", "200:50", "--write", str(md)], timeout=240)
    text = md.read_text(encoding="utf-8")
    assert text.index("**--ipc-spin-us 0**") < text.index("**--ipc-spin-us 200:50**")
    assert "| mode | spin 0 us | spin 200:50 us |" in text and "--ipc-spin-us 0 200:50`" in text
    side = text[text.index("**In-step overhead per step by --ipc-spin-us**"):]
    assert len([line for line in side.splitlines() if line.startswith(("| plain", "| oracle"))]) == 4


def test_grpc_floor_bench_spin_rows(tmp_path):
    """grpc_floor.py --ipc-spin-us 0 200: one ipc row per value, server and client spinning."""
    md = tmp_path / "F.md"
    run_script([sys.executable, str(ROOT / "tools" / "bench" / "grpc_floor.py"), "--calls", "5", "--handler-ms", "0",
                "--server", "ipc", "--ipc-spin-us", "0", "200", "--write", str(md)], timeout=120)
    rows = [line.split("|") for line in md.read_text(encoding="utf-8").splitlines() if line.startswith("| ipc")]
    assert [r[1].strip() for r in rows] == ["ipc", "ipc, spin 200 us"]
    assert all(float(c.strip().split()[0]) > 0 for r in rows for c in r[2:5])
