"""Tensor glue ops (sn.slice / concat / copy / copy_rows / copy_tensors) on the GPU and the CPU against numpy:
exact byte copies. The CPU cases always run; the GPU cases are skipped without a GPU
(SPECD_TEST_GPU_DRYRUN=1 runs them on CPU tensors). copy_tensors' GPU kernel also runs in host emulation
(host_emu/copy_main.cpp) with copy.cu's launch plan, on every machine."""
import os
import subprocess
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_emu_build import build_emu  # noqa: E402

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


# (pairs, shapes): a commit of the 27B's 48 GDN layers (each state, then each conv state: two sizes in one launch);
# 70 pairs (two launches); byte shapes whose sizes are not whole 16-byte words (a copy each); none.
@pytest.mark.parametrize("pairs,shapes,dtype", [(96, [(48, 16, 16), (3, 320)], np.float32),
                                                (70, [(5, 8)], np.float32), (3, [(7,), (13, 3)], np.float16),
                                                (0, [], np.float32)])
@pytest.mark.parametrize("dev", DEVICES)
def test_copy_tensors(rng, dev, pairs, shapes, dtype):
    srcs = [(rng.standard_normal(shapes[i % len(shapes)]) * 100).astype(dtype) for i in range(pairs)]
    before = [np.full_like(x, 7) for x in srcs]
    dst_t, src_t = [put(x, dev) for x in before], [put(x, dev) for x in srcs]
    sn.copy_tensors(dst_t, src_t)
    for d, s, x in zip(dst_t, src_t, srcs):
        np.testing.assert_array_equal(d.numpy(), x)
        np.testing.assert_array_equal(s.numpy(), x)  # sources untouched


@pytest.mark.parametrize("dev", DEVICES)
def test_copy_tensors_unaligned_views(rng, dev):
    """Views whose addresses are not multiples of 16 bytes (sizes that are) take a copy of their own beside the
    kernel's aligned pairs, in one call."""
    x = (rng.standard_normal((12, 1)) * 100).astype(np.float32)
    src, dst, dst2 = put(x, dev), put(np.zeros((12, 1), np.float32), dev), put(np.zeros((8, 4), np.float32), dev)
    big = (rng.standard_normal((8, 4)) * 100).astype(np.float32)
    sn.copy_tensors([dst.view_rows(1, 5), dst2], [src.view_rows(5, 9), put(big, dev)])  # 16 bytes at +4, aligned
    want = np.zeros((12, 1), np.float32)
    want[1:5] = x[5:9]
    np.testing.assert_array_equal(dst.numpy(), want)
    np.testing.assert_array_equal(dst2.numpy(), big)


@pytest.fixture(scope="module")
def copy_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "copy_emu", ["copy_many.cuh", "pdl.cuh"], "copy_main.cpp")


# word counts (16 bytes each): ragged sizes around a block's 1024 words with empty copies between; a commit's 96
# copies of two sizes in one launch (the 27B's: 48 states of 196608 words, 48 conv states of 7680; smaller here);
# 130 copies (two launches of 128 + 2); empty copies only (no launch); one word
@pytest.mark.parametrize("words", [[5000, 1, 0, 1024, 0, 1025, 3000, 0], [2000] * 48 + [77] * 48,
                                   list(range(1, 131)), [0, 0], [1]])
def test_copy_many_kernel_emulated(copy_emu, words):
    """copy_many_kernel with copy.cu's plan: every destination word equals its source's, none written past it; each
    copy over its own blocks (about 1024 words a block), 128 copies a launch."""
    d, exe = copy_emu
    r = subprocess.run([str(exe), *map(str, words)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    blocks = sum(-(-w // 1024) for w in words)
    launches = sum(1 for c0 in range(0, len(words), 128) if any(words[c0:c0 + 128]))
    assert r.stdout.strip() == f"launches={launches} blocks={blocks}"


@pytest.mark.parametrize("dev", DEVICES)
def test_copy_tensors_bad_input(dev):
    """Every pair is checked before anything is written: a bad last pair leaves the first one's dst as it was."""
    a, b = put(np.zeros((3, 4), np.float32), dev), put(np.ones((3, 4), np.float32), dev)
    c = put(np.full((3, 4), 2, np.float32), dev)
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        sn.copy_tensors([a, b], [c])
    with pytest.raises(ValueError, match="pair 1: dst and src must have the same dtype and shape"):
        sn.copy_tensors([a, b], [c, put(np.zeros((4, 3), np.float32), dev)])
    with pytest.raises(ValueError, match="pair 1: dst and src must have the same dtype and shape"):
        sn.copy_tensors([a, b], [c, put(np.zeros((3, 4), np.int32), dev)])
    with pytest.raises(ValueError, match="pair 0: dst overlaps its src"):
        sn.copy_tensors([a], [a])
    with pytest.raises(ValueError, match="pair 0: dst is read-only"):
        ro = np.zeros((3, 4), np.float32)
        ro.setflags(write=False)
        sn.copy_tensors([ro], [np.ones((3, 4), np.float32)])
    with pytest.raises(ValueError, match=r"pair 1: dst overlaps another pair's tensor \(pair 0\)"):
        sn.copy_tensors([c, b], [b, a])  # pair 1's dst is pair 0's src
    with pytest.raises(ValueError, match=r"pair 0: dst overlaps another pair's tensor \(pair 1\)"):
        sn.copy_tensors([a, a], [b, c])  # two pairs write one tensor
    if dev == "gpu" and not DRYRUN:
        with pytest.raises(ValueError, match="pair 1: every tensor must be on pair 0's device"):
            sn.copy_tensors([a, b], [c, np.zeros((3, 4), np.float32)])
    np.testing.assert_array_equal(a.numpy(), 0)
    np.testing.assert_array_equal(b.numpy(), 1)


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


@pytest.mark.gpu
@pytest.mark.skipif(not sn.gpu_available(), reason="no GPU")
def test_copy_rows_across_devices(rng):
    """copy_rows between the CPU and the GPU (across_devices=True; refused without it) moves just the n
    rows (each way), into a host array's own memory (the feature ring's case: a verify's committed rows
    into shared memory); the other rows of the destination stay as they were, and a mismatched dtype,
    shape or range is refused before anything moves."""
    x = (rng.standard_normal((6, 5)) * 100).astype(np.float32)
    gpu = sn.Tensor(x).to(sn.Device.GPU)
    host = np.full((8, 5), 7.0, np.float32)
    with pytest.raises(ValueError, match="different devices"):  # only when asked for
        sn.copy_rows(sn.Tensor(host), 3, gpu, 1, 4)
    sn.copy_rows(sn.Tensor(host), 3, gpu, 1, 4, across_devices=True)  # device to host, straight into `host`
    want = np.full((8, 5), 7.0, np.float32)
    want[3:7] = x[1:5]
    np.testing.assert_array_equal(host, want)
    sn.copy_rows(gpu, 0, sn.Tensor(host), 6, 2, across_devices=True)  # host to device
    np.testing.assert_array_equal(gpu.numpy(), np.concatenate([want[6:8], x[2:]]))
    sn.copy_rows(sn.Tensor(host), 0, gpu, 0, 0, across_devices=True)  # nothing
    for dst, match in ((sn.Tensor(host), "out of range"), (sn.Tensor(host.astype(np.float16)), "dst is F16"),
                       (sn.Tensor(np.zeros((8, 4), np.float32)), "same shape")):
        with pytest.raises(ValueError, match=match):
            sn.copy_rows(dst, 6, gpu, 0, 3 if match == "out of range" else 1, across_devices=True)
    ro = host.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="copy_rows"):
        sn.copy_rows(sn.Tensor(ro), 0, gpu, 0, 1, across_devices=True)
    np.testing.assert_array_equal(host, want)  # no refused copy wrote anything
