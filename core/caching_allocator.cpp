// core/caching_allocator.cpp: the stream-aware caching allocator policy (core/caching_allocator.h).
#include "core/caching_allocator.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/host_wait.h"

namespace shardlab {

namespace {

constexpr std::size_t kSmallLimit = std::size_t{1} << 20;  // 1 MiB
constexpr std::size_t kSmallGranule = 512;
constexpr std::size_t kLargeGranule = std::size_t{128} << 10;  // 128 KiB

std::size_t round_up(std::size_t n, std::size_t granule) { return (n + granule - 1) / granule * granule; }

// Whether `block` sits in the cache (idle or held back) instead of being handed out.
template <typename Block, typename IdleSet>
bool is_cached(Block* block, const IdleSet& idle, const std::vector<Block*>& held_back) {
  return idle.contains(block) || std::ranges::find(held_back, block) != held_back.end();
}

}  // namespace

bool CachingAllocator::BlockOrder::operator()(const Block* a, const Block* b) const {
  // std::less gives a total order on unrelated pointers, where < is unspecified.
  const std::less<void*> less;
  if (a->stream != b->stream) return less(a->stream, b->stream);
  if (a->size != b->size) return a->size < b->size;
  return less(a->data, b->data);
}

CachingAllocator::CachingAllocator(std::string device_name, std::unique_ptr<DeviceMemory> memory)
    : device_name_(std::move(device_name)), memory_(std::move(memory)) {}

CachingAllocator::~CachingAllocator() {
  // Everything goes back to the device, blocks still handed out included: the memory dies with
  // its allocator either way. A destructor cannot throw, so a device error here (the device is
  // typically being torn down) is dropped.
  try {
    for (auto& [data, block] : blocks_) {
      for (void* event : block->pending_events) memory_->destroy_event(event);
      if (block->prev == nullptr) memory_->free(data);  // the first block holds its device allocation
    }
  } catch (const std::exception&) {
  }
}

std::size_t CachingAllocator::round_size(std::size_t nbytes) {
  SHARDLAB_CHECK(nbytes <= std::numeric_limits<std::size_t>::max() - kLargeGranule,
                 "allocation of {} bytes is larger than any device", nbytes);
  // 0 bytes still get a distinct smallest block, so every allocate() returns a unique pointer.
  if (nbytes < kSmallLimit) return round_up(std::max<std::size_t>(nbytes, 1), kSmallGranule);
  return round_up(nbytes, kLargeGranule);
}

void* CachingAllocator::allocate(std::size_t nbytes) {
  const std::size_t size = round_size(nbytes);
  const std::lock_guard lock(mutex_);
  collect_completed_frees();
  void* stream = memory_->current_stream();
  Block* block = take_cached(stream, size);
  if (block == nullptr) {
    void* data = memory_->malloc(size);
    if (data == nullptr) {
      const HostWaitsUnavoidable retry("out of memory: cached blocks returned to the device");
      release_idle_blocks();
      data = memory_->malloc(size);
    }
    const MemoryStats& stats = stats_.raw();
    SHARDLAB_CHECK(data != nullptr,
                   "{}: out of memory: cannot allocate {} bytes ({} bytes rounded); {} bytes are "
                   "in use and {} bytes cached (freed, awaiting work on other streams)",
                   device_name_, nbytes, size, stats.bytes_in_use, stats.bytes_cached);
    auto owned = std::make_unique<Block>(Block{data, size, stream, {}, {}, nullptr, nullptr});
    block = owned.get();
    blocks_.emplace(data, std::move(owned));
  }
  stats_.on_allocate(block->size);
  return block->data;
}

void CachingAllocator::deallocate(void* data, std::size_t nbytes) {
  const std::lock_guard lock(mutex_);
  const auto found = blocks_.find(data);
  Block* block = found == blocks_.end() ? nullptr : found->second.get();
  SHARDLAB_CHECK(block != nullptr && !is_cached(block, idle_, held_back_),
                 "{}: deallocate({}) of a pointer this allocator did not hand out, or freed twice",
                 device_name_, data);
  SHARDLAB_CHECK(nbytes <= block->size, "{}: deallocate({}, {} bytes) of a block of {} bytes", device_name_,
                 data, nbytes, block->size);
  // Work already queued on the recorded streams may still use the block: remember where each
  // of them stands now, and hand the block out again only once all of that has run.
  for (void* other : block->other_streams) {
    block->pending_events.push_back(memory_->record_event(other));
  }
  block->other_streams.clear();
  stats_.on_free(block->size);
  stats_.raw().bytes_cached += static_cast<std::int64_t>(block->size);
  if (block->pending_events.empty()) {
    make_idle(block);
  } else {
    held_back_.push_back(block);
  }
}

MemoryStats CachingAllocator::stats() const {
  const std::lock_guard lock(mutex_);
  return stats_.raw();
}

void CachingAllocator::reset_peak() {
  const std::lock_guard lock(mutex_);
  stats_.reset_peak();
}

void CachingAllocator::record_stream(void* data, void* stream) {
  const std::lock_guard lock(mutex_);
  // The block that starts at or before `data`, if `data` lies inside it.
  auto found = blocks_.upper_bound(data);
  const bool inside = found != blocks_.begin() &&
                      static_cast<const char*>(data) <
                          static_cast<const char*>(std::prev(found)->first) + std::prev(found)->second->size;
  SHARDLAB_CHECK(inside && !is_cached(std::prev(found)->second.get(), idle_, held_back_),
                 "{}: record_stream({}) of a pointer this allocator has not handed out", device_name_, data);
  Block& block = *std::prev(found)->second;
  // Its own stream is ordered with its reuse already; another stream is recorded once.
  const bool known =
      stream == block.stream || std::ranges::find(block.other_streams, stream) != block.other_streams.end();
  if (!known) block.other_streams.push_back(stream);
}

void CachingAllocator::empty_cache() {
  const std::lock_guard lock(mutex_);
  collect_completed_frees();
  release_idle_blocks();
}

void CachingAllocator::collect_completed_frees() {
  std::erase_if(held_back_, [this](Block* block) {
    std::erase_if(block->pending_events, [this](void* event) {
      if (!memory_->event_done(event)) return false;
      memory_->destroy_event(event);
      return true;
    });
    if (!block->pending_events.empty()) return false;
    make_idle(block);
    return true;
  });
}

CachingAllocator::Block* CachingAllocator::take_cached(void* stream, std::size_t size) {
  // The smallest idle block of this stream that holds `size`. A large request splits it; a small
  // one takes it whole, so one bigger than 2x would waste more than it saves, and every later
  // block in the order is bigger still.
  Block probe{nullptr, size, stream, {}, {}, nullptr, nullptr};
  const auto it = idle_.lower_bound(&probe);
  if (it == idle_.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  const bool splits = size >= kSmallLimit && block->size - size >= kSmallLimit;
  if (!splits && block->size > 2 * size) return nullptr;
  idle_.erase(it);
  if (splits) split(block, size);
  stats_.raw().bytes_cached -= static_cast<std::int64_t>(block->size);
  return block;
}

void CachingAllocator::split(Block* block, std::size_t size) {
  auto rest = std::make_unique<Block>(Block{
      static_cast<char*>(block->data) + size, block->size - size, block->stream, {}, {}, block, block->next});
  if (block->next != nullptr) block->next->prev = rest.get();
  block->next = rest.get();
  block->size = size;
  idle_.insert(rest.get());
  blocks_.emplace(rest->data, std::move(rest));
}

void CachingAllocator::make_idle(Block* block) {
  // Only idle neighbours merge: a held-back one still waits for other streams' work.
  if (Block* next = block->next; next != nullptr && idle_.contains(next)) {
    idle_.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    blocks_.erase(next->data);  // destroys *next
  }
  if (Block* prev = block->prev; prev != nullptr && idle_.contains(prev)) {
    idle_.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) block->next->prev = prev;
    blocks_.erase(block->data);  // destroys *block
    block = prev;
  }
  idle_.insert(block);
}

void CachingAllocator::release_idle_blocks() {
  std::vector<Block*> whole;  // idle blocks that are a whole device allocation
  for (Block* block : idle_) {
    if (block->prev == nullptr && block->next == nullptr) whole.push_back(block);
  }
  if (whole.empty()) return;
  // A device's free (cudaFree, cudaFreeHost) waits for all of its queued work.
  host_wait("return cached blocks to the device", device_name_);
  for (Block* block : whole) {
    memory_->free(block->data);
    idle_.erase(block);
    stats_.raw().bytes_cached -= static_cast<std::int64_t>(block->size);
    blocks_.erase(block->data);  // destroys *block
  }
}

}  // namespace shardlab
