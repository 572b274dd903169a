"""feature_transport = "cuda-ipc" through the whole in-process stack on the CPU, with the device calls
replaced by tests/target/fake_ipc.FakeIpcBackend (CPU tensors, handles registered in this process): the
Prefill handle carries the IPC fields, the drafter attaches through them, every ingested feature row
equals the plain run's, speculative output equals plain greedy, a wrong-kind handle is refused, and
every ring (slot table, "device" rows, event) is freed on release and at stop. The same path on a
real GPU across processes is tests/gpu/test_gpu_feature_ipc.py."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import specd.native as sn
from specd.coordinator.policy import PolicyConfig
from specd.target_worker import feature_cuda_ipc as fci

from target.fake_ipc import FakeIpcBackend

from .conftest import BLOCK, Stack, generate, streamed_ids, token_request


def _tables():
    return set(glob.glob(f"/dev/shm/specd-fi-{os.getpid()}-*"))


@pytest.fixture(scope="module")
def cstack(target_gguf):
    mp = pytest.MonkeyPatch()
    mp.setattr(fci, "NativeIpcBackend", FakeIpcBackend)
    before = _tables()
    s = Stack(target_gguf, feature_transport="cuda-ipc", device="cpu", policy=PolicyConfig(step_ratio=0))
    s.tables_before = before
    try:
        yield s
    finally:
        s.stop()
        mp.undo()
        assert _tables() - before == set(), "slot tables left after stop"


def test_info_reports_cuda_ipc(cstack):
    from specd.protos.v1 import worker_pb2 as wpb
    from specd.protos.v1 import worker_pb2_grpc as wpbg

    import grpc

    with grpc.insecure_channel(f"unix://{cstack.dir}/t.sock") as ch:
        ti = wpbg.TargetWorkerStub(ch).Info(wpb.InfoRequest())
    assert ti.feature_transport == "cuda-ipc"
    assert ti.memory.feature_ring_on_device


def test_spec_equals_plain_and_rows_arrive(cstack, reference):
    rng = np.random.default_rng(7)
    vocab = cstack.tservicer.model.hp.n_vocab
    for i in range(3):
        prompt = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 20)))]
        max_tokens = 24
        ref, feats = reference(prompt, max_tokens + BLOCK + 2)
        cstack.drafter.continuations[tuple(prompt)] = ref
        cstack.drafter.plan = [None, 2, 0][i]
        req = token_request(prompt, max_tokens, ignore_eos=True)
        req.request_id = f"ipc-{i}-{rng.integers(1 << 30)}"
        chunks, done = generate(cstack.stub, req)
        assert streamed_ids(chunks) == ref[:max_tokens]
        assert done.speculation.num_draft_tokens > 0
        seq = next(k for k in cstack.drafter.seen if k.startswith(req.request_id + "#"))
        seen = cstack.drafter.seen[seq]
        full = list(prompt) + ref
        assert sorted(seen) == list(range(len(seen))) and len(seen) >= len(prompt)
        for pos, (tok, row) in seen.items():
            assert tok == full[pos]
            np.testing.assert_array_equal(row, feats[pos], err_msg=f"feature row {pos}")
    # released at the end of each request: no ring left on the target, no registered handle
    assert cstack.tservicer.features.live() == []
    assert _tables() - cstack.tables_before == set()
    head = {i.handle for i in cstack.tservicer.model.head_exporter.infos}  # the shared target weights: kept
    assert not [h for h, v in FakeIpcBackend.registry.items() if isinstance(v, sn.Tensor) and h not in head]


def test_wrong_kind_handle_is_refused(cstack):
    import grpc

    from specd.protos.v1 import worker_pb2 as wpb
    from specd.protos.v1 import worker_pb2_grpc as wpbg

    with grpc.insecure_channel(f"unix://{cstack.dir}/d.sock") as ch:
        with pytest.raises(grpc.RpcError) as ei:
            wpbg.DraftWorkerStub(ch).Propose(wpb.ProposeRequest(
                seq_id="x", features=wpb.FeatureHandle(kind="posix_shm", name="nope", capacity=4, width=4)))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cuda-ipc" in ei.value.details() and "cuda_ipc" in ei.value.details()



@pytest.mark.parametrize("transport", ["cuda-ipc", "shm"])
def test_release_order(cstack, transport, monkeypatch):
    """cuda-ipc: the drafter's Release (which closes its mapping of the ring) returns before the
    target's Release (which frees the ring) is sent. shm keeps the concurrent release."""
    import asyncio

    coord = cstack.coords[0][0]
    events = []

    def wrap(stub, name):
        inner = stub.Release

        async def release(request, **kw):
            events.append(("start", name))
            await asyncio.sleep(0.2)  # a slow Release: an overlap would show
            try:
                return await inner(request, **kw)
            finally:
                events.append(("end", name))
        monkeypatch.setattr(stub, "Release", release)

    wrap(coord.target, "target")
    wrap(coord.drafter, "drafter")
    monkeypatch.setattr(coord.cfg, "feature_transport", transport)
    asyncio.run_coroutine_threadsafe(coord._release("order-1", {"target": True, "drafter": True}),
                                     cstack.loop).result(timeout=30)
    if transport == "cuda-ipc":
        assert events == [("start", "drafter"), ("end", "drafter"), ("start", "target"), ("end", "target")]
    else:
        assert [e for e, _ in events[:2]] == ["start", "start"]  # both in flight at once
