// core/cuda/runtime.cpp: CUDA availability, devices, streams, events, the per-thread current
// stream and host/device copies (core/cuda/runtime.h), plus the checks of core/cuda/check.h.
#include "core/cuda/runtime.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "core/cuda/check.h"
#include "core/cuda/index_fault.h"
#include "core/device.h"
#include "core/error.h"
#include "core/host_wait.h"

namespace shardlab::cuda {

void fail_status(cudaError_t status, const char* expr, const char* file, int line) {
  // Reset the thread's last-error slot, or the next launch check would report this failure
  // again as its own (sticky errors, which poison the context, stay reported anyway).
  cudaGetLastError();
  fail("CUDA error at {}:{}: {} failed: {}: {}", file, line, expr, cudaGetErrorName(status),
       cudaGetErrorString(status));
}

namespace {

using DeviceGet = CUresult (*)(CUdevice*, int);
using PrimaryContextState = CUresult (*)(CUdevice, unsigned int*, int*);

// The driver's functions, reached through the runtime: cudart is linked statically and libcuda
// is not linked at all, so that binaries start on machines without a driver.
template <typename Function>
Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}

// Whether `device`'s primary context exists in this process, asked without creating it (which
// cudaSetDevice would do). Unknown counts as active: a switch back is then made as before.
bool has_primary_context(int device) {
  static const auto get = driver_function<DeviceGet>("cuDeviceGet");
  static const auto state = driver_function<PrimaryContextState>("cuDevicePrimaryCtxGetState");
  CUdevice handle = 0;
  unsigned int flags = 0;
  int active = 1;
  if (get == nullptr || state == nullptr || get(&handle, device) != CUDA_SUCCESS ||
      state(handle, &flags, &active) != CUDA_SUCCESS)
    return true;
  return active != 0;
}

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  SHARDLAB_CUDA_CHECK(cudaGetDevice(&previous_));  // asks only: opens no context
  if (previous_ != device) {
    SHARDLAB_CUDA_CHECK(cudaSetDevice(device));
    switched_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  // Switching back makes the previous device's primary context, since CUDA 12: a thread that
  // never chose a device (cudaGetDevice says 0) would open one on GPU 0 on every guard. So the
  // thread switches back only to a device this process already uses, and otherwise stays on the
  // guard's device. A destructor cannot throw: a failure here means the context is already
  // broken and the next checked call reports that; clear it so no launch check takes it as its own.
  if (switched_ && has_primary_context(previous_) && cudaSetDevice(previous_) != cudaSuccess)
    cudaGetLastError();
}

namespace {

struct Availability {
  int device_count = 0;
  std::string reason;  // empty when device_count > 0
};

Availability probe() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // Without a driver this is cudaErrorInsufficientDriver or cudaErrorNoDevice: not an error
    // of ours, just no GPU. Clear it so it cannot surface in a later check.
    cudaGetLastError();
    return {0, std::string("no usable CUDA driver or device (cudaGetDeviceCount: ") +
                   cudaGetErrorName(status) + ": " + cudaGetErrorString(status) + ")"};
  }
  if (count == 0) return {0, "no CUDA device found (cudaGetDeviceCount returned 0)"};
  return {count, ""};
}

// Probed once per process; C++ makes the static's initialisation thread-safe.
const Availability& availability() {
  static const Availability value = probe();
  return value;
}

cudaStream_t raw(const Stream& stream) { return static_cast<cudaStream_t>(stream.handle()); }

// Blocks until `stream`'s queued work has run; the caller has gone through host_wait.
void block_on(const Stream& stream) {
  const DeviceGuard guard(stream.device());
  SHARDLAB_CUDA_CHECK(cudaStreamSynchronize(raw(stream)));
}
cudaEvent_t raw_event(void* handle) { return static_cast<cudaEvent_t>(handle); }

struct DefaultStreams {
  std::mutex mutex;
  std::vector<Stream*> per_device;
};

// The default compute stream of each device, created on first use. Deliberately never
// destroyed: tensors freed by static destructors may still queue work on them at exit, after
// the CUDA runtime may have been torn down.
Stream& default_stream(int device) {
  static auto* streams =
      new DefaultStreams{{}, std::vector<Stream*>(static_cast<std::size_t>(device_count()))};
  const std::lock_guard lock(streams->mutex);
  Stream*& stream = streams->per_device[static_cast<std::size_t>(device)];
  if (stream == nullptr) stream = new Stream(device);
  return *stream;
}

// This thread's StreamGuard-selected stream per device; null means the default stream.
std::vector<Stream*>& guarded_streams() {
  thread_local std::vector<Stream*> streams;
  if (streams.empty()) streams.resize(static_cast<std::size_t>(device_count()), nullptr);
  return streams;
}

cudaMemcpyKind copy_kind(bool dst_on_device, bool src_on_device) {
  if (dst_on_device) return src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
  return src_on_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
}

}  // namespace

bool available() { return availability().device_count > 0; }

int device_count() { return availability().device_count; }

std::string unavailable_reason() { return availability().reason; }

void require_device(int index) {
  const Availability& state = availability();
  SHARDLAB_CHECK(state.device_count > 0, "{} is not usable: {}", Device::cuda(index).str(), state.reason);
  SHARDLAB_CHECK(index >= 0 && index < state.device_count,
                 "{} does not exist: this machine has {} CUDA device(s)", Device::cuda(index).str(),
                 state.device_count);
}

void set_current_device(int index) {
  require_device(index);
  SHARDLAB_CUDA_CHECK(cudaSetDevice(index));
}

// --- Stream ----------------------------------------------------------------------------------

Stream::Stream(int device) : device_(device) {
  require_device(device);
  const DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  SHARDLAB_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  handle_ = stream;
}

Stream::~Stream() {
  // Destroying a stream with queued work is allowed: the work completes first. Errors cannot
  // be thrown from here; clear them so no later check reports them as its own.
  if (cudaStreamDestroy(raw(*this)) != cudaSuccess) cudaGetLastError();
}

// Waiting and querying run under the object's device too: a thread that never chose one (the
// collective watchdog) would otherwise open a context on device 0 just to ask.
void Stream::synchronize() const {
  host_wait("Stream::synchronize", Device::cuda(device_).str());
  block_on(*this);
  report_index_fault();
}

// --- Event -----------------------------------------------------------------------------------

Event::Event(int device) : device_(device) {
  require_device(device);
  const DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  SHARDLAB_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  handle_ = event;
}

Event::~Event() {
  if (cudaEventDestroy(raw_event(handle_)) != cudaSuccess) cudaGetLastError();  // as ~Stream
}

void Event::record(const Stream& stream) {
  SHARDLAB_CHECK(stream.device() == device_, "Event::record: the event belongs to {} but the stream to {}",
                 Device::cuda(device_).str(), Device::cuda(stream.device()).str());
  SHARDLAB_CUDA_CHECK(cudaEventRecord(raw_event(handle_), raw(stream)));
}

void Event::wait(const Stream& stream) const {
  SHARDLAB_CUDA_CHECK(cudaStreamWaitEvent(raw(stream), raw_event(handle_), 0));
}

bool Event::query() const {
  const DeviceGuard guard(device_);
  const cudaError_t status = cudaEventQuery(raw_event(handle_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not a failure: keep it out of later checks
    return false;
  }
  SHARDLAB_CUDA_CHECK(status);
  return true;
}

void Event::synchronize(std::string_view reason) const {
  host_wait(reason, Device::cuda(device_).str());
  {
    const DeviceGuard guard(device_);
    SHARDLAB_CUDA_CHECK(cudaEventSynchronize(raw_event(handle_)));
  }
  report_index_fault();
}

// --- TimingSpan ------------------------------------------------------------------------------

TimingSpan::TimingSpan(const Stream& stream) : device_(stream.device()) {
  const DeviceGuard guard(device_);
  for (void** event : {&start_, &end_}) {
    cudaEvent_t created = nullptr;
    SHARDLAB_CUDA_CHECK(cudaEventCreate(&created));  // with timing, unlike Event
    *event = created;
  }
  SHARDLAB_CUDA_CHECK(cudaEventRecord(raw_event(start_), raw(stream)));
}

TimingSpan::~TimingSpan() {
  const DeviceGuard guard(device_);
  for (void* event : {start_, end_}) {
    if (event != nullptr && cudaEventDestroy(raw_event(event)) != cudaSuccess)
      cudaGetLastError();  // as ~Stream
  }
}

void TimingSpan::stop(const Stream& stream) {
  SHARDLAB_CHECK(stream.device() == device_,
                 "TimingSpan::stop: the span started on {} but the stream is on {}",
                 Device::cuda(device_).str(), Device::cuda(stream.device()).str());
  SHARDLAB_CUDA_CHECK(cudaEventRecord(raw_event(end_), raw(stream)));
}

std::optional<double> TimingSpan::seconds() const {
  const DeviceGuard guard(device_);
  const cudaError_t status = cudaEventQuery(raw_event(end_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return std::nullopt;
  }
  SHARDLAB_CUDA_CHECK(status);
  float milliseconds = 0;
  SHARDLAB_CUDA_CHECK(cudaEventElapsedTime(&milliseconds, raw_event(start_), raw_event(end_)));
  return 1e-3 * milliseconds;
}

double TimingSpan::wait_seconds(std::string_view reason) const {
  host_wait(reason, Device::cuda(device_).str());
  {
    const DeviceGuard guard(device_);
    SHARDLAB_CUDA_CHECK(cudaEventSynchronize(raw_event(end_)));
  }
  return *seconds();
}

// --- current stream --------------------------------------------------------------------------

Stream& current_stream(int device) {
  require_device(device);
  Stream* guarded = guarded_streams()[static_cast<std::size_t>(device)];
  return guarded != nullptr ? *guarded : default_stream(device);
}

StreamGuard::StreamGuard(Stream& stream) : device_(stream.device()) {
  Stream*& slot = guarded_streams()[static_cast<std::size_t>(device_)];
  previous_ = slot;
  slot = &stream;
}

StreamGuard::~StreamGuard() { guarded_streams()[static_cast<std::size_t>(device_)] = previous_; }

// --- copies ----------------------------------------------------------------------------------

void copy_bytes(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t nbytes,
                int device) {
  if (nbytes == 0) return;
  const Stream& stream = current_stream(device);
  // Device to device is ordered on the stream like any kernel. Pageable host memory may be read
  // or written after cudaMemcpyAsync returns: wait, so the caller can reuse or read its buffer at
  // once (from pageable memory the driver itself first waits for the stream's queued work).
  const bool waits = !(dst_on_device && src_on_device);
  if (waits)
    host_wait(dst_on_device ? "copy from pageable host memory" : "copy to host memory",
              Device::cuda(device).str());
  const DeviceGuard guard(device);
  SHARDLAB_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, nbytes, copy_kind(dst_on_device, src_on_device), raw(stream)));
  if (!waits) return;
  block_on(stream);
  report_index_fault();
}

// --- index faults ----------------------------------------------------------------------------

namespace {
std::atomic<IndexFault*> fault_slot{nullptr};
std::mutex fault_mutex;
}  // namespace

IndexFault* index_fault() {
  if (IndexFault* slot = fault_slot.load()) return slot;
  const std::lock_guard lock(fault_mutex);
  if (IndexFault* slot = fault_slot.load()) return slot;
  void* memory = nullptr;
  // Mapped and portable: with unified addressing every device writes it at the host's address.
  SHARDLAB_CUDA_CHECK(
      cudaHostAlloc(&memory, sizeof(IndexFault), cudaHostAllocMapped | cudaHostAllocPortable));
  auto* slot = new (memory) IndexFault{};  // never freed: kernels may write it until the process ends
  fault_slot.store(slot);
  return slot;
}

void report_index_fault() {
  IndexFault* slot = fault_slot.load();
  if (slot == nullptr) return;
  const std::lock_guard lock(fault_mutex);
  volatile IndexFault* seen = slot;
  if (seen->ready == 0) return;
  const IndexFault fault{0, 0, seen->op, seen->what, seen->value, seen->size, seen->device};
  seen->ready = 0;
  seen->claimed = 0;
  fail(
      "{}: index {} is out of range for {} of size {} (found on {} by a check the host did not wait for; "
      "what was computed from it since is not valid)",
      fault.op, fault.value, fault.what, fault.size, Device::cuda(fault.device).str());
}

}  // namespace shardlab::cuda
