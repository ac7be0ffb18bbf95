// core/cuda/disabled.cpp: core/cuda/runtime.h and cuda_kernels() for builds without CUDA: nothing
// is available, and everything that would need a device throws an Error saying why.
#include "core/cuda/runtime.h"
#include "core/error.h"
#include "core/kernels.h"

namespace shardlab {

const Kernels& cuda_kernels() {
  static const Kernels none{};  // every entry null: supports() is false for every op
  return none;
}

namespace cuda {
namespace {

constexpr const char* kReason = "shardlab was built without CUDA (nvcc not found or -Dcuda=disabled)";

[[noreturn]] void fail_unavailable(int device) {
  fail("{} is not usable: {}", Device::cuda(device).str(), kReason);
}

}  // namespace

bool available() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return kReason; }
void require_device(int index) { fail_unavailable(index); }
void set_current_device(int index) { fail_unavailable(index); }

Stream::Stream(int device) : device_(device) { fail_unavailable(device); }
Stream::~Stream() = default;  // never reached: no Stream can be constructed
void Stream::synchronize() const { fail_unavailable(device_); }

Event::Event(int device) : device_(device) { fail_unavailable(device); }
Event::~Event() = default;  // never reached: no Event can be constructed
void Event::record(const Stream&) { fail_unavailable(device_); }
void Event::wait(const Stream&) const { fail_unavailable(device_); }
bool Event::query() const { fail_unavailable(device_); }
void Event::synchronize(std::string_view) const { fail_unavailable(device_); }

TimingSpan::TimingSpan(const Stream& stream) : device_(stream.device()) { fail_unavailable(device_); }
TimingSpan::~TimingSpan() = default;  // never reached: no Stream exists to time
void TimingSpan::stop(const Stream&) { fail_unavailable(device_); }
std::optional<double> TimingSpan::seconds() const { fail_unavailable(device_); }
double TimingSpan::wait_seconds(std::string_view) const { fail_unavailable(device_); }

Stream& current_stream(int device) { fail_unavailable(device); }

StreamGuard::StreamGuard(Stream& stream) : previous_(nullptr), device_(stream.device()) {
  fail_unavailable(device_);
}
StreamGuard::~StreamGuard() = default;  // never reached: no Stream exists to guard

void copy_bytes(void*, bool, const void*, bool, std::size_t, int device) { fail_unavailable(device); }

Allocator& device_allocator(int index) { fail_unavailable(index); }
Allocator& pinned_host_allocator() { fail("pinned host memory needs a usable GPU: {}", kReason); }
void copy_to_device_async(void*, const void*, std::size_t, int device) { fail_unavailable(device); }
void copy_to_host_async(void*, const void*, std::size_t, const Stream& stream) {
  fail_unavailable(stream.device());
}
void record_stream(void*, const Stream& stream) { fail_unavailable(stream.device()); }

}  // namespace cuda
}  // namespace shardlab
