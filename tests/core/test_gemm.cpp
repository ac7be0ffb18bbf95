// tests/core/test_gemm.cpp: the CPU GEMM gives, bit for bit, a naive loop of fused multiply-adds
// in k's order, on every instruction set this processor runs, any thread count and any layout.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cpu/gemm.h"
#include "core/cpu/isa.h"
#include "core/parallel.h"
#include "tests/check.h"
#include "tests/core/runnable_isas.h"

using namespace shardlab;
using cpu::Isa;

namespace {

// Restores the instruction set and thread count in use when the test ends, failed or not.
struct KeepSettings {
  Isa isa = cpu::kernel_isa();
  int threads = num_threads();
  ~KeepSettings() {
    cpu::set_kernel_isa(isa);
    set_num_threads(threads);
  }
};

// How an operand is stored: row-major with its own row length, row-major in rows of 2 KiB (which
// the GEMM packs rather than reading in place), transposed, or every other element of a row.
enum class Storage { row_major, rows_of_2k, transposed, every_other };

const char* storage_name(Storage s) {
  switch (s) {
    case Storage::row_major:
      return "row-major";
    case Storage::rows_of_2k:
      return "rows of 2 KiB";
    case Storage::transposed:
      return "transposed";
    case Storage::every_other:
      return "every other element";
  }
  return "?";
}

// A [rows, cols] matrix of small random values (ties and cancellations included) in `storage`.
template <typename T>
struct Operand {
  std::vector<T> buffer;
  cpu::MatrixView<T> view;

  Operand(std::int64_t rows, std::int64_t cols, Storage storage, std::uint64_t seed) {
    std::int64_t row_stride = cols, col_stride = 1;
    const std::int64_t row_2k = 2048 / static_cast<std::int64_t>(sizeof(T));
    if (storage == Storage::rows_of_2k) row_stride = (cols + row_2k - 1) / row_2k * row_2k;
    if (storage == Storage::transposed) row_stride = 1, col_stride = rows;
    if (storage == Storage::every_other) row_stride = 2 * cols, col_stride = 2;
    const std::int64_t extent =
        std::max<std::int64_t>(1, (rows - 1) * row_stride + (cols - 1) * col_stride + 1);
    const std::vector<double> values =
        test::values(test::random_tensor({extent}, seed, DType::f64, -2.0, 2.0));
    for (const double v : values) buffer.push_back(static_cast<T>(std::round(v * 64) / 64 + v * 1e-3));
    view = {buffer.data(), row_stride, col_stride};
  }
  T at(std::int64_t r, std::int64_t c) const { return view.data[r * view.row_stride + c * view.col_stride]; }
};

// C = (accumulate ? C : 0) + A B with std::fma, k in order: what the GEMM promises bit for bit.
template <typename T>
std::vector<T> naive_fma(const Operand<T>& a, const Operand<T>& b, std::int64_t m, std::int64_t n,
                         std::int64_t k, std::vector<T> c, bool accumulate) {
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      T sum = accumulate ? c[i * n + j] : T(0);
      for (std::int64_t p = 0; p < k; ++p) sum = std::fma(a.at(i, p), b.at(p, j), sum);
      c[i * n + j] = sum;
    }
  }
  return c;
}

// Every storage of A and B, both modes, every instruction set, 1 and 3 threads, on shapes whose
// edges cut the tiles of every set and whose k spans several depth blocks.
template <typename T>
void check_against_naive(const std::vector<std::array<std::int64_t, 3>>& shapes) {
  KeepSettings keep;
  for (const auto& [m, n, k] : shapes) {
    for (const Storage sa :
         {Storage::row_major, Storage::rows_of_2k, Storage::transposed, Storage::every_other}) {
      for (const Storage sb : {Storage::row_major, Storage::transposed, Storage::every_other}) {
        const Operand<T> a(m, k, sa, 1), b(k, n, sb, 2);
        const Operand<T> start(m, n, Storage::row_major, 3);
        for (const bool accumulate : {false, true}) {
          const std::vector<T> expected = naive_fma(a, b, m, n, k, start.buffer, accumulate);
          for (const Isa isa : test::runnable_isas()) {
            cpu::set_kernel_isa(isa);
            for (const int threads : {1, 3}) {
              set_num_threads(threads);
              std::vector<T> c = start.buffer;
              cpu::gemm<T>(m, n, k, a.view, b.view, c.data(), n, accumulate);
              INFO("m=" << m << " n=" << n << " k=" << k << " A " << storage_name(sa) << ", B "
                        << storage_name(sb) << (accumulate ? ", accumulating" : "") << ", "
                        << cpu::isa_name(isa) << ", " << threads << " threads");
              CHECK(c == expected);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("GEMM in f32 has the bits of a naive fused multiply-add loop everywhere", "[gemm]") {
  // Rows 1, 13, 37, 130 and columns 1, 33, 70 cut the tiles (12 x 32, 6 x 16, 4 x 4); k = 300 and
  // 600 span two and three depth blocks (at most 256 steps each); 130 x 70 x 600 is split over the threads.
  check_against_naive<float>({{1, 1, 1}, {13, 33, 7}, {37, 70, 300}, {130, 70, 600}});
}

TEST_CASE("GEMM in f64 has the bits of a naive fused multiply-add loop everywhere", "[gemm]") {
  // Depth blocks of 128 in f64: k = 300 spans three; tiles of 12 x 16, 6 x 8, 4 x 4.
  check_against_naive<double>({{1, 1, 1}, {29, 17, 300}, {70, 41, 130}});
}

TEST_CASE("GEMM with k = 0 writes zeros, or leaves C as it was when accumulating", "[gemm]") {
  const Operand<float> a(5, 1, Storage::row_major, 4), b(1, 7, Storage::row_major, 5);
  std::vector<float> c(35, 2.5f);
  cpu::gemm<float>(5, 7, 0, a.view, b.view, c.data(), 7, true);
  CHECK(c == std::vector<float>(35, 2.5f));
  cpu::gemm<float>(5, 7, 0, a.view, b.view, c.data(), 7, false);
  CHECK(c == std::vector<float>(35, 0.0f));
}

TEST_CASE("GEMM leaves C past its columns alone (leading dimension wider than n)", "[gemm]") {
  // 13 x 33 into rows of 40: the right-edge tile and the 7 columns after it.
  const Operand<float> a(13, 9, Storage::row_major, 6), b(9, 33, Storage::row_major, 7);
  std::vector<float> c(13 * 40, -7.0f);
  cpu::gemm<float>(13, 33, 9, a.view, b.view, c.data(), 40, false);
  const std::vector<float> expected = naive_fma(a, b, 13, 33, 9, std::vector<float>(13 * 33, 0.0f), false);
  for (std::int64_t i = 0; i < 13; ++i) {
    for (std::int64_t j = 0; j < 40; ++j) {
      INFO("row " << i << ", column " << j);
      CHECK(c[i * 40 + j] == (j < 33 ? expected[i * 33 + j] : -7.0f));
    }
  }
}

}  // namespace
