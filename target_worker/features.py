"""The feature ring: drafter features of the target, keyed by absolute position.

For every committed position p the target writes one row: the residual stream after each of the
drafter's ``target_layer_ids``, concatenated in tap order (``n_taps * n_embd`` float32 values,
qwen35-target.md §7; spec-loop.md §6). Position p lives in slot ``p % capacity``. The ring remembers
which position each slot holds, so a read of a position that was never written or has been
overwritten is an error instead of silently returning another position's row.

The rows live in a numpy buffer, by default a private one; ``buffer=`` accepts any float32 array of
the right shape, e.g. a view of shared memory that another process reads. The slot bookkeeping
(:func:`write_slots`, :func:`held_slots`) is shared with the rings whose rows live elsewhere (the
device ring of :mod:`.feature_cuda_ipc`).
"""
from __future__ import annotations

import numpy as np


def write_slots(capacity: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, positions), int64 [n] each, for writing n rows at positions start .. start+n-1 of a ring
    of ``capacity`` slots. ValueError when start < 0 or n > capacity (a write would overwrite itself)."""
    if start < 0 or n < 0 or n > capacity:
        raise ValueError(f"FeatureRing.write: start {start} / {n} rows do not fit a ring of {capacity}")
    pos = start + np.arange(n, dtype=np.int64)
    return pos % capacity, pos


SMALL_SPAN = 64  # held_span checks up to this many rows with Python lists, more with numpy


def held_span(slot_pos: np.ndarray, start: int, n: int) -> slice | None:
    """The slots holding positions start .. start+n-1 as one slice when they are one run of slots (the
    range does not wrap) and every one holds its position, else None (then :func:`held_slots` gives
    the slots or names the positions missing). The common read: a few rows, no numpy temporaries."""
    capacity = slot_pos.shape[0]
    first = start % capacity
    if start < 0 or n <= 0 or first + n > capacity:
        return None
    held = slot_pos[first:first + n]
    if n <= SMALL_SPAN:  # Python lists beat numpy temporaries for the usual few rows
        ok = held.tolist() == list(range(start, start + n))
    else:  # a whole prompt's rows: one vectorised comparison, not an n-long Python list
        ok = np.array_equal(held, np.arange(start, start + n))
    return slice(first, first + n) if ok else None


def held_slots(slot_pos: np.ndarray, start: int, n: int) -> np.ndarray:
    """Slots (int64 [n]) holding positions start .. start+n-1 according to the slot table ``slot_pos``
    (int64 [capacity], -1 = empty). ValueError naming the first positions that were never written or
    have been overwritten by a later position."""
    capacity = slot_pos.shape[0]
    pos = start + np.arange(n, dtype=np.int64)
    slots = pos % capacity
    missing = pos[slot_pos[slots] != pos]
    if start < 0 or missing.size:
        raise ValueError(f"FeatureRing.read: positions {missing[:8].tolist()} are not in the ring")
    return slots


def row_runs(dst_rows: np.ndarray, src_rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(dst_start, src_start, length) runs in which both ``dst_rows`` and ``src_rows`` advance by 1:
    the copies that move rows src_rows[i] to dst_rows[i] (a chain's rows: one run per ring wrap)."""
    out: list[tuple[int, int, int]] = []
    for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


def checked_src_rows(src, src_rows, width: int) -> np.ndarray:
    """``src_rows`` as int64 [n] after checking them against ``src``, a float32 ``sn.Tensor`` [w, width]
    (any device): ValueError on another shape or dtype, or an index outside 0..w-1."""
    import specd.native as sn

    src_rows = np.asarray(src_rows, np.int64).reshape(-1)
    if len(src.shape) != 2 or int(src.shape[1]) != width or src.dtype != sn.DType.F32:
        raise ValueError(f"FeatureRing.write_rows: src must be float32 [w, {width}], "
                         f"got {src.dtype} {tuple(src.shape)}")
    if src_rows.size and (src_rows.min() < 0 or src_rows.max() >= int(src.shape[0])):
        raise ValueError(f"FeatureRing.write_rows: row indices outside 0..{int(src.shape[0]) - 1}")
    return src_rows


def copy_rows_into(dst: np.ndarray, dst_rows: np.ndarray, src, src_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]]: ``dst`` a float32 host array, ``src`` an ``sn.Tensor`` on any
    device (checked by :func:`checked_src_rows`); one ``sn.copy_rows`` per run, so from a GPU tensor
    only these rows cross to the host, straight into ``dst`` (each run one synchronous copy: a chain's
    rows are one run, a tree path's a few)."""
    import specd.native as sn

    if not len(dst_rows):
        return
    view = sn.Tensor(dst)
    for d, s, n in row_runs(dst_rows, src_rows):
        sn.copy_rows(view, d, src, s, n, across_devices=True)


def stage_into(ring, start: int, src, src_rows, copy) -> tuple[int, np.ndarray, np.ndarray]:
    """The staging every ring shares (``FeatureRing.stage_rows``, the cuda-ipc ring's): checks, then
    the slots of positions start .. start+n-1 marked empty (-1: a read of a position they held is an
    error, never a new row) before ``copy(slots, src_rows)`` moves the rows into them. Returns
    (start, slots, positions) for the ring's ``publish_rows``; ValueError (before anything moves) as
    :func:`checked_src_rows` and :func:`write_slots`."""
    src_rows = checked_src_rows(src, src_rows, ring.width)
    slots, pos = write_slots(ring.capacity, start, int(src_rows.size))
    if src_rows.size:
        ring.all_zero = False  # before the copies: one failing part-way has written rows
        ring.slot_pos[slots] = -1
        copy(slots, src_rows)
    return start, slots, pos


class FeatureRing:
    """Ring of ``capacity`` feature rows of ``width`` float32 values.

    Args:
        capacity: number of slots (positions kept); must be > 0.
        width: values per row (n_taps * n_embd); must be > 0.
        buffer: optional float32 array of shape (capacity, width) to use as storage (e.g. a view of
            shared memory); a new zeroed array otherwise.

    ``all_zero``: every row is zero (a new ring without ``buffer``, or a subclass whose storage starts
    zeroed, and only :meth:`write_zeros` since); :meth:`write_zeros` then moves the slot table alone.
    """

    def __init__(self, capacity: int, width: int, buffer: np.ndarray | None = None):
        if capacity <= 0 or width <= 0:
            raise ValueError(f"FeatureRing: capacity and width must be > 0, got {capacity} and {width}")
        self.all_zero = buffer is None  # every row is zero (a new ring; write_zeros keeps it so)
        if buffer is None:
            buffer = np.zeros((capacity, width), np.float32)
        if buffer.shape != (capacity, width) or buffer.dtype != np.float32:
            raise ValueError(f"FeatureRing: buffer must be float32 {(capacity, width)}, got {buffer.dtype} {buffer.shape}")
        self.capacity, self.width, self.rows = capacity, width, buffer
        self.slot_pos = np.full(capacity, -1, np.int64)  # absolute position held by each slot

    def write(self, start: int, rows: np.ndarray) -> None:
        """Stores ``rows`` (float32 [n, width]) at positions start .. start+n-1 (n <= capacity)."""
        rows = np.asarray(rows, np.float32)
        n = rows.shape[0]
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"FeatureRing.write: rows must be [n, {self.width}], got {rows.shape}")
        self.all_zero = False
        first = start % self.capacity if start >= 0 else 0
        if start >= 0 and first + n <= self.capacity:  # one run of slots (no wrap): slices, no index arrays
            self.rows[first:first + n] = rows
            self.slot_pos[first:first + n] = np.arange(start, start + n)
            return
        slots, pos = write_slots(self.capacity, start, n)
        self.rows[slots] = rows
        self.slot_pos[slots] = pos

    def write_rows(self, start: int, src, src_rows) -> None:
        """Positions start .. start+n-1 get rows ``src_rows`` (n indices into the first axis) of ``src``,
        a float32 ``sn.Tensor`` [w, width] on any device, copied straight into this ring's rows
        (:func:`copy_rows_into`): for a verify's GPU features only the committed rows cross to the host,
        and no host copy of the whole output is made. :meth:`stage_rows` then :meth:`publish_rows`.
        ValueError as :func:`checked_src_rows` and :meth:`write`."""
        self.publish_rows(self.stage_rows(start, src, src_rows))

    def stage_rows(self, start: int, src, src_rows):
        """The first half of :meth:`write_rows`: the rows are copied into their slots, which read as
        empty until :meth:`publish_rows` (a read of a position they held is an error, never a new row).
        A commit stages before its state updates and publishes after them, so a failure between
        publishes nothing. Returns the staged write for :meth:`publish_rows`. ValueError (before
        anything moves) as :meth:`write_rows`."""
        return stage_into(self, start, src, src_rows,
                          lambda slots, rows: copy_rows_into(self.rows, slots, src, rows))

    def publish_rows(self, staged) -> None:
        """The second half of :meth:`write_rows`: the staged positions become readable."""
        _, slots, pos = staged
        self.slot_pos[slots] = pos

    def write_zeros(self, start: int, n: int) -> None:
        """Positions start .. start+n-1 get zero rows (the features of a target without capture layers),
        without touching rows that are zero already: a prefill chunk's are tens of MB. ValueError as
        :meth:`write`."""
        slots, pos = write_slots(self.capacity, start, n)
        if not self.all_zero:
            self.rows[slots] = 0.0
        self.slot_pos[slots] = pos

    def read(self, start: int, n: int) -> np.ndarray:
        """Rows of positions start .. start+n-1 (a copy); ValueError if any is not held."""
        span = held_span(self.slot_pos, start, n)
        return self.rows[held_slots(self.slot_pos, start, n) if span is None else span].copy()
