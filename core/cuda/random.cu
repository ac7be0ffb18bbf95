// core/cuda/random.cu: the random-fill kernel: uniform, normal and Bernoulli draws from the
// Philox maps of core/philox.h, so every element has the bits the CPU kernel gives it; and its entry.
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/launch.h"
#include "core/philox.h"

namespace shardlab::cuda {
namespace {

// What a random kernel draws: element i of the output is draw number first_index + i of Philox
// stream (seed, stream) (core/philox.h), or, where row_first_indices is given (in device memory),
// element c of row r (rows of row_size) draw number row_first_indices[r] + c. a, b: uniform low
// and high, normal mean and std, bernoulli p (b unused).
struct PhiloxDraw {
  Distribution kind = Distribution::uniform;
  std::uint64_t seed = 0;
  std::uint64_t stream = 0;
  std::uint64_t first_index = 0;
  double a = 0.0;
  double b = 1.0;
  const std::int64_t* row_first_indices = nullptr;
  std::int64_t row_size = 0;
};

__device__ std::uint64_t draw_number(const PhiloxDraw& draw, std::int64_t i) {
  if (draw.row_first_indices == nullptr) return draw.first_index + static_cast<std::uint64_t>(i);
  const std::int64_t row = i / draw.row_size;
  return static_cast<std::uint64_t>(draw.row_first_indices[row] + (i - row * draw.row_size));
}

// The draw of element `index` as a double, exactly as core/cpu/random.cpp computes it.
template <typename T>
__device__ double draw_value(const PhiloxDraw& draw, std::uint64_t index) {
  switch (draw.kind) {
    case Distribution::uniform:
      if constexpr (std::is_same_v<T, double>) {
        return philox::uniform53(draw.seed, draw.stream, index, draw.a, draw.b);
      } else {
        return philox::uniform24(draw.seed, draw.stream, index, draw.a, draw.b);
      }
    case Distribution::normal:
      return philox::normal(draw.seed, draw.stream, index, draw.a, draw.b);
    case Distribution::bernoulli:
      return philox::bernoulli(draw.seed, draw.stream, index, draw.a) ? 1.0 : 0.0;
  }
  __builtin_unreachable();  // every enumerator is handled above
}

template <typename T>
__global__ void random_kernel(T* out, std::int64_t n, PhiloxDraw draw) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    out[i] = narrow<T>(draw_value<T>(draw, draw_number(draw, i)));
  }
}

// Fills n contiguous elements of any dtype like the CPU kernel: the double that philox::uniform24
// (uniform53 for f64), philox::normal or philox::bernoulli (1 or 0) gives, narrowed to the dtype.
void launch_random(DType dtype, void* out, std::int64_t n, const PhiloxDraw& draw, cudaStream_t stream) {
  if (n == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    random_kernel<T><<<grid_size(n), kBlockSize, 0, stream>>>(static_cast<T*>(out), n, draw);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// --- entries --------------------------------------------------------------------------------------

void cuda_random(const RandomSpec& spec, const Tensor& out) {
  SHARDLAB_CHECK(out.is_contiguous(), "random draws on cuda: the output must be contiguous");
  const LaunchContext context(out);
  PhiloxDraw draw{spec.distribution, spec.key.seed, spec.key.stream, static_cast<std::uint64_t>(spec.first_index),
                  spec.a, spec.b};
  Tensor rows_table;  // holds the rows' table on the device until the launch is queued
  const auto& rows = spec.row_first_indices;
  if (!rows.empty()) {
    draw.row_first_indices =
        static_cast<const std::int64_t*>(upload_into(rows_table, out.device())(rows.data(), rows.size_bytes()));
    draw.row_size = out.numel() / static_cast<std::int64_t>(rows.size());
  }
  launch_random(out.dtype(), out.raw_data(), out.numel(), draw, context.stream());
}

}  // namespace

RandomKernels random_kernels() { return {.random = cuda_random}; }

}  // namespace shardlab::cuda
