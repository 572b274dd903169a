"""The target's token_embd / output shared with the drafter worker (specd.target_worker.shared_weights)
on the CPU, with the device calls replaced by tests/target/fake_ipc.FakeIpcBackend: the target worker
publishes the exported tensors in Info, a drafter worker given ``--target-worker`` maps them instead of
loading its own copy (the very tensors the target computes with), its proposals and the served output
equal the own-copy drafter's and plain greedy decoding, the memory report counts the shared tensors
once (the drafter as "shared"), and every refusal (sharing off, the CPU, another GPU, another file's
sizes, another file's content with the same sizes (the content fingerprint), a fingerprint missing
(an older target worker) or of another scheme, a refused handle, no target worker) falls back to an
own copy with its reason logged, while malformed handle data is an error naming the tensor. The same path on a real GPU across processes is
tests/gpu/test_gpu_shared_head.py."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import struct
import types

import grpc
import numpy as np
import pytest

import specd.native as sn
from specd.coordinator.policy import PolicyConfig
from specd.draft_worker import server as dserver
from specd.draft_worker.engine import open_model_drafter
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg
from specd.target_worker import feature_cuda_ipc as fci
from specd.target_worker import shared_weights as sw
from specd.target_worker.gguf_loader import load_qwen35

from target.fake_ipc import FakeIpcBackend

from .conftest import Stack, generate, streamed_ids, token_request

from .test_drafters import MAX_TOKENS, PROMPTS, make_gguf
from specd.protos.v1 import generate_pb2 as gpb  # noqa: E402

NativeIpcBackend = fci.NativeIpcBackend  # the real one (before the fixtures patch it)


class OtherGpu(FakeIpcBackend):
    pci_bus_id = "0000:9a:00.0"


class Refusing(FakeIpcBackend):
    def open_tensor(self, handle, shape, dtype, nbytes):
        raise RuntimeError("fake IPC: invalid resource handle")


@pytest.fixture(scope="module")
def hstack(target_gguf, tmp_path_factory):
    """An in-process stack whose target worker exports its head (fake IPC), with two DFlash drafter
    workers over the same drafter GGUF: one mapping the target's tensors, one with its own copy."""
    mp = pytest.MonkeyPatch()
    mp.setattr(fci, "NativeIpcBackend", FakeIpcBackend)
    s = Stack(target_gguf, device="cpu", policy=PolicyConfig(step_ratio=0))
    servers = []
    try:
        path = make_gguf(tmp_path_factory.mktemp("shared-head"), "dflash")
        tsock = f"unix://{s.dir}/t.sock"
        s.shared = open_model_drafter(path, target_gguf, device="cpu", target_worker=tsock)
        s.own = open_model_drafter(path, target_gguf, device="cpu", target_worker=tsock, share_target_weights="off")
        s.drafter_path = path
        s.stubs = {}
        for name, d in (("shared", s.shared), ("own", s.own)):
            svc = dserver.DraftServicer(d)
            addr = f"unix://{s.dir}/d-{name}.sock"
            srv, _ = dserver.start_server(svc, addr, 8)
            servers.append((srv, svc))
            s.stubs[name] = (s.coordinator(drafter_override=addr), addr)
        yield s
    finally:
        for srv, svc in servers:
            srv.stop(0).wait()
            svc.close()
        s.stop()
        mp.undo()


def _target_info(stack):
    with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
        return wpbg.TargetWorkerStub(ch).Info(wpb.InfoRequest())


def _drafter_info(addr):
    with grpc.insecure_channel(addr) as ch:
        return wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest())


def test_target_info_publishes_the_exported_head(hstack):
    model = hstack.tservicer.model
    hp = model.hp
    ti = _target_info(hstack)
    got = {m.name: m for m in ti.shared_tensors}
    assert sorted(got) == sorted(sw.NAMES)
    for name, t in ((sw.EMBD, model.token_embd), (sw.OUTPUT, model.output)):
        m = got[name]
        assert list(m.shape) == [hp.n_vocab, hp.n_embd]
        assert m.ggml_type == int(t.dtype) and m.nbytes == t.nbytes == sw.tensor_nbytes(m.shape, t.dtype)
        assert len(m.ipc_mem_handle) == 64 and m.device_id == FakeIpcBackend.pci_bus_id
        # the content fingerprint of the GGUF bytes the buffer was filled from
        assert m.fingerprint == sw.tensor_fingerprint(t) and m.fingerprint.startswith(sw.FINGERPRINT_SCHEME + ":")
        # the target computes with the exported tensors themselves (no second copy on its side either)
        assert FakeIpcBackend.registry[bytes(m.ipc_mem_handle)] is t
    assert got[sw.EMBD].ipc_mem_handle != got[sw.OUTPUT].ipc_mem_handle  # condgen does not tie them


def test_drafter_maps_the_targets_tensors(hstack):
    d, own = hstack.shared, hstack.own
    tm = hstack.tservicer.model
    assert d.head_sharing.shared and d.head_sharing.reason == "" and d.head_sharing.mode == "auto"
    assert d.model.token_embd is tm.token_embd and d.model.lm_head is tm.output  # mapped, not copied
    assert not own.head_sharing.shared and "off" in own.head_sharing.reason
    assert own.model.token_embd is not tm.token_embd
    np.testing.assert_array_equal(d.model.token_embd.numpy(), own.model.token_embd.numpy())
    np.testing.assert_array_equal(d.model.lm_head.numpy(), own.model.lm_head.numpy())


def test_proposals_equal_the_own_copy_drafter(hstack, reference):
    prompt = PROMPTS[2]
    ref, feats = reference(prompt, 4)
    n = len(prompt) + 2
    outs = []
    for d in (hstack.shared, hstack.own):
        seq = d.model.new_sequence(64)
        seq.ingest(feats[:n], 0)
        outs.append(seq.propose(ref[2], n, topk=3, return_logits=True))
    a, b = outs
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)


@pytest.mark.parametrize("tree", [False, True])
def test_served_output_equals_own_copy_and_plain_greedy(hstack, reference, tree):
    spec = dict(draft_mode=gpb.DRAFT_MODE_TREE, tree_budget=6) if tree else {}
    for prompt in PROMPTS:
        want, _ = reference(prompt, MAX_TOKENS)
        got = {}
        for name, (stub, _) in hstack.stubs.items():
            sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, **spec)
            chunks, done = generate(stub, token_request(prompt, MAX_TOKENS, ignore_eos=True, speculation=sp))
            got[name] = streamed_ids(chunks)
            assert list(done.output_ids) == got[name]
        assert got["shared"] == got["own"] == want


def test_memory_report_counts_the_shared_tensors_once(hstack):
    tm = hstack.tservicer.model
    head = tm.token_embd.nbytes + tm.output.nbytes
    shared = _drafter_info(hstack.stubs["shared"][1]).memory
    own = _drafter_info(hstack.stubs["own"][1]).memory
    assert shared.target_head == "shared" and shared.shared_head_bytes == head and shared.target_head_bytes == 0
    assert own.target_head == "own" and own.target_head_bytes == head and own.shared_head_bytes == 0
    assert shared.weight_bytes == own.weight_bytes  # the drafter's own tensors: the same either way
    # the target counts them in its weights (once, for both processes)
    assert _target_info(hstack).memory.weight_bytes >= head
    for name, (own_b, shared_b) in (("shared", (0, head)), ("own", (head, 0))):  # the public GetModelInfo
        mi = hstack.stubs[name][0].GetModelInfo(gpb.GetModelInfoRequest(), timeout=10)
        assert (mi.drafter_target_head_bytes, mi.drafter_shared_head_bytes) == (own_b, shared_b), name
    from specd.target_worker.memory import drafter_memory

    lines = "\n".join(drafter_memory(hstack.shared.model, hstack.shared.head_sharing).lines())
    assert "shared (mapped from the target worker" in lines
    assert "own copy" in "\n".join(drafter_memory(hstack.own.model, hstack.own.head_sharing).lines())


def test_config_path_shares_through_make_drafter(hstack, target_gguf, caplog):
    cfg = dserver.DraftWorkerConfig(drafter=hstack.drafter_path, target=target_gguf, device="cpu",
                                    target_worker=f"unix://{hstack.dir}/t.sock")
    cfg.validate()
    with caplog.at_level(logging.INFO):
        d = dserver.make_drafter(cfg)
    try:
        assert d.head_sharing.shared
        assert "mapped from the target worker" in caplog.text
    finally:
        d.close()


# ---------------------------------------------------------------------- refusals: an own copy, logged

def _infos(stack):
    return [sw.SharedTensorInfo.from_proto(m) for m in _target_info(stack).shared_tensors]


def _refused(stack, target_gguf, caplog, words, **kw):
    kw.setdefault("target_worker", f"unix://{stack.dir}/t.sock")
    kw.setdefault("device", "cpu")
    with caplog.at_level(logging.INFO, logger="specd.target_worker.shared_weights"):
        d = open_model_drafter(stack.drafter_path, target_gguf, **kw)
    assert not d.head_sharing.shared and d.shared_head is None
    assert d.model.token_embd is not stack.tservicer.model.token_embd
    for w in words:
        assert w in d.head_sharing.reason, d.head_sharing.reason
        assert w in caplog.text
    assert "loading its own copy" in caplog.text
    mem = dserver.DraftServicer(d).memory()
    assert mem.target_head == "own" and mem.target_head_bytes > 0 and mem.shared_head_bytes == 0
    return d


def test_refused_when_sharing_is_off(hstack, target_gguf, caplog):
    _refused(hstack, target_gguf, caplog, ["--share-target-weights off"], share_target_weights="off")


def test_refused_on_the_cpu_device(hstack, target_gguf, caplog):
    # the native backend exports / maps GPU memory only: a CPU drafter keeps its own copy
    _refused(hstack, target_gguf, caplog, ["CPU"], ipc_backend=NativeIpcBackend())


def test_refused_for_another_gpu(hstack, target_gguf, caplog):
    _refused(hstack, target_gguf, caplog, ["0000:9a:00.0", FakeIpcBackend.pci_bus_id, "peer link"],
             ipc_backend=OtherGpu())


def test_refused_on_a_size_mismatch(hstack, target_gguf, caplog):
    """Consistent handle data that describes another file's tensor (other shape / size)."""
    infos = _infos(hstack)
    e = infos[0]
    other = dataclasses.replace(e, shape=(e.shape[0], e.shape[1] // 2), nbytes=e.nbytes // 2)
    _refused(hstack, target_gguf, caplog, [e.name, "differs from", target_gguf],
             shared_infos=[other] + infos[1:])


def _changed_copy(src, dst, name=sw.EMBD):
    """A copy of the GGUF ``src`` at ``dst`` whose tensor ``name`` has one byte changed (the first: the
    low mantissa byte of an F32 element, a block's scale otherwise): the same shapes, other content."""
    from gguf import GGUFReader

    shutil.copyfile(src, dst)
    off = next(t.data_offset for t in GGUFReader(str(src)).tensors if t.name == name)
    with open(dst, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    return str(dst)


def test_refused_on_a_content_mismatch(hstack, target_gguf, tmp_path, caplog):
    """A drafter given another target GGUF with the same shapes (one byte of token_embd changed): the
    target worker's published fingerprint differs from the file's, so it keeps its own copy and the
    warning names the tensor and both fingerprints."""
    other = _changed_copy(target_gguf, tmp_path / "other-target.gguf")
    theirs = {i.name: i.fingerprint for i in _infos(hstack)}
    mine = sw.tensor_fingerprint(load_qwen35(other).token_embd)
    assert mine != theirs[sw.EMBD]
    d = _refused(hstack, other, caplog, [sw.EMBD, "content differs from", other, theirs[sw.EMBD], mine])
    assert d.model.token_embd.numpy().tobytes() != hstack.tservicer.model.token_embd.numpy().tobytes()
    assert any(r.levelno == logging.WARNING and "content differs" in r.getMessage() for r in caplog.records)


def test_refused_without_a_fingerprint_or_with_another_scheme(hstack, target_gguf, caplog):
    """A target worker older than the fingerprint publishes none (the proto field unset): refused, not
    an error (the own copy is always correct); so is a fingerprint of a scheme this drafter does not
    compute (it cannot equal the file's)."""
    infos = _infos(hstack)
    old = [wpb.SharedTensor(name=i.name, ggml_type=i.ggml_type, shape=list(i.shape), nbytes=i.nbytes,
                            ipc_mem_handle=i.handle, device_id=i.device_id, owner_id=i.owner_id) for i in infos]
    assert [sw.SharedTensorInfo.from_proto(m).fingerprint for m in old] == ["", ""]
    _refused(hstack, target_gguf, caplog, ["no content fingerprint for token_embd.weight", "older", target_gguf],
             shared_infos=old)
    caplog.clear()
    no_out = [infos[0], dataclasses.replace(infos[1], fingerprint="")]
    _refused(hstack, target_gguf, caplog, ["no content fingerprint for output.weight"], shared_infos=no_out)
    caplog.clear()
    newer = [dataclasses.replace(i, fingerprint="sha3s128:" + "ab" * 16) for i in infos]
    _refused(hstack, target_gguf, caplog, [sw.EMBD, "scheme 'sha3s128'", "different versions"], shared_infos=newer)
    caplog.clear()
    garbled = [dataclasses.replace(infos[0], fingerprint="\x00not-a-fingerprint"), infos[1]]
    _refused(hstack, target_gguf, caplog, [sw.EMBD, "cannot check its content"], shared_infos=garbled)


def test_fingerprint_survives_the_proto_round_trip(hstack):
    for i in _infos(hstack):
        assert i.fingerprint and sw.SharedTensorInfo.from_proto(i.to_proto(wpb)) == i


def test_refused_when_the_runtime_refuses_a_handle(hstack, target_gguf, caplog):
    _refused(hstack, target_gguf, caplog, ["refused", "invalid resource handle"], ipc_backend=Refusing())


def test_refused_without_a_target_worker(hstack, target_gguf, caplog):
    _refused(hstack, target_gguf, caplog, ["--target-worker"], target_worker="")
    _refused(hstack, target_gguf, caplog, ["did not answer Info"], target_worker=f"unix://{hstack.dir}/nobody.sock")


def test_refused_when_the_target_published_nothing(hstack, target_gguf, caplog):
    _refused(hstack, target_gguf, caplog, ["published no shared tensors"], shared_infos=[])
    only = [i for i in _infos(hstack) if i.name == sw.EMBD]
    _refused(hstack, target_gguf, caplog, ["did not publish output.weight"], shared_infos=only)


# ---------------------------------------------------------------------- malformed handle data: an error

@pytest.mark.parametrize("change, words", [
    (dict(handle=b"\x01" * 10), ["10 bytes", "expected 64"]),
    (dict(ggml_type=99), ["unknown ggml type id 99"]),
    (dict(ggml_type=2**40), ["out of range"]),
    (dict(shape=(2**62, 2**62)), ["[rows, cols]"]),
    (dict(shape=(320,)), ["[rows, cols]"]),
    (dict(nbytes=12345), ["12345 bytes declared"]),
])
def test_bad_handle_data_is_an_error_naming_the_tensor(hstack, target_gguf, change, words):
    infos = _infos(hstack)
    bad = [infos[0], dataclasses.replace(infos[1], **change)]
    with pytest.raises(ValueError) as e:
        open_model_drafter(hstack.drafter_path, target_gguf, device="cpu", shared_infos=bad)
    msg = str(e.value)
    assert "'output.weight'" in msg, msg
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------------- lifetime, tied heads, export failure

def test_close_drops_the_mapping(hstack, target_gguf):
    d = open_model_drafter(hstack.drafter_path, target_gguf, device="cpu", shared_infos=_infos(hstack))
    assert d.head_sharing.shared
    d.open("s", 16)
    FakeIpcBackend.log.clear()
    d.close()
    assert ("sync", None) in FakeIpcBackend.log  # the queued work drained before the mapping closes
    assert d.shared_head is None and d.model.token_embd is None and d.model.lm_head is None and d.live() == []
    d.close()  # idempotent
    # the target's tensors are untouched: the worker keeps serving
    assert hstack.tservicer.model.token_embd is not None


def test_tied_head_is_exported_and_mapped_once():
    rng = np.random.default_rng(1)
    embd = sn.Tensor(rng.standard_normal((64, 32)).astype(np.float32))
    weights = types.SimpleNamespace(token_embd=embd, output=None)
    backend = FakeIpcBackend()
    exp = sw.HeadExporter(backend)
    a = exp.place(sw.EMBD, embd)
    b = exp.place(sw.OUTPUT, embd)
    assert a is b and len(exp.tensors) == 1
    assert [i.name for i in exp.infos] == [sw.EMBD, sw.OUTPUT] and exp.infos[0].handle == exp.infos[1].handle
    assert exp.infos[0].fingerprint == exp.infos[1].fingerprint == sw.tensor_fingerprint(embd)
    FakeIpcBackend.log.clear()
    head, reason = sw.open_shared_head(exp.infos, weights, "t.gguf", backend)
    assert reason == "" and head.token_embd is head.output is a
    assert head.nbytes == embd.nbytes  # counted once
    assert [k for k, _ in FakeIpcBackend.log].count("open_tensor") == 1
    handle = exp.infos[0].handle
    exp.close()
    assert exp.infos == [] and exp.tensors == [] and handle not in FakeIpcBackend.registry


def test_export_failure_keeps_the_target_working(target_gguf, caplog):
    class NoIpc(FakeIpcBackend):
        def export_tensor(self, t, tiled=False):
            raise RuntimeError("fake IPC: cudaMalloc of 163840 bytes (IPC buffer): out of memory")

    from specd.target_worker.model import Qwen35Model

    w = load_qwen35(target_gguf)
    exp = sw.HeadExporter(NoIpc())
    with caplog.at_level(logging.WARNING):
        m = Qwen35Model(w, capture_layers=(0, 2), kv_dtype=sn.DType.F32, head_exporter=exp)
    assert exp.infos == [] and m.token_embd is w.token_embd
    assert "cannot export token_embd / output" in caplog.text and "out of memory" in caplog.text
    st = m.new_sequence(8)
    assert np.isfinite(m.prefill(st, [1, 2, 3])).all()


def test_share_option_validation_and_flags(target_gguf):
    with pytest.raises(ValueError, match="--share-target-weights must be one of auto, off"):
        dserver.DraftWorkerConfig(drafter="d.gguf", target=target_gguf, share_target_weights="on").validate()
    with pytest.raises(ValueError, match="--share-target-weights"):
        open_model_drafter("d.gguf", target_gguf, share_target_weights="yes")
    from specd.coordinator import launcher
    from specd.coordinator.cli import build_parser

    with pytest.raises(ValueError, match="--share-target-weights"):
        launcher.ServeConfig(target=target_gguf, drafter_gguf="none", share_target_weights="x").validate()
    assert dserver.DraftWorkerConfig().share_target_weights == "auto" == launcher.ServeConfig().share_target_weights
    args = build_parser().parse_args(["draft-worker", "--drafter", "d.gguf", "--target", "t.gguf",
                                      "--share-target-weights", "off", "--target-worker", "unix:///x.sock"])
    assert args.share_target_weights == "off" and args.target_worker == "unix:///x.sock"
    args = build_parser().parse_args(["serve", "--share-target-weights", "off"])
    assert args.share_target_weights == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--share-target-weights", "maybe"])


def test_serve_forwards_the_option_and_the_target_socket(hstack, target_gguf, serve_children):
    for mode in ("auto", "off"):
        extra = [] if mode == "auto" else ["--share-target-weights", "off"]
        t, d = serve_children(["--target", target_gguf, "--drafter", hstack.drafter_path, "--device", "cpu",
                               "--runtime-dir", hstack.dir + "/rt", *extra])
        tsock = t[t.index("--listen") + 1]
        assert d[d.index("--share-target-weights") + 1] == mode and d[d.index("--target-worker") + 1] == tsock
        # the target exports its head only for a drafter that may map it (the mapping is writable)
        assert ("--export-head" if mode == "auto" else "--no-export-head") in t


def test_target_close_unpublishes_and_unregisters(target_gguf, monkeypatch):
    from specd.target_worker import server as tserver

    monkeypatch.setattr(fci, "NativeIpcBackend", FakeIpcBackend)
    cfg = tserver.TargetWorkerConfig(target=target_gguf, listen="unix:///unused", capture_layers=(0, 2),
                                     max_seq_len=32, kv_dtype="f32", device="cpu")
    svc = tserver.load_servicer(cfg)
    handles = {i.handle for i in svc.model.head_exporter.infos}
    assert len(handles) == 2 and handles <= set(FakeIpcBackend.registry)
    assert len(svc._shared_tensors()) == 2
    svc.close()
    assert not handles & set(FakeIpcBackend.registry) and svc._shared_tensors() == []
    assert svc.model.token_embd is not None  # the model keeps its tensors


def test_tensor_nbytes_matches_the_native_sizes():
    for dt in (sn.DType.F32, sn.DType.F16, sn.DType.BF16, sn.DType.Q8_0, sn.DType.Q4_K, sn.DType.Q5_K,
               sn.DType.Q6_K, sn.DType.IQ4_XS):
        assert sw.tensor_nbytes((3, 512), dt) == sn.Tensor.empty([3, 512], dt, sn.Device.CPU).nbytes, dt
    assert sw.tensor_nbytes((3, 100), sn.DType.Q8_0) is None  # not whole blocks



def test_refused_for_another_host(hstack, target_gguf, caplog):
    """PCI bus ids repeat across identical servers: a handle exported on another machine (owner_id's
    host and boot id differ) is refused before the runtime sees it."""
    infos = [dataclasses.replace(i, owner_id="elsewhere:0000-boot:42") for i in _infos(hstack)]
    _refused(hstack, target_gguf, caplog, ["elsewhere:0000-boot", "one machine"], shared_infos=infos)


def test_unknown_names_are_ignored_and_duplicates_are_an_error(hstack, target_gguf):
    infos = _infos(hstack)
    extra = dataclasses.replace(infos[0], name="rope_freqs.weight", ggml_type=2**20)  # a newer target's export
    d = open_model_drafter(hstack.drafter_path, target_gguf, device="cpu", shared_infos=infos + [extra])
    assert d.head_sharing.shared
    d.close()
    with pytest.raises(ValueError, match="'token_embd.weight': published twice"):
        open_model_drafter(hstack.drafter_path, target_gguf, device="cpu", shared_infos=infos + [infos[0]])


def test_a_handle_shared_by_both_tensors_must_describe_one_tied_tensor():
    """The output published with token_embd's handle but another type is malformed; a target that ties
    them while the drafter's file has its own output is refused (the drafter would use the embedding
    as its lm_head)."""
    rng = np.random.default_rng(2)
    embd = sn.Tensor(rng.standard_normal((64, 32)).astype(np.float32))
    backend = FakeIpcBackend()
    exp = sw.HeadExporter(backend)
    exp.place(sw.EMBD, embd)
    exp.place(sw.OUTPUT, embd)
    tied = types.SimpleNamespace(token_embd=embd, output=None)
    bad = [exp.infos[0], dataclasses.replace(exp.infos[1], ggml_type=int(sn.DType.F16), nbytes=embd.nbytes // 2)]
    with pytest.raises(ValueError, match="same IPC handle as 'token_embd.weight'"):
        sw.open_shared_head(bad, tied, "t.gguf", backend)
    untied = types.SimpleNamespace(token_embd=embd, output=sn.Tensor(rng.standard_normal((64, 32)).astype(np.float32)))
    head, reason = sw.open_shared_head(exp.infos, untied, "t.gguf", backend)
    assert head is None and "ties output.weight" in reason and "t.gguf has its own" in reason
    exp.close()


def test_exporter_keeps_sources_alive_so_ids_stay_unique():
    """Two temporary source tensors must not share an id (the second would get the first's export)."""
    rng = np.random.default_rng(3)
    exp = sw.HeadExporter(FakeIpcBackend())
    exp.place(sw.EMBD, sn.Tensor(rng.standard_normal((8, 32)).astype(np.float32)))
    exp.place(sw.OUTPUT, sn.Tensor(rng.standard_normal((8, 32)).astype(np.float32)))
    assert exp.infos[0].handle != exp.infos[1].handle and len(exp.tensors) == 2
    exp.close()


def test_target_watch_reports_a_restarted_or_vanished_target():
    """TargetWatch: the same exporter -> nothing; another owner -> on_lost at once; Info failing
    `misses` times in a row -> on_lost; then the watch ends."""
    import threading

    owner = f"{sw.host_id()}:111"
    published = [sw.SharedTensorInfo(sw.EMBD, int(sn.DType.F32), (8, 32), 1024, b"\x00" * 64, "bus", owner)]
    state = {"infos": published, "raise": False, "calls": 0}

    def fetch(address, timeout_s):
        state["calls"] += 1
        if state["raise"]:
            raise RuntimeError("connection refused")
        return state["infos"]

    lost, done = [], threading.Event()
    watch = sw.TargetWatch("unix:///x", owner, 0.01, lambda r: (lost.append(r), done.set()), fetch=fetch)
    assert watch.check() == ""
    state["infos"] = [dataclasses.replace(published[0], owner_id=f"{sw.host_id()}:222")]
    watch.start()
    assert done.wait(5) and "no longer exports" in lost[0] and ":111" in lost[0]
    watch.close()
    lost.clear(), done.clear()
    state.update(infos=published, **{"raise": True})
    watch = sw.TargetWatch("unix:///x", owner, 0.01, lambda r: (lost.append(r), done.set()), fetch=fetch, misses=3)
    watch.start()
    assert done.wait(5) and "did not answer Info 3 times" in lost[0]
    watch.close()


def test_drafter_refuses_propose_once_the_target_is_lost(hstack):
    """DraftServicer.target_lost: Propose is refused with FAILED_PRECONDITION naming the reason, and
    the health service reports NOT_SERVING."""
    from grpc_health.v1 import health, health_pb2

    sv = dserver.DraftServicer(hstack.drafter)
    sv.health = health.HealthServicer()
    sv.target_lost("the target worker at unix:///t no longer exports the mapped tensors")

    class Ctx:
        def abort(self, code, details):
            raise RuntimeError((code, details))

    with pytest.raises(RuntimeError) as e:
        sv._propose(wpb.ProposeRequest(seq_id="s"), Ctx())
    code, details = e.value.args[0]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no longer exports" in details and "restarted" in details
    r = sv.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_target_export_head_off_publishes_nothing(target_gguf, monkeypatch):
    """--no-export-head: the target worker keeps token_embd / output private (nothing in Info)."""
    from specd.target_worker import server as tserver

    import argparse

    p = argparse.ArgumentParser()
    tserver.add_arguments(p)
    assert p.parse_args(["--target", target_gguf]).export_head is True
    assert p.parse_args(["--target", target_gguf, "--no-export-head"]).export_head is False
    monkeypatch.setattr(sw, "make_backend", FakeIpcBackend)
    for export, published in ((False, 0), (True, 2)):
        cfg = tserver.TargetWorkerConfig(target=target_gguf, device="cpu", kv_dtype="f32", export_head=export)
        svc = tserver.load_servicer(cfg)
        try:
            assert len(svc.Info(wpb.InfoRequest(), None).shared_tensors) == published
        finally:
            svc.close()


# ---------------------------------------------------------------------- the content fingerprint


def _reference_fingerprint(t) -> str:
    """tensor_fingerprint's documented definition, written out independently."""
    raw = np.ascontiguousarray(t.numpy()).tobytes()
    h = hashlib.sha256(struct.pack("<IQQQ", int(t.dtype), *(int(d) for d in t.shape), len(raw)))
    h.update(raw)
    return "sha256:" + h.hexdigest()


def test_fingerprint_definition_and_any_changed_byte():
    rng = np.random.default_rng(4)
    big = rng.standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
    fp = sw.tensor_fingerprint(sn.Tensor(big))
    assert fp == _reference_fingerprint(sn.Tensor(big)) and len(fp) == len("sha256:") + 64
    flat = big.reshape(-1)
    for i in (0, 12345, flat.size // 2 + 3, flat.size - 1):  # any element, anywhere: detected
        changed = flat.copy()
        changed[i] = np.nextafter(changed[i], np.inf)
        assert sw.tensor_fingerprint(sn.Tensor(changed.reshape(big.shape))) != fp, i
    # type and shape are part of it: the same bytes as another shape or type differ
    assert sw.tensor_fingerprint(sn.Tensor(big.reshape(512, 1024))) != fp
    as_f16 = sn.Tensor(big.view(np.float16).reshape(1024, 1024))
    assert sw.tensor_fingerprint(as_f16) != fp
    q = sn.Tensor.zeros([3, 512], sn.DType.Q8_0)  # a block type: its raw stored bytes
    assert sw.tensor_fingerprint(q) == _reference_fingerprint(q)


def _exported_pair(rng):
    embd = rng.standard_normal((64, 32)).astype(np.float32)
    out = rng.standard_normal((64, 32)).astype(np.float32)
    backend = FakeIpcBackend()
    exp = sw.HeadExporter(backend)
    exp.place(sw.EMBD, sn.Tensor(embd))
    exp.place(sw.OUTPUT, sn.Tensor(out))
    return exp, backend, types.SimpleNamespace(token_embd=sn.Tensor(embd.copy()), output=sn.Tensor(out.copy()))


def test_open_shared_head_falls_back_when_the_fingerprint_fails(monkeypatch):
    """A fingerprint that cannot be computed (an I/O error reading the mapping) falls back to the own
    copy with the reason instead of failing the drafter's start-up."""
    exp, backend, same = _exported_pair(np.random.default_rng(6))

    def broken(t):
        raise OSError("I/O error")

    monkeypatch.setattr(sw, "tensor_fingerprint", broken)
    head, reason = sw.open_shared_head(exp.infos, same, "t.gguf", backend)
    assert head is None and "cannot fingerprint token_embd.weight of t.gguf: OSError: I/O error" in reason
    exp.close()


def test_open_shared_head_refuses_other_content_with_the_same_shapes():
    """The exporter's source and the drafter's file: same type and shape, one value different."""
    exp, backend, same = _exported_pair(np.random.default_rng(5))
    head, reason = sw.open_shared_head(exp.infos, same, "t.gguf", backend)
    assert reason == "" and head is not None
    changed = same.output.numpy().copy()
    changed[7, 3] = -changed[7, 3]
    other = types.SimpleNamespace(token_embd=same.token_embd, output=sn.Tensor(changed))
    FakeIpcBackend.log.clear()
    head, reason = sw.open_shared_head(exp.infos, other, "t.gguf", backend)
    assert head is None and "output.weight content differs from t.gguf" in reason
    assert exp.infos[1].fingerprint in reason and sw.tensor_fingerprint(other.output) in reason
    assert not [k for k, _ in FakeIpcBackend.log if k == "open_tensor"]  # refused before mapping anything
    exp.close()


def test_tiled_output_is_published_and_mapped_in_its_tiled_layout(monkeypatch):
    """A CUDA target exports an untied output in the GEMV's tiled layout (HeadExporter.place(tiled=True)): the
    info, named output.weight:gemv_tiles (a drafter that does not know the layout skips it), carries the tiled
    type's id with the row-major source's shape, size and fingerprint, the buffer holds the numpy reference
    packer's bytes; the drafter checks it against its own row-major tensor (sn.untiled) and maps the tiled
    tensor; a build whose matmul cannot read the layout refuses it with the reason; a tiled type under another
    name, a row-major one under the tiled name or rows that are not whole tiles are malformed handle data."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "native"))
    from quant_blocks import random_blocks

    rng = np.random.default_rng(7)
    embd = rng.standard_normal((32, 256)).astype(np.float32)
    raw = np.ascontiguousarray(random_blocks(rng, "Q5_K", 32, 256))
    backend = FakeIpcBackend()
    exp = sw.HeadExporter(backend)
    exp.place(sw.EMBD, sn.Tensor(embd))
    source = sn.Tensor(raw, sn.DType.Q5_K)
    placed = exp.place(sw.OUTPUT, source, tiled=True)
    info = exp.infos[1]
    assert placed.dtype == sn.DType.Q5_K_TILED and info.ggml_type == int(sn.DType.Q5_K_TILED) == 0x1000D
    assert [i.name for i in exp.infos] == [sw.EMBD, "output.weight:gemv_tiles"]
    assert (info.shape, info.nbytes, info.fingerprint) == ((32, 256), source.nbytes, sw.tensor_fingerprint(source))
    assert sw.SharedTensorInfo.from_proto(info.to_proto(wpb)).check() == sn.DType.Q5_K_TILED
    assert not np.array_equal(placed.numpy().reshape(-1), raw.reshape(-1))  # regrouped, the same bytes
    assert sorted(placed.numpy().reshape(-1).tolist()) == sorted(raw.reshape(-1).tolist())
    mine = types.SimpleNamespace(token_embd=sn.Tensor(embd.copy()), output=sn.Tensor(raw.copy(), sn.DType.Q5_K))
    monkeypatch.setattr(sn, "gemv_tiles_supported", lambda: True)
    head, reason = sw.open_shared_head(exp.infos, mine, "t.gguf", backend)
    assert reason == "" and head.output is placed
    monkeypatch.setattr(sn, "gemv_tiles_supported", lambda: False)
    head, reason = sw.open_shared_head(exp.infos, mine, "t.gguf", backend)
    assert head is None and "output.weight as Q5_K_TILED" in reason and "cannot read" in reason
    other = types.SimpleNamespace(token_embd=mine.token_embd, output=sn.Tensor(raw[:16].copy(), sn.DType.Q5_K))
    monkeypatch.setattr(sn, "gemv_tiles_supported", lambda: True)
    head, reason = sw.open_shared_head(exp.infos, other, "t.gguf", backend)
    assert head is None and "exports Q5_K_TILED [32, 256]" in reason and "holds Q5_K [16, 256]" in reason
    for bad, match in ((dataclasses.replace(info, name=sw.OUTPUT), "only 'output.weight:gemv_tiles' carries"),
                       (dataclasses.replace(exp.infos[0], name=sw.OUTPUT_TILED), "only 'output.weight:gemv_tiles'"),
                       (dataclasses.replace(info, shape=(24, 256), nbytes=24 * 176), "whole 16-row tiles, got 24")):
        with pytest.raises(ValueError, match=match):
            bad.check()
    for name, tiled in ((sw.EMBD, True), (sw.OUTPUT_TILED, False)):
        with pytest.raises(ValueError, match="only output.weight in the GEMV's tiled layout"):
            exp.place(name, source, tiled=tiled)
    plain = dataclasses.replace(info, name=sw.OUTPUT, ggml_type=int(sn.DType.Q5_K))  # the output under both names
    for infos in ([exp.infos[0], plain, info], [exp.infos[0], info, plain]):
        with pytest.raises(ValueError, match=r"'output.weight': published twice \(as 'output.weight"):
            sw.open_shared_head(infos, mine, "t.gguf", backend)
    exp.close()
