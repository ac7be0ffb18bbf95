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
    parallel_for(0, out.numel(), 4096, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t i = first; i < last; ++i) {
        const std::uint64_t index = first_index + static_cast<std::uint64_t>(i);
        double value = 0;
        switch (spec.distribution) {
          case Distribution::uniform:
            value = out.dtype() == DType::f64 ? philox::uniform53(seed, stream, index, spec.a, spec.b)
                                              : philox::uniform24(seed, stream, index, spec.a, spec.b);
            break;
          case Distribution::normal:
            value = philox::normal(seed, stream, index, spec.a, spec.b);
            break;
          case Distribution::bernoulli:
            value = philox::bernoulli(seed, stream, index, spec.a) ? 1.0 : 0.0;
            break;
        }
        data[i] = narrow<T>(value);
      }
    });
  });
}

}  // namespace shardlab::cpu
