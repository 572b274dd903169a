#!/usr/bin/env python3
"""GPU target benchmark on a 27B-shaped random qwen35 GGUF (issue 7; run on the H200).

Measures, in one process, with ``Qwen35Model(weights, device="cuda")``:
* device-to-device copy bandwidth (torch, the physical reference of this run);
* device memory taken by the weights, and per sequence (KV cache per token, GDN + conv state);
* plain greedy decode tok/s (``Qwen35Model.step``: the service's plain step, states committed in place), and
  the same steps as a one-row verify + commit (``decode_verify_commit_tok_s``; ``first_verify_commit``: the
  first such step of a sequence, which captures its graphs, and of a later sequence on the released state
  slot, which replays them), against
  the ceiling copy bandwidth / bytes streamed per token (every weight byte except the embedding table,
  of which one row is read); with CUDA graphs on (the default) also the same decode op by op;
* chain verify step time at widths 1..17 (``verify`` without committing; without ``--capture-layers``
  the model has no capture layers, so no feature rows are computed or copied; with them every commit,
  prefill chunks included, copies its rows into the sequence's host feature ring, as in the
  service); with ``--profile-verify W ...``: where the time of a verify of W rows goes, per GPU
  kernel (N verifies, N from ``--profile``, else 4);
* with ``--profile N``: where the time of N plain decode steps goes, per GPU kernel (torch.profiler's
  CUPTI trace, which sees the library's kernels, graph-launched ones included);
* with ``--decode-context N ...``: plain decode tok/s after a prompt of N tokens (long-context decode,
  where each step's attention reads N keys per attention layer);
* prefill tok/s at 128 / 512 / 2048 / 8192 prompt tokens: the median of 3 runs after a first (cold) one,
  reported apart (longer lengths skipped once one takes > 60 s; one run only above 20 s);
  with ``--profile-prefill N``: where the time of one prefill of N tokens goes, per GPU kernel, on the
  host (cProfile), and where the GPU idles (gaps between its work, the host CUDA calls during them);
* an in-process speculative loop with a scripted drafter at acceptance lengths 3, 5 and 7: each step
  verifies the anchor + 7 drafts whose first AL - 1 are the target's own greedy continuation and
  the rest wrong, then commits AL tokens; tokens/s and the speedup over plain decode; with
  ``--profile-commit AL ...``: where the time of a commit of AL of those 8 rows goes, per GPU kernel (N steps before
  the timed ones, on a continuation N * 8 tokens longer); AL 8 (every draft right: the commit of a whole chain,
  a copy of the verify's states) also runs the loop at AL 8. (In-process:
  no gRPC, so this is the model-side loop; tools/bench/loop_overhead.py measures the service.)

Usage: python tools/bench/gpu_decode.py --gguf /tmp/r27.gguf [--mix iq4xs] [--out DIR]
(the GGUF is written by tools/bench/random_qwen35.py first when it does not exist).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def copy_bandwidth() -> float | None:
    """Device-to-device copy GB/s (read + write) of tools/device/gpu_report.py (the same number its
    reports use as the ceiling), None without torch."""
    sys.path.insert(0, str(HERE.parent / "device"))
    import gpu_report
    c = gpu_report.copy_bandwidth()
    return c["GBps"] if c else None


def device_used_bytes() -> int | None:
    try:
        import torch
        free, total = torch.cuda.mem_get_info()
        return int(total - free)
    except Exception:  # noqa: BLE001 - torch absent or no device: not reported
        return None


def streamed_bytes(reader) -> tuple[int, int]:
    """(bytes read per decode token, total weight bytes) from the GGUF's tensor table."""
    total = sum(int(t.n_bytes) for t in reader.tensors)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return total - int(emb.n_bytes) + int(emb.n_bytes) // int(emb.shape[1]), total


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--mix", default="iq4xs", help="random_qwen35 mix (when the GGUF is generated)")
    ap.add_argument("--config", default="27b", help="random_qwen35 config (when the GGUF is generated)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512, 2048, 8192])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N plain decode steps per GPU kernel (0: off)")
    ap.add_argument("--profile-verify", type=int, nargs="+", default=[], metavar="W",
                    help="profile verifies of W rows (1..16) per GPU kernel, as many as --profile's steps (else 4)")
    ap.add_argument("--profile-commit", type=int, nargs="+", default=[], metavar="AL", choices=(3, 5, 7, 8),
                    help="profile the scripted loop's commits at acceptance length AL (3, 5, 7; 8: a whole chain, "
                         "also looped) per GPU kernel, as many as --profile's steps (else 4)")
    ap.add_argument("--decode-context", type=int, nargs="*", default=[], metavar="N",
                    help="also plain decode tok/s after a prompt of N tokens (the attention then reads N keys "
                         "per layer; e.g. 8192 32768)")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                    help="profile one prefill of N prompt tokens per GPU kernel, after a warm-up prefill (0: off)")
    ap.add_argument("--prefill-chunks", type=int, nargs="*", default=[], metavar="C",
                    help="also time the --prefill lengths with prefill chunks of C tokens (Qwen35Model.prefill_chunk; the "
                         "main table uses the model's default, 2048; e.g. 512 for the A/B)")
    ap.add_argument("--capture-layers", type=int, nargs="*", default=[], metavar="L",
                    help="the target's capture layers (default none: no feature rows are computed or copied); e.g. "
                         "1 16 31 46 61, the 27B DFlash drafter's taps: every commit (prefill chunks, the loop's "
                         "steps) then copies its rows into the sequence's host feature ring, as the service does")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="replay chain verifies of <= 16 rows as CUDA graphs (default on)")
    args = ap.parse_args(argv)
    if any(c <= 0 for c in args.prefill_chunks):
        ap.error("--prefill-chunks: each chunk must be > 0 tokens")
    if any(not 1 <= w <= 16 for w in args.profile_verify) or len(set(args.profile_verify)) != len(args.profile_verify):
        ap.error("--profile-verify: distinct widths in 1..16 (the CUDA-graph verify widths)")
    if args.device != "cuda" and (args.profile or args.profile_verify or args.profile_commit or args.profile_prefill):
        ap.error("--profile, --profile-verify, --profile-commit and --profile-prefill profile GPU kernels: --device cuda")

    import random_qwen35
    import specd.native as sn
    from specd.target_worker.gguf_loader import load_qwen35, open_gguf
    from specd.target_worker.model import Qwen35Model

    rep: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gguf": args.gguf, "mix": args.mix, "config": args.config,
                 "capture_layers": list(args.capture_layers),
                 "device": sn.gpu_device_name() if args.device == "cuda" else "cpu"}
    if args.mix not in random_qwen35.MIXES or args.config not in random_qwen35.CONFIGS:
        ap.error(f"--mix must be one of {random_qwen35.MIXES}, --config one of {sorted(random_qwen35.CONFIGS)}")
    if not os.path.exists(args.gguf):
        rep["generate"] = random_qwen35.write(args.gguf, args.config, args.mix)
        print("generated", rep["generate"], flush=True)
    sync = sn.gpu_synchronize if args.device == "cuda" else (lambda: None)
    rep["copy_GBps"] = copy_bandwidth() if args.device == "cuda" else None
    per_token, total = streamed_bytes(open_gguf(args.gguf))
    rep["weight_bytes"], rep["streamed_bytes_per_token"] = total, per_token
    used0 = device_used_bytes()
    t0 = time.perf_counter()
    model = Qwen35Model(load_qwen35(args.gguf), device=args.device, cuda_graphs=args.cuda_graphs,
                        capture_layers=tuple(args.capture_layers))
    sync()
    rep["load_s"] = time.perf_counter() - t0
    used1 = device_used_bytes()
    rep["device_bytes_weights"] = None if used0 is None else used1 - used0
    print(json.dumps(rep), flush=True)

    rng = np.random.default_rng(0)
    vocab = model.hp.n_vocab
    prompt = rng.integers(0, vocab, 16).tolist()
    st = model.new_sequence(4096)
    used2 = device_used_bytes()
    rep["device_bytes_sequence_4096"] = None if used1 is None else used2 - used1
    logits = model.prefill(st, prompt)
    tok = int(np.argmax(logits))
    model.decode(st, tok)  # warm-up

    def run_decode():  # as the service decodes greedily: one plain step (Qwen35Model.step), its argmax next
        nonlocal tok
        for _ in range(args.decode_tokens):
            tok = model.step(st, tok)

    t = timed(run_decode, sync)
    rep["decode_tok_s"] = args.decode_tokens / t
    # The same steps as one-row verify + commit (the spec loop's kind of step), on a second sequence so
    # that the first keeps the positions the measurements below have always used.
    st2 = model.new_sequence(4096)
    tok2 = int(np.argmax(model.prefill(st2, prompt)))

    def run_verify_commit(n=args.decode_tokens):
        nonlocal tok2
        for _ in range(n):
            res = model.verify(st2, [tok2])
            model.commit(st2, res, 1)
            tok2 = int(res.argmax[0])
    # the first step captures its graphs (verify, then commit); a later request whose sequence takes the
    # released state slot replays them (Qwen35Model slot_cache): its first step's time, for comparison
    first = {"new_slot_ms": 1e3 * timed(lambda: run_verify_commit(1), sync)}
    run_verify_commit()  # warm-up
    rep["decode_verify_commit_tok_s"] = args.decode_tokens / timed(run_verify_commit, sync)
    model.release(st2)
    if model.cuda_graphs:  # (without graphs nothing is captured, and release frees the slot)
        st2 = model.new_sequence(4096)
        tok2 = int(np.argmax(model.prefill(st2, prompt)))
        first["reused_slot_ms"] = 1e3 * timed(lambda: run_verify_commit(1), sync)
    first["steady_ms"] = 1e3 / rep["decode_verify_commit_tok_s"]
    rep["first_verify_commit"] = first
    model.release(st2)
    if rep["copy_GBps"]:
        rep["decode_ceiling_tok_s"] = rep["copy_GBps"] * 1e9 / per_token
        rep["decode_ratio_to_ceiling"] = rep["decode_tok_s"] / rep["decode_ceiling_tok_s"]
    if model.cuda_graphs:  # the same decode op by op from Python, for the ratio
        model.cuda_graphs = False
        rep["decode_eager_tok_s"] = args.decode_tokens / timed(run_decode, sync)
        model.cuda_graphs = True
    print("decode", rep["decode_tok_s"], "as verify + commit", rep["decode_verify_commit_tok_s"], "eager",
          rep.get("decode_eager_tok_s"), "first verify + commit", json.dumps(rep["first_verify_commit"]), flush=True)

    if args.profile > 0:
        decode_tokens = args.decode_tokens
        args.decode_tokens = args.profile
        rep["profile"], rep["profile_steps"] = kernel_profile(run_decode, sync, args.profile), args.profile
        args.decode_tokens = decode_tokens
        print("profile", json.dumps(rep["profile"][:25]), flush=True)

    rep["verify_ms"] = {}
    for w in range(1, 18):
        toks = rng.integers(0, vocab, w).tolist()
        model.verify(st, toks)  # warm-up / shape
        ts = [timed(lambda: model.verify(st, toks), sync) for _ in range(5)]
        rep["verify_ms"][w] = 1e3 * float(np.median(ts))
    print("verify", rep["verify_ms"], flush=True)
    rep["verify_profile"] = {}
    for w in args.profile_verify:  # the kernels of one verify of w rows (as the spec loop's steps run them)
        toks, calls = rng.integers(0, vocab, w).tolist(), args.profile if args.profile > 0 else 4

        def run_verifies():
            for _ in range(calls):
                model.verify(st, toks)
        rep["verify_profile"][w] = {"calls": calls, "kernels": kernel_profile(run_verifies, sync, calls)}
        print("verify profile", w, json.dumps(rep["verify_profile"][w]["kernels"][:25]), flush=True)

    # scripted loop: the target's own continuation (computed here) with AL - 1 right drafts per step
    ref_st = model.new_sequence(4096)
    lg = model.prefill(ref_st, prompt)
    cont = [int(np.argmax(lg))]
    commit_calls = args.profile if args.profile > 0 else 4  # --profile-commit's steps, before the timed ones
    for _ in range(160 + (8 * commit_calls if args.profile_commit else 0)):
        cont.append(int(np.argmax(model.decode(ref_st, cont[-1]))))
    rep["loop"], rep["commit_profile"] = {}, {}
    for al in sorted({3, 5, 7} | set(args.profile_commit)):
        s = model.new_sequence(4096)
        model.prefill(s, prompt)
        pos, steps, mismatches = 0, 0, 0  # cont[pos] is the anchor (decided, not yet fed)

        def step(commit=lambda res: model.commit(s, res, al)):
            nonlocal pos, steps, mismatches
            drafts = cont[pos + 1:pos + al] + [(cont[pos + j] + 1) % vocab for j in range(al, 8)]
            res = model.verify(s, [cont[pos]] + drafts)
            # rows 0..al-1 must predict the greedy continuation (batch invariance: verify == decode)
            mismatches += int(list(res.argmax[:al]) != cont[pos + 1:pos + al + 1])
            commit(res)
            pos += al
            steps += 1

        step()  # untimed: captures this sequence's width-8 verify graph and its commit graph
        if al in args.profile_commit:  # a few steps whose commits alone are traced (on continuation added for them)
            events = []
            for _ in range(commit_calls):
                step(lambda res: events.extend(exclusive_times(trace(lambda: model.commit(s, res, al), sync)[0])))
            rep["commit_profile"][al] = {"calls": commit_calls, "kernels": summarise_kernels(events, commit_calls)}
            print("commit profile", al, json.dumps(rep["commit_profile"][al]["kernels"][:25]), flush=True)
        t0_pos, t0_steps = pos, steps

        def loop():
            while pos + 8 < len(cont):
                step()
        t = timed(loop, sync)
        rep["loop"][al] = {"tok_s": (pos - t0_pos) / t, "steps": steps - t0_steps,
                           "speedup": (pos - t0_pos) / t / rep["decode_tok_s"], "steps_not_matching_greedy": mismatches}
    print("loop", rep["loop"], flush=True)

    rep["prefill_tok_s"], rep["prefill_cold_tok_s"] = prefill_rates(model, args.prefill, rng, vocab, sync)
    rep["prefill_tok_s_by_chunk"] = {}
    default_chunk = model.prefill_chunk
    for c in args.prefill_chunks:  # each chunk dequantizes every weight once: smaller chunks pay it more often
        model.prefill_chunk = c
        rep["prefill_tok_s_by_chunk"][c] = prefill_rates(model, args.prefill, rng, vocab, sync)[0]
        print("prefill chunk", c, rep["prefill_tok_s_by_chunk"][c], flush=True)
    model.prefill_chunk = default_chunk
    rep["decode_at_context_tok_s"] = {}
    for n in args.decode_context:  # long-context decode: the attention's share grows with the keys read
        s = model.new_sequence(n + args.decode_tokens + 2)
        t_ctx = int(np.argmax(model.prefill(s, rng.integers(0, vocab, n).tolist())))
        t_ctx = model.step(s, t_ctx)  # warm-up (captures this slot's step graph)

        def run_at_context():
            nonlocal t_ctx
            for _ in range(args.decode_tokens):
                t_ctx = model.step(s, t_ctx)
        rep["decode_at_context_tok_s"][n] = args.decode_tokens / timed(run_at_context, sync)
        model.release(s)
        print("decode at context", n, rep["decode_at_context_tok_s"][n], flush=True)
    if args.profile_prefill > 0:
        n = args.profile_prefill
        toks = rng.integers(0, vocab, n).tolist()

        def run_prefill():
            s = model.new_sequence(n + 1)
            model.prefill(s, toks)
            model.release(s)
        run_prefill()  # warm-up (the first prefill of a length includes one-time allocations)
        rep["prefill_profile"], rep["prefill_profile_tokens"] = kernel_profile(run_prefill, sync, 1), n
        rep["prefill_host_profile"] = host_profile(run_prefill, sync)
        rep["prefill_gaps"] = gap_profile(run_prefill, sync)
        print("prefill gaps", json.dumps(rep["prefill_gaps"]), flush=True)
        print("prefill profile", json.dumps(rep["prefill_profile"][:25]), flush=True)
        print("prefill host profile", json.dumps(rep["prefill_host_profile"]), flush=True)

    os.makedirs(args.out, exist_ok=True)
    Path(args.out, f"gpu_decode_{args.mix}.json").write_text(json.dumps(rep, indent=1))
    print(markdown(rep))
    return 0


def prefill_rates(model, lengths, rng, vocab, sync) -> tuple[dict, dict]:
    """Prefill tok/s of random prompts of each length: ({n: median of 3 warm runs}, {n: the first run}).
    The first prefill of a length also pays one-time costs (cuBLAS heuristics and workspace, lazily
    loaded kernels, pool growth), so it is reported apart. Stops after a length whose run took > 60 s."""
    warm, cold = {}, {}
    for n in lengths:
        toks = rng.integers(0, vocab, n).tolist()

        def one():
            s = model.new_sequence(n + 1)
            t = timed(lambda: model.prefill(s, toks), sync)
            model.release(s)
            return t
        t = one()
        cold[n] = n / t
        warm[n] = n / t if t > 20 else n / float(np.median([one() for _ in range(3)]))
        print("prefill", n, warm[n], "cold", cold[n], flush=True)
        if t > 60:
            break
    return warm, cold


def kernel_profile(run, sync, steps: int) -> list[dict]:
    """GPU time per kernel over one call of ``run`` (``steps`` decode steps), from torch.profiler's
    CUPTI activity trace (it sees every kernel of the process, the native library's and graph-launched
    ones included); summarised by :func:`summarise_kernels`."""
    return summarise_kernels(exclusive_times(trace(run, sync)[0]), steps)


def kernel_times(run, sync, calls: int, digits: int = 1) -> tuple[float, str]:
    """(GPU us per call in all, "kernel us; ...") of ``calls`` calls made by one call of ``run``
    (:func:`kernel_profile`), for the kernel benchmarks' markdown rows (tools/device/*_bench.py)."""
    ks = kernel_profile(run, sync, calls)
    detail = "; ".join(f"{k['kernel'].split('(')[0]} {k['us_per_step']:.{digits}f}" for k in ks)
    return sum(k["us_per_step"] for k in ks), detail


def gap_profile(run, sync, top: int = 10) -> dict:
    """Where the GPU idles in one call of ``run``: the GPU's work (kernels, copies) and the host's CUDA
    API calls (launches, synchronisations, allocations), summarised by :func:`idle_gaps`. A gap that a
    synchronisation call overlaps is the host waiting for the GPU and then refilling its queue; a gap no
    call overlaps is host work (Python, numpy) slower than the GPU. (Not for CUDA-graph replays: under
    CUPTI a graph launch takes far longer than without it, so their gaps are the profiler's.)"""
    return idle_gaps(*trace(run, sync, host_calls=True), top)


def trace(run, sync, host_calls: bool = False) -> tuple[list, list]:
    """torch.profiler trace of one call of ``run``: (GPU spans, host CUDA API call spans), each sorted
    [(start us, end us, name)]; the second is empty unless ``host_calls``."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host_calls else [ProfilerActivity.CUDA]
    sync()
    with profile(activities=activities) as prof:
        run()
        sync()
    gpu, api = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end, e.name)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append(span)
        elif host_calls and e.name.startswith("cu"):  # cudaLaunchKernel, cudaStreamSynchronize, cuLaunchKernelEx, ...
            api.append(span)
    return sorted(gpu), sorted(api)


def idle_gaps(gpu: list[tuple[float, float, str]], api: list[tuple[float, float, str]], top: int = 10,
              min_us: float = 5.0) -> dict:
    """GPU spans [(start, end, name)] sorted by start, host API call spans likewise (microseconds) ->
    {"span_us": first start to last end, "busy_us", "idle_us", "gaps": {bucket: [count, us]} of the idle
    intervals of at least ``min_us`` ("5-20 us", "20-100 us", "0.1-1 ms", ">= 1 ms"), "top": the ``top``
    longest gaps as {us, before, after (short kernel names), api: {call: overlap us}}, "api": {call:
    [count, us]} over the whole run}."""
    out = {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": {}, "top": [], "api": {}}
    for a0, a1, name in api:
        slot = out["api"].setdefault(name, [0, 0.0])
        slot[0] += 1
        slot[1] += a1 - a0
    if not gpu:
        return out
    gaps, busy_from, busy_until, last = [], gpu[0][0], gpu[0][1], gpu[0][2]
    for start, end, name in gpu[1:]:
        if start > busy_until:
            out["busy_us"] += busy_until - busy_from
            if start - busy_until >= min_us:
                gaps.append((busy_until, start, last, name))
            busy_from = start
        if end >= busy_until:
            busy_until, last = end, name
    out["busy_us"] += busy_until - busy_from
    out["span_us"] = busy_until - gpu[0][0]
    out["idle_us"] = out["span_us"] - out["busy_us"]
    for lo, hi, label in ((min_us, 20, f"{min_us:g}-20 us"), (20, 100, "20-100 us"), (100, 1000, "0.1-1 ms"),
                          (1000, float("inf"), ">= 1 ms")):
        sel = [g1 - g0 for g0, g1, _, _ in gaps if lo <= g1 - g0 < hi]
        out["gaps"][label] = [len(sel), sum(sel)]
    for g0, g1, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        calls: dict[str, float] = {}
        for a0, a1, name in api:
            overlap = min(a1, g1) - max(a0, g0)
            if overlap > 0:
                calls[name] = calls.get(name, 0.0) + overlap
        out["top"].append({"us": g1 - g0, "before": short_kernel_name(before), "after": short_kernel_name(after),
                           "api": calls})
    return out


def host_profile(run, sync, top: int = 20) -> dict:
    """Where the host's time goes in one call of ``run`` (cProfile): the wall time, and the ``top``
    functions by own time (a native op's own time is its host side: argument checks, allocation,
    launches), each with calls and seconds. Tells a host-bound loop (GPU idle between launches)
    from a GPU-bound one when compared with :func:`kernel_profile`'s busy time."""
    import cProfile
    import pstats
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(((f"{os.path.basename(k[0])}:{k[2]}", v[1], v[2]) for k, v in stats.items()), key=lambda r: -r[2])
    return {"wall_s": wall, "top": [{"function": f, "calls": n, "own_s": t} for f, n, t in rows[:top]]}


def exclusive_times(spans: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """[(start, end, name)] sorted by start -> [(name, us)] where a kernel's time counts only from the
    end of every kernel that started before it. With programmatic dependent launch a kernel's blocks
    start while its predecessor runs and wait in griddepcontrol.wait, so its own span would also
    count that wait; this way the times add up to the busy time of the GPU, each interval once."""
    out, busy_until = [], float("-inf")
    for start, end, name in spans:
        out.append((name, max(0.0, end - max(start, busy_until))))
        busy_until = max(busy_until, end)
    return out


def short_kernel_name(name: str) -> str:
    """A demangled kernel name without ``void``, the argument list and the library's namespaces:
    ``void specd::gpu::(anonymous namespace)::rms_norm_kernel<4>(float const*, ...)`` ->
    ``rms_norm_kernel<4>``."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("(")[0]
    return name.replace("specd::gpu::detail::", "").replace("specd::gpu::", "").strip()


def summarise_kernels(events: list[tuple[str, float]], steps: int) -> list[dict]:
    """[(kernel name, microseconds)] of ``steps`` steps -> [{kernel, calls, us_per_step, share}] per
    short name, by time (share of the summed kernel time)."""
    per: dict[str, list] = {}
    for name, us in events:
        slot = per.setdefault(short_kernel_name(name), [0, 0.0])
        slot[0] += 1
        slot[1] += us
    total = sum(v[1] for v in per.values()) or 1.0
    rows = [{"kernel": k, "calls": v[0], "us_per_step": v[1] / steps, "share": v[1] / total} for k, v in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def kernel_table(what: str, per: str, kernels: list[dict], calls: int) -> list[str]:
    """Markdown lines of a per-kernel profile (summarise_kernels' rows of `calls` calls of the profiled run): the top
    15 kernels' launches and microseconds per call (`per` names the call in the header), and their shares."""
    return ["", f"GPU time {what} by kernel (top 15; torch.profiler CUPTI trace; a kernel's time counted from the end "
            "of the kernels before it):", "",
            f"| kernel | calls / {per} | us / {per} | share |", "| --- | --- | --- | --- |"] + [
        f"| `{k['kernel']}` | {k['calls'] / calls:.0f} | {k['us_per_step']:.0f} | {100 * k['share']:.1f} % |"
        for k in kernels[:15]]


def markdown(r: dict) -> str:
    gb = lambda b: f"{b / 2**30:.2f} GiB" if b is not None else "n/a"  # noqa: E731
    taps = r.get("capture_layers")
    L = [f"### Random {r['config']}-shaped qwen35, mix `{r['mix']}` on {r['device']} ({r['date']})", "",
         *([f"- capture layers {', '.join(map(str, taps))}: every commit copies its feature rows into the "
            "sequence's host ring"] if taps else []),
         f"- weights {gb(r['weight_bytes'])} in the file; on the device {gb(r.get('device_bytes_weights'))}; "
         f"one sequence of 4096 positions {gb(r.get('device_bytes_sequence_4096'))}; load {r['load_s']:.1f} s",
         f"- copy bandwidth {r['copy_GBps']:.0f} GB/s; bytes streamed per decode token "
         f"{r['streamed_bytes_per_token'] / 1e9:.2f} GB -> ceiling {r.get('decode_ceiling_tok_s', 0):.0f} tok/s"
         if r.get("copy_GBps") else "- copy bandwidth: n/a",
         f"- plain decode **{r['decode_tok_s']:.1f} tok/s**"
         + (f" ({r['decode_ratio_to_ceiling']:.2f} of the ceiling)" if r.get("decode_ratio_to_ceiling") else "")
         + (f"; as one-row verify + commit {r['decode_verify_commit_tok_s']:.1f} tok/s"
            if r.get("decode_verify_commit_tok_s") else "")
         + (f"; CUDA graphs on; op by op from Python {r['decode_eager_tok_s']:.1f} tok/s" if r.get("decode_eager_tok_s")
            else "")]
    fv = r.get("first_verify_commit")
    if fv:
        reused = (f"; on a released state slot (replays them) {fv['reused_slot_ms']:.1f} ms" if "reused_slot_ms" in fv
                  else "")
        L.append(f"- a sequence's first one-row verify + commit (captures its graphs) {fv['new_slot_ms']:.1f} ms"
                 f"{reused}; steady {fv['steady_ms']:.1f} ms")
    L += ["",
         "| verify width | " + " | ".join(str(w) for w in r["verify_ms"]) + " |",
         "| --- |" + " --- |" * len(r["verify_ms"]),
         "| ms | " + " | ".join(f"{v:.1f}" for v in r["verify_ms"].values()) + " |", "",
         "| prompt tokens | " + " | ".join(str(n) for n in r["prefill_tok_s"]) + " |",
         "| --- |" + " --- |" * len(r["prefill_tok_s"]),
         "| prefill tok/s (median of 3 warm) | " + " | ".join(f"{v:.0f}" for v in r["prefill_tok_s"].values()) + " |"]
    if r.get("prefill_cold_tok_s"):
        L.append("| first prefill of the length (cold) | "
                 + " | ".join(f"{v:.0f}" for v in r["prefill_cold_tok_s"].values()) + " |")
    for c, rates in r.get("prefill_tok_s_by_chunk", {}).items():
        L.append(f"| prefill tok/s, {c}-token chunks (median of 3 warm) | "
                 + " | ".join(f"{rates[n]:.0f}" if n in rates else "-" for n in r["prefill_tok_s"]) + " |")
    ctx = r.get("decode_at_context_tok_s")
    if ctx:
        L += ["", "| decode after a prompt of (tokens) | " + " | ".join(str(n) for n in ctx) + " |",
              "| --- |" + " --- |" * len(ctx),
              "| plain decode tok/s | " + " | ".join(f"{v:.1f}" for v in ctx.values()) + " |"]
    L += ["",
         "| scripted AL | tok/s | speedup vs plain |", "| --- | --- | --- |"]
    L += [f"| {al} | {v['tok_s']:.1f} | {v['speedup']:.2f}x |" for al, v in r["loop"].items()]
    if r.get("profile"):
        L += kernel_table("per plain decode step", "step", r["profile"], max(1, r.get("profile_steps", 1)))
    for w, vp in (r.get("verify_profile") or {}).items():
        L += kernel_table(f"per verify of {w} rows", "verify", vp["kernels"], vp["calls"])
    for al, cp in (r.get("commit_profile") or {}).items():
        L += kernel_table(f"per commit of {al} of a verify's 8 rows (the scripted loop)", "commit", cp["kernels"],
                          cp["calls"])
    if r.get("prefill_profile"):
        n = r["prefill_profile_tokens"]
        L += kernel_table(f"of one prefill of {n} tokens", "prefill", r["prefill_profile"], 1)
        busy = sum(k["us_per_step"] for k in r["prefill_profile"]) / 1e3
        hp = r.get("prefill_host_profile")
        if hp:
            L += ["", f"Host side of the same prefill (cProfile): wall {1e3 * hp['wall_s']:.1f} ms, GPU busy "
                  f"{busy:.1f} ms; top functions by own time:", "", "| function | calls | own ms |", "| --- | --- | --- |"]
            L += [f"| `{f['function']}` | {f['calls']} | {1e3 * f['own_s']:.1f} |" for f in hp["top"][:15]]
        gp = r.get("prefill_gaps")
        if gp:
            L += ["", f"GPU idle in the same prefill (torch.profiler, GPU work and host CUDA API calls): "
                  f"{gp['idle_us'] / 1e3:.1f} of {gp['span_us'] / 1e3:.1f} ms; gaps by length: "
                  + ", ".join(f"{k} {v[0]} ({v[1] / 1e3:.2f} ms)" for k, v in gp["gaps"].items()) + ".", "",
                  "| gap us | after kernel | before kernel | host API calls overlapping it (us) |",
                  "| --- | --- | --- | --- |"]
            L += [f"| {g['us']:.0f} | `{g['before']}` | `{g['after']}` | "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(g["api"].items(), key=lambda kv: -kv[1])) + " |"
                  for g in gp["top"]]
            api = sorted(gp["api"].items(), key=lambda kv: -kv[1][1])[:10]
            L += ["", "Host CUDA API calls of the prefill (top 10 by time): "
                  + ", ".join(f"`{k}` {v[0]} x, {v[1] / 1e3:.2f} ms" for k, v in api) + "."]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
