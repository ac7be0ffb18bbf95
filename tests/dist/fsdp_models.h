// tests/dist/fsdp_models.h: the small nested model of the FSDP tests (an embedding, a
// ModuleList of residual MLP blocks whose parameter counts divide by none of 2, 3, 4, with
// dropout if asked, and a head) and a deterministic stream of global batches for it.
#pragma once

#include <cstdint>
#include <vector>

#include "autograd/functional.h"
#include "nn/layers.h"

namespace shardlab::test {

inline constexpr std::int64_t kGlobalBatch = 12;  // divides by 1, 2, 3, 4
inline constexpr std::uint64_t kSeed = 7;

// x + down(dropout(relu(up(x)))): 15 * hidden + 7 parameters (247 for hidden 16, 277 for 18).
// Dropout 0 (the default) passes its input through untouched.
class BlockImpl : public nn::Module {
 public:
  explicit BlockImpl(std::int64_t hidden, double dropout = 0.0)
      : nn::Module("Block"),
        up(nn::LinearOptions(7, hidden)),
        drop(dropout),
        down(nn::LinearOptions(hidden, 7)) {
    register_module("up", up.ptr());
    register_module("drop", drop.ptr());
    register_module("down", down.ptr());
  }
  Variable operator()(const Variable& x) {
    return with_hooks([&](const Variable& input) { return add(input, down(drop(relu(up(input))))); }, x);
  }
  nn::Linear up;
  nn::Dropout drop;
  nn::Linear down;
};

// tokens [B] -> logits [B, vocab].
class NestedImpl : public nn::Module {
 public:
  NestedImpl(std::int64_t vocab, std::uint64_t seed, double dropout = 0.0)
      : nn::Module("Nested"), embed(vocab, 7), head(nn::LinearOptions(7, vocab)) {
    register_module("embed", embed.ptr());
    register_module("blocks", blocks.ptr());
    register_module("head", head.ptr());
    for (const std::int64_t hidden : {16, 18, 16})
      blocks->push_back(std::make_shared<BlockImpl>(hidden, dropout));
    nn::initialize(*this, seed);
  }
  Variable operator()(const Tensor& tokens) {
    return with_hooks(
        [&](const Tensor& input) {
          Variable x = embed(input);
          for (const auto& block : *blocks) x = (*block)(x);
          return head(x);
        },
        tokens);
  }
  nn::Embedding embed;
  nn::ModuleList<BlockImpl> blocks;
  nn::Linear head;
};
using Nested = nn::Holder<NestedImpl>;

// Step k's global batch of `size` tokens and targets; rank r of w takes rows r, r + w, ...
struct TokenBatch {
  Tensor tokens, targets;
};
inline TokenBatch token_batch(std::int64_t step, std::int64_t size, std::int64_t vocab, int rank = 0,
                              int world = 1) {
  std::vector<std::int64_t> tokens, targets;
  for (std::int64_t i = rank; i < size; i += world) {
    const std::int64_t token = (step * 31 + i * 7 + 3) % vocab;
    tokens.push_back(token);
    targets.push_back((token * 5 + step + 1) % vocab);
  }
  const auto rows = static_cast<std::int64_t>(tokens.size());
  return {from_vector(tokens, {rows}), from_vector(targets, {rows})};
}

}  // namespace shardlab::test
