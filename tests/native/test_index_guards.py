"""Host-side contracts of the index ops' `trusted` flag, views and the GPU staging / graph API in a
build or on a machine without a usable GPU (the device behaviour is in tests/gpu/test_gpu_graph.py).

`trusted` only skips the read-back of GPU index tensors; CPU index values are always checked (at no
cost), so a trusted CPU call still raises ValueError on a bad index."""
import numpy as np
import pytest

import specd.native as sn


def test_trusted_cpu_indices_are_still_checked():
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(sn.embedding(w, np.array([3, 0], np.int32), trusted=True).numpy(), w[[3, 0]])
    with pytest.raises(ValueError, match=r"ids\[1\] = 4 is out of range"):
        sn.embedding(w, np.array([0, 4], np.int32), trusted=True)
    cache = np.zeros((4, 1, 8), np.float32)
    x = np.ones((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        sn.kv_write(cache, x, np.array([1, 4], np.int32), trusted=True)
    with pytest.raises(ValueError, match="distinct"):
        sn.kv_write(cache, x, np.array([1, 1], np.int32), trusted=True)
    sn.kv_write(cache, x, np.array([0, 2], np.int32), trusted=True)
    assert cache[[0, 2]].sum() == 16 and cache[[1, 3]].sum() == 0
    q = np.ones((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="q_pos must be >= 0"):
        sn.attention(q, cache, cache, 4, np.array([-1], np.int32), trusted=True)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        sn.rope_neox(x, np.array([0, -2], np.int32), 8, 10000.0, trusted=True)


def test_view_rows_shares_memory():
    a = np.arange(12, dtype=np.int32).reshape(6, 2)
    t = sn.Tensor(a)
    v = t.view_rows(2, 5)
    assert v.shape == (3, 2)
    np.testing.assert_array_equal(v.numpy(), a[2:5])
    a[3, 0] = -7
    assert v.numpy()[1, 0] == -7  # a view, not a copy
    assert t.view_rows(6, 6).shape == (0, 2)
    flat = sn.Tensor(np.arange(5, dtype=np.int32)).view_rows(1, 4)
    np.testing.assert_array_equal(flat.numpy(), [1, 2, 3])
    with pytest.raises(ValueError, match=r"view_rows: \[4, 7\) is not a range within 0..6"):
        t.view_rows(4, 7)
    with pytest.raises(ValueError, match="must be contiguous"):
        sn.Tensor(np.zeros((4, 4), np.float32)[:, ::2]).view_rows(0, 1)


def test_view_rows_of_block_formats_steps_by_block():
    """A 1-D Q8_0 tensor's rows are elements stored in 34-byte blocks of 32: a view must cover whole
    blocks and start at the block's byte offset (stepping by type_size per element read past the
    end)."""
    raw = np.arange(68, dtype=np.uint8)  # two Q8_0 blocks = 64 elements
    t = sn.Tensor(raw, sn.DType.Q8_0)
    assert t.shape == (64,)
    v = t.view_rows(32, 64)
    assert v.shape == (32,)
    np.testing.assert_array_equal(v.numpy(), raw[34:68])
    np.testing.assert_array_equal(t.view_rows(0, 32).numpy(), raw[:34])
    np.testing.assert_array_equal(t.view_rows(0, 64).numpy(), raw)
    assert t.view_rows(64, 64).shape == (0,)
    for start, stop in ((16, 48), (0, 40), (1, 32)):
        with pytest.raises(ValueError, match="block boundary"):
            t.view_rows(start, stop)
    with pytest.raises(ValueError, match="is not a range"):
        t.view_rows(32, 96)
    rows = np.arange(3 * 34, dtype=np.uint8).reshape(3, 34)  # 2-D: one block per row
    np.testing.assert_array_equal(sn.Tensor(rows, sn.DType.Q8_0).view_rows(1, 3).numpy(), rows[1:3])
    bf = np.arange(6, dtype=np.uint16)  # 1-D plain 2-byte type: element steps
    np.testing.assert_array_equal(sn.Tensor(bf, sn.DType.BF16).view_rows(2, 5).numpy(), bf[2:5])


@pytest.mark.skipif(sn.gpu_available(), reason="checks the API without a usable GPU")
def test_gpu_api_without_gpu():
    assert not sn.gpu_capturing()
    sn.gpu_graph_abort()  # no capture running: a no-op
    with pytest.raises(RuntimeError):
        sn.gpu_graph_begin()
    with pytest.raises(RuntimeError):
        sn.gpu_graph_end()
    with pytest.raises(ValueError, match="arena_bytes must be >= 0"):
        sn.gpu_graph_begin(-1)
    with pytest.raises(ValueError, match="dst must be a GPU tensor"):
        sn.gpu_write_async(sn.Tensor(np.zeros(3, np.int32)), np.zeros(3, np.int32))
