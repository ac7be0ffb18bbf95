// apps/bench_ops: GEMM and conv2d throughput of shardlab's kernels next to OpenBLAS's own
// sgemm on the same shapes (and CUDA next to it when a GPU and a kernel exist), one table.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda/runtime.h"
#include "core/kernels.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/random.h"

using namespace shardlab;

namespace {

// Median seconds of `reps` runs after one warm-up; `sync` waits for asynchronous devices.
double median_seconds(int reps, const std::function<void()>& run, const std::function<void()>& sync) {
  run();
  sync();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    sync();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
  return times[reps / 2];
}

// OpenBLAS sgemm on row-major [m, k] x [k, n], our baseline for both tables.
double openblas_seconds(int reps, std::int64_t m, std::int64_t n, std::int64_t k) {
  const Tensor a = uniform({m, k}, {1, 1}), b = uniform({k, n}, {1, 2}), c = empty({m, n});
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* pc = c.data<float>();
  return median_seconds(
      reps,
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                    static_cast<int>(k), 1.0f, pa, static_cast<int>(k), pb, static_cast<int>(n), 0.0f, pc,
                    static_cast<int>(n));
      },
      [] {});
}

struct Row {
  std::string name;
  double flops;
  std::function<void(Device)> run;
  std::int64_t m, n, k;  // the equivalent GEMM for the OpenBLAS column
};

void print_row(const Row& row, int reps, bool with_cuda) {
  const double ours = median_seconds(
      reps, [&] { row.run(Device::cpu()); }, [] {});
  const double blas = openblas_seconds(reps, row.m, row.n, row.k);
  std::string cuda_column = "-";
  if (with_cuda) {
    if (supports<&Kernels::matmul>(Device::cuda(0)) && supports<&Kernels::conv2d>(Device::cuda(0))) {
      cuda::Stream& stream = cuda::current_stream(0);
      const double gpu = median_seconds(
          reps, [&] { row.run(Device::cuda(0)); }, [&] { stream.synchronize(); });
      cuda_column = fmt::format("{:.1f}", row.flops / gpu / 1e9);
    } else {
      cuda_column = "no kernel yet";
    }
  }
  fmt::print("{:<44} {:>12.1f} {:>14.1f} {:>8.2f} {:>16}\n", row.name, row.flops / ours / 1e9,
             row.flops / blas / 1e9, blas / ours, cuda_column);
}

Row gemm_row(std::int64_t m, std::int64_t n, std::int64_t k) {
  return {fmt::format("matmul [{}, {}] x [{}, {}]", m, k, k, n),
          2.0 * m * n * k,
          [=](Device d) {
            static thread_local Tensor a, b;
            if (!a.defined() || a.device() != d || a.shape() != Shape{m, k}) {
              a = uniform({m, k}, {7, 1}, -1, 1, device(d));
              b = uniform({k, n}, {7, 2}, -1, 1, device(d));
            }
            (void)matmul(a, b);
          },
          m,
          n,
          k};
}

Row conv_row(const std::string& label, Shape input, Shape weight, Conv2dParams p) {
  const std::int64_t oh = (input[2] + 2 * p.padding - weight[2]) / p.stride + 1;
  const std::int64_t ow = (input[3] + 2 * p.padding - weight[3]) / p.stride + 1;
  const std::int64_t patch = weight[1] * weight[2] * weight[3], columns = input[0] * oh * ow;
  return {fmt::format("conv2d {} {}x{}", label, shape_str(input), shape_str(weight)),
          2.0 * weight[0] * patch * columns,
          [=](Device d) {
            static thread_local Tensor x, w;
            if (!x.defined() || x.device() != d || x.shape() != input) {
              x = uniform(input, {9, 1}, -1, 1, device(d));
              w = uniform(weight, {9, 2}, -1, 1, device(d));
            }
            (void)conv2d(x, w, {}, p);
          },
          weight[0],
          columns,
          patch};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_ops: GEMM and conv2d GFLOP/s of shardlab next to OpenBLAS sgemm"};
  int reps = 5;
  int threads = 0;
  app.add_option("--reps", reps, "timed repetitions per row (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "CPU threads (default: the cores this process has)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (threads > 0) set_num_threads(threads);
    const bool with_cuda = cuda::available();
    fmt::print("bench_ops: {} CPU threads; CUDA: {}\n", num_threads(),
               with_cuda ? "available" : cuda::unavailable_reason());
    fmt::print("{:<44} {:>12} {:>14} {:>8} {:>16}\n", "op (f32)", "ours GFLOP/s", "OpenBLAS GF/s", "ratio",
               "CUDA GFLOP/s");
    const std::vector<Row> rows = {
        gemm_row(256, 256, 256),
        gemm_row(512, 512, 512),
        gemm_row(1024, 1024, 1024),
        gemm_row(2048, 512, 2048),
        gemm_row(64, 128, 9216),
        conv_row("mnist conv1", {64, 1, 28, 28}, {32, 1, 3, 3}, {}),
        conv_row("mnist conv2", {64, 32, 26, 26}, {64, 32, 3, 3}, {}),
        conv_row("resnet 3x3", {8, 64, 56, 56}, {64, 64, 3, 3}, {1, 1}),
        conv_row("stride 2", {8, 64, 56, 56}, {128, 64, 3, 3}, {2, 1}),
    };
    for (const Row& row : rows) print_row(row, reps, with_cuda);
    fmt::print(
        "ratio = OpenBLAS time / ours on the same GEMM shape (conv: O x C*KH*KW x N*OH*OW); "
        "1.00 means parity\n");
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_ops: {}\n", e.what());
    return 1;
  }
  return 0;
}
