"""The shipped demo target (models/demo-target.gguf, trained by tools/demo/): it loads, its tokenizer
round-trips text and keeps the chat specials as single ids, and our greedy continuation of a code
prompt is real text, not a degenerate loop. No oracle needed; a few seconds on CPU."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import specd.native as sn
from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata
from specd.target_worker.model import Qwen35Model
from specd.target_worker.tokenizer import build_tokenizer

GGUF = Path(__file__).resolve().parents[2] / "models" / "demo-target.gguf"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def demo():
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} not present")
    weights = load_qwen35(str(GGUF))
    meta = read_tokenizer_metadata(str(GGUF))
    return weights, meta, build_tokenizer(meta, str(GGUF))


def test_file_size_and_shape(demo):
    weights, meta, tok = demo
    assert GGUF.stat().st_size < 15 * 2**20  # the device tool returns <= 16 MiB; budget 15 MiB
    hp = weights.hparams
    assert hp.block_count == 8 and meta is not None
    assert tok.get_vocab_size() == 8192
    assert meta.chat_template and "enable_thinking" in meta.chat_template


def test_tokenizer_round_trip_and_specials(demo):
    _, _, tok = demo
    text = ("def greet(name: str) -> str:\n    return f\"Hello, {name}!\"  # café ünïcode ✓\n\n"
            "The gzip command reduces the size of the named files.\n\t tabs  and   spaces\r\n")
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    for s in SPECIALS:
        ids = tok.encode(s).ids
        assert len(ids) == 1 and tok.id_to_token(ids[0]) == s, s
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>"
    ids = tok.encode(chat).ids
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert {tok.token_to_id(s) for s in ("<|im_start|>", "<|im_end|>", "<think>", "</think>")} <= set(ids)


def test_greedy_code_continuation_is_not_degenerate(demo):
    weights, _, tok = demo
    model = Qwen35Model(weights, kv_dtype=sn.DType.F16)
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and").ids
    st = model.new_sequence(len(prompt) + 48)
    t = int(np.argmax(model.prefill(st, prompt)))
    out = [t]
    for _ in range(40):
        t = int(np.argmax(model.decode(st, t)))
        out.append(t)
    text = tok.decode(out)
    assert len(set(out)) >= 12, (out, text)  # not one token or a short loop
    assert max(out.count(x) for x in set(out)) <= len(out) // 3, text
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(set(words)) >= 6, text  # real words, not byte soup
