"""The feature ring in POSIX shared memory: the target worker writes, the drafter worker reads.

spec-loop.md §6, serving.md §3.1. One segment per sequence, created by the target worker (the only
writer) and attached read-only by the drafter worker. Layout of a segment (little-endian, native
alignment), ``capacity`` slots of ``width`` float32 values:

=========  ==========================  ==============================================
offset     field                       meaning
=========  ==========================  ==============================================
0          int64 magic                 ``MAGIC`` (format check)
8          int64 capacity              slots
16         int64 width                 float32 values per row (n_taps * n_embd)
24         int64 committed             rows < committed are final (published after commit)
32         int64 generation            bumped on every publish
40 .. 64   reserved
64         int64 slot_pos[capacity]    absolute position held by each slot (-1: empty)
64+8*cap   float32 rows[capacity, width]
=========  ==========================  ==============================================

Position p lives in slot ``p % capacity``. Readers check ``slot_pos`` and ``committed`` so a row that
was never written, was overwritten by a later position, or is not yet committed is an error rather
than silently another position's data. The coordinator orders writer and reader (the drafter is
called only after the target's commit returned), so no lock is needed.

Interface for other transports (:mod:`.feature_inline`, :mod:`.feature_cuda_ipc`): :class:`FeatureWriter` (``create``,
``release``, ``close_all``) and :func:`attach_reader` returning an object with ``read(start, n)``;
both are keyed by :class:`FeatureHandleInfo`.

Segments are named ``specd-ft-<pid>-<n>`` and unlinked on release, on ``close_all`` (server stop),
at interpreter exit (atexit) and on SIGTERM (the servers install a handler that exits through
``close_all``); the multiprocessing resource tracker unlinks any left by a crash (SIGKILL).
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import socket
import threading
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from .features import FeatureRing, held_span

MAGIC = 0x53504543445F4654  # "SPECD_FT"
log = logging.getLogger(__name__)

# the segment's pages are allocated at create (a sparse tmpfs file would SIGBUS the writer on first touch
# when /dev/shm is full); module-level so tests can simulate a full /dev/shm
_fallocate = getattr(os, "posix_fallocate", None)


class ShmExhausted(OSError):
    """/dev/shm has no room for a sequence's feature segment (the message names the size)."""
HEADER_BYTES = 64


@dataclasses.dataclass(frozen=True)
class FeatureHandleInfo:
    """Where a sequence's ring lives (mirrors worker.proto FeatureHandle). The last four fields are
    used by kind "cuda_ipc" only (:mod:`.feature_cuda_ipc`): 64-byte CUDA/HIP IPC handles of the device
    rows and of the commit event, the device rows' byte size and the exporting GPU's PCI bus id."""

    kind: str
    name: str
    capacity: int
    width: int
    nbytes: int
    owner_id: str
    ipc_mem_handle: bytes = b""
    ipc_event_handle: bytes = b""
    device_nbytes: int = 0
    device_id: str = ""

    @classmethod
    def from_proto(cls, h) -> "FeatureHandleInfo":
        """From a worker.proto FeatureHandle message."""
        return cls(h.kind, h.name, int(h.capacity), int(h.width), int(h.nbytes), h.owner_id,
                   bytes(h.ipc_mem_handle), bytes(h.ipc_event_handle), int(h.device_nbytes), h.device_id)

    def to_proto(self, pb):
        """As a worker.proto FeatureHandle (``pb``: the generated worker_pb2 module)."""
        return pb.FeatureHandle(kind=self.kind, name=self.name, capacity=self.capacity, width=self.width,
                                nbytes=self.nbytes, owner_id=self.owner_id, ipc_mem_handle=self.ipc_mem_handle,
                                ipc_event_handle=self.ipc_event_handle, device_nbytes=self.device_nbytes,
                                device_id=self.device_id)


def shm_namespace_id() -> str:
    """``<boot_id>:<st_dev of /dev/shm>``: two processes that report the same id share one tmpfs."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        dev = os.stat("/dev/shm").st_dev
    except OSError:
        dev = 0
    return f"{boot}:{dev}"


def segment_bytes(capacity: int, width: int) -> int:
    return HEADER_BYTES + 8 * capacity + 4 * capacity * width


def shm_array(shm: shared_memory.SharedMemory, dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """A numpy view of ``shape`` at byte ``offset`` of the segment that pins its mapping: it (and every
    view of it) holds a buffer export of the mapping (through the memoryview numpy takes of
    ``shm.buf``), so ``shm.close()`` cannot unmap memory a live view still points at: it raises
    BufferError at the mmap and leaves it mapped (``shm.buf`` is then None; nothing may use it).
    ``np.ndarray(buffer=shm.buf)`` holds no export: close() unmapped under it (a SIGSEGV on the next
    read). Relies on numpy's frombuffer keeping the buffer exported: tests/target/test_feature_ring.py
    checks it."""
    return np.frombuffer(shm.buf, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)


def _views(shm: shared_memory.SharedMemory, capacity: int, width: int):
    header = shm_array(shm, np.int64, (8,), 0)
    slot_pos = shm_array(shm, np.int64, (capacity,), HEADER_BYTES)
    rows = shm_array(shm, np.float32, (capacity, width), HEADER_BYTES + 8 * capacity)
    return header, slot_pos, rows


# Segments whose close found a view still alive (a read's rows in use elsewhere): their mapping (and
# its tmpfs pages, once unlinked) stays until the views go and a later close_segment retries them: at
# this process's next close or attach of any segment, and at exit. The servers drop their views before
# a sequence's reader can be closed, so this holds only what a caller kept beyond a call.
_LINGERING: list[shared_memory.SharedMemory] = []
_LINGERING_LOCK = threading.Lock()


def close_segment(shm: shared_memory.SharedMemory | None = None) -> None:
    """Closes this process's mapping of a segment, or, while a view of it is still alive, keeps it
    to close later; retries those kept before (None: only them). Never unmaps memory in use and never
    raises: a close failing otherwise is logged and dropped."""
    with _LINGERING_LOCK:
        pending = [*_LINGERING, *([shm] if shm is not None and all(shm is not s for s in _LINGERING) else [])]
        _LINGERING.clear()
        for seg in pending:
            try:
                seg.close()
            except BufferError:
                _LINGERING.append(seg)
            except Exception as exc:  # noqa: BLE001 - one segment's failure must not strand the others
                log.warning("feature segment %s: close failed: %s", seg.name, exc)


atexit.register(close_segment)


class ShmFeatureRing(FeatureRing):
    """A :class:`FeatureRing` whose rows and slot table live in a shared-memory segment (writer side).

    ``write`` stores host rows, ``write_rows`` (or ``stage_rows`` then ``publish_rows``) a device
    tensor's rows straight into the segment (the target model's ``commit`` on the GPU),
    ``write_zeros`` zero rows; each then publishes them (``publish(c)`` marks rows < c final for
    readers). ``shm`` must be a segment just created (:func:`create_segment`: the kernel zero-fills
    new pages), so the ring starts ``all_zero``.
    """

    def __init__(self, shm: shared_memory.SharedMemory, capacity: int, width: int):
        header, slot_pos, rows = _views(shm, capacity, width)
        super().__init__(capacity, width, buffer=rows)
        slot_pos[:] = -1
        self.slot_pos = slot_pos  # the base class's table, moved into shared memory
        header[:] = 0
        header[0], header[1], header[2] = MAGIC, capacity, width
        self.header, self.shm = header, shm
        self.all_zero = True  # a new segment's pages are zero-filled

    def write(self, start: int, rows: np.ndarray) -> None:
        super().write(start, rows)
        self.publish(start + np.asarray(rows).shape[0])

    def publish_rows(self, staged) -> None:
        super().publish_rows(staged)
        self.publish(staged[0] + len(staged[1]))

    def write_zeros(self, start: int, n: int) -> None:
        super().write_zeros(start, n)
        self.publish(start + n)

    def publish(self, committed: int) -> None:
        """Rows < committed are final for readers (never lowered: a write of no rows at an earlier
        start publishes nothing new)."""
        self.header[3] = max(int(self.header[3]), committed)
        self.header[4] += 1


def create_segment(name: str, nbytes: int, what: str) -> shared_memory.SharedMemory:
    """A new POSIX segment of ``nbytes`` with its pages allocated (ShmExhausted when /dev/shm has no
    room; ``what`` describes the contents in that message)."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    if _fallocate is not None:
        try:
            _fallocate(shm._fd, 0, nbytes)  # noqa: SLF001
        except OSError as exc:
            shm.close()
            shm.unlink()
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise ShmExhausted(exc.errno, f"/dev/shm has no room for a {nbytes}-byte feature segment "
                                              f"({what}): {exc.strerror}") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                raise
            shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)  # no fallocate here
    return shm


def attach_segment(name: str, owner_id: str) -> shared_memory.SharedMemory:
    """Attaches an existing segment without taking over its cleanup (FileNotFoundError when gone)."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    # The attaching process must not unlink the writer's segment at its exit (Python < 3.13 registers
    # every attach with the resource tracker). In the writer's own process the registration is the
    # writer's, so it stays.
    if owner_id != f"{socket.gethostname()}:{os.getpid()}":
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        except Exception:  # noqa: BLE001 - tracker absent or already unregistered
            pass
    return shm


class FeatureWriter:
    """Creates and owns the target worker's ring segments (one per sequence)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._segments: dict[str, tuple[shared_memory.SharedMemory, ShmFeatureRing]] = {}
        self._counter = 0
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}"
        atexit.register(self.close_all)

    def create(self, seq_id: str, capacity: int, width: int) -> tuple[ShmFeatureRing, FeatureHandleInfo]:
        """A new zeroed ring for ``seq_id`` (ValueError if it already has one)."""
        if capacity <= 0 or width <= 0:
            raise ValueError(f"feature ring needs capacity and width > 0, got {capacity}, {width}")
        with self._lock:
            if seq_id in self._segments:
                raise ValueError(f"sequence {seq_id!r} already has a feature ring")
            self._counter += 1
            name = f"specd-ft-{os.getpid()}-{self._counter}"
            nbytes = segment_bytes(capacity, width)
            shm = create_segment(name, nbytes, f"{capacity} rows x {width} floats")
            try:
                ring = ShmFeatureRing(shm, capacity, width)
            except BaseException:
                close_segment(shm)
                shm.unlink()
                raise
            self._segments[seq_id] = (shm, ring)
        return ring, FeatureHandleInfo("posix_shm", name, capacity, width, nbytes, self.owner_id)

    def release(self, seq_id: str) -> bool:
        """Unlinks the sequence's segment; False if it had none."""
        with self._lock:
            entry = self._segments.pop(seq_id, None)
        if entry is None:
            return False
        _close_unlink(entry[0], entry[1])
        return True

    def close_all(self) -> None:
        with self._lock:
            entries, self._segments = list(self._segments.values()), {}
        for shm, ring in entries:
            _close_unlink(shm, ring)

    def live(self) -> list[str]:
        with self._lock:
            return [shm.name for shm, _ in self._segments.values()]


def _close_unlink(shm: shared_memory.SharedMemory, ring: ShmFeatureRing) -> None:
    # drop our numpy views first: a view still alive keeps the mapping (close_segment); unlinking
    # frees the name either way
    ring.rows = ring.slot_pos = ring.header = None
    close_segment(shm)
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class FeatureReader:
    """Read-only view of one sequence's ring in another process (the drafter worker)."""

    def __init__(self, handle: FeatureHandleInfo):
        if handle.kind != "posix_shm":
            raise ValueError(f"feature handle kind {handle.kind!r} is not supported (posix_shm only)")
        close_segment()  # segments kept past their close by a live view: retried at each attach
        shm = attach_segment(handle.name, handle.owner_id)
        if shm.size < segment_bytes(handle.capacity, handle.width):
            shm.close()
            raise ValueError(f"feature segment {handle.name} is {shm.size} bytes, expected "
                             f"{segment_bytes(handle.capacity, handle.width)}")
        self.shm, self.handle = shm, handle
        self.header, self.slot_pos, self.rows = _views(shm, handle.capacity, handle.width)
        self.rows.flags.writeable = False  # the writer's rows: views handed out by read stay read-only
        if int(self.header[0]) != MAGIC or int(self.header[1]) != handle.capacity or int(self.header[2]) != handle.width:
            self.close()
            raise ValueError(f"feature segment {handle.name}: header does not match the handle")

    @property
    def committed(self) -> int:
        return int(self.header[3])

    def feed(self, rows) -> None:
        """Reader interface (see feature_inline): the shared ring takes no inline rows."""
        if len(rows):
            raise ValueError("inline feature rows sent to a drafter reading shared memory "
                             "(feature_transport mismatch)")

    def read(self, start: int, n: int) -> np.ndarray:
        """float32 [n, width] rows of positions start .. start+n-1: a read-only view of the segment when
        they are one run of slots, a copy when the range wraps. ValueError when a row is not committed
        yet or no longer held by the ring.

        A view costs no copy (a 27B target's rows are 100 KB each, a long prompt's hundreds of MB).
        Its rows stay as they are until the writer reuses those slots, ``capacity`` positions later:
        the target's ring holds its whole sequence (capacity = the sequence's), so rows below
        ``committed`` never change while the segment lives, and the drafter reads them within the
        Propose call. The view pins the mapping: :meth:`close` under a live view keeps it mapped
        until the view goes (:func:`close_segment`)."""
        if n == 0:
            return np.zeros((0, self.handle.width), np.float32)
        if start < 0 or start + n > self.committed:
            raise ValueError(f"feature rows {start}..{start + n - 1} are not committed (committed {self.committed})")
        span = held_span(self.slot_pos, start, n)
        if span is not None:
            return self.rows[span]
        pos = start + np.arange(n)
        slots = pos % self.handle.capacity
        bad = pos[self.slot_pos[slots] != pos]
        if bad.size:
            raise ValueError(f"feature rows {bad[:8].tolist()} were overwritten or never written")
        return self.rows[slots]  # fancy indexing: a gathered copy

    def close(self) -> None:
        """Drops this reader's mapping (kept, by :func:`close_segment`, while a row view from
        :meth:`read` is still alive). Idempotent."""
        self.header = self.slot_pos = self.rows = None
        shm, self.shm = self.shm, None
        if shm is not None:
            close_segment(shm)


def attach_reader(handle: FeatureHandleInfo):
    """The reader for a handle: :class:`FeatureReader` (posix_shm), for kind "inline"
    :class:`.feature_inline.InlineFeatureReader`, for kind "cuda_ipc"
    :class:`.feature_cuda_ipc.CudaIpcFeatureReader` (whose ``read`` returns a GPU tensor). All have
    ``feed(rows)``, ``read(start, n)``, ``close()``."""
    if handle.kind == "inline":
        from .feature_inline import InlineFeatureReader

        return InlineFeatureReader(handle)
    if handle.kind == "cuda_ipc":
        from .feature_cuda_ipc import CudaIpcFeatureReader

        return CudaIpcFeatureReader(handle)
    return FeatureReader(handle)
