"""Tiny random Qwen3.5 checkpoints for target tests (recipe: docs/oracles.md §1.2).

Each :class:`TinySpec` is a transformers ``Qwen3_5TextConfig`` plus packaging options (the
``Qwen3_5ForConditionalGeneration`` key prefix with a vision tensor to drop, ``mtp.*`` tensors, a
synthetic byte-level BPE tokenizer, bfloat16 storage, sharding). :func:`build_checkpoint` fills a
model from a fixed-seed numpy generator and writes config.json + safetensors (+ tokenizer) into a
directory; nothing binary is committed — CI regenerates these in seconds.

Fill (oracles.md §1.2): 2-D weights N(0, 0.05); zero-centred norms N(0, 0.1) (perturbed, so a
missing +1 shows); GDN gated norm 1 + N(0, 0.1); ``A_log`` = log U(0.05, 1) (slow decay);
``dt_bias`` N(0, 0.5); the depthwise conv kernel N(0, 0.3) so every tap matters. ``A_log`` is
snapped once through the GGUF round trip (float32 → -exp in float64 → float32 → log in float64 →
float32), which makes it a fixed point: the GGUF stores ``ssm_a = -exp(A_log)`` in float32 and,
without snapping, about 40 % of random float32 ``A_log`` values come back one ulp off, which
would put a ~1e-8 floor under the exact-equality golden tests.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special (CONTROL)
ADDED_TOKENS = ["<think>", "</think>"]  # added, not special (USER_DEFINED), as in Qwen's tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                 "{% else %}<think>\n{% endif %}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one target pass.",
    "Gated DeltaNet layers keep a recurrent state; full attention layers keep a KV cache.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and symbols !@#$%^&*() appear too.",
] * 4 + [
    # scripts whose letters carry combining marks, frequent enough that BPE merges across the marks
    # (Qwen3.5's split keeps them with their letters; Qwen2's split cut them off)
    "नमस्ते दुनिया नमस्ते",
    "สวัสดี สวัสดี",
    "cafe\u0301 re\u0301sume\u0301",
] * 12


def _rope(theta: float, partial: float, mrope: list[int] | None) -> dict:
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    if mrope is not None:
        rope.update(mrope_section=mrope, mrope_interleaved=True)
    return rope


@dataclass(frozen=True)
class TinySpec:
    """A tiny checkpoint: Qwen3_5TextConfig fields plus how it is packaged."""

    name: str
    text: dict
    cond_gen: bool = False  # Qwen3_5ForConditionalGeneration layout (model.language_model.*)
    mtp: bool = False  # add one mtp.* block
    tokenizer: bool = False  # write tokenizer.json / tokenizer_config.json
    bf16: bool = False  # store 2-D weights in bfloat16 (1-D tensors stay float32)
    shards: int = 1  # >1: model-0000i-of-0000n.safetensors + index json
    write_interval: bool = False  # put full_attention_interval into config.json


SPECS: dict[str, TinySpec] = {
    # oracles.md §1.2 "smoke": GDN x3 + full at 3, r = 2
    "smoke": TinySpec("smoke", dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters=_rope(1e7, 0.25, [2, 1, 1]))),
    # oracles.md §1.2 "main": 8 layers, full at 3 and 7; every ne0 a multiple of 256 (K-quant fixtures)
    "main": TinySpec("main", dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters=_rope(1e7, 0.25, [3, 3, 2]))),
    # r = 3 (like the 27B), interval 2, partial rotary 0.5, tied embeddings, sharded, interval key kept
    "r3": TinySpec("r3", dict(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=_rope(1e6, 0.5, [4, 2, 2])),
        shards=2, write_interval=True),
    # real-checkpoint packaging: ForConditionalGeneration prefix, vision tensor, MTP, tokenizer,
    # bf16 storage; no mrope_section (converter default [11, 11, 10, 0]); interval 2, r = 2
    "condgen": TinySpec("condgen", dict(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters=_rope(1e7, 0.25, None)),
        cond_gen=True, mtp=True, tokenizer=True, bf16=True),
}


@dataclass
class TinyCheckpoint:
    """A written tiny checkpoint and its float64 reference model.

    ``hf``: the weights exactly as stored, float32 numpy, Qwen3_5ForCausalLM names (``lm_head``
    absent when tied); ``mtp``: the mtp.* tensors; ``model64``: the model in float64;
    ``prompt``/``logits64``: a fixed prompt and the model's float64 logits (T, V) for it.
    """

    spec: TinySpec
    path: Path
    config: Qwen3_5TextConfig
    hf: dict[str, np.ndarray]
    mtp: dict[str, np.ndarray]
    model64: Qwen3_5ForCausalLM
    prompt: list[int]
    logits64: np.ndarray
    token_ids: dict[str, int] = field(default_factory=dict)


def snap_a_log(a_log: np.ndarray) -> np.ndarray:
    """One -exp/log round trip at GGUF precision; the result is a fixed point of it."""
    ssm_a = (-np.exp(a_log.astype(np.float32).astype(np.float64))).astype(np.float32)
    return np.log(-ssm_a.astype(np.float64)).astype(np.float32)


def init_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The oracles.md §1.2 fill for one parameter, float32."""
    if name.endswith("A_log"):
        return snap_a_log(np.log(rng.uniform(0.05, 1.0, size=shape)))
    if name.endswith("dt_bias"):
        x = rng.normal(0.0, 0.5, size=shape)
    elif name.endswith("linear_attn.norm.weight"):
        x = 1.0 + rng.normal(0.0, 0.1, size=shape)
    elif name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_"):
        x = rng.normal(0.0, 0.1, size=shape)
    elif "conv1d" in name:
        x = rng.normal(0.0, 0.3, size=shape)
    else:
        x = rng.normal(0.0, 0.05, size=shape)
    return x.astype(np.float32)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


def _fill(names_shapes: list[tuple[str, tuple]], rng, bf16: bool) -> dict[str, np.ndarray]:
    out = {}
    for name, shape in names_shapes:
        x = init_value(name, tuple(shape), rng)
        out[name] = _bf16_round(x) if bf16 and x.ndim >= 2 else x
    return out


def mtp_shapes(model: Qwen3_5ForCausalLM) -> list[tuple[str, tuple]]:
    """mtp.* tensors of one MTP block: fc [H, 2H], three norms, one full-attention layer."""
    cfg = model.config
    H = cfg.hidden_size
    full = cfg.layer_types.index("full_attention")
    prefix = f"model.layers.{full}."
    layer = [(f"mtp.layers.0.{k[len(prefix):]}", tuple(v.shape))
             for k, v in model.state_dict().items() if k.startswith(prefix)]
    return [("mtp.fc.weight", (H, 2 * H)), ("mtp.pre_fc_norm_embedding.weight", (H,)),
            ("mtp.pre_fc_norm_hidden.weight", (H,)), ("mtp.norm.weight", (H,))] + layer


def build_model(spec: TinySpec, seed: int = 0):
    """(config, float32 model, stored weights, mtp weights) for a spec; deterministic in seed."""
    config = Qwen3_5TextConfig(**spec.text)
    model = Qwen3_5ForCausalLM(config).eval()
    rng = np.random.default_rng(seed)
    params = [(k, tuple(v.shape)) for k, v in model.state_dict().items()
              if not (config.tie_word_embeddings and k == "lm_head.weight")]
    hf = _fill(params, rng, spec.bf16)
    state = {k: torch.from_numpy(v) for k, v in hf.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    mtp = _fill(mtp_shapes(model), rng, spec.bf16) if spec.mtp else {}
    return config, model, hf, mtp


def logits64(model64: Qwen3_5ForCausalLM, prompt: list[int]) -> np.ndarray:
    """Full-sequence logits (T, V) of a float64 model for one prompt."""
    with torch.no_grad():
        return model64(input_ids=torch.tensor([prompt])).logits[0].numpy()


def load_reference(config: Qwen3_5TextConfig | dict, state: dict[str, np.ndarray]) -> Qwen3_5ForCausalLM:
    """A fresh Qwen3_5ForCausalLM in float64 with ``state`` loaded strictly (golden-from-GGUF)."""
    if isinstance(config, dict):
        config = Qwen3_5TextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    model = Qwen3_5ForCausalLM(config).eval().to(torch.float64)
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in state.items()},
                          strict=True)
    return model


def build_checkpoint(spec: TinySpec, path: Path, seed: int = 0) -> TinyCheckpoint:
    """Write the spec's checkpoint into ``path`` and return it with its float64 reference."""
    path.mkdir(parents=True, exist_ok=True)
    config, model, hf, mtp = build_model(spec, seed)
    token_ids = write_tokenizer(path, config.vocab_size) if spec.tokenizer else {}
    _write_config(spec, config, path, token_ids)
    _write_weights(spec, path, hf, mtp, seed)
    model64 = model.to(torch.float64)
    prompt = [int(t) for t in np.random.default_rng(seed + 1).integers(0, config.vocab_size, size=12)]
    return TinyCheckpoint(spec, path, config, hf, mtp, model64, prompt, logits64(model64, prompt), token_ids)


def _write_config(spec: TinySpec, config: Qwen3_5TextConfig, path: Path, token_ids: dict) -> None:
    text = config.to_dict()
    text["architectures"] = ["Qwen3_5ForCausalLM"]
    if spec.write_interval:
        text["full_attention_interval"] = spec.text["full_attention_interval"]
    if spec.mtp:
        text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    if token_ids:
        text["eos_token_id"] = token_ids["<|endoftext|>"]
    if spec.cond_gen:
        tied = text.pop("tie_word_embeddings")
        text = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": {**text, "model_type": "qwen3_5_text"}, "tie_word_embeddings": tied,
                "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32}}
    (path / "config.json").write_text(json.dumps(text, indent=2), encoding="utf-8")


def _stored_name(spec: TinySpec, name: str) -> str:
    if spec.cond_gen and name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def _write_weights(spec: TinySpec, path: Path, hf: dict, mtp: dict, seed: int) -> None:
    tensors = {}
    for name, x in {**hf, **mtp}.items():
        t = torch.from_numpy(x)
        tensors[_stored_name(spec, name)] = t.to(torch.bfloat16) if spec.bf16 and x.ndim >= 2 else t
    if spec.cond_gen:  # a vision tensor the converter must drop
        vision = np.random.default_rng(seed + 2).normal(size=(32, 3, 2, 2)).astype(np.float32)
        tensors["model.visual.patch_embed.proj.weight"] = torch.from_numpy(vision)
    names = list(tensors)
    if spec.shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(spec.shards):
        shard = f"model-{s + 1:05d}-of-{spec.shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::spec.shards]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def write_tokenizer(path: Path, vocab_size: int) -> dict[str, int]:
    """A byte-level BPE tokenizer trained on a tiny corpus with the Qwen special/added tokens;
    writes tokenizer.json and tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, chat
    template). Returns the ids of the special and added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Normaliser and pre-tokenizer as in Qwen3.5 tokenizer.json files (transformers' Qwen3_5Tokenizer).
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(300, vocab_size - len(ADDED_TOKENS)), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
              "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return ids
