"""Split-K partials handed from one matmul op to the next on the GPU (``partials=True`` /
``in_partials=True``, native/src/gpu/partials.cuh): the tensor-core GEMV's per-split sums left for the op
that reads its output, which sums them itself (the norm fused with the next GEMV's x split over a
thread-block cluster, norm_split_partials_kernel; the SwiGLU split), so the GEMV's sum kernel is not
launched. Everything is checked bit for bit against the same ops on the summed values (sum_partials, whose
order is the GEMV's own sum kernel's: tests/gpu/test_gpu_matmul.py checks those ops against the CPU).

Skipped (marked ``gpu``) unless ``specd.native.gpu_available()``."""
import os
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "native"))
from quant_blocks import random_blocks  # noqa: E402

GPU = sn.Device.GPU
HAVE_GPU = sn.gpu_available()


def gpu_only(f):
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)


def bits(t):
    return t.numpy().view(np.uint32)


def weight(rng, name, out, k):
    """A GPU weight [out, k] of format `name` (random valid blocks; *_TILED: tiled for the GEMV)."""
    base = name[: -len("_TILED")] if name.endswith("_TILED") else name
    if base == "F32":
        w = sn.Tensor(np.ascontiguousarray((rng.standard_normal((out, k)) * 0.05).astype(np.float32))).to(GPU)
    else:
        w = sn.Tensor(np.ascontiguousarray(random_blocks(rng, base, out, k)), getattr(sn.DType, base)).to(GPU)
    return sn.tile_for_gemv(w) if name.endswith("_TILED") else w


def gpu(a):
    return sn.Tensor(np.ascontiguousarray(a, np.float32)).to(GPU)


def partials(rng, s, n, d):
    """Random partials [s, n, d] spanning several binades (so the order of the adds shows in the bits)."""
    return gpu(rng.standard_normal((s, n, d)) * 2.0 ** rng.integers(-6, 7, (s, n, d)))


def assert_same(got, want, what):
    assert got.shape == want.shape and np.array_equal(bits(got), bits(want)), what


@gpu_only
def test_partials_outputs_sum_to_the_outputs_on_gpu(rng):
    """partials=True: each output of the four fused ops comes as [S, n, out] whose sum_partials is the
    output bit for bit; S is the GEMV's split count (several for a weight of few rows and many inputs, 1 for
    a float weight, for 17 rows (GEMV slices) and for the BF16 GEMM of exact=False)."""
    d, heads = 2048, 16
    all_names = ["IQ4_XS_TILED", "Q6_K_TILED", "Q8_0", "F32"]
    all_ws = [weight(rng, name, 64, d) for name in all_names]
    nw = gpu(1.0 + 0.1 * rng.standard_normal(d))
    # without the F32 weight the ops' fused paths (the GEMV on the op's own x split); with it the compositions
    cases = [(all_names[:3], all_ws[:3], n, exact) for n, exact in ((1, True), (2, True), (7, True), (16, True))]
    cases += [(all_names, all_ws, n, exact) for n, exact in ((1, True), (16, True), (17, True), (40, False))]
    for names, ws, n, exact in cases:
        x, r = gpu(rng.standard_normal((n, d))), gpu(rng.standard_normal((n, d)))
        a, z = (gpu(rng.standard_normal((n, heads, d // heads))) for _ in range(2))
        calls = {
            "rms_norm_matmul": lambda **kw: sn.rms_norm_matmul(x, nw, 1e-6, ws, residual=r, exact=exact, **kw)[0],
            "swiglu_matmul": lambda **kw: sn.swiglu_matmul(x, r, ws, exact=exact, **kw),
            "mul_sigmoid_matmul": lambda **kw: sn.mul_sigmoid_matmul(a, z, ws, exact=exact, **kw),
            "rms_norm_gated_matmul": lambda **kw: sn.rms_norm_gated_matmul(a, None, 1e-6, z, ws,
                                                                          exact=exact, **kw),
        }
        for op, call in calls.items():
            for name, p, y in zip(names, call(partials=True), call()):
                assert p.shape[1:] == y.shape, (op, name, n)
                several = n <= 16 and name != "F32"
                assert (p.shape[0] > 1) == several, (op, name, n, p.shape)
                assert_same(sn.sum_partials(p), y, (op, name, n))


# (d, weight formats, whether the cluster norm serves d): the 27B's 5120 (a cluster of 5 blocks of 128 threads
# per row), 1024 (2 blocks), 8192 (8 blocks, two float4 items per thread), 4000 (Q8_0: 1000 float4 items under
# 1024 threads, a ragged last split group), 8000 (ragged with two items per thread), 6144 (6 blocks), 512 (128
# threads: one block, no cluster: the partials summed first).
NORM_CASES = [(5120, ["IQ4_XS_TILED", "Q6_K_TILED"], True), (1024, ["Q4_K", "Q8_0"], True),
              (8192, ["Q8_0"], True), (4000, ["Q8_0"], True), (8000, ["Q8_0"], True), (6144, ["Q5_K"], True),
              (512, ["IQ4_XS"], False)]


@pytest.mark.parametrize("d,names,cluster", NORM_CASES)
@gpu_only
def test_rms_norm_matmul_on_partials_equals_it_on_their_sum(rng, d, names, cluster):
    """in_partials=True: rms_norm_matmul on partials [S, n, d] gives bit for bit (outputs and h) what it gives
    on sum_partials of them, for S = 1, 2, 6, 17, n = 1..16 and 17, with and without a residual and a norm
    weight, and with partials=True handed on; an inf in one part makes that row non-finite as the sum does.
    The cluster norm serves the d it should on the H200 (so the fused path, not the composition, is checked)."""
    assert sn.norm_reads_partials(d) == cluster, d
    ws = [weight(rng, name, 16 * int(rng.integers(1, 7)), d) for name in names]  # (tiled: rows in 16s)
    nw = gpu(1.0 + 0.1 * rng.standard_normal(d))
    for s in (1, 2, 6, 17):
        for n in ((1, 3, 16, 17) if s in (6, 17) else (1, 16)):
            p, r = partials(rng, s, n, d), gpu(rng.standard_normal((n, d)))
            if s == 6 and n == 3:
                host = p.numpy()
                host[4, 1, d // 3] = np.inf
                p = gpu(host)
            for weight_, residual in ((nw, r), (None, r), (nw, None)):
                for out_partials in (False, True):
                    ys, h = sn.rms_norm_matmul(p, weight_, 1e-6, ws, residual=residual, in_partials=True,
                                               partials=out_partials)
                    ys_ref, h_ref = sn.rms_norm_matmul(sn.sum_partials(p), weight_, 1e-6, ws, residual=residual,
                                                       partials=out_partials)
                    what = (d, s, n, weight_ is None, residual is None, out_partials)
                    assert_same(h, h_ref, what)
                    for y, want in zip(ys, ys_ref):
                        assert_same(y, want, what)


@gpu_only
def test_swiglu_matmul_on_partials_equals_it_on_their_sum(rng):
    """in_partials=True: swiglu_matmul on gate and up partials [S, n, in] gives bit for bit what it gives on
    their sums: the fused SwiGLU split (n <= 16), the GEMV slices (17) and the BF16 GEMM (40, exact=False)."""
    k = 2048
    names = ["IQ4_XS_TILED", "Q8_0"]
    ws = [weight(rng, name, 320, k) for name in names]
    for s in (1, 5, 17):
        for n, exact in ((1, True), (4, True), (16, True), (17, True), (40, False)):
            g, u = partials(rng, s, n, k), partials(rng, s, n, k)
            for out_partials in (False, True):
                got = sn.swiglu_matmul(g, u, ws, exact=exact, in_partials=True, partials=out_partials)
                want = sn.swiglu_matmul(sn.sum_partials(g), sn.sum_partials(u), ws, exact=exact,
                                        partials=out_partials)
                for name, y, w in zip(names, got, want):
                    assert_same(y, w, (s, n, exact, name, out_partials))


@gpu_only
def test_a_layer_on_partials_equals_it_on_sums(rng):
    """The target's layer as the forward runs it with partials (the FFN's norm -> gate / up -> SwiGLU -> down ->
    the next norm, each handing its outputs on as partials) equals the same chain on plain outputs bit for bit,
    at the 27B's shapes (hidden 5120, FFN 17408, tiled IQ4_XS / Q6_K), n = 1, 5, 16."""
    d, f = 5120, 17408
    gate, up = weight(rng, "IQ4_XS_TILED", f, d), weight(rng, "IQ4_XS_TILED", f, d)
    down, nxt = weight(rng, "Q6_K_TILED", d, f), weight(rng, "IQ4_XS_TILED", 1024, d)
    nw = gpu(1.0 + 0.1 * rng.standard_normal(d))
    for n in (1, 5, 16):
        mix, x = gpu(rng.standard_normal((n, d))), gpu(rng.standard_normal((n, d)))
        (gp, upp), h = sn.rms_norm_matmul(mix, nw, 1e-6, [gate, up], residual=x, partials=True)
        dp = sn.swiglu_matmul(gp, upp, [down], partials=True, in_partials=True)[0]
        (y,), h2 = sn.rms_norm_matmul(dp, nw, 1e-6, [nxt], residual=h, in_partials=True)
        (g0, u0), h0 = sn.rms_norm_matmul(mix, nw, 1e-6, [gate, up], residual=x)
        d0 = sn.swiglu_matmul(g0, u0, [down])[0]
        (y0,), h20 = sn.rms_norm_matmul(d0, nw, 1e-6, [nxt], residual=h0)
        assert dp.shape[0] > 1 and gp.shape[0] > 1, (dp.shape, gp.shape)
        assert_same(h, h0, n)
        assert_same(h2, h20, n)
        assert_same(y, y0, n)


@gpu_only
def test_partials_bad_input_on_gpu(rng):
    w = weight(rng, "Q8_0", 4, 256)
    p = partials(rng, 3, 2, 256)
    with pytest.raises(ValueError, match=r"rms_norm_matmul: x must be split-K partials"):
        sn.rms_norm_matmul(gpu(np.zeros(256)), None, 1e-6, [w], in_partials=True)
    with pytest.raises(ValueError, match="rms_norm_matmul: residual"):
        sn.rms_norm_matmul(p, None, 1e-6, [w], residual=gpu(np.zeros((2, 128))), in_partials=True)
    with pytest.raises(ValueError, match="swiglu_matmul: gate must hold 1 .. 65536 partials, got 0"):
        sn.swiglu_matmul(gpu(np.zeros((0, 2, 256))), gpu(np.zeros((0, 2, 256))), [w], in_partials=True)
    with pytest.raises(ValueError, match="sum_partials: p must be F32"):
        sn.sum_partials(sn.Tensor(np.zeros((2, 4), np.float16)).to(GPU))
    with pytest.raises(ValueError, match=r"sum_partials: p must be split-K partials"):
        sn.sum_partials(gpu(np.zeros(4)))
