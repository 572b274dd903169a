"""target_worker.memory: the memory report against hand-computed sizes and the tensors the model
actually allocates (tiny random GGUFs of tools/bench/random_qwen35.py, the demo target), and the
27B IQ4_XS fit on one H200 (from the hparams and the mix's storage types; no 15 GB file)."""
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import specd.native as sn
from specd.target_worker import memory as mem
from specd.target_worker.convert import hparams_from_config
from specd.target_worker.feature_shm import segment_bytes
from specd.target_worker.gguf_loader import expected_tensors, load_qwen35
from specd.target_worker.model import Qwen35Model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
import random_qwen35 as rq  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-target.gguf"


def _pending_nbytes(res) -> int:
    total = 0
    for p in res.pending:
        if p is None:
            continue
        for a in (p.conv_in, p.q, p.k, p.v, p.g, p.beta, p.final_state, p.final_conv):
            total += int(a.nbytes)
    return total


def _file_bytes(path) -> dict:
    out = {}
    for t in GGUFReader(str(path)).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return out


@pytest.fixture(scope="module")
def tiny_iq4xs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mem") / "tiny-iq4xs.gguf"
    rq.write(out, "tiny", "iq4xs", seed=3)
    return out


def test_tensor_bytes_by_hand():
    assert mem.tensor_bytes([4, 256], "F32") == 4 * 256 * 4
    assert mem.tensor_bytes([4, 256], sn.DType.F16) == 4 * 256 * 2
    assert mem.tensor_bytes([4, 256], "Q8_0") == 4 * 8 * 34  # 32-value blocks of 34 bytes
    assert mem.tensor_bytes([3, 512], "IQ4_XS") == 3 * 2 * 136  # 256-value blocks of 136 bytes
    assert mem.tensor_bytes([5120], "Q6_K") == 20 * 210
    with pytest.raises(ValueError):
        mem.tensor_bytes([100], "Q8_0")


@pytest.mark.parametrize("kv", ["F16", "Q8_0", "F32"])
def test_tiny_report_matches_hand_and_allocations(tiny_iq4xs, kv):
    w = load_qwen35(tiny_iq4xs)
    hp = w.hparams
    m = Qwen35Model(w, capture_layers=(1, 3), kv_dtype=getattr(sn.DType, kv))
    rep = mem.report(m, max_seq_len=64, max_sequences=3, verify_width=5)
    # tiny: 8 layers, every 4th full attention -> 2 attention + 6 GDN; KV 2 heads x 64; GDN Hk 2, Hv 4, dk=dv 64
    n_attn, n_gdn = 2, 6
    assert (hp.n_head_kv, hp.head_dim, hp.n_k_heads, hp.n_v_heads, hp.head_k_dim, hp.head_v_dim) == (2, 64, 2, 4, 64, 64)
    C = 2 * 2 * 64 + 4 * 64  # conv channels: q, k (Hk*dk each) and v (Hv*dv) = 512
    assert hp.conv_channels == C
    row = {"F16": 64 * 2, "Q8_0": 2 * 34, "F32": 64 * 4}[kv]  # one head's 64 values
    assert rep.kv_bytes_per_token == n_attn * 2 * 2 * row
    assert rep.kv_bytes_per_sequence == 64 * rep.kv_bytes_per_token
    assert rep.recurrent_bytes_per_sequence == n_gdn * 4 * 64 * 64 * 4
    assert rep.conv_bytes_per_sequence == n_gdn * 3 * C * 4
    per_layer_pending = 4 * 5 * (C + 2 * 2 * 64 + 4 * 64 + 2 * 4) + 4 * 64 * 64 * 4 + 3 * C * 4
    assert rep.verify_bytes_per_sequence == n_gdn * per_layer_pending
    assert rep.sequence_bytes == (rep.kv_bytes_per_sequence + rep.recurrent_bytes_per_sequence
                                  + rep.conv_bytes_per_sequence + rep.verify_bytes_per_sequence)
    assert rep.feature_ring_bytes_per_sequence == segment_bytes(64, 2 * 256) == 64 + 8 * 64 + 64 * 512 * 4
    assert rep.total_bytes == rep.weight_bytes + rep.workspace_bytes + 3 * rep.sequence_bytes
    assert rep.device == "cpu" and rep.fits_sequences == -1 and rep.device_total_bytes == 0
    # ... and equal to what the model allocates
    st = m.new_sequence(64)
    assert sum(k.nbytes + v.nbytes for k, v in st.kv.values()) == rep.kv_bytes_per_sequence
    assert sum(a.nbytes for a in st.ssm.values()) == rep.recurrent_bytes_per_sequence
    assert sum(a.nbytes for a in st.conv.values()) == rep.conv_bytes_per_sequence
    m.prefill(st, [1, 2, 3])
    assert _pending_nbytes(m.verify(st, [4, 5, 6, 7, 8])) == rep.verify_bytes_per_sequence
    # weights: the file's tensors minus the loader-unused ones, the conv kernels' transposed copies
    # replacing the originals (same size), i.e. exactly the file's bytes per type
    assert rep.weight_bytes_by_type == _file_bytes(tiny_iq4xs)
    assert set(rep.weight_bytes_by_type) == {"F32", "IQ4_XS", "Q5_K", "Q6_K"}
    text = "\n".join(rep.lines())
    assert "KV cache" in text and "feature ring" in text


def test_tiny_weights_from_types_match_the_model(tiny_iq4xs):
    w = load_qwen35(tiny_iq4xs)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(tiny_iq4xs)).tensors}
    est = mem.weight_bytes_from_types(w.hparams, types)
    assert est == mem.model_weight_bytes(Qwen35Model(w))
    # the device code path (uploaded copies; on the CPU "upload" keeps the tensors) counts the same
    assert mem.model_weight_bytes(Qwen35Model(w, tensor_ops=True)) == est


def test_demo_target_report():
    if not DEMO.is_file():
        pytest.skip(f"{DEMO} not present")
    w = load_qwen35(str(DEMO))
    hp = w.hparams
    m = Qwen35Model(w, capture_layers=(0,))
    rep = mem.report(m, max_seq_len=1024, max_sequences=8, verify_width=17)
    n_attn = sum(1 for r in hp.recurrent if not r)
    assert rep.kv_bytes_per_token == n_attn * 2 * hp.n_head_kv * hp.head_dim * 2  # F16
    assert rep.recurrent_bytes_per_sequence == (hp.n_layer - n_attn) * hp.n_v_heads * hp.head_v_dim * hp.head_k_dim * 4
    file_types = _file_bytes(DEMO)
    skipped = {t.name for t in GGUFReader(str(DEMO)).tensors} - set(expected_tensors(hp))
    if not skipped:  # no MTP tensors: every tensor in the file is a loaded weight
        assert rep.weight_bytes_by_type == file_types
    assert rep.weight_bytes <= sum(file_types.values())
    st = m.new_sequence(1024)
    assert sum(k.nbytes + v.nbytes for k, v in st.kv.values()) == rep.kv_bytes_per_sequence


def _27b_iq4xs():
    """Hyperparameters and per-tensor storage types of the random 27B ``iq4xs`` mix."""
    cfg = rq.CONFIGS["27b"]
    hp = hparams_from_config(cfg, cfg["vocab_size"], 0, "27b")
    types = {}
    for name, spec in expected_tensors(hp).items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        types[name] = rq.storage_type(name, spec.ne, "iq4xs", layer).name
    return hp, types


def test_27b_iq4xs_fits_one_h200():
    """The issue-7 budget: 27B IQ4_XS, 32k context, one 141 GB H200 (numbers in memory.py's docstring)."""
    hp, types = _27b_iq4xs()
    by_type = mem.weight_bytes_from_types(hp, types)
    weights = sum(by_type.values())
    assert 14.5e9 < weights < 15.5e9  # 26.9 B parameters at ~4.45 bits (14.96 GB)
    sb = mem.state_bytes(hp, sn.DType.F16, verify_width=33, n_taps=5)
    assert sb.kv_per_token == 64 * 1024  # 16 layers x K,V x 4 heads x 256 x 2 B (qwen35-target.md §8)
    assert sb.recurrent == 144 * mem.MiB  # 48 x 48 x 128 x 128 x 4 B
    assert sb.conv == 48 * 3 * 10240 * 4
    seq = 32768 * sb.kv_per_token + sb.recurrent + sb.conv + sb.verify
    assert 2.3 * mem.GiB < seq < 2.5 * mem.GiB  # 2 GiB KV + 144 MiB S + 274 MiB verify buffers
    # a verify of 33 rows or a prefill chunk of the default 2048 tokens (the chunk's term is the larger)
    chunk = inspect.signature(Qwen35Model).parameters["prefill_chunk"].default
    assert chunk == 2048
    ws = mem.workspace_bytes(hp, 33, chunk, n_taps=5)
    assert ws > mem.workspace_bytes(hp, 33, 512, n_taps=5) > mem.workspace_bytes(hp, 33)
    assert 9.5 * mem.GiB < ws < 10 * mem.GiB  # 9.99 GiB (3.36 GiB with 512-token chunks, 1.17 for verifies)
    # a prefill chunk is a chain: its deferred-commit buffers and feature rows, no per-row GDN states
    widest = max(hp.n_ff, hp.conv_channels, 2 * hp.n_head * hp.head_dim, hp.n_embd)
    assert ws - mem.CONTEXT_RESERVE_BYTES == (8 * hp.n_vocab + 24 * chunk * widest + mem.state_bytes(hp, "F32", chunk, 1).verify
                                              + 2 * 4 * chunk * 5 * hp.n_embd
                                              + 4 * hp.n_v_heads * (chunk * 257 + 32 * 64 * 64))  # chunked GDN scratch
    n = mem.fits(mem.H200_BYTES, weights, seq, ws)
    assert n >= 44  # "room for many sequences": 44 at 141e9 bytes (47 with 512-token chunks)
    assert mem.fits(mem.H200_BYTES, weights, seq, ws) == (mem.H200_BYTES - weights - ws) // seq
    # Q8_0 KV nearly halves the per-token cost
    sb8 = mem.state_bytes(hp, sn.DType.Q8_0, verify_width=33, n_taps=5)
    assert sb8.kv_per_token == 16 * 2 * 4 * 8 * 34
    assert mem.fits(mem.H200_BYTES, weights, 32768 * sb8.kv_per_token + sb8.recurrent + sb8.conv + sb8.verify, ws) > n
    # the feature ring stays on the host: 5 taps x 5120 x 4 B (+ 8 B slot) per position
    assert sb.feature_per_token == 5 * 5120 * 4 + 8
    # 16 captured CUDA graphs of 16-row verifies (the model's default max_graphs): each holds one
    # verify's activations, logits and deferred-commit buffers; with them many sequences still fit
    one = mem.cuda_graph_bytes(hp, 1, 5)
    assert one == mem.workspace_bytes(hp, 16) - mem.CONTEXT_RESERVE_BYTES + mem.state_bytes(hp, "F32", 16, 5).verify
    assert 150 * mem.MiB < one < 300 * mem.MiB
    assert mem.cuda_graph_bytes(hp, 16, 5) == 16 * one
    assert mem.fits(mem.H200_BYTES, weights, seq, ws + mem.cuda_graph_bytes(hp, 16, 5)) >= 40  # 42
    # and the default 2 kept state slots (--slot-cache: a released sequence's K/V, S and conv state): two
    # sequences' states without their verify buffers, so at most two sequences fewer
    slots = 2 * (32768 * sb.kv_per_token + sb.recurrent + sb.conv)
    with_slots = mem.fits(mem.H200_BYTES, weights, seq, ws + mem.cuda_graph_bytes(hp, 16, 5) + slots)  # 40
    assert with_slots >= 40 and mem.fits(mem.H200_BYTES, weights, seq, ws + mem.cuda_graph_bytes(hp, 16, 5)) - with_slots <= 2


def test_27b_cuda_ipc_ring_on_the_device():
    """With --feature-transport cuda-ipc the 32k ring (100 KiB per position, 3.1 GiB) is device memory
    per sequence: about 19 sequences fit one H200 instead of 44 (memory.py's docstring)."""
    from specd.target_worker.feature_cuda_ipc import device_bytes

    hp, types = _27b_iq4xs()
    weights = sum(mem.weight_bytes_from_types(hp, types).values())
    sb = mem.state_bytes(hp, sn.DType.F16, verify_width=33, n_taps=5)
    seq = 32768 * sb.kv_per_token + sb.recurrent + sb.conv + sb.verify
    ring = device_bytes(32768, 5 * hp.n_embd)
    assert ring == 32768 * 100 * 1024
    ws = mem.workspace_bytes(hp, 33, 2048, n_taps=5)  # the default prefill chunk
    n = mem.fits(mem.H200_BYTES, weights, seq + ring, ws)
    assert 17 <= n <= 21, n


def test_inline_transport_reports_no_feature_ring(tiny_iq4xs):
    """With the inline transport the feature rows travel in the messages: no ring on the host or the
    device, and the report's line says so (shm: a host ring per sequence)."""
    m = Qwen35Model(load_qwen35(tiny_iq4xs), capture_layers=(1, 3))
    shm = mem.report(m, 64, 4, 8, measure=False)
    inline = mem.report(m, 64, 4, 8, measure=False, feature_transport="inline")
    assert shm.feature_ring_bytes_per_sequence > 0 and shm.host_feature_bytes == 4 * shm.feature_ring_bytes_per_sequence
    assert inline.feature_ring_bytes_per_sequence == 0 and inline.host_feature_bytes == 0
    assert any("none: inline transport" in line for line in inline.lines())


def test_default_prefill_chunk_sizes_the_workspace(tiny_iq4xs):
    """Qwen35Model's prefill chunk is 2048 tokens by default (> 0 enforced), and the report's workspace
    covers a chunk of the model's size."""
    w = load_qwen35(tiny_iq4xs)
    m = Qwen35Model(w)
    assert m.prefill_chunk == 2048
    assert mem.report(m, 64, 4, 8, measure=False).workspace_bytes == mem.workspace_bytes(m.hp, 8, 2048)
    small = Qwen35Model(w, prefill_chunk=512, capture_layers=(1, 3))
    assert mem.report(small, 64, 4, 8, measure=False).workspace_bytes == mem.workspace_bytes(m.hp, 8, 512, 2)
    assert mem.workspace_bytes(m.hp, 8, 2048) > mem.workspace_bytes(m.hp, 8, 512)
    # a prefill chunk's pieces as the model allocates them: one chain forward of p rows keeps the
    # deferred-commit buffers of p rows (one S and conv state per GDN layer) and p feature rows per tap
    p = 24
    st = small.new_sequence(64)
    res = small.verify(st, list(range(1, p + 1)), last_only=True, exact=False)
    assert _pending_nbytes(res) == mem.state_bytes(m.hp, "F32", p, 2).verify
    assert all(q.final_state.shape == st.ssm[i].shape for i, q in enumerate(res.pending) if q is not None)
    assert res.features.nbytes == 4 * p * 2 * m.hp.n_embd
    for bad in (0, -1):
        with pytest.raises(ValueError, match="prefill_chunk must be > 0"):
            Qwen35Model(w, prefill_chunk=bad)
