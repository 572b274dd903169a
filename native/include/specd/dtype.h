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
  // Not a ggml type: IQ4_XS rows regrouped for the CUDA tensor-core GEMV (16-row tiles, each warp
  // load 512 contiguous bytes; matmul_mma.cuh, IQ4T). IQ4_XS's blocks in another order, with the
  // 4-bit indices recoded (bits 2 and 3 swapped: a shorter table lookup in the GEMV, same values), so
  // only the GPU matmul reads it (gpu::tile_for_gemv makes it); never in a GGUF file.
  IQ4_XS_TILED = 0x10000 + 23,
  // Not a ggml type either: Q6_K rows in the same 16-row tiles (matmul_mma.cuh, Q6T; 16-byte loads
  // where Q6_K's 210-byte blocks allow 2-byte ones). Made by gpu::tile_for_gemv, read by the GPU matmul.
  Q6_K_TILED = 0x10000 + 14,
  // And Q4_K rows in IQ4_XS_TILED's arrangement (matmul_mma.cuh, Q4T), Q5_K rows in it with their fifth
  // bits in a run of their own (Q5T).
  Q4_K_TILED = 0x10000 + 12,
  Q5_K_TILED = 0x10000 + 13,
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
// The GPU GEMV's tiled layouts and the row-major ggml types they regroup.
inline constexpr DType kGemvTiledPairs[][2] = {{DType::IQ4_XS, DType::IQ4_XS_TILED},
                                               {DType::Q4_K, DType::Q4_K_TILED},
                                               {DType::Q5_K, DType::Q5_K_TILED},
                                               {DType::Q6_K, DType::Q6_K_TILED}};
// The row-major ggml type a tiled layout regroups (t itself for every other type).
inline DType untiled(DType t) {
  for (const auto& p : kGemvTiledPairs)
    if (p[1] == t) return p[0];
  return t;
}
// The tiled layout of row-major type t (IQ4_XS, Q4_K, Q5_K, Q6_K; t itself for every other type).
inline DType tiled_of(DType t) {
  for (const auto& p : kGemvTiledPairs)
    if (p[0] == t) return p[1];
  return t;
}
// Whether t is one of the GPU GEMV's tiled layouts (IQ4_XS_TILED, Q4_K_TILED, Q5_K_TILED, Q6_K_TILED).
inline bool is_gemv_tiled(DType t) { return untiled(t) != t; }
// Whether rows of t are stored one after another (every type but the tiled layouts): what slicing,
// concatenation, row views and the CPU ops assume.
inline bool is_row_major(DType t) { return !is_gemv_tiled(t); }
// Rows per tile of the tiled layouts (a tiled weight has a multiple of this many rows).
constexpr int64_t kGemvTileRows = 16;

// Bytes taken by `n` consecutive elements of type t; n must be a multiple of the block size.
int64_t row_size(DType t, int64_t n);

}  // namespace specd
