#include "specd/dtype.h"

#include "specd/error.h"

namespace specd {

const DTypeInfo& dtype_info(DType t) {
  // Block sizes and byte sizes as in ggml's type_traits (ggml/src/ggml.c).
  static const DTypeInfo f32{"F32", 1, 4}, f16{"F16", 1, 2}, bf16{"BF16", 1, 2}, i32{"I32", 1, 4},
      q8_0{"Q8_0", 32, 34}, q4_k{"Q4_K", 256, 144}, q5_k{"Q5_K", 256, 176}, q6_k{"Q6_K", 256, 210},
      iq4_xs{"IQ4_XS", 256, 136}, iq4_xs_tiled{"IQ4_XS_TILED", 256, 136},
      q6_k_tiled{"Q6_K_TILED", 256, 210}, q4_k_tiled{"Q4_K_TILED", 256, 144},
      q5_k_tiled{"Q5_K_TILED", 256, 176};
  switch (t) {
    case DType::F32: return f32;
    case DType::F16: return f16;
    case DType::BF16: return bf16;
    case DType::I32: return i32;
    case DType::Q8_0: return q8_0;
    case DType::Q4_K: return q4_k;
    case DType::Q5_K: return q5_k;
    case DType::Q6_K: return q6_k;
    case DType::IQ4_XS: return iq4_xs;
    case DType::IQ4_XS_TILED: return iq4_xs_tiled;
    case DType::Q6_K_TILED: return q6_k_tiled;
    case DType::Q4_K_TILED: return q4_k_tiled;
    case DType::Q5_K_TILED: return q5_k_tiled;
  }
  fail("unsupported dtype id ", static_cast<int>(t),
       " (specd reads F32, F16, BF16, I32, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS)");
}

DType dtype_from_id(int32_t id) {
  DType t = static_cast<DType>(id);
  SPECD_CHECK(!is_gemv_tiled(t), "dtype id ", id, " is specd's GPU GEMV layout of ", dtype_info(untiled(t)).name,
              ", not a ggml type");
  dtype_info(t);  // validates
  return t;
}

int64_t row_size(DType t, int64_t n) {
  const DTypeInfo& info = dtype_info(t);
  SPECD_CHECK(n % info.block_size == 0, info.name, " rows must hold a multiple of ", info.block_size,
              " elements, got ", n);
  return n / info.block_size * info.type_size;
}

}  // namespace specd
