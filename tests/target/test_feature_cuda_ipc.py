"""The cuda-ipc feature transport without a GPU: ring bookkeeping (shared FeatureRing slot logic),
handle validation, cleanup, the transport / device validation of every component, and the memory
report. The device calls go through tests/target/fake_ipc.FakeIpcBackend (CPU tensors); the real
device path is tests/gpu/test_gpu_feature_ipc.py."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import specd.native as sn
from specd.coordinator.config import CoordinatorConfig
from specd.draft_worker.server import DraftWorkerConfig
from specd.target_worker import feature_cuda_ipc as fci
from specd.target_worker.feature_inline import check_transport
from specd.target_worker.feature_shm import FeatureHandleInfo, attach_reader
from specd.target_worker.features import FeatureRing, held_slots, row_runs, write_slots
from specd.target_worker.server import TargetWorkerConfig

from .fake_ipc import FakeIpcBackend
from .test_memory import tiny_iq4xs  # noqa: F401 - fixture

W = 6


@pytest.fixture
def writer():
    w = fci.CudaIpcFeatureWriter(backend=FakeIpcBackend())
    yield w
    w.close_all()


def rows(start, n, width=W):
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) + 1000 * (start + 1)).astype(np.float32)


def test_runs():
    assert row_runs(np.array([3, 4, 5, 0, 1]), np.array([0, 1, 2, 3, 4])) == [(3, 0, 3), (0, 3, 2)]
    assert row_runs(np.array([7, 8, 9]), np.array([0, 2, 3])) == [(7, 0, 1), (8, 2, 2)]
    assert row_runs(np.array([], np.int64), np.array([], np.int64)) == []


def test_shared_slot_logic():
    s, p = write_slots(4, 6, 3)
    assert s.tolist() == [2, 3, 0] and p.tolist() == [6, 7, 8]
    with pytest.raises(ValueError, match="do not fit"):
        write_slots(4, 0, 5)
    table = np.full(4, -1, np.int64)
    table[s] = p
    assert held_slots(table, 7, 2).tolist() == [3, 0]
    with pytest.raises(ValueError, match=r"positions \[5\]"):
        held_slots(table, 5, 2)
    r = FeatureRing(4, W)  # the host ring uses the same functions
    r.write(6, rows(6, 3))
    np.testing.assert_array_equal(r.read(7, 2), rows(6, 3)[1:])


def test_write_read_and_event_order(writer):
    FakeIpcBackend.log.clear()
    ring, h = writer.create("s", 16, W)
    assert h.kind == "cuda_ipc" and h.capacity == 16 and h.width == W
    assert h.device_nbytes == 4 * 16 * W and h.nbytes == fci.table_bytes(16)
    assert len(h.ipc_mem_handle) == len(h.ipc_event_handle) == 64
    assert h.device_id == FakeIpcBackend.pci_bus_id
    assert os.path.exists(f"/dev/shm/{h.name}")
    if not sn.gpu_available():  # attach_reader dispatches on the kind to the native backend: a clear error here
        with pytest.raises(RuntimeError, match="GPU backend|GPU"):
            attach_reader(h)
    reader = fci.CudaIpcFeatureReader(h, backend=FakeIpcBackend())
    assert reader.committed == 0
    ring.write(0, rows(0, 5))  # host rows (uploaded)
    src = sn.Tensor(rows(5, 4))  # a "device" verify output of 4 rows; a tree path commits rows 0, 2, 3
    ring.write_rows(5, src, [0, 2, 3])
    assert reader.committed == 8 and ring.slot_pos[:9].tolist() == list(range(8)) + [-1]
    assert [e[0] for e in FakeIpcBackend.log] == ["record", "record"]
    got = reader.read(2, 6)
    assert isinstance(got, sn.Tensor) and tuple(got.shape) == (6, W)
    want = np.concatenate([rows(0, 5), rows(5, 4)[[0, 2, 3]]])[2:8]
    np.testing.assert_array_equal(got.numpy(), want)
    assert FakeIpcBackend.log[-1][0] == "wait"  # the reader waited for the event before gathering
    np.testing.assert_array_equal(ring.read(0, 8), np.concatenate([rows(0, 5), rows(5, 4)[[0, 2, 3]]]))
    assert reader.read(3, 0).shape == (0, W)
    with pytest.raises(ValueError, match="not committed"):
        reader.read(6, 3)
    with pytest.raises(ValueError, match="inline feature rows"):
        reader.feed([object()])
    reader.feed([])
    reader.close()


def test_wraparound_and_overwritten_rows(writer):
    ring, h = writer.create("w", 4, W)
    reader = fci.CudaIpcFeatureReader(h, backend=FakeIpcBackend())
    ring.write(0, rows(0, 3))
    ring.write(3, rows(3, 3))  # positions 3, 4, 5 -> slots 3, 0, 1 (positions 0 and 1 overwritten)
    np.testing.assert_array_equal(reader.read(3, 3).numpy(), rows(3, 3))  # gathered across the wrap
    np.testing.assert_array_equal(reader.read(2, 2).numpy(), np.concatenate([rows(0, 3)[2:], rows(3, 3)[:1]]))
    with pytest.raises(ValueError, match="overwritten or never written"):
        reader.read(0, 2)
    with pytest.raises(ValueError, match="rows must be"):
        ring.write(6, np.zeros((1, W + 1), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        ring.write(6, rows(6, 5))
    with pytest.raises(ValueError, match="row indices"):
        ring.write_rows(6, sn.Tensor(rows(6, 2)), [0, 2])
    reader.close()


def test_write_zeros_publishes_without_copies_until_rows_are_written(writer):
    """A target without capture layers: write_zeros only moves the slot table (and records the event a
    reader waits on) while the exported rows are all zero; after real rows it writes zeros."""
    ring, h = writer.create("z", 4, W)
    reader = fci.CudaIpcFeatureReader(h, backend=FakeIpcBackend())
    FakeIpcBackend.log.clear()
    ring.write_zeros(0, 0)  # nothing to publish: no event recorded
    assert not FakeIpcBackend.log and reader.committed == 0
    ring.write_zeros(0, 3)
    assert ring.all_zero and reader.committed == 3 and [e[0] for e in FakeIpcBackend.log] == ["record"]
    np.testing.assert_array_equal(reader.read(0, 3).numpy(), np.zeros((3, W), np.float32))
    ring.write(3, rows(3, 2))  # positions 3, 4 -> slots 3, 0
    ring.write_zeros(5, 2)  # slots 1, 2
    ring.write_zeros(7, 1)  # slot 3 held row 3: cleared
    np.testing.assert_array_equal(reader.read(4, 4).numpy(), np.concatenate([rows(3, 2)[1:], np.zeros((3, W), np.float32)]))
    with pytest.raises(ValueError, match="do not fit"):
        ring.write_zeros(8, 5)
    reader.close()


def test_handle_validation(writer):
    _, h = writer.create("v", 8, W)
    bad = {
        "kind": dataclasses.replace(h, kind="posix_shm"),
        "device_nbytes": dataclasses.replace(h, device_nbytes=h.device_nbytes + 4),
        "ipc_mem_handle": dataclasses.replace(h, ipc_mem_handle=b"x" * 63),
        "ipc_event_handle": dataclasses.replace(h, ipc_event_handle=b""),
        "capacity": dataclasses.replace(h, capacity=0),
        "width": dataclasses.replace(h, width=fci.MAX_WIDTH + 1),
        "table": dataclasses.replace(h, nbytes=h.nbytes - 8),
        "device_id": dataclasses.replace(h, device_id=""),
    }
    for what, handle in bad.items():
        with pytest.raises(ValueError):
            fci.CudaIpcFeatureReader(handle, backend=FakeIpcBackend())
        assert what
    # a consistent handle whose header disagrees (another ring's segment)
    _, h2 = writer.create("v2", 8, W + 1)
    with pytest.raises(ValueError, match="header does not match"):
        fci.CudaIpcFeatureReader(dataclasses.replace(h, name=h2.name), backend=FakeIpcBackend())
    with pytest.raises(ValueError, match="is 96 bytes, expected 128"):
        _, h3 = writer.create("v3", 4, W)
        fci.CudaIpcFeatureReader(dataclasses.replace(h, name=h3.name), backend=FakeIpcBackend())
    with pytest.raises(RuntimeError, match="unknown memory handle"):
        fci.CudaIpcFeatureReader(dataclasses.replace(h, ipc_mem_handle=b"\0" * 64), backend=FakeIpcBackend())
    with pytest.raises(ValueError, match="capacity"):
        writer.create("big", fci.MAX_CAPACITY + 1, W)


def test_release_and_close_all_free_everything(writer):
    _, h1 = writer.create("a", 8, W)
    ring2, h2 = writer.create("b", 8, W)
    with pytest.raises(ValueError, match="already has"):
        writer.create("a", 8, W)
    assert sorted(writer.live()) == sorted([h1.name, h2.name])
    assert writer.device_bytes() == 2 * 4 * 8 * W
    assert h1.ipc_mem_handle in FakeIpcBackend.registry
    assert writer.release("a") and not writer.release("a")
    assert not os.path.exists(f"/dev/shm/{h1.name}")
    assert h1.ipc_mem_handle not in FakeIpcBackend.registry and h1.ipc_event_handle not in FakeIpcBackend.registry
    with pytest.raises(FileNotFoundError):
        fci.CudaIpcFeatureReader(h1, backend=FakeIpcBackend())
    writer.close_all()
    assert writer.live() == [] and ring2.rows is None and not os.path.exists(f"/dev/shm/{h2.name}")


def test_device_oom_is_resource_exhausted():
    class NoMemory(FakeIpcBackend):
        def export(self, capacity, width):
            raise RuntimeError("cuda call `cudaMalloc of 123 bytes (IPC buffer)` failed: out of memory")

    w = fci.CudaIpcFeatureWriter(backend=NoMemory())
    with pytest.raises(fci.ShmExhausted, match="no device memory for a 192-byte feature ring"):
        w.create("s", 8, W)
    assert w.live() == []
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"specd-fi-{os.getpid()}-")]


def test_handle_proto_round_trip(writer):
    from specd.protos.v1 import worker_pb2 as pb

    _, h = writer.create("p", 8, W)
    msg = pb.FeatureHandle.FromString(h.to_proto(pb).SerializeToString())
    assert FeatureHandleInfo.from_proto(msg) == h


def test_transport_and_device_validation():
    assert check_transport("cuda-ipc", "x") == "cuda-ipc"
    with pytest.raises(ValueError, match="x: feature_transport must be one of shm, inline, cuda-ipc"):
        check_transport("nccl", "x")
    with pytest.raises(ValueError, match="target-worker: --feature-transport cuda-ipc .* needs\n?.*--device cuda"):
        TargetWorkerConfig(target="t.gguf", feature_transport="cuda-ipc", device="cpu").validate()
    with pytest.raises(ValueError, match="draft-worker: --feature-transport cuda-ipc"):
        DraftWorkerConfig(vocab=16, feature_transport="cuda-ipc", device="cpu").validate()
    TargetWorkerConfig(target="t.gguf", feature_transport="shm", device="cpu").validate()
    CoordinatorConfig(feature_transport="cuda-ipc").validate()  # the coordinator has no device
    with pytest.raises(ValueError, match="coordinator: feature_transport"):
        CoordinatorConfig(feature_transport="ipc").validate()
    if not sn.gpu_available():  # auto resolves to cpu here
        with pytest.raises(ValueError, match="needs --device cuda"):
            TargetWorkerConfig(target="t.gguf", feature_transport="cuda-ipc", device="auto").validate()
    fci.check_device_transport("cuda-ipc", "cuda", "w")
    fci.check_device_transport("shm", "cpu", "w")


def test_flags_accept_cuda_ipc_and_serve_refuses_cpu(tmp_path):
    import argparse

    from specd.target_worker.server import add_transport_argument

    p = argparse.ArgumentParser()
    add_transport_argument(p)
    assert p.parse_args(["--feature-transport", "cuda-ipc"]).feature_transport == "cuda-ipc"
    with pytest.raises(SystemExit):
        p.parse_args(["--feature-transport", "gpu"])
    out = subprocess.run([sys.executable, "-m", "specd.coordinator.cli", "serve", "--target", str(tmp_path / "t.gguf"),
                          "--scripted-block", "4", "--device", "cpu", "--feature-transport", "cuda-ipc",
                          "--runtime-dir", str(tmp_path / "rt")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "serve: --feature-transport cuda-ipc" in out.stderr and "--device cuda" in out.stderr, out.stderr[-2000:]


def test_memory_report_counts_the_ring_on_the_device(tiny_iq4xs):
    from specd.target_worker import memory as mem
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.model import Qwen35Model

    m = Qwen35Model(load_qwen35(tiny_iq4xs), capture_layers=(1, 3))
    shm = mem.report(m, max_seq_len=64, max_sequences=3, verify_width=5)
    ipc = mem.report(m, max_seq_len=64, max_sequences=3, verify_width=5, feature_transport="cuda-ipc")
    width = 2 * m.hp.n_embd
    assert not shm.feature_ring_on_device and ipc.feature_ring_on_device
    assert ipc.feature_ring_bytes_per_sequence == 4 * 64 * width
    assert ipc.sequence_bytes == shm.sequence_bytes + 4 * 64 * width
    assert ipc.host_feature_bytes == 3 * fci.table_bytes(64)
    assert ipc.total_bytes == shm.total_bytes + 3 * 4 * 64 * width
    assert any("device, cuda-ipc" in line for line in ipc.lines())
    from specd.protos.v1 import worker_pb2 as pb

    assert ipc.to_proto(pb).feature_ring_on_device


def test_27b_ring_memory_matches_the_docstring():
    # 27B, 5 taps of n_embd 5120: 100 KiB per row, 3.1 GiB per 32k sequence (feature_cuda_ipc docstring)
    assert fci.device_bytes(1, 5 * 5120) == 100 * 1024
    assert round(fci.device_bytes(32768, 5 * 5120) / 2**30, 1) == 3.1


def test_failed_event_create_forgets_the_exported_rows():
    exported = []

    class NoEvent(FakeIpcBackend):
        def export(self, capacity, width):
            t, h = super().export(capacity, width)
            exported.append(h)
            return t, h

        def event_create(self):
            raise RuntimeError("cuda call `cudaEventCreateWithFlags` failed: out of resources")

    w = fci.CudaIpcFeatureWriter(backend=NoEvent())
    with pytest.raises(RuntimeError, match="cudaEventCreateWithFlags"):
        w.create("s", 8, W)
    assert len(exported) == 1 and exported[0] not in FakeIpcBackend.registry  # forgotten, not left registered
    assert w.live() == [] and w.device_bytes() == 0
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"specd-fi-{os.getpid()}-")]
    w.close_all()


def _snapshot(st):
    return (st.committed, {i: np.array(v).copy() for i, v in st.ssm.items()},
            {i: np.array(v).copy() for i, v in st.conv.items()},
            {i: (k.numpy().copy(), v.numpy().copy()) for i, (k, v) in st.kv.items()},
            st.features.slot_pos.copy())


def _assert_unchanged(st, before):
    after = _snapshot(st)
    assert after[0] == before[0]
    for a, b in zip(after[1:4], before[1:4]):
        assert a.keys() == b.keys()
        for i in a:
            np.testing.assert_array_equal(a[i], b[i])
    np.testing.assert_array_equal(after[4], before[4])


def test_failed_feature_read_leaves_the_sequence_unchanged(tiny_iq4xs, writer, monkeypatch):
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.model import Qwen35Model

    m = Qwen35Model(load_qwen35(tiny_iq4xs), capture_layers=(1, 3))
    st = m.new_sequence(32)
    m.prefill(st, [1, 2, 3, 4])

    def broken_d2h(*args, **kwargs):  # a device feature tensor whose copy to the host fails
        raise RuntimeError("cuda call `cudaMemcpy` failed: an illegal memory access was encountered")

    res = m.verify(st, [5, 6, 7])
    res.raw_features = sn.Tensor(np.asarray(res.raw_features))  # stands in for the GPU's tensor
    before = _snapshot(st)
    with monkeypatch.context() as mp:
        mp.setattr(sn, "copy_rows", broken_d2h)
        with pytest.raises(RuntimeError, match="cudaMemcpy"):
            m.commit(st, res, 2)  # host ring: the rows are copied into it before any state moves
    _assert_unchanged(st, before)

    # device ring: a verify graph replayed since (its arena rewritten) is refused before the state updates
    ring, _ = writer.create("dev", 32, 2 * m.hp.n_embd)
    ring.write(0, np.asarray(st.features.read(0, 4)))
    st.features = ring
    res = m.verify(st, [5, 6, 7])
    res.raw_features = sn.Tensor(np.asarray(res.raw_features))
    res.graph, res.replay = type("StaleGraph", (), {"replays": 2, "commits": {}})(), 1
    before = _snapshot(st)
    with pytest.raises(RuntimeError, match="replayed the CUDA graph holding these features"):
        m.commit(st, res, 2)
    _assert_unchanged(st, before)
    res.graph = None  # the same result, fresh
    with monkeypatch.context() as mp:  # the state updates fail after the rows were staged: nothing published
        mp.setattr(m, "_commit_states", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            m.commit(st, res, 2)
    assert st.committed == 4 and ring.header[3] == 4 and (ring.slot_pos[4:] == -1).all()
    m.commit(st, res, 2)  # commits and moves everything
    assert st.committed == 6 and ring.header[3] == 6
    np.testing.assert_array_equal(ring.read(4, 2), np.asarray(res.raw_features.numpy())[:2])


def test_reader_close_drains_the_stream_before_unmapping(writer):
    ring, h = writer.create("c", 8, W)
    ring.write(0, rows(0, 2))
    seen = []

    class Backend(FakeIpcBackend):
        def synchronize(self):
            seen.append(reader.rows is not None)  # still mapped while the stream drains
            super().synchronize()

    reader = fci.CudaIpcFeatureReader(h, backend=Backend())
    reader.read(0, 2)
    reader.close()
    assert seen == [True] and reader.rows is None and reader.event is None
    reader.close()  # idempotent: nothing mapped, no second sync
    assert seen == [True]

    class BrokenDevice(FakeIpcBackend):
        def synchronize(self):
            raise RuntimeError("cuda call `cudaStreamSynchronize` failed: an illegal memory access")

    r2 = fci.CudaIpcFeatureReader(h, backend=BrokenDevice())
    r2.close()  # logged; the mapping and the slot table are dropped all the same
    assert r2.rows is None and r2.shm is None


def test_reader_refuses_a_ring_of_another_gpu(writer):
    _, h = writer.create("g", 8, W)
    other = FakeIpcBackend()
    other.pci_bus_id = "0000:2a:00.0"
    opened = []
    other.open = lambda *a: opened.append(a)  # must not be reached
    with pytest.raises(ValueError, match=r"lives on GPU 0000:19:00\.0 \(the target worker's\) but this drafter "
                                         r"worker runs on GPU 0000:2a:00\.0"):
        fci.CudaIpcFeatureReader(h, backend=other)
    assert opened == []
    fci.CudaIpcFeatureReader(h, backend=FakeIpcBackend()).close()  # the same GPU attaches
