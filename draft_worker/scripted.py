"""The scripted drafter: proposes a chosen token list per sequence (test support and the benchmark's
oracle drafter, performance.md §6.6; shared/cases README).

It knows, for each prompt, the target's own greedy continuation (``continuations``: prompt tuple ->
token list, computed beforehand by a plain run) and a *plan* that says how many leading proposals of
each step are right:

* ``None``: all right (the oracle drafter; acceptance = the block),
* ``k >= 0``: right up to position k, then wrong tokens (k = 0: all wrong),
* ``-1``: propose nothing,
* a set / list / tuple of positions: right everywhere except at those draft positions (0-based), i.e.
  errors injected at chosen positions (chain acceptance stops at the first one).

A plan is a callable ``plan(prompt, step) -> int | None`` (step = 0, 1, ... counts this sequence's
Propose calls) or a constant. A wrong token is ``(right + 1) % n_vocab``, so it never matches.
Prompts without a known continuation get wrong tokens (all rejected).

Trees (DDTree, spec-loop.md §7): with ``options.top_k = K`` the proposal carries per-position top-k
candidates. ``topk_ranks`` (a constant sequence or ``topk_ranks(prompt, step)``) gives, per draft
position i, the rank at which the right token is placed in row i (None or >= K: absent); the other
slots hold distinct wrong tokens ``(right + 1 + j) % n_vocab`` and the chain (``tokens``) is rank 0 of
every row, so a right token at rank r > 0 is reachable only through a non-chain branch. Positions
past the sequence, and every position when ``topk_ranks`` is None, follow the chain plan (rank 0 if
right, absent if wrong). Log-probs are fixed: rank 0 -> -0.1, rank r >= 1 -> -r.

Like a real drafter it ingests the target's feature rows for every newly committed position from the
ring, so tests can check that what the drafter saw equals the target's features (C09): ``seen[seq_id]``
maps position -> (token, feature row) for every ingested position, ``proposals[seq_id]`` lists
every step's proposal; both survive release (test inspection) when ``record_features`` is on.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

Plan = Callable[[tuple, int], "int | None | set[int]"]


@dataclasses.dataclass
class _SeqView:
    prompt: tuple[int, ...] | None = None
    tokens: list = dataclasses.field(default_factory=list)  # committed tokens, position order
    steps: int = 0


class ScriptedDrafter:
    """A drafter that follows a script (see the module docstring).

    Args:
        block_size: most drafts per step (the "block" minus the anchor), >= 1.
        n_vocab: vocabulary size (wrong tokens stay inside it).
        continuations: prompt (tuple of ids) -> the target's greedy continuation from the first
            generated token on (long enough for the test; past its end proposals are wrong).
        plan: a constant or ``plan(prompt, step)``; default None (oracle).
        record_features: keep every ingested feature row in ``seen`` (tests; memory grows).
        topk_ranks: None, a sequence of ranks (None entries = absent) or ``topk_ranks(prompt, step)``
            returning one; see the module docstring. Default None.
        max_top_k: most top-k per proposal (reported by Info), default 8.
    """

    name = "scripted"
    family = "scripted"

    def __init__(self, block_size: int, n_vocab: int, continuations: dict | None = None,
                 plan: "Plan | int | None" = None, record_features: bool = True, topk_ranks=None,
                 max_top_k: int = 8):
        if block_size < 1 or n_vocab < 2:
            raise ValueError(f"ScriptedDrafter: block_size >= 1 and n_vocab >= 2 required, got {block_size}, {n_vocab}")
        self.block_size, self.n_vocab = block_size, n_vocab
        self.continuations = {tuple(k): list(v) for k, v in (continuations or {}).items()}
        self.plan = plan
        self.topk_ranks, self.max_top_k = topk_ranks, int(max_top_k)
        self.record_features = record_features
        self.seqs: dict[str, _SeqView] = {}
        self.seen: dict[str, dict[int, tuple[int, np.ndarray]]] = {}
        self.proposals: dict[str, list[list[int]]] = {}

    # The drafter interface used by draft_worker.server.DraftServicer ---------------------------

    def ingest(self, seq_id: str, start: int, tokens: Sequence[int], features: np.ndarray) -> None:
        """Takes committed positions start..start+n-1 with their tokens and feature rows float32 [n, W]."""
        v = self.seqs.setdefault(seq_id, _SeqView())
        if start != len(v.tokens):
            raise ValueError(f"scripted drafter: sequence {seq_id} expected position {len(v.tokens)}, got {start}")
        if v.prompt is None:
            v.prompt = tuple(int(t) for t in tokens)
        v.tokens.extend(int(t) for t in tokens)
        if self.record_features:
            seen = self.seen.setdefault(seq_id, {})
            if not isinstance(features, np.ndarray):  # a device tensor (cuda-ipc transport)
                features = np.asarray(features.numpy(), np.float32)
            for i, t in enumerate(tokens):
                seen[start + i] = (int(t), features[i].copy())

    def propose(self, seq_id: str, anchor: int, max_tokens: int, options=None):
        """Up to min(max_tokens, block_size) draft tokens after ``anchor``: a token list, or with
        ``options.top_k`` a :class:`~specd.draft_worker.server.Draft` carrying the scripted top-k."""
        v = self.seqs[seq_id]
        k = min(max_tokens, self.block_size)
        step = v.steps
        v.steps += 1
        plan = self.plan(v.prompt, step) if callable(self.plan) else self.plan
        if isinstance(plan, int) and plan < 0:
            out = []
        else:
            cont = self.continuations.get(v.prompt)
            gen = len(v.tokens) - len(v.prompt) + 1  # generated tokens so far, anchor included
            right = [] if cont is None else cont[gen : gen + k]
            known = len(right)  # past the known continuation nothing is "right"
            right = right + [0] * (k - known)
            if isinstance(plan, (set, frozenset, list, tuple)):
                wrong = {int(i) for i in plan}
            else:
                wrong = set(range(k if plan is None else min(plan, k), k))
            wrong |= set(range(known, k))
            out = [(right[i] + 1) % self.n_vocab if i in wrong else right[i] for i in range(k)]
            K = int(getattr(options, "top_k", 0) or 0)
            if K and out:
                ranks = self.topk_ranks(v.prompt, step) if callable(self.topk_ranks) else self.topk_ranks
                ranks = list(ranks) if ranks is not None else []
                ids = np.zeros((k, K), np.int32)
                for i in range(k):
                    r = ranks[i] if i < len(ranks) else (None if i in wrong else 0)
                    if i >= known:
                        r = None
                    row, j = [], 1
                    while len(row) < K:
                        row.append((right[i] + j) % self.n_vocab)
                        j += 1
                    if r is not None and r < K:
                        row[r] = right[i]
                    ids[i] = row
                out = [int(t) for t in ids[:, 0]]
                lps = np.tile(np.array([-0.1] + [-float(r) for r in range(1, K)], np.float32), (k, 1))
                if self.record_features:
                    self.proposals.setdefault(seq_id, []).append(out)
                from .server import Draft

                return Draft(out, [], ids, lps)
        if self.record_features:
            self.proposals.setdefault(seq_id, []).append(out)
        return out

    def release(self, seq_id: str) -> bool:
        # ``seen`` and ``proposals`` are kept after release so tests can inspect a finished request
        return self.seqs.pop(seq_id, None) is not None

    def live(self) -> list[str]:
        return sorted(self.seqs)
