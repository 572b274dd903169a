"""The block-diffusion drafter forward on specd.native: DFlash, DSpark and DFlash 2.

Contract: docs/drafters.md §3 (forward graph, masks, RoPE/YaRN, context K/V caching), §4 (row
alignment), §5.2–5.3 (DSpark Markov and confidence heads), §6.2–6.3 (DFlash 2 grouped dynamic conv
and candidate selector); spec-loop.md §7.1 (per-position top-k for trees) and §8 (proposal
distributions for sampled drafting). Checked in tests/drafter/test_forward_*.py against PyPI
``dflash==0.1.0`` (``DFlashDraftModel`` / ``DFlash2DraftModel``, z-lab, torch float64),
``mlx-dspark==0.20.3`` (DSpark end to end) and float64 numpy forms of the published math.

Two objects:

* :class:`DrafterModel` — a loaded draft GGUF (:func:`~specd.draft_worker.gguf_loader.load_drafter`)
  bound to the **target's** token embedding and lm_head (``output``, or ``token_embd`` when tied);
  stateless.
* :class:`DraftSequence` — per-sequence state: the context K/V of every drafter layer.

Per sequence (drafters.md §3.1–3.2, §3.7):

``ingest(features, start_pos)``
    For committed positions start_pos .. start_pos+n-1, the target's tapped hidden states
    (float32 [n, N·H], taps concatenated in ``target_layer_ids`` order, exactly a FeatureRing row)
    become context rows ``c = hidden_norm(fc(features))`` (one c per position, shared by all
    layers); every layer's context K = RoPE(k_norm(W_k c)) at the absolute position and V = W_v c
    are written into that layer's cache at row = position. Only F32 activations: the fc
    accumulates in F32 whatever the weight dtype (C20: outliers ~1e5 in the taps do not overflow).
``propose(seed, committed_len)``
    The block ``[seed, M × (B−1)]`` (all three families; M = mask token id) at positions
    start .. start+B−1 (start = committed_len = context rows ingested) is embedded with the target's
    token_embd (× ``input_embedding_scale``), run through the layers — queries from block rows only,
    keys/values = cached context rows followed by this block's rows, each layer's mask — then the
    drafter's own final norm and the target lm_head (× ``output_multiplier``, tanh softcap). Block
    K/V are written at rows start.. and are overwritten by the next ingest (never context).
    Token choice per family: DFlash argmax of rows 1..B−1; DSpark the Markov chain over rows
    0..B−1 (+ confidence, optional truncation); DFlash 2 the candidate-selector chain over the
    top-K of rows 1..B−1. Greedy by default; with a :class:`Sampling` every draft is drawn from its
    proposal distribution q, which is returned for rejection sampling.

CUDA graphs (``DrafterModel(cuda_graphs=True)``, the default; GPU). A greedy propose of the file's
block size B, or of a smaller block B' that the sequence's previous propose also ran (a draft cap
below B - 1 asks for the same B' every step), replays a graph captured on the sequence: the block forward (embedding, every layer with
its K/V writes and attention, the output norm), the lm_head over the proposal rows and the family's
device head — DFlash's argmax; DSpark's greedy Markov chain (fused or ``"off"``; the W1 gathers, W2
GEMVs, bias adds and argmaxes, each pick feeding the next gather on the device); DFlash 2's top-K of
the unary logits, the selector projection p = W_h h and the Succ / Pred codebook rows of every
candidate and of the seed. What changes per propose (the seed id, the block's positions, each layer's
K/V rows and attention query positions) is read from one fixed device buffer of the sequence, refreshed
by a single asynchronous host -> device copy before the replay. After it, on the host as in the eager
path: reading the tokens back, DSpark's confidence head (float64 numpy), DFlash 2's per-slot selector
scores and choices, and whatever the request asks for besides (return_logits / return_hidden copies,
top-k and its log-softmax) from the graph's output tensors. Eager (op by op, as before): sampled
proposals (the draws interleave host steps with the chain), DSpark ``markov="unfused"``, a block
shrunk below B for the first time in a row (the shrinking blocks near the end of a request: a
capture per step would cost more than it saves), a key whose capture failed (logged once; e.g. no
device memory for its arena),
drafters with ``final_logit_softcapping`` (tanh runs on the host), and blocks where a non-causal
sliding layer has B > W (its two-sided window needs a host mask).

Attention in the graph covers a key range fixed at capture: full layers (rows = position) the first
``bound`` cache rows, bound = start + B rounded up to a multiple of 1024 (capped by the capacity);
bounded layers (sliding windows, context_cap) all their rows (their row = position − base, so the
graph does not depend on where the rows sit). Each query row still sees exactly the keys of the eager
call: causal layers pass the rows' positions (causal limit, window W as eager); a non-causal layer
passes the block's last position for every row (causal: every key up to the block's end, which is
what a non-causal row sees), with window cap + B under context_cap; a non-causal sliding layer whose
window reaches a context row (start + B > W) and a causal capped layer whose cap drops a context row
(start > cap) need a per-row lower limit, so they run one attention call per block row (window
W + B − 1 − i, resp. cap + 1 + i). sn.attention's result depends only on the row's ordered visible
keys (not on kv_len, the other rows or the cache rows they sit in), so graph and eager results are
bitwise equal. Graphs are keyed (B, head, bound, per-row): a sequence re-captures when its bound
crosses a multiple of 1024 or when the per-row form first applies, and keeps at most ``max_graphs``
(least recently used evicted; a larger bound drops that head's smaller ones). They are freed with the
sequence (:meth:`DraftSequence.release`). Memory: each graph's arena holds its activations, the
[n, V] F32 logits (DSpark: plus the chain's per-row logits and corrected rows, ~4 x) and the
attention scratch: :meth:`DraftSequence.graph_arena_bytes` measures it. With ``tensor_ops`` on the
CPU (tests) the same path runs uncaptured: the graph body is re-run on the fixed input buffer at
every replay, with the same keys and captures.

Masks (ZL-0.1.0 rule, drafters.md §3.3, resolved at conversion into ``causal_pattern`` /
``sliding_pattern``): key at position p_k is visible to the query at p_q iff (causal ⇒ p_k ≤ p_q)
and (sliding ⇒ p_q − p_k < W, and if not causal also p_k − p_q < W). Windows are applied per row.

KV cache: one native cache pair per layer of ``kv_dtype`` (F32 default; F16 and Q8_0 allowed — K
is k-normed and V comes from the hidden-normed context, so both are O(1) in magnitude even when the
taps carry outliers). Unbounded full-attention layers hold ``capacity`` rows (row = position);
layers whose visibility is bounded — sliding windows (the last W − 1 context rows, drafters.md §3.3)
and full layers under ``context_cap`` — hold 2·keep + 2·B rows at a moving base and compute K/V only
for rows they can still see. Visibility (causality, per-row windows, the cap) is computed on
positions, so the bounded layers give exactly the unbounded result.
"""
from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

import specd.native as sn
from specd.native import DType, Tensor

from specd.target_worker.device import _HostOps, _TensorOps, _Uploader, parse_device
# graph_rows: a full layer's attention bound in a graph (start + B rounded up); drafter_graph_arena_bytes:
# what a capture reserves for its arena (also the memory report's estimate)
from specd.target_worker.memory import drafter_graph_arena_bytes, graph_rows

from .gguf_loader import LoadedDrafter

log = logging.getLogger(__name__)

__all__ = ["DrafterModel", "DraftSequence", "Proposal", "Sampling", "sampling_probs", "markov_chain", "selector_chain",
           "grouped_dynamic_conv", "MARKOV_MODES", "DEFAULT_MARKOV"]

#: DSpark Markov-correction modes (drafters.md §5.2–5.5; lucebox's fused single-graph head with its
#: non-fused fallback). ``"fused"`` (default): one lm_head matmul for all block rows, then the
#: unrolled Markov chain. ``"unfused"``: the sequential fallback — per row k, lm_head of row k, then
#: the bias W2·W1[x_{k−1}] and the choice. ``"off"``: no Markov correction — plain argmax of the base
#: logits U_k (DDTree top-k from the base logits too; the confidence head still sees W1 of the
#: chosen previous draft). Fused and unfused are *bitwise identical* (tokens, logits, corrected
#: logits, confidences, top-k): every native op (matmul, embedding, argmax, topk) is batch
#: invariant — row k of a [n, H] × [H, V] matmul is computed with the same reduction order as the
#: [1, H] × [H, V] product of that row alone — and the element-wise transform (output_multiplier,
#: softcap) and the bias add are per element. ``"unfused"`` is there as the reference / fallback path
#: (and costs n lm_head launches instead of one); ``"off"`` changes the proposals (still lossless:
#: the target verifies every draft).
MARKOV_MODES = ("fused", "unfused", "off")
DEFAULT_MARKOV = "fused"


@dataclass(frozen=True)
class Sampling:
    """Sampled drafting for lossless rejection sampling (spec-loop.md §8; ZL-0.1.0 ``sample`` /
    ``_sampling_probs``): drafts are drawn from q = softmax(scores / temperature) after the same
    top-k then top-p truncation the target uses. temperature finite > 0; top_p in (0, 1];
    top_k >= 0 (0 = off); rng: the numpy Generator the draws come from (one uniform per draft,
    inverse CDF over token ids in increasing order)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def __post_init__(self):
        if not (self.temperature > 0 and math.isfinite(self.temperature)) or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"Sampling: temperature must be finite > 0, top_p in (0, 1], top_k >= 0 "
                             f"(got {self.temperature}, {self.top_p}, {self.top_k})")


def sampling_probs(scores: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """ZL-0.1.0 ``_sampling_probs`` in float64: z = scores / T; if 0 < top_k < m keep the top_k
    largest (lower index first on ties); p = softmax over the kept entries; if top_p < 1, keep
    the tokens in descending p order while the mass *before* them is < top_p and renormalise;
    zeros elsewhere. scores float [n, m] -> float32 [n, m], each row summing to 1."""
    z = np.asarray(scores, np.float64) / float(temperature)
    n, m = z.shape
    keep = np.ones_like(z, dtype=bool)
    if 0 < top_k < m:
        order = np.argsort(-z, axis=1, kind="stable")[:, top_k:]
        np.put_along_axis(keep, order, False, axis=1)
    z = np.where(keep, z, -np.inf)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=1, kind="stable")
        sp = np.take_along_axis(p, order, axis=1)
        mask = (np.cumsum(sp, axis=1) - sp) < top_p
        np.put_along_axis(p, order, sp * mask, axis=1)
        p /= p.sum(axis=1, keepdims=True)
    return p.astype(np.float32)


def _draw(q: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of one index from probability row q (float, sums to ~1; zero entries are
    never drawn)."""
    c = np.cumsum(np.asarray(q, np.float64))
    i = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    i = min(i, len(c) - 1)
    while q[i] == 0:  # only reachable through rounding at the top of the CDF
        i -= 1
    return i


@dataclass
class Proposal:
    """Result of :meth:`DraftSequence.propose` for one block.

    n = drafts per block (``hparams.n_drafts``: B − 1 for DFlash / DFlash 2, B for DSpark; B the
    block actually run), before any confidence truncation; ``tokens`` may be shorter when truncated.

    tokens: int32 [m], m ≤ n — the proposals, in order. Draft k (1-based) is the token at position
        ``start + k`` in both alignments (drafters.md §4): DFlash / DFlash 2 read it from block row
        k (row 0, the seed, is discarded), DSpark from block row k − 1. The verify block is
        ``[seed, tokens...]`` at positions start, start + 1, ...
    start: the seed's absolute position (= committed_len).
    logits: float32 [n, V] or None (``return_logits``) — per draft, the drafter's transformed
        lm_head logits (× output_multiplier, softcap; DFlash 2's "unary" logits). For DSpark the
        Markov-corrected logits ℓ_k are in ``markov_logits``.
    markov_logits: DSpark only, float32 [n, V] or None (``return_logits``) — ℓ_k = U_k + W2·W1[x_{k−1}] along the
        chosen chain (x_0 = seed); with ``markov="off"`` ℓ_k = U_k (no correction).
    hidden: float32 [n, H] or None — post-final-norm draft hidden of the proposing rows.
    confidence: DSpark with a confidence head only, float32 [n] — c_k = σ(w·[h_k ; W1[x_{k−1}]] + b),
        the conditional survival estimate of draft k (paper eq. 7); None otherwise.
    candidates, candidate_scores: DFlash 2 only, int32 [n, K] / float32 [n, K] — the top-K unary
        candidates per slot (best unary first) and their selector scores u + Σ Pred[prev]·p·Succ[c]
        given the chosen predecessor.
    q: float32 [n, V] or None — with ``sampling``, the proposal distribution each draft was drawn
        from (spec-loop.md §8): DFlash softmax(logits / T) truncated; DSpark the same over ℓ_k
        (conditioned on the previously *sampled* draft); DFlash 2 softmax(score / T) over the K
        candidates scattered onto their ids (no truncation, as ZL-0.1.0), zeros elsewhere.
    topk_ids, topk_logprobs: int32 [n, k] / float32 [n, k] when ``topk = k > 0`` (spec-loop.md §7.1):
        per draft row, the k best tokens and their log-probabilities, best first. DFlash:
        log_softmax(logits / T); DSpark: log_softmax(ℓ_k / T) along the chain (argmax spine);
        DFlash 2: log_softmax(score / T) over the K selector candidates along the chain (k ≤ K).
    """

    tokens: np.ndarray
    start: int
    logits: np.ndarray | None = None
    markov_logits: np.ndarray | None = None
    hidden: np.ndarray | None = None
    confidence: np.ndarray | None = None
    candidates: np.ndarray | None = None
    candidate_scores: np.ndarray | None = None
    q: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


@dataclass
class _CapturedPropose:
    """A greedy propose recorded as a GPU graph (:meth:`DraftSequence._graph`) and its output tensors
    (in the graph's arena, overwritten by every replay): the proposal rows' hidden, the logits and the
    head's outputs (DFlash: the argmax ids; DSpark: :func:`_markov_chain_device`'s tuple; DFlash 2:
    :func:`_selector_gather_device`'s). The CPU stand-in (tensor_ops) has no graph and re-runs
    ``body`` at every replay, which sets the outputs."""

    graph: object  # sn.GpuGraph, or None (CPU stand-in)
    body: Callable | None
    hidden: object = None
    logits: object = None
    head: object = None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (x float32/float64 [n, m]); returns float32."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


class DrafterModel:
    """A drafter bound to its target's embedding and lm_head.

    Args:
        drafter: a :class:`LoadedDrafter` (weights stay zero-copy views of the GGUF).
        token_embd: the target's token embedding, [V, H] of any weight dtype.
        lm_head: the target's output head, [V, H] of any weight dtype (pass token_embd when the
            target ties them). V must equal the drafter's ``n_vocab`` and H its ``n_embd``.
        kv_dtype: context/block K/V cache type, DType.F32 (default), F16 or Q8_0 (Q8_0 needs
            head_dim % 32 == 0).
        context_cap: None (default: every committed context row is visible, ZL semantics), or a
            positive int C: full-attention layers see only the last C context rows before the block
            (drafters.md §3.7; sliding layers are bounded by their window anyway).
        device: ``sn.Device.CPU`` (default) or ``sn.Device.GPU`` (or "cpu" / "cuda"). On the GPU the
            drafter weights and the target embedding / lm_head are uploaded once here (tensors
            already on the device — a same-process GPU target's, e.g. ``for_target(drafter,
            gpu_qwen35_model)`` — or a target worker's mapped from another process through CUDA IPC
            (:mod:`specd.target_worker.shared_weights`, ``open_model_drafter(share_target_weights=
            "auto")``) — are used as they are, no second copy), every layer's context K/V cache
            lives on the device, and ingest, the block forward, the lm_head, top-k, the DSpark Markov
            chain (fused and unfused) and the DFlash 2 selector run there; only the outputs (tokens,
            chosen ids, requested logits / hidden / top-k log-probs, confidences) come back. Host
            steps that remain: the confidence head's dot product and the selector's per-slot K×R score
            (small, float64/numpy exactly as on the CPU), sampling's q and the top-k log-softmax (the
            logits rows are copied back when sampling / top-k is asked for), and the tanh softcap
            (no native tanh op yet; only drafters with final_logit_softcapping). Same API and
            semantics as on the CPU; tokens equal the CPU's up to argmax ties under F32 rounding.
        tensor_ops: run the device code path (sn.Tensor glue ops) even on the CPU; for tests on
            machines without a GPU (``SPECD_TEST_GPU_DRYRUN``). Implied by the GPU.
        cuda_graphs: on the GPU, replay greedy proposes as CUDA graphs captured per sequence (default
            True; ``specd draft-worker --no-cuda-graphs`` turns it off): bitwise the eager results, far
            less host work per propose (module docstring: what is captured, what stays eager, the
            keys). With tensor_ops on the CPU the same path runs uncaptured; ignored on the host path.
            A plain attribute, read at every propose: switching it off later runs eagerly (graphs
            already captured stay until their sequence is released).
        max_graphs: most captured graphs kept per sequence (least recently used evicted), >= 1;
            default 4 (``--max-graphs``). A sequence normally holds one (two across a 1024-position
            step of the attention bound).

    Raises ValueError on a shape/vocabulary mismatch or a bad option (TypeError for a cuda_graphs
    that is not a bool).
    """

    def __init__(self, drafter: LoadedDrafter, token_embd: Tensor, lm_head: Tensor, *,
                 kv_dtype: DType = DType.F32, context_cap: int | None = None, device=sn.Device.CPU,
                 tensor_ops: bool = False, cuda_graphs: bool = True, max_graphs: int = 4):
        hp = drafter.hparams
        self.drafter, self.hp, self.w = drafter, hp, drafter.weights
        for name, t in (("token_embd", token_embd), ("lm_head", lm_head)):
            shape = tuple(int(s) for s in t.shape)
            if shape != (hp.n_vocab, hp.n_embd):
                raise ValueError(f"{drafter.path}: target {name} is {list(shape)}; the drafter needs "
                                 f"[n_vocab={hp.n_vocab}, n_embd={hp.n_embd}] "
                                 "(it reuses the target's embedding and head)")
        if kv_dtype not in (DType.F32, DType.F16, DType.Q8_0):
            raise ValueError(f"kv_dtype must be F32, F16 or Q8_0, got {kv_dtype}")
        if kv_dtype == DType.Q8_0 and hp.head_dim % 32:
            raise ValueError(f"a Q8_0 KV cache needs head_dim % 32 == 0 (head_dim = {hp.head_dim})")
        if context_cap is not None and context_cap <= 0:
            raise ValueError(f"context_cap must be None or > 0, got {context_cap}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
        self.kv_dtype, self.context_cap = kv_dtype, context_cap
        self.cuda_graphs, self.max_graphs = cuda_graphs, max_graphs
        self.device = parse_device(device)
        self.on_host = self.device == sn.Device.CPU and not tensor_ops
        y = hp.yarn
        self._rope_kw = dict(n_rot=hp.head_dim, theta=float(hp.rope_theta))
        if y is not None:
            self._rope_kw.update(yarn_factor=float(y.factor), yarn_original_context=int(y.original_context_length),
                                 yarn_beta_fast=float(y.beta_fast), yarn_beta_slow=float(y.beta_slow),
                                 yarn_attention_factor=float(y.attention_factor))
        self.causal = tuple(bool(c) for c in hp.causal_pattern)
        self.window = tuple(int(hp.sliding_window) if s else 0 for s in hp.sliding_pattern)
        self._conf_w: np.ndarray | None = None
        self._conf_b: float | None = None
        if self.w.dspark is not None:
            cw = self.w.dspark.confidence_weight
            self._conf_w = None if cw is None else np.asarray(cw.numpy(), np.float32).reshape(-1)
            cb = self.w.dspark.confidence_bias
            self._conf_b = None if cb is None else float(np.asarray(cb.numpy()).reshape(-1)[0])
        if hp.dflash2 is not None:  # conv_group_size | n_embd is checked by DrafterHParams.validate
            self._conv_base = [(np.asarray(l.attn_conv_base.numpy(), np.float32),
                                np.asarray(l.ffn_conv_base.numpy(), np.float32)) for l in self.w.layers]
        if self.on_host:
            self._ops = _HostOps()
            self.token_embd, self.lm_head = token_embd, lm_head
            self.fc, self.hidden_norm, self.output_norm = self.w.fc, self.w.hidden_norm, self.w.output_norm
            self.layers = list(self.w.layers)
            self.markov = None if self.w.dspark is None else (self.w.dspark.markov_w1, self.w.dspark.markov_w2)
            self.selector = None if self.w.selector is None else (self.w.selector.hproj, self.w.selector.pred_cb,
                                                                  self.w.selector.succ_cb)
        else:
            self._ops = _TensorOps(self.device)
            up = _Uploader(self.device)
            self.token_embd, self.lm_head = up.embedding(token_embd), up.matmul(lm_head)
            self.fc, self.hidden_norm, self.output_norm = (up.matmul(self.w.fc), up.plain(self.w.hidden_norm),
                                                           up.plain(self.w.output_norm))
            self.layers = [up.layer(l) for l in self.w.layers]
            self.markov = None if self.w.dspark is None else (up.embedding(self.w.dspark.markov_w1),
                                                              up.matmul(self.w.dspark.markov_w2))
            sel = self.w.selector
            self.selector = None if sel is None else (up.matmul(sel.hproj), up.embedding(sel.pred_cb),
                                                      up.embedding(sel.succ_cb))
            if hp.dflash2 is not None:  # per side, the [taps, H] base kernel sn.grouped_dynamic_conv reads
                self._conv_base = [tuple(tuple(up.plain(sn.Tensor(np.ascontiguousarray(b[j])))
                                               for j in range(b.shape[0])) for b in pair)
                                   for pair in self._conv_base]
            # the [1, width] scale tables ops.scale reads, made now: a graph capture cannot upload them
            for value, width in ((hp.input_embedding_scale, hp.n_embd), (hp.output_multiplier, hp.n_vocab)):
                if value != 1.0:
                    self._ops.scale_table(value, width)
            if self.device == sn.Device.GPU:
                sn.gpu_synchronize()

    @classmethod
    def for_target(cls, drafter: LoadedDrafter, target_weights, **kw) -> "DrafterModel":
        """Binds ``drafter`` to a qwen35 target's ``Qwen35Weights`` (token_embd, and ``output`` —
        the loader already points it at token_embd when the file ties them), or to a
        ``Qwen35Model`` (its placed token_embd / output: on the same device they are shared)."""
        out = target_weights.output if target_weights.output is not None else target_weights.token_embd
        return cls(drafter, target_weights.token_embd, out, **kw)

    def new_sequence(self, capacity: int) -> "DraftSequence":
        """Fresh per-sequence state for at most ``capacity`` positions: every context row plus the
        B block rows of a proposal must fit (propose needs committed_len + B <= capacity)."""
        return DraftSequence(self, capacity)

    # ------------------------------------------------------------------ pieces

    def context_rows(self, features: np.ndarray) -> np.ndarray:
        """c = hidden_norm(fc(features)): float32 [n, N·H] -> float32 [n, H] (drafters.md §3.1).
        The fc matmul accumulates in F32 (C20). Raises ValueError on a wrong width."""
        hp, ops = self.hp, self._ops
        if isinstance(features, sn.Tensor) and features.device == self.device and not self.on_host:
            f = features  # contiguous: a gathered ring read or a view_rows of one
        else:
            f = np.ascontiguousarray(features.numpy() if isinstance(features, sn.Tensor) else features,
                                     dtype=np.float32)
        if len(f.shape) != 2 or f.shape[1] != hp.n_taps * hp.n_embd:
            raise ValueError(f"features must be float32 [n, n_taps*n_embd = {hp.n_taps * hp.n_embd}], "
                             f"got {tuple(f.shape)}")
        return ops.a(sn.rms_norm(sn.matmul(ops.put(f), self.fc), self.hidden_norm, hp.rms_eps))

    def rope(self, x, positions, trusted: bool = False) -> Tensor:
        """The drafter's RoPE (full-head NeoX, θ and YaRN from the file; YaRN's attention factor applied
        once, folded into cos/sin as in HF): x float32 [n, heads, head_dim], positions int32 [n] (a
        numpy array, or an I32 tensor of x's device; ``trusted``: its values are known valid)."""
        if not isinstance(positions, Tensor):
            positions = np.asarray(positions, np.int32)
        return sn.rope_neox(x, positions, trusted=trusted, **self._rope_kw)

    def _k(self, i: int, x: np.ndarray, positions, trusted: bool = False) -> Tensor:
        hp, l, ops = self.hp, self.layers[i], self._ops
        k = ops.reshape(ops.a(sn.matmul(x, l.attn_k)), x.shape[0], hp.n_head_kv, hp.head_dim)
        return self.rope(sn.rms_norm(k, l.attn_k_norm, hp.rms_eps), positions, trusted)

    def _v(self, i: int, x):
        hp, ops = self.hp, self._ops
        return ops.reshape(ops.a(sn.matmul(x, self.layers[i].attn_v)), x.shape[0], hp.n_head_kv, hp.head_dim)

    def _conv(self, y, D, j: int, base):
        """Side j of the grouped dynamic conv (drafters.md §6.2) of y [L, H] with the coefficients
        D [L, 2, taps, G] and that side's base kernel [taps, H], all float32: the numpy reference
        :func:`grouped_dynamic_conv` on the host, else one ``sn.grouped_dynamic_conv`` (the same F32
        operations in the same order, so bitwise the host's result; D's side read in place)."""
        if self.on_host:
            return grouped_dynamic_conv(y, D[:, j], base, self.hp.dflash2.conv_group_size)
        return sn.grouped_dynamic_conv(y, D, base, j)

    def _dyn(self, u, proj: Tensor):
        """Dynamic coefficients D = reshape(u · W_kpᵀ, [L, 2, taps, G])."""
        d, ops = self.hp.dflash2, self._ops
        groups = self.hp.n_embd // d.conv_group_size
        return ops.reshape(ops.a(sn.matmul(u, proj)), u.shape[0], 2, d.conv_kernel_size, groups)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Target lm_head on the draft hidden, × output_multiplier, tanh softcap (ZL-0.1.0
        ``compute_logits``): float32 [n, H] -> float32 [n, V] (numpy on the host path, an sn.Tensor
        on the model's device otherwise)."""
        hp, ops = self.hp, self._ops
        z = ops.a(sn.matmul(ops.put(hidden), self.lm_head))
        if hp.output_multiplier != 1.0:
            z = ops.scale(z, hp.output_multiplier)
        if hp.final_logit_softcapping:
            z = ops.softcap(z, hp.final_logit_softcapping)
        return z


class _LayerKV:
    """K/V rows of one drafter layer: row r holds position ``base + r`` (native caches
    [rows, Hkv, hd] of the model's kv_dtype). ``keep`` = context rows that can still be visible to
    a future block (sliding: W − 1; full layer under context_cap: the cap; None: every row, then
    rows = the sequence capacity and base stays 0). Bounded layers hold 2·keep + 2·B rows and
    compact (move their live rows to the front) when a write would run past the end. Context rows
    of positions [valid_lo, n_ctx) hold data (bounded layers skip rows they can no longer see)."""

    def __init__(self, rows: int, keep: int | None, hp, dtype: DType, ops=None, device=sn.Device.CPU):
        shape = [rows, hp.n_head_kv, hp.head_dim]
        self.k, self.v = Tensor.zeros(shape, dtype, device), Tensor.zeros(shape, dtype, device)
        self.ops = _HostOps() if ops is None else ops
        self.rows, self.keep, self.base, self.valid_lo = rows, keep, 0, 0

    def make_room(self, lo: int, first_new: int, hi: int, n_valid: int) -> None:
        """Make positions [lo, hi) addressable, preserving the rows of positions
        [lo, min(first_new, n_valid)) (older live context); positions >= first_new are about to be
        (re)written. Raises ValueError when a live row was already dropped (a rollback deeper than
        the retained window)."""
        if lo >= self.base and hi - self.base <= self.rows:
            return
        if hi - lo > self.rows:  # cannot happen for the sizes DraftSequence picks
            raise ValueError(f"internal: {hi - lo} positions do not fit {self.rows} cache rows")
        live_hi = min(first_new, n_valid)
        if live_hi > lo:
            if lo < self.valid_lo:
                raise ValueError(f"ingest: positions {lo}..{self.valid_lo - 1} of a windowed layer were already "
                                 "dropped; cannot roll back that far")
            for t in (self.k, self.v):
                self.ops.shift_rows(t, 0, lo - self.base, live_hi - lo)
        self.base = lo
        self.valid_lo = max(self.valid_lo, lo)

    def view(self, first: int, n: int, dtype: DType) -> tuple[Tensor, Tensor]:
        """Native views of the rows of positions [first, first + n)."""
        r = first - self.base
        return self.ops.kv_view(self.k, r, r + n, dtype), self.ops.kv_view(self.v, r, r + n, dtype)


class DraftSequence:
    """Per-sequence drafter state: the context K/V of every layer.

    ``n_ctx``: number of context rows ingested (positions 0 .. n_ctx−1 hold target features).
    Layers whose visibility is bounded (sliding windows: the last W − 1 context rows; full layers
    under ``context_cap``: the last cap rows) keep only those rows (plus room for a block), so
    their memory and ingest work do not grow with the sequence; other layers keep ``capacity``
    rows. A rollback (``ingest`` below n_ctx) must not reach behind a bounded layer's retained
    rows.
    """

    def __init__(self, model: DrafterModel, capacity: int):
        hp = model.hp
        if capacity <= hp.block_size:
            raise ValueError(f"capacity must exceed the block size {hp.block_size}, got {capacity}")
        self.model, self.capacity, self.n_ctx = model, int(capacity), 0
        self.released = False
        self.layers: list[_LayerKV] = []
        for i in range(hp.n_layer):
            keep = model.window[i] - 1 if model.window[i] else model.context_cap
            rows = self.capacity if keep is None else min(self.capacity, 2 * keep + 2 * hp.block_size)
            self.layers.append(_LayerKV(rows, keep, hp, model.kv_dtype, model._ops, model.device))
        # CUDA graphs (module docstring): key -> _CapturedPropose, least recently used first
        self._graphs: collections.OrderedDict[tuple, _CapturedPropose] = collections.OrderedDict()
        self.graph_captures = 0  # graphs captured on this sequence so far (tests, benchmarks)
        self._graph_host: np.ndarray | None = None  # the graphs' inputs (layout: _graph_inputs)
        self._graph_in: Tensor | None = None  # ... as the device buffer the graphs read
        self._last_block: int | None = None  # the block size of the last propose (_graph_key)
        self._no_graph: set[tuple] = set()  # keys whose capture failed: they run eagerly from then on

    def release(self) -> int:
        """Frees the sequence's captured graphs (their arenas), input buffer and K/V caches; later
        ingest / propose raise ValueError. Returns the number of graphs dropped. Call it where forwards
        are serialised (ModelDrafter's compute lock): a graph's destructor waits for its last replay.
        Idempotent."""
        dropped = len(self._graphs)
        self._graphs.clear()
        self._graph_host = self._graph_in = None
        self.layers = []
        self.released = True
        return dropped

    def graph_arena_bytes(self) -> int:
        """Device bytes held by the arenas of this sequence's captured graphs (GpuGraph.arena_bytes;
        0 without graphs or on the CPU)."""
        return sum(int(g.graph.arena_bytes) for g in self._graphs.values() if g.graph is not None)

    @property
    def graph_count(self) -> int:
        """Captured graphs kept now."""
        return len(self._graphs)

    def cached_kv(self, layer: int, positions) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K (RoPE'd, k-normed) and V rows of ``layer`` for absolute ``positions``:
        float32 [n, Hkv, hd] each. Context positions must still be retained (< n_ctx, and within
        the layer's window for bounded layers); positions n_ctx .. n_ctx+B−1 hold the last block
        proposed there. Raises ValueError otherwise."""
        self._check_live("cached_kv")
        lk = self.layers[layer]
        pos = np.asarray(positions, np.int64).reshape(-1)
        lo = lk.valid_lo if lk.keep is None else max(lk.valid_lo, self.n_ctx - lk.keep)
        bad = pos[(pos < lo) | (pos >= min(lk.base + lk.rows, self.n_ctx + self.model.hp.block_size))]
        if bad.size:
            raise ValueError(f"cached_kv: position {int(bad[0])} is not held by layer {layer}")
        r = pos - lk.base
        out = []
        for t in (lk.k, lk.v):
            a = t.numpy()[r]  # a host copy of a device cache
            out.append(sn.dequantize(Tensor(np.ascontiguousarray(a), t.dtype)).numpy()
                       if t.dtype == DType.Q8_0 else np.asarray(a, np.float32))
        return out[0], out[1]

    # ------------------------------------------------------------------ context

    def ingest(self, features: np.ndarray, start_pos: int) -> None:
        """Appends context rows for positions start_pos .. start_pos+n−1.

        features: float32 [n, N·H] (target taps in ``target_layer_ids`` order, one row per committed
        position; a FeatureRing row): a host array (read only, never kept: it may be a view of the
        target's shared ring), or an F32 ``sn.Tensor`` (the cuda-ipc transport's device rows, used on
        the device as they are; copied to the host for a CPU drafter). start_pos must be <= n_ctx
        (append-only; a start below n_ctx drops the later rows first, e.g. to re-ingest after a
        rollback) and start_pos + n must leave room for a block (<= capacity − B). Afterwards
        n_ctx = start_pos + n. Bounded layers compute and store K/V only for the rows they can
        still see.
        Raises ValueError on a gap, a bad width, overflow, or a rollback behind a bounded layer's
        retained rows.
        """
        m, hp = self.model, self.model.hp
        self._check_live("ingest")
        if isinstance(features, sn.Tensor):
            if features.dtype != sn.DType.F32:
                raise ValueError(f"features must be float32, got {features.dtype}")
            feats = (features if features.device == m.device and not m.on_host
                     else np.asarray(features.numpy(), np.float32))
        else:
            feats = np.asarray(features, np.float32)
        if len(feats.shape) != 2:
            raise ValueError(f"features must be 2-D [n, {hp.n_taps * hp.n_embd}], got shape {feats.shape}")
        n = feats.shape[0]
        if not 0 <= start_pos <= self.n_ctx:
            raise ValueError(f"ingest: start_pos {start_pos} would leave a gap after the {self.n_ctx} context rows "
                             "(context rows are appended in position order)")
        if start_pos + n + hp.block_size > self.capacity:
            raise ValueError(f"ingest: {start_pos + n} context rows plus a block of {hp.block_size} exceed the "
                             f"sequence capacity {self.capacity}")
        end = start_pos + n
        first = [start_pos if lk.keep is None else max(start_pos, end - lk.keep) for lk in self.layers]
        for lk in self.layers:  # check every layer before changing any
            if lk.keep is not None:
                lo = max(0, end - lk.keep)
                if start_pos > lo and lo < lk.valid_lo:
                    raise ValueError(f"ingest: re-ingesting from {start_pos} needs context rows from {lo}, but a "
                                     f"windowed layer keeps rows from {lk.valid_lo} only; cannot roll back that far")
        for lk in self.layers:
            lo = 0 if lk.keep is None else max(0, end - lk.keep)
            lk.make_room(lo, start_pos, end + hp.block_size, self.n_ctx)
        self.n_ctx = end
        c_first = min(first) if n else end
        if c_first >= end:
            c = None
        elif isinstance(feats, sn.Tensor):
            c = m.context_rows(feats.view_rows(c_first - start_pos, n) if c_first > start_pos else feats)
        else:
            c = m.context_rows(feats[c_first - start_pos :])
        for i, lk in enumerate(self.layers):
            if first[i] > start_pos:  # rows [start_pos, first) are skipped (never visible again)
                lk.valid_lo = first[i]
            if first[i] >= end:
                continue
            ci = m._ops.rows(c, first[i] - c_first, c.shape[0])
            pos = np.arange(first[i], end, dtype=np.int32)
            rows = (pos - lk.base).astype(np.int32)
            sn.kv_write(lk.k, m._k(i, ci, pos), rows)
            sn.kv_write(lk.v, m._v(i, ci), rows)

    # ------------------------------------------------------------------ block

    def forward_block(self, tokens: Sequence[int], start: int) -> np.ndarray:
        """Runs a block of B tokens at positions start .. start+B−1 over the context rows
        0 .. start−1 and returns the post-final-norm draft hidden, float32 [B, H] (all rows,
        anchor included). start must equal n_ctx. Writes the block's K/V into the cache rows of
        positions start .. (scratch, overwritten by the next ingest). Always eager (op by op)."""
        B = len(tokens)
        self._prepare_block(start, B)
        ids = np.asarray(tokens, np.int32)
        pos = (start + np.arange(B)).astype(np.int32)
        rows = [(pos - lk.base).astype(np.int32) for lk in self.layers]
        return self._block(ids, pos, rows, lambda i, q: self._attend(i, q, start, B), trusted=False)

    def _prepare_block(self, start: int, B: int) -> None:
        """Checks a block at ``start`` and makes every layer's rows of positions start .. start+B−1
        addressable (bounded layers may compact: host-ordered copies, before the block's work)."""
        self._check_live("forward_block")
        if start != self.n_ctx or start + B > self.capacity:
            raise ValueError(f"forward_block: block at {start} (B = {B}) after {self.n_ctx} context rows, "
                             f"capacity {self.capacity}")
        for lk in self.layers:
            lk.make_room(0 if lk.keep is None else max(0, start - lk.keep), start, start + B, self.n_ctx)

    def _check_live(self, what: str) -> None:
        if self.released:
            raise ValueError(f"{what}: this draft sequence was released")

    def _block(self, ids, pos, rows, attend, trusted: bool):
        """The block forward: token ids [B] and positions [B] (numpy, or I32 tensors of the model's
        device), per layer the cache rows [B] its K/V go to, and ``attend(i, q)`` -> layer i's
        attention output [B, Hq, hd]. ``trusted``: the index tensors' values are known valid (no
        read-back: what a graph capture needs). Returns the post-final-norm hidden [B, H]."""
        m, hp, ops = self.model, self.model.hp, self.model._ops
        B = int(ids.shape[0])
        h = ops.a(sn.embedding(m.token_embd, ids, trusted=trusted))
        if hp.input_embedding_scale != 1.0:
            h = ops.scale(h, hp.input_embedding_scale)
        df2 = hp.dflash2 is not None
        for i, l in enumerate(m.layers):
            u = ops.a(sn.rms_norm(h, l.attn_norm, hp.rms_eps))
            if df2:
                base_a, base_f = m._conv_base[i]
                D = m._dyn(u, l.attn_conv_proj)
                u = m._conv(u, D, 0, base_a[0])
            q = ops.reshape(ops.a(sn.matmul(u, l.attn_q)), B, hp.n_head, hp.head_dim)
            q = m.rope(sn.rms_norm(q, l.attn_q_norm, hp.rms_eps), pos, trusted)
            lk = self.layers[i]
            sn.kv_write(lk.k, m._k(i, u, pos, trusted), rows[i], trusted=trusted)
            sn.kv_write(lk.v, m._v(i, u), rows[i], trusted=trusted)
            a = ops.reshape(attend(i, q), B, hp.n_head * hp.head_dim)
            a = ops.a(sn.matmul(a, l.attn_output))
            if df2:
                a = m._conv(a, D, 1, base_a[1])
            u, h = sn.rms_norm(a, l.ffn_norm, hp.rms_eps, residual=h)
            u, h = ops.a(u), ops.a(h)
            if df2:
                E = m._dyn(u, l.ffn_conv_proj)
                u = m._conv(u, E, 0, base_f[0])
            f = ops.a(sn.matmul(sn.swiglu(sn.matmul(u, l.ffn_gate), sn.matmul(u, l.ffn_up)), l.ffn_down))
            if df2:
                f = m._conv(f, E, 1, base_f[1])
            h = ops.a(sn.add(h, f))
        return ops.a(sn.rms_norm(h, m.output_norm, hp.rms_eps))

    def _attend(self, i: int, q: Tensor, start: int, B: int):
        """Attention of the block queries (positions start..start+B−1) over the keys of positions
        [lo, start+B) with the layer's mask, lo = the first retained row (under context_cap: the
        first of the last cap context rows). Positions are passed relative to lo: causality and
        windows only depend on differences, so this is exact."""
        m, lk = self.model, self.layers[i]
        causal, W = m.causal[i], m.window[i]
        lo = lk.base
        if W == 0 and m.context_cap is not None:
            lo = max(lo, start - m.context_cap)
        kc, vc = lk.view(lo, start + B - lo, m.kv_dtype)
        qpos = (start - lo + np.arange(B)).astype(np.int32)
        kv_len = start - lo + B
        mask = None
        if W and not causal and B > W:  # p_k − p_q < W inside the block (only binds when B > W)
            kp = np.arange(kv_len)[None, :]
            mask = (kp - qpos[:, None] < W).astype(np.int32)
        return m._ops.a(sn.attention(q, kc, vc, kv_len, qpos, causal=causal, window=W, mask=mask))

    # ------------------------------------------------------------------ CUDA graphs

    def _graph_key(self, start: int, B: int, sampling, markov: str) -> tuple | None:
        """The key of the graph that runs this propose, or None when it runs eagerly (module
        docstring): (B, head, bound, per_row). bound: the full layers' attention bound (0 without
        unbounded layers); per_row: some bounded layer's lower key limit differs per row and cuts
        into the retained rows at this start, so it takes one attention call per row."""
        m, hp = self.model, self.model.hp
        # A block smaller than the file's is captured once it repeats (a --max-draft-tokens cap
        # asks for the same B every step); the shrinking blocks at a request's end stay eager,
        # where a capture per step would cost more than it saves.
        if (not m.cuda_graphs or m.on_host or sampling is not None
                or (B != hp.block_size and B != self._last_block)
                or hp.final_logit_softcapping or (hp.dspark is not None and markov == "unfused")):
            return None
        per_row = False
        for i in range(len(self.layers)):
            causal, W = m.causal[i], m.window[i]
            if W and not causal:
                if B > W:  # p_k − p_q < W binds inside the block: a host mask (eager)
                    return None
                per_row |= start + B > W
            elif causal and not W and m.context_cap is not None:
                per_row |= start > m.context_cap
        unbounded = any(lk.keep is None for lk in self.layers)
        bound = min(self.capacity, graph_rows(start + B)) if unbounded else 0
        if hp.dflash2 is not None:
            head = "selector"
        elif hp.dspark is not None:
            head = "markov" if markov == "fused" else "markov-off"
        else:
            head = "argmax"
        key = (B, head, bound, per_row)
        return None if key in self._no_graph else key

    def _layer_plan(self, i: int, B: int, bound: int, per_row: bool):
        """Layer i's attention in a graph: (kv_len, last, window). Every call is causal over cache
        rows < kv_len; ``last``: each row's query position is the block's last (a non-causal row sees
        every key up to the block's end), else its own; window: one int (one call for the block) or B
        ints (one call per row, row r with window[r]). Each row's visible keys equal the eager call's
        (module docstring), relative to the layer's base like the eager positions."""
        m, lk = self.model, self.layers[i]
        causal, W, cap = m.causal[i], m.window[i], m.context_cap
        kv_len = bound if lk.keep is None else lk.rows
        if causal:
            if W or cap is None:
                return kv_len, False, W
            # keys from start − cap: row r at start + r needs a window of cap + 1 + r
            return kv_len, False, [cap + 1 + r for r in range(B)] if per_row else 0
        if W:  # keys from start + r − W + 1 to the block's end: a window of W + B − 1 − r from the last position
            return kv_len, True, [W + B - 1 - r for r in range(B)] if per_row else 0
        return kv_len, True, 0 if cap is None else cap + B

    def _graph_inputs(self, seed: int, start: int, key: tuple) -> np.ndarray:
        """The graphs' input buffer for a block at ``start``: segments of block_size int32 — token
        ids, positions, then per layer its cache rows and its attention query positions (both
        relative to the layer's base); only the first B entries of a segment are read."""
        B, _, bound, per_row = key
        hp = self.model.hp
        buf = np.zeros((2 + 2 * len(self.layers), hp.block_size), np.int32)
        buf[0, :B] = [seed] + [hp.mask_token_id] * (B - 1)
        pos = start + np.arange(B)
        buf[1, :B] = pos
        for i, lk in enumerate(self.layers):
            buf[2 + 2 * i, :B] = pos - lk.base
            buf[3 + 2 * i, :B] = start + B - 1 - lk.base if self._layer_plan(i, B, bound, per_row)[1] else pos - lk.base
        return buf.reshape(-1)

    def _graph_body(self, key: tuple):
        """The device work a graph records: (proposal rows' hidden [n, H], logits [n, V], the head's
        outputs), reading its inputs from the sequence's input buffer. No host read-back."""
        B, head, bound, per_row = key
        m, hp, ops = self.model, self.model.hp, self.model._ops
        S = hp.block_size

        def seg(j):
            return self._graph_in.view_rows(j * S, j * S + B)

        plans = [self._layer_plan(i, B, bound, per_row) for i in range(len(self.layers))]

        def attend(i, q):
            kv_len, _, window = plans[i]
            lk, qpos = self.layers[i], seg(3 + 2 * i)
            if isinstance(window, int):
                return sn.attention(q, lk.k, lk.v, kv_len, qpos, causal=True, window=window, trusted=True)
            return ops.cat([sn.attention(q.view_rows(r, r + 1), lk.k, lk.v, kv_len, qpos.view_rows(r, r + 1),
                                         causal=True, window=window[r], trusted=True) for r in range(B)])

        hidden_all = self._block(seg(0), seg(1), [seg(2 + 2 * i) for i in range(len(self.layers))], attend,
                                 trusted=True)
        hidden = ops.rows(hidden_all, hp.first_proposal_row, B)
        logits = m.logits(hidden)
        seed = self._graph_in.view_rows(0, 1)
        if head == "argmax":
            out = sn.argmax(logits)
        elif head == "selector":
            out = _selector_gather_device(ops, logits, hidden, seed, *m.selector, hp.dflash2.selector_top_k)
        else:
            out = _markov_chain_device(ops, logits, hidden, seed, *m.markov, correct=head == "markov",
                                       keep_prev=m._conf_w is not None and hp.dspark.confidence_with_markov)
        return hidden, logits, out

    def _graph(self, key: tuple) -> "_CapturedPropose":
        """The graph of ``key``, captured now if needed (nothing runs until :meth:`_replay`)."""
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        m = self.model
        gpu = m.device == sn.Device.GPU
        if self._graph_in is None:
            n = (2 + 2 * len(self.layers)) * m.hp.block_size
            if gpu:
                self._graph_in = Tensor.zeros([n], DType.I32, m.device)
            else:  # the CPU stand-in: a tensor viewing a numpy buffer written in place
                self._graph_host = np.zeros(n, np.int32)
                self._graph_in = Tensor(self._graph_host)
        if gpu:
            sn.gpu_graph_begin(self._arena_reserve(key))
            try:
                outs = self._graph_body(key)
                g = _CapturedPropose(sn.gpu_graph_end(), None, *outs)
            except BaseException:
                sn.gpu_graph_abort()
                raise
        else:
            g = _CapturedPropose(None, lambda: self._graph_body(key))
        self.graph_captures += 1
        # within a sequence the bound only grows (a rollback aside): that head's smaller bounds are done
        for old in [k for k in self._graphs if k[:2] == key[:2] and k[3] == key[3] and k[2] < key[2]]:
            del self._graphs[old]
        self._graphs[key] = g
        while len(self._graphs) > m.max_graphs:
            self._graphs.popitem(last=False)
        return g

    def _arena_reserve(self, key: tuple) -> int:
        """Device bytes a capture reserves up front for its arena (it grows past them when needed):
        :func:`specd.target_worker.memory.drafter_graph_arena_bytes` — the logits (DSpark: ~4 [n, V]
        tensors with the chain's per-row rows) plus 16 MiB of activations and attention scratch.
        That function counts the file's block size, the largest B a key (``key[0]``) can have."""
        return drafter_graph_arena_bytes(self.model.hp, markov=key[1].startswith("markov"))

    def _replay(self, g: "_CapturedPropose", key: tuple, seed: int, start: int) -> None:
        """Runs graph g for a block at ``start`` after ``seed`` (one asynchronous upload of the inputs,
        ordered after the work already queued)."""
        inputs = self._graph_inputs(seed, start, key)
        if g.graph is not None:
            sn.gpu_write_async(self._graph_in, inputs)
            g.graph.replay()
        else:
            self._graph_host[:] = inputs
            g.hidden, g.logits, g.head = g.body()

    # ------------------------------------------------------------------ proposals

    def propose(self, seed_token: int, committed_len: int, *, return_logits: bool = False,
                return_hidden: bool = False, topk: int = 0, temperature: float = 1.0,
                confidence_threshold: float | None = None, sampling: Sampling | None = None,
                block_size: int | None = None, markov: str = DEFAULT_MARKOV) -> Proposal:
        """Proposals for one block after ``committed_len`` committed positions (greedy unless
        ``sampling`` is given).

        seed_token: the anchor (newest decided token, not yet through the target), a target id.
        committed_len: must equal ``n_ctx`` (every committed position's features ingested); the
            seed sits at that position.
        return_logits / return_hidden: fill ``Proposal.logits`` (+ ``markov_logits`` for DSpark) /
            ``Proposal.hidden``.
        topk: 0, or k >= 1 to fill ``topk_ids`` / ``topk_logprobs`` at ``temperature`` (> 0) for tree
            drafting (spec-loop.md §7.1); DFlash 2 needs k <= selector_top_k.
        confidence_threshold: DSpark only; None/0 = off (default). Otherwise keep drafts up to (not
            including) the first k with c_k < threshold (DeepSpec ``_confident_prefix_length``,
            drafters.md §5.3); may return 0 drafts. Needs a confidence head.
        sampling: None (greedy: argmax / Markov argmax chain / selector argmax chain), or a
            :class:`Sampling`: every draft is drawn from its proposal distribution, returned in
            ``Proposal.q`` (DSpark / DFlash 2 chains condition on the sampled previous draft).
        block_size: None (the file's B), or a smaller block B' run instead (ZL-0.1.0 shrinks the
            block near max_new_tokens; drafters.md §1): [seed, M × (B'−1)], B' − 1 (DFlash,
            DFlash 2; B' >= 2) or B' (DSpark; B' >= 1) drafts.
        markov: DSpark Markov mode, one of :data:`MARKOV_MODES` (default ``"fused"``; see there:
            fused and unfused are bitwise identical, ``"off"`` is plain argmax of the base logits).
            Ignored by DFlash / DFlash 2 (no Markov head), but still validated.
        Returns a :class:`Proposal`. Raises ValueError on a bad argument.
        """
        m, hp = self.model, self.model.hp
        self._check_live("propose")
        if committed_len != self.n_ctx:
            raise ValueError(f"propose: committed_len {committed_len} != {self.n_ctx} ingested context rows "
                             "(ingest the features of every committed position first)")
        if not 0 <= int(seed_token) < hp.n_vocab:
            raise ValueError(f"propose: seed token {seed_token} is outside the vocabulary [0, {hp.n_vocab})")
        if topk < 0 or (topk and not (temperature > 0 and math.isfinite(temperature))):
            raise ValueError(f"propose: topk must be >= 0 and temperature finite > 0 (got {topk}, {temperature})")
        if hp.dflash2 is not None and topk > hp.dflash2.selector_top_k:
            raise ValueError(f"propose: topk {topk} exceeds the DFlash 2 selector's K = {hp.dflash2.selector_top_k}")
        if topk > hp.n_vocab:
            raise ValueError(f"propose: topk {topk} exceeds the vocabulary {hp.n_vocab}")
        if markov not in MARKOV_MODES:
            raise ValueError(f"propose: markov must be one of {MARKOV_MODES}, got {markov!r}")
        if confidence_threshold and (hp.dspark is None or m._conf_w is None):
            raise ValueError("propose: confidence_threshold needs a DSpark drafter with a confidence head")
        start = committed_len
        B = hp.block_size if block_size is None else int(block_size)
        if not hp.first_proposal_row + 1 <= B <= hp.block_size:
            raise ValueError(f"propose: block_size {block_size} outside [{hp.first_proposal_row + 1}, {hp.block_size}]")
        ops = m._ops
        key = self._graph_key(start, B, sampling, markov)
        self._last_block = B
        graph = None
        if key is not None:  # the device work as one captured graph; its outputs stay on the device
            self._prepare_block(start, B)
            try:
                graph = self._graph(key)
            except RuntimeError as exc:  # e.g. no device memory for the arena: this key runs eagerly
                log.warning("drafter: CUDA graph capture of %s failed (%s); that propose shape runs eagerly", key, exc)
                self._no_graph.add(key)
        if graph is not None:
            self._replay(graph, key, int(seed_token), start)
            hidden, logits = graph.hidden, graph.logits
        else:
            hidden_all = self.forward_block([int(seed_token)] + [hp.mask_token_id] * (B - 1), start)
            if m.on_host:
                hidden = np.ascontiguousarray(hidden_all[hp.first_proposal_row:])
            else:  # device rows; only the outputs asked for are copied to the host below
                hidden = ops.rows(hidden_all, hp.first_proposal_row, B)
            # unfused: the lm_head runs per row inside the chain (markov_chain fills ``logits``)
            if hp.dspark is not None and markov == "unfused":
                logits = np.empty((hidden.shape[0], hp.n_vocab), np.float32) if m.on_host else None
            else:
                logits = m.logits(hidden)
        head = None if graph is None else graph.head
        out = Proposal(tokens=np.zeros(0, np.int32), start=start)
        if hp.dflash2 is not None:
            self._select(out, hidden, logits, int(seed_token), topk, temperature, sampling, head)
        elif hp.dspark is not None:
            logits = self._markov(out, hidden, logits, int(seed_token), topk, temperature, return_logits,
                                  confidence_threshold, sampling, markov, head)
        else:
            host_logits = logits if m.on_host else (ops.host(logits) if sampling is not None or topk else None)
            if head is not None:
                out.tokens = ops.host(head).astype(np.int32)
            elif sampling is None:
                out.tokens = sn.argmax(logits).numpy().astype(np.int32)
            else:
                out.q = sampling_probs(host_logits, sampling.temperature, sampling.top_p, sampling.top_k)
                out.tokens = np.array([_draw(r, sampling.rng) for r in out.q], np.int32)
            if topk:
                ids = sn.topk(logits, topk)[1].numpy()
                lse = _log_softmax(host_logits / np.float32(temperature))
                out.topk_ids = ids.astype(np.int32)
                out.topk_logprobs = np.take_along_axis(lse, ids.astype(np.int64), axis=1)
        if return_logits:
            out.logits = logits if m.on_host else ops.host(logits)
        if return_hidden:
            out.hidden = hidden if m.on_host else ops.host(hidden)
        return out

    def _markov(self, out: Proposal, hidden, logits, seed, topk, temperature, keep, threshold, sampling,
                markov: str = DEFAULT_MARKOV, chain=None):
        """Fills ``out`` for DSpark; returns the base logits (the unfused chain computes them).
        ``chain``: the device chain a graph replay already ran (:func:`_markov_chain_device`), or None."""
        m = self.model
        w1, w2 = m.markov
        head = m.logits if markov == "unfused" else None
        cwm = m.hp.dspark.confidence_with_markov
        if m.on_host:
            toks, corrected, conf, q = markov_chain(logits, hidden, seed, w1, w2, m._conf_w, m._conf_b, cwm,
                                                    sampling, head=head, correct=markov != "off")
        else:
            if chain is None:
                chain = _markov_chain_device(m._ops, logits, hidden, seed, w1, w2, sampling, head=head,
                                             correct=markov != "off", keep_prev=m._conf_w is not None and cwm)
            toks, logits, corrected, conf, q = _markov_finish(m._ops, hidden, chain, m._conf_w, m._conf_b, cwm)
            corrected_dev = corrected
            if keep or topk:
                corrected = m._ops.host(corrected)
        out.confidence, out.q = conf, q
        keep_n = len(toks)
        if threshold:
            low = np.nonzero(conf < threshold)[0]
            keep_n = int(low[0]) if low.size else keep_n
        out.tokens = toks[:keep_n]
        if keep:
            out.markov_logits = corrected
        if topk:
            lse = _log_softmax(corrected / np.float32(temperature))
            ids = sn.topk(corrected if m.on_host else corrected_dev, topk)[1].numpy().astype(np.int32)
            out.topk_ids = ids
            out.topk_logprobs = np.take_along_axis(lse, ids.astype(np.int64), axis=1)
        return logits

    def _select(self, out: Proposal, hidden, logits, seed, topk, temperature, sampling, gathered=None) -> None:
        """Fills ``out`` for DFlash 2. ``gathered``: the selector inputs a graph replay already computed
        on the device (:func:`_selector_gather_device`), or None."""
        m = self.model
        hproj, pred_cb, succ_cb = m.selector
        if gathered is None:
            toks, cand, scores, qk = selector_chain(logits, hidden, seed, hproj, pred_cb, succ_cb,
                                                    m.hp.dflash2.selector_top_k, sampling)
        else:
            uv, cand, p, succ, pred = (m._ops.host(x) for x in gathered)
            n, k = cand.shape
            toks, cand, scores, qk = _selector_pick(uv, cand.astype(np.int32), p, succ.reshape(n, k, -1), pred,
                                                    sampling)
        out.tokens, out.candidates, out.candidate_scores = toks, cand, scores
        if qk is not None:
            out.q = np.zeros((cand.shape[0], m.hp.n_vocab), np.float32)
            np.put_along_axis(out.q, cand.astype(np.int64), qk, axis=1)
        if topk:
            lse = _log_softmax(scores / np.float32(temperature))
            order = np.argsort(-scores, axis=1, kind="stable")[:, :topk]
            out.topk_ids = np.take_along_axis(cand, order, axis=1)
            out.topk_logprobs = np.take_along_axis(lse, order, axis=1)


# ---------------------------------------------------------------------- family heads (pure functions)


def markov_chain(logits: np.ndarray, hidden: np.ndarray, seed: int, w1: Tensor, w2: Tensor,
                 conf_w: np.ndarray | None, conf_b: float | None, conf_with_markov: bool,
                 sampling: Sampling | None = None, *, head=None, correct: bool = True):
    """DSpark Markov-corrected greedy chain + confidence head (drafters.md §5.2–5.3; DS
    ``markov_head.py:VanillaMarkov`` / ``sample_block_tokens``, ``common.py:AcceptRatePredictor``).

    logits: float32 [n, V], U_k = lm_head(h_k) of block row k−1 (k = 1..n); hidden: float32 [n, H],
    the post-final-norm rows h_k; seed: x_0 (the anchor); w1, w2: [V, r] Tensors (any weight dtype;
    W1 gathered by token, W2 used as a Linear r → V); conf_w: float32 [d_in] or None, conf_b: bias.
    For k = 1..n:  ℓ_k = U_k + W2·W1[x_{k−1}],  x_k = argmax ℓ_k (first maximum),
    c_k = σ(w·[h_k ; W1[x_{k−1}]] + b) (``[h_k]`` alone when not conf_with_markov; float64).
    With ``sampling``: x_k ~ q_k = sampling_probs(ℓ_k) instead of the argmax.
    Returns (tokens int32 [n], ℓ float32 [n, V], confidence float32 [n] or None, q float32 [n, V]
    or None). The W2 GEMV and the choice are sequential per row (each needs the previous one).

    Modes (:data:`MARKOV_MODES`): fused = ``logits`` precomputed for the whole block (one lm_head
    matmul); unfused = ``head`` given (float32 [1, H] -> [1, V], the transformed lm_head): row k's
    U_k = head(h_k) is computed inside the chain and written into ``logits[k]`` (the caller passes an
    empty [n, V] array) — bitwise equal to fused because the native matmul is batch invariant;
    ``correct=False`` (off): ℓ_k = U_k (no W2·W1 bias; x_k = argmax U_k), the confidence head still
    takes W1[x_{k−1}] of the chosen chain.
    """
    n = logits.shape[0]
    toks = np.zeros(n, np.int32)
    corrected = np.empty((n, logits.shape[1]), np.float32)
    q = None if sampling is None else np.empty_like(corrected)
    prev_rows = []
    prev = int(seed)
    for k in range(n):
        if head is not None:
            logits[k] = head(hidden[k : k + 1])[0]
        e = sn.embedding(w1, np.array([prev], np.int32)).numpy()  # [1, r]
        prev_rows.append(e[0])
        corrected[k] = logits[k] + sn.matmul(e, w2).numpy()[0] if correct else logits[k]
        if sampling is None:
            prev = int(sn.argmax(corrected[k : k + 1]).numpy()[0])
        else:
            q[k] = sampling_probs(corrected[k : k + 1], sampling.temperature, sampling.top_p, sampling.top_k)[0]
            prev = _draw(q[k], sampling.rng)
        toks[k] = prev
    conf = None
    if conf_w is not None:
        x = np.concatenate([hidden, np.stack(prev_rows)], axis=1) if conf_with_markov else hidden
        if x.shape[1] != conf_w.shape[0]:
            raise ValueError(f"confidence head expects {conf_w.shape[0]} inputs, got {x.shape[1]}")
        z = x.astype(np.float64) @ conf_w.astype(np.float64) + float(conf_b)
        conf = (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    return toks, corrected, conf, q


def _markov_chain_device(ops, logits, hidden, seed, w1: Tensor, w2: Tensor, sampling: Sampling | None = None, *,
                         head=None, correct: bool = True, keep_prev: bool = True):
    """The device part of :func:`markov_chain` on sn.Tensors of the model's device (``ops``: its
    _TensorOps): the W1 gather, the W2 GEMV, the bias add and the argmax run there per row, a greedy
    chain feeding each argmax to the next gather on the device, so nothing is read back (what a graph
    capture records; ``seed``: an int, or an I32 [1] device tensor). The fused base logits are one
    [n, V] device tensor, the unfused ones are computed row by row by ``head`` (logits None). With
    ``sampling`` each corrected row is copied to the host for q and the draw.
    Returns (tokens: I32 tensor [n] when greedy, else int32 numpy [n]; base logits Tensor [n, V];
    corrected logits Tensor [n, V]; the W1 rows of each draft's predecessor, Tensor [n, r], or None
    without ``keep_prev``; q float32 [n, V] or None); :func:`_markov_finish` completes it."""
    n = int(hidden.shape[0])
    toks = None if sampling is None else np.zeros(n, np.int32)
    rows, corrected, prev_rows, picks = [], [], [], []
    q = None
    # greedy: then the device's argmax, I32 [1], never read back here
    prev = seed if isinstance(seed, Tensor) else np.array([int(seed)], np.int32)
    for k in range(n):
        u = head(ops.rows(hidden, k, k + 1)) if head is not None else ops.rows(logits, k, k + 1)
        rows.append(u)
        # trusted: an argmax of the V logits indexes W1 [V, r] (contract.py), so the ids need no
        # read-back check, and the greedy chain queues all its steps without a host round trip.
        e = sn.embedding(w1, prev, trusted=True)  # [1, r]
        prev_rows.append(e)
        c = sn.add(u, sn.matmul(e, w2)) if correct else u
        corrected.append(c)
        if sampling is None:
            prev = sn.argmax(c)
            picks.append(prev)
        else:
            qk = sampling_probs(ops.host(c), sampling.temperature, sampling.top_p, sampling.top_k)
            q = np.empty((n, qk.shape[1]), np.float32) if q is None else q
            q[k] = qk[0]
            toks[k] = _draw(q[k], sampling.rng)
            prev = toks[k : k + 1]
    if sampling is None:
        toks = ops.cat(picks)  # one read-back for the whole chain
    base = logits if head is None else ops.cat(rows)
    return toks, base, ops.cat(corrected), ops.cat(prev_rows) if keep_prev else None, q


def _markov_finish(ops, hidden, chain, conf_w, conf_b, conf_with_markov: bool):
    """The host part of the device chain (``chain`` from :func:`_markov_chain_device`): the tokens read
    back and the confidence head (float64, [n, H + r] · w) as in markov_chain.
    Returns (tokens int32 [n], base logits Tensor [n, V], corrected logits Tensor [n, V],
    confidence float32 [n] or None, q float32 [n, V] or None)."""
    toks, base, corrected, prev, q = chain
    if isinstance(toks, Tensor):
        toks = ops.host(toks).astype(np.int32)
    conf = None
    if conf_w is not None:
        h = ops.host(hidden)
        x = np.concatenate([h, ops.host(prev)], axis=1) if conf_with_markov else h
        if x.shape[1] != conf_w.shape[0]:
            raise ValueError(f"confidence head expects {conf_w.shape[0]} inputs, got {x.shape[1]}")
        z = x.astype(np.float64) @ conf_w.astype(np.float64) + float(conf_b)
        conf = (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    return toks, base, corrected, conf, q


def selector_chain(logits: np.ndarray, hidden: np.ndarray, seed: int, hproj: Tensor, pred_cb: Tensor,
                   succ_cb: Tensor, top_k: int, sampling: Sampling | None = None):
    """DFlash 2 candidate-selector greedy chain (drafters.md §6.3; ZL-0.1.0 ``CandidateSelector.select``).

    logits: float32 [n, V] unary logits (already × output_multiplier and softcapped); hidden:
    float32 [n, H] post-final-norm rows; seed: the anchor; hproj [R, H]; pred_cb, succ_cb [V, R].
    Per slot s: (u_s, C_s) = top-K of logits[s] (best first, lower id first on ties);
    p_s = W_h h_s; score_s(c) = u_s[c] + Σ_ρ Pred[prev]_ρ p_s,ρ Succ[c]_ρ; choose argmax (first
    maximum in C_s order); prev = seed for s = 0, else the previous choice. With ``sampling``:
    draw from q_s = softmax(score_s / T) over the K candidates (ZL-0.1.0 applies no top-p/top-k here).
    Returns (tokens int32 [n], candidates int32 [n, K], scores float32 [n, K] for the chosen prev,
    q float32 [n, K] over the candidates or None).
    """
    n = logits.shape[0]
    uv, cand = sn.topk(logits, top_k)
    uv, cand = uv.numpy(), cand.numpy().astype(np.int32)
    h = hidden if isinstance(hidden, Tensor) else np.ascontiguousarray(hidden, np.float32)
    p = sn.matmul(h, hproj).numpy()  # [n, R]
    succ = sn.embedding(succ_cb, np.ascontiguousarray(cand.reshape(-1))).numpy().reshape(n, top_k, -1)
    # Every predecessor the chain can meet is the seed or one of slots 0..n-2's candidates, so their
    # Pred rows are gathered in one call (one device round trip per propose instead of one per slot;
    # the same rows, so the same scores).
    pred_rows = sn.embedding(pred_cb, np.concatenate((np.array([seed], np.int32), cand[:-1].reshape(-1)))).numpy()
    return _selector_pick(uv, cand, p, succ, pred_rows, sampling)


def _selector_gather_device(ops, logits, hidden, seed: Tensor, hproj: Tensor, pred_cb: Tensor, succ_cb: Tensor,
                            top_k: int):
    """The inputs of :func:`_selector_pick` computed on the device from device tensors, nothing read
    back (what a graph capture records): (top-K values [n, K], ids I32 [n, K], p [n, R], the Succ rows
    of every candidate [n·K, R], the Pred rows of the seed (``seed``: I32 [1]) and of slots
    0..n−2's candidates [1 + (n−1)·K, R]). The same ops and rows as :func:`selector_chain`'s (exact
    gathers of the same ids), so the same values; the ids are topk outputs, in range (trusted)."""
    n = int(hidden.shape[0])
    uv, cand = sn.topk(logits, top_k)
    p = sn.matmul(hidden, hproj)
    succ = sn.embedding(succ_cb, cand.reshape([n * top_k]), trusted=True)
    pred = sn.embedding(pred_cb, seed, trusted=True)
    if n > 1:
        prev_ids = cand.view_rows(0, n - 1).reshape([(n - 1) * top_k])
        pred = ops.cat([pred, sn.embedding(pred_cb, prev_ids, trusted=True)])
    return uv, cand, p, succ, pred


def _selector_pick(uv: np.ndarray, cand: np.ndarray, p: np.ndarray, succ: np.ndarray, pred_rows: np.ndarray,
                   sampling: Sampling | None = None):
    """The selector chain of :func:`selector_chain` on its gathered inputs (float32 host arrays): uv
    [n, K] top-K unary values, cand int32 [n, K], p [n, R], succ [n, K, R], pred_rows [1 + (n−1)·K, R]
    (the seed's Pred row, then those of slots 0..n−2's candidates). Returns as selector_chain."""
    n, top_k = cand.shape
    scores = np.empty((n, top_k), np.float32)
    toks = np.zeros(n, np.int32)
    q = None if sampling is None else np.empty((n, top_k), np.float32)
    row = 0  # pred_rows' row of the current predecessor
    for s in range(n):
        scores[s] = uv[s] + succ[s] @ (pred_rows[row] * p[s])
        if sampling is None:
            j = int(sn.argmax(scores[s : s + 1]).numpy()[0])
        else:
            q[s] = sampling_probs(scores[s : s + 1], sampling.temperature)[0]
            j = _draw(q[s], sampling.rng)
        toks[s] = cand[s, j]
        row = 1 + s * top_k + j
    return toks, cand, scores, q


def grouped_dynamic_conv(y: np.ndarray, dyn: np.ndarray, base: np.ndarray, group_size: int) -> np.ndarray:
    """One side of DFlash 2's grouped dynamic causal conv (drafters.md §6.2; ZL-0.1.0
    ``_grouped_dynamic_convolve``): out[t, c] = Σ_o (base[o, c] + dyn[t, o, c // group_size]) · y[t − o, c]
    with y[t − o] = 0 before the block start. y float32 [L, H]; dyn float32 [L, taps, H / group_size];
    base float32 [taps, H]. The coefficient is taken at the output row t. Returns float32 [L, H]."""
    coef = base[None, :, :] + np.repeat(dyn, group_size, axis=2)  # [L, taps, H]
    out = coef[:, 0] * y
    for o in range(1, min(base.shape[0], y.shape[0])):
        out[o:] += coef[o:, o] * y[:-o]
    return out.astype(np.float32)
