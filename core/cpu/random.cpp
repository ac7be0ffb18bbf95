// core/cpu/random.cpp: fills a contiguous tensor from Philox draws (core/philox.h); the same
// functions run in the CUDA kernel, so both devices produce identical bits.
#include "core/cpu/kernels.h"
#include "core/parallel.h"
#include "core/philox.h"

namespace shardlab::cpu {

void random(const RandomSpec& spec, const Tensor& out) {
  const std::uint64_t seed = spec.key.seed, stream = spec.key.stream;
  const auto first_index = static_cast<std::uint64_t>(spec.first_index);
  visit_dtype(out.dtype(), [&]<typename T>() {
    T* data = static_cast<T*>(out.raw_data());
    // 24-bit draws take word index % 4 of Philox block index / 4: compute each block once.
    const bool four_per_block = spec.distribution == Distribution::bernoulli ||
                                (spec.distribution == Distribution::uniform && out.dtype() != DType::f64);
    parallel_for(0, out.numel(), 4096, [&](std::int64_t first, std::int64_t last) {
      philox::Block block{};
      std::uint64_t block_index = ~0ull;
      for (std::int64_t i = first; i < last; ++i) {
        const std::uint64_t index = first_index + static_cast<std::uint64_t>(i);
        double value = 0;
        if (four_per_block) {
          if (index / 4 != block_index) {
            block_index = index / 4;
            block = philox::generate(seed, stream, block_index);
          }
          value = spec.distribution == Distribution::uniform
                      ? philox::uniform24_in_block(block, index, spec.a, spec.b)
                      : (philox::bernoulli_in_block(block, index, spec.a) ? 1.0 : 0.0);
        } else if (spec.distribution == Distribution::uniform) {
          value = philox::uniform53(seed, stream, index, spec.a, spec.b);
        } else {
          value = philox::normal(seed, stream, index, spec.a, spec.b);
        }
        data[i] = narrow<T>(value);
      }
    });
  });
}

}  // namespace shardlab::cpu
