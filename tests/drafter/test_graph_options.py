"""The drafter's CUDA graph options without a GPU: DrafterModel(cuda_graphs=, max_graphs=) validation,
the host path never capturing, release, and the draft worker's --cuda-graphs / --max-graphs flags
(config defaults, validation, parsing, forwarded by specd serve). The graph path itself:
tests/gpu/test_gpu_drafter_graphs.py (its CPU stand-in runs under SPECD_TEST_GPU_DRYRUN=1)."""
from __future__ import annotations

import numpy as np
import pytest

import tinydrafters as td
from specd.draft_worker.gguf_loader import load_drafter
from specd.draft_worker.model import DrafterModel
from specd.native import Tensor


def tiny(tmp_path, rng, family="dflash"):
    folder, cfg, _ = td.make_drafter(tmp_path / family, family, rng, dtype="F32", scales=td.FORWARD_SCALES)
    emb, head = td.target_tables(cfg, rng)
    return load_drafter(td.convert_tiny(folder, "f32")), Tensor(emb), Tensor(head)


def test_options_are_validated(tmp_path, rng):
    ld, emb, head = tiny(tmp_path, rng)
    m = DrafterModel(ld, emb, head)
    assert m.cuda_graphs is True and m.max_graphs == 4  # the documented defaults
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
            DrafterModel(ld, emb, head, cuda_graphs=bad)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_graphs must be an int >= 1"):
            DrafterModel(ld, emb, head, max_graphs=bad)
    assert DrafterModel(ld, emb, head, cuda_graphs=False, max_graphs=1).max_graphs == 1


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_host_path_never_captures_and_release(tmp_path, rng, family):
    """cuda_graphs is ignored on the host path (numpy forward); release frees the sequence and later
    calls are refused."""
    ld, emb, head = tiny(tmp_path, rng, family)
    hp = ld.hparams
    seq = DrafterModel(ld, emb, head).new_sequence(64)
    feats = rng.normal(0, 1, (9, hp.n_taps * hp.n_embd)).astype(np.float32)
    seq.ingest(feats, 0)
    seq.propose(3, 9)
    assert seq.graph_captures == 0 and seq.graph_count == 0 and seq.graph_arena_bytes() == 0
    assert seq.release() == 0 and seq.released
    assert seq.release() == 0  # idempotent
    for call in (lambda: seq.propose(3, 9), lambda: seq.ingest(feats, 9), lambda: seq.forward_block([1], 9),
                 lambda: seq.cached_kv(0, [0])):
        with pytest.raises(ValueError, match="released"):
            call()


def test_draft_worker_graph_flags(monkeypatch, serve_children):
    from specd.coordinator import launcher
    from specd.coordinator.cli import build_parser
    from specd.draft_worker.server import DraftWorkerConfig

    p = build_parser()
    d = p.parse_args(["draft-worker", "--vocab", "10"])
    assert d.cuda_graphs is True and d.max_graphs == 4
    d = p.parse_args(["draft-worker", "--vocab", "10", "--no-cuda-graphs", "--max-graphs", "2"])
    assert d.cuda_graphs is False and d.max_graphs == 2
    assert DraftWorkerConfig().cuda_graphs is True and DraftWorkerConfig().max_graphs == 4
    DraftWorkerConfig(drafter="d.gguf", target="t.gguf", device="cpu", cuda_graphs=False, max_graphs=1).validate()
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match="--max-graphs must be an int >= 1"):
            DraftWorkerConfig(drafter="d.gguf", target="t.gguf", device="cpu", max_graphs=bad).validate()
    with pytest.raises(ValueError, match="cuda_graphs must be true or false"):
        DraftWorkerConfig(drafter="d.gguf", target="t.gguf", device="cpu", cuda_graphs="no").validate()
    # specd serve forwards --cuda-graphs / --no-cuda-graphs to a model draft worker
    assert "--no-cuda-graphs" in launcher_draft_argv(monkeypatch, serve_children, ["--no-cuda-graphs"])
    argv = launcher_draft_argv(monkeypatch, serve_children, [])
    assert "--cuda-graphs" in argv and argv[argv.index("--max-graphs") + 1] == "4"
    # ... and --drafter-max-graphs as the draft worker's --max-graphs (serve's --max-graphs is the target's)
    argv = launcher_draft_argv(monkeypatch, serve_children, ["--drafter-max-graphs", "2", "--max-graphs", "7"])
    assert argv[argv.index("--max-graphs") + 1] == "2"
    with pytest.raises(ValueError, match="--drafter-max-graphs must be >= 1"):
        launcher.ServeConfig(target="t.gguf", drafter_gguf="d.gguf", drafter_max_graphs=0).validate()


def launcher_draft_argv(monkeypatch, serve_children, extra):
    """The argv specd serve starts the draft worker with (serve_children; the loaders and the pair check
    stubbed: the files do not exist)."""
    import specd.draft_worker.gguf_loader as gl
    import specd.target_worker.gguf_loader as tl

    class HP:
        target_layer_ids = (1, 2)

    class LD:
        hparams = HP()

    class T:
        shape = (4, 10)
        name = "token_embd.weight"

    class Reader:
        def __init__(self, *_):
            self.tensors = [T()]

    monkeypatch.setattr(gl, "load_drafter", lambda *_: LD())
    monkeypatch.setattr(gl, "check_pair", lambda *a, **k: None)
    monkeypatch.setattr(tl, "open_gguf", lambda *_: None)
    monkeypatch.setattr(tl, "read_hparams", lambda *_: None)
    monkeypatch.setattr("gguf.GGUFReader", Reader)
    return serve_children(["--target", "t.gguf", "--drafter", "d.gguf", *extra])[-1]


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_memory_report_counts_graph_arenas(tmp_path, rng, family):
    """DrafterMemory.cuda_graph_bytes_per_sequence: max_graphs arenas of the size a capture reserves
    (DraftSequence._arena_reserve: one [n, V] F32 logits, DSpark 4, plus 16 MiB) plus the graphs' input
    buffer; 0 on the CPU and without cuda_graphs; in lines() and the proto."""
    import specd.native as sn
    from specd.protos.v1 import worker_pb2 as wpb
    from specd.target_worker import memory as mem

    ld, emb, head = tiny(tmp_path, rng, family)
    hp = ld.hparams
    n = hp.block_size - hp.first_proposal_row
    one = (4 if family == "dspark" else 1) * n * hp.n_vocab * 4 + mem.DRAFTER_GRAPH_SCRATCH_BYTES
    assert mem.drafter_graph_arena_bytes(hp) == one
    inputs = (2 + 2 * hp.n_layer) * hp.block_size * 4
    assert mem.drafter_graph_bytes(hp, 3) == 3 * one + inputs

    # the capture's reservation is the reported figure (tensor_ops: the graph path's keys on the CPU)
    m = DrafterModel(ld, emb, head, tensor_ops=True, max_graphs=3)
    seq = m.new_sequence(64)
    seq.ingest(rng.normal(0, 1, (9, hp.n_taps * hp.n_embd)).astype(np.float32), 0)
    for markov in (("fused", "off") if family == "dspark" else ("fused",)):
        key = seq._graph_key(9, hp.block_size, None, markov)
        assert key is not None and seq._arena_reserve(key) == one
    seq.propose(3, 9)
    assert seq.graph_captures == 1 and seq._graph_in.nbytes == inputs
    seq.release()

    cpu = mem.drafter_memory(m)
    assert cpu.cuda_graph_bytes_per_sequence == 0 and cpu.max_graphs == 0  # no arenas on the CPU
    assert "CUDA graph" not in "\n".join(cpu.lines())
    m.device = sn.Device.GPU  # only what drafter_memory reads: the report of the same model on a GPU
    gpu = mem.drafter_memory(m)
    assert gpu.device == "cuda" and gpu.max_graphs == 3 and gpu.cuda_graph_bytes_per_sequence == 3 * one + inputs
    assert "CUDA graph arenas" in "\n".join(gpu.lines())
    pb = gpu.to_proto(wpb)
    assert pb.cuda_graph_bytes_per_sequence == gpu.cuda_graph_bytes_per_sequence and pb.max_graphs == 3
    m.cuda_graphs = False
    assert mem.drafter_memory(m).cuda_graph_bytes_per_sequence == 0
