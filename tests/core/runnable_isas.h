// tests/core/runnable_isas.h: the CPU instruction sets this processor runs, for the tests that
// compare the kernels compiled for each.
#pragma once

#include <vector>

#include "core/cpu/isa.h"

namespace shardlab::test {

inline std::vector<cpu::Isa> runnable_isas() {
  std::vector<cpu::Isa> isas;
  for (const cpu::Isa isa : {cpu::Isa::baseline, cpu::Isa::avx2, cpu::Isa::avx512})
    if (isa <= cpu::widest_isa()) isas.push_back(isa);
  return isas;
}

}  // namespace shardlab::test
