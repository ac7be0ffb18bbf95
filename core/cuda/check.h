// core/cuda/check.h: internal to core/cuda: the one macro that checks CUDA status codes (and
// kernel launches) with file:line, and the device guard that checked calls run under.
#pragma once

#include <cuda_runtime_api.h>

namespace shardlab::cuda {

// Throws shardlab::Error "CUDA error at file:line: expr failed: <name>: <description>". Kept out
// of line (core/cuda/runtime.cpp) so this header needs no fmt and .cu files can include it.
[[noreturn]] void fail_status(cudaError_t status, const char* expr, const char* file, int line);

// One overload per status type (cuBLAS, cuDNN and NCCL add theirs next to their wrappers), all
// reached through SHARDLAB_CUDA_CHECK.
inline void check_status(cudaError_t status, const char* expr, const char* file, int line) {
  if (status != cudaSuccess) fail_status(status, expr, file, line);
}

// Makes `device` the calling thread's current CUDA device for the guard's lifetime, because
// cudaMalloc, stream and event creation and kernel launches all act on the current device. It
// switches back at its end only to a device whose context this process already has: it never
// opens a context on another GPU (a thread that chose none would otherwise get one on GPU 0).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace shardlab::cuda

#define SHARDLAB_CUDA_CHECK(expr) ::shardlab::cuda::check_status((expr), #expr, __FILE__, __LINE__)

// Goes right after every <<<...>>>: a bad launch configuration is only reported by
// cudaGetLastError, and the file:line then names the launch itself.
#define SHARDLAB_CUDA_CHECK_LAUNCH() \
  ::shardlab::cuda::check_status(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
