// core/random.h: counter-based random tensors (Philox4x32-10, core/philox.h).
//
// A draw is named by RandomKey{seed, stream}; element i of the tensor is draw number
// first_index + i. So a rank can generate elements [r*S, (r+1)*S) of a parameter alone,
// with first_index = r*S, and get exactly those elements of the full tensor, on any device.
#pragma once

#include <cstdint>
#include <span>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

enum class Distribution : unsigned char { uniform, normal, bernoulli };

struct RandomKey {
  std::uint64_t seed = 0;
  std::uint64_t stream = 0;
};

struct RandomSpec {
  Distribution distribution = Distribution::uniform;
  RandomKey key;
  double a = 0.0;  // uniform: low;  normal: mean; bernoulli: p
  double b = 1.0;  // uniform: high; normal: std
  std::int64_t first_index = 0;
  // Where not empty, out is row_first_indices.size() rows of equal length and element c of row r
  // is draw number row_first_indices[r] + c (first_index must then be 0): rows drawn at offsets of
  // their own in one kernel call, e.g. a shuffled batch's dropout masks at their samples' indices.
  std::span<const std::int64_t> row_first_indices;
};

// Uniform on [low, high). f32/bf16/f16 use 24 random bits per element, f64 uses 53.
Tensor uniform(const Shape& shape, RandomKey key, double low = 0.0, double high = 1.0,
               TensorOptions options = {}, std::int64_t first_index = 0);
Tensor normal(const Shape& shape, RandomKey key, double mean = 0.0, double std = 1.0,
              TensorOptions options = {}, std::int64_t first_index = 0);
// 1 with probability p, else 0, in options.dtype (bool allowed).
Tensor bernoulli(const Shape& shape, RandomKey key, double p, TensorOptions options = {},
                 std::int64_t first_index = 0);
// Fills a contiguous tensor in place with the draws of `spec`.
void fill_random(const Tensor& out, const RandomSpec& spec);

// The random draws' kernel entry: out is contiguous; element i receives draw number first_index + i,
// or element c of row r draw number row_first_indices[r] + c where the spec names rows.
struct RandomKernels {
  void (*random)(const RandomSpec& spec, const Tensor& out);
};
// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> random_ops();

// The entry on each device: core/cpu/random.cpp, core/cuda/random.cu.
namespace cpu {
RandomKernels random_kernels();
}
namespace cuda {
RandomKernels random_kernels();
}

}  // namespace shardlab
