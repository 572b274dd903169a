"""IQ4_XS_TILED / Q4_K_TILED / Q5_K_TILED / Q6_K_TILED: IQ4_XS, Q4_K, Q5_K and Q6_K weights regrouped for
the CUDA tensor-core GEMV (sn.tile_for_gemv).

The layouts (native/src/gpu/matmul_mma.cuh, IQ4T, Q4T, Q5T and Q6T): rows in tiles of 16. IQ4_XS, per tile and
256-input unit 2176 bytes: 4 runs of 512 bytes of quants in the MMA's lane order (run i holds at 16 l
the words 4 i .. 4 i + 3 of lane l = 4 g + t, word k = 8 h + j being qs[16 j + 4 t ..] of row g + 8 h),
then the 16 rows' 8-byte headers; the stored 4-bit indices are recoded (bits 2 and 3 swapped: 4-7 <->
8-11), which shortens the GEMV's table lookup and leaves every value as it was. Q4_K the same
arrangement, bytes unchanged, with its qs (after a 16-byte header) and 16-byte headers (2304 bytes).
Q5_K (2816 bytes) Q4_K's quants, then one 512-byte run of the fifth bits (at 16 l: qh[4 t ..],
qh[16 + 4 t ..] of row g, then of row g + 8), then the 16-byte headers.
Q6_K, per tile and unit 3360 bytes: 6 runs of 512 bytes (run 3 h + c
holds at 16 l the words 4 c .. 4 c + 3 of lane l of row g + 8 h, whose words k = 0..11 are
ql[16 k + 4 t ..] for k < 8 and qh[16 (k - 8) + 4 t ..]), then the 16 rows' 16 scale bytes, then their
fp16 d. `pack_reference` / `arrange_q4` / `pack_reference_q5` / `pack_reference_q6` below write them from those descriptions
(numpy), independently of the GPU kernels.

What must hold: the GPU kernel writes exactly those bytes; matmul / matmul_group on the tiled weight
equal the row-major weight's results BIT FOR BIT (GEMV widths 1..17, grouped with other formats, the
27B's FFN shape, and the prefill path that dequantizes to BF16 for cuBLAS); a qwen35 model with tiled
layers gives the same logits as one without; every other op refuses the layout with a clear error.
GPU tests are skipped (marked ``gpu``) without a GPU; the error checks that need no GPU always run.
"""
import os
import sys

import numpy as np
import pytest

import specd.native as sn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native"))
from quant_blocks import random_blocks  # noqa: E402

GPU, CPU = sn.Device.GPU, sn.Device.CPU
HAVE_TILES = sn.gpu_available() and sn.gemv_tiles_supported()
TILED_ID = 0x10000 + 23
Q6_TILED_ID = 0x10000 + 14
Q4K_TILED_ID = 0x10000 + 12
Q5K_TILED_ID = 0x10000 + 13


def tiles_only(f):
    f = pytest.mark.skipif(not HAVE_TILES, reason="no CUDA GPU with the tensor-core GEMV")(f)
    return pytest.mark.gpu(f)


# IQ4_XS_TILED's stored index of each IQ4_XS index: bits 2 and 3 swapped
IQ4_TILED_INDEX = np.array([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15], np.uint8)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def arrange_q4(raw: np.ndarray, block: int = 136, hdr_bytes: int = 8) -> np.ndarray:
    """Row-major IQ4_XS bytes [out, units * 136] (out % 16 == 0; Q4_K: block 144, hdr_bytes 16) -> the
    tiled arrangement (Q4_K_TILED's bytes; IQ4_XS_TILED recodes the quants too: pack_reference)."""
    out, row_bytes = raw.shape
    units = row_bytes // block
    blk = raw.reshape(out // 16, 16, units, block)           # tile, row in tile, unit, byte
    hdr = blk[..., :hdr_bytes].transpose(0, 2, 1, 3)          # tile, unit, row, hdr_bytes
    qs = blk[..., hdr_bytes:].reshape(out // 16, 2, 8, units, 8, 4, 4)  # tile, h, g, unit, j, t, byte
    # word k = 8 h + j of lane 4 g + t at 512 (k // 4) + 16 lane + 4 (k % 4): order (k // 4, g, t, k % 4, byte)
    q = qs.transpose(0, 3, 1, 4, 2, 5, 6)                     # tile, unit, h, j, g, t, byte
    q = q.reshape(out // 16, units, 2, 2, 4, 8, 4, 4)         # tile, unit, h, j // 4, j % 4, g, t, byte
    q = q.transpose(0, 1, 2, 3, 5, 6, 4, 7)                   # tile, unit, h, j // 4, g, t, j % 4, byte
    return np.concatenate([q.reshape(out // 16, units, 2048), hdr.reshape(out // 16, units, 16 * hdr_bytes)],
                          axis=2).reshape(out, row_bytes)


def pack_reference(raw: np.ndarray) -> np.ndarray:
    """Row-major IQ4_XS bytes [out, units * 136] (out % 16 == 0) -> IQ4_XS_TILED's bytes: arranged, and
    both indices of every quant byte recoded (IQ4_TILED_INDEX)."""
    out, row_bytes = raw.shape
    packed = arrange_q4(raw)
    q = packed.reshape(out // 16, row_bytes // 136, 2176)[..., :2048]  # a view of the quants
    q[...] = IQ4_TILED_INDEX[q & 15] | (IQ4_TILED_INDEX[q >> 4] << 4)
    return packed


def pack_reference_q5(raw: np.ndarray) -> np.ndarray:
    """Row-major Q5_K bytes [out, units * 176] (out % 16 == 0: header [0, 16), qh [16, 48), qs [48, 176)) -> the
    tiled layout's bytes: Q4_K's arrangement of the header and qs, with the qh run between quants and headers."""
    out, row_bytes = raw.shape
    units, nt = row_bytes // 176, out // 16
    blk = raw.reshape(nt, 16, units, 176)                                       # tile, row in tile, unit, byte
    q4 = np.concatenate([blk[..., :16], blk[..., 48:]], axis=3).reshape(out, units * 144)
    q4 = arrange_q4(q4, 144, 16).reshape(nt, units, 2304)
    qh = blk[..., 16:48].reshape(nt, 2, 8, units, 2, 4, 4)                      # tile, h, g, unit, s, t, byte
    qh = qh.transpose(0, 3, 2, 5, 1, 4, 6).reshape(nt, units, 512)              # tile, unit, g, t, h, s, byte
    return np.concatenate([q4[..., :2048], qh, q4[..., 2048:]], axis=2).reshape(out, row_bytes)


def pack_reference_q6(raw: np.ndarray) -> np.ndarray:
    """Row-major Q6_K bytes [out, units * 210] (out % 16 == 0) -> the tiled layout's bytes."""
    out, row_bytes = raw.shape
    units, nt = row_bytes // 210, out // 16
    blk = raw.reshape(nt, 16, units, 210)                                       # tile, row in tile, unit, byte
    ql = blk[..., :128].reshape(nt, 2, 8, units, 2, 4, 4, 4)                    # tile, h, g, unit, c, m, t, byte
    ql = ql.transpose(0, 3, 1, 4, 2, 6, 5, 7)                                   # tile, unit, h, c, g, t, m, byte
    qh = blk[..., 128:192].reshape(nt, 2, 8, units, 4, 4, 4)                    # tile, h, g, unit, m, t, byte
    qh = qh.transpose(0, 3, 1, 2, 5, 4, 6)[:, :, :, None]                       # tile, unit, h, c = 2, g, t, m, byte
    quants = np.concatenate([ql, qh], axis=3).reshape(nt, units, 3072)
    scales = blk[..., 192:208].transpose(0, 2, 1, 3).reshape(nt, units, 256)
    d = blk[..., 208:210].transpose(0, 2, 1, 3).reshape(nt, units, 32)
    return np.concatenate([quants, scales, d], axis=2).reshape(out, row_bytes)


# source format -> (its tiled dtype, the reference packing)
FORMATS = {"IQ4_XS": (sn.DType.IQ4_XS_TILED, pack_reference),
           "Q4_K": (sn.DType.Q4_K_TILED, lambda raw: arrange_q4(raw, 144, 16)),
           "Q5_K": (sn.DType.Q5_K_TILED, pack_reference_q5),
           "Q6_K": (sn.DType.Q6_K_TILED, pack_reference_q6)}
# source format -> the byte arrangement alone (IQ4_XS without the recoding)
ARRANGE = {"IQ4_XS": arrange_q4, "Q4_K": lambda raw: arrange_q4(raw, 144, 16), "Q5_K": pack_reference_q5,
           "Q6_K": pack_reference_q6}


def blocks(rng, fmt, out, k):
    return sn.Tensor(np.ascontiguousarray(random_blocks(rng, fmt, out, k)), getattr(sn.DType, fmt))


def iq4(rng, out, k):
    return blocks(rng, "IQ4_XS", out, k)


@pytest.fixture
def rng():
    return np.random.default_rng(20261130)


def test_arrange_q4_moves_every_byte_once(rng):
    raw = rng.integers(0, 256, (32, 2 * 136), dtype=np.uint8)
    packed = arrange_q4(raw)
    assert packed.shape == raw.shape
    assert sorted(packed.ravel().tolist()) == sorted(raw.ravel().tolist())
    # spot checks against the description: row 9 (g 1, h 1), unit 1, sub-block j 5, t 2 -> word k 13 of lane 6
    unit = packed.reshape(2, 2, 2176)[0, 1]
    assert bytes(unit[512 * 3 + 16 * 6 + 4 * 1 : 512 * 3 + 16 * 6 + 4 * 2]) == bytes(raw[9, 136 + 8 + 16 * 5 + 8 : 136 + 8 + 16 * 5 + 12])
    assert bytes(unit[2048 + 8 * 9 : 2048 + 8 * 10]) == bytes(raw[9, 136 : 136 + 8])


def test_pack_reference_recodes_iq4_xs_indices(rng):
    """IQ4_XS_TILED: the arrangement, with each quant nibble c stored as IQ4_TILED_INDEX[c] (headers as
    they were). The recoded table (value of stored index s: KVALUES[IQ4_TILED_INDEX[s]], the map being
    its own inverse) has entries j and j + 8 of one sign for every j < 8: what the GEMV's lookup needs."""
    raw = rng.integers(0, 256, (32, 3 * 136), dtype=np.uint8)
    arranged, packed = arrange_q4(raw), pack_reference(raw)
    a, p = arranged.reshape(2, 3, 2176), packed.reshape(2, 3, 2176)
    assert np.array_equal(a[..., 2048:], p[..., 2048:])
    for shift in (0, 4):
        assert np.array_equal(IQ4_TILED_INDEX[(a[..., :2048] >> shift) & 15], (p[..., :2048] >> shift) & 15)
    assert np.array_equal(IQ4_TILED_INDEX[IQ4_TILED_INDEX], np.arange(16))
    recoded = KVALUES[IQ4_TILED_INDEX]
    assert np.array_equal(np.sign(recoded[:8]), np.sign(recoded[8:]))


def test_pack_reference_q4_k_spot_checks(rng):
    raw = rng.integers(0, 256, (32, 2 * 144), dtype=np.uint8)
    packed = arrange_q4(raw, 144, 16)
    assert sorted(packed.ravel().tolist()) == sorted(raw.ravel().tolist())
    unit = packed.reshape(2, 2, 2304)[1, 0]  # tile 1, unit 0: rows 16..31
    # row 16 + 10 (g 2, h 1), qs word k 6, t 3 -> run 2 + 1, lane 11, word 2
    assert bytes(unit[512 * 3 + 16 * 11 + 8 : 512 * 3 + 16 * 11 + 12]) == bytes(raw[26, 16 + 16 * 6 + 12 : 16 + 16 * 6 + 16])
    assert bytes(unit[2048 + 16 * 10 : 2048 + 16 * 11]) == bytes(raw[26, :16])


@pytest.mark.parametrize("fmt", ARRANGE)
def test_pack_reference_is_a_permutation(fmt):
    """Every byte position lands exactly once (the arrangements work on any element type: distinct ints)."""
    block = {"IQ4_XS": 136, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[fmt]
    raw = np.arange(32 * 3 * block, dtype=np.int32).reshape(32, 3 * block)
    packed = ARRANGE[fmt](raw)
    assert packed.shape == raw.shape and np.array_equal(np.sort(packed.ravel()), raw.ravel())


def test_pack_reference_q5_k_spot_checks(rng):
    raw = rng.integers(0, 256, (32, 2 * 176), dtype=np.uint8)
    packed = pack_reference_q5(raw)
    unit = packed.reshape(2, 2, 2816)[1, 1]  # tile 1, unit 1: rows 16..31, block bytes at 176 ..
    # row 16 + 10 (g 2, h 1), qs word k 6, t 3 -> run 2 + 1, lane 11, word 2
    assert bytes(unit[512 * 3 + 16 * 11 + 8 : 512 * 3 + 16 * 11 + 12]) == bytes(raw[26, 176 + 48 + 16 * 6 + 12 : 176 + 48 + 16 * 6 + 16])
    # row 16 + 10 (g 2, h 1), qh[16 + 4 t ..] with t 1 -> lane 9, word 2 h + 1 = 3
    assert bytes(unit[2048 + 16 * 9 + 12 : 2048 + 16 * 10]) == bytes(raw[26, 176 + 16 + 16 + 4 : 176 + 16 + 16 + 8])
    # row 16 + 3 (g 3, h 0), qh[4 t ..] with t 0 -> lane 12, word 0
    assert bytes(unit[2048 + 16 * 12 : 2048 + 16 * 12 + 4]) == bytes(raw[19, 176 + 16 : 176 + 20])
    assert bytes(unit[2560 + 16 * 10 : 2560 + 16 * 11]) == bytes(raw[26, 176 : 176 + 16])


def test_pack_reference_q6_moves_every_byte_once(rng):
    raw = rng.integers(0, 256, (32, 2 * 210), dtype=np.uint8)
    packed = pack_reference_q6(raw)
    assert packed.shape == raw.shape
    assert sorted(packed.ravel().tolist()) == sorted(raw.ravel().tolist())
    unit = packed.reshape(2, 2, 3360)[0, 1]  # tile 0, unit 1 (block bytes at 210 ..)
    # row 9 (g 1, h 1), ql word k 5 (c 1, m 1), t 2 -> run 4, lane 6, word 1
    assert bytes(unit[512 * 4 + 16 * 6 + 4 : 512 * 4 + 16 * 6 + 8]) == bytes(raw[9, 210 + 16 * 5 + 8 : 210 + 16 * 5 + 12])
    # row 2 (g 2, h 0), qh word m 3, t 1 -> run 2, lane 9, word 3
    assert bytes(unit[512 * 2 + 16 * 9 + 12 : 512 * 2 + 16 * 10]) == bytes(raw[2, 210 + 128 + 48 + 4 : 210 + 128 + 48 + 8])
    assert bytes(unit[3072 + 16 * 9 : 3072 + 16 * 10]) == bytes(raw[9, 210 + 192 : 210 + 208])
    assert bytes(unit[3328 + 2 * 9 : 3328 + 2 * 10]) == bytes(raw[9, 210 + 208 : 210 + 210])


def test_tiled_dtype_is_not_a_ggml_type():
    for tid, name in ((TILED_ID, "IQ4_XS"), (Q6_TILED_ID, "Q6_K"), (Q4K_TILED_ID, "Q4_K"), (Q5K_TILED_ID, "Q5_K")):
        with pytest.raises(ValueError, match=f"GEMV layout of {name}"):
            sn.dtype_from_id(tid)
    assert int(sn.DType.IQ4_XS_TILED) == TILED_ID and int(sn.DType.Q6_K_TILED) == Q6_TILED_ID
    assert int(sn.DType.Q4_K_TILED) == Q4K_TILED_ID and sn.type_size(sn.DType.Q4_K_TILED) == 144
    assert int(sn.DType.Q5_K_TILED) == Q5K_TILED_ID and sn.type_size(sn.DType.Q5_K_TILED) == 176
    assert sn.block_size(sn.DType.Q6_K_TILED) == 256 and sn.type_size(sn.DType.Q6_K_TILED) == 210


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_ops_refuse_the_tiled_layout(rng, fmt):
    """A tiled tensor (here raw bytes wrapped on the CPU) is read by the GPU matmul only."""
    tiled, pack = FORMATS[fmt]
    wt = sn.Tensor(np.ascontiguousarray(pack(random_blocks(rng, fmt, 32, 256))), tiled)
    assert list(wt.shape) == [32, 256]
    for call in (lambda: sn.slice(wt, 0, 0, 16), lambda: sn.concat([wt, wt]), lambda: wt.view_rows(0, 16),
                 lambda: sn.copy_rows(wt, 0, wt, 16, 16), lambda: wt.reshape([16, 512])):
        with pytest.raises(ValueError, match="tiled layout"):
            call()
    assert list(wt.reshape([32, 256]).shape) == [32, 256]  # the same shape is fine
    with pytest.raises(ValueError, match="tiled layout"):
        sn.matmul(sn.Tensor(np.zeros((1, 256), np.float32)), wt)
    with pytest.raises(ValueError, match=f"{fmt}_TILED"):
        sn.dequantize(wt)


@pytest.mark.skipif(sn.gpu_available(), reason="checks the error without a usable GPU")
def test_trim_pool_without_a_gpu():
    with pytest.raises(RuntimeError):
        sn.gpu_trim_pool()


def test_tile_for_gemv_needs_a_gpu_tensor(rng):
    with pytest.raises(ValueError, match="tile_for_gemv: w must be a GPU tensor"):
        sn.tile_for_gemv(iq4(rng, 16, 256))


@tiles_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_for_gemv_bytes(rng, fmt):
    tiled, pack = FORMATS[fmt]
    for out, k in ((16, 256), (48, 768), (64, 5120)):
        w = blocks(rng, fmt, out, k)
        t = sn.tile_for_gemv(w.to(GPU))
        assert t.dtype == tiled and list(t.shape) == [out, k] and t.device == GPU
        got = t.to(CPU).numpy()
        assert np.array_equal(got.reshape(out, -1), pack(w.numpy())), (out, k)


@tiles_only
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out,k", [(16, 256), (96, 512), (400, 1280), (17408, 5120), (5120, 6144)])
def test_tiled_matmul_bit_identical(rng, fmt, out, k):
    w = blocks(rng, fmt, out, k).to(GPU)
    wt = sn.tile_for_gemv(w)
    widths = range(1, 18) if out < 10000 else (1, 2, 8, 16)
    for n in widths:
        x = sn.Tensor((rng.standard_normal((n, k)) * 0.5).astype(np.float32)).to(GPU)
        ref = sn.matmul(x, w).to(CPU).numpy()
        got = sn.matmul(x, wt).to(CPU).numpy()
        assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), (out, k, n)


@tiles_only
def test_tile_for_gemv_into_an_ipc_export(rng):
    """tile_for_gemv(w, out=...) writes the tiles into a given buffer: the shared head's gpu_ipc_export memory
    (NativeIpcBackend.export_tensor(tiled=True), from the host bytes through a device staging copy), whose bytes are
    the reference packer's and whose matmul equals the row-major weight's; an out of another type or shape, or on
    the CPU, is refused."""
    from specd.target_worker.feature_cuda_ipc import NativeIpcBackend

    w = blocks(rng, "Q5_K", 64, 512)
    backend = NativeIpcBackend()
    d, h = backend.export_tensor(w, tiled=True)
    try:
        assert d.dtype == sn.DType.Q5_K_TILED and list(d.shape) == [64, 512] and len(h) == 64
        assert np.array_equal(d.to(CPU).numpy().reshape(64, -1), pack_reference_q5(w.numpy()))
        x = sn.Tensor((rng.standard_normal((3, 512)) * 0.5).astype(np.float32)).to(GPU)
        ref = sn.matmul(x, w.to(GPU)).to(CPU).numpy()
        assert np.array_equal(ref.view(np.uint32), sn.matmul(x, d).to(CPU).numpy().view(np.uint32))
    finally:
        backend.forget(h)
    wg = w.to(GPU)
    for dt, rows in ((sn.DType.Q4_K_TILED, 64), (sn.DType.Q5_K_TILED, 48)):
        with pytest.raises(ValueError, match=rf"out must be Q5_K_TILED \[64, 512\] \(w's shape\), got {dt.name} "
                                             rf"\[{rows}, 512\]"):
            sn.tile_for_gemv(wg, out=sn.Tensor.empty([rows, 512], dt, GPU))
    with pytest.raises(ValueError, match="tile_for_gemv: out"):
        sn.tile_for_gemv(wg, out=sn.Tensor(np.zeros((64, 352), np.uint8), sn.DType.Q5_K_TILED))  # on the CPU


@tiles_only
def test_tile_for_gemv_of_a_two_byte_aligned_q6_k_view(rng):
    """Q6_K rows are 210 * units bytes: a row view starts 2-byte aligned, and the tiling kernel reads
    16-bit halves, so it tiles any row view."""
    w = blocks(rng, "Q6_K", 17, 512)
    view = w.to(GPU).view_rows(1, 17)
    t = sn.tile_for_gemv(view)
    assert np.array_equal(t.to(CPU).numpy().reshape(16, -1), pack_reference_q6(w.numpy()[1:17]))


@tiles_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_prefill_across_panels(rng, fmt):
    """The BF16 dequantization of a weight larger than one panel (3296 rows of 40960 inputs: panels of
    3264 rows, whole 16-row tiles, then 32): the tile-unit kernel from a panel's first tile on."""
    w = blocks(rng, fmt, 3296, 40960).to(GPU)
    x = sn.Tensor((rng.standard_normal((20, 40960)) * 0.5).astype(np.float32)).to(GPU)
    ref = sn.matmul(x, w, exact=False).to(CPU).numpy()
    got = sn.matmul(x, sn.tile_for_gemv(w), exact=False).to(CPU).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@tiles_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_matmul_right_after_tiling(rng, fmt):
    """x already on the device, tile_for_gemv then matmul with nothing synchronising between them:
    the GEMV loads weight units before it waits for the kernels before it (programmatic dependent
    launch, native/src/gpu/pdl.cuh), so the tiling kernel must have completed by the time the GEMV
    starts (it never lets the next kernel launch early). Fresh weights every round, compared bit for bit
    with the row-major weight's result computed before the tiling."""
    x = sn.Tensor((rng.standard_normal((1, 5120)) * 0.5).astype(np.float32)).to(GPU)
    for _ in range(20):
        w = blocks(rng, fmt, 4096, 5120).to(GPU)
        ref = sn.matmul(x, w)
        got = sn.matmul(x, sn.tile_for_gemv(w))
        assert np.array_equal(ref.to(CPU).numpy().view(np.uint32), got.to(CPU).numpy().view(np.uint32))


@tiles_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_prefill_path_bit_identical(rng, fmt):
    """n > 16 without exact: dequantize to BF16 (panels; the tile-unit kernel) + cuBLAS."""
    w = blocks(rng, fmt, 272, 1024).to(GPU)
    wt = sn.tile_for_gemv(w)
    x = sn.Tensor((rng.standard_normal((40, 1024)) * 0.5).astype(np.float32)).to(GPU)
    ref = sn.matmul(x, w, exact=False).to(CPU).numpy()
    got = sn.matmul(x, wt, exact=False).to(CPU).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@tiles_only
def test_tiled_group_with_other_formats(rng):
    k = 512
    ws = [iq4(rng, 64, k).to(GPU), blocks(rng, "Q6_K", 32, k).to(GPU), iq4(rng, 48, k).to(GPU),
          blocks(rng, "Q6_K", 80, k).to(GPU), blocks(rng, "Q4_K", 32, k).to(GPU), blocks(rng, "Q4_K", 16, k).to(GPU),
          blocks(rng, "Q5_K", 48, k).to(GPU), blocks(rng, "Q5_K", 16, k).to(GPU)]
    tiled = [sn.tile_for_gemv(ws[0]), ws[1], sn.tile_for_gemv(ws[2]), sn.tile_for_gemv(ws[3]), sn.tile_for_gemv(ws[4]),
             ws[5], sn.tile_for_gemv(ws[6]), ws[7]]
    for n in (1, 5, 16, 20):
        x = sn.Tensor((rng.standard_normal((n, k)) * 0.5).astype(np.float32)).to(GPU)
        for a, b in zip(sn.matmul_group(x, ws), sn.matmul_group(x, tiled)):
            assert np.array_equal(a.to(CPU).numpy().view(np.uint32), b.to(CPU).numpy().view(np.uint32)), n


@tiles_only
@pytest.mark.parametrize("fmt", ["IQ4_XS", "Q4_K"])
@pytest.mark.parametrize("shapes,k", [([(12288, 5120), (1024, 5120), (1024, 5120)], 5120),  # the 27B's q / k / v
                                      ([(256, 512), (128, 512), (32, 512)], 512),
                                      ([(64, 512), (48, 512), (64, 512)], 512)])  # v too large to pair
def test_tiled_pair_launch_bit_identical(rng, fmt, shapes, k):
    """q / k tiled in fmt with v in tiled Q6_K (matmul_group at 1-10 rows: one pair launch, mma_gemv_pair_kernel, at
    each of its tile counts, when v is small beside q / k; at 11 and 16 rows, or with v as large as q / k, one launch
    a format) give bit for bit each weight's own matmul, whichever format comes first."""
    (oq, _), (ok, _), (ov, _) = shapes
    q, kk = (sn.tile_for_gemv(blocks(rng, fmt, o, k).to(GPU)) for o in (oq, ok))
    v = sn.tile_for_gemv(blocks(rng, "Q6_K", ov, k).to(GPU))
    for n in (1, 2, 3, 5, 8, 10, 11, 16):
        x = sn.Tensor((rng.standard_normal((n, k)) * 0.5).astype(np.float32)).to(GPU)
        alone = [sn.matmul(x, w).to(CPU).numpy() for w in (q, kk, v)]
        for order in ((0, 1, 2), (2, 0, 1)):
            ws = [(q, kk, v)[i] for i in order]
            for i, y in zip(order, sn.matmul_group(x, ws)):
                assert np.array_equal(y.to(CPU).numpy().view(np.uint32), alone[i].view(np.uint32)), (n, order, i)


@tiles_only
def test_tiled_bad_input(rng):
    with pytest.raises(ValueError, match="multiple of 16"):
        sn.tile_for_gemv(iq4(rng, 24, 256).to(GPU))
    with pytest.raises(ValueError, match="multiple of 16"):
        sn.tile_for_gemv(blocks(rng, "Q6_K", 24, 256).to(GPU))
    with pytest.raises(ValueError, match="IQ4_XS, Q4_K, Q5_K or Q6_K, got Q8_0"):
        sn.tile_for_gemv(blocks(rng, "Q8_0", 16, 256).to(GPU))
    wt = sn.tile_for_gemv(iq4(rng, 32, 256).to(GPU))
    with pytest.raises(ValueError, match="tiled layout"):
        sn.slice(wt, 0, 0, 16)
    for fmt, (tiled, _) in FORMATS.items():
        with pytest.raises(ValueError, match=f"{fmt}_TILED"):
            sn.embedding(sn.tile_for_gemv(blocks(rng, fmt, 32, 256).to(GPU)), sn.Tensor(np.array([0, 1], np.int32)))
    for dt, nbytes in ((sn.DType.IQ4_XS_TILED, 136), (sn.DType.Q4_K_TILED, 144), (sn.DType.Q5_K_TILED, 176),
                       (sn.DType.Q6_K_TILED, 210)):
        ragged = sn.Tensor(np.zeros((24, nbytes), np.uint8), dt).to(GPU)  # not made by tile_for_gemv
        with pytest.raises(ValueError, match="multiple of 16"):
            sn.matmul(sn.Tensor(np.zeros((1, 256), np.float32)).to(GPU), ragged)


@tiles_only
@pytest.mark.parametrize("mix,body", [("iq4xs", "IQ4_XS"), ("q4km", "Q4_K")])
def test_model_with_tiled_layers_equals_row_major(tmp_path, mix, body):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "bench"))
    import random_qwen35 as rq
    from specd.target_worker import shared_weights as sw
    from specd.target_worker.gguf_loader import load_qwen35
    from specd.target_worker.model import Qwen35Model

    path = tmp_path / f"tiny-{mix}.gguf"
    rq.write(path, "tiny", mix)
    def cached():  # bytes the pool holds but no buffer uses
        mi = sn.gpu_memory_info()
        return mi["pool_reserved_bytes"] - mi["pool_used_bytes"] if mi["pool"] else 0

    before = cached()
    tiled = Qwen35Model(load_qwen35(str(path)), device=GPU, gemv_tiles=True)
    assert cached() <= before + (64 << 20), "the upload temporaries stay cached (sn.gpu_trim_pool)"
    plain = Qwen35Model(load_qwen35(str(path)), device=GPU, gemv_tiles=False)
    assert tiled.layers[0].ffn_gate.dtype == getattr(sn.DType, body + "_TILED")
    assert plain.layers[0].ffn_gate.dtype == getattr(sn.DType, body)
    mats = [v for layer in tiled.layers for v in vars(layer).values() if len(getattr(v, "shape", ())) == 2]
    assert sn.DType.Q6_K_TILED in {m.dtype for m in mats}  # the mix's attn_v (and ssm_out / every other ffn_down)
    # every layer matrix of a tiled format is tiled, except those whose rows are not whole tiles (the tiny
    # config's 4-row ssm_alpha / ssm_beta)
    assert all(m.shape[0] % 16 for m in mats if m.dtype in (sn.DType.Q6_K, sn.DType.IQ4_XS, sn.DType.Q4_K, sn.DType.Q5_K))
    # the untied head tiled too (iq4xs: Q5_K, q4km: Q6_K), the embedding row-major (row gathers)
    assert tiled.output.dtype == sn.tiled_of(plain.output.dtype) != plain.output.dtype
    assert tiled.token_embd.dtype == plain.token_embd.dtype
    # exported for the drafter (the shared head's IPC buffer), the head is tiled into that buffer
    exporter = sw.HeadExporter()
    shared = Qwen35Model(load_qwen35(str(path)), device=GPU, gemv_tiles=True, head_exporter=exporter)
    assert shared.output.dtype == tiled.output.dtype and shared.output is exporter.tensors[-1]
    assert [(i.name, i.ggml_type) for i in exporter.infos] == [
        (sw.EMBD, int(plain.token_embd.dtype)), (sw.OUTPUT_TILED, int(tiled.output.dtype))]
    assert np.array_equal(shared.output.to(CPU).numpy(), tiled.output.to(CPU).numpy())
    prompt = list(range(3, 40))
    sa, sb = tiled.new_sequence(128), plain.new_sequence(128)
    la, lb = tiled.prefill(sa, prompt), plain.prefill(sb, prompt)
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))
    sc = shared.new_sequence(128)
    assert np.array_equal(shared.prefill(sc, prompt).view(np.uint32), lb.view(np.uint32))
    shared.release(sc)
    del shared
    exporter.close()
    tok = int(np.argmax(la))
    for w in (1, 3, 8, 16):
        toks = [tok] + [(tok + j) % 1000 for j in range(1, w)]
        ra, rb = tiled.verify(sa, toks), plain.verify(sb, toks)
        assert np.array_equal(ra.logits.view(np.uint32), rb.logits.view(np.uint32)), w
        tiled.commit(sa, ra, 1)
        plain.commit(sb, rb, 1)
        tok = int(ra.argmax[0])


def cuda_kernels(fn):
    """Names of the CUDA kernels fn() runs (torch.profiler's activity trace), after a first call that loads them."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile
    fn()
    sn.gpu_synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sn.gpu_synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@tiles_only
def test_pair_launch_is_taken(rng):
    """matmul_group of the 27B's attention q / k (tiled IQ4_XS) and v (tiled Q6_K), either order, runs one
    mma_gemv_pair_kernel at 1-10 rows and a kernel per format at 11 and 16 rows, and a v as large as q / k is never
    paired (its blocks would lose their register ring): the bitwise tests above pass on either path."""
    if not sn.gpu_available():
        pytest.skip("kernel names exist on a GPU only")
    k = 5120
    q, kk = (sn.tile_for_gemv(iq4(rng, o, k).to(GPU)) for o in (12288, 1024))
    v, v_big = (sn.tile_for_gemv(blocks(rng, "Q6_K", o, k).to(GPU)) for o in (1024, 12288))
    for n, paired in ((1, True), (2, True), (5, True), (8, True), (10, True), (11, False), (16, False)):
        x = sn.Tensor((rng.standard_normal((n, k)) * 0.5).astype(np.float32)).to(GPU)
        for ws in ([q, kk, v], [v, q, kk]):
            names = cuda_kernels(lambda: sn.matmul_group(x, ws))
            assert sum("mma_gemv_pair_kernel" in s for s in names) == int(paired), (n, names)
            assert sum("mma_gemv_kernel" in s for s in names) == (0 if paired else 2), (n, names)
    x = sn.Tensor((rng.standard_normal((1, k)) * 0.5).astype(np.float32)).to(GPU)
    names = cuda_kernels(lambda: sn.matmul_group(x, [q, v_big]))
    assert not any("mma_gemv_pair_kernel" in s for s in names) and sum("mma_gemv_kernel" in s for s in names) == 2
