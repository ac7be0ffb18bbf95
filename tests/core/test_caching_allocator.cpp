// tests/core/test_caching_allocator.cpp: every rule of the caching allocator, on a fake device whose
// memory budget, streams and event completion the tests control (runs without a GPU).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/caching_allocator.h"
#include "core/host_wait.h"
#include "tests/check.h"

namespace shardlab {
namespace {

// The state of the fake device, shared between the test and the FakeDeviceMemory the
// allocator owns.
struct FakeDevice {
  struct EventState {
    void* stream;
    bool done = false;
  };

  std::size_t budget = std::size_t{64} << 20;
  std::size_t used = 0;
  std::vector<std::size_t> malloc_sizes;  // every successful malloc, in order
  int failed_mallocs = 0;
  int frees = 0;
  std::map<void*, std::size_t> live;  // pointer -> size
  void* current_stream = nullptr;
  std::map<std::intptr_t, EventState> events;  // live events by id
  std::intptr_t next_event = 1;
  int recorded_events = 0;

  // Completes every event recorded so far on `stream`: its queued work has run.
  void finish(void* stream) {
    for (auto& [id, event] : events) {
      if (event.stream == stream) event.done = true;
    }
  }
};

// Misuse of the fake by the allocator throws, so it fails the test from any thread (Catch2
// assertions are not thread-safe).
void expect(bool condition, const char* what) {
  if (!condition) throw std::logic_error(what);
}

class FakeDeviceMemory final : public DeviceMemory {
 public:
  explicit FakeDeviceMemory(std::shared_ptr<FakeDevice> device) : device_(std::move(device)) {}

  void* malloc(std::size_t nbytes) override {
    if (device_->used + nbytes > device_->budget) {
      ++device_->failed_mallocs;
      return nullptr;
    }
    void* data = std::aligned_alloc(64, nbytes);  // nbytes is a multiple of 512
    expect(data != nullptr, "host malloc failed");
    device_->used += nbytes;
    device_->live[data] = nbytes;
    device_->malloc_sizes.push_back(nbytes);
    return data;
  }

  void free(void* data) override {
    const auto it = device_->live.find(data);
    expect(it != device_->live.end(), "free of a pointer the fake did not allocate");
    device_->used -= it->second;
    device_->live.erase(it);
    ++device_->frees;
    std::free(data);
  }

  void* current_stream() override { return device_->current_stream; }

  void* record_event(void* stream) override {
    const std::intptr_t id = device_->next_event++;
    device_->events[id] = FakeDevice::EventState{stream};
    ++device_->recorded_events;
    return reinterpret_cast<void*>(id);
  }

  bool event_done(void* event) override { return state(event).done; }

  void destroy_event(void* event) override {
    expect(device_->events.erase(id_of(event)) == 1, "destroy of an unknown event");
  }

 private:
  static std::intptr_t id_of(void* event) { return reinterpret_cast<std::intptr_t>(event); }
  FakeDevice::EventState& state(void* event) {
    const auto it = device_->events.find(id_of(event));
    expect(it != device_->events.end(), "query of a destroyed event");
    return it->second;
  }

  std::shared_ptr<FakeDevice> device_;
};

// Distinct fake stream handles (never dereferenced).
void* const kStreamA = reinterpret_cast<void*>(std::intptr_t{0xa0});
void* const kStreamB = reinterpret_cast<void*>(std::intptr_t{0xb0});

struct Fixture {
  std::shared_ptr<FakeDevice> device = std::make_shared<FakeDevice>();
  CachingAllocator allocator{"fake:0", std::make_unique<FakeDeviceMemory>(device)};

  Fixture() { device->current_stream = kStreamA; }
  std::size_t mallocs() const { return device->malloc_sizes.size(); }
};

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

TEST_CASE("caching allocator: requests round to 512 B below 1 MiB and 128 KiB above") {
  CHECK(CachingAllocator::round_size(0) == 512);
  CHECK(CachingAllocator::round_size(1) == 512);
  CHECK(CachingAllocator::round_size(512) == 512);
  CHECK(CachingAllocator::round_size(513) == 1024);
  CHECK(CachingAllocator::round_size(MiB - 1) == MiB);
  CHECK(CachingAllocator::round_size(MiB) == MiB);
  CHECK(CachingAllocator::round_size(MiB + 1) == MiB + 128 * KiB);
  CHECK(CachingAllocator::round_size(3 * MiB + 128 * KiB) == 3 * MiB + 128 * KiB);
  CHECK_THROWS_ERROR(CachingAllocator::round_size(SIZE_MAX), "larger than any device");

  Fixture f;
  void* data = f.allocator.allocate(1000);
  REQUIRE(f.device->malloc_sizes == std::vector<std::size_t>{1024});
  CHECK(reinterpret_cast<std::uintptr_t>(data) % 64 == 0);
  f.allocator.deallocate(data, 1000);
}

TEST_CASE("caching allocator: a freed block is reused on the same stream") {
  Fixture f;
  void* first = f.allocator.allocate(1000);
  f.allocator.deallocate(first, 1000);
  void* second = f.allocator.allocate(900);  // rounds to the same 1024-byte block
  CHECK(second == first);
  CHECK(f.mallocs() == 1);
  f.allocator.deallocate(second, 900);
}

TEST_CASE("caching allocator: a block freed on one stream is not reused by another") {
  Fixture f;
  void* on_a = f.allocator.allocate(4096);
  f.allocator.deallocate(on_a, 4096);

  f.device->current_stream = kStreamB;
  void* on_b = f.allocator.allocate(4096);
  CHECK(on_b != on_a);
  CHECK(f.mallocs() == 2);
  f.allocator.deallocate(on_b, 4096);

  f.device->current_stream = kStreamA;  // stream A still gets its own block back
  CHECK(f.allocator.allocate(4096) == on_a);
  CHECK(f.mallocs() == 2);
  f.allocator.deallocate(on_a, 4096);
}

TEST_CASE("caching allocator: record_stream holds a freed block back until the stream's work ran") {
  Fixture f;
  void* data = f.allocator.allocate(2048);
  f.allocator.record_stream(data, kStreamB);
  f.allocator.record_stream(data, kStreamB);  // recording twice needs one event
  f.allocator.record_stream(data, kStreamA);  // its own stream needs none
  f.allocator.deallocate(data, 2048);
  REQUIRE(f.device->recorded_events == 1);
  REQUIRE(f.device->events.begin()->second.stream == kStreamB);
  CHECK(f.allocator.stats().bytes_cached == 2048);

  // Work on B may still read the block: a new request on A gets fresh memory.
  void* while_pending = f.allocator.allocate(2048);
  CHECK(while_pending != data);
  CHECK(f.mallocs() == 2);

  f.device->finish(kStreamB);
  void* after = f.allocator.allocate(2048);
  CHECK(after == data);
  CHECK(f.mallocs() == 2);
  CHECK(f.device->events.empty());  // the completed event was destroyed

  // The recorded streams were forgotten at free: the next life of the block starts clean.
  f.allocator.deallocate(after, 2048);
  CHECK(f.device->recorded_events == 1);
  CHECK(f.allocator.allocate(2048) == data);
  f.allocator.deallocate(data, 2048);
  f.allocator.deallocate(while_pending, 2048);
}

TEST_CASE("caching allocator: record_stream takes any address inside a block, as a view's data") {
  Fixture f;
  void* data = f.allocator.allocate(4096);
  void* other = f.allocator.allocate(512);
  // Rank 1's slot of an in-place all-gather: its data starts inside the output's block.
  char* slot = static_cast<char*>(data) + 2048;
  f.allocator.record_stream(slot, kStreamB);
  f.allocator.record_stream(static_cast<char*>(data) + 4095, kStreamB);  // the last byte: the same block
  f.allocator.deallocate(data, 4096);
  CHECK(f.device->recorded_events == 1);  // one block, recorded once, held back for stream B
  void* while_pending = f.allocator.allocate(4096);
  CHECK(while_pending != data);
  f.device->finish(kStreamB);
  void* after = f.allocator.allocate(4096);
  CHECK(after == data);
  f.allocator.deallocate(while_pending, 4096);

  // Past the end of a block, or before the first, is no block's: refused, naming the pointer.
  char* past = static_cast<char*>(after) + 4096;
  if (past != other) {
    CHECK_THROWS_ERROR(f.allocator.record_stream(past, kStreamB),
                       "of a pointer this allocator has not handed out");
  }
  int on_the_host = 0;
  CHECK_THROWS_ERROR(f.allocator.record_stream(&on_the_host, kStreamB), "has not handed out");
  // A freed block's addresses are refused as well.
  f.allocator.deallocate(other, 512);
  CHECK_THROWS_ERROR(f.allocator.record_stream(static_cast<char*>(other) + 8, kStreamB),
                     "has not handed out");
  f.allocator.deallocate(after, 4096);
}

TEST_CASE("caching allocator: events are recorded at free time, not at record_stream time") {
  Fixture f;
  void* data = f.allocator.allocate(512);
  f.allocator.record_stream(data, kStreamB);
  f.device->finish(kStreamB);  // nothing recorded yet: this completes nothing
  CHECK(f.device->recorded_events == 0);
  f.allocator.deallocate(data, 512);
  CHECK(f.allocator.allocate(512) != data);  // the event recorded at free is still pending
  CHECK(f.device->events.size() == 1);
}

TEST_CASE("caching allocator: a cached block is reused only up to twice the rounded request") {
  Fixture f;
  void* big = f.allocator.allocate(4096);
  f.allocator.deallocate(big, 4096);

  void* half = f.allocator.allocate(2048);  // 4096 <= 2 * 2048: reuse
  CHECK(half == big);
  CHECK(f.mallocs() == 1);
  CHECK(f.allocator.stats().bytes_in_use == 4096);  // the whole block is in use
  f.allocator.deallocate(half, 2048);

  void* small = f.allocator.allocate(1536);  // 4096 > 2 * 1536: fresh block
  CHECK(small != big);
  CHECK(f.device->malloc_sizes == std::vector<std::size_t>{4096, 1536});
  f.allocator.deallocate(small, 1536);
}

TEST_CASE("caching allocator: the smallest fitting cached block is chosen") {
  Fixture f;
  void* large = f.allocator.allocate(8192);
  void* fitting = f.allocator.allocate(5120);
  f.allocator.deallocate(large, 8192);
  f.allocator.deallocate(fitting, 5120);
  CHECK(f.allocator.allocate(4608) == fitting);
  CHECK(f.allocator.allocate(4608) == large);  // 8192 <= 2 * 4608
  CHECK(f.mallocs() == 2);
  f.allocator.deallocate(fitting, 4608);
  f.allocator.deallocate(large, 4608);
}

TEST_CASE("caching allocator: out of memory releases idle blocks and retries once") {
  Fixture f;
  f.device->budget = 4096;
  void* a = f.allocator.allocate(2048);
  void* b = f.allocator.allocate(1024);
  f.allocator.deallocate(a, 2048);
  f.allocator.deallocate(b, 1024);
  REQUIRE(f.allocator.stats().bytes_cached == 3072);

  // No cached block fits 3072 and the device has 1024 bytes left: free the cache, retry.
  void* c = f.allocator.allocate(3072);
  CHECK(c != nullptr);
  CHECK(f.device->failed_mallocs == 1);
  CHECK(f.device->frees == 2);
  CHECK(f.allocator.stats().bytes_cached == 0);
  CHECK(f.allocator.stats().bytes_in_use == 3072);
  f.allocator.deallocate(c, 3072);
}

TEST_CASE("caching allocator: emptying the cache is a host wait, refused inside a step") {
  Fixture f;
  void* a = f.allocator.allocate(2048);
  f.allocator.deallocate(a, 2048);
  reset_host_wait_counts();
  {
    // The device's free waits for its queued work: asked for inside the scope, it is refused and
    // nothing changes; the cached block is still there to be reused.
    HostWaitsForbidden step("training step");
    CHECK_THROWS_ERROR(f.allocator.empty_cache(),
                       "host wait inside 'training step': return cached blocks to the device on fake:0");
    CHECK(f.device->frees == 0);
    CHECK(f.allocator.stats().bytes_cached == 2048);
  }
  f.allocator.empty_cache();
  f.allocator.empty_cache();  // nothing idle: no wait
  CHECK(f.device->frees == 1);
  REQUIRE(host_wait_counts().size() == 1);
  CHECK(host_wait_counts()[0].reason == "return cached blocks to the device");
  CHECK(host_wait_counts()[0].count == 1);
  reset_host_wait_counts();
}

TEST_CASE("caching allocator: the out-of-memory retry is allowed inside a step and counted apart") {
  Fixture f;
  f.device->budget = 4096;
  void* a = f.allocator.allocate(2048);
  f.allocator.deallocate(a, 2048);
  reset_host_wait_counts();
  {
    // Emptying the cache cures this request: a step that meets it is slower, not broken.
    HostWaitsForbidden step("training step");
    void* c = f.allocator.allocate(3072);
    CHECK(f.device->frees == 1);
    CHECK(f.allocator.stats().bytes_cached == 0);
    f.allocator.deallocate(c, 3072);
  }
  REQUIRE(host_wait_counts().size() == 1);
  CHECK(host_wait_counts()[0].reason == "out of memory: cached blocks returned to the device");
  CHECK(host_wait_counts()[0].count == 1);
  reset_host_wait_counts();
}

TEST_CASE("caching allocator: a large cached block is split for a smaller request, the rest stays cached") {
  Fixture f;
  f.device->budget = 128 * MiB;
  void* whole = f.allocator.allocate(64 * MiB);
  f.allocator.deallocate(whole, 64 * MiB);

  // 40 MiB and then 20 MiB come out of the one 64 MiB block: its first 40 MiB, then the next 20.
  void* first = f.allocator.allocate(40 * MiB);
  CHECK(first == whole);
  CHECK(f.allocator.stats().bytes_cached == static_cast<std::int64_t>(24 * MiB));
  void* second = f.allocator.allocate(20 * MiB);
  CHECK(second == static_cast<char*>(whole) + 40 * MiB);
  CHECK(f.allocator.stats().bytes_cached == static_cast<std::int64_t>(4 * MiB));
  CHECK(f.allocator.stats().bytes_in_use == static_cast<std::int64_t>(60 * MiB));
  CHECK(f.mallocs() == 1);

  // Less than 1 MiB would be left: the request takes the block whole.
  void* tail = f.allocator.allocate(3 * MiB + 256 * KiB);
  CHECK(tail == static_cast<char*>(whole) + 60 * MiB);
  CHECK(f.allocator.stats().bytes_cached == 0);
  CHECK(f.allocator.stats().bytes_in_use == static_cast<std::int64_t>(64 * MiB));

  // record_stream finds the split blocks by any address inside them.
  f.allocator.record_stream(static_cast<char*>(second) + 5 * MiB, kStreamB);
  f.allocator.deallocate(tail, 3 * MiB + 256 * KiB);
  f.allocator.deallocate(first, 40 * MiB);
  f.allocator.deallocate(second, 20 * MiB);  // held back for stream B: its neighbours cannot merge yet
  void* while_pending = f.allocator.allocate(64 * MiB);
  CHECK(f.mallocs() == 2);
  f.allocator.deallocate(while_pending, 64 * MiB);
  f.allocator.empty_cache();  // returns the second device allocation, whole and idle; not the split one
  CHECK(f.device->frees == 1);

  // Once B's work ran the three merge again: the whole 64 MiB block serves a 64 MiB request.
  f.device->finish(kStreamB);
  CHECK(f.allocator.allocate(64 * MiB) == whole);
  CHECK(f.mallocs() == 2);
  CHECK(f.allocator.stats().bytes_cached == 0);
  f.allocator.deallocate(whole, 64 * MiB);
}

TEST_CASE("caching allocator: shapes that change from step to step are served from the cache") {
  Fixture f;
  f.device->budget = 96 * MiB;
  // Steps of a full batch, then a last partial one and an evaluation of other sizes, twice over:
  // after the first step every request is served from what the first step left cached.
  const std::vector<std::vector<std::size_t>> steps = {
      {24 * MiB, 16 * MiB, 8 * MiB}, {24 * MiB, 16 * MiB, 8 * MiB}, {15 * MiB, 10 * MiB, 5 * MiB},
      {20 * MiB, 2 * MiB},           {24 * MiB, 16 * MiB, 8 * MiB}, {7 * MiB, 7 * MiB, 7 * MiB, 7 * MiB}};
  for (const std::vector<std::size_t>& sizes : steps) {
    std::vector<void*> held;
    for (const std::size_t size : sizes) held.push_back(f.allocator.allocate(size));
    for (std::size_t i = 0; i < held.size(); ++i) f.allocator.deallocate(held[i], sizes[i]);
  }
  CHECK(f.mallocs() == 3);
  CHECK(f.device->failed_mallocs == 0);
  CHECK(f.device->frees == 0);
}

TEST_CASE("caching allocator: out of memory returns only whole device allocations") {
  Fixture f;
  f.device->budget = 8 * MiB;
  void* segment = f.allocator.allocate(6 * MiB);
  f.allocator.deallocate(segment, 6 * MiB);
  void* part = f.allocator.allocate(2 * MiB);  // split: 4 MiB of the allocation stay cached
  CHECK(part == segment);
  // 3 MiB comes out of the 4 MiB rest, split again.
  void* more = f.allocator.allocate(3 * MiB);
  CHECK(more == static_cast<char*>(segment) + 2 * MiB);
  // 4 MiB: nothing cached holds it and the allocation in use cannot go back: out of memory.
  CHECK_THROWS_ERROR(f.allocator.allocate(4 * MiB), "fake:0: out of memory");
  CHECK(f.device->frees == 0);
  f.allocator.deallocate(part, 2 * MiB);
  f.allocator.deallocate(more, 3 * MiB);
  // Whole and idle again: the retry returns it and the request fits.
  void* big = f.allocator.allocate(7 * MiB);
  CHECK(f.device->frees == 1);
  f.allocator.deallocate(big, 7 * MiB);
}

TEST_CASE("caching allocator: out of memory after the retry throws an Error with the numbers") {
  Fixture f;
  f.device->budget = 4096;
  void* held = f.allocator.allocate(3000);  // 3072 bytes
  void* busy = f.allocator.allocate(512);
  f.allocator.record_stream(busy, kStreamB);
  f.allocator.deallocate(busy, 512);  // held back: cached, and not releasable yet

  CHECK_THROWS_ERROR(f.allocator.allocate(2000), "fake:0: out of memory");
  CHECK_THROWS_ERROR(f.allocator.allocate(2000), "cannot allocate 2000 bytes (2048 bytes rounded)");
  CHECK_THROWS_ERROR(f.allocator.allocate(2000), "3072 bytes are in use and 512 bytes cached");
  CHECK(f.device->failed_mallocs == 6);  // each attempt: the first try and one retry

  // The failures left the bookkeeping intact.
  CHECK(f.allocator.stats().bytes_in_use == 3072);
  CHECK(f.allocator.stats().allocations == 2);
  f.allocator.deallocate(held, 3000);
}

TEST_CASE("caching allocator: statistics of use, peak, count and cache") {
  Fixture f;
  void* a = f.allocator.allocate(1000);  // 1024
  void* b = f.allocator.allocate(3000);  // 3072
  MemoryStats stats = f.allocator.stats();
  CHECK(stats.bytes_in_use == 4096);
  CHECK(stats.peak_bytes == 4096);
  CHECK(stats.allocations == 2);
  CHECK(stats.bytes_cached == 0);

  f.allocator.deallocate(b, 3000);
  stats = f.allocator.stats();
  CHECK(stats.bytes_in_use == 1024);
  CHECK(stats.peak_bytes == 4096);
  CHECK(stats.bytes_cached == 3072);

  f.allocator.reset_peak();
  CHECK(f.allocator.stats().peak_bytes == 1024);

  void* c = f.allocator.allocate(3072);  // served from the cache: still counted
  stats = f.allocator.stats();
  CHECK(c == b);
  CHECK(stats.allocations == 3);
  CHECK(stats.bytes_in_use == 4096);
  CHECK(stats.peak_bytes == 4096);
  CHECK(stats.bytes_cached == 0);

  f.allocator.deallocate(a, 1000);
  f.allocator.deallocate(c, 3072);
  stats = f.allocator.stats();
  CHECK(stats.bytes_in_use == 0);
  CHECK(stats.bytes_cached == 4096);
}

TEST_CASE("caching allocator: empty_cache returns idle blocks, keeping held-back ones") {
  Fixture f;
  void* idle = f.allocator.allocate(1024);
  void* pending = f.allocator.allocate(2048);
  void* in_use = f.allocator.allocate(512);
  f.allocator.record_stream(pending, kStreamB);
  f.allocator.deallocate(idle, 1024);
  f.allocator.deallocate(pending, 2048);

  f.allocator.empty_cache();
  CHECK(f.device->frees == 1);
  CHECK(f.device->live.count(idle) == 0);
  CHECK(f.allocator.stats().bytes_cached == 2048);

  f.device->finish(kStreamB);
  f.allocator.empty_cache();
  CHECK(f.device->frees == 2);
  CHECK(f.allocator.stats().bytes_cached == 0);
  CHECK(f.device->live.size() == 1);  // only the block still in use
  CHECK(f.device->events.empty());

  void* again = f.allocator.allocate(1024);
  CHECK(f.mallocs() == 4);  // nothing cached any more
  f.allocator.deallocate(again, 1024);
  f.allocator.deallocate(in_use, 512);
}

TEST_CASE("caching allocator: unknown pointers and double frees are errors") {
  Fixture f;
  int local = 0;
  CHECK_THROWS_ERROR(f.allocator.deallocate(&local, sizeof local), "did not hand out");
  CHECK_THROWS_ERROR(f.allocator.record_stream(&local, kStreamB), "has not handed out");

  void* data = f.allocator.allocate(100);
  CHECK_THROWS_ERROR(f.allocator.deallocate(data, 4096), "of a block of 512 bytes");
  f.allocator.deallocate(data, 100);
  CHECK_THROWS_ERROR(f.allocator.deallocate(data, 100), "freed twice");
  CHECK_THROWS_ERROR(f.allocator.record_stream(data, kStreamB), "has not handed out");
  CHECK(f.allocator.stats().bytes_in_use == 0);
  CHECK(f.allocator.stats().bytes_cached == 512);
}

TEST_CASE("caching allocator: destruction returns every block and event to the device") {
  auto device = std::make_shared<FakeDevice>();
  device->current_stream = kStreamA;
  {
    CachingAllocator allocator("fake:0", std::make_unique<FakeDeviceMemory>(device));
    allocator.allocate(512);  // still handed out
    void* pending = allocator.allocate(1024);
    allocator.record_stream(pending, kStreamB);
    allocator.deallocate(pending, 1024);
    void* idle = allocator.allocate(4096);
    allocator.deallocate(idle, 4096);
    REQUIRE(device->live.size() == 3);
  }
  CHECK(device->live.empty());
  CHECK(device->used == 0);
  CHECK(device->events.empty());
}

TEST_CASE("caching allocator: concurrent allocate and deallocate keep consistent statistics") {
  // FakeDeviceMemory is not thread-safe, so a race inside the allocator's lock would also
  // corrupt the fake's maps and fail here.
  Fixture f;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const std::size_t n = 512 * static_cast<std::size_t>(1 + (i + t) % 7);
        auto* data = static_cast<unsigned char*>(f.allocator.allocate(n));
        data[0] = static_cast<unsigned char>(t);
        data[n - 1] = static_cast<unsigned char>(t);
        std::this_thread::yield();
        if (data[0] != t || data[n - 1] != t) ++wrong;  // another thread got the same block
        f.allocator.deallocate(data, n);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  CHECK(wrong == 0);
  const MemoryStats stats = f.allocator.stats();
  CHECK(stats.bytes_in_use == 0);
  CHECK(stats.allocations == 8000);
  std::size_t cached = 0;
  for (const auto& [data, size] : f.device->live) cached += size;
  CHECK(stats.bytes_cached == static_cast<std::int64_t>(cached));
}

}  // namespace
}  // namespace shardlab
