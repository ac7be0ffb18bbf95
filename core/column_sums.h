// core/column_sums.h: internal to core: the order in which a sum over rows per column (a weight's
// gradient over the batch's tokens) is taken, written once for the CPU and the GPU (SHARDLAB_HD): the
// rows cut into chunks, each chunk's partial sum in row order, then the partials in chunk order. A
// GPU sums every chunk at once instead of walking all the rows one thread per column; both devices
// add in the same order, every run.
#pragma once

#include <cstdint>

#include "core/dtype.h"  // SHARDLAB_HD

namespace shardlab {

inline constexpr std::int64_t kRowsPerColumnChunk = 256;

SHARDLAB_HD inline std::int64_t column_chunks(std::int64_t rows) {
  return (rows + kRowsPerColumnChunk - 1) / kRowsPerColumnChunk;
}

// The rows [begin, end) of chunk `chunk`.
struct RowRange {
  std::int64_t begin, end;
};
SHARDLAB_HD inline RowRange chunk_rows(std::int64_t chunk, std::int64_t rows) {
  const std::int64_t begin = chunk * kRowsPerColumnChunk;
  return {begin, begin + kRowsPerColumnChunk < rows ? begin + kRowsPerColumnChunk : rows};
}

// The total of column e from partials [chunks, width], in chunk order.
SHARDLAB_HD inline double sum_of_partials(const double* partials, std::int64_t chunks, std::int64_t width,
                                          std::int64_t e) {
  double total = 0;
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) total += partials[chunk * width + e];
  return total;
}

}  // namespace shardlab
