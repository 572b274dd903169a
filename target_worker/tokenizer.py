"""The target's tokenizer, built from GGUF metadata with the `tokenizers` library.

GGUF stores a byte-level BPE vocabulary as ``tokenizer.ggml.tokens`` (strings in GPT-2's byte-to-
unicode alphabet), ``tokenizer.ggml.merges`` ("left right" pairs in priority order) and
``tokenizer.ggml.token_type`` (llama.cpp ``llama_token_type``: 1 normal, 3 control, 4 user-defined,
...). Control and user-defined tokens are registered as added tokens so ``<|im_end|>``, ``<think>``
and friends always encode to one id (shared/cases C24); control tokens are also "special" (skipped
when decoding with ``skip_special_tokens``). The pre-tokenizer splits with the Qwen2 regular
expression, which the ``qwen2``/``qwen35`` pre-tokenizer types of llama.cpp implement.
"""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer and the ids the service needs from the metadata (-1 when absent)."""

    tokenizer: Tokenizer
    eos_token_id: int
    eot_token_id: int
    chat_template: str | None


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def tokenizer_from_gguf(reader: gguf.GGUFReader, path: str = "<gguf>") -> TokenizerInfo:
    """Builds the tokenizer of a GGUF file; ValueError naming the file and key when unusable."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{path}: no tokenizer.ggml.model (the file carries no tokenizer)")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model is {model!r}; specd reads byte-level BPE ('gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens and tokenizer.ggml.merges are required")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=int(t) == TOKEN_TYPE_CONTROL, normalized=False)
             for i, t in enumerate(np.asarray(types)) if int(t) in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    tok.add_tokens(added)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    return TokenizerInfo(tok, -1 if eos is None else int(eos), -1 if eot is None else int(eot),
                         _field(reader, "tokenizer.chat_template"))
