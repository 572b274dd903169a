"""Smoke test of the demo-drafter CPU benchmark (tools/bench/demo_drafters.py): one code prompt, 16
tokens, the DFlash drafter only (one `specd serve`, ~10 s on 2 cores; the subprocess is capped at
60 s). Checks the JSON structure and that every config's tokens equal plain decoding."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .script_run import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "demo_drafters.py"
NEEDED = [ROOT / "models" / "demo-target.gguf", ROOT / "models" / "demo-dflash.gguf",
          ROOT / "tools" / "bench" / "demo_prompts.jsonl"]


def test_demo_bench_smoke(tmp_path):
    missing = [str(p) for p in NEEDED if not p.is_file()]
    if missing:
        pytest.skip(f"missing {missing}")
    out = tmp_path / "bench.json"
    md = tmp_path / "B.md"
    md.write_text("# B\n\n## Other section\n\nkeep me\n", encoding="utf-8")
    cmd = [sys.executable, str(SCRIPT), "--limit-prompts", "1", "--max-tokens", "16", "--drafters", "dflash",
           "--kinds", "code", "--json", str(out), "--write", str(md)]
    run_script(cmd, timeout=120)
    res = json.loads(out.read_text(encoding="utf-8"))
    assert res["lossless"] is True and res["mismatches"] == []
    assert res["n_prompts"] == 1 and res["kinds"] == ["code"] and res["max_tokens"] == 16
    configs = [(r["drafter"], r["config"]) for r in res["rows"]]
    assert configs == [("(target only)", "plain"), ("dflash", "chain FORCE"), ("dflash", "chain AUTO"),
                       ("dflash", "tree FORCE"), ("dflash", "tree AUTO")]
    for r in res["rows"]:
        assert r["error"] is None, r
        for k in ("code", "all"):
            a = r["by_kind"][k]
            assert a["completion_tokens"] == 16 and a["requests"] == 1
            assert a["tok_s"] > 0 and 0.0 <= a["spec_share"] <= 1.0
            assert r["speedup"][k] > 0
    force = res["rows"][1]["by_kind"]["all"]
    assert force["num_drafts"] > 0 and force["al"] >= 1.0
    assert force["al"] == pytest.approx(1 + force["num_accepted_tokens"] / force["num_drafts"])
    assert res["rows"][0]["by_kind"]["all"]["num_drafts"] == 0
    assert res["header"]["cores"] >= 1 and len(res["header"]["load_start"]) == 3
    assert res["target_eval"] and res["target_eval"]["code"] > 1.0
    assert res["samples"] and res["samples"][0]["kind"] == "code" and res["samples"][0]["completion"]
    assert len(res["runs"]["dflash"]["plain"]) == 1
    # the markdown section was added once, the other section kept; a second write replaces it
    text = md.read_text(encoding="utf-8")
    assert text.count("## Demo drafters on the CPU (issue 6)") == 1 and "keep me" in text
    from importlib import util
    spec = util.spec_from_file_location("demo_drafters", SCRIPT)
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_section(md, mod.SECTION + "\n\nreplaced\n")
    text2 = md.read_text(encoding="utf-8")
    assert text2.count(mod.SECTION) == 1 and "replaced" in text2 and "keep me" in text2
    assert "| dflash | chain FORCE |" not in text2
