// core/allocator.cpp: the CPU allocator, the statistics counter, and allocator_for(device).
#include "core/allocator.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda/runtime.h"
#include "core/error.h"

namespace shardlab {

void StatsCounter::on_allocate(std::size_t nbytes) {
  stats_.bytes_in_use += static_cast<std::int64_t>(nbytes);
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.bytes_in_use);
  stats_.allocations += 1;
  stats_.largest_allocation = std::max(stats_.largest_allocation, static_cast<std::int64_t>(nbytes));
}

void StatsCounter::on_free(std::size_t nbytes) { stats_.bytes_in_use -= static_cast<std::int64_t>(nbytes); }

namespace {

// Host memory, 64-byte aligned so vectorised loops and OpenBLAS see aligned rows. Freed
// blocks of 64 KiB and more are kept (up to 1 GiB) and handed out again for requests of the
// same rounded size: a training step allocates the same large tensors every time, and
// fresh pages from the kernel cost a fault and a clear each.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(std::size_t nbytes) override {
    const std::size_t rounded = rounded_size(nbytes);
    std::unique_lock lock(mutex_);
    void* data = nullptr;
    if (auto it = cache_.find(rounded); it != cache_.end() && !it->second.empty()) {
      data = it->second.back();
      it->second.pop_back();
      stats_.raw().bytes_cached -= static_cast<std::int64_t>(rounded);
    } else {
      lock.unlock();
      data = std::aligned_alloc(kAlignment, rounded);
      SHARDLAB_CHECK(data != nullptr, "cpu: out of memory allocating {} bytes ({} bytes in use)", nbytes,
                     stats().bytes_in_use);
      lock.lock();
    }
    stats_.on_allocate(nbytes);
    return data;
  }

  void deallocate(void* data, std::size_t nbytes) override {
    const std::size_t rounded = rounded_size(nbytes);
    std::unique_lock lock(mutex_);
    stats_.on_free(nbytes);
    MemoryStats& stats = stats_.raw();
    if (rounded >= kCachedFrom && stats.bytes_cached + static_cast<std::int64_t>(rounded) <= kCacheLimit) {
      cache_[rounded].push_back(data);
      stats.bytes_cached += static_cast<std::int64_t>(rounded);
      return;
    }
    lock.unlock();
    std::free(data);
  }

  MemoryStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_.raw();
  }

  void reset_peak() override {
    std::lock_guard lock(mutex_);
    stats_.reset_peak();
  }

 private:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kCachedFrom = 64 << 10;
  static constexpr std::int64_t kCacheLimit = std::int64_t{1} << 30;

  // Small blocks round to the alignment, cached ones to whole pages.
  static std::size_t rounded_size(std::size_t nbytes) {
    const std::size_t unit = nbytes >= kCachedFrom ? 4096 : kAlignment;
    return (nbytes + unit - 1) / unit * unit;
  }

  mutable std::mutex mutex_;
  StatsCounter stats_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;  // rounded size -> idle blocks
};

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cuda()) return cuda::device_allocator(device.index);
  // Never destroyed: a tensor owned by another static may be freed after main returns, in any
  // order, and must still find its allocator. Its idle cached blocks stay reachable from here, so
  // they are not leaks (a destroyed cache would have dropped them unfreed).
  static CpuAllocator& cpu = *new CpuAllocator;
  return cpu;
}

}  // namespace shardlab
