"""Shared check of Qwen35Model.step against a one-row verify + commit (CPU and GPU target tests)."""
from __future__ import annotations

import numpy as np


def check_steps_equal_verify_commit(model, prompt, rng, same_state, n_steps=14, capacity=96):
    """Two sequences after ``prompt``: sequence a takes plain steps (``model.step``), b the same tokens
    as verify([t]) + commit(1); every 5th step both take the same speculative step (verify 4 rows,
    commit a random prefix). After each plain step the argmax must agree and ``same_state(a, b)``
    (the caller's bitwise comparison of states, KV and feature rows) must pass."""
    vocab = model.hp.n_vocab
    a, b = model.new_sequence(capacity), model.new_sequence(capacity)
    t = int(np.argmax(model.prefill(a, prompt)))
    model.prefill(b, prompt)
    for i in range(n_steps):
        if i % 5 == 4:
            toks = [t] + [int(x) for x in rng.integers(0, vocab, size=3)]
            n = int(rng.integers(1, 5))
            for st in (a, b):
                res = model.verify(st, toks)
                model.commit(st, res, n)
            t = int(res.argmax[n - 1])
            continue
        best = model.step(a, t)
        res = model.verify(b, [t])
        model.commit(b, res, 1)
        assert best == int(res.argmax[0]) == int(np.argmax(res.logits[0])), f"step {i}"
        same_state(a, b)
        t = best
    return a, b, t
