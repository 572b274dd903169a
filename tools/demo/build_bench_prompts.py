#!/usr/bin/env python3
"""Fixed benchmark prompts from the demo corpus's HELD-OUT split (``tools/bench/demo_prompts.jsonl``).

Three kinds, ``--per-kind`` each (default 8), from held-out files only (never seen in training of the
target or the drafters), permissive licences only (the file ships in the repo):
* ``code``: the first ``--max-chars`` characters (cut at a line end) of held-out Python files
  (CPython standard library: PSF-2.0; PyPI sources: the distribution's permissive licence);
* ``prose``: the same from held-out PyPI READMEs and Debian docs / man pages whose package's
  licences (``corpus_manifest.json``) are all permissive;
* ``mixed``: chat requests rendered by the server's chat template: a user question about a held-out
  code file or command ("Show me the source code of the Python module `x`.", "What does `tar` do?")
  answered by the model, i.e. the chat path with an empty think block.
Each record: ``{"kind", "source", "licence", "prompt"}`` or, for mixed, ``"chat"`` instead of
``"prompt"``. Selection is deterministic: files in sorted ``src`` order, every n-th.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Licence names (SPDX ids and the spellings PyPI / Debian DEP-5 files use) accepted as permissive.
PERMISSIVE = re.compile(r"(mit(-0|/x11|-like)?( license)?|expat|x11|isc( license)?|zlib|unlicense|0bsd|cc0(-1\.0)?|"
                        r"public[- ]domain|permissive|fsfap|fsful|python( software foundation license)?|psf(-2\.0)?|"
                        r"bsd( license)?|bsd-[234]-clause( license)?|apache( software license| license)?( 2\.0|-2\.0)?)",
                        re.I)


def permissive(licence: str) -> bool:
    """True when every licence named in ``licence`` (split on ; , | and the words and / or / with)
    is a permissive one in full (no copyleft term anywhere; an empty string is not permissive)."""
    parts = [p.strip() for p in re.split(r"[;,|]|\b(?:and|or|with)\b", licence or "", flags=re.I) if p and p.strip()]
    return bool(parts) and all(PERMISSIVE.fullmatch(p) for p in parts)


def head(text: str, max_chars: int) -> str:
    cut = text[:max_chars]
    nl = cut.rfind("\n")
    return cut[: nl + 1] if nl > max_chars // 2 else cut


def pick(recs: list[dict], n: int) -> list[dict]:
    recs = sorted(recs, key=lambda r: r["src"])
    step = max(1, len(recs) // n)
    return recs[::step][:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="build/demo-corpus")
    ap.add_argument("--manifest", default=str(Path(__file__).with_name("corpus_manifest.json")))
    ap.add_argument("--out", default="tools/bench/demo_prompts.jsonl")
    ap.add_argument("--per-kind", type=int, default=8)
    ap.add_argument("--max-chars", type=int, default=600)
    args = ap.parse_args(argv)
    manifest = json.loads(Path(args.manifest).read_text())
    licences = {}
    for part in manifest["parts"].values():
        licences.update(part.get("licences", {}))
    held = [json.loads(line) for line in (Path(args.corpus) / "heldout.jsonl").open(encoding="utf-8")]

    def licence(r):
        if r["part"] == "code/cpython-stdlib":
            return "PSF-2.0"
        return licences.get(r["pkg"], "")

    ok = [r for r in held if permissive(licence(r)) and len(r["text"]) >= args.max_chars // 2]
    code = pick([r for r in ok if r["kind"] == "code"], 2 * args.per_kind)
    prose = pick([r for r in ok if r["kind"] == "prose"], args.per_kind)
    out = []
    for r in code[0::2]:
        out.append({"kind": "code", "source": f"{r['part']}:{r['src']}", "licence": licence(r),
                    "prompt": head(r["text"], args.max_chars)})
    for r in prose:
        out.append({"kind": "prose", "source": f"{r['part']}:{r['src']}", "licence": licence(r),
                    "prompt": head(r["text"], args.max_chars)})
    for r in code[1::2]:  # every other code pick becomes a chat request
        module = Path(r["src"]).with_suffix("").as_posix().split("/", 1)[-1].replace("/", ".")
        out.append({"kind": "mixed", "source": f"{r['part']}:{r['src']}", "licence": licence(r),
                    "chat": f"Show me the source code of the Python module `{module}`."})
    Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in out), encoding="utf-8")
    kinds = {k: sum(x["kind"] == k for x in out) for k in ("code", "prose", "mixed")}
    print(f"wrote {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
