"""The qwen35 forward on specd.native against transformers, and the exactness of commit/rollback.

Oracle: transformers' Qwen3_5ForCausalLM in float64 on tiny random checkpoints (tinymodels.SPECS),
converted with ``specd convert-target``. Exactness tests compare our verify/commit paths with our
own plain token-by-token run *bitwise*: that is the losslessness contract of speculative decoding
(spec output == plain output), and it holds because every native op is batch invariant.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import specd.native as sn
from specd.coordinator.cli import main as specd_main
from specd.target_worker.convert import to_hf_config, to_hf_state_dict
from specd.target_worker.gguf_loader import load_qwen35, read_tokenizer_metadata
from specd.target_worker.model import Qwen35Model
from specd.target_worker.perplexity import perplexity
from specd.target_worker.tokenizer import build_tokenizer

from .steps import check_steps_equal_verify_commit
from .tinymodels import ADDED_TOKENS, SPECIAL_TOKENS, load_reference, logits64

pytestmark = pytest.mark.oracle

SPECS = ["smoke", "main", "r3", "condgen"]
# F32 weights and F32 KV: fp32 kernels vs a float64 reference. "r3" stores rms_norm_eps 1e-5, which
# llama.cpp (and specd) also use for the GDN q/k L2 norm while transformers hard-wires 1e-6
# (qwen35-target.md §6.2), so it gets a wider bound.
REL_TOL = {"smoke": 1e-5, "main": 1e-5, "r3": 1e-4, "condgen": 1e-5}


def model_for(converted, name, kv=sn.DType.F32, capture=(), chunk=2048, outtype="f32"):
    return Qwen35Model(load_qwen35(converted(name, outtype)), capture_layers=capture, kv_dtype=kv,
                       prefill_chunk=chunk)


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def plain_run(model, tokens, capacity=96):
    """Token-by-token decode: the reference every speculative path must equal bitwise."""
    st = model.new_sequence(capacity)
    return st, np.stack([model.decode(st, t) for t in tokens])


@pytest.mark.parametrize("name", SPECS)
def test_prefill_and_decode_match_transformers(checkpoint, converted, name):
    ck = checkpoint(name)
    model = model_for(converted, name, chunk=5)  # 12-token prompt: chunks of 5, 5, 2
    st = model.new_sequence(32)
    res = model.verify(st, ck.prompt)
    err = rel_err(res.logits, ck.logits64)
    assert err < REL_TOL[name], f"{name}: verify logits rel err {err:.2e}"
    _, dec = plain_run(model, ck.prompt)
    assert rel_err(dec, ck.logits64) < REL_TOL[name]
    last = model.prefill(model.new_sequence(32), ck.prompt)  # chunked prefill
    np.testing.assert_array_equal(last, dec[-1])  # batch invariance across chunkings


@pytest.mark.parametrize("name", ["main", "r3"])
def test_features_equal_hidden_states(checkpoint, converted, name):
    ck = checkpoint(name)
    n_layer = ck.config.num_hidden_layers
    taps = [0, n_layer // 2, n_layer - 2]
    model = model_for(converted, name, capture=taps)
    st = model.new_sequence(32)
    model.prefill(st, ck.prompt)
    with torch.no_grad():
        hs = ck.model64(torch.tensor([ck.prompt]), output_hidden_states=True).hidden_states
    ref = np.concatenate([hs[i + 1][0].numpy() for i in taps], axis=1)  # tap order, [T, 3H]
    got = st.features.read(0, len(ck.prompt))
    assert rel_err(got, ref) < REL_TOL[name]


def test_quantized_file_matches_float64_forward_of_its_weights(mixed_gguf, rng):
    """Golden-from-GGUF (oracles.md §1.3): a Q4_K/Q5_K/Q6_K/IQ4_XS/Q8_0 file against transformers
    in float64 over exactly the dequantized weights, so only kernel numerics remain."""
    path, _ = mixed_gguf
    weights = load_qwen35(path)
    reference = load_reference(to_hf_config(weights.hparams, weights.output_tied), to_hf_state_dict(path))
    prompt = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=10)]
    model = Qwen35Model(weights, kv_dtype=sn.DType.F32)
    got = model.verify(model.new_sequence(16), prompt).logits
    assert rel_err(got, logits64(reference, prompt)) < 1e-4


@pytest.mark.parametrize("kv,tol", [(sn.DType.F16, 5e-4), (sn.DType.Q8_0, 1e-2)])
def test_quantized_kv_cache(checkpoint, converted, kv, tol):
    ck = checkpoint("main")
    model = model_for(converted, "main", kv=kv)
    res = model.verify(model.new_sequence(32), ck.prompt)
    # the cache rounds K/V to fp16 (rel 2^-11) or Q8_0 (~1/254 of each 32-block's max); measured
    # 1.4e-4 and 3.0e-3 on this model
    assert rel_err(res.logits, ck.logits64) < tol


def continuation(model, prompt, n, capacity=96):
    """The target's own greedy continuation of ``prompt``: n tokens."""
    st = model.new_sequence(capacity)
    tok = int(np.argmax(model.prefill(st, prompt)))
    out = [tok]
    for _ in range(n - 1):
        tok = int(np.argmax(model.decode(st, tok)))
        out.append(tok)
    return out


def assert_same_state(model, a, b):
    assert a.committed == b.committed
    c = a.committed
    for i in a.ssm:
        np.testing.assert_array_equal(a.ssm[i], b.ssm[i])
        np.testing.assert_array_equal(a.conv[i], b.conv[i])
    for i in a.kv:
        for ca, cb in zip(a.kv[i], b.kv[i]):
            np.testing.assert_array_equal(ca.numpy()[:c], cb.numpy()[:c])
    if model.capture_layers:
        np.testing.assert_array_equal(a.features.read(0, c), b.features.read(0, c))


@pytest.mark.parametrize("name,kv", [("main", sn.DType.F16), ("r3", sn.DType.Q8_0), ("smoke", sn.DType.F32)])
def test_chain_commit_every_n_equals_plain(checkpoint, converted, rng, name, kv):
    """Verify w tokens, commit n for every n in 0..w, keep decoding: bitwise equal to a plain run
    (C09/C10: recurrent and conv state of the last committed token, for every rejection point)."""
    ck = checkpoint(name)
    model = model_for(converted, name, kv=kv, capture=[1])
    good = continuation(model, ck.prompt, 8)
    w = 6
    for n in range(w + 1):
        draft = list(good[:w])
        if n < w:  # a wrong token at n: what a rejected draft looks like
            draft[n] = int((draft[n] + 1 + rng.integers(0, ck.config.vocab_size - 1)) % ck.config.vocab_size)
        st = model.new_sequence(96)
        model.prefill(st, ck.prompt)
        res = model.verify(st, draft)
        model.commit(st, res, n)
        after = [int(t) for t in rng.integers(0, ck.config.vocab_size, size=3)]
        spec_logits = np.stack([model.decode(st, t) for t in after])
        ref_st, ref_logits = plain_run(model, list(ck.prompt) + draft[:n] + after)
        np.testing.assert_array_equal(spec_logits, ref_logits[-3:], err_msg=f"{name} n={n}")
        np.testing.assert_array_equal(res.logits[:n], ref_logits[len(ck.prompt) - 1 + 1 : len(ck.prompt) + n]
                                      if n else res.logits[:0])
        assert_same_state(model, st, ref_st)


@pytest.mark.parametrize("name,kv", [("main", sn.DType.F16), ("r3", sn.DType.Q8_0), ("smoke", sn.DType.F32)])
def test_step_equals_one_row_verify_and_commit(checkpoint, converted, rng, name, kv):
    """Qwen35Model.step updates the GDN / conv states in place; it must equal verify([t]) + commit(1)
    bitwise (argmax, states, KV rows, feature rows), also between speculative verifies."""
    ck = checkpoint(name)
    model = model_for(converted, name, kv=kv, capture=[1])
    check_steps_equal_verify_commit(model, ck.prompt, rng, lambda a, b: assert_same_state(model, a, b))


def test_step_refuses_bad_input_and_stale_verifies(checkpoint, converted):
    """A bad token or a full sequence raises ValueError and changes nothing; a verify made before a
    step can no longer commit (the step overwrote its states and KV rows)."""
    ck = checkpoint("main")
    model = model_for(converted, "main", capture=[1])
    st = model.new_sequence(len(ck.prompt) + 1)
    model.prefill(st, ck.prompt)
    ssm = {i: s.copy() for i, s in st.ssm.items()}
    for bad in (-1, ck.config.vocab_size):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.step(st, bad)
    assert st.committed == len(ck.prompt) and all(np.array_equal(ssm[i], st.ssm[i]) for i in ssm)
    stale = model.verify(st, [1])
    model.step(st, 1)
    with pytest.raises(ValueError, match="exceed the sequence capacity"):
        model.step(st, 1)
    with pytest.raises(ValueError, match="moved from|newer verify"):
        model.commit(st, stale, 1)
    assert st.committed == len(ck.prompt) + 1


def test_last_only_verify_equals_the_last_row(checkpoint, converted, rng):
    """An exact verify with last_only (its FFN output handed on as split-K partials is summed before the output
    norm reads the last row) gives the full verify's last row bit for bit: logits and argmax."""
    ck = checkpoint("main")
    model = model_for(converted, "main")
    st = model.new_sequence(len(ck.prompt) + 8)
    model.prefill(st, ck.prompt)
    draft = [int(t) for t in rng.integers(0, ck.config.vocab_size, size=5)]
    full, last = model.verify(st, draft), model.verify(st, draft, last_only=True)
    full_logits, last_logits = np.asarray(full.logits), np.asarray(last.logits)
    assert last_logits.shape == (1, full_logits.shape[1])
    np.testing.assert_array_equal(last_logits[0], full_logits[-1])
    assert int(np.asarray(last.argmax).reshape(-1)[-1]) == int(np.asarray(full.argmax).reshape(-1)[-1])


def random_tree(rng, w):
    parents = [-1]
    for j in range(1, w):
        parents.append(int(rng.integers(-1, j)))
    return parents


@pytest.mark.parametrize("name,prefix", [("main", 12), ("r3", 12), ("main", 60)])
def test_tree_verify_and_commit_equal_chain(checkpoint, converted, rng, name, prefix):
    """Every tree node's logits equal a chain verify of its root path, and committing any path
    leaves the state a chain commit of that path leaves (spec-loop.md §7.4-7.5). prefix 60 puts the
    tree's cache rows across row 64, where tree rows (c + index) and chain rows (c + depth) differ."""
    ck = checkpoint(name)
    model = model_for(converted, name, kv=sn.DType.F16, capture=[0, 2])
    vocab = ck.config.vocab_size
    prompt = list(ck.prompt) + [int(t) for t in rng.integers(0, vocab, size=prefix - len(ck.prompt))]
    w = 7
    parents = random_tree(rng, w)
    tokens = [int(t) for t in rng.integers(0, vocab, size=w)]

    def prefilled():
        st = model.new_sequence(96)
        model.prefill(st, prompt)
        return st

    res = model.verify(prefilled(), tokens, parents)
    for j in range(w):
        path = tree_path(parents, j)
        chain_st = prefilled()
        chain = model.verify(chain_st, [tokens[r] for r in path])
        np.testing.assert_array_equal(res.logits[j], chain.logits[-1], err_msg=f"node {j} path {path}")
        np.testing.assert_array_equal(res.features[j], chain.features[-1])
        model.commit(chain_st, chain, len(path))
        st = prefilled()
        model.commit(st, model.verify(st, tokens, parents), path)
        assert_same_state(model, st, chain_st)
        nxt = int(rng.integers(0, vocab))
        np.testing.assert_array_equal(model.decode(st, nxt), model.decode(chain_st, nxt))


def tree_path(parents, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def test_interleaved_sequences_are_isolated(checkpoint, converted, rng):
    ck = checkpoint("main")
    model = model_for(converted, "main", kv=sn.DType.F16, capture=[3])
    prompts = [ck.prompt, [int(t) for t in rng.integers(0, 512, size=9)]]
    steps = [[int(t) for t in rng.integers(0, 512, size=4)] for _ in prompts]
    alone = [plain_run(model, p + s)[1] for p, s in zip(prompts, steps)]
    states = [model.new_sequence(64) for _ in prompts]
    got = [[model.prefill(st, p)] for st, p in zip(states, prompts)]
    for k in range(4):  # alternate: a chain verify of 1 on one, a decode on the other
        for s, st in enumerate(states):
            got[s].append(model.decode(st, steps[s][k]))
    for s, p in enumerate(prompts):
        np.testing.assert_array_equal(np.stack(got[s]), alone[s][len(p) - 1 :])


def test_perplexity_matches_transformers(checkpoint, converted, rng):
    ck = checkpoint("main")
    model = model_for(converted, "main")
    ctx = 16
    tokens = rng.integers(0, ck.config.vocab_size, size=3 * ctx + 5).astype(np.int32)
    model.prefill_chunk = 5  # logits reduced per forward chunk: exercise chunks straddling ctx/2
    ppl, stderr, n = perplexity(model, tokens, ctx)
    nll = []
    for c in range(3):  # llama.cpp: first = n_ctx/2, score logits rows first .. n_ctx-2
        chunk = tokens[c * ctx : (c + 1) * ctx]
        with torch.no_grad():
            lg = ck.model64(torch.tensor([chunk.tolist()])).logits[0].double()
        lp = torch.log_softmax(lg, -1).numpy()
        nll += [-lp[i, chunk[i + 1]] for i in range(ctx // 2, ctx - 1)]
    assert n == len(nll) == 3 * (ctx - 1 - ctx // 2)
    assert math.isclose(ppl, math.exp(np.mean(nll)), rel_tol=1e-5)
    # llama.cpp's uncertainty: ppl * std(nll) / sqrt(n) (first-order error propagation)
    assert math.isclose(stderr, math.exp(np.mean(nll)) * np.std(nll, ddof=1) / math.sqrt(len(nll)), rel_tol=1e-4)


def test_bad_input_is_a_clear_error(checkpoint, converted):
    ck = checkpoint("smoke")
    model = model_for(converted, "smoke")
    st = model.new_sequence(16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.verify(st, [0, ck.config.vocab_size])
    with pytest.raises(ValueError, match="exceed the sequence capacity 16"):
        model.verify(st, list(range(17)))
    with pytest.raises(ValueError, match="a parent must be -1 or an earlier row"):
        model.verify(st, [1, 2, 3], parents=[-1, 2, 0])
    res = model.verify(st, [1, 2, 3], parents=[-1, 0, 0])
    with pytest.raises(ValueError, match="not a root-to-node path"):
        model.commit(st, res, [0, 2, 1])
    chain = model.verify(st, [1, 2])
    with pytest.raises(ValueError, match="n must be in 0..2"):
        model.commit(st, chain, 3)
    with pytest.raises(ValueError, match="a newer verify ran on this sequence"):
        model.commit(st, res, [0])  # the chain verify overwrote the tree's K/V rows
    with pytest.raises(ValueError, match="ran on another sequence"):
        model.commit(model.new_sequence(16), chain, 1)
    model.commit(st, chain, 2)
    with pytest.raises(ValueError, match="moved from 0 to 2"):
        model.commit(st, chain, 1)
    with pytest.raises(ValueError, match="parents must have one entry per token"):
        model.verify(st, [1, 2], parents=[-1])
    with pytest.raises(ValueError, match="non-empty"):
        model.verify(st, [])
    with pytest.raises(ValueError, match="kv_dtype must be"):
        Qwen35Model(load_qwen35(converted("smoke")), kv_dtype=sn.DType.Q4_K)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        model.new_sequence(0)
    with pytest.raises(ValueError, match="capture layer 3 is outside"):
        Qwen35Model(load_qwen35(converted("smoke")), capture_layers=[3])
    with pytest.raises(ValueError, match="max_graphs must be >= 1"):
        Qwen35Model(load_qwen35(converted("smoke")), max_graphs=0)
    assert not Qwen35Model(load_qwen35(converted("smoke")), cuda_graphs=True).cuda_graphs  # GPU only
    with pytest.raises(ValueError, match="not in the ring"):
        st.features.read(0, 3)


class _FakeGraph:
    def __init__(self, n):
        self.arena_bytes = n


def test_release_drops_the_sequences_graphs_and_state(converted):
    """Qwen35Model.release frees a finished sequence: its captured graphs (bookkeeping checked with
    stand-ins on the CPU; the GPU test checks real graphs), its device state, and later calls."""
    from specd.target_worker.model import _CapturedVerify

    model = Qwen35Model(load_qwen35(converted("smoke")))
    a, b = model.new_sequence(32), model.new_sequence(32)
    model.prefill(a, [1, 2, 3])
    model.prefill(b, [1, 2, 3])
    res = model.verify(a, [4, 5])
    ka, kb = a.slot.uid, b.slot.uid
    for key, n in (((ka, 1, False, 1024), 10), ((ka, 2, False, 1024), 20), ((kb, 1, True, 1024), 40)):
        model._graphs[key] = _CapturedVerify(_FakeGraph(n), None, None, None, [])
    model._graphs[(ka, 1, False, 1024)].commits[1] = _FakeGraph(5)
    assert model.graph_arena_bytes() == 75  # verify graphs and their commit graphs
    from specd.protos.v1 import worker_pb2
    from specd.target_worker.memory import report

    model.cuda_graphs = True  # the report's measured arenas (a GPU model's, stood in for here)
    rep = report(model, 64, 2, 4, measure=True)
    assert rep.cuda_graph_measured_bytes == 75 and rep.to_proto(worker_pb2).cuda_graph_measured_bytes == 75
    assert report(model, 64, 2, 4, measure=False).cuda_graph_measured_bytes == 0
    model.cuda_graphs = False
    assert model.release(a) == 2
    assert list(model._graphs) == [(kb, 1, True, 1024)] and model.graph_arena_bytes() == 40
    assert a.released and not a.kv and not a.ssm and not a.conv
    with pytest.raises(ValueError, match="released"):
        model.verify(a, [1])
    with pytest.raises(ValueError, match="released"):
        model.commit(a, res, 1)
    assert model.release(a) == 0  # idempotent
    model.commit(b, model.verify(b, [4]), 1)  # the other sequence is untouched
    assert b.committed == 4


def test_released_slots_are_kept_per_capacity_class(converted):
    """With CUDA graphs a released sequence's state slot is kept (at most slot_cache, the oldest
    dropped with its graphs) and given, states zeroed, to the next sequence whose capacity rounds up
    to the same rows (multiples of 1024). Bookkeeping only, on the CPU: the tensor-ops path with
    cuda_graphs set and stand-in graphs (tests/gpu/test_gpu_graph.py runs real ones)."""
    import specd.target_worker.model as mdl
    from specd.target_worker.model import _CapturedVerify

    model = Qwen35Model(load_qwen35(converted("smoke")), tensor_ops=True, slot_cache=2)
    model.cuda_graphs = True
    a = model.new_sequence(100)
    assert a.slot.rows == 1024
    for t in [*a.ssm.values(), *a.conv.values()]:  # a finished sequence leaves non-zero states
        model._ops.assign(t, sn.Tensor(np.ones(t.shape, np.float32)))
    model._graphs[(a.slot.uid, 1, True, 1024)] = _CapturedVerify(_FakeGraph(1), None, None, None, [])
    slot = a.slot
    assert model.release(a) == 0 and len(model._graphs) == 1
    b = model.new_sequence(1000)
    assert b.slot is slot and b.capacity == 1000 and not b.released
    assert all(not t.numpy().any() for t in [*b.ssm.values(), *b.conv.values()])
    c, d = model.new_sequence(1025), model.new_sequence(5)
    c_slot, d_slot = c.slot, d.slot
    assert c_slot.rows == 2048 and d_slot.rows == 1024 and d_slot is not slot
    assert model.release(b) == 0 and model.release(c) == 0 and b.slot is None
    assert model.release(d) == 1 and not model._graphs  # three kept > 2: b's slot (the oldest) goes
    assert model.new_sequence(900).slot is d_slot
    e = model.new_sequence(2000)
    assert e.slot is c_slot and model.release(e, keep_slot=False) == 0 and model._free_slots == []
    # a new slot that does not fit the device: the kept slots (here a 1024-row one) give their memory back
    model.release(model.new_sequence(10))
    real, calls = mdl._StateSlot, []

    def tight(m, rows):
        calls.append(len(m._free_slots))
        if len(calls) == 1:
            raise RuntimeError("out of device memory")
        return real(m, rows)

    mdl._StateSlot = tight
    try:
        assert model.new_sequence(3000).slot.rows == 3072 and calls == [1, 0] and model._free_slots == []
    finally:
        mdl._StateSlot = real
    with pytest.raises(ValueError, match="slot_cache must be >= 0"):
        Qwen35Model(load_qwen35(converted("smoke")), slot_cache=-1)


def test_step_failures_keep_or_release_the_sequence(converted):
    """A plain step whose graph capture fails has run nothing: the sequence stays usable. A failure
    once the forward runs (here the graph inputs' upload, with a stand-in graph on the CPU) may leave
    the states half updated: the sequence is released and its slot not kept (nor its graphs)."""
    from specd.target_worker.model import _CapturedVerify

    model = Qwen35Model(load_qwen35(converted("smoke")), tensor_ops=True, slot_cache=2)
    model.cuda_graphs = True  # the tensor-ops path with graphs asked for: capture fails on the CPU
    st = model.new_sequence(64)
    with pytest.raises(Exception):
        model.step(st, 1)
    assert not st.released and st.committed == 0 and not model._graphs
    slot = st.slot
    fake = _CapturedVerify(_FakeGraph(1), None, None, None, [])
    model._graphs[(slot.uid, 1, True, 1024)] = fake
    model._chain_graph = lambda *a, **k: fake  # "captured": the replay's input upload then fails
    with pytest.raises(Exception):
        model.step(st, 1)
    assert st.released and model._free_slots == [] and not model._graphs


def test_memory_report_counts_graph_rows_and_kept_slots(converted):
    """With CUDA graphs the report counts K/V at max_seq_len rounded up to 1024 rows and the kept
    slots (slot_cache states at that size) inside the workspace."""
    from specd.target_worker.memory import report, state_bytes

    model = Qwen35Model(load_qwen35(converted("smoke")), tensor_ops=True, slot_cache=3)
    plain = report(model, 1500, 2, 4, measure=False)
    assert plain.kv_bytes_per_sequence == plain.kv_bytes_per_token * 1500 and plain.slot_cache_bytes == 0
    model.cuda_graphs = True
    rep = report(model, 1500, 2, 4, measure=False)
    sb = state_bytes(model.hp, model.kv_dtype, 4, 0)
    assert rep.kv_bytes_per_sequence == rep.kv_bytes_per_token * 2048
    assert rep.slot_cache_bytes == 3 * (rep.kv_bytes_per_sequence + sb.recurrent + sb.conv)
    assert rep.workspace_bytes == plain.workspace_bytes + rep.cuda_graph_bytes + rep.slot_cache_bytes
    assert "kept state slots" in "\n".join(rep.lines())


def test_c24_tokenizer_from_gguf_matches_transformers(checkpoint, converted):
    """The tokenizer rebuilt from GGUF metadata encodes like transformers' Qwen3_5Tokenizer built from
    the same vocabulary and merges (the oracle: its own normaliser, split regex and byte-level BPE),
    including scripts with combining marks and decomposed accents; the chat specials and
    <think>/</think> are single ids inside a rendered chat template (shared/cases C24)."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    path = converted("condgen")
    meta = read_tokenizer_metadata(path)
    assert meta.pre == "qwen35"
    ours = build_tokenizer(meta, str(path))
    real = [t for t, ty in zip(meta.tokens, meta.token_types) if ty in (1, 3, 4)]  # not padding
    ref = Qwen3_5Tokenizer(vocab={t: meta.tokens.index(t) for t in real},
                           merges=[tuple(m.split(" ")) for m in meta.merges])
    ref.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    ref.add_tokens(ADDED_TOKENS)
    texts = ["hello world", "def f(x):\n    return x + 12345", "  spaces\tand\nnewlines\n\n", "naïve café 日本",
             "नमस्ते दुनिया", "สวัสดี", "cafe\u0301 vs café", "it's I'LL we'd",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm</think>\nok<|im_end|>"]
    for text in texts:
        assert ours.encode(text).ids == ref.encode(text, add_special_tokens=False), text
    rendered = texts[-1]
    assert ours.decode(ours.encode(rendered).ids, skip_special_tokens=False) == rendered
    ids = ours.encode(rendered).ids
    for special in SPECIAL_TOKENS[1:] + ADDED_TOKENS:
        assert ours.token_to_id(special) in ids, special
        assert ours.encode(special).ids == [ours.token_to_id(special)]


def test_perplexity_cli(converted, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    assert specd_main(["perplexity", "--target", str(converted("condgen")), "--file", str(text), "--ctx", "16",
                       "--max-chunks", "2", "--kv-type", "f32"]) == 0
    out = capsys.readouterr().out
    assert "Final estimate: PPL = " in out and "14 tokens scored" in out  # 2 chunks x (16 - 1 - 8)
    # user errors are one line on stderr, not a traceback
    assert specd_main(["perplexity", "--target", str(tmp_path / "none.gguf"), "--file", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specd perplexity: error: ") and "none.gguf" in err and "Traceback" not in err


def test_model_without_capture_layers_holds_zero_feature_rows(converted):
    """Without capture layers the feature rows are zeros of one n_embd tap: prefill chunks, chain and tree
    commits and steps hold their positions in the ring without copying rows (its rows stay the new ring's zeros), and
    a verify's ``features`` makes the zero rows when asked."""
    model = Qwen35Model(load_qwen35(converted("smoke")), prefill_chunk=5)
    st = model.new_sequence(32)
    model.prefill(st, [1, 2, 3, 4, 5, 6, 7])  # chunks of 5 and 2
    model.step(st, 8)
    res = model.verify(st, [9, 10, 11])
    assert res.raw_features is None and res.features.shape == (3, model.hp.n_embd) and not res.features.any()
    model.commit(st, res, 2)
    tree = model.verify(st, [12, 13, 14], parents=[-1, 0, -1])
    assert tree.raw_features is None and tree.features.shape == (3, model.hp.n_embd)
    model.commit(st, tree, [0, 1])  # a tree path: positions 10, 11
    width = model.hp.n_embd
    assert st.committed == 12 and st.features.all_zero and st.features.width == width
    np.testing.assert_array_equal(st.features.read(0, 12), np.zeros((12, width), np.float32))
    with pytest.raises(ValueError, match="not in the ring"):
        st.features.read(11, 2)
