// Host harness for test_gpu_decoders_host.py: decodes whole rows through the GPU weight-format
// policies (chunk by chunk, part by part, at the policies' offsets, exactly as the dequantize-to-BF16
// kernel walks them, before its BF16 rounding) and writes float32.
// Usage: decode FORMAT ROWS IN IN.bin OUT.bin
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "weight_formats.cuh"

using namespace specd::gpu::detail;

template <class W, int... P>
void chunk(const uint8_t* row, int64_t c, float* dst, std::integer_sequence<int, P...>) {
  typename W::Raw raw = W::load(row, c);
  auto part = [&](auto pc) {
    constexpr int kP = decltype(pc)::value;
    float v[W::kPE];
    float s = W::template decode_part<kP>(raw, v);
    for (int k = 0; k < W::kPE; ++k) dst[W::offset(c, kP) + k] = W::kScaled ? v[k] * s : v[k];
  };
  (part(std::integral_constant<int, P>()), ...);
}

template <class W>
void rows(const uint8_t* w, int64_t n, int64_t rb, int64_t in, int64_t nchunks, float* out) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < nchunks; ++c)
      chunk<W>(w + r * rb, c, out + r * in, std::make_integer_sequence<int, W::kParts>());
}

int main(int argc, char** argv) {
  if (argc != 6) return 2;
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
  const uint8_t* w = buf.data();
  if (fmt == "Q8_0") rows<Q8_0Quarter>(w, n, rb, in, in / 8, out.data());
  else if (fmt == "Q4_K") rows<Q4KW>(w, n, rb, in, in / 32, out.data());
  else if (fmt == "Q5_K") rows<Q5KW>(w, n, rb, in, in / 32, out.data());
  else if (fmt == "Q6_K") rows<Q6KW>(w, n, rb, in, in / 32, out.data());
  else if (fmt == "IQ4_XS") rows<IQ4XSW>(w, n, rb, in, in / 32, out.data());
  else if (fmt == "F16") rows<Half16W<8, false>>(w, n, rb, in, in / 8, out.data());
  else if (fmt == "F16_1") rows<Half16W<1, false>>(w, n, rb, in, in, out.data());
  else if (fmt == "BF16") rows<Half16W<8, true>>(w, n, rb, in, in / 8, out.data());
  else if (fmt == "BF16_1") rows<Half16W<1, true>>(w, n, rb, in, in, out.data());
  else if (fmt == "F32") rows<F32W<4>>(w, n, rb, in, in / 4, out.data());
  else if (fmt == "F32_1") rows<F32W<1>>(w, n, rb, in, in, out.data());
  else return 4;
  f = fopen(argv[5], "wb");
  if (!f) return 3;
  fwrite(out.data(), 4, out.size(), f);
  fclose(f);
  return 0;
}
