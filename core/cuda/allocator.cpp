// core/cuda/allocator.cpp: CUDA device memory behind the caching allocator, one allocator per
// device (device_allocator), and record_stream.
#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "core/caching_allocator.h"
#include "core/cuda/check.h"
#include "core/cuda/runtime.h"
#include "core/device.h"

namespace shardlab::cuda {
namespace {

// DeviceMemory over the CUDA runtime for one device: streams and events are their CUDA handles.
class CudaMemory final : public DeviceMemory {
 public:
  explicit CudaMemory(int device) : device_(device) {}

  void* malloc(std::size_t nbytes) override {
    const DeviceGuard guard(device_);
    void* data = nullptr;
    const cudaError_t malloc_status = cudaMalloc(&data, nbytes);
    if (malloc_status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // an answer the allocator handles (free its cache, retry, or throw)
      return nullptr;
    }
    SHARDLAB_CUDA_CHECK(malloc_status);
    return data;
  }

  void free(void* data) override {
    const DeviceGuard guard(device_);
    SHARDLAB_CUDA_CHECK(cudaFree(data));
  }

  void* current_stream() override { return cuda::current_stream(device_).handle(); }

  void* record_event(void* stream) override {
    const DeviceGuard guard(device_);
    cudaEvent_t event = nullptr;
    SHARDLAB_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    const cudaError_t record_status = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (record_status != cudaSuccess) cudaEventDestroy(event);  // best effort: we throw next
    SHARDLAB_CUDA_CHECK(record_status);
    return event;
  }

  bool event_done(void* event) override {
    const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is an answer, not a failure
      return false;
    }
    SHARDLAB_CUDA_CHECK(status);
    return true;
  }

  void destroy_event(void* event) override {
    SHARDLAB_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  }

 private:
  int device_;
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

}  // namespace

Allocator& device_allocator(int index) { return caching_allocator(index); }

void record_stream(void* data, const Stream& stream) {
  caching_allocator(stream.device()).record_stream(data, stream.handle());
}

}  // namespace shardlab::cuda
