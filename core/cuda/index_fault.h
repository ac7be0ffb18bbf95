// core/cuda/index_fault.h: internal to core/cuda: where a kernel records an out-of-range index, in
// mapped page-locked memory the host reads at its next wait, so checking indices never makes the
// host wait for the check itself.
#pragma once

#include <cstdint>

namespace shardlab::cuda {

// Written by kernels and read by the host at the same address.
struct IndexFault {
  int claimed;  // set by the first thread that finds a bad index
  int ready;    // set once the fields below are written
  const char* op;
  const char* what;  // op and what: string literals of the host
  std::int64_t value, size;
  int device;
};

// The one slot, made on first use (then every host wait looks at it).
IndexFault* index_fault();
// After a host wait: throws the fault a kernel recorded, naming op, value and device, and clears
// the slot for the next.
void report_index_fault();

}  // namespace shardlab::cuda
