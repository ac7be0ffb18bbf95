// core/allocator.h: the per-device allocator interface and its memory statistics.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device.h"

namespace shardlab {

struct MemoryStats {
  std::int64_t bytes_in_use = 0;  // bytes handed out and not yet freed
  std::int64_t peak_bytes = 0;    // high-water mark of bytes_in_use since the last reset
  std::int64_t allocations = 0;   // number of allocate() calls since start
  std::int64_t bytes_cached = 0;  // bytes held by a caching allocator but not in use
  // The largest single allocate() since the last reset of the peak (what a caching allocator hands
  // out: a request rounded up to its block): the biggest tensor a computation made.
  std::int64_t largest_allocation = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory for nbytes (> 0), aligned to at least 64 bytes. Throws Error when out
  // of memory, naming the device, the request and what is in use.
  virtual void* allocate(std::size_t nbytes) = 0;
  virtual void deallocate(void* data, std::size_t nbytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
};

// The allocator that owns memory on `device` (one per device, alive for the process).
Allocator& allocator_for(Device device);

// Shorthands used by tests, the --explain plan and benchmarks.
inline MemoryStats memory_stats(Device device) { return allocator_for(device).stats(); }
inline void reset_peak_memory(Device device) { allocator_for(device).reset_peak(); }

// Bookkeeping shared by every allocator: in-use, peak and count, updated under the
// owner's lock.
class StatsCounter {
 public:
  void on_allocate(std::size_t nbytes);
  void on_free(std::size_t nbytes);
  void reset_peak() {
    stats_.peak_bytes = stats_.bytes_in_use;
    stats_.largest_allocation = 0;
  }
  MemoryStats& raw() { return stats_; }
  const MemoryStats& raw() const { return stats_; }

 private:
  MemoryStats stats_;
};

}  // namespace shardlab
