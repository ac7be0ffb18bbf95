// apps/support/resident_memory.cpp: VmHWM from /proc/self/status.
#include "apps/support/resident_memory.h"

#include <fstream>
#include <sstream>
#include <string>

namespace shardlab::apps {

std::optional<std::int64_t> peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (!line.starts_with("VmHWM:")) continue;
    std::istringstream fields(line.substr(6));
    std::int64_t kilobytes = 0;
    std::string unit;
    if (fields >> kilobytes >> unit && unit == "kB") return kilobytes * 1024;
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace shardlab::apps
