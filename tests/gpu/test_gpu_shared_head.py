"""The target's token_embd / output shared with the drafter worker on a real GPU
(target_worker/shared_weights.py over specd.native gpu_ipc_export / gpu_ipc_open).

* Two processes: this process runs a target worker on the GPU (demo target; it exports its head and
  publishes the handles in Info); spawned drafter processes load the demo DFlash 2 drafter with
  ``--share-target-weights auto`` (maps the target's tensors) and ``off`` (own copy). The mapped bytes
  equal the GGUF's bitwise, proposals (tokens, logits, top-k) are bit-identical, and the sharing
  drafter's device memory (its pool's bytes in use) is lower by about the tensors' size; the memory
  report says "shared" with the mapped bytes.
* One process (the in-process stack): the drafter takes the target's own tensors (CUDA refuses to
  open a handle in its exporting process), output equals plain greedy decoding on the GPU.
* ``specd serve --device cuda`` (three processes; the drafter worker maps through ``--target-worker``)
  equals plain greedy, and its Info reports the shared head.

Needs a real GPU: skipped without one and under SPECD_TEST_GPU_DRYRUN=1 (IPC handles exist only on a
device). The CPU side (negotiation, refusals, errors, memory accounting, the whole stack with a fake
IPC backend) is tests/service/test_shared_head.py.

Run on the GPU machine: ``python -m pytest -v tests/gpu/test_gpu_shared_head.py``."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawn_child import run_child  # noqa: E402

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DRYRUN or not sn.gpu_available(), reason="needs a real GPU (CUDA/HIP IPC)")]
CLI = [sys.executable, "-m", "specd.coordinator.cli"]
N_CTX = 24  # committed positions ingested before the proposal


def _demo():
    from demo.test_demo_drafters import TARGET, drafter_path

    d = drafter_path("dflash2")
    if not (TARGET.is_file() and d.is_file()):
        pytest.skip(f"demo models not present ({TARGET}, {d})")
    return str(TARGET), str(d)


def _sha(t) -> str:
    return hashlib.sha256(np.ascontiguousarray(t.numpy()).tobytes()).hexdigest()


# ---------------------------------------------------------------- the drafter process (spawned)

def _child_drafter(dpath, tpath, address, mode, q):
    """Loads the drafter on the GPU with --share-target-weights ``mode``; reports its pool bytes in
    use, the sharing decision, the memory report, the head's bytes and one proposal."""
    import numpy as np

    import specd.native as sn
    from specd.draft_worker.engine import open_model_drafter
    from specd.target_worker.memory import drafter_memory

    try:
        sn.gpu_synchronize()
        before = int(sn.gpu_memory_info()["pool_used_bytes"])
        d = open_model_drafter(dpath, tpath, device="cuda", share_target_weights=mode, target_worker=address)
        sn.gpu_synchronize()
        used = int(sn.gpu_memory_info()["pool_used_bytes"]) - before
        hp = d.hp
        rng = np.random.default_rng(5)
        feats = rng.standard_normal((N_CTX, len(hp.target_layer_ids) * hp.n_embd)).astype(np.float32)
        seq = d.model.new_sequence(64)
        seq.ingest(feats, 0)
        p = seq.propose(17, N_CTX, return_logits=True, topk=2)
        mem = drafter_memory(d.model, d.head_sharing)
        out = dict(used=used, shared=d.head_sharing.shared, reason=d.head_sharing.reason,
                   mem_head=mem.target_head, mem_own=mem.target_head_bytes, mem_shared=mem.shared_head_bytes,
                   embd_sha=_sha(d.model.token_embd), head_sha=_sha(d.model.lm_head),
                   embd_gpu=d.model.token_embd.device == sn.Device.GPU,
                   tokens=np.asarray(p.tokens).tobytes(), logits=np.asarray(p.logits).tobytes(),
                   topk=np.asarray(p.topk_ids).tobytes() + np.asarray(p.topk_logprobs).tobytes())
        del seq, p
        d.close()  # closes the mapping (cudaIpcCloseMemHandle) before the process exits
        sn.gpu_synchronize()
        q.put(("ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put(("err", traceback.format_exc() + repr(exc)))


def _run_child(target, *args):
    return run_child(target, *args, timeout=300)


@pytest.fixture(scope="module")
def target_worker():
    """A target worker on the GPU in this process, serving on a Unix socket."""
    from specd.target_worker import server as tserver

    tpath, dpath = _demo()
    from demo.test_demo_drafters import TAPS

    d = tempfile.mkdtemp(prefix="specd-gpu-head-")
    cfg = tserver.TargetWorkerConfig(target=tpath, listen=f"unix://{d}/t.sock", capture_layers=TAPS,
                                     max_seq_len=512, kv_dtype="f32", threads=8, device="cuda")
    svc = tserver.load_servicer(cfg)
    srv, _ = tserver.start_server(svc, cfg.listen, cfg.threads)
    try:
        yield svc, cfg.listen, tpath, dpath
    finally:
        srv.stop(0).wait()
        svc.close()


def test_target_exports_and_publishes_its_head(target_worker):
    import grpc

    from specd.protos.v1 import worker_pb2 as wpb
    from specd.protos.v1 import worker_pb2_grpc as wpbg
    from specd.target_worker.gguf_loader import load_qwen35

    svc, addr, tpath, _ = target_worker
    with grpc.insecure_channel(addr) as ch:
        ti = wpbg.TargetWorkerStub(ch).Info(wpb.InfoRequest())
    got = {m.name: m for m in ti.shared_tensors}
    assert set(got) == {"token_embd.weight", "output.weight"}
    w = load_qwen35(tpath)
    out = w.output if w.output is not None else w.token_embd
    for name, t, placed in (("token_embd.weight", w.token_embd, svc.model.token_embd),
                            ("output.weight", out, svc.model.output)):
        m = got[name]
        assert m.device_id == sn.gpu_pci_bus_id() and len(m.ipc_mem_handle) == 64
        assert (m.ggml_type, list(m.shape), m.nbytes) == (int(t.dtype), list(t.shape), t.nbytes)
        assert placed.device == sn.Device.GPU and _sha(placed) == _sha(t)  # the target computes with them


def test_two_processes_shared_equals_own_copy_and_saves_memory(target_worker):
    svc, addr, tpath, dpath = target_worker
    from specd.target_worker.gguf_loader import load_qwen35

    w = load_qwen35(tpath)
    out = w.output if w.output is not None else w.token_embd
    head = w.token_embd.nbytes + (out.nbytes if out is not w.token_embd else 0)
    shared = _run_child(_child_drafter, dpath, tpath, addr, "auto")
    own = _run_child(_child_drafter, dpath, tpath, addr, "off")
    assert shared["shared"] and shared["reason"] == "", shared["reason"]
    assert not own["shared"] and "off" in own["reason"]
    assert shared["embd_gpu"] and own["embd_gpu"]
    # the mapped tensors hold exactly the GGUF's bytes; proposals are bit-identical
    assert shared["embd_sha"] == own["embd_sha"] == _sha(w.token_embd)
    assert shared["head_sha"] == own["head_sha"] == _sha(out)
    for k in ("tokens", "logits", "topk"):
        assert shared[k] == own[k], k
    # memory: the sharing drafter's device memory is lower by about the head's size
    saved = own["used"] - shared["used"]
    assert abs(saved - head) <= max(2 << 20, head // 20), (saved, head, own["used"], shared["used"])
    assert (shared["mem_head"], shared["mem_shared"], shared["mem_own"]) == ("shared", head, 0)
    assert (own["mem_head"], own["mem_own"], own["mem_shared"]) == ("own", head, 0)
    # the target keeps serving after the drafters closed their mappings
    st = svc.model.new_sequence(16)
    assert np.isfinite(np.asarray(svc.model.prefill(st, [1, 2, 3]))).all()
    svc.model.release(st)


@pytest.fixture(scope="module")
def gpu_plain():
    from demo.test_demo_drafters import plain_greedy, prompts

    _demo()
    run = plain_greedy("cuda", 32)
    return [run(text) for text in prompts("code", 2) + prompts("prose", 1)]


def test_in_process_stack_drafter_uses_the_targets_tensors(gpu_plain):
    from demo.test_demo_drafters import TAPS
    from service.conftest import Stack, generate, streamed_ids, token_request
    from specd.coordinator.policy import PolicyConfig
    from specd.draft_worker import server as dserver
    from specd.draft_worker.engine import open_model_drafter
    from specd.protos.v1 import generate_pb2 as gpb

    tpath, dpath = _demo()
    stack = Stack(tpath, capture_layers=TAPS, max_seq_len=1024, device="cuda", policy=PolicyConfig(step_ratio=0))
    srv = svc = None
    try:
        d = open_model_drafter(dpath, tpath, device="cuda", target_worker=f"unix://{stack.dir}/t.sock")
        assert d.head_sharing.shared, d.head_sharing.reason
        assert d.model.token_embd is stack.tservicer.model.token_embd  # this process's export: the tensor itself
        svc = dserver.DraftServicer(d)
        addr = f"unix://{stack.dir}/d-head.sock"
        srv, _ = dserver.start_server(svc, addr, 4)
        stub = stack.coordinator(drafter_override=addr)
        for ids, ref in gpu_plain:
            sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE)
            chunks, done = generate(stub, token_request(ids, len(ref), ignore_eos=True, speculation=sp), timeout=120)
            assert streamed_ids(chunks) == ref
    finally:
        if srv is not None:
            srv.stop(0).wait()
            svc.close()
        stack.stop()


def test_serve_with_shared_head_equals_plain_greedy(gpu_plain, tmp_path):
    """`specd serve --device cuda` (default --share-target-weights auto): the drafter worker maps the
    target's head (its Info says "shared") and output equals plain greedy on the GPU."""
    import grpc

    from service.test_processes import _start, _stop
    from specd.protos.v1 import worker_pb2 as wpb
    from specd.protos.v1 import worker_pb2_grpc as wpbg

    tpath, dpath = _demo()
    sock = f"unix://{tmp_path}/c.sock"
    rt = tmp_path / "rt"
    serve = _start(["serve", "--target", tpath, "--drafter", dpath, "--device", "cuda", "--listen", sock,
                    "--metrics-port", "0", "--policy-step-ratio", "0", "--max-seq-len", "1024", "--kv-dtype", "f32",
                    "--runtime-dir", str(rt)], timeout=300)
    try:
        with grpc.insecure_channel(f"unix://{rt}/draft.sock") as ch:
            mem = wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest(), timeout=30).memory
        assert mem.target_head == "shared" and mem.shared_head_bytes > 0 and mem.target_head_bytes == 0
        for ids, ref in gpu_plain:
            out = subprocess.run(CLI + ["generate", "--server", sock, "--token-ids", ",".join(map(str, ids)),
                                        "--max-tokens", str(len(ref)), "--ignore-eos", "--speculation", "force",
                                        "--json"], capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            assert [int(t) for t in json.loads(out.stdout)["output_ids"]] == ref
    finally:
        assert _stop(serve, 120) == 0
