"""`specd perplexity`: llama.cpp-style perplexity of a target GGUF over a text file.

Method (llama.cpp ``tools/perplexity``): the tokenised text is cut into consecutive chunks of
``ctx`` tokens; each chunk is evaluated from an empty state and only the second half of each chunk
is scored, so every scored token sees at least ctx/2 tokens of context. PPL = exp(mean NLL) over
all scored tokens, printed per chunk as a running estimate and at the end with its standard error.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target GGUF (arch qwen35)")
    p.add_argument("--file", required=True, help="UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, must be >= 4)")
    p.add_argument("--kv-type", choices=["f16", "q8_0", "f32"], default="f16", help="KV cache type (default f16)")
    p.add_argument("--max-chunks", type=int, default=0, help="score at most this many chunks (0: all)")


def chunk_nll(model, tokens: np.ndarray) -> np.ndarray:
    """NLL (float64, nats) of tokens[i+1] given tokens[:i+1], for i in [ctx/2 - 1, ctx - 2]."""
    ctx = len(tokens)
    st = model.new_sequence(ctx)
    logits = []
    for s in range(0, ctx - 1, model.prefill_chunk):
        res = model.verify(st, tokens[s : min(s + model.prefill_chunk, ctx - 1)])
        model.commit(st, res, len(res.tokens))
        logits.append(res.logits)
    lg = np.concatenate(logits).astype(np.float64)  # row i predicts token i+1
    first = ctx // 2 - 1
    rows = lg[first:]
    lse = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
    return lse - rows[np.arange(len(rows)), tokens[first + 1 :]]


def perplexity(model, tokens: np.ndarray, ctx: int, max_chunks: int = 0, out=None):
    """Returns (ppl, stderr_of_ppl, n_scored) over all whole chunks of ``ctx`` tokens."""
    if ctx < 4:
        raise ValueError(f"ctx must be >= 4, got {ctx}")
    n_chunks = len(tokens) // ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one chunk of {ctx}")
    parts = []
    for i in range(n_chunks):
        parts.append(chunk_nll(model, tokens[i * ctx : (i + 1) * ctx]))
        if out is not None:  # running estimate, as llama.cpp prints it
            print(f"[{i + 1}]{math.exp(np.concatenate(parts).mean()):.4f}", end=" ", file=out, flush=True)
    nll = np.concatenate(parts)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    stderr = ppl * float(nll.std(ddof=1)) / math.sqrt(len(nll)) if len(nll) > 1 else float("nan")
    return ppl, stderr, len(nll)


def run(args) -> int:
    import specd.native as sn

    from .gguf_loader import TargetFileError, load_qwen35, read_tokenizer_metadata
    from .model import Qwen35Model
    from .tokenizer import build_tokenizer

    weights = load_qwen35(args.target)
    meta = read_tokenizer_metadata(args.target)
    if meta is None:
        raise TargetFileError(f"{args.target}: the file has no tokenizer (tokenizer.ggml.model); perplexity needs one")
    tok = build_tokenizer(meta, args.target)
    with open(args.file, encoding="utf-8") as f:
        tokens = np.asarray(tok.encode(f.read()).ids, np.int32)
    kv = {"f16": sn.DType.F16, "q8_0": sn.DType.Q8_0, "f32": sn.DType.F32}[args.kv_type]
    model = Qwen35Model(weights, kv_dtype=kv)
    ppl, err, n = perplexity(model, tokens, args.ctx, args.max_chunks, out=sys.stdout)
    print(f"\nFinal estimate: PPL = {ppl:.4f} +/- {err:.5f} ({n} tokens scored, ctx {args.ctx})")
    return 0
