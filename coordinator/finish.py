"""Finish rules and incremental text for one request, applied token by token inside accepted blocks.

spec-loop.md §3 ("stop tokens and stop strings are checked inside the emitted span; emission is cut at
the first stop"), shared/cases C01, C02, C04, C24. :class:`Finisher` takes the target's tokens in
order (the anchor after prefill, then each verify's d_1..d_m and bonus) and decides for each one
whether it is sent and whether the request ends:

* a stop token id (EOS/EOT unless ignore_eos, plus the request's ``stop_token_ids``, plus stop
  strings that are exactly one special/added token) ends with "stop"; the token is sent only with
  ``include_stop``;
* a stop string found in the decoded text (it may span tokens) ends with "stop"; the token that
  completed it is sent, the text is cut before the string (after it with ``include_stop``);
* the ``max_tokens``-th sent token ends with "length".

Nothing after the finishing token is sent; ``ids`` is exactly what the client received, so usage =
``len(ids)``. Text is detokenised incrementally (the offsets scheme of vLLM's
``detokenize_incrementally``): a delta is released only when the decoded window does not end in
U+FFFD, so a multi-byte character split across tokens is never sent half. While stop strings are
active the last ``max_len(stop) - 1`` characters are held back, so text that turns out to be the start
of a stop string never reaches the client.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """Text of a growing id list, released only at complete characters.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def push(self, token: int) -> str:
        """Adds one token; returns the newly complete text (possibly '')."""
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character decodes as U+FFFD) at the end."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class Finisher:
    """Applies the finish rules (module docstring) to one request's generated tokens.

    Args:
        max_tokens: most tokens sent (>= 1).
        stop_ids: token id -> matched-stop value to report (the id itself, or a stop string that is
            exactly that token).
        stop_strings: strings matched in the text (needs ``tokenizer``).
        include_stop: send the stop token / stop string.
        tokenizer: ``tokenizers.Tokenizer`` or None (then no text, no stop strings).
        skip_special_tokens: text option.
    """

    def __init__(self, max_tokens: int, stop_ids: dict, stop_strings=(), include_stop: bool = False,
                 tokenizer=None, skip_special_tokens: bool = True):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.stop_ids = max_tokens, dict(stop_ids)
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.include_stop = include_stop
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.text = ""          # decoded text of ids (complete characters), before any stop cut
        self.sent_text = 0      # characters of the final text already released
        self.final_text: str | None = None
        self.done = False
        self.reason: str | None = None  # "stop" | "length" | "abort"
        self.matched = None     # int token id or str stop string
        self._scan_from = 0

    def push(self, token: int) -> bool:
        """Feeds the next generated token; returns True when the request is finished (no more pushes)."""
        if self.done:
            raise RuntimeError("Finisher.push after finish")
        token = int(token)
        if token in self.stop_ids:
            self.reason, self.matched = "stop", self.stop_ids[token]
            if self.include_stop:
                self._append(token)
            return self._finish()
        self._append(token)
        if self.stop_strings:
            hit = None
            for s in self.stop_strings:
                i = self.text.find(s, max(0, self._scan_from - len(s) + 1))
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            self._scan_from = len(self.text)
            if hit is not None:
                i, s = hit
                self.reason, self.matched = "stop", s
                self.final_text = self.text[: i + (len(s) if self.include_stop else 0)]
                return self._finish(flush=False)
        if len(self.ids) >= self.max_tokens:
            self.reason = "length"
            return self._finish()
        return False

    def abort(self) -> None:
        """Ends the request now with reason "abort" (text of the tokens already sent is flushed)."""
        if not self.done:
            self.reason = "abort"
            self._finish()

    def _append(self, token: int) -> None:
        self.ids.append(token)
        if self.detok is not None:
            self.text += self.detok.push(token)

    def _finish(self, flush: bool = True) -> bool:
        if self.final_text is None:
            if flush and self.detok is not None:
                self.text += self.detok.flush()
            self.final_text = self.text
        self.done = True
        return True

    def take_text(self) -> str:
        """Text not yet released that may be released now."""
        if self.done:
            out = self.final_text[self.sent_text :]
        else:
            end = max(self.sent_text, len(self.text) - self.hold) if self.stop_strings else len(self.text)
            out = self.text[self.sent_text : end]
        self.sent_text += len(out)
        return out
