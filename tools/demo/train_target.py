#!/usr/bin/env python3
"""Train the demo qwen35 target (transformers ``Qwen3_5ForCausalLM``) on the packed token stream.

Runs on the lent H200 (bf16 autocast, fused AdamW, warmup + cosine LR over a WALL-CLOCK budget:
the schedule's progress is elapsed/budget, so the run always ends on time and with the LR annealed)
or, with ``--smoke``, for a few steps of a tiny config on the CPU (to test the script before a
device run). Batches are random 513-token windows of the packed stream (documents separated by
``<|endoftext|>``), next-token loss on all 512 positions. Held-out code and prose loss is measured
on fixed windows every ``--eval-every`` steps and at the end. Writes config.json + sharded F32
safetensors (each file < 16 MiB) + train_log.jsonl + summary.json into ``--out``.
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
import torch

MODEL = dict(  # the shipped demo target (F16 GGUF ~14.4 MiB with the tokenizer)
    vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
)
SMOKE = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
             rope_parameters=dict(MODEL["rope_parameters"], mrope_section=[2, 1, 1]))


def log(fh, **rec):
    line = json.dumps(rec)
    print(line, flush=True)
    fh.write(line + "\n")
    fh.flush()


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], device, amp) -> dict[str, float]:
    model.eval()
    res = {}
    for name, w in windows.items():
        tot, n = 0.0, 0
        for i in range(0, len(w), 16):
            x = w[i:i + 16].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            tot += loss.item()
            n += x[:, 1:].numel()
        res[name] = tot / n
    model.train()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default="build/demo-tokens", help="folder with train_tokens.npy, heldout_*_tokens.npy")
    ap.add_argument("--out", default="build/demo-target-hf")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100, help="warmup steps (linear)")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--budget-s", type=float, default=360.0, help="training wall-clock budget (seconds)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too (0: none)")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny config, CPU, few steps (script test)")
    args = ap.parse_args(argv)

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    import transformers

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    amp = device.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fh = (out / "train_log.jsonl").open("w")

    data = Path(args.data)
    train = torch.from_numpy(np.load(data / "train_tokens.npy").astype(np.int64)).to(device)
    L = args.seq + 1
    windows = {}
    for kind in ("code", "prose"):
        h = np.load(data / f"heldout_{kind}_tokens.npy").astype(np.int64)
        n = min(args.eval_windows, len(h) // L)
        starts = np.linspace(0, len(h) - L, n).astype(np.int64)  # fixed, spread over the held-out set
        windows[kind] = torch.from_numpy(np.stack([h[s:s + L] for s in starts]))

    cfg = Qwen3_5TextConfig(**(SMOKE if args.smoke else MODEL))
    model = Qwen3_5ForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    log(fh, event="start", device=str(torch.cuda.get_device_name(0) if amp else "cpu"), torch=torch.__version__,
        transformers=transformers.__version__, params=n_params, train_tokens=int(train.numel()),
        tokens_per_step=args.batch * args.seq, args=vars(args))

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    offs = torch.arange(L, device=device)
    t0 = time.time()
    step, tokens_seen, ema = 0, 0, None
    model.train()
    while True:
        elapsed = time.time() - t0
        if elapsed >= args.budget_s or (args.max_steps and step >= args.max_steps):
            break
        progress = min(1.0, max(elapsed / args.budget_s, (step / args.max_steps) if args.max_steps else 0.0))
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - L, (args.batch,), device=device, generator=gen)
        x = train[starts[:, None] + offs]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += args.batch * args.seq
        if step % 25 == 0 or step == 1:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            el = time.time() - t0
            log(fh, step=step, loss=round(lv, 4), loss_ema=round(ema, 4), lr=round(lr, 6), gnorm=round(gnorm.item(), 3),
                tokens=tokens_seen, elapsed=round(el, 1), tok_per_s=round(tokens_seen / el))
            if not math.isfinite(lv):
                log(fh, event="nonfinite loss, stopping")
                break
        if step % args.eval_every == 0:
            ev = evaluate(model, windows, device, amp)
            log(fh, step=step, eval_loss_code=round(ev["code"], 4), eval_loss_prose=round(ev["prose"], 4),
                ppl_code=round(math.exp(ev["code"]), 2), ppl_prose=round(math.exp(ev["prose"]), 2))
    train_s = time.time() - t0
    ev = evaluate(model, windows, device, amp)
    ev32 = evaluate(model, windows, device, False)
    summary = dict(steps=step, tokens=tokens_seen, epochs=round(tokens_seen / train.numel(), 2), train_s=round(train_s, 1),
                   params=n_params, final_eval_loss_bf16=ev, final_eval_loss_fp32=ev32,
                   final_ppl_fp32={k: round(math.exp(v), 3) for k, v in ev32.items()})
    log(fh, event="done", **summary)
    model.to("cpu").float()
    model.config.architectures = ["Qwen3_5ForCausalLM"]
    model.config.eos_token_id = 0  # <|endoftext|>
    model.config.pad_token_id = 0
    model.save_pretrained(out, max_shard_size="15MB", safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # the device returns at most 8 files
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    fh.close()
    print("saved:", sorted(os.listdir(out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
