// core/cuda/allocator.cpp: CUDA device memory and pinned host memory behind the caching
// allocator (device_allocator, pinned_host_allocator), record_stream, and copies from pinned
// memory that the host does not wait for.
#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <vector>

#include "core/caching_allocator.h"
#include "core/cuda/check.h"
#include "core/cuda/runtime.h"
#include "core/device.h"
#include "core/error.h"

namespace shardlab::cuda {
namespace {

// Events on CUDA streams, for memory of any kind that CUDA streams use. Each event keeps its
// device: it is queried and destroyed under that device, from whichever thread frees memory (a
// thread that chose no device would otherwise act on GPU 0).
class StreamEvents : public DeviceMemory {
 public:
  void* record_event(void* stream) override {
    // An event is created and recorded on its stream's device.
    int device = 0;
    SHARDLAB_CUDA_CHECK(cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &device));
    const DeviceGuard guard(device);
    cudaEvent_t event = nullptr;
    SHARDLAB_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    const cudaError_t record_status = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (record_status != cudaSuccess) cudaEventDestroy(event);  // best effort: we throw next
    SHARDLAB_CUDA_CHECK(record_status);
    return new DeviceEvent{event, device};
  }

  bool event_done(void* handle) override {
    const auto* event = static_cast<DeviceEvent*>(handle);
    const DeviceGuard guard(event->device);
    const cudaError_t status = cudaEventQuery(event->event);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is an answer, not a failure
      return false;
    }
    SHARDLAB_CUDA_CHECK(status);
    return true;
  }

  void destroy_event(void* handle) override {
    const std::unique_ptr<DeviceEvent> event(static_cast<DeviceEvent*>(handle));
    const DeviceGuard guard(event->device);
    SHARDLAB_CUDA_CHECK(cudaEventDestroy(event->event));
  }

 private:
  struct DeviceEvent {
    cudaEvent_t event;
    int device;
  };
};

// An out-of-memory answer is the allocator's to handle (free its cache, retry, or throw). The
// status is taken first and the pointer after: as two arguments of one call, the compiler may read
// the pointer before the allocation has written it.
void* null_when_out_of_memory(cudaError_t status, void* data) {
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;
  }
  SHARDLAB_CUDA_CHECK(status);
  return data;
}

// Memory of one device: streams are that device's CUDA streams.
class CudaMemory final : public StreamEvents {
 public:
  explicit CudaMemory(int device) : device_(device) {}

  void* malloc(std::size_t nbytes) override {
    const DeviceGuard guard(device_);
    void* data = nullptr;
    const cudaError_t status = cudaMalloc(&data, nbytes);
    return null_when_out_of_memory(status, data);
  }

  void free(void* data) override {
    const DeviceGuard guard(device_);
    SHARDLAB_CUDA_CHECK(cudaFree(data));
  }

  void* current_stream() override { return cuda::current_stream(device_).handle(); }

 private:
  int device_;
};

// The host reads and writes pinned blocks in program order, so all host use is one stream to the
// policy: a block the host frees is at once the host's to reuse, unless a copy queued on a device
// stream was recorded on it, which holds the block back until that copy has run.
char host_stream;  // its address names the host's stream

// Page-locked host memory, portable: a copy from it to any device is a direct DMA.
class PinnedMemory final : public StreamEvents {
 public:
  void* malloc(std::size_t nbytes) override {
    void* data = nullptr;
    const cudaError_t status = cudaHostAlloc(&data, nbytes, cudaHostAllocPortable);
    return null_when_out_of_memory(status, data);
  }

  void free(void* data) override { SHARDLAB_CUDA_CHECK(cudaFreeHost(data)); }

  void* current_stream() override { return &host_stream; }
};

struct Allocators {
  std::mutex mutex;
  std::vector<CachingAllocator*> per_device;
};

// Created on first use and deliberately never destroyed: tensors held in static objects are
// freed during exit, possibly after this function's statics would have been destroyed.
CachingAllocator& caching_allocator(int index) {
  require_device(index);
  static auto* allocators =
      new Allocators{{}, std::vector<CachingAllocator*>(static_cast<std::size_t>(device_count()))};
  const std::lock_guard lock(allocators->mutex);
  CachingAllocator*& allocator = allocators->per_device[static_cast<std::size_t>(index)];
  if (allocator == nullptr) {
    allocator = new CachingAllocator(Device::cuda(index).str(), std::make_unique<CudaMemory>(index));
  }
  return *allocator;
}

// Never destroyed, for the same reason as the device allocators.
CachingAllocator& pinned_allocator() {
  SHARDLAB_CHECK(available(), "pinned host memory needs a usable GPU: {}", unavailable_reason());
  static auto* allocator = new CachingAllocator("pinned host memory", std::make_unique<PinnedMemory>());
  return *allocator;
}

}  // namespace

Allocator& device_allocator(int index) { return caching_allocator(index); }

Allocator& pinned_host_allocator() { return pinned_allocator(); }

void record_stream(void* data, const Stream& stream) {
  caching_allocator(stream.device()).record_stream(data, stream.handle());
}

void copy_to_device_async(void* dst, const void* pinned_src, std::size_t nbytes, int device) {
  if (nbytes == 0) return;
  const Stream& stream = current_stream(device);
  // Recorded first: it also checks that the source is pinned memory of ours.
  pinned_allocator().record_stream(const_cast<void*>(pinned_src), stream.handle());
  const DeviceGuard guard(device);
  SHARDLAB_CUDA_CHECK(cudaMemcpyAsync(dst, pinned_src, nbytes, cudaMemcpyHostToDevice,
                                      static_cast<cudaStream_t>(stream.handle())));
}

void copy_to_host_async(void* pinned_dst, const void* src, std::size_t nbytes, const Stream& stream) {
  if (nbytes == 0) return;
  pinned_allocator().record_stream(pinned_dst, stream.handle());  // checks that it is pinned memory of ours
  record_stream(const_cast<void*>(src), stream);
  const DeviceGuard guard(stream.device());
  SHARDLAB_CUDA_CHECK(cudaMemcpyAsync(pinned_dst, src, nbytes, cudaMemcpyDeviceToHost,
                                      static_cast<cudaStream_t>(stream.handle())));
}

}  // namespace shardlab::cuda
