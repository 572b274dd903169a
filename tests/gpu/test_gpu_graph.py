"""GPU graph capture, trusted index tensors, broadcast add/mul and async uploads on the device.

Needs a real GPU (skipped otherwise, and under SPECD_TEST_GPU_DRYRUN: graphs exist only on the
device; the host contracts are in tests/native/test_index_guards.py). Properties:
* broadcast sn.add / sn.mul of a [1, H] / [H] operand: bitwise numpy;
* trusted index tensors are not read back, and the kernels guard them: an out-of-range embedding
  id gives a zero row, an out-of-range kv_write (or qk_norm_rope cache write) row is skipped, a negative
  causal q_pos attends to nothing (zeros); untrusted GPU indices are still checked (ValueError);
* a captured graph replays with new inputs written by sn.gpu_write_async; tensors freed during the
  capture stay valid for replays; a host synchronisation during a capture raises RuntimeError and
  the library works normally after sn.gpu_graph_abort(); another thread's op waits for the capture (the commit's
  in-place ops, which allocate nothing, too);
  only the capturing thread may end or abort it; a buffer another thread frees during a capture is
  freed when the capture ends (not when its graph goes); gated calls of another thread (allocation,
  upload, copy_rows, read-back, replay) never leak into a capture running beside them;
* Qwen35Model with cuda_graphs equals the eager model bitwise (tokens, argmax, logits, features,
  states) over many steps of widths 1..16, two sequences interleaved, a small graph cache (eviction)
  and positions crossing the 1024-row attention bound, with commits (any prefix) replayed as graphs
  too; a stale graph result refuses its logits; a larger attention bound supersedes a (sequence, w)
  pair's graphs of smaller bounds, and Qwen35Model.release (slot_cache 0) drops a sequence's graphs;
* plain steps (Qwen35Model.step) replay their own graph, states committed in place, bitwise the eager
  one-row verify + commit;
* a released sequence's state slot and graphs serve the next sequence of its capacity class (no new
  capture), bitwise the eager model's fresh sequence.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import specd.native as sn

from test_gpu_target import DRYRUN, Qwen35Model, assert_same_state, tiny  # noqa: F401  (tiny: fixture)

GPU = sn.Device.GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DRYRUN or not sn.gpu_available(), reason="needs a GPU (graphs exist only there)")]


def on_gpu(a):
    return sn.Tensor(np.ascontiguousarray(a)).to(GPU)


@pytest.fixture(autouse=True)
def no_capture_left():
    yield
    if sn.gpu_capturing():  # a failed test must not leave the stream capturing for the next one
        sn.gpu_graph_abort()
        pytest.fail("a GPU graph capture was left running")


# ------------------------------------------------------------------------------------------ ops

@pytest.mark.parametrize("a_shape,b_shape", [((7, 300), (1, 300)), ((7, 300), (300,)), ((2, 3, 64), (64,)),
                                             ((1, 5), (5,))])
def test_broadcast_add_mul(rng, a_shape, b_shape):
    a = (rng.standard_normal(a_shape) * 10).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    np.testing.assert_array_equal(sn.add(on_gpu(a), on_gpu(b)).numpy(), (a + b).reshape(a_shape))
    np.testing.assert_array_equal(sn.mul(on_gpu(a), on_gpu(b)).numpy(), (a * b).reshape(a_shape))
    with pytest.raises(ValueError, match="a and b must have the same shape"):
        sn.add(on_gpu(a), on_gpu(np.ones((2, a_shape[-1]), np.float32)))


def test_trusted_embedding_guards(rng):
    w = rng.standard_normal((10, 64)).astype(np.float32)
    ids = on_gpu(np.array([3, -1, 10, 9], np.int32))
    y = sn.embedding(on_gpu(w), ids, trusted=True).numpy()
    np.testing.assert_array_equal(y[[0, 3]], w[[3, 9]])
    np.testing.assert_array_equal(y[[1, 2]], 0.0)  # out of range: a zero row, never a read past w
    with pytest.raises(ValueError, match="out of range"):
        sn.embedding(on_gpu(w), ids)  # untrusted GPU ids are read back and checked


@pytest.mark.parametrize("dtype", [sn.DType.F32, sn.DType.F16, sn.DType.Q8_0])
def test_trusted_kv_write_skips_bad_rows(rng, dtype):
    cache = sn.Tensor.zeros([6, 2, 32], dtype, GPU)
    before = cache.numpy().copy()
    x = rng.standard_normal((3, 2, 32)).astype(np.float32)
    sn.kv_write(cache, on_gpu(x), on_gpu(np.array([6, 2, -3], np.int32)), trusted=True)
    after = cache.numpy()
    keep = [r for r in range(6) if r != 2]
    np.testing.assert_array_equal(after[keep], before[keep])  # rows 6 and -3 skipped
    ref = sn.Tensor.zeros([6, 2, 32], dtype, GPU)
    sn.kv_write(ref, on_gpu(x[1:2]), np.array([2], np.int32))
    np.testing.assert_array_equal(after[2], ref.numpy()[2])
    with pytest.raises(ValueError, match="outside the cache"):
        sn.kv_write(cache, on_gpu(x), on_gpu(np.array([6, 2, 1], np.int32)))


@pytest.mark.parametrize("dtype", [sn.DType.F32, sn.DType.F16, sn.DType.Q8_0])
def test_trusted_qk_norm_rope_cache_write_skips_bad_rows(rng, dtype):
    """As kv_write's: trusted rows outside the cache are skipped (k still returned for every row); the written
    row equals the composition's bytes."""
    qg, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 2, 64), (3, 2, 32), (3, 2, 32)))
    norm_w, pos = on_gpu(np.ones(32, np.float32)), on_gpu(np.array([4, 5, 6], np.int32))
    caches = [sn.Tensor.zeros([6, 2, 32], dtype, GPU) for _ in range(2)]
    before = [c.numpy().copy() for c in caches]
    _, _, ko = sn.qk_norm_rope(on_gpu(qg), on_gpu(k), norm_w, norm_w, pos, 32, 1e4, 1e-6, trusted=True,
                               k_cache=caches[0], v_cache=caches[1], v=on_gpu(v),
                               rows=on_gpu(np.array([6, 2, -3], np.int32)))
    _, _, want_k = sn.qk_norm_rope(on_gpu(qg), on_gpu(k), norm_w, norm_w, pos, 32, 1e4, 1e-6)
    np.testing.assert_array_equal(ko.numpy(), want_k.numpy())
    keep = [r for r in range(6) if r != 2]
    for c, b, x in zip(caches, before, (want_k.numpy(), v)):
        after = c.numpy()
        np.testing.assert_array_equal(after[keep], b[keep])  # rows 6 and -3 skipped
        ref = sn.Tensor.zeros([6, 2, 32], dtype, GPU)
        sn.kv_write(ref, on_gpu(x[1:2]), np.array([2], np.int32))
        np.testing.assert_array_equal(after[2], ref.numpy()[2])


def test_trusted_attention_negative_position(rng):
    kc = on_gpu(rng.standard_normal((8, 1, 64)).astype(np.float32))
    q = on_gpu(rng.standard_normal((2, 2, 64)).astype(np.float32))
    pos = on_gpu(np.array([-5, 3], np.int32))
    out = sn.attention(q, kc, kc, 8, pos, causal=True, trusted=True).numpy()
    np.testing.assert_array_equal(out[0], 0.0)  # no visible key
    ref = sn.attention(q, kc, kc, 8, np.array([0, 3], np.int32), causal=True).numpy()
    np.testing.assert_array_equal(out[1], ref[1])
    with pytest.raises(ValueError, match="q_pos must be >= 0"):
        sn.attention(q, kc, kc, 8, pos, causal=True)


def test_write_async_and_views():
    t = sn.Tensor.zeros([8], sn.DType.I32, GPU)
    sn.gpu_write_async(t, np.arange(8, dtype=np.int32))
    np.testing.assert_array_equal(t.view_rows(2, 5).numpy(), [2, 3, 4])
    src = np.full(8, 7, np.int32)
    sn.gpu_write_async(t, src)
    src[:] = -1  # already staged: the device copy must not see this
    np.testing.assert_array_equal(t.numpy(), 7)
    big = sn.Tensor.zeros([40000], sn.DType.I32, GPU)  # over one staging slot: synchronous fallback
    sn.gpu_write_async(big, np.arange(40000, dtype=np.int32))
    np.testing.assert_array_equal(big.numpy(), np.arange(40000))
    with pytest.raises(ValueError, match="bytes"):
        sn.gpu_write_async(t, np.zeros(7, np.int32))
    with pytest.raises(ValueError, match="src is F32, dst is I32"):
        sn.gpu_write_async(t, np.zeros(8, np.float32))


# ----------------------------------------------------------------------------------------- graphs

def test_graph_replays_with_new_inputs(rng):
    x = sn.Tensor.zeros([4, 256], sn.DType.F32, GPU)
    v = on_gpu(rng.standard_normal((1, 256)).astype(np.float32))
    tmp_host = rng.standard_normal((4, 256)).astype(np.float32)
    tmp = on_gpu(tmp_host)
    sn.gpu_graph_begin(0)  # no reserve: every allocation grows the arena
    assert sn.gpu_capturing()
    y = sn.mul(sn.add(x, v), tmp)  # the add's output is freed during the capture
    del tmp  # freed during the capture: deferred, the graph keeps reading it
    g = sn.gpu_graph_end()
    assert not sn.gpu_capturing() and g.arena_bytes > 0
    vh = v.numpy()
    for _ in range(3):
        xh = rng.standard_normal((4, 256)).astype(np.float32)
        sn.gpu_write_async(x, xh)
        g.replay()
        np.testing.assert_array_equal(y.numpy(), (xh + vh) * tmp_host)
    del g
    np.testing.assert_array_equal(y.numpy(), (xh + vh) * tmp_host)  # the arena outlives the graph


def test_host_sync_during_capture_raises():
    x = on_gpu(np.ones((2, 8), np.float32))
    ids = on_gpu(np.array([0, 1], np.int32))
    sn.gpu_graph_begin()
    try:
        y = sn.add(x, x)
        with pytest.raises(RuntimeError, match="graph capture"):
            y.numpy()
        with pytest.raises(RuntimeError, match="graph capture"):
            sn.gpu_synchronize()
        with pytest.raises(RuntimeError, match="graph capture"):
            sn.embedding(x, ids)  # untrusted GPU ids would be read back
        with pytest.raises(RuntimeError, match="graph capture"):
            sn.gpu_write_async(ids, np.zeros(2, np.int32))
        with pytest.raises(RuntimeError, match="graph capture"):
            sn.Tensor(np.ones(3, np.float32)).to(GPU)
        with pytest.raises(RuntimeError, match="already running"):
            sn.gpu_graph_begin()
    finally:
        sn.gpu_graph_abort()
    assert not sn.gpu_capturing()
    np.testing.assert_array_equal(sn.add(x, x).numpy(), 2.0)  # the library works after the abort
    with pytest.raises(RuntimeError, match="no GPU graph capture is running"):
        sn.gpu_graph_end()


def beside_capture(capture, other):
    """Runs other() on another thread while this one captures capture(): other must wait until the capture ends,
    then finish (an exception it raised is raised here). Returns (the graph, capture's result)."""
    done, failed = threading.Event(), []

    def run():
        try:
            other()
        except BaseException as exc:  # noqa: BLE001 (raised again on the test's thread)
            failed.append(exc)
        done.set()

    sn.gpu_graph_begin()
    try:
        out = capture()
        worker = threading.Thread(target=run)
        worker.start()
        assert not done.wait(0.5)  # waiting while this thread captures
        g = sn.gpu_graph_end()
    except BaseException:
        sn.gpu_graph_abort()
        raise
    worker.join(30)
    assert done.is_set()
    if failed:
        raise failed[0]
    return g, out


def test_other_thread_waits_for_the_capture():
    """Another thread's op is held back at its output allocation until the capture ends (it is not
    recorded into the graph) and then runs normally."""
    x = on_gpu(np.ones((2, 8), np.float32))
    out = {}

    def other():
        out["y"] = sn.add(x, x).numpy()
        out["z"] = sn.slice(sn.Tensor.zeros([4, 2], sn.DType.F32, GPU), 0, 1, 3).numpy()

    g, z = beside_capture(lambda: sn.mul(x, x), other)
    np.testing.assert_array_equal(out["y"], 2.0)
    np.testing.assert_array_equal(out["z"], np.zeros((2, 2), np.float32))
    g.replay()
    np.testing.assert_array_equal(z.numpy(), 1.0)


@pytest.mark.parametrize("op", ["conv1d_causal_states", "gated_delta_net_states", "copy_tensors"])
def test_in_place_commit_ops_wait_for_the_capture(rng, op):
    """The commit's in-place ops allocate nothing: each holds the capture lock while it enqueues, so another
    thread's call waits for a capture to end and runs then, once: its result is there before any replay, and a
    replay of the graph does not apply it again."""
    T, C, hk, hv, d = 2, 40, 1, 2, 32
    x = on_gpu(rng.standard_normal((T, C)).astype(np.float32))
    q = rng.standard_normal((T, hk, d)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    g, beta = -np.abs(rng.standard_normal((T, hv))).astype(np.float32), np.full((T, hv), 0.5, np.float32)
    v = rng.standard_normal((T, hv, d)).astype(np.float32)
    gdn_in = [on_gpu(a) for a in (q, q, v, g, beta)]
    if op == "conv1d_causal_states":
        start = rng.standard_normal((3, C)).astype(np.float32)
        target = on_gpu(start)
        want = np.concatenate([start, x.numpy()])[T:]
        call = lambda: sn.conv1d_causal_states([x], [target])  # noqa: E731
    elif op == "gated_delta_net_states":
        start = rng.standard_normal((hv, d, d)).astype(np.float32)
        target, one = on_gpu(start), on_gpu(start)
        sn.gated_delta_net(*gdn_in, one, 0.2)
        want = one.numpy()
        call = lambda: sn.gated_delta_net_states(*([a] for a in gdn_in), [target], 0.2)  # noqa: E731
    else:
        target, src = on_gpu(np.zeros(5, np.float32)), on_gpu(np.ones(5, np.float32))
        want = np.ones(5, np.float32)
        call = lambda: sn.copy_tensors([target], [src])  # noqa: E731
    graph, y = beside_capture(lambda: sn.add(x, x), call)
    np.testing.assert_array_equal(target.numpy(), want)  # ran once the capture ended, not recorded into it
    if op == "copy_tensors":
        sn.copy_rows(src, 0, on_gpu(np.full(5, 3.0, np.float32)), 0, 5)  # a replayed copy would bring 3.0
    graph.replay()
    np.testing.assert_array_equal(y.numpy(), 2 * x.numpy())
    np.testing.assert_array_equal(target.numpy(), want)


def test_only_the_capturing_thread_ends_the_capture():
    x = on_gpu(np.ones((2, 8), np.float32))
    errors = []

    def other():
        for fn in (sn.gpu_graph_end, sn.gpu_graph_abort):
            try:
                fn()
            except RuntimeError as exc:
                errors.append(str(exc))

    sn.gpu_graph_begin()
    try:
        z = sn.mul(x, x)
        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        assert sn.gpu_capturing()  # still this thread's
        g = sn.gpu_graph_end()
    except BaseException:
        sn.gpu_graph_abort()
        raise
    assert len(errors) == 2 and all("another thread" in e for e in errors), errors
    g.replay()
    np.testing.assert_array_equal(z.numpy(), 1.0)


def test_other_threads_free_runs_when_the_capture_ends():
    """A free by another thread during a capture is not recorded (nor deferred to the graph's
    destruction): it runs right after gpu_graph_end."""
    x = on_gpu(np.ones((2, 8), np.float32))
    big = [sn.Tensor.zeros([16 << 20], sn.DType.F32, GPU)]  # 64 MiB from the pool
    sn.gpu_synchronize()
    used0 = sn.gpu_memory_info()["pool_used_bytes"]
    sn.gpu_graph_begin()
    try:
        z = sn.add(x, x)
        t = threading.Thread(target=big.clear)  # the last reference goes on another thread
        t.start()
        t.join(30)
        assert sn.gpu_memory_info()["pool_used_bytes"] >= used0  # not freed during the capture
        g = sn.gpu_graph_end()
    except BaseException:
        sn.gpu_graph_abort()
        raise
    sn.gpu_synchronize()
    assert sn.gpu_memory_info()["pool_used_bytes"] <= used0 - (64 << 20)  # freed, while g still lives
    g.replay()
    np.testing.assert_array_equal(z.numpy(), 2.0)
    del g


def test_gated_calls_of_another_thread_stay_out_of_captures():
    """One thread captures and replays small graphs in a loop while another allocates, uploads,
    copies rows, reads back and replays its own graph: every result is right (no work of one thread
    is recorded into the other's graph, no capture is invalidated)."""
    x = on_gpu(np.full((4, 64), 3.0, np.float32))
    stop, errors = threading.Event(), []
    own_in = sn.Tensor.zeros([4, 64], sn.DType.F32, GPU)  # the other thread's graph input (fixed address)
    sn.gpu_graph_begin()
    try:
        own_out = sn.mul(own_in, own_in)
        own = sn.gpu_graph_end()
    except BaseException:
        sn.gpu_graph_abort()
        raise

    def other():
        try:
            rng = np.random.default_rng(1)
            i = 0
            while not stop.is_set() and i < 2000:
                i += 1
                vals = rng.integers(-1000, 1000, size=64).astype(np.int32)
                t = sn.Tensor.zeros([64], sn.DType.I32, GPU)
                sn.gpu_write_async(t, vals)
                u = sn.Tensor.zeros([64], sn.DType.I32, GPU)
                sn.copy_rows(u, 0, t, 0, 64)
                np.testing.assert_array_equal(u.numpy(), vals)
                h = rng.standard_normal((4, 64)).astype(np.float32)
                sn.gpu_write_async(own_in, h)
                own.replay()
                np.testing.assert_array_equal(own_out.numpy(), h * h)
                del t, u
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    worker = threading.Thread(target=other)
    worker.start()
    try:
        for k in range(200):
            sn.gpu_graph_begin(1 << 20)
            try:
                z = sn.mul(x, x)
                g = sn.gpu_graph_end()
            except BaseException:
                sn.gpu_graph_abort()
                raise
            g.replay()
            np.testing.assert_array_equal(z.numpy(), 9.0, err_msg=f"capture {k}")
            del g, z
    finally:
        stop.set()
        worker.join(120)
    assert not worker.is_alive()
    assert not errors, errors


# ------------------------------------------------------------------------------------------ model

def _pair(weights, **kw):
    return (Qwen35Model(weights, device=GPU, cuda_graphs=True, **kw),
            Qwen35Model(weights, device=GPU, cuda_graphs=False, **kw))


def _same_result(a, b, what):
    np.testing.assert_array_equal(a.argmax, b.argmax, err_msg=what)
    np.testing.assert_array_equal(a.logits, b.logits, err_msg=what)
    np.testing.assert_array_equal(a.features, b.features, err_msg=what)


@pytest.mark.parametrize("name,kv", [("main", sn.DType.F16), ("r3", sn.DType.Q8_0), ("smoke", sn.DType.F32)])
def test_graph_verify_equals_eager(tiny, rng, name, kv):
    weights, ck = tiny(name)
    graphs, eager = _pair(weights, kv_dtype=kv, capture_layers=[1], max_graphs=3)
    V = weights.hparams.n_vocab
    seqs = []
    for _ in range(2):
        sg, se = graphs.new_sequence(400), eager.new_sequence(400)
        graphs.prefill(sg, ck.prompt)
        eager.prefill(se, ck.prompt)
        seqs.append((sg, se))
    for step in range(40):
        sg, se = seqs[step % 2]  # two sequences interleaved
        if sg.committed + 16 > sg.capacity:
            break
        w = int(rng.integers(1, 17))
        toks = [int(t) for t in rng.integers(0, V, size=w)]
        rg, re = graphs.verify(sg, toks), eager.verify(se, toks)
        assert rg.graph is not None and re.graph is None
        _same_result(rg, re, f"step {step} w={w}")
        n = int(rng.integers(0, w + 1))
        graphs.commit(sg, rg, n)
        eager.commit(se, re, n)
        assert len(graphs._graphs) <= 3  # evicted beyond max_graphs
        assert n == 0 or n in rg.graph.commits  # the commit ran as a graph too
    for sg, se in seqs:
        assert_same_state(sg, se)
        np.testing.assert_array_equal(sg.features.read(0, sg.committed), se.features.read(0, se.committed))
        t = int(rng.integers(0, V))
        np.testing.assert_array_equal(graphs.decode(sg, t), eager.decode(se, t))


def test_graph_decode_crosses_attention_bound(tiny, rng):
    """Positions past 1024 switch to graphs with a larger attention bound; still bitwise eager."""
    weights, _ = tiny("smoke")
    graphs, eager = _pair(weights, prefill_chunk=256, slot_cache=0)
    prompt = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=1018)]
    sg, se = graphs.new_sequence(1100), eager.new_sequence(1100)
    graphs.prefill(sg, prompt)
    eager.prefill(se, prompt)
    for step in range(6):
        w = 1 + step % 3
        toks = [int(t) for t in rng.integers(0, weights.hparams.n_vocab, size=w)]
        rg, re = graphs.verify(sg, toks), eager.verify(se, toks)
        _same_result(rg, re, f"step {step} at {sg.committed}")
        graphs.commit(sg, rg, w)
        eager.commit(se, re, w)
    assert {k[3] for k in graphs._graphs} == {2048}  # the 1024-bound graphs were superseded (rows: 2048)
    assert sorted(k[1] for k in graphs._graphs) == [1, 2, 3]
    assert_same_state(sg, se)
    assert graphs.graph_arena_bytes() >= 3 * (64 << 20)  # measured, commit graphs included
    assert graphs.release(sg) == 3 and not graphs._graphs and graphs.graph_arena_bytes() == 0


def test_graph_step_equals_eager_verify_and_commit(tiny, rng):
    """Plain steps (Qwen35Model.step) replay one graph per (state slot, attention bound) that commits the
    GDN / conv states in place, without a commit graph: bitwise the eager one-row verify + commit
    (argmax, states, KV and feature rows) across the 1024-row bound and between speculative verifies;
    release (slot_cache 0) drops the step graphs with the others."""
    weights, _ = tiny("main")
    graphs, eager = _pair(weights, prefill_chunk=256, capture_layers=[1], slot_cache=0)
    vocab = weights.hparams.n_vocab
    prompt = [int(t) for t in rng.integers(0, vocab, size=1012)]
    sg, se = graphs.new_sequence(1100), eager.new_sequence(1100)
    t = int(np.argmax(graphs.prefill(sg, prompt)))
    eager.prefill(se, prompt)
    for i in range(16):
        if i % 4 == 3:  # a speculative step on both: verify 3 rows, commit 2
            toks = [t] + [int(x) for x in rng.integers(0, vocab, size=2)]
            rg, re = graphs.verify(sg, toks), eager.verify(se, toks)
            graphs.commit(sg, rg, 2)
            eager.commit(se, re, 2)
            t = int(re.argmax[1])
            continue
        best = graphs.step(sg, t)
        re = eager.verify(se, [t])
        eager.commit(se, re, 1)
        assert best == int(re.argmax[0]), f"step {i} at {se.committed}"
        t = best
    assert sg.committed > 1024
    assert_same_state(sg, se)
    np.testing.assert_array_equal(sg.features.read(0, sg.committed), se.features.read(0, se.committed))
    steps = [k for k in graphs._graphs if k[2]]
    assert {k[3] for k in steps} == {2048} and {k[1] for k in steps} == {1}  # the 1024 bound's was superseded
    assert all(not graphs._graphs[k].commits for k in steps)
    n = len(graphs._graphs)
    assert graphs.release(sg) == n and not graphs._graphs


def test_released_slot_serves_the_next_sequence_with_its_graphs(tiny, rng):
    """A released sequence's state slot and its captured graphs serve the next sequence of the same
    capacity class (no new capture: the same graph objects replay), with states zeroed: its tokens,
    logits, states and features equal an eager model's fresh sequence bitwise; a sequence of another
    class gets a new slot; beyond slot_cache the oldest kept slot goes with its graphs."""
    weights, ck = tiny("main")
    graphs, eager = _pair(weights, capture_layers=[1], slot_cache=1)
    vocab = weights.hparams.n_vocab

    def generate(model, capacity, toks):
        st = model.new_sequence(capacity)
        t = int(np.argmax(model.prefill(st, ck.prompt)))
        out = []
        for i, d in enumerate(toks):
            if i % 3 == 2:  # a speculative step: verify 3 rows, commit 2
                res = model.verify(st, [t, d, int(d + 1) % vocab])
                model.commit(st, res, 2)
                t = int(res.argmax[1])
            else:
                t = model.step(st, t)
            out.append(t)
        return st, out

    toks = [int(x) for x in rng.integers(0, vocab, size=9)]
    s1, out1 = generate(graphs, 200, toks)
    slot, captured = s1.slot, dict(graphs._graphs)
    assert graphs.release(s1) == 0 and graphs._graphs == captured  # kept with its graphs
    toks2 = [int(x) for x in rng.integers(0, vocab, size=9)]
    s2, out2 = generate(graphs, 300, toks2)  # same class (rows 1024): the slot and its graphs again
    assert s2.slot is slot and all(graphs._graphs[k] is g for k, g in captured.items())
    e2, ref2 = generate(eager, 300, toks2)
    assert out2 == ref2
    assert_same_state(s2, e2)
    np.testing.assert_array_equal(s2.features.read(0, s2.committed), e2.features.read(0, e2.committed))
    s3 = graphs.new_sequence(1500)  # another class (rows 2048): a new slot
    assert s3.slot is not slot and s3.slot.rows == 2048
    graphs.release(s2)
    n = len(captured)
    assert graphs.release(s3) == n and not graphs._graphs  # slot_cache 1: s2's slot goes with its graphs


def test_stale_graph_result_refuses_logits(tiny):
    weights, ck = tiny("smoke")
    model = Qwen35Model(weights, device=GPU)
    assert model.cuda_graphs
    st = model.new_sequence(64)
    model.prefill(st, ck.prompt)
    first = model.verify(st, [1, 2])
    second = model.verify(st, [3, 4])  # same graph replayed: first's arena outputs are overwritten
    with pytest.raises(RuntimeError, match="replayed the CUDA graph"):
        first.logits  # noqa: B018
    with pytest.raises(ValueError, match="newer verify"):
        model.commit(st, first, 1)
    model.commit(st, second, 2)
    assert st.committed == len(ck.prompt) + 2


def test_model_rejects_bad_max_graphs(tiny):
    weights, _ = tiny("smoke")
    with pytest.raises(ValueError, match="max_graphs must be >= 1"):
        Qwen35Model(weights, device=GPU, max_graphs=0)
