// Host harness for test_gpu_decoders_host.py: decodes whole rows through the GPU weight-format
// policies with decode_chunk (chunk by chunk, part by part, at the policies' offsets, as the
// embedding gather and the dequantize-to-BF16 kernel walk them) and writes float32, or with "bf16"
// the BF16 bits that kernel stores. FORMAT IQ4_XS_T / Q4_K_T / Q5_K_T / Q6_K_T: IN.bin holds the GEMV's tiled
// layout (ROWS a multiple of 16), each chunk gathered through load_tiled on its own (the gathers alone).
// With "units" (tiled formats only) the BF16 bits of the tile-unit kernel (tiled_units below).
// Usage: decode FORMAT ROWS IN IN.bin OUT.bin [bf16 | units]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "weight_formats.cuh"

using namespace specd::gpu::detail;

// Rows of w decoded through decode_chunk (the kernels' walk: chunk by chunk, part by part) into
// `out` with Store (StoreF32 or StoreBF16, their vector stores included).
template <class W, class Store, class T>
void rows(const uint8_t* w, int64_t n, int64_t rb, int64_t in, int64_t nchunks, T* out) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < nchunks; ++c) decode_chunk<W>(w + r * rb, c, Store{out + r * in});
}

template <class W>
void rows(const uint8_t* w, int64_t n, int64_t rb, int64_t in, int64_t nchunks, float* f32, uint16_t* bf16) {
  if (bf16) rows<W, StoreBF16>(w, n, rb, in, nchunks, bf16);
  else rows<W, StoreF32>(w, n, rb, in, nchunks, f32);
}

// The same for a weight in a tiled layout (T: IQ4XSTiledW, Q4KTiledW, Q5KTiledW or Q6KTiledW; 8 chunks per unit).
template <class T, class Store, class Out>
void tiled_rows(const uint8_t* w, int64_t n, int64_t in, Out* out) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < in / 32; ++c) decode_raw<T>(T::load_tiled(w, in / 256, r, c), c, Store{out + r * in});
}

template <class T>
void tiled_rows(const uint8_t* w, int64_t n, int64_t in, float* f32, uint16_t* bf16) {
  if (bf16) tiled_rows<T, StoreBF16>(w, n, in, bf16);
  else tiled_rows<T, StoreF32>(w, n, in, f32);
}

// The tiled weight through the prefill's tile-unit kernel (dequant_units_bf16_kernel): per unit, the
// warp's 32 lanes run phase 1 (unit_decode_lane into a poisoned shared-memory tile), then, after the
// kernel's __syncwarp, phase 2 (unit_store_lane); units in the kernel's order.
template <class T>
void tiled_units(const uint8_t* w, int64_t n, int64_t in, uint16_t* bf16) {
  std::vector<uint4> tile(kUnitRows * kUnitPieces);
  for (int64_t t = 0; t < n / kUnitRows; ++t)
    for (int64_t u = 0; u < in / 256; ++u) {
      std::fill(tile.begin(), tile.end(), uint4{~0u, ~0u, ~0u, ~0u});
      for (int lane = 0; lane < 32; ++lane) unit_decode_lane<T>(w, in / 256, kUnitRows * t, u, lane, tile.data());
      for (int lane = 0; lane < 32; ++lane) unit_store_lane(tile.data(), bf16 + kUnitRows * t * in, in, u, lane);
    }
}

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) return 2;
  const bool units = argc == 7 && std::string(argv[6]) == "units";  // BF16 through the tile-unit kernel
  const bool as_bf16 = argc == 7 && (std::string(argv[6]) == "bf16" || units);
  const std::string fmt = argv[1];
  const int64_t n = atoll(argv[2]), in = atoll(argv[3]);
  FILE* f = fopen(argv[4], "rb");
  if (!f) return 3;
  std::vector<uint8_t> buf;
  for (int ch; (ch = fgetc(f)) != EOF;) buf.push_back(uint8_t(ch));
  fclose(f);
  buf.resize(buf.size() + 64);  // slack: never read, keeps the 16-byte loads of the last row in bounds
  const int64_t rb = int64_t(buf.size() - 64) / n;
  std::vector<float> out(size_t(n * in), NAN);
  std::vector<uint16_t> outb(as_bf16 ? size_t(n * in) : 0, 0xffff);
  uint16_t* b = as_bf16 ? outb.data() : nullptr;
  const uint8_t* w = buf.data();
  if (fmt == "Q8_0") rows<Q8_0Quarter>(w, n, rb, in, in / 8, out.data(), b);
  else if (fmt == "Q4_K") rows<Q4KW>(w, n, rb, in, in / 32, out.data(), b);
  else if (fmt == "Q5_K") rows<Q5KW>(w, n, rb, in, in / 32, out.data(), b);
  else if (fmt == "Q6_K") rows<Q6KW>(w, n, rb, in, in / 32, out.data(), b);
  else if (fmt == "IQ4_XS") rows<IQ4XSW>(w, n, rb, in, in / 32, out.data(), b);
  else if (units && fmt == "IQ4_XS_T") tiled_units<IQ4XSTiledW>(w, n, in, b);
  else if (units && fmt == "Q4_K_T") tiled_units<Q4KTiledW>(w, n, in, b);
  else if (units && fmt == "Q5_K_T") tiled_units<Q5KTiledW>(w, n, in, b);
  else if (units && fmt == "Q6_K_T") tiled_units<Q6KTiledW>(w, n, in, b);
  else if (units) return 4;
  else if (fmt == "IQ4_XS_T") tiled_rows<IQ4XSTiledW>(w, n, in, out.data(), b);
  else if (fmt == "Q4_K_T") tiled_rows<Q4KTiledW>(w, n, in, out.data(), b);
  else if (fmt == "Q5_K_T") tiled_rows<Q5KTiledW>(w, n, in, out.data(), b);
  else if (fmt == "Q6_K_T") tiled_rows<Q6KTiledW>(w, n, in, out.data(), b);
  else if (fmt == "F16") rows<Half16W<8, false>>(w, n, rb, in, in / 8, out.data(), b);
  else if (fmt == "F16_1") rows<Half16W<1, false>>(w, n, rb, in, in, out.data(), b);
  else if (fmt == "BF16") rows<Half16W<8, true>>(w, n, rb, in, in / 8, out.data(), b);
  else if (fmt == "BF16_1") rows<Half16W<1, true>>(w, n, rb, in, in, out.data(), b);
  else if (fmt == "F32") rows<F32W<4>>(w, n, rb, in, in / 4, out.data(), b);
  else if (fmt == "F32_1") rows<F32W<1>>(w, n, rb, in, in, out.data(), b);
  else return 4;
  f = fopen(argv[5], "wb");
  if (!f) return 3;
  if (as_bf16) fwrite(outb.data(), 2, outb.size(), f);
  else fwrite(out.data(), 4, out.size(), f);
  fclose(f);
  return 0;
}
