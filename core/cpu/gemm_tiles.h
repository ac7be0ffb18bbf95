// core/cpu/gemm_tiles.h: internal to core/cpu: the register tile of the GEMM (core/cpu/gemm.h) on
// each instruction set: C[rows, cols] from a packed panel of A and one of B.
#pragma once

#include <array>
#include <cstdint>

#include "core/cpu/isa.h"

namespace shardlab::cpu {

inline constexpr int kMaxTileRows = 12, kMaxTileCols = 32;

// runs[rows - 1](kc, a, lda, a_step, b, c, ldc, from_c): for each of kc steps p,
// C[r][j] = fma(a[r * lda + p * a_step], b[p * cols + j], C[r][j]) over the tile's rows r and
// `cols` columns j, starting from C's values when `from_c`, else from 0. a points at the tile's
// rows of A, b at a packed panel of B (gemm.cpp), c at the tile's first element in a row-major C.
template <typename T>
struct TileKernel {
  using Run = void (*)(std::int64_t kc, const T* a, std::int64_t lda, std::int64_t a_step, const T* b, T* c,
                       std::int64_t ldc, bool from_c);
  int rows;
  int cols;
  std::array<Run, kMaxTileRows> runs;  // runs[r - 1]: a tile of the first r rows (at the bottom edge)
};

// The tile of `isa`: 12 rows x 2 vectors on AVX-512 (24 of its 32 registers hold C), 6 x 2 on
// AVX2, 4 x 4 scalars on plain x86-64; and the same with fewer rows.
template <typename T>
TileKernel<T> tile_kernel(Isa isa);

}  // namespace shardlab::cpu
