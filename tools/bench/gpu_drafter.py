#!/usr/bin/env python3
"""GPU drafter benchmark: random DFlash / DSpark / DFlash 2 drafters in the published 27B shapes
against a random 27B-shaped qwen35 target (issue 7; run on the H200).

For each family (``--families``), in one process: the random drafter of
tools/bench/random_drafter.py is written next to the target (unless it exists) and opened exactly as
``specd draft-worker --drafter D --target T`` opens it (:func:`specd.draft_worker.engine.open_model_drafter`:
drafter loader, pair check, the target's ``token_embd`` / ``output`` bound and, on ``--device cuda``,
uploaded with the drafter weights), then measured:

* load time and device memory taken (torch's mem_get_info; None without torch);
* ingest: ``--context`` (default 512) committed positions of random N(0, 1) target features
  ([n, n_taps * H] float32, one call, as the first Ingest after a prefill) into a fresh sequence,
  median of ``--ingest-reps``;
* propose: one block, as the worker's Propose runs it by default (``ModelDrafter.propose`` with
  ``ProposeOptions(top_k=--top-k)``: the drafter forward over the block's rows, the lm_head over the
  proposal rows, then argmax (DFlash), the DSpark Markov chain (``--dspark-markov``, default fused)
  + confidence head, or the DFlash 2 candidate selector): median (and min) over ``--steps`` after
  ``--warmup``; the forward alone (``DraftSequence.forward_block``, always eager) too, so head =
  propose - forward for the eager propose (n/a when only the graph's is measured). ``--cuda-graphs`` (default ``both`` on cuda): the propose
  replayed as a CUDA graph (``propose_ms``, the worker's default) and the eager one
  (``propose_eager_ms``, ``DrafterModel.cuda_graphs`` switched off) are measured in the same run on
  the same sequence; ``on`` / ``off`` measure one of them (``off``: ``propose_ms`` is the eager one);
* the physical floor: bytes one propose must stream (every ``blk.*`` tensor + ``output_norm`` of the
  drafter, the target's lm_head once, DSpark's Markov W2 once per draft (one GEMV per chain step),
  DFlash 2's selector projection) / the device copy bandwidth (tools/device/gpu_report.py's, as
  gpu_decode.py); gathered rows (embedding, W1, codebooks) are not counted;
* the values: whether one block's logits and final hidden rows are finite, their std / RMS;
* with ``--profile N``: where N proposes' time goes, per GPU kernel (``--device cuda``: gpu_decode.py's
  CUPTI ``kernel_profile``, GPU busy time by kernel) and on the host (``host_profile``: wall time and the
  Python functions by own time), so a host-bound propose (GPU idle between launches) shows;
* with ``--verify-ms`` (one value) or ``--decode-json`` (gpu_decode.py's JSON: its ``verify_ms`` at
  the drafter's verify width), the ratio propose / verify.

Prints a markdown table; writes ``gpu_drafter_<type>.json`` to ``--out`` (after each family, so a run
cut short by a timeout keeps the families it finished).

Usage (H200): python tools/bench/gpu_drafter.py --target /tmp/r27-iq4xs.gguf [--families dflash dspark dflash2]
                  [--type bf16] [--decode-json OUT/gpu_decode_iq4xs.json] [--out DIR]
CPU smoke test: python tools/bench/gpu_drafter.py --device cpu --config tiny --target /tmp/t.gguf --out /tmp/o
(the target is written by random_qwen35.py with ``--config`` / ``--mix`` when it does not exist).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_float(s: str) -> float:
    v = float(s)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {s}")
    return v


def tensor_bytes(reader) -> dict[str, int]:
    """name -> stored bytes of every tensor of a GGUFReader."""
    return {t.name: int(t.n_bytes) for t in reader.tensors}


def propose_stream_bytes(hp, drafter_bytes: dict[str, int], lm_head_bytes: int) -> int:
    """Bytes one propose of drafter ``hp`` must read: its ``blk.*`` tensors and ``output_norm``, the
    target's lm_head (``lm_head_bytes``), DSpark's W2 once per draft, DFlash 2's selector projection."""
    n = sum(b for k, b in drafter_bytes.items() if k.startswith("blk.") or k == "output_norm.weight")
    n += lm_head_bytes
    if hp.dspark is not None:
        n += hp.n_drafts * drafter_bytes["dflash.dspark.markov.w2"]
    if hp.dflash2 is not None:
        n += drafter_bytes["dflash.selector.hproj.weight"]
    return n


def bench_family(family: str, args, target: str, sync, lm_head_bytes: int, verify: dict) -> dict:
    """Write (if needed), open and measure one family's drafter; returns its report dict."""
    import gguf

    import random_drafter
    from gpu_decode import device_used_bytes, timed
    from specd.draft_worker.engine import open_model_drafter
    from specd.draft_worker.server import ProposeOptions

    path = Path(args.drafter_dir) / f"{Path(target).stem}-draft-{family}-{args.type}.gguf"
    r: dict = {"family": family, "drafter": str(path)}
    generated = not path.exists()
    if generated:
        r["generate"] = random_drafter.write(path, family, args.config, args.type, args.seed)
        print(family, "generated", r["generate"], flush=True)
    try:
        sizes = tensor_bytes(gguf.GGUFReader(path))
        r["weight_bytes"] = sum(sizes.values())
        used0 = device_used_bytes() if args.device == "cuda" else None
        t0 = time.perf_counter()
        d = open_model_drafter(str(path), target, kv_dtype=args.kv_dtype, dspark_markov=args.dspark_markov,
                               device=args.device, cuda_graphs=args.cuda_graphs != "off")
        sync()
        r["load_s"] = time.perf_counter() - t0
        used1 = device_used_bytes() if args.device == "cuda" else None
        r["device_bytes_drafter_and_head"] = None if used0 is None or used1 is None else used1 - used0
        hp = d.hp
        r.update(params=sum(math.prod(int(x) for x in t.shape) for t in d.model.drafter.reader.tensors),
                 block_size=hp.block_size, drafts=hp.n_drafts, verify_width=hp.verify_width,
                 summary=hp.summary(), stream_bytes_per_propose=propose_stream_bytes(hp, sizes, lm_head_bytes))
        if args.top_k > d.max_top_k:
            raise SystemExit(f"--top-k {args.top_k} exceeds the {family} drafter's max {d.max_top_k}")
        rng = np.random.default_rng(args.seed)
        n_ctx = args.context
        feats = rng.standard_normal((n_ctx, hp.n_taps * hp.n_embd), dtype=np.float32)
        toks = rng.integers(0, hp.n_vocab, n_ctx).tolist()
        opts = ProposeOptions(top_k=args.top_k)
        anchor = int(rng.integers(0, hp.n_vocab))

        def fresh(name: str) -> None:
            d.release(name)
            d.open(name, n_ctx)

        # warm-up: one ingest + proposes on a throwaway sequence (kernels, graphs, allocator)
        fresh("warm")
        d.ingest("warm", 0, toks, feats)
        for _ in range(args.warmup):
            d.propose("warm", anchor, hp.n_drafts, opts)
        d.release("warm")
        ts = []
        for i in range(args.ingest_reps):
            fresh("s")
            ts.append(timed(lambda: d.ingest("s", 0, toks, feats), sync))
        r["ingest_ms"] = 1e3 * float(np.median(ts))
        r["ingest_rows_per_s"] = n_ctx / float(np.median(ts))
        draft = None

        def prop():
            nonlocal draft
            draft = d.propose("s", anchor, hp.n_drafts, opts)
        if args.cuda_graphs == "both":  # the eager propose first, on the same sequence
            d.model.cuda_graphs = False
            for _ in range(args.warmup):
                prop()
            ts = [timed(prop, sync) for _ in range(args.steps)]
            r["propose_eager_ms"] = 1e3 * float(np.median(ts))
            d.model.cuda_graphs = True
        for _ in range(args.warmup):  # (the graph's capture happens here)
            prop()
        ts = [timed(prop, sync) for _ in range(args.steps)]
        r["propose_ms"] = 1e3 * float(np.median(ts))
        r["propose_min_ms"] = 1e3 * float(np.min(ts))
        r["n_tokens"] = len(draft.tokens)
        seq = d.seqs["s"]
        r["graph_captures"], r["graph_arena_bytes"] = seq.graph_captures, seq.graph_arena_bytes()
        p = seq.propose(anchor, seq.n_ctx, return_logits=True, return_hidden=True)  # untimed: sanity of the values
        r["logits_finite"] = bool(np.isfinite(p.logits).all() and np.isfinite(p.hidden).all())
        r["logits_std"], r["hidden_rms"] = float(np.std(p.logits)), float(np.sqrt(np.mean(np.square(p.hidden))))
        block = [anchor] + [hp.mask_token_id] * (hp.block_size - 1)
        ts = [timed(lambda: seq.forward_block(block, seq.n_ctx), sync) for _ in range(args.steps)]
        r["forward_ms"] = 1e3 * float(np.median(ts))
        # of the eager propose (the forward is eager; None when only the graph's was measured: --cuda-graphs
        # on, cuda); two medians: noise could make it < 0
        eager = r.get("propose_eager_ms",
                      r["propose_ms"] if args.cuda_graphs == "off" or args.device != "cuda" else None)
        r["head_ms"] = None if eager is None else max(0.0, eager - r["forward_ms"])
        if args.profile:
            from gpu_decode import host_profile, kernel_profile

            def proposes():
                for _ in range(args.profile):
                    prop()
            r["profile"] = kernel_profile(proposes, sync, args.profile) if args.device == "cuda" else []  # GPU kernels
            r["profile_busy_ms"] = sum(k["us_per_step"] for k in r["profile"]) / 1e3
            host = host_profile(proposes, sync)
            r["host_profile"] = {"wall_ms_per_propose": 1e3 * host["wall_s"] / args.profile, "top": host["top"]}
            print(family, "profile", json.dumps(r["profile"][:25]), flush=True)
            print(family, "host profile", json.dumps(r["host_profile"]), flush=True)
        if args.copy_GBps:
            r["floor_ms"] = 1e3 * r["stream_bytes_per_propose"] / (args.copy_GBps * 1e9)
            r["propose_ratio_to_floor"] = r["propose_ms"] / r["floor_ms"]
        v = verify.get(hp.verify_width)
        if v:
            r["verify_ms"] = v
            r["propose_ratio_to_verify"] = r["propose_ms"] / v
        d.release("s")
        del d, seq
        print(family, json.dumps({k: v for k, v in r.items() if k not in ("generate", "summary", "profile", "host_profile")}),
              flush=True)
        return r
    finally:
        if generated and not args.keep:
            path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    import random_drafter
    import random_qwen35
    from specd.draft_worker.engine import KV_DTYPES
    from specd.draft_worker.model import DEFAULT_MARKOV, MARKOV_MODES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target GGUF (random_qwen35; written when missing)")
    ap.add_argument("--config", choices=sorted(random_drafter.CONFIGS), default="27b",
                    help="random_drafter / random_qwen35 config: 27b (default) or tiny (CPU tests)")
    ap.add_argument("--mix", choices=random_qwen35.MIXES, default="iq4xs", help="target mix when it is generated")
    ap.add_argument("--families", nargs="+", choices=random_drafter.FAMILIES, default=list(random_drafter.FAMILIES))
    ap.add_argument("--type", choices=random_drafter.TYPES, default="bf16", help="drafter matrix storage")
    ap.add_argument("--drafter-dir", default=None,
                    help="where drafters are looked for / written (default: the target's folder); a drafter "
                         "written here is deleted after its measurement unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the drafters this run wrote")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--context", type=positive_int, default=512, help="context rows ingested before proposing")
    ap.add_argument("--steps", type=positive_int, default=20, help="timed proposes (median reported)")
    ap.add_argument("--warmup", type=nonneg_int, default=3)
    ap.add_argument("--ingest-reps", type=positive_int, default=3)
    ap.add_argument("--top-k", type=nonneg_int, default=0, help="ProposeOptions.top_k (0: none, the default)")
    ap.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="f32", help="drafter K/V cache (worker default f32)")
    ap.add_argument("--dspark-markov", choices=MARKOV_MODES, default=DEFAULT_MARKOV)
    ap.add_argument("--cuda-graphs", choices=("both", "on", "off"), default="both",
                    help="measure the propose replayed as a CUDA graph (on), eagerly (off) or both in one run "
                         "(default both; propose_ms is the graph's unless off)")
    ap.add_argument("--verify-ms", type=positive_float, default=None,
                    help="target verify step time (ms) to compare every family's propose with")
    ap.add_argument("--decode-json", default=None,
                    help="gpu_decode.py's JSON: verify time at each family's verify width")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--profile", type=nonneg_int, default=0, metavar="N",
                    help="profile N proposes per GPU kernel and on the host (0: off)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.decode_json and not os.path.isfile(args.decode_json):
        ap.error(f"--decode-json {args.decode_json}: no such file")
    args.drafter_dir = args.drafter_dir or str(Path(args.target).resolve().parent)

    import specd.native as sn
    from gpu_decode import copy_bandwidth
    from specd.target_worker.gguf_loader import open_gguf

    if args.device == "cuda" and not sn.gpu_available():
        ap.error("--device cuda: no GPU in this build / machine (use --device cpu)")
    rep: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "target": args.target, "config": args.config,
                 "type": args.type, "context": args.context, "steps": args.steps, "top_k": args.top_k,
                 "kv_dtype": args.kv_dtype, "dspark_markov": args.dspark_markov, "cuda_graphs": args.cuda_graphs,
                 "device": sn.gpu_device_name() if args.device == "cuda" else "cpu"}
    if not os.path.exists(args.target):
        rep["generate_target"] = random_qwen35.write(args.target, args.config, args.mix)
        print("generated target", rep["generate_target"], flush=True)
    sync = sn.gpu_synchronize if args.device == "cuda" else (lambda: None)
    args.copy_GBps = rep["copy_GBps"] = copy_bandwidth() if args.device == "cuda" else None
    tb = tensor_bytes(open_gguf(args.target))
    rep["lm_head_bytes"] = tb.get("output.weight", tb["token_embd.weight"])
    verify: dict[int, float] = {}
    if args.decode_json:
        verify = {int(w): float(v) for w, v in json.loads(Path(args.decode_json).read_text())["verify_ms"].items()}
    if args.verify_ms:
        verify = {w: args.verify_ms for w in range(1, 65)}
    os.makedirs(args.out, exist_ok=True)
    rep["families"] = {}
    for f in args.families:  # the JSON is rewritten after each family: a run cut short keeps what it measured
        rep["families"][f] = bench_family(f, args, args.target, sync, rep["lm_head_bytes"], verify)
        Path(args.out, f"gpu_drafter_{args.type}.json").write_text(json.dumps(rep, indent=1))
    print(markdown(rep))
    return 0


def markdown(r: dict) -> str:
    """The report as a markdown section (one row per family)."""
    f = lambda v, fmt: "n/a" if v is None else format(v, fmt)  # noqa: E731
    L = [f"### Random {r['config']}-shaped drafters ({r['type']}) on {r['device']} ({r['date']})", "",
         f"- target {r['target']}; context {r['context']} rows; propose median of {r['steps']}; top_k {r['top_k']}; "
         f"K/V {r['kv_dtype']}; DSpark Markov {r['dspark_markov']}; CUDA graphs {r.get('cuda_graphs', 'n/a')}; "
         "copy bandwidth "
         + (f"{r['copy_GBps']:.0f} GB/s" if r.get("copy_GBps") else "n/a"), "",
         "| family | B / drafts | params | file GB | load s | ingest ms | rows/s | propose ms (min) | eager propose ms "
         "| forward ms | head ms | streamed GB | floor ms | x floor | verify ms | propose / verify |",
         "| --- |" + " --- |" * 15]
    for fam, x in r["families"].items():
        L.append(f"| {fam} | {x['block_size']} / {x['drafts']} | {x['params'] / 1e9:.3f} B | {x['weight_bytes'] / 1e9:.2f} "
                 f"| {x['load_s']:.1f} | {x['ingest_ms']:.1f} | {x['ingest_rows_per_s']:.0f} "
                 f"| **{x['propose_ms']:.2f}** ({x['propose_min_ms']:.2f}) | {f(x.get('propose_eager_ms'), '.2f')} "
                 f"| {x['forward_ms']:.2f} | {f(x.get('head_ms'), '.2f')} "
                 f"| {x['stream_bytes_per_propose'] / 1e9:.2f} | {f(x.get('floor_ms'), '.2f')} "
                 f"| {f(x.get('propose_ratio_to_floor'), '.1f')} | {f(x.get('verify_ms'), '.1f')} "
                 f"| {f(x.get('propose_ratio_to_verify'), '.2f')} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
