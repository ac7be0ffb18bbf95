// core/cuda/runtime.h: CUDA devices, streams and events for code that must not include CUDA
// headers. Safe to call on machines without a GPU or driver: available() is then false.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace shardlab {
class Allocator;
}

namespace shardlab::cuda {

// True when shardlab was built with CUDA and at least one device answers.
bool available();
int device_count();
// Why available() is false ("built without CUDA", "no CUDA driver: ..."), or "".
std::string unavailable_reason();

// Throws Error naming the device and the reason when `index` is not a usable device.
void require_device(int index);
// Makes `index` the calling thread's current device, where CUDA work outside any device guard
// goes (pinned host memory, for one): a process that runs on one GPU sets it once, so it never
// opens a context on another GPU. dist::init sets each rank's.
void set_current_device(int index);

// An owned cudaStream_t (non-blocking with respect to the legacy default stream).
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const { return device_; }
  void* handle() const { return handle_; }  // a cudaStream_t
  void synchronize() const;

 private:
  int device_;
  void* handle_ = nullptr;
};

// An owned cudaEvent_t without timing, for ordering streams and knowing when work is done.
class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& stream);
  void wait(const Stream& stream) const;  // `stream` waits for the recorded work
  bool query() const;                     // true when the recorded work has completed
  // The host waits for the recorded work (a host_wait, counted under `reason`).
  void synchronize(std::string_view reason = "Event::synchronize") const;

 private:
  int device_;
  void* handle_ = nullptr;
};

// The device's time between two points of one stream's queue (two CUDA timing events): what the
// kernels queued in between took on the GPU, which the host clock around their launch cannot tell.
class TimingSpan {
 public:
  explicit TimingSpan(const Stream& stream);  // records the start on `stream`
  ~TimingSpan();
  TimingSpan(const TimingSpan&) = delete;
  TimingSpan& operator=(const TimingSpan&) = delete;

  void stop(const Stream& stream);  // records the end on `stream`, after the work to time
  // The seconds between start and end once the end has run, without waiting; nothing before.
  std::optional<double> seconds() const;
  // The same, waiting for the end (a host wait counted under `reason`).
  double wait_seconds(std::string_view reason) const;

 private:
  int device_;
  void* start_ = nullptr;
  void* end_ = nullptr;
};

// The stream ops on `device` run on from this thread: the device's default compute stream
// unless a StreamGuard says otherwise.
Stream& current_stream(int device);

// Makes `stream` the current stream of its device for this thread until destroyed.
class StreamGuard {
 public:
  explicit StreamGuard(Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream* previous_;
  int device_;
};

// Copies bytes between host and device memory (either direction, or device to device) on
// the current stream of the device involved; returns once the bytes are in place.
void copy_bytes(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t nbytes,
                int device);

// The caching allocator of device `index` (core/caching_allocator.h); throws when the
// device is not usable.
Allocator& device_allocator(int index);
// Page-locked host memory (cudaHostAlloc, portable to every device) behind a caching allocator:
// a copy from it to a device runs without the host waiting. A block freed while a copy queued on
// a stream still reads it is handed out again only once that copy has run. Throws Error saying
// why when no GPU is usable.
Allocator& pinned_host_allocator();
// Queues a copy of nbytes from pinned host memory (pinned_host_allocator, any address inside one
// of its blocks) to memory of `device` on that device's current stream and returns at once.
void copy_to_device_async(void* dst, const void* pinned_src, std::size_t nbytes, int device);
// Queues a copy of nbytes from memory of `stream`'s device to pinned host memory (any address inside
// one of its blocks) on `stream` and returns at once; both blocks are held until it ran. The host
// may read `pinned_dst` once an event recorded after it on `stream` has completed.
void copy_to_host_async(void* pinned_dst, const void* src, std::size_t nbytes, const Stream& stream);

// Tells device `index`'s allocator that `data` is also used by work queued on `stream`, so
// it is not reused by another stream before that work completes.
void record_stream(void* data, const Stream& stream);

}  // namespace shardlab::cuda
