"""The cuda-ipc feature transport on a real GPU (target_worker/feature_cuda_ipc.py, specd.native
gpu_ipc_*): a device buffer and an interprocess event exported by one process and opened by another
(multiprocessing spawn), rows compared bitwise; the transport's ring / reader across processes; the
in-process stack (the reader uses the writer's tensor: CUDA refuses to open a handle in its exporting
process) with a real drafter on the GPU; and `specd serve --device cuda --feature-transport cuda-ipc`
on the demo models (three processes) equal to plain greedy decoding on the GPU.

Needs a real GPU: skipped without one and under SPECD_TEST_GPU_DRYRUN=1 (IPC handles exist only on a
device; the CPU side is tests/target/test_feature_cuda_ipc.py and tests/service/test_cuda_ipc_features.py).

Run on the GPU machine: ``python -m pytest -v tests/gpu/test_gpu_feature_ipc.py``
(or ``TESTS=tests/gpu/test_gpu_feature_ipc.py bash tools/device/gpu_tests.sh``)."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawn_child import run_child  # noqa: E402

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DRYRUN or not sn.gpu_available(), reason="needs a real GPU (CUDA/HIP IPC)")]
GPU = sn.Device.GPU
CLI = [sys.executable, "-m", "specd.coordinator.cli"]


# ---------------------------------------------------------------- child processes (spawned)

def _child_raw(mem_handle, event_handle, shape, nbytes, q):
    """Opens the exported buffer and event, waits, copies the rows back; checks the size guards."""
    import specd.native as sn

    try:
        out = {}
        try:
            sn.gpu_ipc_open(mem_handle, [shape[0], shape[1] + 1], sn.DType.F32, nbytes)
        except ValueError as exc:
            out["wrong_shape"] = str(exc)
        try:
            sn.gpu_ipc_open(mem_handle, list(shape), sn.DType.F32, nbytes * 2)
        except ValueError as exc:
            out["wrong_nbytes"] = str(exc)
        try:
            sn.gpu_ipc_open(mem_handle[:10], list(shape), sn.DType.F32, nbytes)
        except ValueError as exc:
            out["short_handle"] = str(exc)
        try:  # consistent shape and size, but larger than the exported allocation
            sn.gpu_ipc_open(mem_handle, [2 * shape[0], shape[1]], sn.DType.F32, 2 * nbytes)
            out["mapped_smaller"] = "not detected"
        except ValueError as exc:
            out["mapped_smaller"] = str(exc)
        out["pci_bus_id"] = sn.gpu_pci_bus_id()
        # The exact size maps: the runtime reports the allocation's size (else every open is refused,
        # "cannot be determined": a peer's declared size is never trusted).
        t = sn.gpu_ipc_open(mem_handle, list(shape), sn.DType.F32, nbytes)
        ev = sn.gpu_ipc_event_open(event_handle)
        ev.wait()
        out["rows"] = sn.copy(t).numpy().tobytes()
        del t, ev  # closes the mapping (cudaIpcCloseMemHandle) and the event
        sn.gpu_synchronize()
        q.put(("ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("err", repr(exc)))


def _child_reader(fields, reads, q):
    """CudaIpcFeatureReader over a handle: every (start, n) read, as bytes."""
    import specd.native as sn
    from specd.target_worker.feature_cuda_ipc import CudaIpcFeatureReader
    from specd.target_worker.feature_shm import FeatureHandleInfo

    try:
        r = CudaIpcFeatureReader(FeatureHandleInfo(**fields))
        out = []
        for start, n in reads:
            t = r.read(start, n)
            assert t.device == sn.Device.GPU and tuple(t.shape) == (n, fields["width"])
            out.append(t.numpy().tobytes())
        try:
            r.read(0, r.committed + 1)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
        r.close()
        sn.gpu_synchronize()
        q.put(("ok", out))
    except BaseException as exc:  # noqa: BLE001
        q.put(("err", repr(exc)))


def _run_child(target, *args):
    return run_child(target, *args, timeout=120)


# ---------------------------------------------------------------- native API

def test_native_export_open_event_across_processes():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4096, 1024)).astype(np.float32)  # 16 MiB: the copy takes a while
    t, h = sn.gpu_ipc_export(list(rows.shape), sn.DType.F32)
    assert len(h) == sn.GPU_IPC_HANDLE_BYTES == 64 and t.device == GPU
    np.testing.assert_array_equal(t.numpy(), 0)  # zeroed
    ev = sn.gpu_ipc_event_create()
    assert len(ev.handle) == 64
    src = sn.Tensor(rows).to(GPU)
    sn.copy_rows(t, 0, src, 0, rows.shape[0])
    ev.record()  # the child waits for this record before it reads
    out = _run_child(_child_raw, h, ev.handle, rows.shape, rows.nbytes)
    assert np.frombuffer(out["rows"], np.float32).reshape(rows.shape).tobytes() == rows.tobytes()  # bitwise
    assert "bytes" in out["wrong_shape"] and "bytes" in out["wrong_nbytes"] and "64 bytes" in out["short_handle"]
    # the size is always determined (a runtime that cannot tell refuses every open, this one too)
    assert "exported allocation has" in out["mapped_smaller"], out["mapped_smaller"]
    assert "cannot be determined" not in out["mapped_smaller"]
    assert out["pci_bus_id"] == sn.gpu_pci_bus_id() != ""  # the same GPU names itself alike in both
    ev.synchronize()
    del t  # cudaFree after the stream drains
    sn.gpu_synchronize()


def test_native_errors_in_process():
    t, h = sn.gpu_ipc_export([8, 8], sn.DType.F32)
    with pytest.raises(ValueError, match="64 bytes"):
        sn.gpu_ipc_event_open(b"x")
    with pytest.raises(ValueError, match="must be > 0"):
        sn.gpu_ipc_export([0, 8], sn.DType.F32)
    with pytest.raises(RuntimeError):  # CUDA refuses a handle in its own exporting process
        sn.gpu_ipc_open(h, [8, 8], sn.DType.F32, 256)
    del t


# ---------------------------------------------------------------- the transport across processes

def test_ring_across_processes_bitwise():
    from specd.target_worker.feature_cuda_ipc import CudaIpcFeatureReader, CudaIpcFeatureWriter

    rng = np.random.default_rng(1)
    cap, width = 64, 3 * 256
    w = CudaIpcFeatureWriter()
    try:
        ring, h = w.create("s", cap, width)
        assert h.device_id == sn.gpu_pci_bus_id()
        with pytest.raises(ValueError, match="lives on GPU .* but this drafter worker runs on GPU"):
            CudaIpcFeatureReader(dataclasses.replace(h, device_id="0000:ff:1f.7"))  # refused before mapping
        prompt = rng.standard_normal((40, width)).astype(np.float32)
        ring.write(0, prompt)  # host rows (uploaded), as a prefill would commit
        verify = rng.standard_normal((9, width)).astype(np.float32)
        ring.write_rows(40, sn.Tensor(verify).to(GPU), [0, 1, 3, 4, 8])  # a tree path, device to device
        want = np.concatenate([prompt, verify[[0, 1, 3, 4, 8]]])
        out = _run_child(_child_reader, dataclasses.asdict(h), [(0, 45), (38, 7), (44, 1)])
        for (start, n), got in zip([(0, 45), (38, 7), (44, 1)], out[:3]):
            assert np.frombuffer(got, np.float32).reshape(n, width).tobytes() == want[start:start + n].tobytes()
        assert "not committed" in out[3]
        np.testing.assert_array_equal(ring.read(0, 45), want)  # writer-side read (host copy)
        assert w.release("s")
        assert not os.path.exists(f"/dev/shm/{h.name}")
    finally:
        w.close_all()
    sn.gpu_synchronize()


# ---------------------------------------------------------------- service paths

def _demo():
    from demo.test_demo_drafters import TARGET, drafter_path

    d = drafter_path("dflash2")
    if not (TARGET.is_file() and d.is_file()):
        pytest.skip(f"demo models not present ({TARGET}, {d})")
    return TARGET, d


@pytest.fixture(scope="module")
def gpu_plain():
    from demo.test_demo_drafters import plain_greedy, prompts

    _demo()
    run = plain_greedy("cuda", 40)
    return [run(text) for text in prompts("code", 2) + prompts("prose", 1)]


def test_in_process_stack_cuda_ipc_with_gpu_drafter(gpu_plain):
    """Target and drafter servicers in one process (the reader takes the writer's own tensor): the
    drafter (DFlash 2 on the GPU) ingests device rows, output equals plain greedy."""
    from demo.test_demo_drafters import TAPS
    from service.conftest import Stack, generate, streamed_ids, token_request
    from specd.coordinator.policy import PolicyConfig
    from specd.draft_worker import server as dserver
    from specd.draft_worker.engine import open_model_drafter
    from specd.protos.v1 import generate_pb2 as gpb

    target, dpath = _demo()
    stack = Stack(str(target), capture_layers=TAPS, max_seq_len=1024, device="cuda", feature_transport="cuda-ipc",
                  policy=PolicyConfig(step_ratio=0))
    srv = svc = None
    try:
        d = open_model_drafter(str(dpath), str(target), device="cuda")
        svc = dserver.DraftServicer(d, feature_transport="cuda-ipc")
        addr = f"unix://{stack.dir}/d-ipc.sock"
        srv, _ = dserver.start_server(svc, addr, 4)
        stub = stack.coordinator(drafter_override=addr)
        accepted = 0
        for ids, ref in gpu_plain:
            sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE)
            chunks, done = generate(stub, token_request(ids, 40, ignore_eos=True, speculation=sp), timeout=120)
            assert streamed_ids(chunks) == ref
            accepted += done.speculation.num_accepted_tokens
        assert accepted > 0
        assert stack.tservicer.features.live() == []
    finally:
        if srv is not None:
            srv.stop(0).wait()
            svc.close()
        stack.stop()


def test_serve_cuda_ipc_equals_plain_greedy(gpu_plain, tmp_path):
    """`specd serve --device cuda --feature-transport cuda-ipc` (target worker, drafter worker and
    coordinator as three processes; the drafter maps the target's rings): chain and tree output of
    `specd generate` equals plain greedy on the GPU; SIGTERM stops it cleanly and leaves no slot
    table behind."""
    from service.test_processes import _start, _stop

    target, dpath = _demo()
    before = set(glob.glob("/dev/shm/specd-fi-*"))
    sock = f"unix://{tmp_path}/c.sock"
    serve = _start(["serve", "--target", str(target), "--drafter", str(dpath), "--device", "cuda",
                    "--feature-transport", "cuda-ipc", "--listen", sock, "--metrics-port", "0",
                    "--policy-step-ratio", "0", "--max-seq-len", "1024", "--kv-dtype", "f32",
                    "--runtime-dir", str(tmp_path / "rt")], timeout=300)
    try:
        accepted = 0
        for ids, ref in gpu_plain:
            for mode in ("chain", "tree"):
                out = subprocess.run(CLI + ["generate", "--server", sock, "--token-ids", ",".join(map(str, ids)),
                                            "--max-tokens", str(len(ref)), "--ignore-eos", "--speculation", "force",
                                            "--draft-mode", mode, "--json"],
                                     capture_output=True, text=True, timeout=300)
                assert out.returncode == 0, out.stderr[-3000:]
                done = json.loads(out.stdout)
                assert [int(t) for t in done["output_ids"]] == ref, (mode, ids[:8])
                accepted += int(done["speculation"].get("num_accepted_tokens", 0))
        assert accepted > 0
    finally:
        assert _stop(serve, 120) == 0
    leaked = [s for s in set(glob.glob("/dev/shm/specd-fi-*")) - before]
    assert leaked == []
