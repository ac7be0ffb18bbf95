// core/cpu/transpose.cpp: transposed block copies: 8 x 8 floats at a time in AVX2 registers, the
// rest (the edges, doubles, processors without AVX2) one element at a time.
#include "core/cpu/transpose.h"

#include <immintrin.h>

#include "core/cpu/isa.h"

namespace shardlab::cpu {
namespace {

template <typename T>
void transpose_elements(const T* from, std::int64_t from_stride, std::int64_t r0, std::int64_t r1,
                        std::int64_t c0, std::int64_t c1, T* to, std::int64_t to_stride) {
  for (std::int64_t r = r0; r < r1; ++r) {
    for (std::int64_t c = c0; c < c1; ++c) to[c * to_stride + r] = from[r * from_stride + c];
  }
}

// Rows r..r+7 x columns c..c+7: interleave pairs of rows, then pairs of pairs, then swap the
// 128-bit halves (the usual three stages of an 8 x 8 transpose).
[[gnu::target("avx2")]] void transpose_8x8(const float* from, std::int64_t from_stride, float* to,
                                           std::int64_t to_stride) {
  __m256 row[8], pair[8], quad[8];
  for (int i = 0; i < 8; ++i) row[i] = _mm256_loadu_ps(from + i * from_stride);
  for (int i = 0; i < 8; i += 2) {
    pair[i] = _mm256_unpacklo_ps(row[i], row[i + 1]);
    pair[i + 1] = _mm256_unpackhi_ps(row[i], row[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    quad[i] = _mm256_shuffle_ps(pair[i], pair[i + 2], 0x44);
    quad[i + 1] = _mm256_shuffle_ps(pair[i], pair[i + 2], 0xEE);
    quad[i + 2] = _mm256_shuffle_ps(pair[i + 1], pair[i + 3], 0x44);
    quad[i + 3] = _mm256_shuffle_ps(pair[i + 1], pair[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(to + i * to_stride, _mm256_permute2f128_ps(quad[i], quad[i + 4], 0x20));
    _mm256_storeu_ps(to + (i + 4) * to_stride, _mm256_permute2f128_ps(quad[i], quad[i + 4], 0x31));
  }
}

[[gnu::target("avx2")]] void transpose_avx2(const float* from, std::int64_t from_stride, std::int64_t rows,
                                            std::int64_t cols, float* to, std::int64_t to_stride) {
  const std::int64_t full_rows = rows / 8 * 8, full_cols = cols / 8 * 8;
  for (std::int64_t r = 0; r < full_rows; r += 8) {
    for (std::int64_t c = 0; c < full_cols; c += 8) {
      transpose_8x8(from + r * from_stride + c, from_stride, to + c * to_stride + r, to_stride);
    }
  }
  transpose_elements(from, from_stride, 0, full_rows, full_cols, cols, to, to_stride);
  transpose_elements(from, from_stride, full_rows, rows, 0, cols, to, to_stride);
}

}  // namespace

template <typename T>
void transpose_block(const T* from, std::int64_t from_stride, std::int64_t rows, std::int64_t cols, T* to,
                     std::int64_t to_stride) {
  if constexpr (sizeof(T) == sizeof(float)) {
    if (kernel_isa() != Isa::baseline) return transpose_avx2(from, from_stride, rows, cols, to, to_stride);
  }
  transpose_elements(from, from_stride, 0, rows, 0, cols, to, to_stride);
}

template void transpose_block<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*,
                                     std::int64_t);
template void transpose_block<double>(const double*, std::int64_t, std::int64_t, std::int64_t, double*,
                                      std::int64_t);

}  // namespace shardlab::cpu
