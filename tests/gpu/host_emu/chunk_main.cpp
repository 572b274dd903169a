// Host emulation of the exact attention path's tensor-core chunk pass (native/src/gpu/
// attention_chunk_mma.cuh): attn_chunk_mma_kernel runs on the CPU, one std::thread per lane (warp_emu.h:
// mma.sync m16n8k16 f16 -> f32 and shuffles emulated from the PTX ISA layouts), with attention.cu's
// launch plan (chunk_mma::plan: rows packed into m-tiles without a window, else one row per m-tile), then the
// partials are combined with attention.cu's two-level combine arithmetic. A mask is compacted on the
// host as attention_mask.cuh's kernels do (emulated by mask_main.cpp). Partials and output are poisoned
// (NaN) first, so a partial the kernel should have written and did not shows. Driven by
// tests/gpu/test_gpu_attention_mma_host.py.
//
// usage: chunk_emu D n hq hkv capacity kv_len window causal scale resident_warps[:slice_rows] q.bin pos.bin
//        k.bin v.bin mask.bin|- out.bin
//   q: F32 [n, hq, D]; pos: I32 [n]; k, v: F16 [capacity, hkv, D]; mask: I32 [n, kv_len] or "-";
//   out: F32 [n, hq, D] (written). resident_warps sizes chunks per warp (small: several per warp);
//   slice_rows > 0 runs the rows in slices of that many (the last slice's plan is printed).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "warp_emu.h"
#include "attention_chunk_mma.cuh"
#include "attn_case.h"

using namespace specd::gpu::detail;

// The plan's kernel instance, chosen as attention.cu's launch_chunk_mma does (chunk_mma::with_instance).
static bool run(const chunk_mma::Params& P, int d, int ds, int64_t blocks) {
  return chunk_mma::with_instance(d, ds, [&](auto dc, auto dsc) {
    constexpr int D = decltype(dc)::value, DS = decltype(dsc)::value;
    if (P.idx) emulate(blocks, chunk_mma::kWarps * 32, [&] { chunk_mma::attn_chunk_mma_kernel<D, true, DS>(P); });
    else emulate(blocks, chunk_mma::kWarps * 32, [&] { chunk_mma::attn_chunk_mma_kernel<D, false, DS>(P); });
  });
}

int main(int argc, char** argv) {
  if (argc != 17) {
    std::fprintf(stderr, "usage: %s D n hq hkv capacity kv_len window causal scale resident q pos k v mask|- out\n",
                 argv[0]);
    return 2;
  }
  AttnCase ac;
  if (!ac.parse(argv) || !chunk_mma::supported_dim(ac.d) || ac.kv_len < 1) return 2;
  const int d = ac.d, causal = ac.causal;
  const int64_t n = ac.n, hq = ac.hq, hkv = ac.hkv, kv_len = ac.kv_len, window = ac.window;
  const float scale = float(ac.scale);
  // resident_warps[:slice_rows]: rows go through the kernel in slices of slice_rows (attention.cu's
  // scratch-bounded slices: i0 > 0), each with its own partials.
  const std::string rs = argv[10];
  const int64_t resident = std::atoll(rs.c_str());
  const int64_t slice_rows = rs.find(':') == std::string::npos ? 0 : std::atoll(rs.c_str() + rs.find(':') + 1);
  const bool has_mask = std::string(argv[15]) != "-";
  std::vector<int32_t> mask(has_mask ? size_t(n * kv_len) : 0);
  if (!ac.read(argv[11], argv[12], argv[13], argv[14])) return 2;
  if (has_mask && !read_file(argv[15], mask)) {
    std::fprintf(stderr, "short input file\n");
    return 2;
  }
  const std::vector<int32_t>& pos = ac.pos;
  std::vector<float>& out = ac.out;
  const int64_t r = hq / hkv, nch = (kv_len + chunk_mma::kChunk - 1) / chunk_mma::kChunk;
  // The mask's visible positions per row, compacted in order (attention_mask.cuh).
  std::vector<int32_t> idx(has_mask ? size_t(n * kv_len) : 0), cnt(has_mask ? size_t(n) : 0);
  for (int64_t i = 0; has_mask && i < n; ++i) {
    int64_t lo, hi;
    visible_range(pos[size_t(i)], window, causal != 0, kv_len, lo, hi);
    int32_t c = 0;
    for (int64_t j = lo; j < hi; ++j)
      if (mask[size_t(i * kv_len + j)] != 0) idx[size_t(i * kv_len + c++)] = int32_t(j);
    cnt[size_t(i)] = c;
  }
  const int64_t per = slice_rows > 0 ? std::min(slice_rows, n) : n;
  chunk_mma::Plan pl{};
  for (int64_t i0 = 0; i0 < n; i0 += per) {
    const int64_t rows = std::min(per, n - i0);
    std::vector<float> part(size_t(rows * hq * nch * d), NAN), ml(size_t(rows * hq * nch * 2), NAN);  // poisoned
    pl = chunk_mma::plan(rows, r, hkv, nch, window == 0, resident, d);
    chunk_mma::Params P{};
    ac.set_views(P);
    P.idx = has_mask ? idx.data() : nullptr;
    P.cnt = has_mask ? cnt.data() : nullptr;
    P.kv_len = kv_len;
    P.window = window;
    P.causal = causal;
    P.hq = int(hq);
    P.hkv = int(hkv);
    P.r = int(r);
    P.nch = int(nch);
    P.dp = d;
    P.i0 = i0;
    P.rows = rows;
    P.scale = scale;
    P.part = part.data();
    P.ml = ml.data();
    chunk_mma::set_plan(P, pl);
    if (!run(P, d, pl.ds, pl.blocks)) {
      std::fprintf(stderr, "no kernel instance for d=%d ds=%d\n", d, pl.ds);
      return 2;
    }
    // attention.cu's two-level combine: per group of 64 chunks M_g = max m_c and the chains L_g, acc_g over its
    // chunks with w = expf(m_c - M_g); a row of one group outputs acc_g / L_g, else the same chains over the
    // groups with w = expf(M_g - M), M = max M_g.
    constexpr int64_t kGroup = 64;
    auto chains = [](int64_t k, auto m_of, auto l_of, auto v_of, float& L, float& acc) {
      float M = -INFINITY;
      for (int64_t x = 0; x < k; ++x) M = std::fmax(M, m_of(x));
      L = 0.0f, acc = 0.0f;
      for (int64_t x = 0; x < k; ++x) {
        const float w = std::exp(m_of(x) - M);
        L = std::fma(l_of(x), w, L);
        acc = std::fma(w, v_of(x), acc);
      }
      return M;
    };
    for (int64_t il = 0; il < rows; ++il) {
      int64_t lo, c;
      row_range(P, i0 + il, lo, c);
      const int64_t nc = (c + chunk_mma::kChunk - 1) / chunk_mma::kChunk, ng = (nc + kGroup - 1) / kGroup;
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t base = (il * hq + h) * nch;
        for (int e = 0; e < d; ++e) {
          std::vector<float> gm(static_cast<size_t>(ng)), gl(gm.size()), ga(gm.size());
          for (int64_t g = 0; g < ng; ++g) {
            const int64_t c0 = base + g * kGroup;
            gm[size_t(g)] = chains(
                std::min(kGroup, nc - g * kGroup), [&](int64_t x) { return ml[size_t((c0 + x) * 2)]; },
                [&](int64_t x) { return ml[size_t((c0 + x) * 2 + 1)]; },
                [&](int64_t x) { return part[size_t((c0 + x) * d + e)]; }, gl[size_t(g)], ga[size_t(g)]);
          }
          float L = ng ? gl[0] : 1.0f, acc = ng ? ga[0] : 0.0f;
          if (ng > 1)
            chains(
                ng, [&](int64_t x) { return gm[size_t(x)]; }, [&](int64_t x) { return gl[size_t(x)]; },
                [&](int64_t x) { return ga[size_t(x)]; }, L, acc);
          out[size_t(((i0 + il) * hq + h) * d + e)] = nc == 0 ? 0.0f : acc / L;
        }
      }
    }
  }
  std::printf("packed=%d mtiles=%lld groups=%d cpw=%d ds=%d blocks=%lld\n", pl.packed, (long long)pl.mtiles,
              pl.groups, pl.cpw, pl.ds, (long long)pl.blocks);
  ac.write_out(argv[16]);
  return 0;
}
