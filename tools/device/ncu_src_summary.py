"""Where a kernel's warps wait, per SASS opcode: a summary of Nsight Compute's per-instruction tables.

Reads the ``ncu_src_NAME.csv`` files that ``tools/device/gemv_sweep.sh`` writes with ``NCU_SOURCE=1``
(``ncu --page source --print-source sass --csv``: row 1 the kernel name, row 2 the header, then one
row per SASS instruction with its "# Samples", "Instructions Executed" and ``stall_*`` sample
counts) and prints, per file, each opcode's share of the stall samples and of the executed warp
instructions and its three largest stall reasons. Two files side by side show where a variant's
time moved (BENCHMARKS.md, session of 2026-11-30 23:26: v2's waits moved from the loop's back edge
to the IMMAs). Runs anywhere (no GPU): the CSVs come back from the device call.

Usage: python tools/device/ncu_src_summary.py OUT/ncu_src_new.csv OUT/ncu_src_old.csv [--top 10]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from dataclasses import dataclass, field

_PREDICATE = re.compile(r"^@!?U?P[0-9T]+\s+")


@dataclass
class OpcodeStats:
    """Totals of one opcode (the mnemonic before its first '.') over a kernel's instructions."""

    samples: float = 0.0
    executed: float = 0.0
    stalls: collections.Counter = field(default_factory=collections.Counter)


def opcode(source: str) -> str:
    """'@!P0 LDG.E.64.CONSTANT R4, ...' -> 'LDG' (predicate and modifiers dropped)."""
    text = _PREDICATE.sub("", source.strip())
    return text.split(" ", 1)[0].split(".", 1)[0] if text else ""


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def summarize(path: str) -> tuple[str, dict[str, OpcodeStats]]:
    """(kernel name, opcode -> OpcodeStats) of one ncu_src CSV. Raises ValueError naming the file
    when the header lacks the columns used ("Source", "# Samples", "Instructions Executed")."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path}: expected a kernel-name row and a header row, got {len(rows)} rows")
    kernel = rows[0][1] if len(rows[0]) > 1 else rows[0][0]
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    for need in ("Source", "# Samples", "Instructions Executed"):
        if need not in col:
            raise ValueError(f"{path}: header has no column {need!r}")
    stall_cols = [(name[len("stall_"):], i) for name, i in col.items()
                  if name.startswith("stall_") and "Not Issued" not in name]
    stats: dict[str, OpcodeStats] = collections.defaultdict(OpcodeStats)
    for row in rows[2:]:
        if len(row) < len(header):
            continue  # a trailing blank or partial row
        st = stats[opcode(row[col["Source"]])]
        st.samples += _number(row[col["# Samples"]])
        st.executed += _number(row[col["Instructions Executed"]])
        for reason, i in stall_cols:
            st.stalls[reason] += _number(row[i])
    return kernel, dict(stats)


def report(path: str, top: int) -> list[str]:
    """Text lines: the kernel, totals, then the `top` opcodes by stall samples."""
    kernel, stats = summarize(path)
    samples = sum(s.samples for s in stats.values()) or 1.0
    executed = sum(s.executed for s in stats.values()) or 1.0
    lines = [f"{path}: {kernel}", f"  {samples:.0f} stall samples, {executed:.0f} warp instructions executed",
             "  opcode   samples  instr   largest stall reasons (% of all samples)"]
    for op, st in sorted(stats.items(), key=lambda kv: -kv[1].samples)[:top]:
        why = ", ".join(f"{r} {v / samples * 100:.1f}" for r, v in st.stalls.most_common(3) if v > 0)
        lines.append(f"  {op or '?':8s} {st.samples / samples * 100:6.1f}% {st.executed / executed * 100:5.1f}%   {why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="ncu_src_NAME.csv files (gemv_sweep.sh NCU_SOURCE=1)")
    ap.add_argument("--top", type=int, default=10, help="opcodes shown per file (default 10)")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error("--top must be at least 1")
    for path in args.csv:
        try:
            print("\n".join(report(path, args.top)))
        except (OSError, ValueError) as e:
            print(f"ncu_src_summary: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
