"""Spec-loop benchmark through the service: plain decode vs speculation at fixed acceptance lengths.

Runs the service's three parts as real processes over gRPC on a target GGUF: one target worker,
scripted drafter workers with the *oracle* drafter of performance.md §6.6 (it proposes the target's
own greedy continuation, computed here beforehand by a plain in-process run) and one coordinator per
drafter worker. Two shapes per acceptance length AL: "exact" proposes AL - 1 drafts, all right
(verify width = AL, nothing wasted); "block B" proposes B drafts of which the first AL - 1 are right
(verify width B + 1, as a real block drafter with rejections). For plain decode (speculation off) and
each AL it sends the same prompts and reports (plain decode twice: one target step per Verify call,
and plain runs of ``--plain-steps-per-call`` steps per call), from the final Generate message: decode tokens/s,
steps, worker calls per step, the workers' compute time and the loop overhead per step — both the
in-step overhead the coordinator accumulates (``Timing.loop_overhead_s``: step wall time around the
worker calls minus their compute) and the total (decode wall time minus worker compute: also the
coordinator's bookkeeping between steps and the client stream) — and the overhead share of the
step; then where the step's wall time outside the target's compute goes, from Timing's split of
decode_s: ``bookkeeping_s``, ``draft_wait_s``, the Verify calls outside the target's handler
(``verify_wall_s`` less ``target_handler_s``), the target's handler beyond its compute
(``target_handler_s`` less ``target_compute_s``), and the drafter's compute. Every run's tokens are
checked equal to the plain greedy ones.

Cost: the target is loaded once by the service (its worker starts while the reference runs) and
once here for the reference; every mode is a request option on the running service ("exact":
``max_draft_tokens`` on one oracle drafter with block max(AL) - 1; "block B": one scripted drafter
worker per AL, each behind its own coordinator, all sharing the one target worker; plain:
speculation off), and requests go through an in-process gRPC client (no CLI process per request).
Each coordinator and mode gets one short warm-up request first (CUDA graph capture of its widths).

Usage: python tools/bench/loop_overhead.py [--target models/demo-target.gguf] [--device cpu|cuda]
       [--tokens 128] [--al 3 5 7] [--block 8] [--plain-steps-per-call 8] [--no-worker-streams]
       [--no-ipc-streams] [--ipc-spin-us 0 [1000 1000:0 0:1000 ...]] [--capture-layers 1,16,31,46,61]
       [--write BENCHMARKS.md]
``--device cuda`` runs both the reference and the workers on the GPU (e.g. a random 27B-shaped GGUF of
tools/bench/random_qwen35.py, whose placeholder tokenizer encodes the prompts byte by byte).
``--no-worker-streams`` gives the coordinators ``--no-worker-streams`` (one unary Verify / Propose call
per step instead of one stream per sequence: the previous hot path, for comparison).
``--no-ipc-streams`` gives the coordinators ``--no-ipc-streams`` (per-sequence gRPC streams instead of
the workers' IPC stream sockets, the default hot path): run it with and without to A/B the two.
``--ipc-spin-us N [N ...]`` gives every process (the target worker, the drafter workers, the coordinators)
``--ipc-spin-us N`` (busy-poll before blocking for an IPC request or answer, specd.target_worker.ipc_stream);
a value ``W:C`` gives the workers W and the coordinators C (e.g. ``1000:0``: the workers' spin alone;
default ``auto:1000``, the service's defaults: the workers 1000 on a GPU and 0 on the CPU); a
suffix ``/fixed`` gives them ``--no-ipc-wake-ahead`` (spin
right after each request or answer only, not from shortly before the predicted one). With
several values the service is started once per value (the reference runs once) and each gets its table,
so spin on / off is compared in one call.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

PROMPTS = [
    'def read_config(path):\n    """Read a configuration file and',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "The gzip command compresses files. By default",
    "class Cache:\n    def __init__(self, capacity):\n",
]
START_TIMEOUT_S = 600  # a 27B GGUF loads in ~15 s per worker; the reference runs meanwhile


def greedy(model, ids, n):
    st = model.new_sequence(len(ids) + n + 1)
    tok = int(np.argmax(model.prefill(st, ids)))
    out = [tok]
    while len(out) < n:
        tok = int(np.argmax(model.decode(st, tok)))
        out.append(tok)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str]) -> subprocess.Popen:
    """Starts ``specd <argv>`` (stdout piped for its READY line, stderr passed through)."""
    return subprocess.Popen([sys.executable, "-m", "specd.coordinator.cli", *argv], stdout=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, what: str) -> None:
    """Reads ``proc``'s stdout until its READY line; RuntimeError when it exits or times out first."""
    deadline = time.time() + START_TIMEOUT_S
    for line in proc.stdout:
        if line.startswith("READY"):
            return
        if time.time() > deadline:
            break
    raise RuntimeError(f"{what} did not start (exit status {proc.poll()})")


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process (in order), then waits for each (kill after 30 s)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def generate(stub, ids, n, mode, max_draft=0):
    """One Generate of ``n`` tokens (EOS ignored); returns (the final GenerateComplete message, the
    number of chunks after the first: one per Verify call, since each call's tokens go out as one chunk)."""
    from specd.protos.v1 import generate_pb2 as gpb

    req = gpb.GenerateRequest(tokenized=gpb.TokenizedInput(input_ids=ids),
                              stopping=gpb.StoppingParams(max_tokens=n, ignore_eos=True))
    req.speculation.mode = {"off": gpb.SPECULATION_MODE_OFF, "force": gpb.SPECULATION_MODE_FORCE}[mode]
    if max_draft:
        req.speculation.max_draft_tokens = max_draft
    done, chunks = None, -1
    for r in stub.Generate(req):  # no deadline, like `specd generate` without --timeout-s
        if r.HasField("complete"):
            done = r.complete
        else:
            chunks += 1
    return done, chunks


def run_mode(stub, prompts, n, mode, max_draft=0):
    generate(stub, prompts[0], 8, mode, max_draft)  # warm-up (graph capture of this mode's widths)
    return [generate(stub, ids, n, mode, max_draft) for ids in prompts]


def summarise(label, results, reference):
    tok = steps = calls = 0
    decode = compute = overhead = target = handler = wait = verify = book = 0.0
    for (r, verifies), ref in zip(results, reference):
        ids = [int(t) for t in r.output_ids]
        assert ids == ref, f"{label}: output differs from plain greedy decoding"
        t = r.timing
        tok += int(r.usage.completion_tokens)
        steps += int(t.steps)
        calls += verifies + int(r.speculation.num_drafts)  # a Verify per chunk, a Propose per draft
        decode += float(t.decode_s)
        compute += float(t.worker_compute_s)
        overhead += float(t.loop_overhead_s)
        target += float(t.target_compute_s)
        handler += float(t.target_handler_s)
        wait += float(t.draft_wait_s)
        verify += float(t.verify_wall_s)
        book += float(t.bookkeeping_s)
    n = max(steps, 1)
    return dict(label=label, tokens=tok, steps=steps, tok_s=tok / decode if decode else 0.0,
                al=tok / n, calls=calls / n, overhead_ms=1e3 * overhead / n,
                total_ms=1e3 * (decode - compute) / n, overhead_share=(decode - compute) / decode if decode else 0.0,
                compute_ms=1e3 * compute / n, drafter_ms=1e3 * (compute - target) / n, wait_ms=1e3 * wait / n,
                outside_ms=1e3 * (verify - handler) / n if handler else None,
                handler_extra_ms=1e3 * (handler - target) / n if handler else None, book_ms=1e3 * book / n)


def spin_value(text: str) -> tuple[int, int, bool]:
    """An --ipc-spin-us value: "N" (every process) or "W:C" (W may be "auto": the workers' default,
    1000 us on a GPU, off on the CPU), optionally with "/fixed" (no wake-ahead) -> (workers' us or -1
    for auto, coordinators' us, wake-ahead)."""
    spins, _, how = text.partition("/")
    parts = spins.split(":")
    workers, coordinators = parts[0], parts[-1]
    auto = len(parts) == 2 and workers == "auto"
    if len(parts) > 2 or not coordinators.isdigit() or not (auto or workers.isdigit()) or how not in ("", "fixed"):
        raise argparse.ArgumentTypeError(f"expected N or W:C (microseconds >= 0, W also auto), optionally /fixed, "
                                         f"got {text!r}")
    return -1 if auto else int(workers), int(coordinators), not how


def spin_label(spin: tuple[int, int, bool]) -> str:
    workers = "auto" if spin[0] < 0 else str(spin[0])
    return (workers if spin[0] == spin[1] else f"{workers}:{spin[1]}") + ("" if spin[2] else "/fixed")


def wake_flag(spin: tuple[int, int, bool]) -> str:
    return "--ipc-wake-ahead" if spin[2] else "--no-ipc-wake-ahead"


def target_argv(args, run_dir: str, spin: tuple[int, int, bool]) -> list[str]:
    return ["target-worker", "--target", args.target, "--listen", f"unix://{run_dir}/target.sock",
            "--device", args.device, "--ipc-spin-us", str(spin[0]), wake_flag(spin)] + (
                ["--capture-layers", args.capture_layers] if args.capture_layers else [])


def reference_run(args):
    """(prompts as token ids, their plain greedy continuations of args.tokens tokens, vocabulary size)."""
    from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata
    from specd.target_worker.model import Qwen35Model
    from specd.target_worker.tokenizer import build_tokenizer

    weights = load_qwen35(args.target)
    tok = build_tokenizer(read_tokenizer_metadata(args.target), args.target)
    # the reference runs op by op (no CUDA graphs), so the service's graph-replayed output is checked
    # against an independent path
    model = Qwen35Model(weights, device=args.device, cuda_graphs=False)
    prompts = [tok.encode(p).ids for p in PROMPTS]
    reference = [greedy(model, ids, args.tokens) for ids in prompts]
    return prompts, reference, model.hp.n_vocab  # the model is freed on return (on the GPU this process's
    # pool keeps its blocks)


def service_run(args, run_dir: str, spin: tuple[int, int, bool], target: subprocess.Popen, cont: str, vocab: int,
                prompts, reference) -> list[dict]:
    """Starts the drafter workers and coordinators (``--ipc-spin-us`` spin[0] / spin[1], wake-ahead spin[2]) beside the
    started ``target`` worker, runs every mode and returns its rows; stops all of them, ``target`` too."""
    import grpc

    from specd.protos.v1 import generate_pb2_grpc as gpbg

    tsock = f"unix://{run_dir}/target.sock"
    procs: list[subprocess.Popen] = [target]  # stopped in reverse start order: coordinators, drafters, target
    channels = []
    try:
        wait_ready(target, "target-worker")
        # drafter workers: "exact" (block max(AL) - 1, every draft right; requests cap the drafts at
        # AL - 1) and one "block B" per AL (B drafts, the first AL - 1 right)
        shapes = [("exact", max(args.al) - 1, -1)] + [(f"block-{al}", args.block, al - 1) for al in args.al]
        drafters = {}
        for name, block, accept in shapes:
            dsock = f"unix://{run_dir}/draft-{name}.sock"
            drafters[name] = (dsock, launch(["draft-worker", "--listen", dsock, "--vocab", str(vocab),
                                             "--scripted-block", str(block), "--scripted-accept", str(accept),
                                             "--scripted-continuations", cont, "--device", args.device,
                                             "--ipc-spin-us", str(spin[0]), wake_flag(spin)]))
            procs.append(drafters[name][1])
        for name, (_, p) in drafters.items():
            wait_ready(p, f"draft-worker {name}")
        coords = {}
        # "plain-1": plain decode at one step per Verify call (the others run plain runs)
        for name, (dsock, _) in [("plain-1", drafters["exact"])] + list(drafters.items()):
            addr = f"127.0.0.1:{free_port()}"
            argv = ["coordinator", "--target", tsock, "--drafter", dsock, "--tokenizer", args.target,
                    "--listen", addr, "--metrics-port", "0", "--ipc-spin-us", str(spin[1]), wake_flag(spin),
                    "--plain-steps-per-call", "1" if name == "plain-1" else str(args.plain_steps_per_call)]
            argv += ["--no-worker-streams"] if args.no_worker_streams else []
            argv += ["--no-ipc-streams"] if args.no_ipc_streams else []
            coords[name] = (addr, launch(argv))
            procs.append(coords[name][1])
        stubs = {}
        for name, (addr, p) in coords.items():
            wait_ready(p, f"coordinator {name}")
            channels.append(grpc.insecure_channel(addr))
            stubs[name] = gpbg.SpecDecodeStub(channels[-1])

        rows = [summarise("plain (speculation off), 1 step per call",
                          run_mode(stubs["plain-1"], prompts, args.tokens, "off"), reference),
                summarise(f"plain (speculation off), {args.plain_steps_per_call} steps per call",
                          run_mode(stubs["exact"], prompts, args.tokens, "off"), reference)]
        for al in args.al:
            res = run_mode(stubs["exact"], prompts, args.tokens, "force", max_draft=al - 1)
            rows.append(summarise(f"oracle drafter, AL {al}, exact (width {al})", res, reference))
            res = run_mode(stubs[f"block-{al}"], prompts, args.tokens, "force")
            rows.append(summarise(f"oracle drafter, AL {al}, block {args.block} (width {args.block + 1})", res,
                                  reference))
        return rows
    finally:
        for ch in channels:
            ch.close()
        stop(list(reversed(procs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/demo-target.gguf")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--al", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--block", type=int, default=8, help="drafts per step of the 'block' rows (default 8)")
    ap.add_argument("--plain-steps-per-call", type=int, default=8,
                    help="the coordinators' --plain-steps-per-call (default 8); plain decode is also measured at 1")
    ap.add_argument("--no-worker-streams", action="store_true",
                    help="coordinators make one unary worker call per step (the previous hot path)")
    ap.add_argument("--no-ipc-streams", action="store_true",
                    help="coordinators use gRPC streams instead of the workers' IPC stream sockets (default: IPC)")
    ap.add_argument("--ipc-spin-us", type=spin_value, nargs="+", default=[(-1, 1000, True)], metavar="N|W:C[/fixed]",
                    help="--ipc-spin-us for every process, or W for the workers and C for the coordinators "
                         "(default auto:1000, the service's defaults; 0 = off); /fixed: --no-ipc-wake-ahead "
                         "(spin right "
                         "after each request or answer only); several values: one service run each")
    ap.add_argument("--capture-layers", default="", metavar="L1,L2,...",
                    help="the target worker's --capture-layers (default none: its feature rows are zeros and none "
                         "are copied); e.g. 1,16,31,46,61, the 27B DFlash drafter's taps, so that a real drafter's "
                         "rows travel through the feature ring (the target's copy out of the verify, the drafter's read)")
    ap.add_argument("--write", default="", help="append the markdown section to this file")
    args = ap.parse_args()
    if min(args.al) < 2 or args.block < max(args.al) - 1:
        ap.error("--al values must be >= 2 and --block >= max(--al) - 1")
    t_begin = time.perf_counter()
    # SIGTERM (e.g. `timeout` in gpu_bench.sh) exits through the finally below, which stops the servers
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    rt = tempfile.mkdtemp(prefix="specd-loop-")
    runs = []  # ((workers us, coordinators us, wake-ahead), rows) per service run
    try:
        reference = None
        for i, spin in enumerate(args.ipc_spin_us):
            run_dir = os.path.join(rt, f"run-{i}")
            os.makedirs(run_dir)
            if reference is None:  # the service's first target worker loads while the reference runs here
                target = launch(target_argv(args, run_dir, spin))
                try:
                    prompts, reference, vocab = reference_run(args)
                except BaseException:
                    stop([target])
                    raise
                cont = os.path.join(rt, "continuations.jsonl")
                with open(cont, "w") as f:
                    for ids, c in zip(prompts, reference):
                        f.write(json.dumps({"prompt": ids, "continuation": c}) + "\n")
            else:
                target = launch(target_argv(args, run_dir, spin))
            runs.append((spin, service_run(args, run_dir, spin, target, cont, vocab, prompts, reference)))
    finally:
        shutil.rmtree(rt, ignore_errors=True)
    wall = time.perf_counter() - t_begin
    if args.device == "cuda":
        import specd.native as sn
        where, hw = "the GPU", f"{sn.gpu_device_name()} ({sn.gpu_backend()}), {os.cpu_count()} host cores"
        cost = ("Both workers run on the GPU; worker compute is the target's verify, so the overhead columns are what "
                "the loop adds around the GPU work (gRPC, Python, policy, detokenisation).")
    else:
        where, hw = "the CPU", f"{platform.machine()} development VM, {os.cpu_count()} cores (shared)"
        cost = ("The 7.4 M-parameter demo target is dominated by per-op dispatch on this CPU, so a verify of 9 tokens "
                "costs only ~1.5-2x a decode; on a 27B target the verify is weight-bound instead (performance.md). "
                f"Load average during the run: {os.getloadavg()[0]:.1f} (treat single rows as +-30 %).")
    calls = ("one unary call per worker call" if args.no_worker_streams else
             f"one {'gRPC' if args.no_ipc_streams else 'IPC'} stream per sequence and worker")
    lines = [f"## Spec loop on {where}: loop overhead at fixed acceptance ({datetime.date.today()})", "",
             f"**Hardware.** {hw}. **Target.** `{args.target}`. **Command.** `python tools/bench/loop_overhead.py "
             f"--target {args.target} --device {args.device} --tokens {args.tokens} --al {' '.join(map(str, args.al))}"
             f" --plain-steps-per-call {args.plain_steps_per_call}"
             f"{f' --capture-layers {args.capture_layers}' if args.capture_layers else ''}"
             f"{' --no-worker-streams' if args.no_worker_streams else ''}"
             f"{' --no-ipc-streams' if args.no_ipc_streams else ''}"
             f" --ipc-spin-us {' '.join(map(spin_label, args.ipc_spin_us))}` ({wall:.0f} s wall). "
             f"{len(prompts)} prompts x {args.tokens} tokens, greedy, every run's tokens checked equal to plain greedy "
             "decoding. Real processes (unix sockets between coordinator and workers, "
             f"{calls}); the oracle drafter's own compute is ~0, so the numbers isolate the target and the loop. "
             "In-step overhead: step wall time around the worker calls minus their compute (Timing.loop_overhead_s); "
             f"total: decode wall time minus worker compute, per step (the share is of the latter). {cost}", "",
             "Plain decode runs at 1 and at --plain-steps-per-call target steps per Verify call (a plain run); "
             "\"vs plain\" is against the first row. Steps are target steps (a plain run counts each of its steps). "
             "`--ipc-spin-us N`: every process busy-polls up to N us for an IPC request or answer before blocking "
             "(0 = off; `W:C`: the workers W us, the coordinators C us), from half a window before the answer or "
             "request its stream's last ones predict when that is later (wake-ahead; `/fixed`: right after the "
             "request or answer only); one service run per value, in the order given.", ""]
    for spin, rows in runs:
        base = rows[0]["tok_s"]
        lines += [f"**--ipc-spin-us {spin_label(spin)}**", "",
                  "| mode | tokens/step (AL) | decode tok/s | vs plain | worker calls / step | worker compute / step "
                  "| in-step overhead / step | total overhead / step | overhead share |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {r['label']} | {r['al']:.2f} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | "
                         f"{r['calls']:.2f} | {r['compute_ms']:.2f} ms | {r['overhead_ms']:.2f} ms | "
                         f"{r['total_ms']:.2f} ms | {100 * r['overhead_share']:.1f} % |")
        lines += ["", "Where a step's wall time outside the target's compute goes (ms per step; Timing's split of "
                  "decode_s: bookkeeping = a verify's answer -> the next step's start, the next Propose sent early "
                  "among it; draft wait = step start -> the drafter's answer; the Verify call's wall time less the "
                  "target's compute, as the call outside the target's handler (the request built and sent, the "
                  "transport both ways, the worker's parsing and serialising, what the coordinator's event loop "
                  "runs meanwhile, a plain step's set-up) and the target's handler beyond its compute; n/a: the "
                  "target does not report its handler time). The drafter's own compute is part of the first two "
                  "(it runs during the bookkeeping when the Propose went out early), so the first four sum to total "
                  "overhead + drafter compute.", "",
                  "| mode | bookkeeping | draft wait | verify outside the handler | target handler beyond compute "
                  "| drafter compute |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            outside, extra = (("n/a", "n/a") if r["outside_ms"] is None else
                              (f"{r['outside_ms']:.3f}", f"{r['handler_extra_ms']:.3f}"))
            lines.append(f"| {r['label']} | {r['book_ms']:.3f} | {r['wait_ms']:.3f} | {outside} | {extra} | "
                         f"{r['drafter_ms']:.3f} |")
        lines.append("")
    if len(runs) > 1:  # the in-step overhead per step side by side (ms; total overhead in parentheses)
        lines += ["**In-step overhead per step by --ipc-spin-us** (ms; total overhead per step in parentheses)", "",
                  "| mode | " + " | ".join(f"spin {spin_label(spin)} us" for spin, _ in runs) + " |",
                  "| --- |" + " --- |" * len(runs)]
        for k, r in enumerate(runs[0][1]):
            lines.append(f"| {r['label']} | " + " | ".join(f"{rows[k]['overhead_ms']:.3f} ({rows[k]['total_ms']:.3f})"
                                                         for _, rows in runs) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        with open(args.write, "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
