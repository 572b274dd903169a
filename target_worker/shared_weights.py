"""The target's token embedding and lm_head shared with the drafter worker on the same GPU (CUDA / HIP IPC).

The drafter reuses the target's ``token_embd.weight`` and ``output.weight`` (drafters.md §3). Without
sharing, the drafter worker loads its own copy from the target GGUF: for a 27B target that is a second
~1.6 GB of device memory next to the target worker's. With sharing, the target worker places the two
tensors in exportable device memory and publishes their IPC handles; a drafter worker on the same GPU
maps them instead of loading them.

Target side (no flag: exporting is free). A target worker whose model runs on the GPU places
``token_embd`` and ``output`` (once when the GGUF ties them) with :class:`HeadExporter`: each is a
``sn.gpu_ipc_export`` buffer (plain cudaMalloc, not the stream-ordered pool: IPC handles need it) of
the tensor's stored type and shape, filled from the GGUF, exported with ``cudaIpcGetMemHandle`` and
used by the target's own forward (no second copy in the target either). An untied output of a type the CUDA
GEMV tiles (IQ4_XS, Q4_K, Q5_K, Q6_K: ``sn.tile_for_gemv``) is exported in that tiled layout when the model
tiles its weights (``gemv_tiles``), published as :data:`OUTPUT_TILED`: the target's GEMV reads it faster than
the row-major bytes (the 27B's Q5_K head: 319 -> 217 us a decode step on the H200, BENCHMARKS.md), and the drafter's matmul
reads it too; a drafter of an older version skips that name and loads its own copy. ``TargetInfo.shared_tensors``
publishes per tensor (worker.proto SharedTensor, :class:`SharedTensorInfo`): the GGUF name (OUTPUT_TILED for
the tiled output), the
ggml type id, the shape ``[n_vocab, n_embd]``, the byte size, the 64-byte handle, the exporting
GPU's PCI bus id (``device_id``) and a content fingerprint of the GGUF bytes it was filled from
(:func:`tensor_fingerprint`, computed once at load). The buffers are model weights: alive for the target worker's life,
so they outlive every mapping (``specd serve`` stops the drafter worker before the target worker);
a standalone drafter watches its target (:class:`TargetWatch`) and stops proposing when the exporting
process is gone. An export failure
(e.g. a runtime without IPC) is logged and the tensors are placed as usual, with nothing published.

Drafter side (``--share-target-weights {auto,off}``, default auto, with ``--target-worker ADDR``, which
``specd serve`` passes): at start-up the drafter worker asks the target worker's Info for
``shared_tensors`` and :func:`open_shared_head` maps them (``sn.gpu_ipc_open``) as device tensors of
the published type and shape, which :class:`~specd.draft_worker.model.DrafterModel` takes as they
are. It falls back to loading its own copy, logging why (:class:`HeadSharing` ``reason``), when: the
mode is off; the drafter is not on the GPU; no target worker address is known or its Info fails; the
target published nothing; the exporter runs on another machine (:func:`host_id` in ``owner_id``); the
target ties output to token_embd but the drafter's GGUF does not; the target's GPU is another one (``device_id``: the runtime would map it
over the peer link, every embedding gather and lm_head matmul a remote read); a tensor's type, shape
or size differs from the target GGUF the drafter was given (another file; a tiled layout counts as its
row-major type); a tensor comes in a tiled layout this build's matmul cannot read (a HIP build); a tensor's content
fingerprint (:func:`tensor_fingerprint`: sha256 over type, shape, length and every stored byte, computed by the exporter from the GGUF it loaded and by the drafter from
its own view of the target GGUF) differs (another file with the same shapes), is missing (a target
worker older than the fingerprint: refused, since the content cannot be vouched for) or is of another
scheme; or the runtime refuses a handle. Malformed handle data (a handle not 64 bytes, an unknown
type id, a tiled layout's id under another name than :data:`OUTPUT_TILED` or a row-major type under it,
tiled rows that are not whole 16-row tiles, a shape that is not ``[rows, cols]`` > 0, a byte size that does
not match the shape and type, a tensor published twice, output.weight among them under both its names)
is a ValueError naming the tensor: the target worker never sends it, so something is wrong that
a fallback must not hide. A missing or unreadable fingerprint is not malformed handle data but a
refusal (the own copy is always correct; an older target worker is a version skew to report, not a
fault to stop on).

Lifetime on the drafter side: :meth:`SharedHead.close` (``ModelDrafter.close``, run by the drafter
worker's shutdown) drops the mapped tensors after the library stream drains; the last reference
closes the mapping (``cudaIpcCloseMemHandle``). Memory accounting: the target worker counts the two
tensors in its weights; the drafter reports them as ``shared_head_bytes`` (mapped), not in its own
``target_head_bytes`` (:func:`specd.target_worker.memory.drafter_memory`).

The GPU calls go through :class:`~.feature_cuda_ipc.NativeIpcBackend` (``export_tensor`` /
``open_tensor``: the same IPC layer as the cuda-ipc feature ring), so the whole negotiation runs in CPU
tests with a fake backend (tests/target/fake_ipc.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import struct
import threading

import specd.native as sn

from . import feature_cuda_ipc as fci

log = logging.getLogger(__name__)

SHARE_MODES = ("auto", "off")
DEFAULT_SHARE = "auto"
EMBD, OUTPUT = "token_embd.weight", "output.weight"
NAMES = (EMBD, OUTPUT)
# The name output.weight is published under when it is in the GPU GEMV's tiled layout (its ggml_type then the tiled
# layout's id, not a ggml type): a drafter that does not know the layout skips the name and loads its own copy.
OUTPUT_TILED = OUTPUT + ":gemv_tiles"
# tensor_fingerprint's scheme: sha256 over every stored byte (the tag starts every fingerprint)
FINGERPRINT_SCHEME = "sha256"


def check_share_mode(mode: str, who: str) -> str:
    """``mode`` if it is one of SHARE_MODES, else ValueError naming ``who``."""
    if mode not in SHARE_MODES:
        raise ValueError(f"{who}: --share-target-weights must be one of {', '.join(SHARE_MODES)}, got {mode!r}")
    return mode


def host_id() -> str:
    """"<hostname>:<boot id>" of this machine: two processes can share a GPU allocation only when this
    is the same (PCI bus ids repeat across identical servers)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def make_backend():
    """The IPC backend: :class:`.feature_cuda_ipc.NativeIpcBackend` (looked up at call time, so tests
    can replace it with their fake one)."""
    return fci.NativeIpcBackend()


@dataclasses.dataclass(frozen=True)
class SharedTensorInfo:
    """One exported weight (worker.proto SharedTensor).

    name: "token_embd.weight", "output.weight", or :data:`OUTPUT_TILED` ("output.weight:gemv_tiles": the
    output in its GPU GEMV tiled layout, ``sn.tile_for_gemv``'s regrouping of the same bytes, which a CUDA
    target worker exports for an untied output); ggml_type: the stored type's ggml id (``int(sn.DType)``),
    for OUTPUT_TILED the tiled layout's id; shape: (n_vocab, n_embd) as the sn.Tensor shape; nbytes: the buffer's bytes;
    handle: the 64-byte IPC memory handle; device_id: the exporting GPU's PCI bus id; owner_id:
    "<hostname>:<boot id>:<pid>" of the exporting process (:func:`host_id`); fingerprint: the
    :func:`tensor_fingerprint` of the source the exporter filled the buffer from ("" from a target
    worker older than the fingerprint: the drafter refuses to map it).
    """

    name: str
    ggml_type: int
    shape: tuple
    nbytes: int
    handle: bytes
    device_id: str
    owner_id: str = ""
    fingerprint: str = ""

    def to_proto(self, pb):
        return pb.SharedTensor(name=self.name, ggml_type=self.ggml_type, shape=list(self.shape), nbytes=self.nbytes,
                               ipc_mem_handle=self.handle, device_id=self.device_id, owner_id=self.owner_id,
                               fingerprint=self.fingerprint)

    @classmethod
    def from_proto(cls, m) -> "SharedTensorInfo":
        return cls(name=m.name, ggml_type=int(m.ggml_type), shape=tuple(int(s) for s in m.shape),
                   nbytes=int(m.nbytes), handle=bytes(m.ipc_mem_handle), device_id=m.device_id, owner_id=m.owner_id,
                   fingerprint=m.fingerprint)

    def check(self) -> "sn.DType":
        """The tensor's DType after checking the handle data's own consistency; ValueError naming the
        tensor on a handle that is not 64 bytes, an unknown type id, a tiled layout's id under another
        name than :data:`OUTPUT_TILED` (or that name with a row-major type), a tiled shape whose rows are
        not whole 16-row tiles, a shape that is not [rows, cols] with both > 0, or a byte size that does
        not match shape and type."""
        what = f"shared target tensor {self.name!r}"
        if len(self.handle) != fci.HANDLE_BYTES:
            raise ValueError(f"{what}: the IPC handle is {len(self.handle)} bytes, expected {fci.HANDLE_BYTES}")
        if not 0 <= self.ggml_type < 2**31:
            raise ValueError(f"{what}: ggml type id {self.ggml_type} out of range")
        dtype = _TILED_IDS.get(int(self.ggml_type))
        try:
            dtype = dtype if dtype is not None else sn.dtype_from_id(int(self.ggml_type))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{what}: unknown ggml type id {self.ggml_type}: {exc}") from None
        if (dtype != sn.untiled(dtype)) != (self.name == OUTPUT_TILED):
            raise ValueError(f"{what}: type {dtype.name}, but only {OUTPUT_TILED!r} carries (and always carries) "
                             "a GPU GEMV tiled layout")
        if len(self.shape) != 2 or not all(0 < d < 2**40 for d in self.shape):
            raise ValueError(f"{what}: shape must be [rows, cols], each in 1 .. 2^40, got {list(self.shape)}")
        if dtype != sn.untiled(dtype) and self.shape[0] % 16:
            raise ValueError(f"{what}: a {dtype.name} tensor has whole 16-row tiles, got {self.shape[0]} rows")
        want = tensor_nbytes(self.shape, dtype)
        if want is None or want != self.nbytes:
            raise ValueError(f"{what}: {self.nbytes} bytes declared, but {list(self.shape)} of "
                             f"{dtype.name} is {want if want is not None else 'not a whole number of blocks'}")
        if self.nbytes > fci.MAX_DEVICE_BYTES:
            raise ValueError(f"{what}: {self.nbytes} bytes exceed the {fci.MAX_DEVICE_BYTES}-byte limit of a mapping")
        return dtype


# The GPU GEMV's tiled layouts by id (not ggml types: sn.dtype_from_id refuses them).
_TILED_IDS = {int(d): d for d in sn.DType.__members__.values() if sn.untiled(d) != d}


def tensor_nbytes(shape, dtype: "sn.DType"):
    """Bytes of a contiguous tensor of ``shape`` / ``dtype`` (Python ints, no overflow; None when the
    last dimension is not a whole number of the type's blocks)."""
    rows, cols = (int(d) for d in shape)
    block = sn.block_size(dtype)
    if cols % block:
        return None
    return rows * (cols // block) * sn.type_size(dtype)


def _host_bytes(t) -> memoryview:
    """The stored bytes of ``t`` as one flat byte view: zero-copy for a contiguous CPU tensor (a GGUF
    view over the file's mapping); a device tensor is copied to the host first."""
    a = t.numpy()
    if not a.flags.c_contiguous:
        import numpy as np

        a = np.ascontiguousarray(a)
    return memoryview(a).cast("B")


def tensor_fingerprint(t) -> str:
    """The content fingerprint of ``t`` (an sn.Tensor, normally the target GGUF's mapped view of
    token_embd / output), as the exporter publishes it (SharedTensor.fingerprint) and the drafter
    recomputes it from its own view of the target GGUF before mapping.

    Definition (scheme ``sha256``): ``"sha256:" + sha256(header + bytes).hexdigest()`` with the
    header ``struct.pack("<IQQQ", ggml type id, rows, cols, n)`` and all n stored bytes of the
    tensor. Exact: any changed byte (an edited row, added tokens trained, another file with the same
    shapes) changes it. Cost: ~0.5 s per GB on one core (hashlib releases the GIL), once per tensor
    at start-up on each side (a 27B target's token_embd + output are ~1.6 GB); the drafter reads the
    pages of the same GGUF file the target worker has just read, so they come from the page cache."""
    rows, cols = (int(d) for d in t.shape)  # [n_vocab, n_embd]: the exported tensors are 2-D
    data = _host_bytes(t)
    h = hashlib.sha256()
    h.update(struct.pack("<IQQQ", int(t.dtype), rows, cols, len(data)))
    h.update(data)
    return f"{FINGERPRINT_SCHEME}:{h.hexdigest()}"


class HeadExporter:
    """Target side: places token_embd / output in exported device buffers and records their
    :class:`SharedTensorInfo` (``infos``). ``backend``: :func:`make_backend` by default."""

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else make_backend()
        self.infos: list[SharedTensorInfo] = []
        self.tensors: list = []  # the exported tensors: alive as long as the exporter (the worker)
        # (id(source), tiled) -> (source, exported tensor, handle, fingerprint): a tied output once
        self._done: dict = {}
        self.owner_id = f"{host_id()}:{os.getpid()}"

    def place(self, name: str, t, tiled: bool = False):
        """The exported device copy of ``t`` (an sn.Tensor [rows, cols] of any stored type, usually a
        GGUF view) for GGUF tensor ``name``, with ``tiled`` in the GPU GEMV's tiled layout of its type
        (``sn.tile_for_gemv``; only for OUTPUT, published as :data:`OUTPUT_TILED` with the tiled type's id;
        ValueError for another name); the same tensor again for the
        same source and layout (tied output: its info carries token_embd's handle). The published
        fingerprint (:func:`tensor_fingerprint`) is computed once per source, from ``t`` itself (the host
        copy / file mapping the buffer is filled from). Raises what the backend raises (RuntimeError on a
        device failure, ValueError where the tiling refuses ``t``)."""
        if name not in NAMES or (tiled and name != OUTPUT):
            raise ValueError(f"HeadExporter.place: {name!r} {'tiled' if tiled else ''}: the exported tensors are "
                             f"{', '.join(NAMES)}, only {OUTPUT} in the GEMV's tiled layout (published as {OUTPUT_TILED})")
        key = (id(t), bool(tiled))
        if key in self._done:
            _, placed, handle, fingerprint = self._done[key]
        else:
            fingerprint = tensor_fingerprint(t)
            placed, handle = self.backend.export_tensor(t, tiled=tiled)
            self._done[key] = (t, placed, handle, fingerprint)  # the source kept alive: its id stays unique
            self.tensors.append(placed)
        self.infos.append(SharedTensorInfo(name=OUTPUT_TILED if tiled else name, ggml_type=int(placed.dtype),
                                           shape=tuple(int(s) for s in t.shape), nbytes=int(t.nbytes),
                                           handle=bytes(handle),
                                           device_id=self.backend.device_id(), owner_id=self.owner_id,
                                           fingerprint=fingerprint))
        return placed

    def close(self) -> None:
        """Forgets every export: nothing is published any more, the backend's registration of the
        handles is dropped, and this object's references to the tensors too (whoever placed them, the
        model, keeps its own). Used after a failed export and at the worker's shutdown."""
        forget = getattr(self.backend, "forget", None)
        if forget is not None:
            forget(*(h for _, _, h, _ in self._done.values()))
        self.infos, self.tensors, self._done = [], [], {}


@dataclasses.dataclass
class HeadSharing:
    """How a drafter got the target's embedding / head: ``mode`` (SHARE_MODES), ``shared`` (mapped
    from the target worker), ``reason`` (why it loaded its own copy; "" when shared), ``nbytes``
    (bytes mapped: each distinct buffer once)."""

    mode: str
    shared: bool = False
    reason: str = ""
    nbytes: int = 0


class SharedHead:
    """Drafter side: the target's token_embd / output mapped from the target worker.

    ``token_embd``, ``output``: device sn.Tensors of the published type and shape [n_vocab, n_embd]
    (the same tensor when the target ties them); ``nbytes``: bytes mapped (each buffer once)."""

    def __init__(self, token_embd, output, nbytes: int, backend, owner_id: str = ""):
        self.token_embd, self.output, self.nbytes, self.backend = token_embd, output, nbytes, backend
        self.owner_id = owner_id  # the exporting process (TargetWatch checks it is still the one serving)

    def close(self) -> None:
        """Waits for queued work, then drops this object's references to the mapped tensors (the
        mapping is closed when the last reference, e.g. the model's, drops too). Idempotent."""
        if self.token_embd is None:
            return
        sync = getattr(self.backend, "synchronize", None)
        if sync is not None:
            try:
                sync()
            except Exception as exc:  # noqa: BLE001 - closing goes on
                log.warning("shared target weights: synchronising before closing the mapping failed: %s", exc)
        self.token_embd = self.output = None


def open_shared_head(infos, target_weights, target_path: str, backend=None):
    """Maps the target worker's exported token_embd / output (``infos``: SharedTensorInfo or worker.proto
    SharedTensor messages) after checking them against ``target_weights`` (the drafter's own view of
    the target GGUF ``target_path``: its tensors are what would be loaded otherwise).

    Returns (SharedHead, "") or (None, reason) when sharing is refused (not published, another GPU,
    a type / shape / size that differs from the GGUF, a content fingerprint that differs from the
    GGUF's (:func:`tensor_fingerprint` of ``target_weights``' tensor) or is missing (an older target
    worker) or of another scheme, the runtime refused a handle). The fingerprint is checked last,
    after the cheap checks, each distinct source tensor hashed once. Raises ValueError naming the
    tensor on malformed handle data (:meth:`SharedTensorInfo.check`); a missing or unreadable
    fingerprint is a refusal, not an error: it says nothing about the handle, only that the content
    cannot be vouched for, and the own copy is always correct."""
    backend = backend if backend is not None else make_backend()
    by_name = {}
    for i in infos:
        i = i if isinstance(i, SharedTensorInfo) else SharedTensorInfo.from_proto(i)
        name = OUTPUT if i.name == OUTPUT_TILED else i.name  # the output in the GEMV's tiled layout
        if name not in NAMES:
            continue  # a tensor a newer target publishes: not ours to check
        if name in by_name:
            raise ValueError(f"shared target tensor {name!r}: published twice (as {by_name[name][0].name!r} and "
                             f"{i.name!r})")
        by_name[name] = (i, i.check())
    if not by_name:
        return None, "the target worker published no shared tensors (target on the CPU, or its export failed)"
    own_out = target_weights.output if target_weights.output is not None else target_weights.token_embd
    want = {EMBD: target_weights.token_embd, OUTPUT: own_out}
    for name in NAMES:
        if name not in by_name:
            return None, f"the target worker did not publish {name}"
    e_info, o_info = by_name[EMBD][0], by_name[OUTPUT][0]
    if e_info.handle == o_info.handle:  # one buffer for both: the target ties them, so must the file
        if (e_info.ggml_type, e_info.shape, e_info.nbytes) != (o_info.ggml_type, o_info.shape, o_info.nbytes):
            raise ValueError(f"shared target tensor {o_info.name!r}: same IPC handle as {EMBD!r} but another type / "
                             "shape / size")
        if target_weights.output is not None and target_weights.output is not target_weights.token_embd:
            return None, (f"the target worker ties {OUTPUT} to {EMBD} (one buffer), but {target_path} has its own "
                          f"{OUTPUT}")
    mine, host = backend.device_id(), host_id()
    for name in NAMES:
        info, dtype = by_name[name]
        if info.owner_id.rsplit(":", 1)[0] != host:
            return None, (f"the target worker's {name} was exported on {info.owner_id.rsplit(':', 1)[0] or 'an unnamed host'}, "
                          f"this drafter runs on {host}: IPC handles only work on one machine")
        if info.device_id != mine:
            return None, (f"the target worker's {name} is on GPU {info.device_id or '?'}, this drafter on {mine}: "
                          "mapping it would read it over the peer link")
        t = want[name]
        if dtype != sn.untiled(dtype) and not sn.gemv_tiles_supported():
            return None, (f"the target worker exports {name} as {dtype.name} (the CUDA GEMV's tiled layout), which "
                          f"this build's matmul cannot read (a {sn.gpu_backend()} build)")
        own = (t.dtype, tuple(int(s) for s in t.shape), int(t.nbytes))
        if (sn.untiled(dtype), info.shape, info.nbytes) != own:
            return None, (f"{name} differs from {target_path}: the target worker exports {dtype.name} "
                          f"{list(info.shape)} ({info.nbytes} bytes), the file holds {own[0].name} {list(own[1])} "
                          f"({own[2]} bytes)")
    mine_fp: dict[int, str] = {}  # id(own tensor) -> its fingerprint (a tied file: hashed once)
    for name in NAMES:
        info, t = by_name[name][0], want[name]
        if not info.fingerprint:
            return None, (f"the target worker published no content fingerprint for {name} (a target worker older "
                          f"than this drafter): cannot check that it holds {target_path}'s {name}; restart the "
                          "target worker with this version to share")
        scheme = info.fingerprint.split(":", 1)[0]
        if scheme != FINGERPRINT_SCHEME:
            return None, (f"the target worker fingerprints {name} with scheme {scheme!r}, this drafter with "
                          f"{FINGERPRINT_SCHEME!r} (workers of different versions): cannot check its content")
        if id(t) not in mine_fp:
            try:
                mine_fp[id(t)] = tensor_fingerprint(t)
            except Exception as exc:  # noqa: BLE001 - the own copy is always correct: never fail start-up here
                return None, f"cannot fingerprint {name} of {target_path}: {type(exc).__name__}: {exc}"
        if info.fingerprint != mine_fp[id(t)]:
            return None, (f"{name} content differs from {target_path}: the target worker's fingerprint is "
                          f"{info.fingerprint!r}, the file's {mine_fp[id(t)]!r}: the drafter's --target is "
                          "not the GGUF the target worker serves (acceptance suffers either way)")
    opened: dict[bytes, object] = {}
    try:
        for name in NAMES:
            info, dtype = by_name[name]
            if info.handle not in opened:
                opened[info.handle] = backend.open_tensor(info.handle, info.shape, dtype, info.nbytes)
    except (RuntimeError, ValueError) as exc:
        opened.clear()
        return None, f"the runtime refused to map {name}: {exc}"
    e, o = (opened[by_name[n][0].handle] for n in NAMES)
    nbytes = sum(by_name[n][0].nbytes for n in NAMES if n == EMBD or by_name[n][0].handle != by_name[EMBD][0].handle)
    return SharedHead(e, o, nbytes, backend, e_info.owner_id), ""


def fetch_shared_infos(address: str, timeout_s: float = 30.0) -> list:
    """The target worker's ``TargetInfo.shared_tensors`` at ``address`` (a gRPC target). Raises
    grpc.RpcError when the target worker cannot be reached."""
    import grpc

    from specd.protos.v1 import worker_pb2 as pb
    from specd.protos.v1 import worker_pb2_grpc as pbg

    with grpc.insecure_channel(address) as ch:
        info = pbg.TargetWorkerStub(ch).Info(pb.InfoRequest(), timeout=timeout_s)
    return [SharedTensorInfo.from_proto(m) for m in info.shared_tensors]


def resolve_shared_head(mode: str, device, target_address: str, target_weights, target_path: str, backend=None,
                        infos=None):
    """The drafter worker's decision (module docstring): (SharedHead or None, HeadSharing). Every
    refusal is logged with its reason (the drafter then loads its own copy); malformed handle data
    raises ValueError naming the tensor. ``device``: the drafter's resolved device ("cpu" / "cuda" or
    an sn.Device); ``infos``: the published tensors when already known (else fetched from
    ``target_address``)."""
    check_share_mode(mode, "draft-worker")
    status = HeadSharing(mode=mode)

    def refuse(reason, expected=False):
        # An expected fallback (off, CPU, no address) is news; an unexpected one costs ~1.6 GB at 27B.
        status.reason = reason
        log.log(logging.INFO if expected else logging.WARNING,
                "draft-worker: loading its own copy of the target's token_embd / output: %s", reason)
        return None, status

    if mode == "off":
        return refuse("--share-target-weights off", expected=True)
    backend = backend if backend is not None else make_backend()
    dev = device if isinstance(device, sn.Device) else (sn.Device.CPU if str(device) == "cpu" else sn.Device.GPU)
    if dev != backend.device:
        return refuse(f"the drafter runs on {'the CPU' if dev == sn.Device.CPU else 'the GPU'}; sharing needs "
                      "both workers on one GPU", expected=True)
    if infos is None:
        if not target_address:
            return refuse("no --target-worker address to ask for the target's shared tensors", expected=True)
        try:
            infos = fetch_shared_infos(target_address)
        except Exception as exc:  # noqa: BLE001 - grpc.RpcError and friends: fall back
            detail = exc.details() if callable(getattr(exc, "details", None)) else exc
            return refuse(f"the target worker at {target_address} did not answer Info: {detail}")
    head, reason = open_shared_head(infos, target_weights, target_path, backend)
    if head is None:
        return refuse(reason)
    status.shared, status.nbytes = True, head.nbytes
    log.info("draft-worker: mapped the target worker's token_embd / output (%d bytes) instead of loading a copy",
             head.nbytes)
    return head, status


class TargetWatch:
    """Drafter side, while it maps the target's tensors: every ``interval_s`` asks the target worker at
    ``address`` for its Info and checks that the exporter of the published token_embd is still
    ``owner_id``. A target worker that restarted (another owner) or stopped answering (``misses``
    failed calls in a row) has freed, or will free, the memory the drafter reads: ``on_lost(reason)``
    is called once (the drafter worker then refuses Propose and reports NOT_SERVING; it must be
    restarted) and the watch ends. ``fetch``: :func:`fetch_shared_infos` (tests pass their own)."""

    def __init__(self, address: str, owner_id: str, interval_s: float, on_lost, fetch=None, misses: int = 3):
        self.address, self.owner_id, self.interval_s, self.on_lost = address, owner_id, interval_s, on_lost
        self.fetch = fetch if fetch is not None else fetch_shared_infos
        self.misses = misses
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="target-watch", daemon=True)

    def start(self) -> "TargetWatch":
        self._thread.start()
        return self

    def check(self) -> str:
        """"" while the exporter is the same, else why not (raises what ``fetch`` raises)."""
        infos = self.fetch(self.address, timeout_s=max(1.0, 2 * self.interval_s))
        owners = {i.owner_id for i in infos if i.name == EMBD}
        if owners != {self.owner_id}:
            return (f"the target worker at {self.address} no longer exports the mapped tensors (exporter "
                    f"{sorted(owners) or 'none'}, mapped from {self.owner_id})")
        return ""

    def _run(self) -> None:
        failed = 0
        while not self._stop.wait(self.interval_s):
            try:
                reason = self.check()
                failed = 0
            except Exception as exc:  # noqa: BLE001 - an unreachable target counts as a miss
                failed += 1
                reason = "" if failed < self.misses else (
                    f"the target worker at {self.address} did not answer Info {failed} times in a row: {exc}")
            if reason:
                log.error("draft-worker: %s; refusing Propose (restart the drafter worker)", reason)
                self.on_lost(reason)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 3 * self.interval_s))
