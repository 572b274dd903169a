"""Tiny random drafter checkpoints in the published HF layouts (DFlash, DSpark, DFlash 2).

Tensor names and shapes come from the reference model classes of PyPI ``dflash==0.1.0``
(``DFlashDraftModel`` / ``DFlash2DraftModel``, instantiated on CPU from the tiny config) when that
package is importable, and from the documented tensor lists of docs/drafters.md §2.3 / §5.4 / §6.4
otherwise; ``documented_names`` is the latter and a test checks both agree. DSpark has no torch
reference on PyPI, so its list is always the documented one (SpecForge packaging: heads inline in
model.safetensors, no embedding / lm_head; DeepSpec packaging adds the target copies).

Values are drawn from a numpy generator (stable across library versions): 2-D weights N(0, 0.05),
norm gains 1 + N(0, 0.1) (perturbed so a dropped or added +1 shows), conv base kernels N(0, 0.5),
biases N(0, 0.1). Published codebooks are raw parameters, written without ``.weight``.
Checkpoints are written as BF16 (the published dtype) or F32 safetensors by a small numpy writer.
"""
from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import numpy as np

TINY = dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16,
            taps=[1, 3, 5], n_target=6, block=8, mask=500, theta=1e7)
DSPARK_RANK = 32
DF2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}


def make_config(family: str, *, rope: str = "nested", block_at: str | None = None, yarn: bool = False,
                sliding: str = "none", packaging: str = "specforge", confidence: bool = True,
                with_markov: bool = True, dims: dict | None = None) -> dict:
    """A raw ``config.json`` dict for a tiny drafter.

    rope: ``nested`` (transformers ≥ 5 ``rope_parameters``) or ``toplevel`` (``rope_theta``).
    block_at: where ``block_size`` lives (``dflash_config`` or ``top``); C19. Default as published:
    top level for z-lab DFlash 1 and SpecForge / DeepSpec DSpark, inside dflash_config for DFlash 2.
    yarn: declare YaRN (factor 32, original 8192, β 32/1), as RadixArk DSpark does.
    sliding: ``none`` (Qwen3.5 DFlash), ``qwen36`` (sliding + last full, window 32),
    ``qwen36_noflag`` (the same without ``use_sliding_window``: causal layers, no window) or ``all``
    (DFlash 2: every layer sliding, ``is_causal: false``).
    packaging (DSpark): ``specforge`` (keys nested in dflash_config) or ``deepspec`` (top level).
    dims: overrides of :data:`TINY` entries (e.g. hidden / vocab / taps to match a tiny target).
    """
    t = {**TINY, **(dims or {})}
    cfg: dict = {
        "architectures": [ARCHITECTURES[family] if not (family == "dspark" and packaging == "deepspec")
                          else "Qwen3DSparkModel"],
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": t["hidden"], "intermediate_size": t["inter"], "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"], "num_key_value_heads": t["kv_heads"], "head_dim": t["head_dim"],
        "rms_norm_eps": 1e-6, "vocab_size": t["vocab"], "max_position_embeddings": 40960,
        "num_target_layers": t["n_target"], "tie_word_embeddings": False, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": t["mask"], "target_layer_ids": list(t["taps"])},
    }
    rope_params = {"rope_type": "default", "rope_theta": t["theta"]}
    if yarn:
        rope_params = {"rope_type": "yarn", "rope_theta": t["theta"], "factor": 32.0,
                       "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0}
    if rope == "nested":
        cfg["rope_parameters"] = rope_params
    else:
        cfg["rope_theta"] = t["theta"]
        if yarn:
            cfg["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if block_at is None:
        block_at = "dflash_config" if family == "dflash2" else "top"
    if block_at == "dflash_config":
        cfg["dflash_config"]["block_size"] = t["block"]
    else:
        cfg["block_size"] = t["block"]
    if sliding in ("qwen36", "qwen36_noflag"):
        cfg.update(layer_types=["sliding_attention"] * (t["layers"] - 1) + ["full_attention"],
                   sliding_window=32, use_sliding_window=True)
        if sliding == "qwen36_noflag":  # transformers / dflash drop the window without the flag
            del cfg["use_sliding_window"]
    elif sliding == "all":
        cfg.update(layer_types=["sliding_attention"] * t["layers"], sliding_window=32,
                   use_sliding_window=True, is_causal=False)
    if family == "dflash2":
        cfg["dflash_config"].update(DF2)
    if family == "dspark":
        heads = {"markov_rank": DSPARK_RANK, "markov_head_type": "vanilla",
                 "enable_confidence_head": confidence, "confidence_head_with_markov": with_markov and confidence}
        if packaging == "specforge":
            cfg["dflash_config"].update(projector_type="dspark", **heads)
        else:  # DeepSpec: everything at top level, no dflash_config
            dc = cfg.pop("dflash_config")
            cfg.update(mask_token_id=dc["mask_token_id"], target_layer_ids=dc["target_layer_ids"], **heads)
            if "block_size" in dc:
                cfg["block_size"] = dc["block_size"]
            cfg["layer_types"] = ["full_attention"] * t["layers"]
    return cfg


def documented_names(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names → torch shapes from drafters.md §2.3 / §5.4 / §6.4 for ``cfg``."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dc = cfg.get("dflash_config", {})
    taps = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
    V = cfg["vocab_size"]
    arch = cfg["architectures"][0]
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(taps) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
        if arch == "DFlash2DraftModel":
            K, G = dc["conv_kernel_size"], H // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, K, H)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * K * G, H)
    if arch == "DFlash2DraftModel":
        R = dc["selector_rank"]
        out.update({"candidate_selector.predecessor_codebook": (V, R),
                    "candidate_selector.successor_codebook": (V, R),
                    "candidate_selector.hidden_projection.weight": (R, H)})
    if arch in ("DSparkDraftModel", "Qwen3DSparkModel"):
        r = dc.get("markov_rank", cfg.get("markov_rank"))
        out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
        conf = dc.get("enable_confidence_head", cfg.get("enable_confidence_head"))
        wm = dc.get("confidence_head_with_markov", cfg.get("confidence_head_with_markov"))
        if conf:
            out.update({"confidence_head.proj.weight": (1, H + (r if wm else 0)), "confidence_head.proj.bias": (1,)})
        if arch == "Qwen3DSparkModel":  # DeepSpec ships frozen target copies
            out.update({"embed_tokens.weight": (V, H), "lm_head.weight": (V, H)})
    return out


def reference_names(cfg: dict) -> dict[str, tuple[int, ...]] | None:
    """Names → shapes of dflash 0.1.0's model class for ``cfg`` (codebooks without ``.weight``, as
    published), or None when ``dflash`` / torch are not importable or the family has no class."""
    arch = cfg["architectures"][0]
    if arch not in ("DFlashDraftModel", "DFlash2DraftModel"):
        return None
    try:
        from dflash import DFlash2DraftModel, DFlashDraftModel
        from transformers import Qwen3Config
    except Exception:  # noqa: BLE001 - any import failure means "oracle absent"
        return None
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "model_type", "dtype")}
    qc = Qwen3Config(**kwargs)
    qc.dflash_config = copy.deepcopy(cfg.get("dflash_config", {}))
    if "is_causal" in cfg:
        qc.is_causal = cfg["is_causal"]
    cls = DFlash2DraftModel if arch == "DFlash2DraftModel" else DFlashDraftModel
    model = cls(qc)
    out = {}
    for name, v in model.state_dict().items():
        if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
            name = name[: -len(".weight")]
        out[name] = tuple(v.shape)
    return out


def random_weights(names: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fixed-distribution float32 values for every tensor in ``names``."""
    out = {}
    for name, shape in names.items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + rng.normal(0, 0.1, shape)).astype(np.float32)
        elif name.endswith("base_kernel"):
            out[name] = rng.normal(0, 0.5, shape).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = rng.normal(0, 0.1, shape).astype(np.float32)
        else:
            out[name] = rng.normal(0, 0.05, shape).astype(np.float32)
    return out


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 → bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """Write float32 ``tensors`` as a safetensors file of ``dtype`` (BF16, F16 or F32)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        raw = (to_bf16_bits(a) if dtype == "BF16" else a.astype(np.float16 if dtype == "F16" else np.float32)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for b in blobs:
            fh.write(b)


def write_checkpoint(folder: Path, cfg: dict, tensors: dict[str, np.ndarray], dtype: str = "BF16",
                     shards: int = 1) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (or ``shards`` files with an index)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, allow_nan=True))
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, dtype)
    else:
        names = sorted(tensors)
        per = math.ceil(len(names) / shards)
        weight_map = {}
        for s in range(shards):
            part = names[s * per:(s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(folder / fname, {n: tensors[n] for n in part}, dtype)
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def make_drafter(folder: Path, family: str, rng: np.random.Generator, *, dtype: str = "BF16", shards: int = 1,
                 cfg: dict | None = None, scales: dict[str, float] | None = None,
                 **config_kwargs) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """Write a tiny random drafter of ``family`` under ``folder``; return (folder, config, float32
    tensors as stored, i.e. after BF16 rounding when dtype is BF16). ``scales`` multiplies every
    tensor whose name contains a key by its value (forward tests use it to make the random
    drafter's rows, Markov bias and selector term large enough to matter)."""
    cfg = cfg if cfg is not None else make_config(family, **config_kwargs)
    names = reference_names(cfg) or documented_names(cfg)
    tensors = random_weights(names, rng)
    for part, f in (scales or {}).items():
        tensors = {k: (v * np.float32(f) if part in k else v) for k, v in tensors.items()}
    if dtype == "BF16":
        tensors = {k: from_bf16_bits(to_bf16_bits(v)) for k, v in tensors.items()}
    elif dtype == "F16":
        tensors = {k: v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}
    write_checkpoint(folder, cfg, tensors, dtype, shards)
    return folder, cfg, tensors


# ------------------------------------------------------------------ forward-parity helpers


def reference_model(cfg: dict, tensors: dict[str, np.ndarray], dtype: str = "float64", rope64: bool = True):
    """dflash 0.1.0's ``DFlashDraftModel`` / ``DFlash2DraftModel`` for ``cfg`` with ``tensors``
    (HF names as written by :func:`make_drafter`; published codebook names without ``.weight``)
    loaded strictly, in eval mode, as torch ``dtype``. A DSpark config gets a DFlashDraftModel of
    its backbone (the DSpark backbone is the DFlash graph, drafters.md §5; its heads are skipped).

    rope64: replace the model's cos/sin table by float64 angles from the published formulas
    (:func:`f64_yarn_inv_freq` / θ^(−2i/d), ×(0.1·ln s + 1) under YaRN). transformers'
    ``Qwen3RotaryEmbedding`` forms pos·inv_freq in float32 whatever the model dtype, which puts
    ≈ pos·6e-8 rad on every angle (≈ 1e-6 relative on the logits at position 50, 1e-5 at 500)
    — a limit of the oracle, not of the math under test. Everything else (masks, attention,
    norms, convs, selector) is dflash's own code.
    Raises ImportError when dflash / torch are absent."""
    import torch
    from dflash import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    arch = cfg["architectures"][0]
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "model_type", "dtype")}
    qc = Qwen3Config(**kwargs)
    dc = copy.deepcopy(cfg.get("dflash_config", {}))
    for k in ("mask_token_id", "target_layer_ids", "block_size"):  # DeepSpec packaging: top level
        if k in cfg and k not in dc:
            dc[k] = cfg[k]
    qc.dflash_config = dc
    if "is_causal" in cfg:
        qc.is_causal = cfg["is_causal"]
    cls = DFlash2DraftModel if arch == "DFlash2DraftModel" else DFlashDraftModel
    model = cls(qc).eval()
    state = {}
    for name, v in tensors.items():
        if name.startswith(("markov_head.", "confidence_head.", "embed_tokens.", "lm_head.")):
            continue
        if name.startswith("candidate_selector.") and name.endswith("_codebook"):
            name += ".weight"
        state[name] = torch.from_numpy(np.asarray(v, np.float32))
    model.load_state_dict(state, strict=True)
    model = model.to(getattr(torch, dtype))
    if rope64:
        rp = cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"], **cfg.get("rope_scaling", {})}
        hd = cfg["head_dim"]
        if rp.get("rope_type") == "yarn":
            inv, ms = f64_yarn_inv_freq(hd, rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"],
                                        rp.get("beta_fast", 32.0), rp.get("beta_slow", 1.0))
        else:
            inv, ms = 1.0 / rp["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd), 1.0
        inv_t = torch.from_numpy(inv)

        def rotary(x, position_ids):
            f = position_ids.to(torch.float64)[..., None] * inv_t
            e = torch.cat([f, f], dim=-1)
            return (e.cos() * ms).to(x.dtype), (e.sin() * ms).to(x.dtype)

        model.rotary_emb.forward = rotary
    return model


def reference_forward(model, features: np.ndarray, block_embeddings: np.ndarray, start: int) -> np.ndarray:
    """Post-final-norm draft hidden [B, H] (float64 numpy) of the reference ``model`` for a block
    at positions start..start+B−1 over context features [start, N·H] (positions 0..start−1),
    computed without a cache (keys = all context rows then the block; ZL-0.1.0 masks)."""
    import torch

    dt = next(model.parameters()).dtype
    B = block_embeddings.shape[0]
    with torch.no_grad():
        h = model(position_ids=torch.arange(start + B)[None],
                  noise_embedding=torch.from_numpy(np.asarray(block_embeddings, np.float64)).to(dt)[None],
                  target_hidden=torch.from_numpy(np.asarray(features, np.float64)).to(dt)[None])
    return h[0].double().numpy()


FORWARD_SCALES = {"self_attn.": 3.0, "mlp.": 2.0, "fc.": 2.0, "markov_head.": 40.0, "candidate_selector.": 12.0}
"""Weight multipliers for forward tests: with the plain N(0, 0.05) fill a tiny drafter's block rows
are near copies of the mask embedding (every row proposes the same token) and the Markov /
selector terms are negligible; these make rows differ and the family heads change choices."""


def target_tables(cfg: dict, rng: np.random.Generator, mask_scale: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in target embedding and lm_head, float32 [V, H] each: N(0, 1) and N(0, 0.3), the
    mask token's embedding row scaled by ``mask_scale`` (so the block rows carry context)."""
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    emb = rng.normal(0, 1, (V, H)).astype(np.float32)
    mask = cfg.get("dflash_config", {}).get("mask_token_id", cfg.get("mask_token_id"))
    emb[mask] *= np.float32(mask_scale)
    return emb, rng.normal(0, 0.3, (V, H)).astype(np.float32)


def _checked_error(ours: np.ndarray, ref: np.ndarray, tol: float, what: str) -> float:
    """max|ours − ref| after asserting it is within ``tol`` of max|ref| (the caller's bound)."""
    e = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    assert e <= tol * scale, f"{what}: error {e:.3g} exceeds {tol:g} of max|ref| {scale:.3g}"
    return e


def assert_greedy_tokens(tokens: np.ndarray, ours: np.ndarray, ref: np.ndarray, tol: float) -> None:
    """Greedy proposals against reference logits, exact except at genuine near-ties.

    ``ours`` (specd's own logits) must be within ``tol`` of max|ref| of the reference, and ``tokens``
    exactly their argmax (first maximum: no tolerance, the same values). With e = max|ours − ref|
    (the measured error, at most that bound), the argmax of ``ours`` can only be a token whose
    reference logit is within 2e of the row's maximum, so that is required of every row; on a row
    whose reference top-2 gap exceeds 2e it is exactly tokens == argmax(ref). A plain
    ``tokens == ref.argmax(1)`` fails by chance on a random fixture whenever a row's top-2 gap falls
    below the F32-vs-F64 error: the smallest row gap measured was 3.2e-6 of max|ref| over ~340
    proposals of test_compaction_many_small_ingests_f16_kv_context_cap (6 seeds), against logit
    errors of 4e-7 to 4e-6 of max|ref| (~6e-3 chance of a failure per run there, ~1e-4 to 5e-4 per
    proposal check elsewhere)."""
    tokens = np.asarray(tokens)
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert tokens.shape == ref.shape[:-1] == ours.shape[:-1], (tokens.shape, ours.shape, ref.shape)
    e = _checked_error(ours, ref, tol, "greedy logits")
    np.testing.assert_array_equal(tokens, ours.argmax(-1))
    short = ref.max(-1) - np.take_along_axis(ref, tokens[..., None].astype(np.int64), -1)[..., 0]
    bad = np.nonzero(short > 2 * e)
    assert not bad[0].size, (f"rows {bad[0].tolist()}: tokens {tokens[bad].tolist()} are {short[bad].tolist()} "
                             f"below the reference maximum (argmax {ref.argmax(-1)[bad].tolist()}), more than "
                             f"2 x the logit error {e:.3g}")


def f64_sampling_probs(scores: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """dflash 0.1.0 ``_sampling_probs`` (dflash/model.py) in float64 numpy: z = scores / T; if 0 < top_k < V
    keep the top_k (ties: lower index first); softmax; if top_p < 1 keep, in descending order, the tokens
    whose preceding mass is < top_p, and renormalise. [n, V] float64. (dflash's own runs in float32,
    ``logits.float()``: its rounding of z alone moves q by up to ~1e-6 at |z| ~ 80, so it cannot check a
    float32 q tightly, and its float32 cumsum can place the top-p cut differently from a float64 one.)"""
    z = np.asarray(scores, np.float64) / float(temperature)
    if 0 < top_k < z.shape[-1]:
        drop = np.argsort(-z, axis=-1, kind="stable")[..., top_k:]
        z = z.copy()
        np.put_along_axis(z, drop, -np.inf, axis=-1)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, axis=-1)
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp * ((np.cumsum(sp, axis=-1) - sp) < top_p), axis=-1)
        p /= p.sum(-1, keepdims=True)
    return p


def assert_ranked_ids(ids: np.ndarray, ours: np.ndarray, ref: np.ndarray, tol: float) -> None:
    """Top-K ids [n, K] ranked by ``ours`` [n, V] (specd's scores, within ``tol`` of max|ref| of the
    reference scores: asserted; the ids exactly their stable descending order, no tolerance), against
    the reference, exact except at genuine near-ties: with e = max|ours − ref|, each id's reference
    score is at least the next one's − 2e and at least that of every id left out − 2e (the order and
    the set are then exactly the reference's wherever its gaps exceed 2e; see
    :func:`assert_greedy_tokens`)."""
    ids = np.asarray(ids).astype(np.int64)
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    k = ids.shape[-1]
    e = _checked_error(ours, ref, tol, "ranked scores")
    np.testing.assert_array_equal(ids, np.argsort(-ours, axis=-1, kind="stable")[..., :k])
    r = np.take_along_axis(ref, ids, -1)
    out = ref.copy()
    np.put_along_axis(out, ids, -np.inf, -1)
    worst = np.maximum(np.max(r[..., 1:] - r[..., :-1], initial=-np.inf, axis=-1), out.max(-1) - r[..., -1])
    assert (worst <= 2 * e).all(), (f"reference order broken by {worst.max():.3g} > 2 x the score error {e:.3g} "
                                    f"in rows {np.nonzero(worst > 2 * e)[0].tolist()}")


def convert_tiny(folder: Path, outtype: str = "f32") -> Path:
    """Convert a tiny checkpoint folder with specd's converter; returns the GGUF path."""
    from specd.draft_worker.convert import convert_hf

    out = folder.parent / f"{folder.name}.{outtype}.gguf"
    convert_hf(folder, out, outtype, log=lambda s: None)
    return out


def f64_markov_reference(U: np.ndarray, hidden: np.ndarray, seed: int, W1: np.ndarray, W2: np.ndarray,
                         conf_w: np.ndarray | None = None, conf_b: float = 0.0, with_markov: bool = True,
                         chain: np.ndarray | None = None):
    """DSpark Markov chain + confidence in float64, written straight from drafters.md §5.2–5.3 /
    DSpark paper eq. 5 and 7 (no specd code): x_0 = seed; ℓ_k = U_k + W2 W1[x_{k−1}];
    x_k = argmax ℓ_k; c_k = σ(w·[h_k ; W1[x_{k−1}]] + b). U [n, V], hidden [n, H], W1/W2 [V, r].
    ``chain`` (the drafts under test): x_{k−1} = chain[k−1] instead of the reference's own argmax, so
    row k is the reference's ℓ_k given the same predecessor even where a near-tie let the chain take
    the other token (check the choices with :func:`assert_greedy_tokens`; tokens are still argmax ℓ_k).
    Returns (tokens [n], ℓ [n, V], c [n] or None)."""
    U, W1, W2 = (np.asarray(a, np.float64) for a in (U, W1, W2))
    prev, toks, ells, confs = int(seed), [], [], []
    for k in range(U.shape[0]):
        ell = U[k] + W2 @ W1[prev]
        if conf_w is not None:
            x = np.concatenate([hidden[k], W1[prev]]) if with_markov else np.asarray(hidden[k], np.float64)
            confs.append(1.0 / (1.0 + np.exp(-(np.dot(np.asarray(conf_w, np.float64).reshape(-1), x) + conf_b))))
        toks.append(int(np.argmax(ell)))
        prev = toks[-1] if chain is None else int(chain[k])
        ells.append(ell)
    return np.array(toks), np.stack(ells), (np.array(confs) if conf_w is not None else None)


def f64_selector_reference(unary: np.ndarray, hidden: np.ndarray, seed: int, hproj: np.ndarray,
                           pred: np.ndarray, succ: np.ndarray, top_k: int, chain: np.ndarray | None = None,
                           candidates: np.ndarray | None = None):
    """DFlash 2 candidate-selector greedy chain in float64 from drafters.md §6.3. Returns
    (tokens [n], candidate ids [n, K] sorted by unary, scores [n, K]). ``chain`` / ``candidates`` (the
    drafts under test): the predecessor of row s + 1 is chain[s] and row s scores candidates[s] instead
    of the reference's own choices, so each row is the reference given the same inputs even where a
    near-tie went the other way (check the choices with :func:`assert_ranked_ids` /
    :func:`assert_greedy_tokens`)."""
    unary, hidden, hproj, pred, succ = (np.asarray(a, np.float64) for a in (unary, hidden, hproj, pred, succ))
    prev, toks, cands, scores = int(seed), [], [], []
    for s in range(unary.shape[0]):
        c = np.argsort(-unary[s], kind="stable")[:top_k] if candidates is None else np.asarray(candidates[s])
        sc = unary[s, c] + succ[c] @ (pred[prev] * (hproj @ hidden[s]))
        toks.append(int(c[int(np.argmax(sc))]))
        prev = toks[-1] if chain is None else int(chain[s])
        cands.append(c)
        scores.append(sc)
    return np.array(toks), np.stack(cands), np.stack(scores)


def f64_yarn_inv_freq(dim: int, theta: float, factor: float, orig: int, beta_fast: float = 32.0,
                      beta_slow: float = 1.0) -> tuple[np.ndarray, float]:
    """YaRN inverse frequencies and cos/sin multiplier in float64, from the YaRN paper (Peng et al.
    2023) as transformers ``_compute_yarn_parameters`` states it (truncate=True): dims rotating
    more than β_fast times over the original window keep their frequency, fewer than β_slow times
    are divided by the factor, a linear ramp in between; multiplier 0.1·ln(factor) + 1."""
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrap, interp = 1.0 / base, 1.0 / (factor * base)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return interp * ramp + extrap * (1 - ramp), 0.1 * math.log(factor) + 1.0


def f64_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, mscale: float = 1.0) -> np.ndarray:
    """NeoX ("rotate half") RoPE over the whole head in float64: x [n, heads, d], pos [n]."""
    a = np.asarray(pos, np.float64)[:, None] * inv_freq[None, :]  # [n, d/2]
    cos, sin = (np.concatenate([f(a), f(a)], 1)[:, None, :] * mscale for f in (np.cos, np.sin))
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def f64_forward(cfg: dict, tensors: dict[str, np.ndarray], features: np.ndarray, block_emb: np.ndarray,
                start: int, return_layer0_scores: bool = False):
    """DFlash forward in float64 numpy, straight from drafters.md §3.1–3.2 (no specd code, no torch):
    full-attention bidirectional layers only (every layer sees every context row and block row),
    RoPE θ / YaRN from ``cfg``'s ``rope_parameters``. Returns the post-final-norm hidden [B, H]
    (and, if asked, layer 0's pre-softmax scores [Hq, B, start + B])."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rp = cfg["rope_parameters"]
    if rp.get("rope_type") == "yarn":
        inv, ms = f64_yarn_inv_freq(hd, rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"],
                                    rp.get("beta_fast", 32.0), rp.get("beta_slow", 1.0))
    else:
        inv, ms = 1.0 / rp["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd), 1.0

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    c = rms(np.asarray(features, np.float64) @ t["fc.weight"].T, t["hidden_norm.weight"])
    h = np.asarray(block_emb, np.float64)
    B = h.shape[0]
    pos_all = np.arange(start + B)
    scores0 = None
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        n = rms(h, t[p + "input_layernorm.weight"])
        kv_in = np.concatenate([c, n])
        q = rms((n @ t[p + "self_attn.q_proj.weight"].T).reshape(B, nh, hd), t[p + "self_attn.q_norm.weight"])
        k = rms((kv_in @ t[p + "self_attn.k_proj.weight"].T).reshape(-1, nkv, hd), t[p + "self_attn.k_norm.weight"])
        v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).reshape(-1, nkv, hd)
        q, k = f64_rope(q, pos_all[start:], inv, ms), f64_rope(k, pos_all, inv, ms)
        g = nh // nkv
        s = np.einsum("qhd,khd->hqk", q, np.repeat(k, g, axis=1)) / math.sqrt(hd)
        if i == 0:
            scores0 = s
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, np.repeat(v, g, axis=1)).reshape(B, nh * hd)
        h = h + o @ t[p + "self_attn.o_proj.weight"].T
        m = rms(h, t[p + "post_attention_layernorm.weight"])
        gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    out = rms(h, t["norm.weight"])
    return (out, scores0) if return_layer0_scores else out
