"""The target's tokenizer, built from GGUF metadata with the `tokenizers` library.

GGUF stores a byte-level BPE vocabulary as ``tokenizer.ggml.tokens`` (strings in GPT-2's byte-to-
unicode alphabet), ``tokenizer.ggml.merges`` ("left right" pairs in priority order) and
``tokenizer.ggml.token_type`` (llama.cpp ``llama_token_type``: 1 normal, 3 control, 4 user-defined,
...). Control and user-defined tokens are registered as added tokens so ``<|im_end|>``, ``<think>``
and friends always encode to one id (shared/cases C24); control tokens are also "special" (skipped
when decoding with ``skip_special_tokens``). The pre-tokenizer follows ``tokenizer.ggml.pre`` as
llama.cpp does (``llama-vocab.cpp``): ``qwen35`` is the split of Qwen3.5's tokenizer.json (letters
with their combining marks, single digits, punctuation runs, newlines, spaces), ``qwen2`` the older
one without combining marks; either is followed by NFC normalisation (as the tokenizer.json files
declare) and the byte-level mapping. Any other pre-tokenizer is refused rather than guessed.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .gguf_loader import TargetFileError, TokenizerMetadata

SPLIT_REGEX = {
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def build_tokenizer(meta: TokenizerMetadata, path: str = "<gguf>") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` for the metadata of a GGUF (see
    :func:`specd.target_worker.gguf_loader.read_tokenizer_metadata`). Raises TargetFileError naming
    the file and key when the tokenizer is not byte-level BPE or its arrays are inconsistent."""
    if meta.model != "gpt2":
        raise TargetFileError(f"{path}: tokenizer.ggml.model is {meta.model!r}; specd reads byte-level BPE ('gpt2')")
    if meta.pre not in SPLIT_REGEX:
        raise TargetFileError(f"{path}: tokenizer.ggml.pre is {meta.pre!r}; specd knows {sorted(SPLIT_REGEX)}")
    if not meta.tokens:
        raise TargetFileError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    if len(set(meta.tokens)) != len(meta.tokens):
        raise TargetFileError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    for key, tid in (("bos", meta.bos_id), ("eos", meta.eos_id), ("eot", meta.eot_id), ("padding", meta.pad_id)):
        if tid is not None and not 0 <= tid < len(meta.tokens):
            raise TargetFileError(f"{path}: tokenizer.ggml.{key}_token_id = {tid} is outside the "
                                  f"{len(meta.tokens)} tokens")
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
    unknown = next((m for m in pairs if m[0] not in vocab or m[1] not in vocab), None)
    if unknown is not None:
        raise TargetFileError(f"{path}: tokenizer.ggml.merges entry {' '.join(unknown)!r} names a token "
                              "that is not in tokenizer.ggml.tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX[meta.pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(meta.tokens[i], special=t == TOKEN_TYPE_CONTROL, normalized=False)
                    for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)])
    return tok
