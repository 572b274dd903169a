#!/usr/bin/env python3
"""Evaluate the shipped demo target: held-out perplexity with specd's Qwen35Model (the GGUF) and,
as a check, with the float32 transformers model (the trained checkpoint) on the SAME tokens and the
same llama.cpp-style chunks (ctx 512, second half scored; ``--max-chunks`` chunks spread evenly
over each held-out file); then greedy samples from a code, a prose
and a chat prompt with Qwen35Model. Writes a JSON summary with ``--json``.

    python3 tools/demo/eval_target.py --gguf models/demo-target.gguf --hf build/demo-target-hf \
        --corpus build/demo-corpus --max-chunks 40
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

PROMPTS = {
    "code": "import os\nimport sys\n\n\ndef read_config(path):\n    \"\"\"Read a configuration file and",
    "prose": "The gzip command compresses files.",
    "chat": "<|im_start|>user\nWhat does `ls` do?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
}


def hf_perplexity(model, tokens: np.ndarray, ctx: int, n_chunks: int) -> tuple[float, int]:
    import torch

    nll = []
    with torch.no_grad():
        for i in range(n_chunks):
            x = torch.from_numpy(tokens[i * ctx:(i + 1) * ctx].astype(np.int64))[None]
            logits = model(input_ids=x[:, :-1]).logits[0].double()  # row j predicts token j+1
            first = ctx // 2 - 1
            lp = torch.log_softmax(logits[first:], -1)
            nll.append((-lp[torch.arange(lp.shape[0]), x[0, first + 1:]]).numpy())
    nll = np.concatenate(nll)
    return math.exp(float(nll.mean())), len(nll)


def greedy(model, tok, prompt: str, n: int) -> tuple[str, list[int]]:
    ids = tok.encode(prompt).ids
    st = model.new_sequence(len(ids) + n + 1)
    t = int(np.argmax(model.prefill(st, ids)))
    out = [t]
    for _ in range(n - 1):
        if t in (0, 2):  # <|endoftext|>, <|im_end|>
            break
        t = int(np.argmax(model.decode(st, t)))
        out.append(t)
    return tok.decode(out, skip_special_tokens=False), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="models/demo-target.gguf")
    ap.add_argument("--hf", default="", help="trained transformers checkpoint (for the float32 check); empty: skip")
    ap.add_argument("--corpus", default="build/demo-corpus")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-chunks", type=int, default=40)
    ap.add_argument("--sample-tokens", type=int, default=80)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import specd.native as sn
    from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata
    from specd.target_worker.model import Qwen35Model
    from specd.target_worker.perplexity import perplexity
    from specd.target_worker.tokenizer import build_tokenizer

    tok = build_tokenizer(read_tokenizer_metadata(args.gguf), args.gguf)
    model = Qwen35Model(load_qwen35(args.gguf), kv_dtype=sn.DType.F16)
    hf = None
    if args.hf:
        import torch
        from transformers import Qwen3_5ForCausalLM
        torch.set_num_threads(2)
        hf = Qwen3_5ForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    res = {"ctx": args.ctx, "max_chunks": args.max_chunks}
    for kind in ("code", "prose"):
        with open(f"{args.corpus}/heldout_{kind}.txt", encoding="utf-8") as f:
            tokens = np.asarray(tok.encode(f.read()).ids, np.int32)
        total = len(tokens) // args.ctx
        n_chunks = min(total, args.max_chunks)
        # chunks spread evenly over the whole file (each chunk is scored from an empty state, so
        # concatenating the chosen chunks is the same as scoring them in place)
        pick = np.linspace(0, total - 1, n_chunks).round().astype(int)
        tokens = np.concatenate([tokens[i * args.ctx:(i + 1) * args.ctx] for i in pick])
        t0 = time.time()
        ppl, err, n = perplexity(model, tokens, args.ctx, n_chunks)
        r = {"chunks_in_file": total, "chunks": n_chunks, "scored": n, "ppl_specd_gguf_f16": round(ppl, 4),
             "stderr": round(err, 4), "seconds_specd": round(time.time() - t0, 1)}
        if hf is not None:
            t0 = time.time()
            ppl32, n32 = hf_perplexity(hf, tokens, args.ctx, n_chunks)
            r.update(ppl_transformers_f32=round(ppl32, 4), rel_diff=round(abs(ppl - ppl32) / ppl32, 5),
                     seconds_transformers=round(time.time() - t0, 1))
        res[kind] = r
        print(kind, json.dumps(r), flush=True)
    res["samples"] = {}
    for name, prompt in PROMPTS.items():
        text, ids = greedy(model, tok, prompt, args.sample_tokens)
        res["samples"][name] = {"prompt": prompt, "completion": text, "distinct_tokens": len(set(ids)), "n": len(ids)}
        print(f"--- {name} prompt ---\n{prompt}\033[1m{text}\033[0m\n", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
