"""sn.grouped_dynamic_conv on the GPU (native/src/gpu/dynamic_conv.cu, DFlash 2's grouped dynamic causal conv,
drafters.md §6.2) against the CPU op: bit-identical (the same F32 operations in the same order, explicit
round-to-nearest on the device, -ffp-contract=off on the host), on the cases of tests/native/
test_dynamic_conv.py (which checks the CPU op against numpy), at the 27B head's size, and with inf / NaN
(every NaN equal to every NaN: the device returns its canonical NaN). Also the GPU argument checks.

Skipped without a GPU like the other GPU tests; SPECD_TEST_GPU_DRYRUN=1 runs them with the "GPU" tensors left
on the CPU (CPU vs CPU), to check the test logic. The kernel's arithmetic without a GPU:
test_gpu_dynamic_conv_host.py (host emulation).
"""
import os
import sys

import numpy as np
import pytest

import specd.native as sn
from specd.draft_worker.model import grouped_dynamic_conv

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native"))
from test_dynamic_conv import GROUPINGS, assert_bits, inputs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_marks import DEV, DRYRUN, GPU, gpu_only  # noqa: E402


def on_gpu(a):
    t = sn.Tensor(np.array(a, copy=True, order="C"))  # a device copy: never aliases the host array
    return t if DRYRUN else t.to(GPU)


def gpu_vs_cpu(y, dyn, base, side=0):
    """The GPU op's result, after checking it bitwise against the CPU op's; returns the CPU's."""
    cpu = sn.grouped_dynamic_conv(y, dyn, base, side).numpy()
    out = sn.grouped_dynamic_conv(on_gpu(y), on_gpu(dyn), on_gpu(base), side)
    assert out.device == DEV and out.shape == cpu.shape and out.dtype == sn.DType.F32
    assert_bits(out.numpy(), cpu)
    return cpu


@pytest.mark.parametrize("L", [1, 2, 8, 17])
@pytest.mark.parametrize("taps", [1, 2, 4])
@pytest.mark.parametrize("G,gs", GROUPINGS)
@gpu_only
def test_grouped_dynamic_conv_gpu_equals_cpu(rng, L, taps, G, gs):
    y, dyn, base = inputs(rng, L, taps, G, gs)
    assert_bits(gpu_vs_cpu(y, dyn, base), grouped_dynamic_conv(y, dyn, base, gs))


@pytest.mark.parametrize("L,taps", [(1, 2), (8, 2), (3, 4), (16, 2), (17, 1)])
@pytest.mark.parametrize("side", [0, 1])
@gpu_only
def test_grouped_dynamic_conv_gpu_side_of_projection(rng, L, taps, side):
    """The 27B head's conv (H 5120, groups of 16: G 320) with dyn the projection's [L, 2, taps, G], read
    in place at `side`, and a small one."""
    for G, gs in ((320, 16), (7, 3)):
        y, D, base = inputs(rng, L, taps, G, gs, S=2)
        assert_bits(gpu_vs_cpu(y, D, base, side), grouped_dynamic_conv(y, D[:, side], base, gs))


@gpu_only
def test_grouped_dynamic_conv_gpu_many_blocks(rng):
    """More outputs than one block of threads, and a last block only partly inside: L * H = 33 * 5120 + 0,
    then 33 * 5130 (H not a multiple of the 256-thread block)."""
    for G, gs in ((320, 16), (1710, 3)):
        y, dyn, base = inputs(rng, 33, 4, G, gs)
        gpu_vs_cpu(y, dyn, base)


@gpu_only
def test_grouped_dynamic_conv_gpu_empty_block(rng):
    y, dyn, base = inputs(rng, 0, 2, 4, 3)
    out = sn.grouped_dynamic_conv(on_gpu(y), on_gpu(dyn), on_gpu(base))
    assert out.device == DEV and out.shape == (0, 12)


@pytest.mark.parametrize("where", ["y", "dyn", "base"])
@gpu_only
def test_grouped_dynamic_conv_gpu_inf_nan(rng, where):
    L, taps, G, gs = 8, 4, 5, 3
    y, dyn, base = inputs(rng, L, taps, G, gs)
    flat = {"y": y, "dyn": dyn, "base": base}[where].reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
    flat[idx] = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, np.inf] * 2, np.float32)[: idx.size]
    if where == "y":
        y[3, :] = 0.0
        dyn[4, 1, :] = np.inf
    cpu = gpu_vs_cpu(y, dyn, base)
    assert np.isnan(cpu).any() or np.isinf(cpu).any()


@gpu_only
def test_grouped_dynamic_conv_gpu_signed_zeros():
    y = np.ones((2, 4), np.float32)
    assert np.signbit(gpu_vs_cpu(y, np.full((2, 2, 2), -0.0, np.float32), np.full((2, 4), -0.0, np.float32))).all()


@pytest.mark.skipif(DRYRUN or not sn.gpu_available(), reason="needs a GPU (device mismatches)")
@pytest.mark.gpu
def test_grouped_dynamic_conv_gpu_errors(rng):
    y, dyn, base = inputs(rng, 4, 2, 5, 3)
    yg, dg, bg = on_gpu(y), on_gpu(dyn), on_gpu(base)
    op = "grouped_dynamic_conv"
    # y's device picks the backend: the other arguments must be on it
    for args, msg in [((y, dyn, bg), "base must be on the CPU"), ((yg, dyn, bg), "dyn must be on the GPU"),
                      ((yg, dg, base), "base must be on the GPU"), ((y, dg, base), "dyn must be on the CPU"),
                      ((yg, on_gpu(dyn.astype(np.float16)), bg), "dyn must be F32"),
                      ((yg, dg, on_gpu(base[:1])), r"base must be \[taps, H\] = \[2, 15\]"),
                      ((yg, on_gpu(np.zeros((4, 2, 4), np.float32)), bg), "y's H = 15 must be a multiple of dyn's G = 4"),
                      ((on_gpu(y[:3]), dg, bg), "dyn must have y's L = 3 rows")]:
        with pytest.raises(ValueError, match=f"{op}: {msg}"):
            sn.grouped_dynamic_conv(*args)
    with pytest.raises(ValueError, match=f"{op}: side 1 out of range"):
        sn.grouped_dynamic_conv(yg, dg, bg, 1)
