// core/device.cpp: parsing and printing devices, and the device a program is asked to run on.
#include "core/device.h"

#include <charconv>
#include <mutex>
#include <utility>

#include "core/cuda/runtime.h"
#include "core/error.h"

namespace shardlab {

Device Device::parse(std::string_view text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.starts_with("cuda:")) {
    const std::string_view digits = text.substr(5);
    int index = -1;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (error == std::errc() && end == digits.data() + digits.size() && index >= 0 && !digits.empty()) {
      return cuda(index);
    }
  }
  fail("device: cannot parse '{}' (expected cpu, cuda or cuda:N)", text);
}

DeviceChoice parse_device_choice(std::string_view text) {
  if (text == "auto") return DeviceChoice::automatic;
  if (text == "cpu") return DeviceChoice::cpu;
  if (text == "cuda") return DeviceChoice::cuda;
  fail("device: '{}' is not a device choice (expected auto, cpu or cuda)", text);
}

Device device_for(DeviceChoice choice) {
  if (choice == DeviceChoice::cpu) return Device::cpu();
  if (cuda::available()) return Device::cuda(0);
  SHARDLAB_CHECK(choice == DeviceChoice::automatic, "device cuda was requested but {}",
                 cuda::unavailable_reason());
  return Device::cpu();
}

std::string Device::str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }

namespace {
std::mutex binder_mutex;
ThreadBinder binder;  // empty: the real binding
}  // namespace

void bind_thread_to_device(Device device) {
  ThreadBinder replaced;
  {
    const std::lock_guard lock(binder_mutex);
    replaced = binder;
  }
  if (replaced) {
    replaced(device);
  } else if (device.is_cuda()) {
    cuda::set_current_device(device.index);
  }
}

ThreadBinder replace_thread_binder(ThreadBinder replacement) {
  const std::lock_guard lock(binder_mutex);
  return std::exchange(binder, std::move(replacement));
}

}  // namespace shardlab
