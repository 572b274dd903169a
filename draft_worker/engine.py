"""The real drafters behind the drafter worker: :class:`ModelDrafter` adapts
:class:`~specd.draft_worker.model.DrafterModel` (DFlash, DSpark, DFlash 2) to the worker's
:class:`~specd.draft_worker.server.Drafter` protocol.

Start-up (:func:`open_model_drafter`): the draft GGUF is read and validated
(:func:`~specd.draft_worker.gguf_loader.load_drafter`), the target GGUF is mapped only for its
hyperparameters, ``token_embd`` and ``output`` (:func:`~specd.target_worker.gguf_loader.load_qwen35`,
zero-copy views; the drafter reuses the target's embedding and head, drafters.md §3), and the pair is
checked (:func:`~specd.draft_worker.gguf_loader.check_pair`: hidden size, vocabulary, mask id, tap
ids < target layers, trained target depth) — a mismatch raises ``DrafterPairError`` naming both files.
On the GPU the embedding and head are then either mapped from the target worker (CUDA IPC,
``share_target_weights="auto"`` with its address: :mod:`specd.target_worker.shared_weights`) or
uploaded from the target GGUF (own copy; the reason is logged).

Per sequence a :class:`~specd.draft_worker.model.DraftSequence` holds the drafter's context K/V.
``open(seq_id, capacity)`` sizes it to the feature ring's capacity plus one block (the block rows of
a proposal sit after the committed positions); ``ingest`` appends committed positions' feature rows;
``propose`` runs one block (shrunk to the requested number of drafts: B' = max_tokens +
first_proposal_row, so the verify never carries unused drafts) and returns the greedy drafts with
the family's extras: DSpark confidences (and the optional confidence-gate truncation), per-position
top-k log-probs for DDTree (spec-loop.md §7.1; DSpark Markov-corrected along the argmax spine,
DFlash 2 selector scores re-normalised per position). DSpark proposals follow the Markov mode
(``dspark_markov``: the drafter's default, overridden per request; fused / unfused / off,
model.MARKOV_MODES); other families ignore it.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

import specd.native as sn

from .gguf_loader import check_pair, load_drafter
from .model import DEFAULT_MARKOV, MARKOV_MODES, DrafterModel, DraftSequence

__all__ = ["ModelDrafter", "open_model_drafter", "KV_DTYPES"]

KV_DTYPES = {"f32": sn.DType.F32, "f16": sn.DType.F16, "q8_0": sn.DType.Q8_0}


class ModelDrafter:
    """A :class:`DrafterModel` behind the drafter worker's ``Drafter`` protocol.

    Args:
        model: the bound drafter (its target embedding / head already attached).
        name: reported by Info (default: the drafter family).
        default_capacity: positions per sequence when ``open`` was not called (ingest-first use,
            tests); default 4096.

    Attributes: ``family`` ("dflash", "dspark", "dflash2"), ``block_size`` (most drafts per propose =
    ``hparams.n_drafts``), ``n_vocab``, ``target_layer_ids``, ``max_top_k`` (n_vocab, or the DFlash 2
    selector's K), ``has_confidence`` (a DSpark confidence head), ``dspark_markov`` (the default
    Markov mode, ``dspark_markov`` argument, default "fused"; "" when the family has no Markov head:
    a request's mode is then ignored).
    """

    def __init__(self, model: DrafterModel, name: str = "", default_capacity: int = 4096,
                 dspark_markov: str = DEFAULT_MARKOV):
        if dspark_markov not in MARKOV_MODES:
            raise ValueError(f"drafter dspark_markov must be one of {MARKOV_MODES}, got {dspark_markov!r}")
        hp = model.hp
        self.model, self.hp = model, hp
        self.family = hp.family
        self.name = name or hp.family
        self.block_size = int(hp.n_drafts)
        self.n_vocab = int(hp.n_vocab)
        self.target_layer_ids = tuple(int(i) for i in hp.target_layer_ids)
        self.max_top_k = int(hp.dflash2.selector_top_k) if hp.dflash2 is not None else self.n_vocab
        self.has_confidence = hp.dspark is not None and model._conf_w is not None
        # the default DSpark Markov mode; "" for families without a Markov head (requests' modes ignored)
        self.dspark_markov = dspark_markov if hp.dspark is not None else ""
        self.default_capacity = default_capacity
        # the target's embedding / head mapped from the target worker (shared_weights.SharedHead) or
        # None (own copy), and how that was decided (shared_weights.HeadSharing); set by open_model_drafter
        self.shared_head = None
        self.head_sharing = None
        self.seqs: dict[str, DraftSequence] = {}
        self.lock = threading.Lock()
        # one model, one device: forwards of different sequences are serialised (as in the target worker)
        self.compute_lock = threading.Lock()

    def open(self, seq_id: str, capacity: int) -> None:
        """Allocates the sequence's state for ``capacity`` committed positions (the feature ring's
        capacity) plus one block of proposal rows. Idempotent for a known sequence."""
        with self.lock:
            if seq_id not in self.seqs:
                self.seqs[seq_id] = self.model.new_sequence(int(capacity) + self.hp.block_size)

    def ingest(self, seq_id: str, start: int, tokens: Sequence[int], features: np.ndarray) -> None:
        """Committed positions start .. start+n-1 (float32 features [n, n_taps * n_embd]: a host array,
        e.g. a read-only view of the shm ring, or with the cuda-ipc transport a GPU ``sn.Tensor`` taken
        as it is; read during the call, never kept); ValueError on a gap or a wrong width."""
        with self.lock:
            seq = self.seqs.get(seq_id)
            if seq is None:
                seq = self.seqs[seq_id] = self.model.new_sequence(self.default_capacity + self.hp.block_size)
        if start != seq.n_ctx:
            raise ValueError(f"drafter: sequence {seq_id} has {seq.n_ctx} positions, ingest starts at {start}")
        with self.compute_lock:
            seq.ingest(features if isinstance(features, sn.Tensor) else np.asarray(features, np.float32), start)

    def propose(self, seq_id: str, anchor: int, max_tokens: int, options=None):
        """Up to ``max_tokens`` greedy drafts after ``anchor`` as a ``Draft`` (see
        :class:`specd.draft_worker.server.Draft`). options: a ``ProposeOptions`` (confidence
        threshold, top_k, top-k temperature, DSpark Markov mode: "" = this drafter's default;
        ignored without a Markov head) or None. ValueError on an unknown sequence or a bad
        option (threshold without a confidence head, top_k above max_top_k)."""
        from .server import Draft, ProposeOptions

        opts = options or ProposeOptions()
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"drafter: unknown sequence {seq_id!r} (ingest its prompt first)")
        n = min(int(max_tokens), self.block_size)
        if n <= 0:
            return Draft([])
        if opts.top_k > self.max_top_k:
            raise ValueError(f"top_k {opts.top_k} exceeds this drafter's max {self.max_top_k}")
        with self.compute_lock:
            p = seq.propose(int(anchor), seq.n_ctx, topk=opts.top_k, temperature=opts.top_k_temperature,
                            confidence_threshold=opts.confidence_threshold or None,
                            block_size=n + self.hp.first_proposal_row,
                            markov=(opts.dspark_markov or self.dspark_markov) if self.dspark_markov else DEFAULT_MARKOV)
        toks = [int(t) for t in p.tokens[:n]]
        conf = [] if p.confidence is None else [float(c) for c in p.confidence[: len(toks)]]
        ids = lps = None
        if opts.top_k:
            ids = np.asarray(p.topk_ids[: len(toks)], np.int32)
            lps = np.asarray(p.topk_logprobs[: len(toks)], np.float32)
        return Draft(toks, conf, ids, lps)

    def release(self, seq_id: str) -> bool:
        """Frees a sequence: its K/V caches and captured CUDA graphs (under the compute lock: a graph
        is not dropped while another sequence's forward or capture runs). False for an unknown id."""
        with self.lock:
            seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        with self.compute_lock:
            seq.release()
        return True

    def close(self) -> None:
        """Shutdown: frees every sequence and, when the target's embedding / head are mapped from the
        target worker (``shared_head``), closes the mapping (after the queued work drains). The drafter
        cannot propose afterwards. Idempotent."""
        with self.lock:
            seqs = list(self.seqs.values())
            self.seqs.clear()
        with self.compute_lock:
            for seq in seqs:
                seq.release()
        head, self.shared_head = self.shared_head, None
        if head is not None:
            with self.compute_lock:
                head.close()
                self.model.token_embd = self.model.lm_head = None  # the model's references: the last ones

    def live(self) -> list[str]:
        with self.lock:
            return sorted(self.seqs)


def open_model_drafter(drafter_path: str, target_path: str, *, kv_dtype: str = "f32",
                       context_cap: int = 0, default_capacity: int = 4096,
                       dspark_markov: str = DEFAULT_MARKOV, device: str = "cpu", cuda_graphs: bool = True,
                       max_graphs: int = 4, share_target_weights: str = "auto", target_worker: str = "",
                       shared_infos=None, ipc_backend=None) -> ModelDrafter:
    """Loads the drafter GGUF and binds it to the target GGUF's embedding and head after the pair
    check. kv_dtype: "f32" (default), "f16" or "q8_0"; context_cap: 0 (all context visible) or C > 0
    (drafters.md §3.7); device: "cpu" (default) or "cuda" (DrafterModel on the GPU: the weights, the
    target embedding / head and every sequence's K/V uploaded there); cuda_graphs / max_graphs: the
    DrafterModel options (greedy proposes replayed as CUDA graphs on the GPU; graphs kept per sequence).

    share_target_weights: "auto" (default) maps the target worker's exported token_embd / output
    ([n_vocab, n_embd] in the target's stored types; :mod:`specd.target_worker.shared_weights`) when
    the drafter runs on the GPU and the target worker at ``target_worker`` (a gRPC address; or the
    already fetched ``shared_infos``) published them from the same GPU with content fingerprints
    equal to the target GGUF's (:func:`~specd.target_worker.shared_weights.tensor_fingerprint`;
    a missing one refused); otherwise, and with "off",
    the drafter uploads its own copy from the target GGUF (the reason is logged and kept in the
    result's ``head_sharing``). ``ipc_backend``: the IPC backend (default the native one; tests pass a
    fake).

    Raises DrafterFormatError / TargetFileError for a bad file, DrafterPairError (both paths in the
    message) for a mismatched pair, ValueError for a bad option or malformed shared-tensor data (the
    message names the tensor)."""
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.shared_weights import check_share_mode, resolve_shared_head

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"drafter kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if dspark_markov not in MARKOV_MODES:
        raise ValueError(f"drafter dspark_markov must be one of {MARKOV_MODES}, got {dspark_markov!r}")
    if context_cap < 0:
        raise ValueError(f"drafter context_cap must be >= 0, got {context_cap}")
    check_share_mode(share_target_weights, "draft-worker")
    drafter = load_drafter(drafter_path)
    target = load_qwen35(target_path)
    check_pair(drafter.hparams, drafter_path, target.hparams, target_path)
    head, sharing = resolve_shared_head(share_target_weights, device, target_worker, target, target_path,
                                        backend=ipc_backend, infos=shared_infos)
    kw = dict(kv_dtype=KV_DTYPES[kv_dtype], context_cap=context_cap or None, device=device, cuda_graphs=cuda_graphs,
              max_graphs=max_graphs)
    try:
        model = (DrafterModel.for_target(drafter, target, **kw) if head is None
                 else DrafterModel(drafter, head.token_embd, head.output, **kw))
    except BaseException:
        if head is not None:
            head.close()
        raise
    md = ModelDrafter(model, default_capacity=default_capacity, dspark_markov=dspark_markov)
    md.shared_head, md.head_sharing = head, sharing
    return md
