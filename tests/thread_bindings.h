// tests/thread_bindings.h: while one lives, bind_thread_to_device (core/device.h) records which
// device each thread binds instead of binding it, so a test sees that a helper thread takes its
// rank's device, on machines with or without a GPU.
#pragma once

#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/device.h"

namespace shardlab::test {

class ThreadBindings {
 public:
  ThreadBindings()
      : replaced_(replace_thread_binder([this](Device device) {
          const std::lock_guard lock(mutex_);
          seen_.emplace_back(std::this_thread::get_id(), device);
        })) {}
  ~ThreadBindings() { replace_thread_binder(std::move(replaced_)); }
  ThreadBindings(const ThreadBindings&) = delete;
  ThreadBindings& operator=(const ThreadBindings&) = delete;

  // The devices bound by threads other than the calling one, in order.
  std::vector<Device> by_other_threads() const {
    const std::lock_guard lock(mutex_);
    std::vector<Device> devices;
    for (const auto& [thread, device] : seen_) {
      if (thread != std::this_thread::get_id()) devices.push_back(device);
    }
    return devices;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<std::thread::id, Device>> seen_;
  ThreadBinder replaced_;
};

}  // namespace shardlab::test
