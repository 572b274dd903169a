"""The target's tokenizer, built from GGUF metadata with the `tokenizers` library.

GGUF stores a byte-level BPE vocabulary as ``tokenizer.ggml.tokens`` (strings in GPT-2's byte-to-
unicode alphabet), ``tokenizer.ggml.merges`` ("left right" pairs in priority order) and
``tokenizer.ggml.token_type`` (llama.cpp ``llama_token_type``: 1 normal, 3 control, 4 user-defined,
...). Control and user-defined tokens are registered as added tokens so ``<|im_end|>``, ``<think>``
and friends always encode to one id (shared/cases C24); control tokens are also "special" (skipped
when decoding with ``skip_special_tokens``). The pre-tokenizer is the one Qwen2/3/3.5 tokenizer.json
files declare (and llama.cpp's ``qwen2``/``qwen35`` pre-tokenizer types implement): a regex split
(letters, single digits, punctuation runs, newlines, spaces) followed by the byte-level mapping.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .gguf_loader import TargetFileError, TokenizerMetadata

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def build_tokenizer(meta: TokenizerMetadata, path: str = "<gguf>") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` for the metadata of a GGUF (see
    :func:`specd.target_worker.gguf_loader.read_tokenizer_metadata`). Raises TargetFileError naming
    the file and key when the tokenizer is not byte-level BPE or its arrays are inconsistent."""
    if meta.model != "gpt2":
        raise TargetFileError(f"{path}: tokenizer.ggml.model is {meta.model!r}; specd reads byte-level BPE ('gpt2')")
    if not meta.tokens:
        raise TargetFileError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    types = meta.token_types or (1,) * len(meta.tokens)
    if len(types) != len(meta.tokens):
        raise TargetFileError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(meta.tokens)} tokens")
    pairs = []
    for m in meta.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TargetFileError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((left, right))
    vocab = {t: i for i, t in enumerate(meta.tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(meta.tokens[i], special=t == TOKEN_TYPE_CONTROL, normalized=False)
                    for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)])
    return tok
