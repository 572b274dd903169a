#!/usr/bin/env python3
"""Train the demo DFlash, DSpark and DFlash 2 drafters on the demo target's captured features.

Three stages (``tools/demo/device_train_drafters.sh`` runs the last two on the lent H200):

``prepare`` (CPU, here): fixed prompt windows from the tokenized corpus (train split for training,
  held-out code / prose for evaluation) and the demo target's HF checkpoint with its matrices
  rounded to F16 (what ``models/demo-target.gguf`` holds), into one folder that travels to the GPU.
``generate`` (GPU): the target's greedy continuation of every prompt (the data a drafter sees at
  run time: DFlash's recipe regenerates training responses with the target), then one forward over
  prompt + continuation capturing the tap features ``hidden_states[id + 1]`` for
  ``target_layer_ids`` and the final-norm hidden state (for DSpark's target distribution).
``train --family F`` (GPU): one drafter, published objective, wall-clock budget; writes the HF
  checkpoint in the published layout (config.json + model.safetensors, F32) and a JSON summary with
  the held-out block acceptance.

Objectives (docs/drafters.md; DFlash paper arXiv 2602.06036, DSpark paper, SpecForge
``dflash_family_model.py``): random anchors in the continuation; a block is
``[anchor, <|mask|> x (B-1)]`` at positions a..a+B-1 that attends to the context features of
positions < a and to every row of its own block (bidirectional, the inference mask of all three
families at these lengths; a boolean SDPA mask: dflash's attention always calls the sdpa kernel).
* DFlash: rows 1..B-1 predict the tokens at a+1..a+B-1 (cross-entropy through the frozen target
  lm_head).
* DFlash 2: the same unary loss, plus the candidate selector's loss: cross-entropy over the top-K
  unary candidates (plus the gold token when it is outside them) of
  ``u[c] + sum_r Pred[prev]_r * (W_h h)_r * Succ[c]_r``, prev teacher-forced (anchor, gold tokens);
  its gradient reaches the unary logits and the backbone too (one joint objective). Grouped dynamic
  convolutions run per block (zero padding at the anchor row).
* DSpark: rows 0..B-1 predict a+1..a+B; Markov head ``l = U + W2 W1[prev]`` (prev teacher-forced);
  0.1 x CE + 0.9 x TV + 1.0 x BCE, TV = 1/2 ||softmax(l) - p_target||_1 (the "l1" term of DeepSpec
  ``config/dspark``, written as the total variation the confidence target uses), and the confidence
  head's BCE against c* = 1 - TV (paper eq. 8); loss decay gamma 4.
Row weights: draft k (the token at anchor + k) weighs exp(-(k - 1) / gamma).

The drafter modules are ``dflash==0.1.0``'s own classes (DFlashDraftModel / DFlash2DraftModel; the
DSpark backbone is a DFlashDraftModel with all-full-attention layers) so the exported checkpoints load
in the reference implementation; after training, the training-time forward of one block is checked
against the reference ``DFlashDraftModel.forward`` (logged as ``reference_check_max_abs``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

MASK_ID = 3           # <|mask|> of the demo tokenizer
TAPS = [1, 3, 5]      # build_target_layer_ids(8, 3): round(1 + i (L - 4) / (n - 1))
GAMMA = 4.0           # loss decay (DFlash paper, block 8; DeepSpec gamma 4)
REFERENCE_TOL = 2e-2  # training vs reference forward, post-norm hidden (|h| ~ 1.4; TF32 matmuls: 6e-3 seen)
DRAFT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, vocab_size=8192,
             max_position_embeddings=4096, num_target_layers=8)
FAMILIES = {
    "dflash": dict(block=8),
    "dflash2": dict(block=8, conv_kernel_size=2, conv_group_size=16, selector_rank=64, selector_top_k=8),
    "dspark": dict(block=7, markov_rank=64),
}


def log(fh, **rec):
    line = json.dumps(rec)
    print(line, flush=True)
    if fh is not None:
        fh.write(line + "\n")
        fh.flush()


# --------------------------------------------------------------------------- prepare (CPU)

def prepare(args) -> int:
    """Prompt windows + an F16-rounded copy of the target checkpoint into ``args.out``."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    tokens = Path(args.tokens)
    train = np.load(tokens / "train_tokens.npy")
    starts = rng.integers(0, len(train) - args.prompt, args.n_train)
    np.save(out / "prompts_train.npy", np.stack([train[s:s + args.prompt] for s in starts]).astype(np.uint16))
    for kind in ("code", "prose"):
        h = np.load(tokens / f"heldout_{kind}_tokens.npy")
        starts = np.linspace(0, len(h) - args.prompt - 1, args.n_eval).astype(np.int64)
        np.save(out / f"prompts_{kind}.npy", np.stack([h[s:s + args.prompt] for s in starts]).astype(np.uint16))
    ckpt = Path(args.target_hf)
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    # Matrices as F16 (the shipped GGUF's type); vectors and the conv kernels stay F32, as the
    # converter writes them (the shipped drafters were trained before the conv exception was added:
    # their target had F16-rounded conv kernels, a < 1e-3 relative difference).
    tensors = {k: (v.half() if v.ndim >= 2 and "conv1d" not in k else v.float()).contiguous()
               for k, v in tensors.items()}
    tdir = out / "target"
    tdir.mkdir(exist_ok=True)
    save_file(tensors, str(tdir / "model.safetensors"), metadata={"format": "pt"})
    (tdir / "config.json").write_text((ckpt / "config.json").read_text())
    print(f"prepared {out}: {args.n_train} train / {args.n_eval}+{args.n_eval} eval prompts of {args.prompt} tokens")
    return 0


# --------------------------------------------------------------------------- generate (GPU)

def load_target(path, device):
    import torch
    from transformers import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return model


def greedy_continue(model, prompts, n_new, batch):
    """Greedy continuation [N, n_new] (int64, on the model's device) of prompts [N, P]."""
    import torch
    outs = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            x = prompts[i:i + batch]
            o = model(input_ids=x, use_cache=True)
            pkv, tok = o.past_key_values, o.logits[:, -1].argmax(-1)
            cont = [tok]
            for _ in range(n_new - 1):
                o = model(input_ids=tok[:, None], past_key_values=pkv, use_cache=True)
                pkv, tok = o.past_key_values, o.logits[:, -1].argmax(-1)
                cont.append(tok)
            outs.append(torch.stack(cont, 1))
    return torch.cat(outs)


def capture(model, seqs, batch):
    """Tap features [N, T, len(TAPS)*H] (bf16) and final-norm hidden [N, T, H] (bf16) of seqs."""
    import torch
    feats, last = [], []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            o = model.model(input_ids=seqs[i:i + batch], output_hidden_states=True)
            hs = o.hidden_states
            feats.append(torch.cat([hs[t + 1] for t in TAPS], -1).bfloat16())
            last.append(o.last_hidden_state.bfloat16())
    return torch.cat(feats), torch.cat(last)


def generate(args) -> int:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_target(data / "target", device)
    t0 = time.time()
    for split in ("train", "code", "prose"):
        p = torch.from_numpy(np.load(data / f"prompts_{split}.npy").astype(np.int64))
        if args.limit:
            p = p[:args.limit]
        p = p.to(device)
        cont = greedy_continue(model, p, args.new, args.batch)
        seqs = torch.cat([p, cont], 1)
        feats, last = capture(model, seqs, args.batch)
        torch.save({"tokens": seqs.cpu(), "feats": feats.cpu(), "last": last.cpu(), "prompt": p.shape[1]},
                   out / f"{split}.pt")
        print(json.dumps({"split": split, "seqs": list(seqs.shape), "elapsed_s": round(time.time() - t0, 1)}),
              flush=True)
    return 0


# --------------------------------------------------------------------------- drafter models

def draft_config(family: str) -> dict:
    """The published-layout ``config.json`` of a demo drafter (docs/drafters.md §2, §5.4, §6.1)."""
    fam = FAMILIES[family]
    cfg = {"model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "dtype": "float32",
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}, **DRAFT,
           "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS}}
    L = DRAFT["num_hidden_layers"]
    if family == "dflash":        # z-lab Qwen3.5 DFlash: no layer_types (bidirectional), block at top
        cfg.update(architectures=["DFlashDraftModel"], block_size=fam["block"])
    elif family == "dflash2":     # z-lab Qwen3.8 DFlash 2: all sliding, is_causal false, block in dflash_config
        cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, layer_types=["sliding_attention"] * L,
                   sliding_window=2048, use_sliding_window=True)
        cfg["dflash_config"].update(block_size=fam["block"], conv_kernel_size=fam["conv_kernel_size"],
                                    conv_group_size=fam["conv_group_size"], selector_rank=fam["selector_rank"],
                                    selector_top_k=fam["selector_top_k"])
    else:                         # SpecForge DSpark packaging (RadixArk): keys nested, block at top
        cfg.update(architectures=["DSparkDraftModel"], block_size=fam["block"], layer_types=["full_attention"] * L)
        cfg["dflash_config"].update(projector_type="dspark", markov_rank=fam["markov_rank"],
                                    markov_head_type="vanilla", enable_confidence_head=True,
                                    confidence_head_with_markov=True)
    return cfg


def build_drafter(family: str, out_norm=None):
    """(backbone, heads) torch modules; heads is a ModuleDict (DSpark Markov + confidence) or None."""
    import torch
    from torch import nn
    from transformers import Qwen3Config
    from dflash import DFlash2DraftModel, DFlashDraftModel

    cfg = draft_config(family)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "model_type", "dtype")}
    qc = Qwen3Config(**kw)
    qc.dflash_config = dict(cfg["dflash_config"])
    if "is_causal" in cfg:
        qc.is_causal = cfg["is_causal"]
    model = (DFlash2DraftModel if family == "dflash2" else DFlashDraftModel)(qc)
    if out_norm is not None:  # start from the target's effective final-norm gain (qwen35 stores w - 1)
        with torch.no_grad():
            model.norm.weight.copy_(1.0 + out_norm)
    if family == "dflash2":  # SF dflash2.py init: identity convolutions (a fresh DFlash 2 = DFlash)
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                with torch.no_grad():
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0].fill_(1.0)
                    conv.kernel_projection.weight.zero_()
    heads = None
    if family == "dspark":
        r, H, V = FAMILIES["dspark"]["markov_rank"], DRAFT["hidden_size"], DRAFT["vocab_size"]
        heads = nn.ModuleDict({"markov_w1": nn.Embedding(V, r), "markov_w2": nn.Linear(r, V, bias=False),
                               "confidence": nn.Linear(H + r, 1)})
        with torch.no_grad():
            heads["markov_w1"].weight.normal_(0, 0.02)
            heads["markov_w2"].weight.zero_()  # starts as the plain backbone
    return model, heads


def layer_forward(layer, h, ctx, mask, pe, blocks: int):
    """One ``Qwen3DFlashDecoderLayer`` over concatenated blocks; the DFlash 2 convolutions run per block
    (``h`` [S, blocks*B, H] viewed as [S*blocks, B, H]) so the anchor row never mixes with the previous block."""
    S, NB, H = h.shape

    def per_block(fn, x, *extra):
        y = fn(x.reshape(S * blocks, NB // blocks, H), *extra)
        return y

    res = h
    x = layer.input_layernorm(h)
    ak = None
    if layer.attention_conv is not None:
        x, ak = per_block(layer.attention_conv.prepare, x)
        x = x.reshape(S, NB, H)
    x = layer.self_attn(hidden_states=x, target_hidden=ctx, position_embeddings=pe, attention_mask=mask)[0]
    if ak is not None:
        x = per_block(layer.attention_conv.finish, x, ak).reshape(S, NB, H)
    h = res + x
    res = h
    x = layer.post_attention_layernorm(h)
    mk = None
    if layer.mlp_conv is not None:
        x, mk = per_block(layer.mlp_conv.prepare, x)
        x = x.reshape(S, NB, H)
    x = layer.mlp(x)
    if mk is not None:
        x = per_block(layer.mlp_conv.finish, x, mk).reshape(S, NB, H)
    return res + x


def draft_hidden(model, embed, feats, tokens, anchors, B: int):
    """Post-norm draft hidden [S, N, B, H] of blocks [anchor, mask x (B-1)] at anchors [S, N].

    feats [S, T, n*H] target tap features; tokens [S, T]; block rows see context positions < anchor
    and every row of their own block."""
    import torch
    S, T = tokens.shape
    N = anchors.shape[1]
    dev = tokens.device
    ids = torch.full((S, N, B), MASK_ID, dtype=torch.long, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    noise = embed[ids].reshape(S, N * B, -1)
    rows = (anchors[:, :, None] + torch.arange(B, device=dev)).reshape(S, N * B)
    pos = torch.cat([torch.arange(T, device=dev).expand(S, T), rows], 1)
    ctx_vis = torch.arange(T, device=dev)[None, None, :] < anchors.repeat_interleave(B, 1)[:, :, None]
    blk = torch.arange(N * B, device=dev) // B
    blk_vis = (blk[:, None] == blk[None, :]).expand(S, -1, -1)
    mask = torch.cat([ctx_vis, blk_vis], 2)[:, None]
    ctx = model.hidden_norm(model.fc(feats.to(model.fc.weight.dtype)))
    pe = model.rotary_emb(noise, pos)
    h = noise
    for layer in model.layers:
        h = layer_forward(layer, h, ctx, mask, pe, N)
    return model.norm(h).reshape(S, N, B, -1)


def decay(n: int, first: int, device):
    import torch
    k = torch.arange(n, device=device, dtype=torch.float32)
    return torch.exp(-(k - first) / GAMMA).clamp(max=1.0)


def losses(family, model, heads, embed, batch, B):
    """Scalar loss and a dict of metrics for one batch (dict with tokens, feats, last, anchors)."""
    import torch
    import torch.nn.functional as F
    tokens, anchors = batch["tokens"], batch["anchors"]
    h = draft_hidden(model, embed, batch["feats"], tokens, anchors, B).float()
    S, N = anchors.shape
    offs = torch.arange(B, device=tokens.device)
    if family in ("dflash", "dflash2"):
        hs = h[:, :, 1:]                                         # rows 1..B-1
        gold = tokens.gather(1, (anchors[:, :, None] + offs[1:]).reshape(S, -1)).reshape(S, N, B - 1)
        w = decay(B - 1, 0, tokens.device)
        u = hs @ embed.float().T
        ce = F.cross_entropy(u.reshape(-1, u.shape[-1]), gold.reshape(-1), reduction="none").reshape(S, N, B - 1)
        loss = (ce * w).sum() / (w.sum() * S * N)
        m = {"ce": loss.detach(), "top1": (u.argmax(-1) == gold).float().mean().detach()}
        if family == "dflash2":
            sel = model.candidate_selector
            prev = tokens.gather(1, (anchors[:, :, None] + offs[:-1]).reshape(S, -1)).reshape(S, N, B - 1)
            K = sel.top_k
            cand = u.detach().topk(K, -1).indices
            cand = torch.cat([cand, gold[..., None]], -1)         # K + 1 candidates, gold last
            dup = (cand[..., :K] == gold[..., None]).any(-1)
            p = sel.hidden_projection(hs)
            score = u.gather(-1, cand) + torch.einsum("snbkr,snbr->snbk", sel.successor_codebook(cand),
                                                      sel.predecessor_codebook(prev) * p)
            score[..., K] = torch.where(dup, torch.full_like(score[..., K], -1e4), score[..., K])
            target = torch.where(dup, (cand[..., :K] == gold[..., None]).int().argmax(-1),
                                 torch.full_like(gold, K))
            sce = F.cross_entropy(score.reshape(-1, K + 1), target.reshape(-1), reduction="none").reshape(S, N, B - 1)
            sl = (sce * w).sum() / (w.sum() * S * N)
            loss = loss + sl
            m.update(sel_ce=sl.detach(), sel_top1=(score.argmax(-1) == target).float().mean().detach())
        return loss, m
    # DSpark: rows 0..B-1 predict a+1..a+B
    gold = tokens.gather(1, (anchors[:, :, None] + offs + 1).reshape(S, -1)).reshape(S, N, B)
    prev = tokens.gather(1, (anchors[:, :, None] + offs).reshape(S, -1)).reshape(S, N, B)
    w = decay(B, 0, tokens.device)
    e1 = heads["markov_w1"](prev)
    logits = h @ embed.float().T + heads["markov_w2"](e1)
    last = batch["last"].float().gather(1, (anchors[:, :, None] + offs).reshape(S, -1, 1).expand(-1, -1, h.shape[-1]))
    p_t = torch.softmax(last.reshape(S, N, B, -1) @ embed.float().T, -1)
    q = torch.softmax(logits, -1)
    tv = 0.5 * (q - p_t).abs().sum(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), gold.reshape(-1), reduction="none").reshape(S, N, B)
    conf = heads["confidence"](torch.cat([h, e1], -1))[..., 0]
    bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach(), reduction="none")
    norm = w.sum() * S * N
    loss = ((0.1 * ce + 0.9 * tv + bce) * w).sum() / norm
    return loss, {"ce": ((ce * w).sum() / norm).detach(), "tv": ((tv * w).sum() / norm).detach(),
                  "bce": ((bce * w).sum() / norm).detach(),
                  "top1": (logits.argmax(-1) == gold).float().mean().detach()}


def sample_anchors(n_seq, n_anchor, lo, hi, gen, device):
    import torch
    return torch.randint(lo, hi, (n_seq, n_anchor), device=device, generator=gen).sort(-1).values


# --------------------------------------------------------------------------- evaluation

def propose(family, model, heads, embed, h, anchor_tok):
    """Greedy drafts [S, N, D] from post-norm hidden h [S, N, B, H] (D = B-1, or B for DSpark)."""
    import torch
    h = h.float()
    if family == "dflash":
        return (h[:, :, 1:] @ embed.float().T).argmax(-1)
    if family == "dflash2":
        sel = model.candidate_selector
        hs = h[:, :, 1:]
        u = hs @ embed.float().T
        val, cand = u.topk(sel.top_k, -1)
        p = sel.hidden_projection(hs)
        prev, out = anchor_tok, []
        for s in range(hs.shape[2]):
            sc = val[:, :, s] + torch.einsum("snkr,snr->snk", sel.successor_codebook(cand[:, :, s]),
                                             sel.predecessor_codebook(prev) * p[:, :, s])
            prev = cand[:, :, s].gather(-1, sc.argmax(-1, keepdim=True))[..., 0]
            out.append(prev)
        return torch.stack(out, -1)
    base = h @ embed.float().T
    prev, out = anchor_tok, []
    for s in range(h.shape[2]):
        prev = (base[:, :, s] + heads["markov_w2"](heads["markov_w1"](prev))).argmax(-1)
        out.append(prev)
    return torch.stack(out, -1)


def block_acceptance(family, model, heads, embed, data, B, device, stride=8, chunk=32):
    """Mean acceptance length (1 + accepted greedy drafts) over anchors every ``stride`` positions
    of the held-out continuations: the AL a chain verify of the whole block would see."""
    import torch
    tokens_all, feats_all, P = data["tokens"], data["feats"], data["prompt"]
    T = tokens_all.shape[1]
    D = B if family == "dspark" else B - 1   # drafts per block; draft k is the token at anchor + k
    anchors = torch.arange(P, T - B - 1, stride, device=device)
    acc = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for i in range(0, len(tokens_all), chunk):
            tok = tokens_all[i:i + chunk].to(device)
            an = anchors.expand(len(tok), -1).contiguous()
            h = draft_hidden(model, embed, feats_all[i:i + chunk].to(device), tok, an, B)
            drafts = propose(family, model, heads, embed, h, tok.gather(1, an))
            gold = tok.gather(1, (an[:, :, None] + torch.arange(1, 1 + D, device=device)).reshape(len(tok), -1))
            ok = (drafts.reshape(len(tok), -1, D) == gold.reshape(len(tok), -1, D)).int()
            acc.append(ok.cumprod(-1).sum(-1).flatten().float())
    return 1.0 + torch.cat(acc).mean().item()


def reference_check(family, model, embed, data, B, device):
    """Max |training forward - dflash reference forward| of the post-norm hidden for one block."""
    import torch
    tok = data["tokens"][:1].to(device)
    feats = data["feats"][:1].to(device).float()
    a = data["prompt"] + 5
    with torch.no_grad():
        h = draft_hidden(model, embed, feats, tok, torch.tensor([[a]], device=device), B)[0, 0]
        ids = torch.full((1, B), MASK_ID, device=device)
        ids[0, 0] = tok[0, a]
        ref = model(position_ids=torch.arange(a + B, device=device)[None], noise_embedding=embed[ids],
                    target_hidden=feats[:, :a])[0]
    return (h - ref).abs().max().item()


# --------------------------------------------------------------------------- train (GPU)

def export(family, model, heads, out: Path) -> Path:
    """Write the published HF layout: config.json + model.safetensors (F32)."""
    from safetensors.torch import save_file
    d = out / family
    d.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("rotary_emb"):
            continue
        if k.startswith("candidate_selector.") and k.endswith("_codebook.weight"):
            k = k[: -len(".weight")]  # published codebooks are raw parameters
        sd[k] = v.detach().float().cpu().contiguous()
    if heads is not None:
        sd["markov_head.markov_w1.weight"] = heads["markov_w1"].weight.detach().float().cpu().contiguous()
        sd["markov_head.markov_w2.weight"] = heads["markov_w2"].weight.detach().float().cpu().contiguous()
        sd["confidence_head.proj.weight"] = heads["confidence"].weight.detach().float().cpu().contiguous()
        sd["confidence_head.proj.bias"] = heads["confidence"].bias.detach().float().cpu().contiguous()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(draft_config(family), indent=1))
    return d


def train(args) -> int:
    import torch
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    family, B = args.family, FAMILIES[args.family]["block"]
    data_dir, out = Path(args.gen), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fh = (out / f"{family}_log.jsonl").open("w")
    train_d = torch.load(data_dir / "train.pt")
    P, T = train_d["prompt"], train_d["tokens"].shape[1]
    tokens = train_d["tokens"].to(device)
    feats = train_d["feats"].to(device)
    last = train_d["last"].to(device) if family == "dspark" else None
    from safetensors.torch import load_file
    target = load_file(str(Path(args.data) / "target" / "model.safetensors"))
    embed = target["model.embed_tokens.weight"].float().to(device)  # frozen target embedding = tied lm_head

    model, heads = build_drafter(family, target["model.norm.weight"].float())
    model.to(device).train()
    params = list(model.parameters()) + (list(heads.parameters()) if heads is not None else [])
    if heads is not None:
        heads.to(device).train()
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=amp)
    log(fh, event="start", family=family, params=n_params, seqs=list(tokens.shape), block=B, args=vars(args))
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    hi = T - B - (1 if family == "dspark" else 0)
    t0, step = time.time(), 0
    while True:
        el = time.time() - t0
        if el >= args.budget_s or (args.max_steps and step >= args.max_steps):
            break
        prog = min(1.0, max(el / args.budget_s, step / args.max_steps if args.max_steps else 0.0))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(tokens), (args.batch,), device=device, generator=gen)
        b = {"tokens": tokens[idx], "feats": feats[idx], "last": last[idx] if last is not None else None,
             "anchors": sample_anchors(args.batch, args.anchors, P, hi, gen, device)}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss, m = losses(family, model, heads, embed, b, B)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step == 1:
            log(fh, step=step, loss=round(loss.item(), 4), lr=round(lr, 6), gnorm=round(gn.item(), 3),
                elapsed=round(time.time() - t0, 1), **{k: round(v.item(), 4) for k, v in m.items()})
    train_s = time.time() - t0
    model.eval()
    if heads is not None:
        heads.eval()
    summary = {"family": family, "steps": step, "train_s": round(train_s, 1), "params": n_params, "block_size": B,
               "blocks_seen": step * args.batch * args.anchors}
    for split in ("code", "prose"):
        d = torch.load(data_dir / f"{split}.pt")
        summary[f"heldout_block_al_{split}"] = round(block_acceptance(family, model, heads, embed, d, B, device), 3)
    summary["reference_check_max_abs"] = reference_check(family, model, embed, torch.load(data_dir / "code.pt"), B,
                                                         device)
    if not summary["reference_check_max_abs"] < REFERENCE_TOL:
        raise RuntimeError(f"{family}: training forward differs from dflash's reference forward by "
                           f"{summary['reference_check_max_abs']:.3g} (> {REFERENCE_TOL})")
    log(fh, event="done", **summary)
    d = export(family, model, heads, out)
    (d / "summary.json").write_text(json.dumps(summary, indent=1))
    with tarfile.open(out / f"{family}.tar", "w") as tf:
        tf.add(d, arcname=family)
    fh.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="prompt windows + F16-rounded target (CPU)")
    p.add_argument("--tokens", default="build/demo-tokens")
    p.add_argument("--target-hf", default="build/demo-target-hf")
    p.add_argument("--out", default=".demowork/drafter-data")
    p.add_argument("--prompt", type=int, default=192, help="prompt tokens per window")
    p.add_argument("--n-train", type=int, default=12288)
    p.add_argument("--n-eval", type=int, default=128)
    p.add_argument("--seed", type=int, default=7)
    p = sub.add_parser("generate", help="greedy continuations + captured features (GPU)")
    p.add_argument("--data", default=".demowork/drafter-data")
    p.add_argument("--out", default="/tmp/drafter-gen")
    p.add_argument("--new", type=int, default=192, help="greedy tokens generated per prompt")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts per split (smoke)")
    p = sub.add_parser("train", help="train one drafter family (GPU)")
    p.add_argument("--family", choices=sorted(FAMILIES), required=True)
    p.add_argument("--data", default=".demowork/drafter-data")
    p.add_argument("--gen", default="/tmp/drafter-gen")
    p.add_argument("--out", default="/tmp/drafters")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--anchors", type=int, default=24, help="random anchors (blocks) per sequence")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--budget-s", type=float, default=240.0, help="training wall-clock budget (seconds)")
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return {"prepare": prepare, "generate": generate, "train": train}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
