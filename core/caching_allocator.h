// core/caching_allocator.h: a stream-aware caching allocator policy. It is written against a
// small DeviceMemory interface rather than CUDA, so its rules are tested on any machine.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/allocator.h"

namespace shardlab {

// What the policy needs from a device. Streams and events are opaque handles.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual void* malloc(std::size_t nbytes) = 0;  // nullptr when the device is out of memory
  virtual void free(void* data) = 0;
  virtual void* current_stream() = 0;
  virtual void* record_event(void* stream) = 0;  // marks the work queued on stream so far
  virtual bool event_done(void* event) = 0;
  virtual void destroy_event(void* event) = 0;
};

// Rules:
// - a block is allocated on the caller's current stream and, once freed, is reused only
//   for requests on that same stream (stream order makes that safe without a sync);
// - a block also used on other streams (record_stream) is held back after its free until
//   events recorded on those streams at free time have completed;
// - requests round up (512 B below 1 MiB, 128 KiB above). A request of 1 MiB or more takes the
//   smallest idle block of its stream that holds it and splits off the rest when at least 1 MiB
//   is left, which stays cached; freed neighbours from one device allocation merge again. So
//   shapes that change from step to step (a last partial batch, an evaluation) are served from
//   the cache instead of emptying it. A smaller request takes a cached block whole, only when
//   at most twice the rounded request;
// - on out-of-memory every idle cached device allocation (whole: none of its blocks in use) is
//   returned to the device and the request retried once, then Error is thrown. The return waits
//   for the device's queued work: it is an unavoidable host wait (core/host_wait.h), allowed
//   inside a training step and counted under "out of memory: cached blocks returned to the device".
class CachingAllocator final : public Allocator {
 public:
  CachingAllocator(std::string device_name, std::unique_ptr<DeviceMemory> memory);
  ~CachingAllocator() override;

  void* allocate(std::size_t nbytes) override;
  void deallocate(void* data, std::size_t nbytes) override;
  MemoryStats stats() const override;
  void reset_peak() override;

  // The block that holds `data` (any address inside memory handed out by allocate: a view's data at
  // an offset too) is also read or written by work queued on `stream`.
  void record_stream(void* data, void* stream);
  // Returns every idle cached block to the device.
  void empty_cache();

  static std::size_t round_size(std::size_t nbytes);

 private:
  struct Block {
    void* data;
    std::size_t size;
    void* stream;                      // the stream it was allocated on
    std::vector<void*> other_streams;  // streams recorded with record_stream
    std::vector<void*> pending_events;
    // The blocks before and after it in the same device allocation, once it was split; a block
    // without either is a whole device allocation, which alone can go back to the device.
    Block* prev = nullptr;
    Block* next = nullptr;
  };
  struct BlockOrder {  // by (stream, size, address): best fit within one stream
    bool operator()(const Block* a, const Block* b) const;
  };

  void collect_completed_frees();  // moves held-back blocks whose events finished to the pool
  Block* take_cached(void* stream, std::size_t size);
  void split(Block* block, std::size_t size);  // the rest after `size` bytes becomes an idle block
  void make_idle(Block* block);                // into the pool, merged with idle neighbours
  void release_idle_blocks();

  std::string device_name_;
  std::unique_ptr<DeviceMemory> memory_;
  mutable std::mutex mutex_;
  std::map<void*, std::unique_ptr<Block>> blocks_;  // every block we own, by address
  std::set<Block*, BlockOrder> idle_;
  std::vector<Block*> held_back_;
  StatsCounter stats_;
};

}  // namespace shardlab
