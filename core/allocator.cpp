// core/allocator.cpp: the CPU allocator, the statistics counter, and allocator_for(device).
#include "core/allocator.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "core/cuda/runtime.h"
#include "core/error.h"

namespace shardlab {

void StatsCounter::on_allocate(std::size_t nbytes) {
  stats_.bytes_in_use += static_cast<std::int64_t>(nbytes);
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.bytes_in_use);
  stats_.allocations += 1;
}

void StatsCounter::on_free(std::size_t nbytes) { stats_.bytes_in_use -= static_cast<std::int64_t>(nbytes); }

namespace {

// Host memory, 64-byte aligned so vectorised loops and OpenBLAS see aligned rows.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(std::size_t nbytes) override {
    const std::size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    void* data = std::aligned_alloc(kAlignment, rounded);
    SHARDLAB_CHECK(data != nullptr, "cpu: out of memory allocating {} bytes ({} bytes in use)", nbytes,
                   stats().bytes_in_use);
    std::lock_guard lock(mutex_);
    stats_.on_allocate(nbytes);
    return data;
  }

  void deallocate(void* data, std::size_t nbytes) override {
    std::free(data);
    std::lock_guard lock(mutex_);
    stats_.on_free(nbytes);
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
  mutable std::mutex mutex_;
  StatsCounter stats_;
};

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cuda()) return cuda::device_allocator(device.index);
  static CpuAllocator cpu;
  return cpu;
}

}  // namespace shardlab
