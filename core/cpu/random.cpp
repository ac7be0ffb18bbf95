// core/cpu/random.cpp: fills a contiguous tensor from Philox draws (core/philox.h); the same
// functions run in the CUDA kernel, so both devices produce identical bits.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/cpu/isa.h"
#include "core/cpu/kernels.h"
#include "core/parallel.h"
#include "core/philox.h"

namespace shardlab::cpu {
namespace {

// f32 Bernoulli draws of `blocks` whole Philox blocks from `first_block` on (4 values each), in a
// loop built for AVX-512, AVX2 and the baseline (core/cpu/isa.h). A value is 1 when its word's top
// 24 bits are below `threshold`, which is philox::bernoulli's (word >> 8) * 2^-24 < p in integers.
SHARDLAB_CPU_CLONES(void, bernoulli_blocks,
                    (std::uint64_t seed, std::uint64_t stream, std::uint64_t first_block, std::int64_t blocks,
                     std::uint32_t threshold, float* out),
                    (seed, stream, first_block, blocks, threshold, out)) {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const philox::Block block = philox::generate(seed, stream, first_block + static_cast<std::uint64_t>(b));
    for (int word = 0; word < 4; ++word)
      out[4 * b + word] = (block.word[word] >> 8) < threshold ? 1.0f : 0.0f;
  }
}

// The integers x in [0, 2^24) with x * 2^-24 < p: those below ceil(p * 2^24) (exact in double).
std::uint32_t bernoulli_threshold(double p) {
  return static_cast<std::uint32_t>(std::clamp(std::ceil(p * 16777216.0), 0.0, 16777216.0));
}

// Fills out[0, count) with draws number start, start + 1, ... of spec's distribution.
template <typename T>
void fill_run(const RandomSpec& spec, T* out, std::int64_t count, std::uint64_t start) {
  const std::uint64_t seed = spec.key.seed, stream = spec.key.stream;
  if constexpr (std::is_same_v<T, float>) {
    if (spec.distribution == Distribution::bernoulli) {
      // The whole blocks in the middle in one go; the elements before and after them one by one.
      const std::int64_t head = std::min<std::int64_t>(count, static_cast<std::int64_t>((4 - start % 4) % 4));
      const std::int64_t blocks = (count - head) / 4;
      bernoulli_blocks(seed, stream, (start + static_cast<std::uint64_t>(head)) / 4, blocks,
                       bernoulli_threshold(spec.a), out + head);
      const auto draw = [&](std::int64_t k) {
        out[k] = philox::bernoulli(seed, stream, start + static_cast<std::uint64_t>(k), spec.a) ? 1.0f : 0.0f;
      };
      for (std::int64_t k = 0; k < head; ++k) draw(k);
      for (std::int64_t k = head + 4 * blocks; k < count; ++k) draw(k);
      return;
    }
  }
  // 24-bit draws take word index % 4 of Philox block index / 4: compute each block once.
  const bool four_per_block = spec.distribution == Distribution::bernoulli ||
                              (spec.distribution == Distribution::uniform && !std::is_same_v<T, double>);
  philox::Block block{};
  std::uint64_t block_index = ~0ull;
  for (std::int64_t k = 0; k < count; ++k) {
    const std::uint64_t index = start + static_cast<std::uint64_t>(k);
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
    out[k] = narrow<T>(value);
  }
}

// Without row_first_indices the whole tensor is one row drawn from first_index on.
void random(const RandomSpec& spec, const Tensor& out) {
  const auto& rows = spec.row_first_indices;
  const std::int64_t row_size = rows.empty() ? out.numel() : out.numel() / static_cast<std::int64_t>(rows.size());
  const auto row_start = [&](std::int64_t r) {
    return static_cast<std::uint64_t>(rows.empty() ? spec.first_index : rows[static_cast<std::size_t>(r)]);
  };
  visit_dtype(out.dtype(), [&]<typename T>() {
    T* data = static_cast<T*>(out.raw_data());
    parallel_for(0, out.numel(), 4096, [&](std::int64_t first, std::int64_t last) {
      // A chunk's pieces in each row it meets.
      for (std::int64_t i = first; i < last;) {
        const std::int64_t row = i / row_size, end = std::min(last, (row + 1) * row_size);
        fill_run(spec, data + i, end - i, row_start(row) + static_cast<std::uint64_t>(i - row * row_size));
        i = end;
      }
    });
  });
}

}  // namespace

RandomKernels random_kernels() { return {.random = random}; }

}  // namespace shardlab::cpu
