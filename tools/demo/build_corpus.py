#!/usr/bin/env python3
"""Build the demo-model corpus from real text already installed on this machine.

Parts (provenance and licence are recorded per file/package in the manifest):

* ``code/cpython-stdlib``  -- the pure-Python standard library of the local CPython (``*.py`` under
  ``sysconfig.get_paths()['stdlib']``, minus site-packages and test suites). PSF-2.0.
* ``code/pypi-source``     -- ``*.py`` files (RECORD order, tests/vendored code skipped) of the installed
  PyPI distributions whose METADATA licence is permissive (MIT/BSD/Apache/PSF/ISC/...; no GPL).
* ``prose/pypi-readmes``   -- the long descriptions (README) in ``*.dist-info/METADATA`` of the
  PyPI distributions installed in site-packages; licence from each METADATA (License-Expression /
  License / classifiers).
* ``prose/debian-docs``    -- README/FAQ/*.md/*.rst/*.txt files under ``/usr/share/doc/<pkg>/``
  (changelogs and copyright files excluded), gz decompressed; licence = the ``License:`` short names
  of the package's DEP-5 ``/usr/share/doc/<pkg>/copyright``.
* ``prose/man-pages``      -- English man pages (``/usr/share/man/man[1-8]``), roff markup stripped
  by a small deterministic converter; package from dpkg's file lists, licence as above.

Determinism: every file list is sorted; text is normalised (UTF-8, ``\\r\\n`` -> ``\\n``, trailing
space stripped); exact duplicates (sha256 of the normalised text) are dropped keeping the first in
sorted order; the held-out split is by FILE: sha256("<part>:<source path>") mod 1000 < 50 (5 %).
With ``--pin MANIFEST`` (default: the committed manifest) only
the packages that manifest lists are read, so packages installed later leave the corpus unchanged.
Size caps (per part, and 1.5 M characters per package except for the stdlib) are applied in sorted order (deterministic). Outputs under ``--out`` (not in git):
``train.jsonl`` / ``heldout.jsonl`` (one {"part","src","pkg","text"} per file), ``heldout_code.txt`` and
``heldout_prose.txt`` (held-out files joined by blank lines, for ``specd perplexity``), and
``manifest.json`` (counts, bytes, sha256 of every file list and licence per package), which is also
copied to ``tools/demo/corpus_manifest.json`` (committed).
"""
from __future__ import annotations

import argparse
import email.parser
import gzip
import hashlib
import json
import re
import sys
import sysconfig
from pathlib import Path

HELDOUT_PER_MILLE = 50
MIN_CHARS = 200
MAX_PKG_CHARS = 1_500_000  # per (part, package): keeps e.g. google-cloud-cli's thousands of man pages in check
MAX_FILE_CHARS = 200_000  # a single file larger than this is truncated (keeps huge generated files in check)
PERMISSIVE_HINT = re.compile(r"MIT|BSD|Apache|PSF|Python Software|ISC|Expat|zlib|Unlicense|public domain|CC0|MPL",
                             re.I)


def norm(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [ln.rstrip() for ln in text.split("\n")]
    out = "\n".join(lines).strip("\n")
    out = re.sub(r"\n{4,}", "\n\n\n", out)
    return out[:MAX_FILE_CHARS]


def read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    if "\x00" in text:
        return None
    return text


def is_heldout(part: str, src: str) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{part}:{src}".encode()).digest()[:8], "big")
    return h % 1000 < HELDOUT_PER_MILLE


# ---------------------------------------------------------------------------------------------
# Debian package ownership and licences
# ---------------------------------------------------------------------------------------------

def dpkg_owner_map() -> dict[str, str]:
    owner = {}
    for lst in sorted(Path("/var/lib/dpkg/info").glob("*.list")):
        pkg = lst.stem.split(":")[0]
        for line in lst.read_text(encoding="utf-8", errors="replace").splitlines():
            owner.setdefault(line, pkg)
    return owner


_LIC_CACHE: dict[str, str] = {}


def debian_licence(pkg: str) -> str:
    if pkg in _LIC_CACHE:
        return _LIC_CACHE[pkg]
    cp = Path("/usr/share/doc") / pkg / "copyright"
    lic = "unknown (no copyright file)"
    if cp.is_file():
        text = cp.read_text(encoding="utf-8", errors="replace")
        names = sorted({m.group(1).strip() for m in re.finditer(r"^License:[ \t]*(\S[^\n]*)$", text, re.M)})
        lic = "; ".join(names) if names else f"see /usr/share/doc/{pkg}/copyright (not DEP-5)"
    _LIC_CACHE[pkg] = lic
    return lic


# ---------------------------------------------------------------------------------------------
# Part collectors: each yields (src, pkg, licence, text)
# ---------------------------------------------------------------------------------------------

def collect_stdlib():
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = re.compile(r"(^|/)(site-packages|dist-packages|test|tests|idle_test|__pycache__|lib2to3/tests)(/|$)")
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if skip.search(rel):
            continue
        text = read_text(p)
        if text:
            yield f"stdlib/{rel}", f"cpython-{sys.version.split()[0]}", "PSF-2.0", text


def collect_pypi_readmes():
    roots = sorted({Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])})
    seen = set()
    for root in roots:
        for meta in sorted(root.glob("*.dist-info/METADATA")):
            msg = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
            name, version = msg.get("Name", meta.parent.name), msg.get("Version", "?")
            if name.lower() in seen:
                continue
            seen.add(name.lower())
            body = msg.get_payload()
            if not isinstance(body, str) or not body.strip():
                body = msg.get("Description", "") or ""
            lic = msg.get("License-Expression") or ""
            if not lic:
                short = (msg.get("License") or "").strip().splitlines()
                lic = short[0][:80] if short else ""
            classifiers = [c.split("::")[-1].strip() for c in msg.get_all("Classifier", []) if c.startswith("License")]
            if classifiers:
                lic = (lic + " | " if lic else "") + ", ".join(classifiers)
            yield f"pypi/{name}-{version}/README", f"{name}=={version}", lic or "unknown (METADATA has none)", body


def _dist_licence(msg) -> str:
    lic = msg.get("License-Expression") or ""
    if not lic:
        short = (msg.get("License") or "").strip().splitlines()
        lic = short[0][:80] if short else ""
    classifiers = [c.split("::")[-1].strip() for c in msg.get_all("Classifier", []) if c.startswith("License")]
    if classifiers:
        lic = (lic + " | " if lic else "") + ", ".join(classifiers)
    return lic


def collect_pypi_code():
    """Python source of installed PyPI distributions whose METADATA names a permissive licence."""
    root = Path(sysconfig.get_paths()["purelib"])
    skip = re.compile(r"(^|/)(tests?|testing|_vendor|vendored|__pycache__)(/|$)")
    for meta in sorted(root.glob("*.dist-info/METADATA")):
        msg = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
        lic = _dist_licence(msg)
        if not lic or not PERMISSIVE_HINT.search(lic) or re.search(r"GPL", lic):
            continue
        name, version = msg.get("Name", meta.parent.name), msg.get("Version", "?")
        record = meta.parent / "RECORD"
        if not record.is_file():
            continue
        rels = sorted({ln.split(",")[0] for ln in record.read_text(encoding="utf-8", errors="replace").splitlines()})
        for rel in rels:
            if not rel.endswith(".py") or rel.startswith("..") or skip.search(rel):
                continue
            text = read_text(root / rel)
            if text:
                yield f"site-packages/{rel}", f"{name}=={version}", lic, text


DOC_NAME = re.compile(r"(readme|faq|\.md|\.markdown|\.rst|\.txt)(\.gz)?$", re.I)
DOC_SKIP = re.compile(r"(changelog|copyright|news|changes|license|licence|authors|thanks|todo)", re.I)


def collect_debian_docs(owner):
    root = Path("/usr/share/doc")
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.is_symlink():
            continue
        rel = p.relative_to(root).as_posix()
        if not DOC_NAME.search(p.name) or DOC_SKIP.search(p.name):
            continue
        text = read_text(p)
        if not text:
            continue
        pkg = owner.get(str(p), rel.split("/")[0])
        yield f"doc/{rel}", pkg, debian_licence(pkg), text


_ROFF_ESC = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""), (re.compile(r"\\s[+-]?\d"), ""),
    (re.compile(r"\\\((aq|cq)"), "'"), (re.compile(r"\\\((lq|rq|dq)"), '"'), (re.compile(r"\\\((em|en)"), "--"),
    (re.compile(r"\\\(bu"), "*"), (re.compile(r"\\\(co"), "(c)"), (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),
    (re.compile(r"\\\*\((..)|\\\*\[[^\]]*\]|\\\*."), ""), (re.compile(r"\\[-]"), "-"), (re.compile(r"\\[&|^:%]"), ""),
    (re.compile(r"\\e"), "\\\\"), (re.compile(r"\\ "), " "), (re.compile(r"\\c$"), ""), (re.compile(r"\\n\(..|\\n."), ""),
]


def roff_to_text(src: str) -> str | None:
    out, para = [], []

    def flush():
        if para:
            out.append(" ".join(para))
            para.clear()

    nofill = False
    for line in src.split("\n"):
        if line.startswith(".so ") or line.startswith("'so "):
            return None
        if line.startswith('.\\"') or line.startswith("'\\\"") or line.startswith('\\"'):
            continue
        if line.startswith(".") or line.startswith("'"):
            m = re.match(r"[.'](\S+)\s*(.*)", line)
            if not m:
                continue
            req, args = m.group(1), m.group(2)
            for rx, rep in _ROFF_ESC:
                args = rx.sub(rep, args)
            args = " ".join(a.strip('"') for a in re.findall(r'"[^"]*"|\S+', args))
            if req in ("SH", "SS"):
                flush()
                out.append("")
                out.append(args.upper() if req == "SH" else args)
            elif req in ("PP", "P", "LP", "sp", "br", "TP", "RS", "RE"):
                flush()
            elif req == "IP":
                flush()
                if args:
                    para.append(args.split(" ")[0])
            elif req in ("B", "I", "SM", "SB"):
                para.append(args)
            elif req in ("BR", "RB", "IR", "RI", "BI", "IB"):
                para.append("".join(args.split(" ")))
            elif req == "TH":
                out.append(args.split(" ")[0])
            elif req in ("nf", "EX"):
                flush()
                nofill = True
            elif req in ("fi", "EE"):
                nofill = False
            continue
        for rx, rep in _ROFF_ESC:
            line = rx.sub(rep, line)
        if nofill:
            flush()
            out.append(line)
        elif line.strip():
            para.append(line.strip())
        else:
            flush()
    flush()
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text


def collect_man_pages(owner):
    for sec in range(1, 9):
        d = Path(f"/usr/share/man/man{sec}")
        for p in sorted(d.glob("*")):
            if not p.is_file() or p.is_symlink():
                continue
            raw = read_text(p)
            if not raw:
                continue
            text = roff_to_text(raw)
            if not text:
                continue
            pkg = owner.get(str(p), "unknown")
            yield f"man/man{sec}/{p.name}", pkg, debian_licence(pkg), text


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="build/demo-corpus", help="output folder (not in git)")
    ap.add_argument("--max-mb", type=float, nargs=5, default=[16.0, 15.0, 6.0, 10.0, 28.0],
                    metavar=("STDLIB", "PYPICODE", "PYPIDOC", "DEBDOC", "MAN"),
                    help="per-part caps on kept characters (millions), applied in sorted order")
    ap.add_argument("--pin", default=str(Path(__file__).with_name("corpus_manifest.json")),
                    help="a previous manifest: keep only the packages (name==version for PyPI) it lists per part, "
                         "so packages installed later do not change the corpus ('' = take everything installed)")
    ap.add_argument("--manifest-copy", default=str(Path(__file__).with_name("corpus_manifest.json")))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    owner = dpkg_owner_map()
    parts = [
        ("code/cpython-stdlib", "code", collect_stdlib()),
        ("code/pypi-source", "code", collect_pypi_code()),
        ("prose/pypi-readmes", "prose", collect_pypi_readmes()),
        ("prose/debian-docs", "prose", collect_debian_docs(owner)),
        ("prose/man-pages", "prose", collect_man_pages(owner)),
    ]
    pins = None
    if args.pin and Path(args.pin).is_file():
        old = json.loads(Path(args.pin).read_text(encoding="utf-8"))
        pins = {part: set(v["licences"]) for part, v in old["parts"].items()}
    seen_hashes: set[str] = set()
    manifest = {"heldout_rule": f"sha256('<part>:<src>') mod 1000 < {HELDOUT_PER_MILLE}", "parts": {}}
    f_train = (out / "train.jsonl").open("w", encoding="utf-8")
    f_held = (out / "heldout.jsonl").open("w", encoding="utf-8")
    held_text = {"code": [], "prose": []}
    for (part, kind, gen), cap_mb in zip(parts, args.max_mb):
        cap = int(cap_mb * 1e6)
        kept_chars, files, dups, short, capped = 0, [], 0, 0, 0
        licences: dict[str, str] = {}
        per_pkg: dict[str, int] = {}
        for src, pkg, lic, text in gen:
            if pins is not None and pkg not in pins.get(part, ()):
                continue
            text = norm(text)
            if len(text) < MIN_CHARS:
                short += 1
                continue
            h = hashlib.sha256(text.encode()).hexdigest()
            if h in seen_hashes:
                dups += 1
                continue
            if kept_chars + len(text) > cap or (
                    part != "code/cpython-stdlib" and per_pkg.get(pkg, 0) + len(text) > MAX_PKG_CHARS):
                capped += 1
                continue
            seen_hashes.add(h)
            kept_chars += len(text)
            per_pkg[pkg] = per_pkg.get(pkg, 0) + len(text)
            held = is_heldout(part, src)
            rec = {"part": part, "kind": kind, "src": src, "pkg": pkg, "text": text}
            (f_held if held else f_train).write(json.dumps(rec, ensure_ascii=False) + "\n")
            if held:
                held_text[kind].append(text)
            files.append((src, h, held))
            licences.setdefault(pkg, lic)
        listing = "\n".join(f"{s}\t{h}\t{'heldout' if hd else 'train'}" for s, h, hd in files)
        manifest["parts"][part] = {
            "kind": kind, "files": len(files), "heldout_files": sum(hd for _, _, hd in files),
            "chars": kept_chars, "dropped_duplicates": dups, "dropped_short": short, "dropped_over_cap": capped,
            "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "packages": len(licences),
            "licences": dict(sorted(licences.items())),
        }
        (out / f"files-{part.replace('/', '_')}.tsv").write_text(listing + "\n", encoding="utf-8")
        print(f"{part:22s} files {len(files):6d} (held out {manifest['parts'][part]['heldout_files']:4d})  "
              f"chars {kept_chars/1e6:7.2f} M  dups {dups} short {short} over-cap {capped}", flush=True)
    f_train.close()
    f_held.close()
    for kind, texts in held_text.items():
        (out / f"heldout_{kind}.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
        manifest[f"heldout_{kind}_chars"] = sum(len(t) for t in texts)
    mtext = json.dumps(manifest, indent=1, ensure_ascii=False)
    (out / "manifest.json").write_text(mtext, encoding="utf-8")
    if args.manifest_copy:
        Path(args.manifest_copy).write_text(mtext, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
