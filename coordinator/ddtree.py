"""DDTree: the draft tree built from per-position top-k log-probs, and the walk of a verified tree.

spec-loop.md §7.2 (best-first build, a port of LH ``build_ddtree`` / FM ``build_flat_ddtree``) and
§7.5 (``follow_verified_tree``). Pure Python, shared by the coordinator (builds the tree, re-walks
the verified tree to check the worker's path) and the target worker (walks and commits in the same
Verify call, so a tree step stays at two worker calls).

Flat layout (also the tree Verify layout): row 0 is the root = the anchor (not a draft); rows
1..n are the drafted nodes in insertion order, so a parent always precedes its children.
``parents[0] = -1``; a node at depth d (1-based; the root is depth 0) is the candidate for the token
at position committed + d and uses row d - 1 of the drafter's top-k (per-position marginals: every
node at depth d shares that row whatever its ancestors, §7.1).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["DraftTree", "build_tree", "walk_tree", "auto_top_k"]


@dataclass
class DraftTree:
    """A flat draft tree (module docstring).

    tokens: [n + 1] token ids, tokens[0] = the anchor.
    parents: [n + 1] parent row indices, parents[0] = -1.
    depth: [n + 1] depth per row (root 0).
    rank: [n + 1] the node's rank in its position's top-k (0 = top-1; the root has -1).
    score: [n + 1] cumulative log-prob of the ranks along the path (root 0.0).
    children: per row, token -> child row.
    """

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    rank: list[int]
    score: list[float]
    children: list[dict[int, int]] = field(default_factory=list)

    @property
    def n_nodes(self) -> int:
        """Drafted (non-root) nodes."""
        return len(self.tokens) - 1

    def add(self, parent: int, token: int, rank: int, score: float) -> int:
        row = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.rank.append(rank)
        self.score.append(score)
        self.children.append({})
        self.children[parent][int(token)] = row
        return row


def auto_top_k(budget: int, depth: int, max_top_k: int) -> int:
    """spec-loop.md §7.1 default: K = 8 if budget > L (room for branches) else 1 (pure chain),
    clipped to the drafter's ``max_top_k`` (>= 1)."""
    return max(1, min(8 if budget > depth else 1, max_top_k))


def build_tree(anchor: int, topk_ids: Sequence[Sequence[int]], topk_logprobs: Sequence[Sequence[float]],
               budget: int, chain_seed: bool = True) -> DraftTree:
    """Best-first DDTree under a node budget (spec-loop.md §7.2).

    anchor: the root token. topk_ids / topk_logprobs: [L][K] per draft position (depth 1..L), best
    first (log-probs non-increasing along a row). budget: most non-root nodes (>= 1).
    chain_seed: first insert the top-1 chain to depth min(L, budget) and, per depth d, push the
    rank-1 sibling of the chain node (score w_chain(d) - lp[d][0] + lp[d][1]); otherwise the heap
    starts with the root's rank-0 child.
    Loop: pop the best (highest score; ties: earliest pushed) candidate (parent, depth, rank);
    if the parent already has a child with that token it is skipped (its next sibling is still
    pushed), else it becomes a node; push its next sibling (w - lp[d][r] + lp[d][r+1], if r + 1 < K)
    and its first child (w + lp[d+1][0], if d < L). Stops at ``budget`` nodes or an empty heap.
    Returns the :class:`DraftTree` (just the root when L = 0). Raises ValueError on ragged rows,
    K = 0 or budget < 1.
    """
    L = len(topk_ids)
    if budget < 1:
        raise ValueError(f"build_tree: budget must be >= 1, got {budget}")
    if len(topk_logprobs) != L:
        raise ValueError(f"build_tree: {L} id rows but {len(topk_logprobs)} log-prob rows")
    K = len(topk_ids[0]) if L else 0
    if L and (K == 0 or any(len(r) != K for r in topk_ids) or any(len(r) != K for r in topk_logprobs)):
        raise ValueError(f"build_tree: every top-k row must have the same K >= 1 ids and log-probs")
    lp = [[float(x) for x in r] for r in topk_logprobs]
    if any(math.isnan(x) for r in lp for x in r):
        raise ValueError("build_tree: NaN log-prob")
    tree = DraftTree([int(anchor)], [-1], [0], [-1], [0.0], [{}])
    if L == 0:
        return tree
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, seq, parent, depth, rank)
    seq = 0

    def push(score: float, parent: int, d: int, r: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (-score, seq, parent, d, r))
        seq += 1

    if chain_seed:
        parent, w = 0, 0.0
        for d in range(1, min(L, budget) + 1):
            if K > 1:
                push(w + lp[d - 1][1], parent, d, 1)
            w += lp[d - 1][0]
            parent = tree.add(parent, topk_ids[d - 1][0], 0, w)
    else:
        push(lp[0][0], 0, 1, 0)
    while heap and tree.n_nodes < budget:
        neg, _, parent, d, r = heapq.heappop(heap)
        w = -neg
        if r + 1 < K:
            push(w - lp[d - 1][r] + lp[d - 1][r + 1], parent, d, r + 1)
        token = int(topk_ids[d - 1][r])
        if token in tree.children[parent]:
            continue  # duplicate child under one parent
        row = tree.add(parent, token, r, w)
        if d < L:
            push(w + lp[d][0], row, d + 1, 0)
    return tree


def walk_tree(tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int],
              max_accept: int | None = None) -> list[int]:
    """The accepted path of a verified tree (spec-loop.md §7.5): from the root (row 0), repeatedly
    move to the child whose token equals the current row's target argmax, at most ``max_accept``
    moves (None: no cap). tokens / parents / argmax: one per row, parents[0] = -1 and parents[i] < i.
    Returns row indices, root first; the bonus is argmax[path[-1]]. If a row has two children with
    the same token the first (lowest row) is taken. Raises ValueError on a malformed tree."""
    w = len(tokens)
    if len(parents) != w or len(argmax) != w or w == 0 or parents[0] != -1:
        raise ValueError(f"walk_tree: need equal-length tokens/parents/argmax with parents[0] = -1 "
                         f"(got {w}, {len(parents)}, {len(argmax)})")
    children: list[dict[int, int]] = [{} for _ in range(w)]
    for i in range(1, w):
        p = int(parents[i])
        if not 0 <= p < i:
            raise ValueError(f"walk_tree: parents[{i}] = {p} must be in [0, {i})")
        children[p].setdefault(int(tokens[i]), i)
    path = [0]
    while max_accept is None or len(path) - 1 < max_accept:
        nxt = children[path[-1]].get(int(argmax[path[-1]]))
        if nxt is None:
            break
        path.append(nxt)
    return path
