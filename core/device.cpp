// core/device.cpp: parsing and printing devices.
#include "core/device.h"

#include <charconv>

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

std::string Device::str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }

}  // namespace shardlab
