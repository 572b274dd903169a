"""Inline feature transport: feature rows as bytes in the worker messages (serving.md §3.1 fallback).

Used when the target and drafter workers do not share one ``/dev/shm`` (different hosts), selected by
``feature_transport = "inline"`` on the target worker, the drafter worker and the coordinator (all
three must agree; the coordinator checks both workers' Info at start-up). Default is ``"shm"``
(:mod:`.feature_shm`).

Flow (keeps two worker calls per speculative step): every target call that commits positions
(Prefill, Verify, Commit) returns those positions' rows in its response (``FeatureRows``:
``start``, ``n``, ``width``, little-endian float32 bytes ``[n, width]``). The coordinator appends
the messages unread to a per-sequence list and sends them in the sequence's next ``Propose``
(``ProposeRequest.rows``); the drafter decodes them into a private :class:`FeatureRing` and ingests
from it exactly as it ingests from the shared ring. No segment is created on either side.

Bounded messages: ``inline_max_rows(max_message_bytes, width)`` rows fit one message (1 MiB is
left for the rest of the message). The target reports it in ``TargetInfo.inline_max_rows`` and
refuses a Prefill with more prompt rows; the coordinator makes a step speculative (so a Propose
drains the rows) before the rows pending for the drafter plus one verify could pass it. A Verify
response carries at most ``max_verify`` rows.

Writer side: :class:`InlineFeatureWriter` (``create``, ``release``, ``close_all``, ``live``, like
:class:`.feature_shm.FeatureWriter`, plus ``take``). Reader side: :class:`InlineFeatureReader`
(``feed(rows)``, ``read(start, n)``, ``close()``), the same reader interface as the shm reader.
"""
from __future__ import annotations

import os
import socket
import threading

import numpy as np

from .feature_shm import FeatureHandleInfo
from .features import FeatureRing, checked_src_rows, copy_rows_into, write_slots

TRANSPORTS = ("shm", "inline", "cuda-ipc")  # cuda-ipc: .feature_cuda_ipc
INLINE_KIND = "inline"
MESSAGE_HEADROOM = 1 << 20  # bytes of a message kept for everything but the rows


def check_transport(value: str, who: str) -> str:
    """``value`` if it is a known feature transport, else ValueError naming ``who``."""
    if value not in TRANSPORTS:
        raise ValueError(f"{who}: feature_transport must be one of {', '.join(TRANSPORTS)}, got {value!r}")
    return value


def inline_max_rows(max_message_bytes: int, width: int) -> int:
    """Feature rows of ``width`` float32 values that fit one message of ``max_message_bytes``."""
    return max(1, (max_message_bytes - MESSAGE_HEADROOM) // (4 * max(1, width)))


def encode_rows(start: int, rows: np.ndarray) -> tuple[int, int, int, bytes]:
    """(start, n, width, little-endian float32 bytes) of rows float32 [n, width]."""
    rows = np.ascontiguousarray(rows, dtype="<f4")
    return int(start), int(rows.shape[0]), int(rows.shape[1]), rows.tobytes()


def decode_rows(n: int, width: int, data: bytes) -> np.ndarray:
    if len(data) != 4 * n * width:
        raise ValueError(f"inline feature rows: {len(data)} bytes for [{n}, {width}] float32")
    return np.frombuffer(data, dtype="<f4").reshape(n, width).astype(np.float32)


class InlineFeatureRing(FeatureRing):
    """The target side: keeps no rows, only the writes since the last ``take`` (merged when
    contiguous)."""

    def __init__(self, capacity: int, width: int):  # noqa: D107 - no storage; see FeatureRing
        if capacity <= 0 or width <= 0:
            raise ValueError(f"feature ring needs capacity and width > 0, got {capacity}, {width}")
        self.capacity, self.width = capacity, width
        self.outbox: list[tuple[int, np.ndarray]] = []

    def write(self, start: int, rows: np.ndarray) -> None:
        rows = np.asarray(rows, np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"FeatureRing.write: rows must be [n, {self.width}], got {rows.shape}")
        self._send(start, rows, owned=False)

    def stage_rows(self, start: int, src, src_rows):
        """The rows gathered to the host (only these rows), not yet in the outbox."""
        src_rows = checked_src_rows(src, src_rows, self.width)
        write_slots(self.capacity, start, src_rows.size)  # the same bounds as every ring's
        host = np.empty((src_rows.size, self.width), np.float32)
        copy_rows_into(host, np.arange(src_rows.size), src, src_rows)
        return start, host

    def publish_rows(self, staged) -> None:
        """The staged rows join the outbox."""
        self._send(*staged)

    def _send(self, start: int, rows: np.ndarray, owned: bool = True) -> None:
        """Adds rows to the outbox, merged with the last write when contiguous (a copy is kept unless
        the caller hands them over: ``owned``)."""
        if not rows.shape[0]:
            return
        if self.outbox and self.outbox[-1][0] + self.outbox[-1][1].shape[0] == start:
            s0, r0 = self.outbox[-1]
            self.outbox[-1] = (s0, np.concatenate([r0, rows]))
        else:
            self.outbox.append((start, rows if owned else rows.copy()))

    def write_zeros(self, start: int, n: int) -> None:
        """n zero rows at positions start .. start+n-1 (they travel in the responses like any rows);
        ValueError as :meth:`.features.FeatureRing.write_zeros`."""
        write_slots(self.capacity, start, n)  # the same bounds as every ring's
        self._send(start, np.zeros((n, self.width), np.float32))

    def read(self, start: int, n: int) -> np.ndarray:
        raise ValueError("the inline feature ring keeps no rows (they travel in the responses)")

    def take(self) -> list[tuple[int, np.ndarray]]:
        out, self.outbox = self.outbox, []
        return out


class InlineFeatureWriter:
    """Same interface as :class:`.feature_shm.FeatureWriter`; creates no shared memory."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rings: dict[str, InlineFeatureRing] = {}
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}"

    def create(self, seq_id: str, capacity: int, width: int) -> tuple[InlineFeatureRing, FeatureHandleInfo]:
        ring = InlineFeatureRing(capacity, width)
        with self._lock:
            if seq_id in self._rings:
                raise ValueError(f"sequence {seq_id!r} already has a feature ring")
            self._rings[seq_id] = ring
        return ring, FeatureHandleInfo(INLINE_KIND, "", capacity, width, 0, self.owner_id)

    def take(self, seq_id: str) -> list[tuple[int, np.ndarray]]:
        with self._lock:
            ring = self._rings.get(seq_id)
        return ring.take() if ring is not None else []

    def release(self, seq_id: str) -> bool:
        with self._lock:
            return self._rings.pop(seq_id, None) is not None

    def close_all(self) -> None:
        with self._lock:
            self._rings.clear()

    def live(self) -> list[str]:
        return []  # no shared-memory segments


class InlineFeatureReader:
    """The drafter side: a private ring filled by ``feed`` from the Propose's ``FeatureRows``."""

    def __init__(self, handle: FeatureHandleInfo):
        if handle.kind != INLINE_KIND:
            raise ValueError(f"feature handle kind {handle.kind!r} is not {INLINE_KIND!r}")
        self.handle = handle
        self.ring = FeatureRing(handle.capacity, handle.width)
        self.committed = 0

    def feed(self, rows) -> None:
        """Stores FeatureRows messages (start, n, width, data) in order; each must continue the last."""
        for r in rows:
            if r.width != self.handle.width:
                raise ValueError(f"inline feature rows of width {r.width}, expected {self.handle.width}")
            if r.start != self.committed:
                raise ValueError(f"inline feature rows start at {r.start}, expected {self.committed}")
            self.ring.write(r.start, decode_rows(r.n, r.width, r.data))
            self.committed = r.start + r.n

    def read(self, start: int, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros((0, self.handle.width), np.float32)
        if start < 0 or start + n > self.committed:
            raise ValueError(f"feature rows {start}..{start + n - 1} were not received (have < {self.committed})")
        return self.ring.read(start, n)

    def close(self) -> None:
        self.ring = None
