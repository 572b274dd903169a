#!/usr/bin/env python3
"""Check that specd serves the demo drafters as they were trained (a manual check after training).

For each family: the demo target (specd, ``models/demo-target.gguf``) greedily continues held-out
code prompts while capturing the drafter's tap features; then, for anchors in each continuation,
the drafts of (a) the training forward of ``train_drafters.py`` on the exported HF checkpoint
(``build/demo-drafters-hf/<family>``, dflash's modules) and (b) specd's drafter on the shipped GGUF
(``models/demo-<family>.gguf``) are compared token by token, and both acceptance lengths printed.
Needs the training outputs (not in git): ``build/demo-drafters-hf/`` and the prepared target of
``train_drafters.py prepare`` (``.demowork/drafter-data/target``, for the frozen embedding).

Usage: python tools/demo/check_drafter_parity.py [--prompts 4] [--new 64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))


def accepted(drafts, gold) -> int:
    n = 0
    for d, g in zip(drafts, gold):
        if int(d) != int(g):
            break
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="held-out code prompts (tools/bench/demo_prompts.jsonl)")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--hf", default=str(ROOT / "build" / "demo-drafters-hf"))
    ap.add_argument("--data", default=str(ROOT / ".demowork" / "drafter-data"))
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    import specd.native as sn
    import train_drafters as T
    from specd.draft_worker.gguf_loader import load_drafter
    from specd.draft_worker.model import DrafterModel
    from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata
    from specd.target_worker.model import Qwen35Model
    from specd.target_worker.tokenizer import build_tokenizer

    target = str(ROOT / "models" / "demo-target.gguf")
    model = Qwen35Model(load_qwen35(target), capture_layers=tuple(T.TAPS), kv_dtype=sn.DType.F32)
    tok = build_tokenizer(read_tokenizer_metadata(target), target)
    recs = [json.loads(line) for line in (ROOT / "tools" / "bench" / "demo_prompts.jsonl").open()]
    texts = [r["prompt"] for r in recs if r["kind"] == "code"][:args.prompts]
    runs = []
    for text in texts:
        ids = tok.encode(text).ids
        st = model.new_sequence(len(ids) + args.new + 1)
        logits, out = model.prefill(st, ids), []
        for _ in range(args.new):
            out.append(int(np.argmax(logits)))
            logits = model.decode(st, out[-1])
        runs.append((ids + out, len(ids), st.features.read(0, st.committed)))
    embed = load_file(str(Path(args.data) / "target" / "model.safetensors"))["model.embed_tokens.weight"].float()
    table = sn.Tensor(np.ascontiguousarray(embed.numpy()))
    for fam, spec in T.FAMILIES.items():
        B = spec["block"]
        D = B if fam == "dspark" else B - 1
        trained, heads = T.build_drafter(fam)
        sd = load_file(str(Path(args.hf) / fam / "model.safetensors"))
        trained.load_state_dict({k + (".weight" if k.endswith("_codebook") else ""): v for k, v in sd.items()
                                 if not k.startswith(("markov_head", "confidence_head"))}, strict=False)
        if heads is not None:
            heads["markov_w1"].weight.data = sd["markov_head.markov_w1.weight"]
            heads["markov_w2"].weight.data = sd["markov_head.markov_w2.weight"]
        served = DrafterModel(load_drafter(str(ROOT / "models" / f"demo-{fam}.gguf")), table, table)
        same = total = acc_t = acc_s = 0
        for seq, p, feats in runs:
            anchors = torch.arange(p, p + args.new - B - 1, 4)[None]
            tokens = torch.tensor(seq)[None]
            with torch.no_grad():
                h = T.draft_hidden(trained, embed, torch.from_numpy(feats)[None], tokens, anchors, B)
                dt = T.propose(fam, trained, heads, embed, h, tokens.gather(1, anchors))[0]
            for j, a in enumerate(anchors[0].tolist()):
                s = served.new_sequence(len(seq) + B)
                s.ingest(feats[:a], 0)
                ds = s.propose(seq[a], a).tokens[:D]
                gold = seq[a + 1:a + 1 + D]
                same += int(list(map(int, ds)) == dt[j].tolist())
                total += 1
                acc_t += accepted(dt[j].tolist(), gold)
                acc_s += accepted(ds, gold)
        print(f"{fam}: identical drafts in {same}/{total} blocks; AL training forward {1 + acc_t / total:.2f}, "
              f"specd (Q8_0 GGUF) {1 + acc_s / total:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
