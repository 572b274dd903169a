"""Demo drafters on the CPU (issue 6): acceptance length, tokens/s and speedup of the shipped demo
drafters on the held-out benchmark prompts.

For each drafter (models/demo-{dflash,dflash2,dspark}.gguf, trained on models/demo-target.gguf) one
``specd serve`` runs on loopback (coordinator + target worker + drafter worker, real processes over
gRPC). This script sends the requests itself, in-process over gRPC (the request is built by
``specd generate``'s own ``build_request``): per held-out prompt (tools/bench/demo_prompts.jsonl,
kinds code / prose / mixed; "chat" records are sent as a chat with enable_thinking=false) and per
config, ``--max-tokens`` greedy tokens with ignore_eos, so every config generates the same tokens:

  plain        speculation.mode OFF (measured on every server, interleaved with the others)
  chain FORCE  chain drafting every step (adaptive policy off)
  chain AUTO   chain drafting under the adaptive policy
  tree FORCE   DDTree drafting (server default budget) every step
  tree AUTO    DDTree under the adaptive policy

Per prompt the configs run back to back (plain first), so slow drifts of the machine's load hit
every config alike. A config the server rejects is reported "n/a" with the error. Every output is
checked token for token against the plain output of the same prompt (lossless); any mismatch makes
the exit status 1.

Metrics per config and prompt kind, pooled over prompts and repeats (sums, then ratios):
  AL        mean acceptance length = 1 + sum(num_accepted_tokens) / sum(num_drafts): tokens emitted per
            speculative step (accepted drafts + the bonus token), as SpeculationStats defines it;
            plain steps are not counted.
  tok/s     sum(completion_tokens) / sum(timing.decode_s).
  speedup   tok/s / tok/s of plain on the SAME server (interleaved, same conditions).
  spec      share of decode steps that speculated = sum(num_drafts) / sum(timing.steps).
  tok/step  sum(completion_tokens) / sum(timing.steps) (all steps, speculative and plain).

Usage: python tools/bench/demo_drafters.py [--drafters dflash dflash2 dspark] [--kinds code prose mixed]
       [--max-tokens 128] [--limit-prompts N] [--repeats 1] [--json out.json] [--write BENCHMARKS.md]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Demo drafters on the CPU (issue 6)"
KINDS = ("code", "prose", "mixed")
CONFIGS = [  # (label, speculation, draft_mode); plain first
    ("plain", "off", "default"),
    ("chain FORCE", "force", "chain"),
    ("chain AUTO", "auto", "chain"),
    ("tree FORCE", "force", "tree"),
    ("tree AUTO", "auto", "tree"),
]
EVAL_RESULTS = "tools/demo/eval_results.json"
DRAFTER_SUMMARY = "tools/demo/drafters_summary.json"


# --------------------------------------------------------------------------------------------- server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``specd serve`` subprocess; its output is drained by a thread (kept: the last 200 lines)."""

    def __init__(self, target: str, drafter: str, extra: list[str], start_timeout: float = 180.0):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "specd.coordinator.cli", "serve", "--target", target, "--drafter",
                    drafter, "--listen", self.address, "--metrics-port", "0", *extra]
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.ready = threading.Event()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=str(ROOT))
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()
        deadline = time.time() + start_timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                tail = "\n".join(list(self.lines)[-15:])
                raise RuntimeError(f"specd serve did not start ({' '.join(self.cmd)}):\n{tail}")

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("READY"):
                self.ready.set()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.reader.join(timeout=5)


# -------------------------------------------------------------------------------------------- requests

def request_args(prompt: dict, max_tokens: int, spec: str, draft_mode: str) -> list[str]:
    src = [f"--chat={prompt['chat']}", "--no-thinking"] if "chat" in prompt else [f"--prompt={prompt['prompt']}"]
    return src + ["--max-tokens", str(max_tokens), "--ignore-eos", "--speculation", spec, "--draft-mode", draft_mode]


class Client:
    def __init__(self, address: str, timeout_s: float):
        import grpc

        from specd.coordinator import client
        from specd.protos.v1 import generate_pb2_grpc as gpbg

        self.grpc, self.client, self.timeout_s = grpc, client, timeout_s
        self.parser = argparse.ArgumentParser(add_help=False)
        client.add_arguments(self.parser)
        self.channel = grpc.insecure_channel(address)
        self.stub = gpbg.SpecDecodeStub(self.channel)

    def generate(self, argv: list[str]):
        """The final GenerateComplete, or raises RuntimeError with the gRPC status."""
        req = self.client.build_request(self.parser.parse_args(argv))
        done = None
        try:
            for r in self.stub.Generate(req, timeout=self.timeout_s):
                if r.HasField("complete"):
                    done = r.complete
        except self.grpc.RpcError as exc:
            raise RuntimeError(f"{exc.code().name}: {exc.details()}") from None
        if done is None:
            raise RuntimeError("stream ended without a complete message")
        return done

    def close(self):
        self.channel.close()


def record(done, kind: str, idx: int, rep: int) -> dict:
    sp, t = done.speculation, done.timing
    return dict(prompt=idx, kind=kind, repeat=rep, completion_tokens=int(done.usage.completion_tokens),
                prompt_tokens=int(done.usage.prompt_tokens), finish=done.finish_reason,
                decode_s=float(t.decode_s), steps=int(t.steps), worker_compute_s=float(t.worker_compute_s),
                loop_overhead_s=float(t.loop_overhead_s), num_drafts=int(sp.num_drafts),
                num_draft_tokens=int(sp.num_draft_tokens), num_accepted_tokens=int(sp.num_accepted_tokens),
                num_plain_steps=int(sp.num_plain_steps), num_tree_steps=int(sp.num_tree_steps),
                policy_switches=len(sp.policy_switches), output_ids=[int(x) for x in done.output_ids])


def aggregate(runs: list[dict]) -> dict | None:
    if not runs:
        return None
    s = {k: sum(r[k] for r in runs) for k in ("completion_tokens", "decode_s", "steps", "num_drafts",
                                                "num_draft_tokens", "num_accepted_tokens", "num_plain_steps",
                                                "num_tree_steps", "worker_compute_s", "loop_overhead_s")}
    s["requests"] = len(runs)
    s["tok_s"] = s["completion_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
    s["al"] = 1.0 + s["num_accepted_tokens"] / s["num_drafts"] if s["num_drafts"] else None
    s["spec_share"] = s["num_drafts"] / s["steps"] if s["steps"] else 0.0
    s["tok_per_step"] = s["completion_tokens"] / s["steps"] if s["steps"] else 0.0
    s["ms_per_step"] = 1e3 * s["decode_s"] / s["steps"] if s["steps"] else 0.0
    return s


# ---------------------------------------------------------------------------------------------- header

def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        c = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return c + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def drafter_summaries(names: list[str]) -> tuple[dict, str]:
    """Training summaries per drafter: tools/demo/drafters_summary.json (a dict by family or a list of
    records with "family"), else the per-family summary.json of the local training output."""
    data = read_json(ROOT / DRAFTER_SUMMARY)
    out: dict = {}
    if isinstance(data, dict):
        out = {k: v for k, v in data.items() if isinstance(v, dict)}
        if "family" in data:
            out = {data["family"]: data}
    elif isinstance(data, list):
        out = {r["family"]: r for r in data if isinstance(r, dict) and "family" in r}
    if out:
        return out, DRAFTER_SUMMARY
    for n in names:
        d = read_json(ROOT / "build" / "demo-drafters-hf" / n / "summary.json")
        if isinstance(d, dict):
            out[n] = d
    return out, "build/demo-drafters-hf/<family>/summary.json (train_drafters.py output, not in git)"


# ---------------------------------------------------------------------------------------------- report

def fmt(x, spec, na="–"):
    return na if x is None else format(x, spec)


def render(res: dict) -> str:
    kinds = res["kinds"]
    h = res["header"]
    lines = [SECTION, ""]
    per_kind = ", ".join(f"{k} {res['prompts_per_kind'][k]}" for k in kinds)
    lines.append(
        f"**Date** {h['date']}. **Hardware** {h['cpu']}, {h['cores']} cores ({h['machine']}, shared development "
        f"VM); load average (1 min) {h['load_start'][0]:.2f} at start, {h['load_end'][0]:.2f} at end, "
        f"{h['load_mean']:.2f} mean / {h['load_max']:.2f} max during the run. "
        f"**Commit** `{h['commit']}`. **Command** `{h['command']}` ({h['wall_s']:.0f} s wall)."
        + " (The benchmark's own processes account for a load of about 1-1.5; "
        + ("more means other work shared the cores: single rows are noisy, see the per-server plain spread "
           "below.)" if h['load_max'] > 1.6 else "the machine was otherwise quiet.)"))
    lines.append("")
    lines.append(
        f"**Setup.** Target `{res['target']}`; one `specd serve` per drafter (coordinator + target worker + "
        f"drafter worker, real processes over gRPC, server defaults: DDTree budget 12, adaptive policy "
        f"defaults); requests sent in-process over gRPC. {res['n_prompts']} held-out prompts of "
        f"`tools/bench/demo_prompts.jsonl` ({per_kind}; "
        f"mixed = chat requests with thinking off) x {res['max_tokens']} greedy tokens (ignore_eos) x "
        f"{res['repeats']} repeat(s) per config; the five configs run back to back per prompt, after one "
        f"warm-up request per config. Every output was checked token for token against plain decoding: "
        + ("**all identical**." if not res["mismatches"] else
           f"**{len(res['mismatches'])} MISMATCHES** (see the JSON)."))
    lines.append("")
    lines.append(
        "**Metrics** (pooled over prompts: sums, then ratios). AL = 1 + accepted drafts / speculative "
        "steps (tokens per speculative step, bonus included; SpeculationStats' definition). tok/s = "
        "completion tokens / decode seconds. Speedup = tok/s over plain decoding on the same server, "
        "measured interleaved. Spec = share of decode steps that speculated (drafts / steps). "
        "Tok/step = completion tokens / all decode steps.")
    lines.append("")
    ev = res.get("target_eval")
    if ev:
        lines.append(
            f"**Target quality.** Held-out perplexity of `models/demo-target.gguf` (from `{EVAL_RESULTS}`: "
            f"`specd perplexity` method, ctx {ev.get('ctx')}, {ev.get('max_chunks')} chunks spread over each "
            f"held-out set, second halves scored): code **{ev['code']:.3f}** ± {ev['code_err']:.3f}, prose "
            f"**{ev['prose']:.3f}** ± {ev['prose_err']:.3f}.")
        lines.append("")
    ds = res.get("drafter_training") or {}
    if ds:
        lines.append(f"**Drafter training** (from {res['drafter_training_source']}): " + "; ".join(
            f"{n}: block {d.get('block_size')}, {d.get('params', 0) / 1e6:.2f} M params, {d.get('steps')} steps "
            f"in {d.get('train_s')} s, held-out block AL (training-time estimate) code "
            f"{d.get('heldout_block_al_code')} / prose {d.get('heldout_block_al_prose')}"
            for n, d in ds.items()) + ".")
        lines.append("")
    lines.append("All prompts:")
    lines.append("")
    lines.append("| drafter | config | AL | decode tok/s | speedup | spec steps | tok/step | ms/step |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in res["rows"]:
        a = row["by_kind"].get("all")
        if row.get("error"):
            lines.append(f"| {row['drafter']} | {row['config']} | n/a: {row['error'][:120]} | | | | | |")
            continue
        lines.append(f"| {row['drafter']} | {row['config']} | {fmt(a['al'], '.2f')} | {a['tok_s']:.1f} | "
                     f"{fmt(row['speedup'].get('all'), '.2f')}x | {100 * a['spec_share']:.0f} % | "
                     f"{a['tok_per_step']:.2f} | {a['ms_per_step']:.2f} |")
    lines.append("")
    lines.append("By prompt kind (AL / speedup):")
    lines.append("")
    lines.append("| drafter | config | " + " | ".join(f"{k} AL | {k} speedup" for k in kinds) + " |")
    lines.append("| --- | --- | " + " | ".join("--- | ---" for _ in kinds) + " |")
    for row in res["rows"]:
        if row.get("error"):
            lines.append(f"| {row['drafter']} | {row['config']} | " + " | ".join("n/a | n/a" for _ in kinds) + " |")
            continue
        cells = []
        for k in kinds:
            a = row["by_kind"].get(k)
            cells.append(f"{fmt(a and a['al'], '.2f')} | {fmt(row['speedup'].get(k), '.2f')}x")
        lines.append(f"| {row['drafter']} | {row['config']} | " + " | ".join(cells) + " |")
    lines.append("")
    if res.get("plain_per_server"):
        lines.append("Plain decode tok/s per server (the `plain` row pools them): " + ", ".join(
            f"{n} {v:.1f}" for n, v in res["plain_per_server"].items()) + ".")
        lines.append("")
    if res.get("samples"):
        lines.append("Samples of the target's plain greedy text (first 300 characters of the completion):")
        lines.append("")
        for s in res["samples"]:
            body = (s["prompt_tail"] + "⟦" + s["completion"][:300] + "⟧").replace("````", "'''")
            lines.append(f"[{s['kind']}, `{s['source']}`] prompt end ... ⟦completion⟧:")
            lines.append("")
            lines.append("````text")
            lines.append(body)
            lines.append("````")
            lines.append("")
    lines += derived_notes(res)
    return "\n".join(lines).rstrip() + "\n"


def derived_notes(res: dict) -> list[str]:
    """Observations computed from the rows (so a re-render from the JSON gives the same text)."""
    notes = list(res.get("notes") or [])
    rows = {(r["drafter"], r["config"]): r for r in res["rows"] if not r.get("error")}
    plain = rows.get(("(target only)", "plain"))
    out = []
    if plain:
        pm = plain["by_kind"]["all"]["ms_per_step"]
        cost = []
        for (d, c), r in rows.items():
            if c.endswith("FORCE"):
                cost.append(f"{d} {c.split()[0]} {r['by_kind']['all']['ms_per_step'] / pm:.1f}x")
        if cost:
            out.append(f"- A speculative step costs much more than a plain one here (ms/step of the FORCE rows over "
                       f"plain's {pm:.2f} ms: {', '.join(cost)}): the 7.4 M-parameter target is dispatch-bound on "
                       "this CPU, so the drafter forward and the second worker call cost about as much as the "
                       "target step itself, and speculation only pays off at AL well above 2-3.")
    auto = [(d, c, r["by_kind"]["all"]["spec_share"]) for (d, c), r in rows.items() if c.endswith("AUTO")]
    if auto:
        out.append("- The adaptive policy (AUTO) speculated on only " + ", ".join(
            f"{d} {c.split()[0]} {100 * sh:.0f} %" for d, c, sh in auto) + " of the steps: it measures the step "
            "times, sees the high cost of a speculative step and decodes plainly except in stretches of high "
            "acceptance (hence AUTO's AL is higher than FORCE's: it is the AL of the steps it chose to speculate). "
            "AUTO rows depend on measured timings and vary with load; FORCE rows' AL and tok/step are deterministic.")
    ds = res.get("drafter_training") or {}
    cmp = []
    for d, t in ds.items():
        r = rows.get((d, "chain FORCE"))
        if r and "code" in r["by_kind"] and "prose" in r["by_kind"]:
            cmp.append(f"{d} code {r['by_kind']['code']['al']:.2f} vs {t.get('heldout_block_al_code')}, prose "
                       f"{r['by_kind']['prose']['al']:.2f} vs {t.get('heldout_block_al_prose')}")
    if cmp:
        out.append("- Served chain FORCE AL vs the training-time held-out block AL estimate: " + "; ".join(cmp) + ".")
    if out:
        notes = notes + (["", "Notes:"] if notes else ["Notes:"]) + out
    return notes + [""] if notes else []


def write_section(path: Path, text: str):
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    lines = old.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.rstrip("\n") == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text if old else text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + rest if rest else "")
    path.write_text(new, encoding="utf-8")


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/demo-target.gguf")
    ap.add_argument("--drafters", nargs="+", default=["dflash", "dflash2", "dspark"],
                    help="NAME (models/demo-NAME.gguf) or NAME=PATH (default dflash dflash2 dspark)")
    ap.add_argument("--prompts", default="tools/bench/demo_prompts.jsonl")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--limit-prompts", type=int, default=0, help="at most N prompts per kind (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--serve-args", default="", help="extra `specd serve` flags (one shell-quoted string)")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--json", default="", help="write the raw results here")
    ap.add_argument("--write", default="", help="add/replace the markdown section in this file")
    ap.add_argument("--render-json", default="", help="only re-render the section from a --json file of an earlier run")
    args = ap.parse_args(argv)
    if args.render_json:
        res = json.loads(Path(args.render_json).read_text(encoding="utf-8"))
        text = render(res)
        print(text)
        if args.write:
            write_section(Path(args.write), text)
        return 1 if res.get("mismatches") else 0

    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)

    t_start = time.time()
    load_start = os.getloadavg()
    prompts = [json.loads(l) for l in (ROOT / args.prompts).read_text(encoding="utf-8").splitlines() if l.strip()]
    sel = []
    for k in args.kinds:
        ps = [p for p in prompts if p.get("kind") == k]
        sel += ps[:args.limit_prompts] if args.limit_prompts > 0 else ps
    if not sel:
        print("no prompts selected", file=sys.stderr)
        return 2
    drafters = []
    for d in args.drafters:
        name, _, path = d.partition("=")
        drafters.append((name, path or f"models/demo-{name}.gguf"))

    reference: dict[int, list[int]] = {}   # prompt index -> plain output ids (first server)
    mismatches: list[dict] = []
    raw: dict = {}
    rows: list[dict] = []
    samples: list[dict] = []
    plain_runs_all: list[dict] = []
    plain_per_server: dict[str, float] = {}
    notes: list[str] = []
    load_samples: list[float] = []
    labels = [c[0] for c in CONFIGS]

    for dname, dpath in drafters:
        print(f"[{dname}] starting specd serve ({dpath})", file=sys.stderr, flush=True)
        runs: dict[str, list[dict]] = {c: [] for c in labels}
        errors: dict[str, str] = {}
        server = client = None
        try:
            server = Server(args.target, dpath, shlex.split(args.serve_args))
            client = Client(server.address, args.request_timeout_s)
            # warm-up: one short request per config on the first prompt
            for label, spec, mode in CONFIGS:
                try:
                    client.generate(request_args(sel[0], 16, spec, mode))
                except RuntimeError as exc:
                    errors[label] = str(exc)
                    print(f"[{dname}] {label}: n/a ({exc})", file=sys.stderr, flush=True)
            for rep in range(args.repeats):
                for i, p in enumerate(sel):
                    for label, spec, mode in CONFIGS:
                        if label in errors:
                            continue
                        try:
                            done = client.generate(request_args(p, args.max_tokens, spec, mode))
                        except RuntimeError as exc:
                            errors[label] = f"prompt {i}: {exc}"
                            print(f"[{dname}] {label}: n/a ({exc})", file=sys.stderr, flush=True)
                            continue
                        r = record(done, p["kind"], i, rep)
                        runs[label].append(r)
                        if label == "plain":
                            if i not in reference:
                                reference[i] = r["output_ids"]
                                if p["kind"] in ("code", "prose") and not any(s["kind"] == p["kind"] for s in samples):
                                    text = p.get("prompt") or p.get("chat", "")
                                    samples.append(dict(kind=p["kind"], source=p.get("source", ""),
                                                        prompt_tail=text[-120:], completion=done.text))
                        ref = reference.get(i)
                        if ref is not None and r["output_ids"] != ref:
                            first = next((j for j, (a, b) in enumerate(zip(r["output_ids"], ref)) if a != b),
                                         min(len(ref), len(r["output_ids"])))
                            mismatches.append(dict(drafter=dname, config=label, prompt=i, repeat=rep,
                                                   first_diff=first, len=len(r["output_ids"]), ref_len=len(ref)))
                            print(f"[{dname}] {label}: prompt {i} DIFFERS from plain at token {first}",
                                  file=sys.stderr, flush=True)
                    load_samples.append(os.getloadavg()[0])
                    print(f"[{dname}] rep {rep} prompt {i + 1}/{len(sel)} done ({time.time() - t_start:.0f} s)",
                          file=sys.stderr, flush=True)
        except RuntimeError as exc:  # the server did not start
            for label in labels:
                errors.setdefault(label, str(exc).splitlines()[0])
            notes.append(f"- {dname}: {str(exc).splitlines()[0]}")
            print(f"[{dname}] {exc}", file=sys.stderr, flush=True)
        finally:
            if client is not None:
                client.close()
            if server is not None:
                server.stop()
        raw[dname] = {c: [{k: v for k, v in r.items() if k != "output_ids"} for r in runs[c]] for c in labels}
        raw[dname]["errors"] = errors
        plain_runs_all += runs["plain"]
        pa = aggregate(runs["plain"])
        if pa:
            plain_per_server[dname] = pa["tok_s"]
        for label in labels[1:]:
            row = dict(drafter=dname, config=label, error=errors.get(label), by_kind={}, speedup={})
            for k in list(args.kinds) + ["all"]:
                sub = [r for r in runs[label] if k == "all" or r["kind"] == k]
                psub = [r for r in runs["plain"] if k == "all" or r["kind"] == k]
                a, b = aggregate(sub), aggregate(psub)
                if a:
                    row["by_kind"][k] = a
                    row["speedup"][k] = a["tok_s"] / b["tok_s"] if b and b["tok_s"] else None
            if not row["by_kind"] and not row["error"]:
                row["error"] = "no results"
            rows.append(row)

    plain_row = dict(drafter="(target only)", config="plain", error=None if plain_runs_all else "no results",
                     by_kind={}, speedup={})
    for k in list(args.kinds) + ["all"]:
        a = aggregate([r for r in plain_runs_all if k == "all" or r["kind"] == k])
        if a:
            plain_row["by_kind"][k] = a
            plain_row["speedup"][k] = 1.0
    rows.insert(0, plain_row)

    ev = read_json(ROOT / EVAL_RESULTS)
    target_eval = None
    if isinstance(ev, dict) and "code" in ev and "prose" in ev:
        target_eval = dict(ctx=ev.get("ctx"), max_chunks=ev.get("max_chunks"),
                           code=ev["code"]["ppl_specd_gguf_f16"], code_err=ev["code"].get("stderr", 0.0),
                           prose=ev["prose"]["ppl_specd_gguf_f16"], prose_err=ev["prose"].get("stderr", 0.0))
    dsum, dsrc = drafter_summaries([d[0] for d in drafters])
    load_end = os.getloadavg()
    res = dict(
        header=dict(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), cpu=cpu_model(), cores=os.cpu_count(),
                    machine=platform.machine(), load_start=list(load_start), load_end=list(load_end),
                    load_mean=sum(load_samples) / len(load_samples) if load_samples else load_start[0],
                    load_max=max(load_samples, default=load_start[0]),
                    commit=git_commit(), wall_s=time.time() - t_start,
                    command="python tools/bench/demo_drafters.py " + " ".join(shlex.quote(a) for a in
                                                                              (argv if argv is not None else sys.argv[1:]))),
        target=args.target, drafters=dict(drafters), kinds=list(args.kinds), max_tokens=args.max_tokens,
        repeats=args.repeats, n_prompts=len(sel),
        prompts_per_kind={k: sum(1 for p in sel if p["kind"] == k) for k in args.kinds},
        lossless=not mismatches, mismatches=mismatches, target_eval=target_eval, drafter_training=dsum,
        drafter_training_source=dsrc, rows=rows, plain_per_server=plain_per_server, samples=samples,
        notes=notes, runs=raw)
    text = render(res)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    if args.write:
        write_section(Path(args.write), text)
    if mismatches:
        print(f"LOSSLESS CHECK FAILED: {len(mismatches)} outputs differ from plain decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
