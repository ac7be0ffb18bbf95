// tests/fuzz/fuzzer.cpp: the libFuzzer entry point, built once per target (tests/fuzz/meson.build)
// with SHARDLAB_FUZZ_TARGET naming its function in tests/fuzz/targets.h.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  shardlab::fuzz::SHARDLAB_FUZZ_TARGET(data, size);
  return 0;
}
