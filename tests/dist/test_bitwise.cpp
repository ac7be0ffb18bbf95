// tests/dist/test_bitwise.cpp: FsdpOptions::bitwise under mpirun: the nested model trained on whole chunks
// of the global batch per rank (an uneven share where the chunks do not divide by the ranks) gets, at every
// sharding, the bits of the same training in one process: gradient norms (clip_grad_norm_exact), clipped
// gradients and parameters after AdamW steps.
// Without the mode, the same runs differ from one process in some bit (so the check can fail).
#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "autograd/batch_chunks.h"
#include "tests/dist/fsdp_parity.h"

namespace shardlab::test {
namespace {

constexpr std::int64_t kChunk = 2;  // 6 chunks: 6, 3/3, 2/2/2 and 2/2/1/1 per rank at np 1-4
constexpr int kSteps = 3;

// Rows [first, first + count) of the global batch that a rank of `ranks` holds: whole chunks, the first
// ranks one more where they do not divide.
struct Share {
  std::int64_t first = 0, count = 0;
};
Share share_of(int rank, int ranks) {
  const std::int64_t chunks = kGlobalBatch / kChunk, base = chunks / ranks, extra = chunks % ranks;
  const std::int64_t before = rank * base + std::min<std::int64_t>(rank, extra);
  return {before * kChunk, (base + (rank < extra ? 1 : 0)) * kChunk};
}

struct Trained {
  // Per step, this rank's piece of every parameter's gradient, with where it starts in the flat whole.
  std::vector<std::vector<std::pair<std::int64_t, Tensor>>> gradients;
  std::vector<double> norms;  // bitwise: clip_grad_norm_exact's, per step
  nn::Named<Tensor> parameters;
};

// Trains a nested model sharded over `communicator` with `options`, each rank on its share of every
// global batch, the loss a sum over the global batch's rows scaled by its size: bitwise, cut into
// chunks, as the reduction sums; else by the ranks too, as FSDP averages.
Trained train(dist::Communicator& communicator, dist::FsdpOptions options, std::int64_t vocab) {
  options.communicator = &communicator;
  Nested model(vocab, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
  optim::AdamW optimizer(dist::sharded_parameters(*model), {.lr = 1e-2});
  const Share share = share_of(communicator.rank(), communicator.size());
  Trained trained;
  for (int step = 0; step < kSteps; ++step) {
    const auto batch = token_batch(step, kGlobalBatch, vocab);
    optimizer.zero_grad();
    {
      std::optional<autograd::BatchChunking> chunking;
      if (options.bitwise) chunking.emplace(autograd::BatchChunks{.samples = share.count, .chunk = kChunk});
      const Variable logits = model(batch.tokens.narrow(0, share.first, share.count));
      const Variable losses =
          cross_entropy(logits, batch.targets.narrow(0, share.first, share.count), -100, Reduction::sum);
      const double ranks = options.bitwise ? 1.0 : communicator.size();
      mul(losses, ranks / static_cast<double>(kGlobalBatch)).backward();
    }
    if (options.bitwise)  // clipping too: max_norm under the first steps' norms
      trained.norms.push_back(optim::clip_grad_norm_exact(model->parameters(), 0.3).item<double>());
    auto& pieces = trained.gradients.emplace_back();
    for (const auto& [name, shard] : dist::sharded_parameters(*model)) {
      const Tensor grad = shard.grad().defined() ? shard.grad().clone() : zeros({0});
      pieces.emplace_back(shard.shard_info() != nullptr ? shard.shard_info()->first : 0, grad);
    }
    optimizer.step();
  }
  trained.parameters = dist::gather_full_parameters(*model);
  return trained;
}

// Elements of `actual` whose bits differ from those of `expected` from element `first` on.
std::int64_t differing_bits(const Tensor& actual, const Tensor& expected, std::int64_t first = 0) {
  const std::vector<float> got = actual.to_vector<float>();
  const std::vector<float> want =
      expected.reshape({expected.numel()}).narrow(0, first, actual.numel()).to_vector<float>();
  std::int64_t differ = 0;
  for (std::size_t k = 0; k < got.size(); ++k)
    differ += std::bit_cast<std::uint32_t>(got[k]) != std::bit_cast<std::uint32_t>(want[k]);
  return differ;
}

// Summed over ranks: the parameters' elements that differ.
std::int64_t differing_bits(const nn::Named<Tensor>& actual, const nn::Named<Tensor>& expected) {
  REQUIRE(actual.size() == expected.size());
  std::int64_t differ = 0;
  for (std::size_t i = 0; i < expected.size(); ++i)
    differ += differing_bits(actual[i].second, expected[i].second);
  return sum_over_ranks(differ);
}

// Summed over ranks: the elements of this rank's gradient pieces that differ from one process's.
std::int64_t differing_bits(const std::vector<std::pair<std::int64_t, Tensor>>& pieces,
                            const std::vector<std::pair<std::int64_t, Tensor>>& whole) {
  REQUIRE(pieces.size() == whole.size());
  std::int64_t differ = 0;
  for (std::size_t i = 0; i < whole.size(); ++i)
    differ += differing_bits(pieces[i].second, whole[i].second, pieces[i].first);
  return sum_over_ranks(differ);
}

std::unique_ptr<dist::Communicator> alone() { return world().split(world().rank(), 0, "alone"); }

}  // namespace

TEST_CASE("bitwise FSDP: every sharding at this world size gives one process's bits",
          "[dist][fsdp][bitwise]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const std::unique_ptr<dist::Communicator> self = alone();
  const Trained reference = train(*self, {.bitwise = true}, vocab);
  CHECK(reference.norms.front() > 0.3);  // the clipping scales the gradients
  for (auto [name, options] : strategies(world().size())) {
    INFO(name);
    options.bitwise = true;
    const Trained trained = train(world(), options, vocab);
    for (int step = 0; step < kSteps; ++step) {
      INFO("step " << step);
      CHECK(std::bit_cast<std::uint64_t>(trained.norms[step]) ==
            std::bit_cast<std::uint64_t>(reference.norms[step]));
      CHECK(differing_bits(trained.gradients[step], reference.gradients[step]) == 0);
    }
    CHECK(differing_bits(trained.parameters, reference.parameters) == 0);
  }
}

TEST_CASE("bitwise FSDP: without the mode, ranks differ from one process in some bit",
          "[dist][fsdp][bitwise]") {
  if (world().size() == 1) return;  // one rank is one process
  const std::int64_t vocab = 4 * world().size() + 1;
  const std::unique_ptr<dist::Communicator> self = alone();
  const Trained reference = train(*self, {}, vocab);
  CHECK(differing_bits(train(world(), {}, vocab).parameters, reference.parameters) > 0);
}

}  // namespace shardlab::test
