// The attention call the two attention harnesses (attn_main.cpp, chunk_main.cpp) read: argv[1..9] =
// D n hq hkv capacity kv_len window causal scale, and the files q.bin pos.bin k.bin v.bin (q: F32 [n, hq, D];
// pos: I32 [n]; k, v: F16 [capacity, hkv, D]); out (F32 [n, hq, D]) starts poisoned (NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "warp_emu.h"

struct AttnCase {
  int d = 0;
  int64_t n = 0, hq = 0, hkv = 0, cap = 0, kv_len = 0, window = 0;
  int causal = 0;
  double scale = 0.0;
  std::vector<float> q, out;
  std::vector<int32_t> pos;
  std::vector<uint16_t> k, v;

  // The shape from argv[1..9]; false on a shape the harnesses cannot run (the caller checks D).
  bool parse(char** argv) {
    d = std::atoi(argv[1]);
    n = std::atoll(argv[2]), hq = std::atoll(argv[3]), hkv = std::atoll(argv[4]);
    cap = std::atoll(argv[5]), kv_len = std::atoll(argv[6]), window = std::atoll(argv[7]);
    causal = std::atoi(argv[8]);
    scale = std::atof(argv[9]);
    return n >= 1 && hkv >= 1 && hq % hkv == 0 && kv_len >= 0 && kv_len <= cap;
  }
  // The inputs from the four files (false, with a message, when one is short or missing).
  bool read(const char* q_path, const char* pos_path, const char* k_path, const char* v_path) {
    q.resize(size_t(n * hq * d)), out.assign(q.size(), NAN), pos.resize(static_cast<size_t>(n));
    k.resize(size_t(cap * hkv * d)), v.resize(k.size());
    if (read_file(q_path, q) && read_file(pos_path, pos) && read_file(k_path, k) && read_file(v_path, v)) return true;
    std::fprintf(stderr, "short input file\n");
    return false;
  }
  // The fields a kernel's Params share: q, the F16 caches [capacity, hkv, D] and their strides, q_pos.
  template <class Params>
  void set_views(Params& P) const {
    P.q = q.data();
    P.kc = reinterpret_cast<const uint8_t*>(k.data());
    P.vc = reinterpret_cast<const uint8_t*>(v.data());
    P.k_row_stride = P.v_row_stride = hkv * d * 2;
    P.k_head_stride = P.v_head_stride = int64_t(d) * 2;
    P.q_pos = pos.data();
  }
  void write_out(const char* path) const {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(out.data()),
                                                std::streamsize(out.size() * sizeof(float)));
  }
};
