// apps/support/resident_memory.h: the process's peak resident memory as Linux counts it (VmHWM),
// which the training programs report beside the allocator's figures: it also holds what no
// allocator sees (file reads, libraries' buffers), as a whole model read on every rank would be.
#pragma once

#include <cstdint>
#include <optional>

namespace shardlab::apps {

// VmHWM of /proc/self/status in bytes; none where the system has no such file or line.
std::optional<std::int64_t> peak_resident_bytes();

}  // namespace shardlab::apps
