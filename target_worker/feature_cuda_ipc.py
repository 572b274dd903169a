"""The feature ring in device memory, shared with the drafter worker on the same GPU (CUDA / HIP IPC).

Selected by ``feature_transport = "cuda-ipc"`` on the target worker, the drafter worker and the
coordinator (all three must agree; ``specd serve --feature-transport cuda-ipc`` passes it on). Valid
only with ``--device cuda`` on both workers (each refuses to start otherwise:
:func:`check_device_transport`), which must use the same GPU: the runtime would map another GPU's
rows too (``cudaIpcOpenMemHandle`` with ``cudaIpcMemLazyEnablePeerAccess``: every gather a read over
the peer link), so the handle names the exporting GPU by PCI bus id (``device_id``) and the drafter's
attach refuses a ring of another GPU with an error naming both. Host shared memory
(:mod:`.feature_shm`) stays the transport of the CPU backend.

Per sequence the target worker (the only writer) creates:

* the rows: a device tensor float32 ``[capacity, width]`` allocated with plain cudaMalloc and exported
  with ``cudaIpcGetMemHandle`` (``sn.gpu_ipc_export``); position p lives in row ``p % capacity``;
* an interprocess event (``sn.gpu_ipc_event_create``), recorded on the library stream after every
  commit's row copies (and at a commit of zero rows, which copies nothing while the rows are the
  export's zeros: a target without capture layers);
* the slot table on the host, in a small POSIX segment ``specd-fi-<pid>-<n>`` (created and cleaned
  up like the shm transport's segments): ``int64 header[8]`` (magic ``MAGIC``, capacity, width,
  committed, generation, reserved) then ``int64 slot_pos[capacity]`` (-1 = empty) — the
  :class:`.features.FeatureRing` bookkeeping (``write_slots`` / ``held_slots``), so a read of a
  position that was never written or was overwritten is a ValueError, never another row's data.

The handle (worker.proto FeatureHandle, kind ``"cuda_ipc"``) carries the segment name and size, the
two 64-byte IPC handles, the device byte size (``device_nbytes = 4 * capacity * width``) and the
exporting GPU's PCI bus id (``device_id``); the reader checks all of them against each other, against
``MAX_DEVICE_BYTES`` and against its own GPU before mapping, and the runtime refuses to map an
allocation smaller than ``device_nbytes`` or whose size it cannot determine.

Commit (``Qwen35Model.commit``): the committed rows go device-to-device from the verify's feature
tensor into the ring (``sn.copy_rows``, one copy per contiguous run; no host copy of the features is
made), then the event is recorded, then the slot table and ``committed`` are published on the host.
The drafter's ``read(start, n)`` checks the slot table, makes its library stream wait for the event
(``cudaStreamWaitEvent``: the last record, which precedes the publish it just saw) and gathers the
rows into a new device tensor float32 ``[n, width]`` (a copy: the drafter keeps no reference into the
target's memory), which ``DrafterModel.ingest`` takes as it is.

Capacity contract (the simplest correct option): the ring holds the whole sequence — ``capacity`` is
the sequence's capacity (``PrefillRequest.capacity`` or ``--max-seq-len``), exactly as for the shm
ring. Prefill writes the whole prompt before the drafter's first ingest, and no slot is ever written
twice, so the writer never overwrites rows a reader may still be copying (no write-after-read hazard
across the processes, no back-pressure protocol). Cost: ``4 * n_taps * n_embd`` bytes of device
memory per position; a 27B target with 5 taps (n_embd 5120) needs 100 KiB per row, 3.1 GiB per
sequence of 32k positions. The memory report (:mod:`.memory`) counts it as device memory per sequence
with this transport.

Cleanup: ``release`` (sequence end), ``close_all`` (server stop, atexit, SIGTERM through the servers'
handler) drop the device rows (cudaFree after the library stream drains), the event and the host
segment; the drafter's ``close`` waits for its stream (its queued gathers) and closes its mapping
(cudaIpcCloseMemHandle) and event. With this transport the coordinator releases a sequence on the
drafter first and on the target only after the drafter's Release returned, so the rows are never
freed while the drafter still maps them. A crashed
target's device memory is reclaimed by the driver with its process, its segment by the resource
tracker.

The GPU calls go through a small backend object (:class:`NativeIpcBackend`) so the bookkeeping and
the handle checks run in CPU tests with a fake one.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import socket
import threading

import numpy as np

from .feature_shm import (HEADER_BYTES, FeatureHandleInfo, ShmExhausted, _close_unlink,  # noqa: F401
                          attach_segment, close_segment, create_segment, shm_array)
from .features import held_slots, row_runs, stage_into, write_slots

log = logging.getLogger(__name__)

KIND = "cuda_ipc"
TRANSPORT = "cuda-ipc"
MAGIC = 0x53504543445F4649  # "SPECD_FI"
HANDLE_BYTES = 64
MAX_DEVICE_BYTES = 1 << 40  # a peer's declared ring size above this is refused before mapping
MAX_CAPACITY = 1 << 24  # positions
MAX_WIDTH = 1 << 20  # float32 values per row


class DeviceRingExhausted(ShmExhausted):
    """The device has no memory for a sequence's feature ring (the target worker answers
    RESOURCE_EXHAUSTED, as for a full /dev/shm)."""


def table_bytes(capacity: int) -> int:
    """Bytes of the host slot-table segment of a ring of ``capacity`` slots."""
    return HEADER_BYTES + 8 * capacity


def device_bytes(capacity: int, width: int) -> int:
    """Bytes of the device rows, float32 [capacity, width]."""
    return 4 * capacity * width


def check_device_transport(transport: str, device: str, who: str) -> None:
    """ValueError unless ``transport`` "cuda-ipc" runs with ``device`` "cuda" (``device`` already
    resolved: "auto" counts as what it resolved to)."""
    if transport == TRANSPORT and device != "cuda":
        raise ValueError(f"{who}: --feature-transport cuda-ipc shares the feature ring in GPU memory and needs "
                         f"--device cuda (got device {device!r}); use --feature-transport shm for the CPU backend")


# Rings exported by this process, by handle: CUDA refuses to open an IPC handle in the process that
# exported it, so a reader in the writer's own process (the in-process test stacks) uses the writer's
# tensor and event directly. Entries are removed when the ring is freed.
_LOCAL_LOCK = threading.Lock()
_LOCAL: dict[bytes, object] = {}


class NativeIpcBackend:
    """The GPU calls of the transport, on ``specd.native`` (CUDA or HIP build, a GPU present)."""

    def __init__(self):
        import specd.native as sn

        self.sn = sn
        self.device = sn.Device.GPU
        self._device_id = None

    def device_id(self) -> str:
        """PCI bus id of this process's GPU (the same string in every process on that GPU)."""
        if self._device_id is None:
            self._device_id = self.sn.gpu_pci_bus_id()
        return self._device_id

    def export(self, capacity: int, width: int):
        """(GPU tensor float32 [capacity, width], zeroed; 64-byte handle)."""
        t, h = self.sn.gpu_ipc_export([capacity, width], self.sn.DType.F32)
        with _LOCAL_LOCK:
            _LOCAL[bytes(h)] = t
        return t, bytes(h)

    def open(self, handle: bytes, capacity: int, width: int, nbytes: int):
        with _LOCAL_LOCK:
            local = _LOCAL.get(bytes(handle))
        if local is not None:  # exported by this very process
            if tuple(local.shape) != (capacity, width):
                raise ValueError(f"feature handle: ring of shape {tuple(local.shape)}, the handle says "
                                 f"{(capacity, width)}")
            return local
        return self.sn.gpu_ipc_open(handle, [capacity, width], self.sn.DType.F32, nbytes)

    def export_tensor(self, t, tiled: bool = False):
        """(GPU tensor, 64-byte handle): an exported copy of ``t`` (an sn.Tensor of any stored type and
        shape, on the host, e.g. a GGUF view) in plain cudaMalloc memory (the shared target weights,
        :mod:`.shared_weights`); with ``tiled`` in the GPU GEMV's tiled layout of its type
        (``sn.tile_for_gemv``: the row-major bytes pass through a temporary device copy). The copy is
        complete when this returns. Raises ValueError where ``sn.tile_for_gemv`` refuses ``t``."""
        src = t.contiguous()
        shape = [int(s) for s in src.shape]
        if tiled and (self.sn.tiled_of(src.dtype) == src.dtype or len(shape) != 2 or shape[0] % 16):
            raise ValueError(f"export_tensor: no GEMV tiled layout for {src.dtype.name} {shape} (IQ4_XS, Q4_K, Q5_K or "
                             "Q6_K [rows, cols] with rows a multiple of 16)")
        d, h = self.sn.gpu_ipc_export(shape, self.sn.tiled_of(src.dtype) if tiled else src.dtype)
        if tiled:
            staged = None
            try:
                staged = self.sn.Tensor.empty(shape, src.dtype, self.sn.Device.GPU)
                self.sn.gpu_write_async(staged, np.ascontiguousarray(src.numpy()))
                self.sn.tile_for_gemv(staged, out=d)
                self.sn.gpu_synchronize()
            finally:
                del staged
                self.sn.gpu_trim_pool()  # the staging copy (the size of the head) is not kept in the pool
        else:
            self.sn.gpu_write_async(d, np.ascontiguousarray(src.numpy()))
            self.sn.gpu_synchronize()
        with _LOCAL_LOCK:
            _LOCAL[bytes(h)] = d
        return d, bytes(h)

    def open_tensor(self, handle: bytes, shape, dtype, nbytes: int):
        """Another process's exported tensor mapped as a GPU tensor of ``shape`` / ``dtype`` (the
        exporter's own tensor when it is this process). ValueError on a shape / size mismatch or a
        mapped allocation smaller than ``nbytes``; RuntimeError when the runtime refuses the handle."""
        with _LOCAL_LOCK:
            local = _LOCAL.get(bytes(handle))
        if local is not None:
            if tuple(local.shape) != tuple(shape) or local.dtype != dtype:
                raise ValueError(f"shared tensor: {local.dtype.name} {tuple(local.shape)} exported, the handle says "
                                 f"{dtype.name} {tuple(shape)}")
            return local
        return self.sn.gpu_ipc_open(handle, [int(s) for s in shape], dtype, int(nbytes))

    def event_create(self):
        e = self.sn.gpu_ipc_event_create()
        with _LOCAL_LOCK:
            _LOCAL[bytes(e.handle)] = e
        return e

    def event_open(self, handle: bytes):
        with _LOCAL_LOCK:
            local = _LOCAL.get(bytes(handle))
        return local if local is not None else self.sn.gpu_ipc_event_open(handle)

    def synchronize(self) -> None:
        """Waits until the library stream has drained (a reader's queued gathers are done)."""
        self.sn.gpu_synchronize()

    def forget(self, *handles: bytes) -> None:
        """Drops this process's references to freed rings' tensors and events."""
        with _LOCAL_LOCK:
            for h in handles:
                _LOCAL.pop(bytes(h), None)

    def empty(self, n: int, width: int):
        return self.sn.Tensor.empty([n, width], self.sn.DType.F32, self.device)

    def upload(self, rows: np.ndarray):
        return self.sn.Tensor(np.ascontiguousarray(rows, np.float32)).to(self.device)

    def copy_rows(self, dst, dst_start: int, src, src_start: int, n: int) -> None:
        self.sn.copy_rows(dst, dst_start, src, src_start, n)


def _gather(backend, rows, slots: np.ndarray, width: int):
    """rows[slots] as a new tensor [len(slots), width] on the backend's device."""
    out = backend.empty(len(slots), width)
    for d, s, n in row_runs(np.arange(len(slots)), slots):
        backend.copy_rows(out, d, rows, s, n)
    return out


class CudaIpcFeatureRing:
    """The target side of one sequence's device ring (see the module docstring). Interface of
    :class:`.features.FeatureRing`: ``capacity``, ``width``, ``slot_pos`` (host int64 [capacity]),
    ``all_zero``, ``write(start, rows)``, ``write_zeros(start, n)``, ``read(start, n)``; plus
    ``write_rows`` (device-to-device commit).

    ``device`` is True: :meth:`Qwen35Model.commit` then passes the verify's device feature tensor to
    :meth:`write_rows` instead of host rows.
    """

    device = True

    def __init__(self, shm, capacity: int, width: int, backend):
        if capacity <= 0 or width <= 0:
            raise ValueError(f"feature ring needs capacity and width > 0, got {capacity}, {width}")
        self.capacity, self.width, self.backend, self.shm = capacity, width, backend, shm
        self.header = shm_array(shm, np.int64, (8,), 0)
        self.slot_pos = shm_array(shm, np.int64, (capacity,), HEADER_BYTES)
        self.slot_pos[:] = -1
        self.header[:] = 0
        self.header[0], self.header[1], self.header[2] = MAGIC, capacity, width
        self.rows, self.mem_handle = backend.export(capacity, width)
        self.all_zero = True  # the exported rows start zeroed; write_zeros keeps them so
        self.event = None
        try:
            self.event = backend.event_create()
        except BaseException:
            self.close()  # the exported rows must not stay registered (``_LOCAL``) past a failed creation
            raise

    def write_rows(self, start: int, src, src_rows) -> None:
        """Positions start .. start+n-1 get rows ``src_rows`` (n indices) of ``src`` (a tensor float32
        [w, width] on the ring's device), device to device: :meth:`stage_rows` then
        :meth:`publish_rows`. ValueError on a wrong width or when n > capacity."""
        self.publish_rows(self.stage_rows(start, src, src_rows))

    def stage_rows(self, start: int, src, src_rows):
        """The copies of :meth:`write_rows`, queued on the stream, then the event recorded after them;
        the slots read as empty until :meth:`publish_rows` (as :meth:`.features.FeatureRing.stage_rows`:
        a commit stages before its state updates and publishes after them). Returns the staged write."""
        def copy(slots, rows):
            for d, s, n in row_runs(slots, rows):
                self.backend.copy_rows(self.rows, d, src, s, n)
            self.event.record()  # after the copies; before the host publish a reader checks

        return stage_into(self, start, src, src_rows, copy)

    def publish_rows(self, staged) -> None:
        """The staged positions become readable (the event was recorded when they were staged)."""
        start, slots, pos = staged
        if len(slots):
            self._publish(start, slots, pos)

    def write_zeros(self, start: int, n: int) -> None:
        """Positions start .. start+n-1 get zero rows (a target without capture layers): only the slot
        table moves while every row is still the zero of the exported ring. ValueError when n > capacity."""
        if not self.all_zero:
            self.write(start, np.zeros((n, self.width), np.float32))
            return
        slots, pos = write_slots(self.capacity, start, n)
        if n:
            self.event.record()  # orders the reader after the commit, as for written rows
            self._publish(start, slots, pos)

    def _publish(self, start: int, slots: np.ndarray, pos: np.ndarray) -> None:
        self.slot_pos[slots] = pos
        self.header[3] = max(int(self.header[3]), start + len(slots))
        self.header[4] += 1

    def write(self, start: int, rows) -> None:
        """Host rows float32 [n, width] (uploaded) or a device tensor [n, width]: positions start ..
        start+n-1."""
        if isinstance(rows, np.ndarray):
            rows = np.asarray(rows, np.float32)
            if rows.ndim != 2 or rows.shape[1] != self.width:
                raise ValueError(f"FeatureRing.write: rows must be [n, {self.width}], got {rows.shape}")
            rows = self.backend.upload(rows)
        self.write_rows(start, rows, np.arange(int(rows.shape[0])))

    def read_device(self, start: int, n: int):
        """Rows of positions start .. start+n-1 as a new device tensor [n, width]; ValueError if any is
        not held."""
        return _gather(self.backend, self.rows, held_slots(self.slot_pos, start, n), self.width)

    def read(self, start: int, n: int) -> np.ndarray:
        """As :meth:`.features.FeatureRing.read`: a host copy float32 [n, width]."""
        return np.asarray(self.read_device(start, n).numpy(), np.float32).reshape(n, self.width)

    def close(self) -> None:
        """Drops the device rows (freed once the library stream drains) and the event."""
        if self.rows is not None:
            forget = getattr(self.backend, "forget", None)
            if forget is not None:
                forget(self.mem_handle, *(() if self.event is None else (self.event.handle,)))
        self.rows = self.event = None


class CudaIpcFeatureWriter:
    """Creates and owns the target worker's device rings (same interface as
    :class:`.feature_shm.FeatureWriter`). ``backend``: :class:`NativeIpcBackend` by default."""

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else NativeIpcBackend()
        self._lock = threading.Lock()
        self._rings: dict[str, CudaIpcFeatureRing] = {}
        self._counter = 0
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}"
        self.device_id = ""  # the GPU's PCI bus id, read at the first ring
        atexit.register(self.close_all)

    def create(self, seq_id: str, capacity: int, width: int) -> tuple[CudaIpcFeatureRing, FeatureHandleInfo]:
        """A new zeroed ring for ``seq_id`` (ValueError if it already has one or a size is out of
        bounds; ShmExhausted when /dev/shm has no room for the slot table; DeviceRingExhausted (a
        ShmExhausted) when the device allocation fails; the runtime's RuntimeError on another device
        failure, with nothing left allocated or registered)."""
        if not 0 < capacity <= MAX_CAPACITY or not 0 < width <= MAX_WIDTH:
            raise ValueError(f"feature ring needs 0 < capacity <= {MAX_CAPACITY} and 0 < width <= {MAX_WIDTH}, "
                             f"got {capacity}, {width}")
        with self._lock:
            if seq_id in self._rings:
                raise ValueError(f"sequence {seq_id!r} already has a feature ring")
            if not self.device_id:
                self.device_id = self.backend.device_id()
            self._counter += 1
            name = f"specd-fi-{os.getpid()}-{self._counter}"
            nbytes = table_bytes(capacity)
            shm = create_segment(name, nbytes, f"slot table of {capacity} positions")
            try:
                ring = CudaIpcFeatureRing(shm, capacity, width, self.backend)
            except BaseException as exc:
                close_segment(shm)  # the half-made ring's views may still be alive (the traceback's frames)
                shm.unlink()
                if isinstance(exc, RuntimeError) and "cudaMalloc" in str(exc):
                    raise DeviceRingExhausted(errno.ENOMEM, f"no device memory for a {device_bytes(capacity, width)}"
                                              f"-byte feature ring ({capacity} rows x {width} floats): {exc}") from exc
                raise
            self._rings[seq_id] = ring
        return ring, FeatureHandleInfo(KIND, name, capacity, width, nbytes, self.owner_id, bytes(ring.mem_handle),
                                       bytes(ring.event.handle), device_bytes(capacity, width), self.device_id)

    def release(self, seq_id: str) -> bool:
        """Frees the sequence's ring (device rows, event, slot table); False if it had none."""
        with self._lock:
            ring = self._rings.pop(seq_id, None)
        if ring is None:
            return False
        _free(ring)
        return True

    def close_all(self) -> None:
        with self._lock:
            rings, self._rings = list(self._rings.values()), {}
        for ring in rings:
            _free(ring)

    def live(self) -> list[str]:
        """Names of the live slot-table segments (one per ring)."""
        with self._lock:
            return [r.shm.name for r in self._rings.values()]

    def device_bytes(self) -> int:
        """Device bytes held by the live rings."""
        with self._lock:
            return sum(device_bytes(r.capacity, r.width) for r in self._rings.values())


def _free(ring: CudaIpcFeatureRing) -> None:
    ring.close()
    _close_unlink(ring.shm, ring)


def check_handle(handle: FeatureHandleInfo) -> None:
    """ValueError unless a peer's cuda_ipc handle is self-consistent and within bounds."""
    if handle.kind != KIND:
        raise ValueError(f"feature handle kind {handle.kind!r} is not {KIND!r}")
    if not 0 < handle.capacity <= MAX_CAPACITY or not 0 < handle.width <= MAX_WIDTH:
        raise ValueError(f"feature handle: capacity {handle.capacity} / width {handle.width} out of bounds "
                         f"(1..{MAX_CAPACITY} / 1..{MAX_WIDTH})")
    want = device_bytes(handle.capacity, handle.width)
    if handle.device_nbytes != want or want > MAX_DEVICE_BYTES:
        raise ValueError(f"feature handle: device_nbytes {handle.device_nbytes} does not match capacity "
                         f"{handle.capacity} x width {handle.width} float32 ({want} bytes, at most {MAX_DEVICE_BYTES})")
    if handle.nbytes != table_bytes(handle.capacity):
        raise ValueError(f"feature handle: slot table of {handle.nbytes} bytes, expected {table_bytes(handle.capacity)}")
    for field in ("ipc_mem_handle", "ipc_event_handle"):
        if len(getattr(handle, field)) != HANDLE_BYTES:
            raise ValueError(f"feature handle: {field} is {len(getattr(handle, field))} bytes, expected {HANDLE_BYTES}")
    if not handle.device_id:
        raise ValueError("feature handle: no device_id (the exporting GPU's PCI bus id)")


def check_same_device(handle: FeatureHandleInfo, here: str) -> None:
    """ValueError unless the ring was exported on this process's GPU (``here``: its PCI bus id)."""
    if handle.device_id != here:
        raise ValueError(f"feature ring {handle.name} lives on GPU {handle.device_id} (the target worker's) but this "
                         f"drafter worker runs on GPU {here}: cuda-ipc needs both workers on the same GPU (the "
                         f"runtime would read it over the peer link); use the same device for both, or "
                         f"--feature-transport shm")


class CudaIpcFeatureReader:
    """The drafter side: maps the target's device rows, opens its event and attaches the slot table
    (reader interface of :mod:`.feature_shm`: ``feed``, ``read``, ``close``; ``read`` returns a device
    tensor). ValueError on an inconsistent handle or header or a ring of another GPU (``device_id``),
    FileNotFoundError when the slot table is gone, RuntimeError when the runtime refuses a handle."""

    def __init__(self, handle: FeatureHandleInfo, backend=None):
        check_handle(handle)
        self.handle, self.backend = handle, backend if backend is not None else NativeIpcBackend()
        check_same_device(handle, self.backend.device_id())
        self.rows = self.event = None
        self.shm = attach_segment(handle.name, handle.owner_id)
        try:
            if self.shm.size < handle.nbytes:
                raise ValueError(f"feature slot table {handle.name} is {self.shm.size} bytes, expected {handle.nbytes}")
            self.header = shm_array(self.shm, np.int64, (8,), 0)
            self.slot_pos = shm_array(self.shm, np.int64, (handle.capacity,), HEADER_BYTES)
            if (int(self.header[0]) != MAGIC or int(self.header[1]) != handle.capacity
                    or int(self.header[2]) != handle.width):
                raise ValueError(f"feature slot table {handle.name}: header does not match the handle")
            self.rows = self.backend.open(handle.ipc_mem_handle, handle.capacity, handle.width, handle.device_nbytes)
            self.event = self.backend.event_open(handle.ipc_event_handle)
        except BaseException:
            self.close()
            raise

    @property
    def committed(self) -> int:
        return int(self.header[3])

    def feed(self, rows) -> None:
        """Reader interface: the device ring takes no inline rows."""
        if len(rows):
            raise ValueError("inline feature rows sent to a drafter reading a CUDA IPC ring "
                             "(feature_transport mismatch)")

    def read(self, start: int, n: int):
        """Rows of positions start .. start+n-1: a new device tensor float32 [n, width] (a host
        float32 [0, width] array for n = 0), ordered after the writer's last commit on the library
        stream. ValueError when a row is not committed yet or no longer held."""
        if n == 0:
            return np.zeros((0, self.handle.width), np.float32)
        if start < 0 or start + n > self.committed:
            raise ValueError(f"feature rows {start}..{start + n - 1} are not committed (committed {self.committed})")
        try:
            slots = held_slots(self.slot_pos, start, n)
        except ValueError:
            raise ValueError(f"feature rows {start}..{start + n - 1} were overwritten or never written") from None
        self.event.wait()
        return _gather(self.backend, self.rows, slots, self.handle.width)

    def close(self) -> None:
        """Waits for the gathers queued on the library stream, then closes the mapping
        (cudaIpcCloseMemHandle), the event and the slot table. The coordinator releases the target's
        ring (cudaFree) only after the drafter's Release, which calls this, has returned."""
        if getattr(self, "rows", None) is not None:
            sync = getattr(self.backend, "synchronize", None)
            if sync is not None:
                try:
                    sync()
                except Exception as exc:  # noqa: BLE001 - a broken device: the close goes on
                    log.warning("feature ring %s: synchronising before closing the mapping failed: %s",
                                self.handle.name, exc)
        self.rows = self.event = None
        self.header = self.slot_pos = None
        shm, self.shm = getattr(self, "shm", None), None
        if shm is not None:
            close_segment(shm)
