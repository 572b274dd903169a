// Element and block formats of specd tensors.
//
// The numeric ids are ggml's `enum ggml_type` values (ggml/include/ggml.h), which are also the ids
// stored in GGUF tensor infos and exposed by the `gguf` package as GGMLQuantizationType. Block
// layouts are read exactly as ggml writes them; see native/src/cpu/quants.h.
#pragma once
#include <cstdint>
#include <string>

namespace specd {

enum class DType : int32_t {
  F32 = 0,
  F16 = 1,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  IQ4_XS = 23,
  I32 = 26,
  BF16 = 30,
};

struct DTypeInfo {
  const char* name;
  int64_t block_size;  // elements per block (1 for plain types)
  int64_t type_size;   // bytes per block
};

// Throws std::invalid_argument for ids specd does not support.
const DTypeInfo& dtype_info(DType t);
DType dtype_from_id(int32_t id);

inline bool is_block_type(DType t) { return dtype_info(t).block_size > 1; }
inline bool is_float_type(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

// Bytes taken by `n` consecutive elements of type t; n must be a multiple of the block size.
int64_t row_size(DType t, int64_t n);

}  // namespace specd
