"""The qwen35 target forward on the GPU (Qwen35Model(weights, device=GPU)) against the CPU model.

Skipped without a GPU like the other GPU tests. SPECD_TEST_GPU_DRYRUN=1 runs the device code path
(sn.Tensor glue ops: slice / concat / copy / copy_rows / embedding gathers, no numpy in the graph)
on CPU tensors instead (Qwen35Model(..., tensor_ops=True)), to check the Python logic and the CPU
twins of the glue ops on machines without a GPU.

Properties:
* GPU logits vs CPU logits of the same model: max|gpu - cpu| / max|cpu| <= 1e-4, for verify of
  the prompt, chunked prefill and 32 greedy decode steps, whose tokens must be equal. Prefill
  chunks here are <= 16 rows: prefill (``verify(exact=False)``) runs chunks over 16 rows as a BF16
  cuBLAS GEMM (error ~2^-8), fine for a prefill but not for a 1e-4 comparison; verifies are exact.
* Prefill chunks of >= 64 rows on F16 K/V caches take the tensor-core flash attention
  (``sn.attention(..., exact=False)``, F16 q and softmax weights): logits of an 80-token verify whose
  attention is forced onto that path stay within REL_FLASH = 2e-3 of the CPU model (the host emulation
  of the kernel in the CPU model measured 0.8e-4 .. 1.4e-4 on "main"; the F16 K/V caches alone are allowed
  REL_F16_KV), and Qwen35Model.prefill does take it, landing as close to the CPU model as a prefill with
  exact attention (both run BF16 GEMMs).
* Batch invariance on the GPU, bitwise: chain verify rows of width 1..8 equal step-by-step decode
  logits, committing any prefix leaves a state whose next decodes equal a plain run's, and a tree
  node's logits equal the chain verify of its path (what makes speculative output equal plain
  output on the GPU).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import specd.native as sn

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from target.steps import check_steps_equal_verify_commit  # noqa: E402
from target.tinymodels import SPECS, build_checkpoint  # noqa: E402

from specd.target_worker.convert import convert  # noqa: E402
from specd.target_worker.gguf_loader import load_qwen35  # noqa: E402
from specd.target_worker.model import Qwen35Model, parse_device  # noqa: E402

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
HAVE_GPU = sn.gpu_available() or DRYRUN
DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-target.gguf"
REL = 1e-4
# F16 K/V: a 1-ulp F32 difference between the backends can flip an F16 rounding of a cached K/V
# element (2^-11 relative), and later rows attend to it: measured 3.3e-4 over 24 demo-target rows.
REL_F16_KV = 1e-3
CHUNK = 16  # see the module docstring
REL_FLASH = 2e-3  # the flash-attention prefill path (module docstring)


def gpu_only(f):
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(name, outtype) -> (weights, checkpoint) for a tinymodels.SPECS entry (cached)."""
    cks, cache = {}, {}

    def get(name, outtype="f32"):
        if name not in cks:
            cks[name] = build_checkpoint(SPECS[name], tmp_path_factory.mktemp(f"hf-{name}"))
        key = (name, outtype)
        if key not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{name}-{outtype}.gguf"
            convert(cks[name].path, out, outtype, mtp=False)
            cache[key] = load_qwen35(out)
        return cache[key], cks[name]

    return get


def gpu_model(weights, **kw):
    if DRYRUN:
        return Qwen35Model(weights, device=sn.Device.CPU, tensor_ops=True, **kw)
    return Qwen35Model(weights, device=sn.Device.GPU, **kw)


def host(x):
    return x.numpy() if isinstance(x, sn.Tensor) else np.asarray(x)


def rel_err(a, ref):
    return float(np.abs(np.asarray(a) - ref).max() / np.abs(ref).max())


def greedy(model, prompt, n, capacity=128):
    st = model.new_sequence(capacity)
    logits = [model.prefill(st, prompt)]
    toks = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        logits.append(model.decode(st, toks[-1]))
        toks.append(int(np.argmax(logits[-1])))
    return toks, np.stack(logits)


def compare_with_cpu(weights, prompt, kv=sn.DType.F32, n=32, capture=()):
    cpu = Qwen35Model(weights, kv_dtype=kv, prefill_chunk=CHUNK, capture_layers=capture)
    gpu = gpu_model(weights, kv_dtype=kv, prefill_chunk=CHUNK, capture_layers=capture)
    rel = REL_F16_KV if kv == sn.DType.F16 else REL
    ref = cpu.verify(cpu.new_sequence(len(prompt)), prompt)
    got = gpu.verify(gpu.new_sequence(len(prompt)), prompt)
    assert rel_err(got.logits, ref.logits) <= rel
    np.testing.assert_array_equal(got.argmax, np.argmax(got.logits, axis=-1))
    if capture:
        assert rel_err(got.features, ref.features) <= rel
    toks_c, lg_c = greedy(cpu, prompt, n)
    toks_g, lg_g = greedy(gpu, prompt, n)
    assert rel_err(lg_g, lg_c) <= rel
    assert toks_g == toks_c


@pytest.mark.parametrize("name", ["smoke", "main", "r3", "condgen"])
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@gpu_only
def test_gpu_logits_match_cpu(tiny, name, outtype):
    weights, ck = tiny(name, outtype)
    compare_with_cpu(weights, list(ck.prompt), capture=[0, 1] if name == "main" else ())


@pytest.mark.parametrize("kv", [sn.DType.F16, sn.DType.Q8_0])
@gpu_only
def test_gpu_quantized_kv_matches_cpu(tiny, kv):
    weights, ck = tiny("main")
    cpu = Qwen35Model(weights, kv_dtype=kv)
    gpu = gpu_model(weights, kv_dtype=kv)
    ref = cpu.verify(cpu.new_sequence(32), ck.prompt).logits
    got = gpu.verify(gpu.new_sequence(32), ck.prompt).logits
    assert rel_err(got, ref) <= (REL_F16_KV if kv == sn.DType.F16 else 2e-3)  # roundings may flip


@pytest.mark.skipif(not DEMO.exists(), reason="models/demo-target.gguf is not present")
@gpu_only
def test_gpu_demo_target_matches_cpu(rng):
    weights = load_qwen35(DEMO)
    # 24 rows: a verify wider than one 16-row GEMV slice (verify is exact at any width)
    prompt = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=24)]
    compare_with_cpu(weights, prompt, kv=sn.DType.F16)


def plain_logits(model, tokens, capacity=128):
    st = model.new_sequence(capacity)
    return st, np.stack([model.decode(st, t) for t in tokens])


def assert_same_state(a, b):
    assert a.committed == b.committed
    c = a.committed
    for i in a.ssm:
        np.testing.assert_array_equal(host(a.ssm[i]), host(b.ssm[i]))
        np.testing.assert_array_equal(host(a.conv[i]), host(b.conv[i]))
    for i in a.kv:
        for ca, cb in zip(a.kv[i], b.kv[i]):
            np.testing.assert_array_equal(ca.numpy()[:c], cb.numpy()[:c])


@pytest.mark.parametrize("name,kv", [("main", sn.DType.F16), ("r3", sn.DType.Q8_0), ("smoke", sn.DType.F32)])
@gpu_only
def test_gpu_chain_verify_is_batch_invariant(tiny, rng, name, kv):
    """Verify of width 1..8, 17 and 33 (past the 16-row GEMV slice: exact at any width) gives bitwise
    the decode logits of the same tokens; committing every prefix n then decoding equals a plain run
    (logits and state), all on the GPU."""
    weights, ck = tiny(name)
    model = gpu_model(weights, kv_dtype=kv, capture_layers=[1])
    prompt = list(ck.prompt)
    cont = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=33)]
    _, ref = plain_logits(model, prompt + cont)
    for w in [*range(1, 9), 17, 33]:
        st = model.new_sequence(128)
        for t in prompt:
            model.decode(st, t)
        res = model.verify(st, cont[:w])
        np.testing.assert_array_equal(res.logits, ref[len(prompt) : len(prompt) + w], err_msg=f"w={w}")
        n = int(rng.integers(0, w + 1))
        model.commit(st, res, n)
        after = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=2)]
        spec = np.stack([model.decode(st, t) for t in after])
        ref_st, ref2 = plain_logits(model, prompt + cont[:n] + after)
        np.testing.assert_array_equal(spec, ref2[-2:], err_msg=f"w={w} n={n}")
        assert_same_state(st, ref_st)
        np.testing.assert_array_equal(st.features.read(0, st.committed), ref_st.features.read(0, st.committed))


@pytest.mark.parametrize("name,kv", [("main", sn.DType.F16), ("r3", sn.DType.Q8_0)])
@gpu_only
def test_gpu_step_equals_one_row_verify_and_commit(tiny, rng, name, kv):
    """Qwen35Model.step (GDN / conv states updated in place; on the GPU its own captured graph) gives
    bitwise the argmax, logits, states, KV rows and feature rows of verify([t]) + commit(1), over steps
    interleaved with speculative verifies committing a random prefix on both sequences."""
    weights, ck = tiny(name)
    model = gpu_model(weights, kv_dtype=kv, capture_layers=[1])

    def same(a, b):
        assert_same_state(a, b)
        np.testing.assert_array_equal(a.features.read(0, a.committed), b.features.read(0, b.committed))
    a, b, t = check_steps_equal_verify_commit(model, list(ck.prompt), rng, same, n_steps=16)
    ref = model.verify(a, [t]).logits[0]  # a's next row, not committed
    np.testing.assert_array_equal(model.decode(b, t), ref)  # decode is a step returning its logits


@gpu_only
def test_gpu_prefill_chunking_is_invariant(tiny):
    weights, ck = tiny("main")
    model = gpu_model(weights, prefill_chunk=5)
    _, dec = plain_logits(model, list(ck.prompt))
    np.testing.assert_array_equal(model.prefill(model.new_sequence(32), ck.prompt), dec[-1])


@gpu_only
def test_gpu_prefill_flash_attention_matches_cpu(tiny, rng, monkeypatch):
    """"main" (head_dim 64, GQA 2:1), F16 K/V, an 80-token prompt. (1) A verify with exact matmuls whose
    attention calls are forced to exact=False (flash path) gives logits within REL_FLASH of the CPU
    model, and differs from the exact verify. (2) prefill (chunk 128) passes exact=False to its 80-row
    attention calls, and its last logits are as close to the CPU model's as those of a GPU prefill whose
    attention is forced exact (the same BF16 GEMMs otherwise: within 2x its error, or REL_FLASH), and
    differ from them."""
    weights, _ = tiny("main")
    prompt = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=80)]
    cpu = Qwen35Model(weights, kv_dtype=sn.DType.F16)
    gpu = gpu_model(weights, kv_dtype=sn.DType.F16, prefill_chunk=128)
    original, force, seen = sn.attention, {"exact": None}, []

    def attention(*args, **kw):
        seen.append((args[0].shape[0], kw.get("exact", True), kw.get("mask") is None))
        if force["exact"] is not None:
            kw["exact"] = force["exact"]
        return original(*args, **kw)

    monkeypatch.setattr(sn, "attention", attention)
    ref = cpu.verify(cpu.new_sequence(96), prompt).logits
    exact = host(gpu.verify(gpu.new_sequence(96), prompt).logits)
    assert rel_err(exact, ref) <= REL_FLASH  # F16 K/V roundings may flip over 80 rows (REL_F16_KV: 12 / 24 rows)
    force["exact"] = False
    flash = host(gpu.verify(gpu.new_sequence(96), prompt).logits)
    assert rel_err(flash, ref) <= REL_FLASH
    force["exact"], seen[:] = None, []
    p = gpu.prefill(gpu.new_sequence(96), prompt)
    assert (80, False, True) in seen  # the chunk's causal attention asked for the flash path
    force["exact"] = True
    pe = gpu.prefill(gpu.new_sequence(96), prompt)
    # Both prefills run BF16 GEMMs (~2^-8 per product), whose input roundings flip where the attention
    # differs by ~1e-4, so p and pe differ by BF16 noise (H200: 4.7e-3): the flash prefill must be as
    # close to the CPU model as the exact-attention prefill is (within 2x, or REL_FLASH).
    assert rel_err(p, ref[-1]) <= max(2 * rel_err(pe, ref[-1]), REL_FLASH)
    if not DRYRUN:
        assert not np.array_equal(flash, exact) and not np.array_equal(p, pe)


@gpu_only
def test_gpu_prefill_chunked_gdn_matches_cpu(tiny, rng, monkeypatch):
    """"main" (GDN dk = dv = 64), a 100-token prompt, prefill chunk 128: prefill passes exact=False to its
    100-token GDN recurrences (the GPU's chunked path), and its last logits are as close to the CPU model's
    as those of a GPU prefill whose recurrences are forced exact (token by token; the same BF16 GEMMs and
    flash attention otherwise: within 2x its error, or REL_FLASH), and differ from them. The recurrence
    itself is held to the CPU op's tolerance by test_gpu_ops2.py::test_gdn_gpu_chunked_vs_cpu."""
    weights, _ = tiny("main")
    prompt = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=100)]
    ref = Qwen35Model(weights, kv_dtype=sn.DType.F16).verify(Qwen35Model(weights).new_sequence(128), prompt).logits
    gpu = gpu_model(weights, kv_dtype=sn.DType.F16, prefill_chunk=128)
    original, force, seen = sn.gated_delta_net, {"exact": None}, []

    def gdn(*args, **kw):
        seen.append((args[0].shape[0], kw.get("exact", True)))
        if force["exact"] is not None:
            kw["exact"] = force["exact"]
        return original(*args, **kw)

    monkeypatch.setattr(sn, "gated_delta_net", gdn)
    p = gpu.prefill(gpu.new_sequence(128), prompt)
    assert (100, False) in seen
    force["exact"] = True
    pe = gpu.prefill(gpu.new_sequence(128), prompt)
    # Both run BF16 GEMMs, whose input roundings flip where the recurrences differ by ~1e-6 (H200: pe 3.7e-2
    # from the CPU model's logits over 100 rows), so p must be as close to the CPU model as pe (within 2x).
    assert rel_err(p, ref[-1]) <= max(2 * rel_err(pe, ref[-1]), REL_FLASH)
    if not DRYRUN:
        assert not np.array_equal(p, pe)


@gpu_only
def test_gpu_tree_verify_and_commit_equal_chain(tiny, rng):
    weights, ck = tiny("main")
    model = gpu_model(weights, kv_dtype=sn.DType.F16)
    prompt = list(ck.prompt)
    w = 7
    parents = [-1] + [int(rng.integers(-1, j)) for j in range(1, w)]
    tokens = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=w)]
    st = model.new_sequence(64)
    model.prefill(st, prompt)
    res = model.verify(st, tokens, parents=parents)
    for j in range(w):
        path = _path(parents, j)
        st2 = model.new_sequence(64)
        model.prefill(st2, prompt)
        chain = model.verify(st2, [tokens[r] for r in path])
        np.testing.assert_array_equal(res.logits[j], chain.logits[-1], err_msg=f"node {j}")
    # commit the deepest path, compare with a chain commit of it
    j = int(np.argmax([len(_path(parents, k)) for k in range(w)]))
    path = _path(parents, j)
    model.commit(st, res, path)
    ref = model.new_sequence(64)
    model.prefill(ref, prompt)
    model.commit(ref, model.verify(ref, [tokens[r] for r in path]), len(path))
    assert_same_state(st, ref)
    nxt = int(rng.integers(0, weights.hparams.n_vocab))
    np.testing.assert_array_equal(model.decode(st, nxt), model.decode(ref, nxt))


def _path(parents, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


@pytest.mark.skipif(DRYRUN or not sn.gpu_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_gpu_state_stays_on_device(tiny):
    weights, ck = tiny("main")
    model = gpu_model(weights)
    st = model.new_sequence(32)
    model.prefill(st, ck.prompt)
    assert all(t.device == sn.Device.GPU for t in st.ssm.values())
    assert all(t.device == sn.Device.GPU for t in st.conv.values())
    assert all(c.device == sn.Device.GPU for kv in st.kv.values() for c in kv)


def test_device_parsing():
    assert parse_device("cpu") == sn.Device.CPU
    with pytest.raises(ValueError, match="device"):
        parse_device("tpu")
    if not sn.gpu_compiled():
        with pytest.raises(RuntimeError, match="without a GPU backend"):
            parse_device("cuda")
    elif not sn.gpu_available():
        with pytest.raises(RuntimeError, match="no GPU"):
            parse_device("cuda")
    from specd.coordinator.launcher import ServeConfig
    from specd.target_worker.server import TargetWorkerConfig

    for cfg in (TargetWorkerConfig(target="x.gguf", device="tpu"), ServeConfig(target="x.gguf", device="tpu")):
        with pytest.raises(ValueError, match="device"):
            cfg.validate()
    TargetWorkerConfig(target="x.gguf", device="cpu").validate()
    assert TargetWorkerConfig(target="x.gguf").resolved_device == ("cuda" if sn.gpu_available() else "cpu")
    if not sn.gpu_available():
        for cfg in (TargetWorkerConfig(target="x.gguf", device="cuda"), ServeConfig(target="x.gguf", device="cuda")):
            with pytest.raises(ValueError, match="--device cuda"):
                cfg.validate()


@gpu_only
def test_gpu_commit_copies_the_committed_feature_rows_straight_into_the_host_ring(tiny):
    """On the GPU, commit copies the verify's committed feature rows from the device straight into the
    host ring (sn.copy_rows across devices, one copy per run; the shm transport's path): the ring
    holds exactly those rows of the verify's feature tensor, for a prefill chunk (prefill's
    ``last_only`` / inexact verify), a chain's accepted rows and one row (CUDA-graph verifies: the
    rows come out of their arena), a tree path; the tensor is never downloaded whole."""
    weights, ck = tiny("main")
    model = gpu_model(weights, capture_layers=[0, 1], prefill_chunk=CHUNK)
    st = model.new_sequence(96)
    prompt = list(ck.prompt)
    c = 0
    for tokens, parents, accept in ((prompt, None, len(prompt)), ([5, 6, 7, 8, 9], None, 3),
                                    ([9, 10, 11, 12], [-1, 0, 0, 2], [0, 2, 3]), ([4], None, 1)):
        prefill = c == 0
        res = model.verify(st, tokens, parents, last_only=prefill, exact=not prefill)
        assert (res.graph is not None) == (parents is None and not prefill and not DRYRUN)  # rows in a graph's arena
        whole = np.asarray(res.raw_features.numpy())  # read beside the commit, not through res
        model.commit(st, res, accept)
        rows = list(range(accept)) if parents is None else accept
        assert not isinstance(res.raw_features, np.ndarray)
        np.testing.assert_array_equal(st.features.read(c, len(rows)), whole[rows])
        c += len(rows)
    assert st.committed == c
