"""The GPU matmul's weight decoders (native/src/gpu/weight_formats.cuh), checked on the CPU.

The decoders are plain C++ apart from a few device intrinsics, so this test compiles them for the
host with stand-ins for those intrinsics (host_emu/portability.h, CUDA semantics) and decodes random
valid blocks of every format chunk by chunk, part by part, at the policies' element offsets, as the
GEMV and the dequantize-to-BF16 kernel walk them. The result must be bit-identical to the CPU
backend's sn.dequantize (itself bit-exact with gguf). It runs everywhere a C++17 compiler is found
(no GPU needed), so layout mistakes show up in CPU CI; the device code itself is covered by
test_gpu_matmul.py on a GPU.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import specd.native as sn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "native"))
sys.path.insert(0, HERE)
from quant_blocks import random_blocks  # noqa: E402
from mma_bounds import mma_tolerance  # noqa: E402

SRC = os.path.join(HERE, "..", "..", "native", "src", "gpu", "weight_formats.cuh")
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    if not CXX or not os.path.exists(SRC):
        pytest.skip("no C++ compiler or no source tree")
    d = tmp_path_factory.mktemp("host_emu")
    shutil.copy(SRC, d / "weight_formats.cuh")  # next to the stand-in portability.h
    shutil.copy(os.path.join(HERE, "host_emu", "portability.h"), d / "portability.h")
    exe = d / "decode"
    subprocess.run([CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-I", str(d), "-o", str(exe),
                    os.path.join(HERE, "host_emu", "decode_main.cpp")], check=True)
    return d, exe


def weight(rng, name, rows, k, extreme):
    base = name[:-2] if name.endswith("_1") else name  # "_1": the one-value-per-chunk fallback
    if base == "F16":
        a = rng.standard_normal((rows, k)).astype(np.float16)
        return a.view(np.uint8), sn.Tensor(a)
    if base == "BF16":
        a = (rng.standard_normal((rows, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return a.view(np.uint8), sn.Tensor(a, sn.DType.BF16)
    if base == "F32":
        a = rng.standard_normal((rows, k)).astype(np.float32)
        return a.view(np.uint8), sn.Tensor(a)
    raw = random_blocks(rng, name, rows, k, extreme=extreme)
    return raw, sn.Tensor(raw, getattr(sn.DType, name))


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "F16", "F16_1", "BF16", "BF16_1",
                                  "F32", "F32_1"])
def test_gpu_weight_decoders_bit_exact_on_host(decoder, rng, name, extreme):
    d, exe = decoder
    rows, k = 3, 1024
    raw, t = weight(rng, name, rows, k, extreme)
    np.ascontiguousarray(raw).tofile(d / "w.bin")
    subprocess.run([str(exe), name, str(rows), str(k), str(d / "w.bin"), str(d / "y.bin")], check=True)
    got = np.fromfile(d / "y.bin", np.float32).reshape(rows, k)
    ref = sn.dequantize(t).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (
        f"{name}: {int(np.sum(got.view(np.uint32) != ref.view(np.uint32)))} of {got.size} values differ")
    # the BF16 bits the dequantize-to-BF16 kernel stores (its vector stores): round to nearest even
    subprocess.run([str(exe), name, str(rows), str(k), str(d / "w.bin"), str(d / "b.bin"), "bf16"], check=True)
    got16 = np.fromfile(d / "b.bin", np.uint16).reshape(rows, k)
    assert np.array_equal(got16, bf16_bits(ref)), f"{name}: BF16 stores differ from round-to-nearest-even"


@pytest.mark.parametrize("fmt", ["IQ4_XS", "Q4_K", "Q5_K", "Q6_K"])
def test_gpu_tiled_weight_decoders_bit_exact_on_host(decoder, rng, fmt):
    """The tiled layouts' chunk gathers (IQ4XSTiledW / Q4KTiledW / Q5KTiledW / Q6KTiledW::load_tiled, the prefill's
    dequantize-to-BF16 of tiled weights) on bytes packed by test_gpu_gemv_tiles.py's reference packers
    (IQ4_XS_TILED: recoded indices) decode to the row-major weight's values, bit for bit; and so do
    the BF16 rows of the tile-unit kernel (dequant_units_bf16_kernel's two phases: a warp's lanes decode
    into a poisoned shared-memory tile at its swizzled slots, then store whole row segments)."""
    from test_gpu_gemv_tiles import FORMATS as TILED
    d, exe = decoder
    rows, k = 32, 1024
    raw = random_blocks(rng, fmt, rows, k, extreme=False)
    ref = sn.dequantize(sn.Tensor(raw, getattr(sn.DType, fmt))).numpy()
    np.ascontiguousarray(TILED[fmt][1](np.ascontiguousarray(raw).reshape(rows, -1))).tofile(d / "w.bin")
    for extra, out, want in (([], "y.bin", ref.view(np.uint32)), (["bf16"], "b.bin", bf16_bits(ref)),
                             (["units"], "u.bin", bf16_bits(ref))):
        subprocess.run([str(exe), fmt + "_T", str(rows), str(k), str(d / "w.bin"), str(d / out), *extra], check=True)
        got = np.fromfile(d / out, want.dtype).reshape(rows, k)
        assert np.array_equal(got, want), f"{fmt}_T {extra}: {int(np.sum(got != want))} of {got.size} values differ"


def bf16_bits(f32):
    """float32 -> bfloat16 bits, round to nearest even, NaN kept quiet (numpy, independent of the kernel)."""
    u = f32.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


# --------------------------------------------------------------------------------------------
# The tensor-core GEMV (native/src/gpu/matmul_mma.cuh), emulated on the host
# --------------------------------------------------------------------------------------------
# host_emu/mma_main.cpp runs the header's split_x_kernel and mma_gemv_kernel (and mma_gemv_pair_kernel) on the CPU (one thread
# per lane, mma.sync m16n8k32 s8 -> s32 and m16n8k16 f16 -> f32 emulated from the PTX ISA fragment
# layouts, shuffles and __syncwarp across the lane threads), so the per-format load offsets, the k
# order, the x split (three int8 terms per power-of-two scaled 256-input group), the integer scales,
# the min terms, the load ring, the term sums and the split-K walk are checked without a GPU.
# Tolerance: the GEMV's contract (mma_bounds.py: 1e-5 * (|x| @ |w|^T) + 2^-20 * the group maxima
# term; normal x lands ~1e-7 of the first). The hardware: test_gpu_matmul.py on a GPU.

MMA_SRC = os.path.join(HERE, "..", "..", "native", "src", "gpu", "matmul_mma.cuh")


def build_mma_emu(tmp_path_factory, *defines):
    """(folder, executable) of the emulation built with `defines` (-D tuning constants of the header)."""
    if not CXX or not os.path.exists(MMA_SRC):
        pytest.skip("no C++ compiler or no source tree")
    d = tmp_path_factory.mktemp("mma_emu")
    for src in (SRC, MMA_SRC, os.path.join(os.path.dirname(MMA_SRC), "pdl.cuh"),
                os.path.join(os.path.dirname(MMA_SRC), "partials.cuh"),
                os.path.join(HERE, "host_emu", "portability.h"),
                os.path.join(HERE, "host_emu", "warp_emu.h"),
                os.path.join(HERE, "host_emu", "mma_main.cpp")):
        shutil.copy(src, d / os.path.basename(src))
    exe = d / "mma_emu"
    r = subprocess.run([CXX, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", *defines, "-I", str(d), "-o",
                        str(exe), str(d / "mma_main.cpp")], capture_output=True, text=True)
    if r.returncode != 0 and "barrier" in r.stderr:
        pytest.skip("C++ compiler without std::barrier (C++20)")
    assert r.returncode == 0, r.stderr
    return d, exe


@pytest.fixture(scope="module")
def mma_emu(tmp_path_factory):
    return build_mma_emu(tmp_path_factory)


def run_mma_emu(d, exe, name, x, out, sms=None):
    """The emulated GEMV of w.bin (one weight of `out` rows, or a group: a list of row counts, the
    weights' rows one after the other in w.bin) against x: y [n, out], or a list of [n, out_i]."""
    n, k = x.shape
    outs = out if isinstance(out, list) else [out]
    np.ascontiguousarray(x).astype(np.float32).tofile(d / "x.bin")
    env = dict(os.environ)
    if sms is not None:
        env["SPECD_EMU_SMS"] = str(sms)
    subprocess.run([str(exe), name, str(n), str(k), ",".join(map(str, outs)), str(d / "w.bin"), str(d / "x.bin"),
                    str(d / "y.bin")], check=True, env=env)
    flat = np.fromfile(d / "y.bin", np.float32)
    ys, o = [], 0
    for rows in outs:
        ys.append(flat[o:o + n * rows].reshape(n, rows))
        o += n * rows
    return ys if isinstance(out, list) else ys[0]


def wide_range_x(rng, n, k):
    """x with a wide dynamic range: rows scaled by 2^-60 .. 2^60, elements by 2^-12 .. 2^12 (and a
    few exact zeros), so the per-block power-of-two scaling of the x split is exercised across the
    F32 range and within blocks."""
    x = rng.standard_normal((n, k)) * np.exp2(rng.uniform(-12, 12, (n, k)))
    x *= np.exp2(np.linspace(-60, 60, n))[:, None]
    x[rng.random((n, k)) < 0.02] = 0.0
    return x.astype(np.float32)


FORMATS_MMA = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
# (format, in, out, extreme weights): the weight shapes; (4096, 20) on one SM: split-K of 256-input
# formats (4 splits of 4 units, the load ring past its first slots); Q8_0 rows that end in a ragged x
# group (in % 256 != 0); full-range fp16 scale fields.
MMA_CASES = [(name, k, out, False) for name in FORMATS_MMA for k, out in [(256, 7), (512, 77), (1024, 40)]]
MMA_CASES += [(name, 4096, 20, False) for name in FORMATS_MMA]
MMA_CASES += [("Q8_0", 96, 33, False), ("Q8_0", 288, 40, False)]
MMA_CASES += [(name, 512, 40, True) for name in FORMATS_MMA]


def check_mma_emulated(d, exe, name, t, x, out, sms, widths=(1, 2, 3, 8, 9, 12, 16)):
    """The emulated GEMV of weight t (its bytes in w.bin) at every width in `widths` against the CPU,
    within the GEMV's contract (mma_bounds.py), and batch invariant (each width's rows equal the
    widest call's)."""
    ref = sn.matmul(x, t).numpy()
    allow = mma_tolerance(x, np.abs(sn.dequantize(t).numpy().astype(np.float64)))
    ys = {}
    for n in widths:
        y = ys[n] = run_mma_emu(d, exe, name, x[:n], out, sms=sms)
        err = np.abs(y.astype(np.float64) - ref[:n])
        assert np.all(err <= allow[:n]), f"{name} n={n}: max err / allowance {(err / allow[:n]).max():.3g}"
    top = max(widths)
    for n in widths:  # batch invariance: a row's result does not depend on n
        assert np.array_equal(ys[n].view(np.uint32), ys[top][:n].view(np.uint32)), f"{name}: n={n} differs from {top}"


@pytest.mark.parametrize("name,k,out,extreme", MMA_CASES)
@pytest.mark.parametrize("xkind", ["normal", "wide"])
def test_gpu_mma_gemv_emulated_on_host(mma_emu, rng, name, k, out, extreme, xkind):
    d, exe = mma_emu
    raw, t = weight(rng, name, out, k, extreme)
    x = rng.standard_normal((16, k)).astype(np.float32) if xkind == "normal" else wide_range_x(rng, 16, k)
    np.ascontiguousarray(raw).tofile(d / "w.bin")
    check_mma_emulated(d, exe, name, t, x, out, sms=1 if k >= 1024 else None)  # 1 SM: several splits


@pytest.mark.parametrize("name", FORMATS_MMA)
def test_gpu_mma_gemv_emulated_every_width(mma_emu, rng, name):
    """Every width 1..16 (every kernel instance, 1..6 n8 tiles, with split-K): within the
    contract and bit-identical rows whatever the width. 2048 inputs on 1 SM: 2 splits of the 256-input
    formats, 16 of Q8_0."""
    d, exe = mma_emu
    k, out = 2048, 20
    raw, t = weight(rng, name, out, k, False)
    np.ascontiguousarray(raw).tofile(d / "w.bin")
    x = rng.standard_normal((16, k)).astype(np.float32)
    check_mma_emulated(d, exe, name, t, x, out, sms=1, widths=tuple(range(1, 17)))


@pytest.mark.parametrize("fmt", ["IQ4_XS", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k,outs", [(2048, [20]), (512, [7, 130, 40])])
def test_gpu_mma_gemv_emulated_tiled(mma_emu, rng, fmt, k, outs):
    """IQ4_XS / Q4_K / Q5_K / Q6_K in the GEMV's tiled layouts (IQ4T / Q4T / Q5T / Q6T: 16-row tiles, lane-ordered quants,
    512-byte warp loads; ragged last tiles; IQ4T: recoded indices and their own table lookup, packed by
    mma_main.cpp's packer) give bit for bit the row-major kernel's results, at every width, with split-K
    and in grouped launches."""
    d, exe = mma_emu
    raws = [weight(rng, fmt, o, k, False)[0] for o in outs]
    np.concatenate(raws).tofile(d / "w.bin")
    x = rng.standard_normal((16, k)).astype(np.float32)
    for n in (1, 3, 8, 12, 16):
        rowmajor = run_mma_emu(d, exe, fmt, x[:n], outs, sms=1)
        tiled = run_mma_emu(d, exe, fmt + "_T", x[:n], outs, sms=1)
        for i, (a, b) in enumerate(zip(tiled, rowmajor)):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"n={n}, weight {i}"


@pytest.mark.parametrize("fmt", ["IQ4_XS", "Q4_K"])
@pytest.mark.parametrize("k,outs_f,outs_g,sms", [(2048, [20], [33], 1), (512, [7, 130], [40, 16], 1),
                                                 (5120, [64, 16], [16], 132)])
def test_gpu_mma_pair_emulated(mma_emu, rng, fmt, k, outs_f, outs_g, sms):
    """The pair launch (mma_gemv_pair_kernel: fmt's tiled group with a tiled Q6_K group, the latter's blocks first,
    without a register ring; at the fewer resident blocks of the two past one n8 tile) gives bit for bit each format's
    own grouped launch at every tile count it runs (1-10 rows), with split-K (one SM) and with the H200's split plan."""
    d, exe = mma_emu
    raws_f = [weight(rng, fmt, o, k, False)[0] for o in outs_f]
    raws_g = [weight(rng, "Q6_K", o, k, False)[0] for o in outs_g]
    np.concatenate(raws_f).tofile(d / "wf.bin")
    np.concatenate(raws_g).tofile(d / "wg.bin")
    x = rng.standard_normal((10, k)).astype(np.float32)
    for n in (1, 2, 4, 7, 10):
        shutil.copy(d / "wf.bin", d / "w.bin")
        own = run_mma_emu(d, exe, fmt + "_T", x[:n], outs_f, sms=sms)
        shutil.copy(d / "wg.bin", d / "w.bin")
        own += run_mma_emu(d, exe, "Q6_K_T", x[:n], outs_g, sms=sms)
        np.ascontiguousarray(x[:n]).tofile(d / "x.bin")
        subprocess.run([str(exe), "pair", fmt + "_T", "Q6_K_T", str(n), str(k), ",".join(map(str, outs_f)),
                        ",".join(map(str, outs_g)), str(d / "wf.bin"), str(d / "wg.bin"), str(d / "x.bin"),
                        str(d / "y.bin")], check=True, env=dict(os.environ, SPECD_EMU_SMS=str(sms)))
        flat, o = np.fromfile(d / "y.bin", np.float32), 0
        for i, rows in enumerate(outs_f + outs_g):
            got = flat[o:o + n * rows].reshape(n, rows)
            o += n * rows
            assert np.array_equal(got.view(np.uint32), own[i].view(np.uint32)), (n, i)


def test_gpu_mma_queue_sums_on_host(mma_emu):
    """`mma_emu queue`: mma::queue_sums merges the split-sum sets of a grouped call's launches into one sum launch's
    set (element ranges rebased one after the other) and flushes the pending set first when the next would not fit
    kMaxGroup weights (the GEMV's other tests never queue more than 8)."""
    d, exe = mma_emu
    r = subprocess.run([str(exe), "queue"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_gpu_mma_iq4_lookups_on_host(mma_emu):
    """`mma_emu lookup`: the __byte_perm stand-in and mma::prmt against hand-computed PTX prmt.b32
    results (the sign-replicating selectors included), mma::sbyte for every byte value at every
    position, then IQ4T's lookup of recoded words
    (IQ4TableRecoded) against IQ4U's (IQ4Table) of the original words and against kvalues, for every
    16-bit half and 10^5 random words."""
    d, exe = mma_emu
    r = subprocess.run([str(exe), "lookup"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.fixture(scope="module")
def mma_emu_fewest_units(tmp_path_factory):
    """The emulation with splits by the fewest-units rule alone (SPECD_MMA_SPLIT_WAVES=0)."""
    return build_mma_emu(tmp_path_factory, "-DSPECD_MMA_SPLIT_WAVES=0")


@pytest.fixture(scope="module")
def mma_emu_deep_ring(tmp_path_factory):
    """The emulation with the sweep's deepest ring (tools/device/gemv_sweep.sh variants): up to 8 units
    loading ahead in a 160-register ring at one tile and 3 resident blocks (mma::min_blocks and
    units_ahead scale the rest: two tiles 100 registers at 4 blocks, 3-4 tiles 120 at 2); tiled IQ4_XS's
    own 2- and 3-4-tile rings (SPECD_MMA_IQ4T_RING_*, none by default) 100 and 120 registers; the tiled
    formats' one-tile rings with x ahead (SPECD_MMA_X_RING_REGS) 160 registers."""
    return build_mma_emu(tmp_path_factory, "-DSPECD_MMA_RING_REGS=160", "-DSPECD_MMA_MAX_AHEAD=8",
                         "-DSPECD_MMA_MIN_BLOCKS=3", "-DSPECD_MMA_IQ4T_RING_2=100", "-DSPECD_MMA_IQ4T_RING_34=120",
                         "-DSPECD_MMA_X_RING_REGS=160")


@pytest.fixture(scope="module")
def mma_emu_no_x_ahead(tmp_path_factory):
    """The emulation without the tiled formats' x loaded a unit ahead (SPECD_MMA_X_AHEAD=0: x read in each
    unit, the rings of SPECD_MMA_RING_REGS)."""
    return build_mma_emu(tmp_path_factory, "-DSPECD_MMA_X_AHEAD=0")


@pytest.fixture(scope="module")
def mma_emu_q6_x4(tmp_path_factory):
    """The emulation with Q6_K's quants built as 4 (q - 32) at no tile count and at every one
    (SPECD_MMA_Q6_X4_TILES=0 / 6; the default build: at up to 3 n8 tiles)."""
    return (build_mma_emu(tmp_path_factory, "-DSPECD_MMA_Q6_X4_TILES=0"),
            build_mma_emu(tmp_path_factory, "-DSPECD_MMA_Q6_X4_TILES=6"))


@pytest.mark.parametrize("name", ["Q6_K", "Q6_K_T"])
@pytest.mark.parametrize("extreme", [False, True])
def test_gpu_mma_q6_x4_keeps_results(mma_emu, mma_emu_q6_x4, rng, name, extreme):
    """SPECD_MMA_Q6_X4_TILES: the quants as 4 (q - 32), every sum 4x and shifted back exactly before the float step,
    give bit for bit the rows of the plain quants, at one to six tiles (the default build mixes the two), with
    split-K, for random and extreme blocks and x (tiny and huge groups)."""
    builds = (mma_emu, *mma_emu_q6_x4)
    for k, out in ((2304, 40), (256, 24)):
        raw, _ = weight(rng, name.removesuffix("_T"), out, k, extreme)
        x = rng.standard_normal((16, k)).astype(np.float32)
        x[1] *= 2.0 ** -90
        x[2] *= 2.0 ** 60
        for d, _exe in builds:
            np.ascontiguousarray(raw).tofile(d / "w.bin")
        for n in (1, 3, 8, 16):  # 1, 2, 3 and 6 tiles
            base = run_mma_emu(*mma_emu_q6_x4[0], name, x[:n], out, sms=1)
            for build in (mma_emu, mma_emu_q6_x4[1]):
                other = run_mma_emu(*build, name, x[:n], out, sms=1)
                assert np.array_equal(base.view(np.uint32), other.view(np.uint32)), f"{name} k={k} n={n} {build[0]}"


@pytest.mark.parametrize("name", FORMATS_MMA + ["IQ4_XS_T", "Q4_K_T", "Q5_K_T", "Q6_K_T"])
def test_gpu_mma_gemv_ring_depth_keeps_results(mma_emu, mma_emu_deep_ring, mma_emu_no_x_ahead, rng, name):
    """The ring depth, occupancy and x-ahead constants change when units and x are loaded, never the
    arithmetic (the split plans included: the wave rule's blocks per multiprocessor are constants, kWaveBlocks):
    the deep-ring and no-x-ahead builds give bit for bit the default build's rows (split-K on 1 SM, ragged last
    splits; splits of 1, 3, 5 and 4 256-input units: odd and even runs through the unrolled slots; 1100 rows: one
    split of 9 units, which wraps the deep rings of every format)."""
    builds = (mma_emu_deep_ring, mma_emu_no_x_ahead)
    for k, out in ((2304, 40), (768, 40), (256, 40), (2304, 1100)):  # 256-input units: 9 (splits of 5, 4), 3, 1, 9
        raw, _ = weight(rng, name.removesuffix("_T"), out, k, False)
        x = rng.standard_normal((8, k)).astype(np.float32)
        for d, _exe in (mma_emu, *builds):
            np.ascontiguousarray(raw).tofile(d / "w.bin")
        for n in (1, 2, 4, 8):  # 1, 1, 2 and 3 tiles
            base = run_mma_emu(*mma_emu, name, x[:n], out, sms=1)
            for build in builds:
                other = run_mma_emu(*build, name, x[:n], out, sms=1)
                assert np.array_equal(base.view(np.uint32), other.view(np.uint32)), f"{name} k={k} n={n} {build[0]}"


def split_info(d, exe, name, out, k, sms=132):
    """(splits, units per split, wave blocks, one-tile blocks) of one weight of `name`, `out` rows and `k` inputs on
    `sms` multiprocessors: the GEMV's plan (mma::splits_for / units_per_split_of, as the launch and gemv_splits call
    them), the blocks per multiprocessor the wave rule assumes (mma::wave_blocks) and those the format's tiled twin's
    one-tile instance runs at in this build (mma::min_blocks; 0 0 without a twin)."""
    r = subprocess.run([str(exe), "splits", name, str(out), str(k), str(sms)], capture_output=True, text=True, check=True)
    return tuple(map(int, r.stdout.split()))


def split_plan(d, exe, name, out, k, sms=132):
    """(splits, units per split) of split_info."""
    return split_info(d, exe, name, out, k, sms)[:2]


# The 27B decode step's weights on an H200 (132 SMs): (format, out, in, splits, units per split). Tiled IQ4_XS runs 4
# blocks per SM at one tile, tiled Q6_K 3. The FFN gate / up and GDN qkv take 3 splits of 7 units (1.55 / 0.91
# waves), the down projection 10 of 7 (1.52), attention q 4 of 5 (1.45), the Q6_K out projection 4 of 6 (0.81);
# the rest keep the fewest-units rule's 4-unit splits (GDN z: 0.91 wave; attention k, v: no split fills 0.8 of a
# wave), and the Q5_K output head its single split (15520 tiles fill the GPU); the formats without a tiled layout keep
# the fewest-units rule (Q8_0).
SPLIT_PLANS_27B = [("IQ4_XS_T", 17408, 5120, 3, 7), ("IQ4_XS_T", 5120, 17408, 10, 7), ("IQ4_XS_T", 10240, 5120, 3, 7),
                   ("IQ4_XS_T", 6144, 5120, 5, 4), ("IQ4_XS_T", 12288, 5120, 4, 5), ("IQ4_XS_T", 1024, 5120, 5, 4),
                   ("IQ4_XS_T", 5120, 6144, 6, 4), ("Q6_K_T", 5120, 6144, 4, 6), ("Q6_K_T", 1024, 5120, 5, 4),
                   ("Q5_K", 248320, 5120, 1, 20), ("Q5_K_T", 248320, 5120, 1, 20), ("Q8_0", 5120, 5120, 23, 7),
                   ("Q5_K", 10240, 5120, 3, 7),
                   ("IQ4_XS", 17408, 5120, 3, 7), ("Q6_K", 5120, 6144, 4, 6)]


@pytest.mark.parametrize("name,out,k,splits,per", SPLIT_PLANS_27B)
def test_gpu_mma_split_plans(mma_emu, name, out, k, splits, per):
    """The wave rule's splits (mma::units_per_split) for the 27B's decode weights on 132 SMs, the fewest-units
    rule's where no split of at most 2048 inputs fills the resident blocks to a good wave shape or the format has
    no tiled layout; and in this (default) build the wave rule's blocks per multiprocessor are the tiled twin's
    one-tile instance's."""
    got_splits, got_per, wave_blocks, one_tile_blocks = split_info(*mma_emu, name, out, k)
    assert (got_splits, got_per) == (splits, per)
    assert wave_blocks == one_tile_blocks


def test_gpu_mma_split_plans_rules(mma_emu, mma_emu_fewest_units):
    """Over a grid of shapes and SM counts: every split plan covers the units with splits of at most `per` (the last
    one ragged); the wave rule's plans (the tiled formats and their row-major twins) are either the fewest-units
    rule's or at most 2048 inputs a split, never more splits than the fewest-units rule's; a row-major format with a
    tiled layout plans as that layout (the same bits either way: test_gpu_gemv_tiles.py); the formats without one
    keep the fewest-units rule's."""
    twins = {"IQ4_XS": "IQ4_XS_T", "Q6_K": "Q6_K_T", "Q4_K": "Q4_K_T", "Q5_K": "Q5_K_T"}
    for name, unit in (("IQ4_XS_T", 256), ("IQ4_XS", 256), ("Q6_K_T", 256), ("Q6_K", 256), ("Q4_K_T", 256),
                       ("Q4_K", 256), ("Q5_K_T", 256), ("Q5_K", 256), ("Q8_0", 32), ("BF16", 64)):
        for out in (16, 48, 1024, 5120, 6144, 17408, 65536):
            for k in (256, 2048, 5120, 6144, 17408):
                if k % unit:
                    continue
                for sms in (1, 8, 132):
                    nunits = k // unit
                    s, per = split_plan(*mma_emu, name, out, k, sms)
                    s0, per0 = split_plan(*mma_emu_fewest_units, name, out, k, sms)
                    assert s == -(-nunits // per) and (s - 1) * per < nunits, (name, out, k, sms, s, per)
                    waves = name.endswith("_T") or name in twins
                    assert (s, per) == (s0, per0) or (waves and per * unit <= 2048 and s <= s0), (name, out, k, sms, s, s0)
                    if name in twins:
                        assert (s, per) == split_plan(*mma_emu, twins[name], out, k, sms), (name, out, k, sms)


@pytest.mark.parametrize("scale_exp", [-110, -116, -125])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "IQ4_XS"])
def test_gpu_mma_gemv_emulated_tiny_x(mma_emu, rng, name, scale_exp):
    """x of ~2^-110 .. 2^-125 (the x scale's clamp and subnormal scale products): within the contract's
    2^-100 floor of the group maximum."""
    d, exe = mma_emu
    k, out = 512, 40
    raw, t = weight(rng, name, out, k, False)
    np.ascontiguousarray(raw).tofile(d / "w.bin")
    x = (rng.standard_normal((3, k)) * 2.0 ** scale_exp).astype(np.float32)
    check_mma_emulated(d, exe, name, t, x, out, None, widths=(1, 3))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_gpu_mma_gemv_emulated_min_term_cancellation(mma_emu, rng, name):
    """K-quant super-blocks whose d * sc * q and dmin * m nearly cancel (every scale, min and quant at
    its maximum, dmin ~ 15 d, so each weight is ~0.43 while both parts are ~940): the GEMV forms their
    difference with one rounding, so the error stays within 1e-5 of |x| @ |w|."""
    d, exe = mma_emu
    k, out = 256, 8
    raw, t = weight(rng, name, out, k, False)
    raw = np.ascontiguousarray(raw).reshape(out, -1)
    raw[:, 0:2] = np.frombuffer(np.float16(1.0009765625).tobytes(), np.uint8)  # d
    raw[:, 2:4] = np.frombuffer(np.float16(15.0078125).tobytes(), np.uint8)  # dmin
    raw[:, 4:] = 0xFF  # scales / mins 63, quants 15 (Q5_K: and the fifth bits: 31)
    t = sn.Tensor(raw, getattr(sn.DType, name))
    raw.tofile(d / "w.bin")
    x = rng.uniform(0.5, 1.0, (2, k)).astype(np.float32)
    check_mma_emulated(d, exe, name, t, x, out, None, widths=(1, 2))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_gpu_mma_gemv_emulated_nonfinite_x(mma_emu, rng, name):
    """inf / NaN in a row of x give non-finite results in that row only (the CPU's: inf * w and
    NaN propagate), other rows unaffected."""
    d, exe = mma_emu
    k, out = 512, 40
    raw, t = weight(rng, name, out, k, False)
    np.ascontiguousarray(raw).tofile(d / "w.bin")
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 100] = np.inf
    x[1, 300] = np.nan
    y = run_mma_emu(d, exe, name, x, out)
    assert not np.isfinite(y[0]).any() and not np.isfinite(y[1]).any()
    assert np.isfinite(y[2]).all()
    with np.errstate(all="ignore"):
        ref = sn.matmul(x, t).numpy()
    assert not np.isfinite(ref[0]).any() and not np.isfinite(ref[1]).any()


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_gpu_mma_gemv_group_emulated_equals_single(mma_emu, rng, name):
    """A grouped launch (one x, several weights of one format: flat grid, each weight its own split)
    gives every weight bit for bit what a launch of its own gives, at 1 and 5 n8 tiles (n = 1, 12)."""
    d, exe = mma_emu
    k, outs = 512, [7, 130, 40]
    raws = [weight(rng, name, o, k, False)[0] for o in outs]
    x = rng.standard_normal((12, k)).astype(np.float32)
    for n in (1, 12):
        np.concatenate([np.ascontiguousarray(r).reshape(-1) for r in raws]).tofile(d / "w.bin")
        group = run_mma_emu(d, exe, name, x[:n], outs, sms=2)  # 2 SMs: several splits per weight
        for raw, o, yg in zip(raws, outs, group):
            np.ascontiguousarray(raw).tofile(d / "w.bin")
            single = run_mma_emu(d, exe, name, x[:n], o, sms=2)
            assert np.array_equal(yg.view(np.uint32), single.view(np.uint32)), f"{name} out={o} n={n}"


@pytest.mark.parametrize("k", [288, 800])
def test_gpu_mma_gemv_emulated_special_x_groups(mma_emu, rng, k):
    """The x split's special groups at every width 1..16, with a ragged last group (Q8_0, in % 256 =
    32): an all-zero group (full or ragged) or row, inf / NaN in a full or the ragged group. Finite
    rows are within the contract, bit-identical whatever the width (an all-zero row gives exact
    zeros); a row holding inf / NaN is non-finite in every output, as on the CPU."""
    d, exe = mma_emu
    out, last = 24, 256 * (k // 256)
    raw, t = weight(rng, "Q8_0", out, k, False)
    np.ascontiguousarray(raw).tofile(d / "w.bin")
    x = wide_range_x(rng, 16, k)
    x[1, :256] = 0.0
    x[2] = 0.0
    x[4, last:] = 0.0
    x[5, last + 3] = np.inf
    x[7, 40] = np.nan
    x[10, k - 1] = -np.inf
    x[13, last + 17] = np.nan
    bad = np.zeros(16, bool)
    bad[[5, 7, 10, 13]] = True
    with np.errstate(all="ignore"):
        ref = sn.matmul(x, t).numpy()
        allow = mma_tolerance(x, np.abs(sn.dequantize(t).numpy().astype(np.float64)))
    assert not np.isfinite(ref[bad]).any()
    ys = {}
    for n in range(1, 17):
        y = ys[n] = run_mma_emu(d, exe, "Q8_0", x[:n], out, sms=1)
        good = ~bad[:n]
        err = np.abs(y[good].astype(np.float64) - ref[:n][good])
        assert np.all(err <= allow[:n][good]), f"n={n}: max err / allowance {(err / allow[:n][good]).max():.3g}"
        assert not np.isfinite(y[bad[:n]]).any(), f"n={n}"
        if n > 2:
            assert np.all(y[2] == 0.0)
    for n in range(1, 16):
        assert np.array_equal(ys[n][~bad[:n]].view(np.uint32), ys[16][:n][~bad[:n]].view(np.uint32)), f"n={n}"


# BF16 weights on the tensor cores (BF16U: x as three BF16 terms, m16n8k16 bf16 -> f32 MMAs, a load ring at
# every tile count), emulated: against the CPU backend within the GEMV's 1e-5 * (|x| @ |w|^T) (x's terms
# sum to x exactly, the products are exact; the emulated MMA sums in double, the hardware in F32: the
# hardware is test_gpu_matmul.py's), batch invariant, grouped == single, non-finite x kept per row.

def bf16_weight(rng, rows, k):
    """(raw BF16 bits [rows, k] uint16, the sn.Tensor of them) from random normals."""
    bits = (rng.standard_normal((rows, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, sn.Tensor(np.ascontiguousarray(bits), sn.DType.BF16)


@pytest.mark.parametrize("k,out,sms", [(64, 7, None), (512, 77, None), (2048, 20, 1), (4096, 130, 2)])
@pytest.mark.parametrize("xkind", ["normal", "wide"])
def test_gpu_mma_gemv_bf16_emulated(mma_emu, rng, k, out, sms, xkind):
    """Every width 1..16 (1..6 n8 tiles, the ring at each), ragged out, split-K (1-2 SMs: several
    splits), x of normal and wide range (BF16 keeps F32's exponents: no scaling)."""
    d, exe = mma_emu
    raw, t = bf16_weight(rng, out, k)
    raw.tofile(d / "w.bin")
    x = rng.standard_normal((16, k)).astype(np.float32) if xkind == "normal" else wide_range_x(rng, 16, k)
    ref = sn.matmul(x, t).numpy().astype(np.float64)
    bound = np.abs(x.astype(np.float64)) @ np.abs(sn.dequantize(t).numpy().astype(np.float64)).T
    ys = {}
    for n in range(1, 17):
        y = ys[n] = run_mma_emu(d, exe, "BF16", x[:n], out, sms=sms)
        err = np.abs(y.astype(np.float64) - ref[:n])
        assert np.all(err <= 1e-5 * bound[:n] + 1e-37), f"n={n}: max err / bound {(err / (bound[:n] + 1e-300)).max():.3g}"
    for n in range(1, 16):
        assert np.array_equal(ys[n].view(np.uint32), ys[16][:n].view(np.uint32)), f"n={n} differs from 16"


def test_gpu_mma_gemv_bf16_emulated_group_and_nonfinite(mma_emu, rng):
    """A grouped launch of three BF16 weights equals their single launches bit for bit; inf / NaN in a row
    of x make that row's results non-finite (inf stays inf where the CPU's does) and leave the others."""
    d, exe = mma_emu
    k, outs = 512, [7, 130, 40]
    parts = [bf16_weight(rng, o, k) for o in outs]
    x = rng.standard_normal((12, k)).astype(np.float32)
    for n in (1, 12):
        np.concatenate([p[0].reshape(-1) for p in parts]).tofile(d / "w.bin")
        group = run_mma_emu(d, exe, "BF16", x[:n], outs, sms=2)
        for (raw, _), o, yg in zip(parts, outs, group):
            raw.tofile(d / "w.bin")
            single = run_mma_emu(d, exe, "BF16", x[:n], o, sms=2)
            assert np.array_equal(yg.view(np.uint32), single.view(np.uint32)), f"out={o} n={n}"
    raw, t = parts[1]
    raw.tofile(d / "w.bin")
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 100], x[1, 300] = np.inf, np.nan
    y = run_mma_emu(d, exe, "BF16", x, outs[1])
    ref = sn.matmul(x, t).numpy()
    assert np.array_equal(np.isposinf(y[0]), np.isposinf(ref[0])) and np.array_equal(np.isneginf(y[0]), np.isneginf(ref[0]))
    assert not np.isfinite(y[1]).any() and np.all(np.isfinite(y[2]))


def test_gpu_mma_gemv_bf16_emulated_extreme_x(mma_emu, rng):
    """x near F32's maximum (its BF16 terms are truncations, so none overflows) and below 2^-110 (lo
    under BF16's subnormals: an absolute error < 2^-126 per value) against the CPU."""
    d, exe = mma_emu
    k, out = 256, 24
    raw, _ = bf16_weight(rng, out, k)
    raw[:, 5] = 0x3A83  # ~1e-3: 3.3e38 * w stays finite
    raw.tofile(d / "w.bin")
    t = sn.Tensor(np.ascontiguousarray(raw), sn.DType.BF16)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 5] = np.float32(3.3e38)
    x[1, 5] = -np.float32(3.39e38)
    x[2] = (rng.standard_normal(k) * 2.0 ** -120).astype(np.float32)
    y = run_mma_emu(d, exe, "BF16", x, out).astype(np.float64)
    ref = sn.matmul(x, t).numpy().astype(np.float64)
    bound = np.abs(x.astype(np.float64)) @ np.abs(sn.dequantize(t).numpy().astype(np.float64)).T
    assert np.all(np.isfinite(y))
    allow = 1e-5 * bound + 2.0 ** -126 * np.abs(sn.dequantize(t).numpy().astype(np.float64)).sum(axis=1)
    assert np.all(np.abs(y - ref) <= allow)
