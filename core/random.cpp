// core/random.cpp: random tensor factories over the device's Philox kernel.
#include "core/random.h"

#include "core/call_log.h"
#include "core/kernels.h"
#include "core/profile.h"

namespace shardlab {
namespace {

Tensor draw(const char* op, const Shape& shape, const RandomSpec& spec, TensorOptions options,
            bool floating_only) {
  SHARDLAB_CHECK(!floating_only || is_floating(options.dtype), "{}: needs a floating dtype, got {}", op,
                 dtype_name(options.dtype));
  SHARDLAB_CHECK(spec.first_index >= 0, "{}: first_index must be non-negative, got {}", op, spec.first_index);
  Tensor out = empty(shape, options);
  fill_random(out, spec);
  return out;
}

}  // namespace

void fill_random(const Tensor& out, const RandomSpec& spec) {
  SHARDLAB_CHECK(out.is_contiguous(), "fill_random: output must be contiguous, got shape {} strides {}",
                 shape_str(out.shape()), shape_str(out.strides()));
  SHARDLAB_CHECK(spec.first_index >= 0, "fill_random: first_index must be non-negative, got {}",
                 spec.first_index);
  const auto rows = static_cast<std::int64_t>(spec.row_first_indices.size());
  if (rows > 0) {
    SHARDLAB_CHECK(out.numel() % rows == 0, "fill_random: {} rows do not divide the output's {} elements (shape {})",
                   rows, out.numel(), shape_str(out.shape()));
    SHARDLAB_CHECK(spec.first_index == 0,
                   "fill_random: first_index {} and row_first_indices both place the draws; give one",
                   spec.first_index);
    for (std::int64_t r = 0; r < rows; ++r) {
      SHARDLAB_CHECK(spec.row_first_indices[static_cast<std::size_t>(r)] >= 0,
                     "fill_random: row {} starts at draw {}; draw numbers are non-negative", r,
                     spec.row_first_indices[static_cast<std::size_t>(r)]);
    }
  }
  if (out.numel() == 0) return;
  const auto fn = kernels_for(out.device()).random;
  SHARDLAB_CHECK(fn != nullptr, "fill_random: not supported on {} (no kernel for it in this build)",
                 out.device().str());
  const call_log::Scope logged("random", out.device(), out);
  const profile::KernelTimer timer("random", out.device());
  fn(spec, out);
}

Tensor uniform(const Shape& shape, RandomKey key, double low, double high, TensorOptions options,
               std::int64_t first_index) {
  SHARDLAB_CHECK(low <= high, "uniform: low {} is above high {}", low, high);
  return draw("uniform", shape, RandomSpec{Distribution::uniform, key, low, high, first_index}, options,
              true);
}

Tensor normal(const Shape& shape, RandomKey key, double mean, double std, TensorOptions options,
              std::int64_t first_index) {
  SHARDLAB_CHECK(std >= 0, "normal: std must be non-negative, got {}", std);
  return draw("normal", shape, RandomSpec{Distribution::normal, key, mean, std, first_index}, options, true);
}

Tensor bernoulli(const Shape& shape, RandomKey key, double p, TensorOptions options,
                 std::int64_t first_index) {
  SHARDLAB_CHECK(p >= 0 && p <= 1, "bernoulli: p must be in [0, 1], got {}", p);
  return draw("bernoulli", shape, RandomSpec{Distribution::bernoulli, key, p, 0.0, first_index}, options,
              false);
}

std::span<const OpInfo> random_ops() {
  static constexpr OpInfo ops[] = {{"random", OpCategory::elementwise, "Philox counter per element"}};
  return ops;
}

}  // namespace shardlab
