"""The host feature rings (specd.target_worker.features, .feature_shm): a range of positions held in one
run of slots is written and read through slices (held_span), a range across the wrap through index
arrays; both give the same rows, and a position overwritten, never written or not committed is an
error either way."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from specd.protos.v1 import worker_pb2 as pb
from specd.target_worker.feature_inline import InlineFeatureWriter
from specd.target_worker.feature_shm import FeatureHandleInfo, FeatureWriter, attach_reader
from specd.target_worker.features import FeatureRing, held_slots, held_span

from .test_memory import tiny_iq4xs  # noqa: F401 - fixture

W = 5


def rows(start: int, n: int) -> np.ndarray:
    return (np.arange(start, start + n, dtype=np.float32)[:, None] * 10 + np.arange(W, dtype=np.float32))


@contextlib.contextmanager
def ring_of(kind: str, name: str, capacity: int = 8, width: int = W):
    """(ring, reader) of ``capacity`` slots of ``width``: "private" (one FeatureRing, its own reader),
    "shm" (a segment and a reader attached to it) or "inline" (reader None: its rows travel in an
    outbox). Segments are unlinked afterwards."""
    writer = FeatureWriter() if kind == "shm" else InlineFeatureWriter() if kind == "inline" else None
    reader = None
    try:
        if kind == "private":
            ring = reader = FeatureRing(capacity, width)
        else:
            ring, handle = writer.create(name, capacity, width)
            if kind == "shm":
                reader = attach_reader(FeatureHandleInfo.from_proto(handle.to_proto(pb)))
        yield ring, reader
    finally:
        if reader is not None and reader is not ring:
            reader.close()
        if writer is not None:
            writer.close_all()


def test_held_span_is_a_slice_only_for_one_run_of_held_slots():
    table = np.full(4, -1, np.int64)
    table[[2, 3, 0]] = [6, 7, 8]  # positions 6, 7, 8 in slots 2, 3, 0
    assert held_span(table, 6, 2) == slice(2, 4)
    assert held_span(table, 8, 1) == slice(0, 1)
    assert held_span(table, 7, 2) is None and held_slots(table, 7, 2).tolist() == [3, 0]  # across the wrap
    assert held_span(table, 5, 2) is None  # position 5 is not held (slot 1 empty)
    assert held_span(table, 2, 1) is None  # slot 2 holds 6: position 2 was overwritten
    assert held_span(table, -1, 1) is None and held_span(table, 6, 0) is None
    big = np.arange(900, 1200, dtype=np.int64)  # 300 slots, slot i holds 900 + i: past SMALL_SPAN rows (numpy)
    assert held_span(big, 900, 300) == slice(0, 300) and held_span(big, 1000, 150) == slice(100, 250)
    big[200] = 1400  # slot 200's position 1100 overwritten by a later one
    assert held_span(big, 900, 300) is None and held_span(big, 900, 200) == slice(0, 200)
    assert held_span(big, 1101, 99) == slice(201, 300) and held_span(big, 899, 100) is None  # the last wraps


@pytest.mark.parametrize("ring_kind", ["private", "shm"])
def test_rings_read_the_same_rows_through_slices_and_index_arrays(ring_kind):
    with ring_of(ring_kind, "ring-test") as (ring, reader):
        ring.write(0, rows(0, 6))  # slots 0..5 (one run)
        ring.write(6, rows(6, 4))  # positions 6..9 -> slots 6, 7, 0, 1 (across the wrap: 0, 1 overwritten)
        np.testing.assert_array_equal(reader.read(2, 4), rows(2, 4))  # one run
        np.testing.assert_array_equal(reader.read(5, 5), rows(5, 5))  # across the wrap
        np.testing.assert_array_equal(reader.read(8, 2), rows(8, 2))  # one run after the wrap
        assert ring.slot_pos.tolist() == [8, 9, 2, 3, 4, 5, 6, 7]
        with pytest.raises(ValueError, match="not in the ring|overwritten or never written"):
            reader.read(0, 2)
        with pytest.raises(ValueError, match="not in the ring|overwritten or never written"):
            reader.read(1, 3)
        if ring_kind == "shm":
            with pytest.raises(ValueError, match="not committed"):
                reader.read(9, 2)


@pytest.mark.parametrize("ring_kind", ["private", "shm", "inline"])
def test_write_zeros_holds_zero_rows_and_clears_written_ones(ring_kind):
    """write_zeros (the features of a target without capture layers) holds its positions with zero rows;
    while the ring has only ever held zeros it copies nothing, and after a write of real rows it clears
    the slots it takes (the inline ring sends the zero rows in its outbox)."""
    with ring_of(ring_kind, "zeros-test") as (ring, reader):
        ring.write_zeros(0, 0)  # nothing held, nothing published
        assert ring_kind == "inline" and not ring.take() or ring_kind != "inline" and (ring.slot_pos == -1).all()
        ring.write_zeros(0, 6)
        if ring_kind == "inline":
            ring.write(6, rows(6, 2))
            ring.write_zeros(8, 3)
            outbox = ring.take()
            assert [s for s, _ in outbox] == [0] and outbox[0][1].shape == (11, W)
            with pytest.raises(ValueError, match="do not fit"):
                ring.write_zeros(11, 9)
            np.testing.assert_array_equal(outbox[0][1], np.concatenate([np.zeros((6, W)), rows(6, 2), np.zeros((3, W))]))
            return
        assert ring.all_zero and ring.slot_pos.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
        np.testing.assert_array_equal(reader.read(0, 6), np.zeros((6, W), np.float32))
        ring.write(6, rows(6, 4))  # slots 6, 7, 0, 1
        assert not ring.all_zero
        ring.write_zeros(10, 3)  # positions 10..12 -> slots 2, 3, 4 (zero already)
        ring.write_zeros(13, 2)  # slots 5, 6: slot 6 held row 6
        np.testing.assert_array_equal(reader.read(7, 8), np.concatenate([rows(7, 3), np.zeros((5, W), np.float32)]))
        with pytest.raises(ValueError, match="do not fit"):
            ring.write_zeros(15, 9)
        ring.write_zeros(15, 0)
        np.testing.assert_array_equal(ring.slot_pos, [8, 9, 10, 11, 12, 13, 14, 7])


@pytest.mark.parametrize("ring_kind", ["private", "shm", "inline"])
def test_write_rows_copies_a_tensors_rows_straight_into_the_ring(ring_kind):
    """write_rows (a verify's feature tensor at commit): rows src_rows of an sn.Tensor land at
    consecutive positions, one sn.copy_rows per run of slots and source rows (a chain's leading rows,
    a tree path's scattered ones, a range across the wrap); the shm ring publishes them. A bad width,
    dtype or row index is a ValueError that leaves the slot table and published count as they were."""
    import specd.native as sn

    with ring_of(ring_kind, "rows-test") as (ring, reader):
        src = rows(100, 6)  # a verify's 6 rows
        ring.write_rows(0, sn.Tensor(src), range(4))  # a chain's 4 accepted rows
        ring.write_rows(4, sn.Tensor(src), [0, 2, 3, 5])  # a tree path
        ring.write_rows(8, sn.Tensor(src), np.array([1, 2, 3], np.int64))  # positions 8..10: slots 0..2 (wrap)
        ring.write_rows(11, sn.Tensor(src), [])
        want = np.concatenate([src[:4], src[[0, 2, 3, 5]], src[1:4]])
        for bad, match in ((sn.Tensor(rows(0, 3)[:, :3].copy()), "float32"),
                           (sn.Tensor(src.astype(np.float16)), "float32"), (sn.Tensor(src), "outside")):
            with pytest.raises(ValueError, match=match):
                ring.write_rows(11, bad, [0, 6] if match == "outside" else [0])
        with pytest.raises(ValueError, match="do not fit"):
            ring.write_rows(11, sn.Tensor(np.zeros((9, W), np.float32)), range(9))
        if ring_kind == "inline":
            outbox = ring.take()
            assert [s for s, _ in outbox] == [0]
            np.testing.assert_array_equal(outbox[0][1], want)
            return
        assert ring.slot_pos.tolist() == [8, 9, 10, 3, 4, 5, 6, 7] and not ring.all_zero
        np.testing.assert_array_equal(reader.read(3, 8), want[3:])
        if ring_kind == "shm":
            assert reader.committed == 11
            got = reader.read(3, 5)  # one run of slots: a read-only view of the segment, no copy
            assert not got.flags.writeable and np.shares_memory(got, reader.rows)
            np.testing.assert_array_equal(got, want[3:8])
            wrapped = reader.read(6, 4)  # across the wrap: a gathered copy
            assert not np.shares_memory(wrapped, reader.rows)
            np.testing.assert_array_equal(wrapped, want[6:10])
            del got


@pytest.mark.parametrize("ring_kind", ["private", "shm", "inline"])
def test_commit_copies_a_device_feature_tensor_straight_into_the_host_ring(tiny_iq4xs, ring_kind, monkeypatch):
    """Qwen35Model.commit with the verify's features as a tensor (the GPU's; a CPU sn.Tensor stands in)
    and a host ring of each kind: the ring gets exactly the rows the host-array path gives (a prompt's
    rows, a chain's accepted rows, a tree path), the tensor is never downloaded whole
    (``raw_features`` stays a tensor; only the committed rows cross: a spy counts sn.copy_rows' rows),
    and a state update failing between the rows' copy and their publication publishes nothing: the
    retried commit publishes them once."""
    import specd.native as sn
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.model import Qwen35Model

    def published(ring):
        if ring_kind == "inline":
            return [(s, r.copy()) for s, r in ring.outbox]
        return ring.slot_pos.copy(), (int(ring.header[3]) if ring_kind == "shm" else None)

    def boom(*args):
        raise RuntimeError("boom: a state update failed")

    copied = []
    real_copy_rows = sn.copy_rows

    def counting_copy_rows(dst, dst_start, src, src_start, n=1, **kw):
        copied.append(n)
        return real_copy_rows(dst, dst_start, src, src_start, n, **kw)

    m = Qwen35Model(load_qwen35(tiny_iq4xs), capture_layers=(1, 3))
    ref, st = m.new_sequence(48), m.new_sequence(48)
    with ring_of(ring_kind, "commit-test", 48, 2 * m.hp.n_embd) as (ring, reader):
        st.features = ring
        steps = (([1, 2, 3, 4, 5, 6, 7], None, 7), ([5, 6, 7, 8], None, 2), ([9, 10, 11, 12], [-1, 0, 0, 2], [0, 2, 3]))
        for i, (tokens, parents, accept) in enumerate(steps):
            m.commit(ref, m.verify(ref, tokens, parents), accept)  # the host-array path
            res = m.verify(st, tokens, parents)
            res.raw_features = sn.Tensor(np.asarray(res.raw_features))
            monkeypatch.setattr(sn, "copy_rows", counting_copy_rows)
            if i == 1:
                before = published(ring)
                with monkeypatch.context() as mp:
                    mp.setattr(m, "_commit_states", boom)
                    with pytest.raises(RuntimeError, match="boom"):
                        m.commit(st, res, accept)
                after = published(ring)
                copied.clear()
                if ring_kind == "inline":
                    assert [(s, r.shape) for s, r in after] == [(s, r.shape) for s, r in before]
                else:
                    np.testing.assert_array_equal(after[0], before[0])
                    assert after[1] == before[1] and st.committed == 7
            m.commit(st, res, accept)
            monkeypatch.setattr(sn, "copy_rows", real_copy_rows)
            assert isinstance(res.raw_features, sn.Tensor)
            assert sum(copied) == (accept if parents is None else len(accept))  # these rows alone crossed
            copied.clear()
        want = ref.features.read(0, 12)
        assert st.committed == ref.committed == 12 and (np.abs(want).max(1) > 0).all()  # real rows, not zeros
        if ring_kind == "inline":
            outbox = ring.take()
            assert [s for s, _ in outbox] == [0]
            np.testing.assert_array_equal(outbox[0][1], want)
        else:
            np.testing.assert_array_equal(reader.read(0, 12), want)
            assert ring_kind == "private" or reader.committed == 12


def test_a_reader_closed_under_a_live_view_keeps_the_mapping_until_the_view_goes():
    """A row view from FeatureReader.read pins the segment's mapping: closing the reader (or the writer
    unlinking the segment) while it is alive keeps the memory mapped and readable (before, close()
    unmapped it and touching the view crashed the process); the mapping closes once the view is gone."""
    from specd.target_worker import feature_shm

    with ring_of("shm", "pin-test") as (ring, reader):
        ring.write(0, rows(0, 4))
        view = reader.read(1, 2)
        mapping = reader.shm
        reader.close()
        ring_view = ring.rows[0:2]
        written = ring.shm
    # kept, not unmapped, once each (ring_of closed the reader a second time)
    assert [seg is mapping for seg in feature_shm._LINGERING].count(True) == 1 and written in feature_shm._LINGERING
    np.testing.assert_array_equal(view, rows(1, 2))  # still mapped: no crash
    np.testing.assert_array_equal(ring_view, rows(0, 2))
    del view, ring_view
    feature_shm.close_segment()  # retries the kept ones: now closed
    assert mapping not in feature_shm._LINGERING and written not in feature_shm._LINGERING
