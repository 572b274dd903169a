"""The tensor-core flash attention (native/src/gpu/attention_flash.cuh), emulated on the host.

host_emu/attn_main.cpp compiles the kernel header for the CPU with stand-ins for the device
instructions (host_emu/warp_emu.h: one thread per lane; mma.sync m16n8k16 f16 -> f32 and ldmatrix .x4 /
.x4.trans emulated from the PTX ISA fragment layouts, shuffles, __syncthreads; cp.async copies at once)
and runs attn_flash_kernel with the launch plan attention.cu uses (flash::plan), with poisoned shared
memory and output (NaN: a read of anything unwritten shows). So the fragment layouts, the shared-memory
swizzle, the GQA work split (heads of a KV head's group per block, ragged head sub-groups), the key-tile
walk (aligned tiles, zero-filled keys outside the block's range, warps skipping tiles), the causal /
window / bidirectional masks and the online softmax are checked without a GPU, against the float64
softmax attention within the path's derived tolerance (flash_ref.py). Not covered here: the
hardware's own accumulation order and ex2.approx (F32-level, far inside the tolerance), cp.async
asynchrony (the emulation copies at once, so a missing wait or barrier would not show) and the
register / shared-memory limits of the real launch: test_gpu_ops2.py's flash tests on a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from flash_ref import check_flash, row_ranges  # noqa: E402
from host_emu_build import build_emu, inputs  # noqa: E402


@pytest.fixture(scope="module")
def attn_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "attn_emu",
                     ["attention_flash.cuh", "attention_rows.cuh", "pdl.cuh", "warp_reduce.cuh"], "attn_main.cpp")


def run_emu(emu, q, k, v, kv_len, pos, causal=True, window=0, scale=None):
    """The emulated kernel's output F32 [n, hq, d] (k, v: F16 [capacity, hkv, d])."""
    d, exe = emu
    n, hq, hd = q.shape
    cap, hkv, _ = k.shape
    sc = 1.0 / np.sqrt(hd) if scale is None else scale
    files = {name: str(d / f"{name}.bin") for name in ("q", "pos", "k", "v", "out")}
    np.ascontiguousarray(q, np.float32).tofile(files["q"])
    np.ascontiguousarray(pos, np.int32).tofile(files["pos"])
    np.ascontiguousarray(k, np.float16).tofile(files["k"])
    np.ascontiguousarray(v, np.float16).tofile(files["v"])
    subprocess.run([str(exe), str(hd), str(n), str(hq), str(hkv), str(cap), str(kv_len), str(window), str(int(causal)),
                    repr(float(sc)), files["q"], files["pos"], files["k"], files["v"], files["out"]], check=True)
    return np.fromfile(files["out"], np.float32).reshape(n, hq, hd)


# (head_dim, hq, hkv, n, kv_len, first position): chunks in the middle of a prompt (positions c .. c + n - 1
# over kv_len = c + n keys), ragged row counts, GQA 6:1 (the 27B's 24:4 group) and 1:1, several key tiles.
CAUSAL_CASES = [
    (64, 6, 1, 100, 250, 150),
    (64, 2, 2, 64, 64, 0),
    (128, 2, 2, 64, 200, 136),
    (128, 6, 1, 77, 177, 100),
    (256, 6, 1, 40, 160, 120),
    (256, 2, 2, 33, 97, 64),
]


@pytest.mark.parametrize("d,hq,hkv,n,kv_len,c", CAUSAL_CASES)
def test_flash_attention_emulated_causal_chunk(attn_emu, rng, d, hq, hkv, n, kv_len, c):
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len + 8)
    pos = np.arange(c, c + n, dtype=np.int32)
    out = run_emu(attn_emu, q, k, v, kv_len, pos)
    check_flash(out, q, k, v, kv_len, pos, what=f"d={d} {hq}/{hkv} n={n}")


@pytest.mark.parametrize("causal,window", [(True, 37), (False, 0), (False, 21)])
def test_flash_attention_emulated_window_and_bidirectional(attn_emu, rng, causal, window):
    """Sliding windows (a row's keys start at q_pos - window + 1: the blocks' key ranges no longer start
    at a tile boundary) and bidirectional rows (every key below kv_len), GQA 3:1 (2 slabs of 3 heads)."""
    d, hq, hkv, n, kv_len = 64, 6, 2, 80, 210
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    out = run_emu(attn_emu, q, k, v, kv_len, pos, causal=causal, window=window)
    check_flash(out, q, k, v, kv_len, pos, causal=causal, window=window, what=f"causal={causal} window={window}")


def test_flash_attention_emulated_ragged_head_groups_and_any_positions(attn_emu, rng):
    """9 q heads per KV head: 2 blocks of 5 heads, the second with one idle warp; unsorted, repeated
    positions (every row's own range; blocks span the union), an explicit scale."""
    d, hq, hkv, n, kv_len = 128, 9, 1, 50, 150
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = rng.integers(0, kv_len, n).astype(np.int32)
    pos[7] = pos[8]
    out = run_emu(attn_emu, q, k, v, kv_len, pos, scale=0.05)
    check_flash(out, q, k, v, kv_len, pos, scale=0.05, what="r=9, random positions")


def test_flash_attention_emulated_rows_without_keys(attn_emu, rng):
    """Rows with no visible key get zeros: bidirectional with a window past the cache's end (lo >=
    kv_len), beside rows that see keys."""
    d, hq, hkv, n, kv_len, window = 64, 2, 1, 40, 100, 10
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(80, 80 + n, dtype=np.int32)  # rows at 109.. see nothing (lo = pos - 9 >= 100)
    lo, hi = row_ranges(pos, kv_len, False, window)
    assert (lo >= hi).sum() > 10 and (lo < hi).sum() > 10
    out = run_emu(attn_emu, q, k, v, kv_len, pos, causal=False, window=window)
    check_flash(out, q, k, v, kv_len, pos, causal=False, window=window, what="rows without keys")


def test_flash_attention_emulated_peaky_softmax(attn_emu, rng):
    """q * 4: scores spread over ~+-20, most weights tiny (F16 subnormal p) and the running max
    changing across tiles (the online rescaling)."""
    d, hq, hkv, n, kv_len = 128, 2, 1, 64, 256
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len, qscale=4.0)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    out = run_emu(attn_emu, q, k, v, kv_len, pos)
    check_flash(out, q, k, v, kv_len, pos, what="peaky")


def test_flash_attention_emulated_rows_independent_of_the_call(attn_emu, rng):
    """Key tiles sit at absolute positions and a tile outside a row's range leaves its state unchanged,
    so a row's result does not depend on the other rows of the call: the last 64 rows of a 100-row call
    equal a call of those 64 rows alone bit for bit (other row blocks, other slabs, other tile ranges)."""
    d, hq, hkv, n, kv_len = 64, 6, 1, 100, 300
    q, k, v = inputs(rng, n, hq, hkv, d, kv_len)
    pos = np.arange(kv_len - n, kv_len, dtype=np.int32)
    full = run_emu(attn_emu, q, k, v, kv_len, pos)
    tail = run_emu(attn_emu, q[n - 64:], k, v, kv_len, pos[n - 64:])
    np.testing.assert_array_equal(tail.view(np.uint32), full[n - 64:].view(np.uint32))
    part = run_emu(attn_emu, q[10:75], k, v, kv_len, pos[10:75])
    np.testing.assert_array_equal(part.view(np.uint32), full[10:75].view(np.uint32))


def test_flash_attention_emulated_in_the_target_model(attn_emu, rng, tmp_path, monkeypatch):
    """The CPU target model ("main": head_dim 64, GQA 2:1, F16 K/V) with its attention of >= 64 rows run
    by the emulated kernel (what a GPU prefill chunk computes there): an 80-token verify's logits stay
    within test_gpu_target.REL_FLASH = 2e-3 of the plain CPU model (measured ~1e-4)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import specd.native as sn

    sys.path.insert(0, os.path.join(HERE, ".."))
    from target.tinymodels import SPECS, build_checkpoint
    from specd.target_worker.convert import convert
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.model import Qwen35Model

    ck = build_checkpoint(SPECS["main"], tmp_path / "hf")
    convert(ck.path, tmp_path / "main.gguf", "f32", mtp=False)
    weights = load_qwen35(tmp_path / "main.gguf")
    prompt = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=80)]
    model = Qwen35Model(weights, kv_dtype=sn.DType.F16)
    ref = model.verify(model.new_sequence(96), prompt).logits
    original, emulated = sn.attention, []

    def arr(x):
        return x.numpy() if isinstance(x, sn.Tensor) else np.asarray(x)

    def attention(q, kc, vc, kv_len, pos, causal=True, window=0, mask=None, scale=None, **kw):
        qa = arr(q)
        if mask is None and qa.shape[0] >= 64 and arr(kc).dtype == np.float16 and arr(vc).dtype == np.float16:
            emulated.append(qa.shape)
            return sn.Tensor(run_emu(attn_emu, qa, arr(kc), arr(vc), kv_len, arr(pos), causal, window, scale))
        return original(q, kc, vc, kv_len, pos, causal=causal, window=window, mask=mask, scale=scale, **kw)

    monkeypatch.setattr(sn, "attention", attention)
    got = model.verify(model.new_sequence(96), prompt).logits
    assert len(emulated) == 2 and emulated[0][0] == 80  # the two full-attention layers
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert 0 < rel <= 2e-3
