// core/segments.h: internal to core: index_add's order (the embedding backward's), written once for
// the CPU and the GPU (SHARDLAB_HD): the picks sorted stably by the row they add to, so each row's
// picks form one segment, added to the row in their original order. Segments are independent work,
// however few columns a row has, and every device adds in the same order, every run.
#pragma once

#include <cstdint>

#include "core/dtype.h"  // SHARDLAB_HD

namespace shardlab {

// Whether sorted position p starts a segment (its key differs from the one before).
SHARDLAB_HD inline bool starts_segment(const std::int64_t* sorted_keys, std::int64_t p) {
  return p == 0 || sorted_keys[p] != sorted_keys[p - 1];
}

// One past the last sorted position of the segment that starts at p.
SHARDLAB_HD inline std::int64_t segment_end(const std::int64_t* sorted_keys, std::int64_t p, std::int64_t n) {
  std::int64_t q = p + 1;
  while (q < n && sorted_keys[q] == sorted_keys[p]) ++q;
  return q;
}

}  // namespace shardlab
