#!/usr/bin/env python3
"""Train the demo byte-level BPE tokenizer on the corpus's TRAIN split (never the held-out files).

Qwen2/3/3.5 layout: the Qwen2 split regex, then ByteLevel(use_regex=False); specials
``<|endoftext|>`` ``<|im_start|>`` ``<|im_end|>`` ``<|mask|>`` (special, ids 0-3) and ``<think>``
``</think>`` (added, not special, the last two ids); a Qwen3-style chat template with thinking on/off
(``enable_thinking``). Writes tokenizer.json + tokenizer_config.json into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
ADDED_TOKENS = ["<think>", "</think>"]

# Qwen3-style: an assistant turn that carries ``reasoning_content`` (even "") gets a think block;
# generation prompt with enable_thinking=false pre-fills an empty think block (thinking off).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.get('reasoning_content') is not none %}"
    "{{- '<think>\\n' + message['reasoning_content'].strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def iter_texts(path: Path):
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", default="build/demo-corpus")
    ap.add_argument("--out", default="build/demo-tokenizer")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size - len(ADDED_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(iter_texts(Path(args.corpus) / "train.jsonl"), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "add_bos_token": False,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
        "unk_token": None, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": t in SPECIAL_TOKENS, "normalized": False,
                                      "lstrip": False, "rstrip": False, "single_word": False}
            for t in SPECIAL_TOKENS + ADDED_TOKENS},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    print("vocab", tok.get_vocab_size(), "special/added ids", ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
