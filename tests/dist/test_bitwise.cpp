// tests/dist/test_bitwise.cpp: FsdpOptions::bitwise under mpirun: the nested model trained on whole chunks
// of the global batch per rank (an uneven share where the chunks do not divide by the ranks) gets, at every
// sharding, the bits of the same training in one process: gradient norms (clip_grad_norm_exact), clipped
// gradients and parameters after AdamW steps.
// Without the mode, the same runs differ from one process in some bit (so the check can fail). The tiny
// Llama (also with activation checkpointing) and the CNN, f32 and with bf16 parameters, at every sharding:
// losses (added exactly), clipped norms and parameters, one process's bits.
#include <bit>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "autograd/batch_chunks.h"
#include "autograd/random_context.h"
#include "core/exact_sum.h"
#include "models/cnn.h"
#include "models/llama.h"
#include "recipes/llama.h"
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
Share share_of(int rank, int ranks, std::int64_t batch = kGlobalBatch, std::int64_t chunk = kChunk) {
  const std::int64_t chunks = batch / chunk, base = chunks / ranks, extra = chunks % ranks;
  const std::int64_t before = rank * base + std::min<std::int64_t>(rank, extra);
  return {before * chunk, (base + (rank < extra ? 1 : 0)) * chunk};
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

// --- the reference models -------------------------------------------------------------------------

namespace {

std::vector<std::uint64_t> bits(const std::vector<double>& values) {
  std::vector<std::uint64_t> out;
  for (const double value : values) out.push_back(std::bit_cast<std::uint64_t>(value));
  return out;
}

// A reference model sharded with some options, and the losses of its share of a step's global batch.
struct ModelCase {
  std::int64_t global_batch = 0, chunk = 0;
  std::function<std::shared_ptr<nn::Module>(const dist::FsdpOptions&)> build;  // sharded
  std::function<Variable(nn::Module&, int step, Share share)> losses;          // one per sample or target
};

ModelCase tiny_llama(bool activation_checkpointing) {
  constexpr std::int64_t kBatch = 8, kTokens = 16;
  const models::LlamaConfig config = models::LlamaConfig::preset("tiny");
  return {.global_batch = kBatch,
          .chunk = 2,
          .build =
              [config, activation_checkpointing](const dist::FsdpOptions& options) {
                models::Llama model(config, kSeed);
                if (activation_checkpointing) recipes::apply_activation_checkpointing(model);
                recipes::apply_fsdp(model, options);
                return model.ptr();
              },
          .losses =
              [config](nn::Module& module, int step, Share share) {
                const Tensor tokens =
                    test::random_tensor({kBatch, kTokens + 1}, 100 + static_cast<std::uint64_t>(step),
                                        DType::f32, 0.0, static_cast<double>(config.vocab_size))
                        .to(DType::i64)
                        .narrow(0, share.first, share.count);
                const Variable logits =
                    dynamic_cast<models::LlamaImpl&>(module)(tokens.narrow(1, 0, kTokens));
                return cross_entropy(reshape(logits, {-1, config.vocab_size}),
                                     tokens.narrow(1, 1, kTokens).reshape({-1}), -100, Reduction::none);
              }};
}

ModelCase cnn() {
  constexpr std::int64_t kBatch = 8;
  return {.global_batch = kBatch,
          .chunk = 2,
          .build =
              [](const dist::FsdpOptions& options) {
                models::Cnn model(kSeed);
                dist::fully_shard(*model, options);
                return model.ptr();
              },
          .losses =
              [](nn::Module& module, int step, Share share) {
                const auto seed = 200 + static_cast<std::uint64_t>(step);
                const Tensor images =
                    test::random_tensor({kBatch, 1, 28, 28}, seed).narrow(0, share.first, share.count);
                const Tensor labels = test::random_tensor({kBatch}, seed + 50, DType::f32, 0.0, 10.0)
                                          .to(DType::i64)
                                          .narrow(0, share.first, share.count);
                std::vector<std::int64_t> samples(static_cast<std::size_t>(share.count));
                std::iota(samples.begin(), samples.end(),
                          share.first);  // dropout's streams, per global sample
                const RandomContextGuard dropout({kSeed, step, samples});
                return nll_loss(dynamic_cast<models::CnnImpl&>(module)(constant(images)), labels, -100,
                                Reduction::none);
              }};
}

// Rank 0's loss (added exactly over the ranks), clipped gradient norm and final parameters, after
// kSteps AdamW steps of `model` sharded over `communicator` with bitwise `options`.
struct ModelRun {
  std::vector<double> losses, norms;
  nn::Named<Tensor> parameters;
};

ModelRun train_model(const ModelCase& model, dist::Communicator& communicator, dist::FsdpOptions options) {
  options.communicator = &communicator;
  options.bitwise = true;
  const std::shared_ptr<nn::Module> root = model.build(options);
  optim::AdamW optimizer(dist::sharded_parameters(*root), {.lr = 1e-2});
  const Share share = share_of(communicator.rank(), communicator.size(), model.global_batch, model.chunk);
  ModelRun run;
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    Variable losses;
    {
      const autograd::BatchChunking chunking({.samples = share.count, .chunk = model.chunk});
      losses = model.losses(*root, step, share);
    }
    const std::int64_t per_sample = losses.numel() / share.count;  // the Llama's targets per sequence
    mul(sum(losses), 1.0 / static_cast<double>(per_sample * model.global_batch)).backward();
    ExactSum loss;
    loss.add(losses.data());
    const Tensor limbs = loss.limbs();
    communicator.all_reduce(limbs, dist::ReduceOp::sum, "loss").wait();
    run.losses.push_back(ExactSum::from_limbs(limbs).value());
    run.norms.push_back(optim::clip_grad_norm_exact(root->parameters(), 1.0).item<double>());
    optimizer.step();
  }
  run.parameters = dist::gather_full_parameters(*root);
  return run;
}

void check_model(const ModelCase& model) {
  const std::unique_ptr<dist::Communicator> self = alone();
  for (const bool bf16 : {false, true}) {
    const dist::MixedPrecision precision =
        bf16 ? dist::MixedPrecision{.param_dtype = DType::bf16, .reduce_dtype = DType::f32}
             : dist::MixedPrecision{};
    const ModelRun reference = train_model(model, *self, {.mixed_precision = precision});
    for (auto [name, options] : strategies(world().size())) {
      INFO(name << (bf16 ? ", bf16 parameters" : ", f32"));
      options.mixed_precision = precision;
      const ModelRun run = train_model(model, world(), options);
      CHECK(bits(run.losses) == bits(reference.losses));
      CHECK(bits(run.norms) == bits(reference.norms));
      CHECK(differing_bits(run.parameters, reference.parameters) == 0);
    }
  }
}

}  // namespace

TEST_CASE("bitwise FSDP: the tiny Llama, every sharding, f32 and bf16, gives one process's bits",
          "[dist][fsdp][bitwise]") {
  check_model(tiny_llama(false));
}

TEST_CASE("bitwise FSDP: the tiny Llama with activation checkpointing gives one process's bits",
          "[dist][fsdp][bitwise]") {
  check_model(tiny_llama(true));
}

TEST_CASE("bitwise FSDP: the CNN, every sharding, f32 and bf16, gives one process's bits",
          "[dist][fsdp][bitwise]") {
  check_model(cnn());
}

}  // namespace shardlab::test
