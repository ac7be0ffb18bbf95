// tests/core/test_transpose.cpp: the CPU's transposed block copy puts every element where a naive
// loop does, on every instruction set this processor runs, and writes nothing else.
#include <cstdint>
#include <vector>

#include "core/cpu/isa.h"
#include "core/cpu/transpose.h"
#include "tests/check.h"
#include "tests/core/runnable_isas.h"

using namespace shardlab;

namespace {

template <typename T>
void check_transpose() {
  const cpu::Isa kept = cpu::kernel_isa();
  // Sizes below, at and past the 8 x 8 register blocks, with strides wider than the block.
  for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 1}, {3, 5}, {8, 8}, {9, 17}, {16, 24}, {32, 150}, {6, 150}}) {
    const std::int64_t from_stride = cols + 3, to_stride = rows + 5;
    std::vector<T> from(rows * from_stride);
    for (std::size_t i = 0; i < from.size(); ++i) from[i] = static_cast<T>(i) + T(0.25);
    std::vector<T> expected(cols * to_stride, T(-1));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) expected[c * to_stride + r] = from[r * from_stride + c];
    }
    for (const cpu::Isa isa : test::runnable_isas()) {
      cpu::set_kernel_isa(isa);
      std::vector<T> to(cols * to_stride, T(-1));
      cpu::transpose_block(from.data(), from_stride, rows, cols, to.data(), to_stride);
      INFO(rows << " x " << cols << ", " << cpu::isa_name(isa));
      CHECK(to == expected);  // the gaps between rows of `to` keep their -1
    }
  }
  cpu::set_kernel_isa(kept);
}

TEST_CASE("A transposed block copy puts each element where the naive loop does", "[transpose]") {
  check_transpose<float>();
  check_transpose<double>();
}

}  // namespace
