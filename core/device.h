// core/device.h: where a tensor lives: the CPU or one CUDA device.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace shardlab {

enum class DeviceType : unsigned char { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  // Parses "cpu", "cuda" and "cuda:N"; throws Error naming the text otherwise.
  static Device parse(std::string_view text);

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string str() const;  // "cpu", "cuda:1"
  bool operator==(const Device&) const = default;
};

// What a program is asked to run on (--device): automatic takes a GPU where one answers (in a
// job of several processes, where every rank has one), else the CPU.
enum class DeviceChoice : unsigned char { automatic, cpu, cuda };

// Parses "auto", "cpu" and "cuda"; throws Error naming the text otherwise.
DeviceChoice parse_device_choice(std::string_view text);

// The device of a program of one process: cuda:0 for cuda, and for automatic where a GPU
// answers; the CPU otherwise. cuda where no GPU answers throws Error saying why.
Device device_for(DeviceChoice choice);

// Makes `device` the calling thread's current device. A helper thread (the collective watchdog, a
// communication worker, the host step thread) calls it first with its rank's device, so the CUDA
// calls it makes act on that GPU and never open a context on GPU 0, as a thread that chose no
// device would (each such context holds about 0.5 GB of GPU 0). A CPU device needs nothing.
void bind_thread_to_device(Device device);

// For tests: replaces what bind_thread_to_device does with `binder` (an empty one restores the
// real binding), so a test records which device each helper thread binds, with or without a GPU.
// Returns the binder it replaced.
using ThreadBinder = std::function<void(Device)>;
ThreadBinder replace_thread_binder(ThreadBinder binder);

}  // namespace shardlab
