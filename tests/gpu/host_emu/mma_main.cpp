// Host emulation of the integer tensor-core GEMV (native/src/gpu/matmul_mma.cuh): its split_x_kernel
// and mma_gemv_kernel run on the CPU, one std::thread per lane, with the warp-wide instructions
// emulated from the PTX ISA fragment layouts (warp_emu.h, a barrier per instruction): mma.sync
// m16n8k32 s8 -> s32 (exact integers, as the hardware), mma.sync m16n8k16 f16 -> f32 (products exact,
// summed in double, rounded once: the min terms' operands are small integers, so the hardware's sums
// are exact too), shuffles and __syncwarp. Checks the per-format load offsets, k order, x split, scales, min terms and
// split-K against the CPU backend (test_gpu_decoders_host.py) without a GPU; the device itself is
// covered by test_gpu_matmul.py.
//
// usage: mma_emu FORMAT n in out[,out...] w.bin x.bin y.bin   (x: F32 [n, in]; y: F32 [n, out]; w: the
// weights row-major as in GGUF; FORMAT IQ4_XS_T / Q4_K_T / Q5_K_T / Q6_K_T packs them into the tiled layout,
// then runs IQ4T / Q4T / Q5T / Q6T; BF16 (in % 64 == 0) runs BF16U on its own x split, split_x_bf16_kernel);
// mma_emu pair FMT_F FMT_G n in outs_f outs_g wf.bin wg.bin x.bin y.bin: two formats' groups in one pair launch
// (mma_gemv_pair_kernel); also `lookup`, `queue` and `splits` checks (below)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "warp_emu.h"
#include "matmul_mma.cuh"

using namespace specd::gpu::detail;

// IQ4T's stored index of IQ4_XS index c (4 bits): bits 2 and 3 swapped.
inline int iq4_tiled_index(int c) { return (c & 3) | ((c & 4) << 1) | ((c & 8) >> 1); }

// The test's own packer of IQ4T's / Q4T's / Q5T's tiled layout (the library tiles on the GPU: mma::tile_q4_kernel,
// checked against a numpy packer on the device by test_gpu_gemv_tiles.py): a row-major IQ4_XS / Q4_K / Q5_K
// weight src [out][nunits * block bytes] (a hdr-byte header, Q5_K's qh[32], then qs[128]) -> dst ((out + 15) / 16 *
// nunits * 16 * block bytes: the quant runs, Q5_K's qh run, the headers); a ragged last tile repeats the last row (the
// kernel's clamp makes any row count work; the library tiles multiples of 16). recode (IQ4_XS): both indices of every
// quant byte go through iq4_tiled_index.
void pack_q4_tiles(const uint8_t* src, int64_t out, int64_t nunits, int block, int hdr, bool recode, uint8_t* dst) {
  const int64_t row_bytes = nunits * block;
  const int qh = block - 128 - hdr, qs = hdr + qh;  // Q5_K: 32 bytes of fifth bits before the quants
  for (int64_t tile = 0; tile < (out + 15) / 16; ++tile)
    for (int64_t u = 0; u < nunits; ++u) {
      uint8_t* o = dst + (tile * nunits + u) * 16 * block;
      for (int r = 0; r < 16; ++r) {
        const int64_t row = std::min<int64_t>(tile * 16 + r, out - 1);
        const uint8_t* blk = src + row * row_bytes + u * block;
        for (int b = 0; b < hdr; ++b) o[2048 + 16 * qh + hdr * r + b] = blk[b];
        const int g = r & 7, h = r >> 3;
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 4; ++t) {
            const int k = 8 * h + j, lane = 4 * g + t;  // word k of the lane: run k / 4, word k % 4
            for (int b = 0; b < 4; ++b) {
              const int q = blk[qs + 16 * j + 4 * t + b];
              o[512 * (k >> 2) + 16 * lane + 4 * (k & 3) + b] =
                  uint8_t(recode ? iq4_tiled_index(q & 15) | (iq4_tiled_index(q >> 4) << 4) : q);
            }
          }
        for (int s = 0; s < (qh ? 2 : 0); ++s)  // the qh run: lane 4 g + t's words qh[16 s + 4 t ..] of rows g, g + 8
          for (int t = 0; t < 4; ++t)
            for (int b = 0; b < 4; ++b) o[2048 + 16 * (4 * g + t) + 4 * (2 * h + s) + b] = blk[hdr + 16 * s + 4 * t + b];
      }
    }
}

// The same for Q6T's layout (mma::tile_q6_k_kernel on the GPU): src Q6_K [out][nunits * 210 bytes] ->
// dst ((out + 15) / 16 * nunits * 3360 bytes): per tile unit, run 3 h + c at 16 lane holds the lane's
// words 4 c .. 4 c + 3 of row g + 8 h (words k < 8: ql[16 k + 4 t ..], k >= 8: qh[16 (k - 8) + 4 t ..]),
// then the 16 rows' scales (16 bytes each), then their d (2 bytes each).
void pack_q6_k_tiles(const uint8_t* src, int64_t out, int64_t nunits, uint8_t* dst) {
  const int64_t row_bytes = nunits * 210;
  for (int64_t tile = 0; tile < (out + 15) / 16; ++tile)
    for (int64_t u = 0; u < nunits; ++u) {
      uint8_t* o = dst + (tile * nunits + u) * mma::Q6T::kTileUnitBytes;
      for (int r = 0; r < 16; ++r) {
        const int64_t row = std::min<int64_t>(tile * 16 + r, out - 1);
        const uint8_t* blk = src + row * row_bytes + u * 210;
        for (int b = 0; b < 16; ++b) o[3072 + 16 * r + b] = blk[192 + b];
        for (int b = 0; b < 2; ++b) o[3328 + 2 * r + b] = blk[208 + b];
        const int g = r & 7, h = r >> 3;
        for (int k = 0; k < 12; ++k)
          for (int t = 0; t < 4; ++t) {
            const int lane = 4 * g + t, run = 3 * h + k / 4;
            const int from = (k < 8 ? 16 * k : 128 + 16 * (k - 8)) + 4 * t;
            for (int b = 0; b < 4; ++b) o[512 * run + 16 * lane + 4 * (k % 4) + b] = blk[from + b];
          }
      }
    }
}

// The library's tiling kernel (mma::tile_q4_kernel over tile_q4_pieces' threads, as launch_tile_q4 runs it; Q6T:
// tile_q6_k_kernel over tile_q6_k_pieces') on the whole tiles of src [out][nunits * block bytes] gives this harness's packer's bytes
// (`packed`); exits 3 naming the first differing byte otherwise. The device test compares the kernel with a numpy
// packer too (test_gpu_gemv_tiles.py); this catches a wrong piece count or offset without a GPU.
template <class F>
void check_tiling_kernel(const uint8_t* src, int64_t out, int64_t nunits, const std::vector<uint8_t>& packed) {
  using namespace specd::gpu::detail::mma;
  const int64_t rows = out / 16 * 16;
  if (rows == 0) return;
  std::vector<uint8_t> dst(size_t(rows / 16 * nunits * F::kTileUnitBytes), 0xEE);  // poisoned: every byte written
  auto* d = reinterpret_cast<uint4*>(dst.data());
  int64_t pieces = 0;
  if constexpr (std::is_same_v<F, Q6T>) pieces = tile_q6_k_pieces(rows, nunits);
  else if constexpr (std::is_same_v<F, Q4T>) pieces = tile_q4_pieces<144>(rows, nunits);
  else if constexpr (std::is_same_v<F, Q5T>) pieces = tile_q4_pieces<176>(rows, nunits);
  else pieces = tile_q4_pieces<136>(rows, nunits);
  blockDim.x = 256;
  for (int64_t id = 0; id < (pieces + 255) / 256 * 256; ++id) {  // the launch's threads, one after the other
    blockIdx.x = unsigned(id / 256), threadIdx.x = unsigned(id % 256);
    if constexpr (std::is_same_v<F, Q6T>) tile_q6_k_kernel(src, nunits, pieces, d);
    else if constexpr (std::is_same_v<F, Q4T>) tile_q4_kernel<144, 16, false>(src, nunits, pieces, d);
    else if constexpr (std::is_same_v<F, Q5T>) tile_q4_kernel<176, 16, false>(src, nunits, pieces, d);
    else tile_q4_kernel<136, 8, true>(src, nunits, pieces, d);
  }
  for (size_t i = 0; i < dst.size(); ++i)
    if (dst[i] != packed[i]) {
      std::fprintf(stderr, "tiling kernel: byte %zu is %d, the packer's %d\n", i, dst[i], packed[i]);
      std::exit(3);
    }
}

// x [n, in] split as the call splits it (launch_split_x; BF16U: split_x_bf16), into scratch the caller keeps: the
// XView the GEMV reads. Poisoned (NaN f32 / f16, int8 -1): whatever the kernels read was written, but for the
// padding columns' B fragments and sub-block sums, which every lane of the x-ahead instances loads and only padding
// columns may see.
template <class F>
specd::gpu::detail::mma::XView split(const std::vector<float>& x, int n, int64_t in, std::vector<uint8_t>& scratch_x,
                                     std::vector<uint4>& scratch_h) {
  using namespace specd::gpu::detail::mma;
  const XSizes sz(in);
  scratch_x.assign(sz.total(), 0xFF);
  uint8_t* base = scratch_x.data();
  XView xv{reinterpret_cast<const uint2*>(base), reinterpret_cast<const float*>(base + sz.xb),
           reinterpret_cast<const uint32_t*>(base + sz.xb + sz.xs), 3 * n, 0};
  if constexpr (std::is_same_v<F, BF16U>) {  // its own split: three BF16 terms (as mma::split_x_bf16)
    scratch_h.assign(size_t(in / 32 * kMaxTiles * 32), make_uint4(0xA5A5A5A5u, 0xA5A5A5A5u, 0xA5A5A5A5u, 0xA5A5A5A5u));
    const int tiles = tiles_for(n);
    const int64_t threads = in / 32 * tiles * 32;
    emulate((threads + 127) / 128, 128, [&] { split_x_bf16_kernel(x.data(), in, n, tiles, scratch_h.data()); });
    xv = XView{nullptr, nullptr, nullptr, 3 * n, 0};
    xv.xh = scratch_h.data();
  } else {
    const int64_t groups = (in + kGroup - 1) / kGroup, threads = int64_t(n) * groups * 32;  // as launch_split_x
    emulate((threads + 127) / 128, 128, [&] {
      const XSizes::Parts xp = sz.at(base);
      split_x_kernel(PlainInput{x.data(), in}, in, n, groups, xp.xb, xp.xs, xp.xm);
    });
  }
  return xv;
}

// Multiprocessors the split plans assume: SPECD_EMU_SMS (default 132, an H200; small values give many splits on the
// tests' small weights).
int64_t emu_sms() {
  const char* sms_env = std::getenv("SPECD_EMU_SMS");
  return sms_env ? std::atoll(sms_env) : 132;
}

// Weights of format F planned as one grouped launch (mma::plan_group: flat grid, each weight's own split; the
// launch's own planner): w holds the rows of weights of outs[i] rows one after the other (row-major, as in GGUF; a
// tiled format packs each into its tiled bytes, and checks the library's tiling kernel against the packer), their
// outputs [n, outs[i]] one after the other at y.
template <class F>
struct Planned {
  std::vector<std::vector<uint8_t>> packed;
  std::vector<std::vector<float>> scratch;
  std::vector<specd::gpu::detail::mma::GroupWeight> ws;
  specd::gpu::detail::mma::Group grp;
  specd::gpu::detail::mma::SplitSums sums;
  Planned(const Planned&) = delete;  // grp and ws point into its own vectors
  Planned& operator=(const Planned&) = delete;
  Planned(const uint8_t* w, int64_t row_bytes, int64_t in, int n, const std::vector<int64_t>& outs, float* y) {
    using namespace specd::gpu::detail::mma;
    int64_t row0 = 0, y0 = 0;
    for (int64_t o : outs) {
      ws.push_back({w + row0 * row_bytes, row_bytes, o, y + y0});
      row0 += o, y0 += int64_t(n) * o;
    }
    if constexpr (F::kTiled) {
      packed.reserve(ws.size());
      for (GroupWeight& wt : ws) {
        packed.emplace_back(size_t((wt.out + 15) / 16 * (in / 256) * F::kTileUnitBytes));
        if constexpr (std::is_same_v<F, Q6T>)
          pack_q6_k_tiles(wt.w, wt.out, in / 256, packed.back().data());
        else if constexpr (std::is_same_v<F, Q4T>)
          pack_q4_tiles(wt.w, wt.out, in / 256, 144, 16, false, packed.back().data());
        else if constexpr (std::is_same_v<F, Q5T>)
          pack_q4_tiles(wt.w, wt.out, in / 256, 176, 16, false, packed.back().data());
        else
          pack_q4_tiles(wt.w, wt.out, in / 256, 136, 8, true, packed.back().data());
        check_tiling_kernel<F>(wt.w, wt.out, in / 256, packed.back());
        wt.w = packed.back().data();
      }
    }
    scratch.reserve(ws.size());  // the partials' buffers stay where plan_group put them
    if (!plan_group<F>(ws.data(), int(outs.size()), in, n, emu_sms(),
                       [&](size_t bytes) {
                         scratch.emplace_back(bytes / sizeof(float), NAN);
                         return scratch.back().data();
                       }, grp, sums))
      std::abort();  // (no partials buffers here: every output is summed)
  }
  int64_t blocks() const { return grp.block0[grp.count]; }
  // The split sums of mma::sum_splits_at (the sum kernel's element function).
  void sum() const {
    for (int64_t e = 0; e < sums.elem0[sums.count]; ++e) specd::gpu::detail::mma::sum_splits_at(sums, e);
  }
};

// The weights of format F against x as one grouped launch (mma_gemv_kernel), then their split sums.
template <class F>
void run(const std::vector<uint8_t>& w, int64_t row_bytes, int64_t in, const std::vector<float>& x, int n,
         const std::vector<int64_t>& outs, std::vector<float>& y) {
  using namespace specd::gpu::detail::mma;
  std::vector<uint8_t> sx;
  std::vector<uint4> sh;
  const XView xv = split<F>(x, n, in, sx, sh);
  const Planned<F> p(w.data(), row_bytes, in, n, outs, y.data());
  const int64_t nunits = in / F::kUnitElems;
  const auto kernel = with_tiles(n, [](auto nt) { return mma_gemv_kernel<F, decltype(nt)::value>; });
  emulate(p.blocks(), kWarps * 32, [&] { kernel(p.grp, nunits, xv, n); });
  p.sum();
}

// Weights of formats F (rows outs_f, at wf) and G (outs_g, at wg) against x as one pair launch
// (mma_gemv_pair_kernel, up to kPairMaxTiles n8 tiles: n <= 10), then their split sums; y: F's outputs, then G's.
template <class F, class G>
void run_pair(const std::vector<uint8_t>& wf, int64_t rb_f, const std::vector<uint8_t>& wg, int64_t rb_g, int64_t in,
              const std::vector<float>& x, int n, const std::vector<int64_t>& outs_f,
              const std::vector<int64_t>& outs_g, std::vector<float>& y) {
  using namespace specd::gpu::detail::mma;
  std::vector<uint8_t> sx;
  std::vector<uint4> sh;
  const XView xv = split<F>(x, n, in, sx, sh);
  int64_t yf = 0;
  for (int64_t o : outs_f) yf += int64_t(n) * o;
  const Planned<F> pf(wf.data(), rb_f, in, n, outs_f, y.data());
  const Planned<G> pg(wg.data(), rb_g, in, n, outs_g, y.data() + yf);
  const auto kernel = with_tiles(n, [](auto nt) {
    return mma_gemv_pair_kernel<F, G, std::min(int(decltype(nt)::value), kPairMaxTiles)>;
  });
  emulate(pf.blocks() + pg.blocks(), kWarps * 32,
          [&] { kernel(pf.grp, in / F::kUnitElems, pg.grp, in / G::kUnitElems, xv, n); });
  pf.sum(), pg.sum();
}

// `mma_emu queue`: mma::queue_sums on synthetic sets: sets that fit are merged with their element ranges rebased
// one after the other; a set that would not fit first flushes the pending one (exactly once, whole) and then starts
// a new one at element 0. Prints what fails, returns 1 if anything does.
int check_queue_sums() {
  using namespace specd::gpu::detail::mma;
  static float parts[kMaxGroup * 2][1], ys[kMaxGroup * 2][1];
  const auto set = [&](int first, int count) {  // weights first .. first + count - 1, weight i of 10 (i + 1) elements
    SplitSums s;
    for (int i = 0; i < count; ++i) {
      s.part[i] = parts[first + i], s.y[i] = ys[first + i], s.splits[i] = first + i + 2;
      s.elem0[i + 1] = s.elem0[i] + 10 * (first + i + 1);
    }
    s.count = count;
    return s;
  };
  int bad = 0, flushes = 0;
  SplitSums flushed, pending;
  const auto flush = [&](const SplitSums& full) { ++flushes, flushed = full; };
  const auto expect = [&](bool ok, const char* what) {
    if (!ok) std::printf("queue_sums: %s\n", what), bad = 1;
  };
  queue_sums(pending, set(0, 3), flush);
  queue_sums(pending, set(3, 2), flush);
  expect(flushes == 0 && pending.count == 5, "two sets of 3 and 2 weights merged without a flush");
  bool ok = true;
  for (int i = 0; i < 5; ++i)  // weight i: its own pointers and splits, elements [5 i (i + 1), 5 (i + 1) (i + 2))
    ok = ok && pending.part[i] == parts[i] && pending.y[i] == ys[i] && pending.splits[i] == i + 2 &&
         pending.elem0[i] == 5 * i * (i + 1) && pending.elem0[i + 1] == 5 * (i + 1) * (i + 2);
  expect(ok, "merged weights keep their pointers, splits and consecutive element ranges");
  queue_sums(pending, set(5, 4), flush);  // 5 + 4 > kMaxGroup: the 5 are flushed, the 4 start anew
  expect(flushes == 1 && flushed.count == 5 && flushed.elem0[5] == 150, "a set that does not fit flushes the pending one");
  ok = pending.count == 4 && pending.elem0[0] == 0;
  for (int i = 0; i < 4; ++i)
    ok = ok && pending.part[i] == parts[5 + i] && pending.elem0[i + 1] - pending.elem0[i] == 10 * (6 + i);
  expect(ok, "after a flush the set starts at element 0");
  if (!bad) std::printf("ok\n");
  return bad;
}

// `mma_emu lookup`: checks of the byte permute the IQ4_XS lookups are made of, then of the lookups
// themselves; prints what fails, returns 1 if anything does.
int check_lookups() {
  int bad = 0;
  // The __byte_perm stand-in (portability.h) and mma::prmt against hand-computed PTX prmt.b32 results
  // (default mode: selector nibble bit 3 replicates the selected byte's sign; upper 16 bits ignored).
  struct Case {
    uint32_t a, b, sel, want;
  };
  const Case cases[] = {
      {0x33221100u, 0x77665544u, 0x3210u, 0x33221100u},
      {0x33221100u, 0x77665544u, 0x7654u, 0x77665544u},
      {0x33221100u, 0x77665544u, 0x0123u, 0x00112233u},
      {0x33221100u, 0x77665544u, 0x5140u, 0x55114400u},
      {0x80FF7F01u, 0x00000000u, 0x8888u, 0x00000000u},  // sign of 0x01
      {0x80FF7F01u, 0x00000000u, 0xAAAAu, 0xFFFFFFFFu},  // sign of 0xFF
      {0x80FF7F01u, 0x00000000u, 0xB8A9u, 0xFF00FF00u},  // signs of 0x7F, 0xFF, 0x01, 0x80
      {0x00000000u, 0x7F80017Fu, 0xCDEFu, 0x0000FF00u},  // from b: signs of b3 0x7F, b2 0x80, b1 0x01, b0 0x7F
      {0x33221100u, 0xF0665544u, 0x7F3Cu, 0xF0FF3300u},  // mixed: b0 sign, a3, b3 sign, b3
  };
  for (const Case& c : cases) {
    const uint32_t got = __byte_perm(c.a, c.b, c.sel), got_hi = mma::prmt(c.a, c.b, 0xABCD0000u | c.sel);
    if (got != c.want || got_hi != c.want) {
      std::printf("prmt(%08x, %08x, %04x) = %08x / %08x, want %08x\n", c.a, c.b, c.sel, got, got_hi, c.want);
      ++bad;
    }
  }
  // mma::sbyte (one sign-mode permute) against the int8 of the byte: every byte value at every position,
  // the other bytes set.
  for (int i = 0; i < 4; ++i)
    for (uint32_t b = 0; b < 256; ++b) {
      const uint32_t v = (0xA5C3E781u & ~(0xFFu << (8 * i))) | (b << (8 * i));
      if (mma::sbyte(v, i) != int(int8_t(uint8_t(b)))) {
        std::printf("sbyte(%08x, %d) = %d, want %d\n", v, i, mma::sbyte(v, i), int(int8_t(uint8_t(b))));
        ++bad;
      }
    }
  // IQ4T's lookup of recoded words gives IQ4U's lookup of the original words (and kvalues), for every
  // value of the first 16 bits, then random words (both tables as every lane builds them).
  static const int8_t kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto rnd = [&] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return uint32_t(state >> 16);
  };
  for (int lane = 0; lane < 2; ++lane) {
    const mma::IQ4Table tab(lane);
    const mma::IQ4TableRecoded rec(lane);
    for (uint32_t i = 0; i < (1u << 16) + 100000u; ++i) {
      const uint32_t w = i < (1u << 16) ? i * 0x10001u ^ 0x5A5A0000u : rnd();
      uint32_t wr = 0;  // w recoded nibble by nibble
      for (int k = 0; k < 8; ++k) wr |= uint32_t(iq4_tiled_index(int(w >> (4 * k)) & 15)) << (4 * k);
      if (wr != iq4_tile_recode(w)) {
        std::printf("iq4_tile_recode(%08x) = %08x, want %08x\n", w, iq4_tile_recode(w), wr);
        ++bad;
      }
      const uint2 a = tab.lookup8(w), b = rec.lookup8(wr);
      uint32_t want[2] = {0u, 0u};
      for (int k = 0; k < 8; ++k) want[k >> 2] |= uint32_t(uint8_t(kv[(w >> (4 * k)) & 15])) << (8 * (k & 3));
      if (a.x != want[0] || a.y != want[1] || b.x != want[0] || b.y != want[1]) {
        if (++bad < 10)
          std::printf("w %08x: lookup8 %08x %08x, recoded %08x %08x, want %08x %08x\n", w, a.x, a.y, b.x, b.y, want[0],
                      want[1]);
      }
    }
  }
  std::printf("%s\n", bad ? "FAILED" : "ok");
  return bad ? 1 : 0;
}

// `mma_emu splits FORMAT out in sms`: the GEMV's split plan of one weight (mma::splits_for, units_per_split_of) as
// "splits units_per_split wave_blocks one_tile_blocks": the blocks per multiprocessor the wave rule assumes and those
// the format's tiled twin's one-tile instance runs at in this build (min_blocks; 0 0 without a twin).
template <class F>
int print_splits(int64_t out, int64_t in, int64_t sms) {
  const int64_t nunits = in / F::kUnitElems;
  using T = typename mma::SplitTwin<F>::type;
  int blocks = 0;
  if constexpr (!std::is_void_v<T>) blocks = mma::min_blocks<T, 1>();
  std::printf("%lld %lld %d %d\n", static_cast<long long>(mma::splits_for<F>(out, nunits, sms)),
              static_cast<long long>(mma::units_per_split_of<F>(out, nunits, sms)), mma::wave_blocks<F>(), blocks);
  return 0;
}

// Row bytes of a weight of `in` inputs in FORMAT (as the usage line names them; _T: the tiled layout of the same
// row-major bytes), 0 for an unknown format or shape.
int64_t row_bytes_of(const std::string& fmt, int64_t in) {
  if (fmt == "Q8_0") return in / 32 * 34;
  if (fmt == "Q4_K" || fmt == "Q4_K_T") return in / 256 * 144;
  if (fmt == "Q5_K" || fmt == "Q5_K_T") return in / 256 * 176;
  if (fmt == "Q6_K" || fmt == "Q6_K_T") return in / 256 * 210;
  if (fmt == "IQ4_XS" || fmt == "IQ4_XS_T") return in / 256 * 136;
  if (fmt == "BF16" && in % 64 == 0) return in * 2;
  return 0;
}

// Comma-separated row counts, one per weight of a group (empty or more than kMaxGroup: none).
std::vector<int64_t> parse_outs(const char* p) {
  std::vector<int64_t> outs;
  while (*p) {
    char* end = nullptr;
    outs.push_back(std::strtoll(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
  }
  if (outs.size() > size_t(specd::gpu::detail::mma::kMaxGroup)) outs.clear();
  return outs;
}

// The first `count` values of type T in file `path` (a short file leaves the rest zero).
template <class T>
std::vector<T> read_file(const char* path, size_t count) {
  std::vector<T> v(count);
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(v.data()), std::streamsize(count * sizeof(T)));
  return v;
}

int64_t total(const std::vector<int64_t>& outs) {
  int64_t t = 0;
  for (int64_t o : outs) t += o;
  return t;
}

// `mma_emu pair FMT_F FMT_G n in outs_f outs_g wf.bin wg.bin x.bin y.bin`: the pair launch (run_pair) of the pairs
// gemv_split launches so (mma::with_pair: IQ4_XS_T or Q4_K_T with Q6_K_T), n <= 10 (kPairMaxTiles).
int pair_main(char** argv) {
  using namespace specd::gpu::detail;
  const std::string ff = argv[2], fg = argv[3];
  const int n = std::atoi(argv[4]);
  const int64_t in = std::atoll(argv[5]);
  const std::vector<int64_t> outs_f = parse_outs(argv[6]), outs_g = parse_outs(argv[7]);
  const int64_t rb_f = row_bytes_of(ff, in), rb_g = row_bytes_of(fg, in);
  if (n < 1 || mma::tiles_for(n) > mma::kPairMaxTiles || outs_f.empty() || outs_g.empty() || rb_f == 0 || rb_g == 0 || fg != "Q6_K_T") return 2;
  const auto wf = read_file<uint8_t>(argv[8], size_t(rb_f * total(outs_f)));
  const auto wg = read_file<uint8_t>(argv[9], size_t(rb_g * total(outs_g)));
  const auto x = read_file<float>(argv[10], size_t(n * in));
  std::vector<float> y(size_t(n * (total(outs_f) + total(outs_g))), NAN);  // poisoned: every row must be written
  if (ff == "IQ4_XS_T") run_pair<mma::IQ4T, mma::Q6T>(wf, rb_f, wg, rb_g, in, x, n, outs_f, outs_g, y);
  else if (ff == "Q4_K_T") run_pair<mma::Q4T, mma::Q6T>(wf, rb_f, wg, rb_g, in, x, n, outs_f, outs_g, y);
  else return 2;
  std::ofstream(argv[11], std::ios::binary).write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * 4));
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "lookup") return check_lookups();
  if (argc == 2 && std::string(argv[1]) == "queue") return check_queue_sums();
  if (argc == 12 && std::string(argv[1]) == "pair") return pair_main(argv);
  if (argc == 6 && std::string(argv[1]) == "splits") {
    const std::string f = argv[2];
    const int64_t out = std::atoll(argv[3]), in = std::atoll(argv[4]), sms = std::atoll(argv[5]);
    if (f == "IQ4_XS_T") return print_splits<mma::IQ4T>(out, in, sms);
    if (f == "IQ4_XS") return print_splits<mma::IQ4U>(out, in, sms);
    if (f == "Q6_K_T") return print_splits<mma::Q6T>(out, in, sms);
    if (f == "Q6_K") return print_splits<mma::Q6U>(out, in, sms);
    if (f == "Q4_K_T") return print_splits<mma::Q4T>(out, in, sms);
    if (f == "Q4_K") return print_splits<mma::QK45U<false>>(out, in, sms);
    if (f == "Q5_K_T") return print_splits<mma::Q5T>(out, in, sms);
    if (f == "Q5_K") return print_splits<mma::QK45U<true>>(out, in, sms);
    if (f == "Q8_0") return print_splits<mma::Q8U>(out, in, sms);
    if (f == "BF16") return print_splits<mma::BF16U>(out, in, sms);
    return 2;
  }
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s FORMAT n in out[,out...] w.bin x.bin y.bin\n", argv[0]);
    return 2;
  }
  const std::string fmt = argv[1];
  const int n = std::atoi(argv[2]);
  if (n < 1 || n > 16) return 2;  // the GEMV's widths
  const int64_t in = std::atoll(argv[3]);
  const std::vector<int64_t> outs = parse_outs(argv[4]);
  const int64_t row_bytes = row_bytes_of(fmt, in);
  if (outs.empty() || row_bytes == 0) return 2;
  // The weights' rows one after the other (y: each weight's [n, out] one after the other).
  const auto w = read_file<uint8_t>(argv[5], size_t(row_bytes * total(outs)));
  const auto x = read_file<float>(argv[6], size_t(n * in));
  std::vector<float> y(size_t(n * total(outs)), NAN);  // poisoned: every row must be written
  if (fmt == "Q8_0") run<mma::Q8U>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "Q4_K") run<mma::QK45U<false>>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "Q4_K_T") run<mma::Q4T>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "Q5_K") run<mma::QK45U<true>>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "Q5_K_T") run<mma::Q5T>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "Q6_K") run<mma::Q6U>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "Q6_K_T") run<mma::Q6T>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "IQ4_XS") run<mma::IQ4U>(w, row_bytes, in, x, n, outs, y);
  else if (fmt == "BF16") run<mma::BF16U>(w, row_bytes, in, x, n, outs, y);
  else run<mma::IQ4T>(w, row_bytes, in, x, n, outs, y);
  std::ofstream(argv[7], std::ios::binary).write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * 4));
  return 0;
}
