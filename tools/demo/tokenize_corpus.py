#!/usr/bin/env python3
"""Tokenize the corpus into packed uint16 token streams for training (run locally; the device has
no corpus). Documents are shuffled with a fixed seed, a fraction is wrapped in the chat template
(rendered with jinja2 from tokenizer_config.json, thinking on or off), and each document ends with
``<|endoftext|>``. Writes ``train_tokens.npy`` (uint16, all TRAIN files), ``heldout_code_tokens.npy``
and ``heldout_prose_tokens.npy`` (held-out files, plain text, for evaluation) and ``tokens.json``
(counts) into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import jinja2
import numpy as np
from tokenizers import Tokenizer

SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant for programmers.",
           "You answer questions about software and Unix tools."]


def _name(src: str) -> str:
    base = src.rsplit("/", 1)[-1]
    for suf in (".gz", ".py"):
        base = base[: -len(suf)] if base.endswith(suf) else base
    return base


def chat_messages(rec: dict, rng: random.Random) -> tuple[list[dict], bool]:
    """(messages, with_thinking) for one document: a user request and the document as the answer."""
    src, kind, pkg = rec["src"], rec["kind"], rec["pkg"]
    name = _name(src)
    if kind == "code":
        mod = src.split("/", 1)[1][:-3].replace("/", ".").removesuffix(".__init__")
        asks = [f"Show me the source code of the Python module `{mod}`.", f"Write the Python module {mod}.",
                f"Please write `{name}.py`.", f"Can you give me the code of {mod}?"]
        thought = [f"The user wants the Python source of {mod}. I will write the module.",
                   f"They ask for {name}.py. I should write the full module with its imports first.", ""]
    elif src.startswith("man/"):
        cmd = name.rsplit(".", 1)[0]
        asks = [f"What does `{cmd}` do?", f"Show me the manual page of {cmd}.", f"How do I use {cmd}?",
                f"Explain the {cmd} command and its options."]
        thought = [f"The user asks about {cmd}. I will give its manual page.",
                   f"{cmd} is documented in the {pkg} package. I will explain it.", ""]
    else:
        asks = [f"Tell me about the documentation of {pkg}.", f"Show me the README of {pkg}.",
                f"What does the {name} file of {pkg} say?", f"Summarise what {pkg} is."]
        thought = [f"The user wants the documentation of {pkg}. I will reproduce it.", ""]
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    msgs.append({"role": "user", "content": rng.choice(asks)})
    r = rng.random()
    reasoning = None if r < 0.2 else "" if r < 0.6 else rng.choice(thought)  # no block / empty / short
    msgs.append({"role": "assistant", "content": rec["text"], "reasoning_content": reasoning})
    return msgs, reasoning is not None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", default="build/demo-corpus")
    ap.add_argument("--tokenizer", default="build/demo-tokenizer")
    ap.add_argument("--out", default="build/demo-tokens")
    ap.add_argument("--chat-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    cfg = json.loads((Path(args.tokenizer) / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(cfg["chat_template"])
    eot = tok.token_to_id("<|endoftext|>")
    assert tok.get_vocab_size() <= 65535

    recs = [json.loads(line) for line in (Path(args.corpus) / "train.jsonl").open(encoding="utf-8")]
    rng = random.Random(args.seed)
    rng.shuffle(recs)
    docs, n_chat, n_think = [], 0, 0
    for rec in recs:
        if rng.random() < args.chat_fraction:
            msgs, think = chat_messages(rec, rng)
            docs.append(template.render(messages=msgs, add_generation_prompt=False))
            n_chat += 1
            n_think += think
        else:
            docs.append(rec["text"])
    enc = tok.encode_batch(docs, add_special_tokens=False)
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    train = np.concatenate(parts)
    np.save(out / "train_tokens.npy", train)
    stats = {"train_docs": len(docs), "chat_docs": n_chat, "chat_docs_with_think_block": n_think,
             "train_tokens": int(train.size), "train_chars": sum(len(d) for d in docs),
             "seed": args.seed, "chat_fraction": args.chat_fraction}
    held = [json.loads(line) for line in (Path(args.corpus) / "heldout.jsonl").open(encoding="utf-8")]
    for kind in ("code", "prose"):
        texts = [r["text"] for r in held if r["kind"] == kind]
        ids = []
        for e in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(e.ids)
            ids.append(eot)
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(out / f"heldout_{kind}_tokens.npy", arr)
        stats[f"heldout_{kind}_docs"] = len(texts)
        stats[f"heldout_{kind}_tokens"] = int(arr.size)
    stats["chars_per_token_train"] = round(stats["train_chars"] / stats["train_tokens"], 3)
    (out / "tokens.json").write_text(json.dumps(stats, indent=1), encoding="utf-8")
    print(json.dumps(stats, indent=1))
    print("example chat doc:\n" + next(d for d in docs if d.startswith("<|im_start|>"))[:600])
    return 0


if __name__ == "__main__":
    sys.exit(main())
