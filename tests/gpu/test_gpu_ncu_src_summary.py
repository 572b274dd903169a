"""tools/device/ncu_src_summary.py on a small table in Nsight Compute's per-instruction CSV layout
(no GPU needed: the tables come back from device calls)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "device"))
import ncu_src_summary as ns  # noqa: E402

HEADER = ['"Address"', '"Source"', '"# Samples"', '"Instructions Executed"', '"stall_long_sb"', '"stall_wait"',
          '"stall_long_sb (Not Issued)"']
ROWS = [
    ['"0x10"', '"  LDG.E.64.CONSTANT R4, desc[UR6][R2.64]"', '"10"', '"1,000"', '"2"', '"8"', '"99"'],
    ['"0x20"', '"  @!P0 LDG.E.128 R8, desc[UR6][R2.64]"', '"5"', '"500"', '"0"', '"5"', '"99"'],
    ['"0x30"', '"  IMMA.16832.S8.S8 R1, R2.ROW, R3.COL, RZ"', '"25"', '"500"', '"20"', '"5"', '"99"'],
    ['"0x40"', '"  @P1 BRA 0x10"', '"10"', '"0"', '"10"', '"0"', '"99"'],
]


def write(tmp_path, rows=ROWS, header=HEADER):
    p = tmp_path / "ncu_src_x.csv"
    lines = ['"Kernel Name","void k<3>(int)",'] + [",".join(header)] + [",".join(r) for r in rows] + [""]
    p.write_text("\n".join(lines))
    return str(p)


def test_opcodes_drop_predicates_and_modifiers():
    assert ns.opcode("  @!P0 LDG.E.64.CONSTANT R4, [R2]") == "LDG"
    assert ns.opcode("@UPT BRA 0x10") == "BRA"
    assert ns.opcode("IMMA.16832.S8.S8 R1, R2, R3, RZ") == "IMMA"
    assert ns.opcode("   ") == ""


def test_totals_per_opcode(tmp_path):
    kernel, stats = ns.summarize(write(tmp_path))
    assert kernel == "void k<3>(int)"
    assert set(stats) == {"LDG", "IMMA", "BRA"}
    assert stats["LDG"].samples == 15 and stats["LDG"].executed == 1500  # "1,000": thousands separator
    assert stats["LDG"].stalls == {"long_sb": 2, "wait": 13}  # "(Not Issued)" columns are not counted twice
    assert stats["IMMA"].stalls["long_sb"] == 20
    lines = ns.report(write(tmp_path), top=2)
    assert "50 stall samples" in lines[1]
    assert [ln.split()[:2] for ln in lines[3:]] == [["IMMA", "50.0%"], ["LDG", "30.0%"]]  # top 2 of 3


def test_bad_tables_name_the_file(tmp_path, capsys):
    p = write(tmp_path, header=[h for h in HEADER if h != '"# Samples"'])
    with pytest.raises(ValueError, match="# Samples"):
        ns.summarize(p)
    assert ns.main([p]) == 1 and "ncu_src_x.csv" in capsys.readouterr().err
    assert ns.main([str(tmp_path / "absent.csv")]) == 1
    with pytest.raises(SystemExit):
        ns.main([p, "--top", "0"])
