"""`specd perplexity`: llama.cpp-style perplexity of a target GGUF over a text file.

Method (llama.cpp ``tools/perplexity``): the tokenised text is cut into consecutive chunks of
``ctx`` tokens; each chunk is evaluated from an empty state and only the tokens after position
ctx/2 are scored (``n_ctx - 1 - n_ctx/2`` per chunk), so every scored token sees at least ctx/2
tokens of context. PPL = exp(mean NLL) over
all scored tokens, printed per chunk as a running estimate and at the end with its standard error.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

PERPLEXITY_CHUNK = 512  # tokens per forward of `specd perplexity` (its memory: [512, n_vocab] logits)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target GGUF (arch qwen35)")
    p.add_argument("--file", required=True, help="UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, must be >= 4)")
    p.add_argument("--kv-type", choices=["f16", "q8_0", "f32"], default="f16", help="KV cache type (default f16)")
    p.add_argument("--max-chunks", type=int, default=0, help="score at most this many chunks (0: all)")


def chunk_nll(model, tokens: np.ndarray) -> np.ndarray:
    """NLL (float64, nats) of tokens[i+1] given tokens[:i+1] for i in [ctx/2, ctx - 2], as llama.cpp
    scores a chunk (``first = n_ctx/2``, ``n_ctx - 1 - first`` tokens). Logits are reduced per
    forward chunk, so memory stays at one chunk of [prefill_chunk, n_vocab]."""
    ctx = len(tokens)
    first = ctx // 2
    st = model.new_sequence(ctx)
    out = []
    for s in range(0, ctx - 1, model.prefill_chunk):
        e = min(s + model.prefill_chunk, ctx - 1)
        res = model.verify(st, tokens[s:e])
        model.commit(st, res, len(res.tokens))
        rows = res.logits[max(first - s, 0) :].astype(np.float64)  # row r predicts token s + r + 1
        if len(rows):
            targets = tokens[max(first, s) + 1 : e + 1]
            top = rows.max(1, keepdims=True)
            lse = np.log(np.exp(rows - top).sum(1)) + top[:, 0]
            out.append(lse - rows[np.arange(len(rows)), targets])
    return np.concatenate(out)


def perplexity(model, tokens: np.ndarray, ctx: int, max_chunks: int = 0, out=None):
    """Returns (ppl, stderr_of_ppl, n_scored) over the whole chunks of ``ctx`` tokens (at most
    ``max_chunks`` when > 0). Raises ValueError for ctx < 4, max_chunks < 0 or a text shorter than
    one chunk."""
    if ctx < 4:
        raise ValueError(f"ctx must be >= 4, got {ctx}")
    if max_chunks < 0:
        raise ValueError(f"max_chunks must be >= 0, got {max_chunks}")
    n_chunks = len(tokens) // ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one chunk of {ctx}")
    parts = []
    for i in range(n_chunks):
        parts.append(chunk_nll(model, tokens[i * ctx : (i + 1) * ctx]))
        if out is not None:  # running estimate, printed as llama.cpp does
            print(f"[{i + 1}]{math.exp(np.concatenate(parts).mean()):.4f},", end="", file=out, flush=True)
    nll = np.concatenate(parts)
    ppl = math.exp(float(nll.mean()))
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
    # every row's logits are scored (float32 [chunk, n_vocab], float64 copies), so the forwards stay at
    # 512 rows whatever the serving default; they are exact (each row bitwise its decode): same scores
    model = Qwen35Model(weights, kv_dtype=kv, prefill_chunk=PERPLEXITY_CHUNK)
    ppl, err, n = perplexity(model, tokens, args.ctx, args.max_chunks, out=sys.stdout)
    print(f"\nFinal estimate: PPL = {ppl:.4f} +/- {err:.5f} ({n} tokens scored, ctx {args.ctx})")
    return 0
