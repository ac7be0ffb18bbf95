// core/cpu/transpose.h: internal to core/cpu: copies a strided block of a matrix transposed, in
// 8 x 8 register transposes where the processor has AVX2 (the GEMM's packing of a transposed
// operand).
#pragma once

#include <cstdint>

namespace shardlab::cpu {

// to[c * to_stride + r] = from[r * from_stride + c] for r < rows, c < cols: a copy, so the same
// values on every instruction set.
template <typename T>
void transpose_block(const T* from, std::int64_t from_stride, std::int64_t rows, std::int64_t cols, T* to,
                     std::int64_t to_stride);

extern template void transpose_block<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*,
                                            std::int64_t);
extern template void transpose_block<double>(const double*, std::int64_t, std::int64_t, std::int64_t, double*,
                                             std::int64_t);

}  // namespace shardlab::cpu
