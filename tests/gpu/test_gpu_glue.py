"""Tensor glue ops (sn.slice / concat / copy / copy_rows) on the GPU and the CPU against numpy:
exact byte copies. The CPU cases always run; the GPU cases are skipped without a GPU
(SPECD_TEST_GPU_DRYRUN=1 runs them on CPU tensors)."""
import os

import numpy as np
import pytest

import specd.native as sn

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
HAVE_GPU = sn.gpu_available() or DRYRUN
DEVICES = ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="no GPU")])]


def put(a, dev, dtype=None):
    t = sn.Tensor(np.array(a, copy=True, order="C")) if dtype is None else sn.Tensor(np.array(a, copy=True), dtype)
    return t.to(sn.Device.GPU) if dev == "gpu" and not DRYRUN else t


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_slice_concat_copy(rng, dev, dtype):
    x = (rng.standard_normal((3, 5, 7)) * 100).astype(dtype)
    t = put(x, dev)
    for axis in (0, 1, 2, -1):
        n = x.shape[axis]
        for start, stop in [(0, n), (1, n - 1), (n - 1, n), (2, 2)]:
            got = sn.slice(t, axis, start, stop)
            assert got.device == t.device
            np.testing.assert_array_equal(got.numpy(), np.take(x, range(start, stop), axis=axis))
        y = (rng.standard_normal(x.shape) * 100).astype(dtype)
        got = sn.concat([t, put(y, dev), t], axis)
        np.testing.assert_array_equal(got.numpy(), np.concatenate([x, y, x], axis=axis))
    np.testing.assert_array_equal(sn.copy(t).numpy(), x)


@pytest.mark.parametrize("dev", DEVICES)
def test_copy_rows_q8_0_cache(rng, dev):
    raw = rng.integers(0, 256, (6, 2, 34), dtype=np.uint8).reshape(6, 68)
    cache = put(raw.reshape(6, 1, 68), dev, sn.DType.Q8_0)
    assert cache.shape == (6, 1, 64)
    sn.copy_rows(cache, 1, cache, 4, 2)
    want = raw.copy()
    want[1:3] = raw[4:6]
    np.testing.assert_array_equal(cache.numpy().reshape(6, 68), want)


@pytest.mark.parametrize("dev", DEVICES)
def test_glue_bad_input(dev):
    t = put(np.zeros((3, 4), np.float32), dev)
    with pytest.raises(ValueError, match="slice"):
        sn.slice(t, 0, 2, 5)
    with pytest.raises(ValueError, match="slice"):
        sn.slice(t, 2, 0, 1)
    with pytest.raises(ValueError, match="concat"):
        sn.concat([t, put(np.zeros((3, 5), np.float32), dev)], 0)
    with pytest.raises(ValueError, match="concat"):
        sn.concat([t, put(np.zeros((3, 4), np.int32), dev)], 0)
    with pytest.raises(ValueError, match="concat"):
        sn.concat([], 0)
    with pytest.raises(ValueError, match="copy_rows"):
        sn.copy_rows(t, 2, t, 0, 2)
    q = put(np.zeros((2, 34), np.uint8), dev, sn.DType.Q8_0)
    with pytest.raises(ValueError, match="blocks"):
        sn.slice(q, -1, 0, 32)
