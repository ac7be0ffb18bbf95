// tests/dist/test_bitwise.cpp: FsdpOptions::bitwise under mpirun: the nested model trained on whole chunks
// of the global batch per rank (an uneven share where the chunks do not divide by the ranks) gets, at every
// sharding, the bits of the same training in one process: gradient norms (clip_grad_norm_exact), clipped
// gradients and parameters after AdamW steps.
// The tiny Llama (also with activation checkpointing) and the CNN, f32 and with bf16 parameters, at every
// sharding, over 20 steps: every step's loss (added exactly) and clipped norm, and the full safetensors
// file written at the end, one process's bits. Without the mode, the same runs differ from one process in
// some bit (so each check can fail).
#include <bit>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/batch_chunks.h"
#include "autograd/random_context.h"
#include "core/exact_sum.h"
#include "dist/checkpoint/full_safetensors.h"
#include "models/cnn.h"
#include "models/llama.h"
#include "recipes/llama.h"
#include "tests/dist/fsdp_parity.h"
#include "tests/dist/shared_dir.h"

namespace shardlab::test {
namespace {

constexpr std::int64_t kChunk = 2;  // 6 chunks: 6, 3/3, 2/2/2 and 2/2/1/1 per rank at np 1-4
constexpr int kSteps = 3;
// The reference models' runs: 20 steps; 3 in the sanitizer build, which checks the same code's memory and
// runs it several times slower (the normal build's run shows the bits).
#ifdef __SANITIZE_ADDRESS__
constexpr int kModelSteps = 3;
#else
constexpr int kModelSteps = 20;
#endif

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
// With `divide_factor`, every unit's reduction is divided by it (dist::set_gradient_divide_factor).
Trained train(dist::Communicator& communicator, dist::FsdpOptions options, std::int64_t vocab,
              std::optional<double> divide_factor = std::nullopt) {
  options.communicator = &communicator;
  Nested model(vocab, kSeed);
  shard(model, options);
  if (divide_factor) {
    for (const auto& block : *model->blocks) dist::set_gradient_divide_factor(*block, *divide_factor);
    dist::set_gradient_divide_factor(*model, *divide_factor);
  }
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

// Every sharding at this world size, bitwise, trains to `reference`'s bits: norms, gradients, parameters.
void check_every_sharding(const Trained& reference, std::int64_t vocab,
                          std::optional<double> divide_factor = std::nullopt) {
  for (auto [name, options] : strategies(world().size())) {
    INFO(name);
    options.bitwise = true;
    const Trained trained = train(world(), options, vocab, divide_factor);
    for (int step = 0; step < kSteps; ++step) {
      INFO("step " << step);
      CHECK(std::bit_cast<std::uint64_t>(trained.norms[step]) ==
            std::bit_cast<std::uint64_t>(reference.norms[step]));
      CHECK(differing_bits(trained.gradients[step], reference.gradients[step]) == 0);
    }
    CHECK(differing_bits(trained.parameters, reference.parameters) == 0);
  }
}

}  // namespace

TEST_CASE("bitwise FSDP: every sharding at this world size gives one process's bits",
          "[dist][fsdp][bitwise]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const std::unique_ptr<dist::Communicator> self = alone();
  const Trained reference = train(*self, {.bitwise = true}, vocab);
  CHECK(reference.norms.front() > 0.3);  // the clipping scales the gradients
  check_every_sharding(reference, vocab);
}

TEST_CASE("bitwise FSDP with a gradient divide factor: one process's bits with the same factor",
          "[dist][fsdp][bitwise][fsdp2]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const std::unique_ptr<dist::Communicator> self = alone();
  const Trained undivided = train(*self, {.bitwise = true}, vocab);
  const Trained reference = train(*self, {.bitwise = true}, vocab, 3.0);
  // The sum divided by 3: the first step's norm, before any clipping or update, is a third.
  CHECK(reference.norms.front() == Approx(undivided.norms.front() / 3.0).epsilon(1e-6));
  check_every_sharding(reference, vocab, 3.0);
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
  constexpr std::int64_t kBatch = 4;  // in chunks of 1: 2/1/1 at np 3
  return {.global_batch = kBatch,
          .chunk = 1,
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

// Every step's loss (over the global batch) and clipped gradient norm, and the model's full safetensors
// file, after kModelSteps AdamW steps of `model` sharded over `communicator` with `options`. Bitwise:
// each rank runs its whole chunks under BatchChunking, the loss is added exactly over the ranks, the
// norm is clip_grad_norm_exact's. Without the mode: the same shares in one forward, the loss scaled by
// the ranks (FSDP averages the gradients), summed over the ranks in f64 and clipped by clip_grad_norm_,
// as a plain FSDP program does.
struct ModelRun {
  std::vector<double> losses, norms;
  std::string file;
};

double summed_loss(const Variable& losses, dist::Communicator& communicator, bool exactly) {
  if (!exactly) {
    const Tensor total = full({1}, sum(losses.data()).item<double>(), dtype(DType::f64));
    communicator.all_reduce(total, dist::ReduceOp::sum, "loss").wait();
    return total.item<double>();
  }
  ExactSum loss;
  loss.add(losses.data());
  const Tensor limbs = loss.limbs();
  communicator.all_reduce(limbs, dist::ReduceOp::sum, "loss").wait();
  return ExactSum::from_limbs(limbs).value();
}

ModelRun train_model(const ModelCase& model, dist::Communicator& communicator, dist::FsdpOptions options,
                     const std::string& file) {
  options.communicator = &communicator;
  const std::shared_ptr<nn::Module> root = model.build(options);
  optim::AdamW optimizer(dist::sharded_parameters(*root), {.lr = 1e-2});
  const Share share = share_of(communicator.rank(), communicator.size(), model.global_batch, model.chunk);
  const double ranks = options.bitwise ? 1.0 : communicator.size();
  ModelRun run{.file = file};
  for (int step = 0; step < kModelSteps; ++step) {
    optimizer.zero_grad();
    Variable losses;
    {
      std::optional<autograd::BatchChunking> chunking;
      if (options.bitwise)
        chunking.emplace(autograd::BatchChunks{.samples = share.count, .chunk = model.chunk});
      losses = model.losses(*root, step, share);
    }
    const std::int64_t per_sample = losses.numel() / share.count;  // the Llama's targets per sequence
    mul(sum(losses), ranks / static_cast<double>(per_sample * model.global_batch)).backward();
    run.losses.push_back(summed_loss(losses, communicator, options.bitwise));
    run.norms.push_back((options.bitwise ? optim::clip_grad_norm_exact(root->parameters(), 1.0)
                                         : optim::clip_grad_norm_(root->parameters(), 1.0))
                            .item<double>());
    optimizer.step();
  }
  dist::save_full_safetensors(file, *root);
  communicator.barrier("saved").wait();  // rank 0 renames the file into place: then every rank reads it
  return run;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// One process's run of `model` with `options` (the mode's or not), made by rank 0 alone: its steps
// broadcast, its file written where every rank reads it.
ModelRun one_process(const ModelCase& model, dist::FsdpOptions options, const std::string& file) {
  const std::unique_ptr<dist::Communicator> self = alone();
  ModelRun run{
      .losses = std::vector<double>(kModelSteps), .norms = std::vector<double>(kModelSteps), .file = file};
  if (world().rank() == 0) run = train_model(model, *self, options, file);
  MPI_Bcast(run.losses.data(), kModelSteps, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Bcast(run.norms.data(), kModelSteps, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return run;
}

// Over the ranks, how many of a run's steps (losses and norms) and file differ in some bit from one
// process's (0: the same bits).
std::int64_t differences(const ModelRun& run, const ModelRun& reference) {
  const bool steps_differ =
      bits(run.losses) != bits(reference.losses) || bits(run.norms) != bits(reference.norms);
  const bool files_differ = file_bytes(run.file) != file_bytes(reference.file);
  return sum_over_ranks(std::int64_t{steps_differ} + std::int64_t{files_differ});
}

dist::MixedPrecision precision(bool bf16) {
  return bf16 ? dist::MixedPrecision{.param_dtype = DType::bf16, .reduce_dtype = DType::f32}
              : dist::MixedPrecision{};
}

// In the mode, every sharding at this world size, f32 and bf16 parameters: one process's bits, every
// step's and the file's. Without it (the control; at np 1 one rank is one process), they differ.
void check_model(const ModelCase& model) {
  const SharedDir dir;
  for (const bool bf16 : {false, true}) {
    const ModelRun reference = one_process(model, {.mixed_precision = precision(bf16), .bitwise = true},
                                           dir.file("one.safetensors"));
    for (auto [name, options] : strategies(world().size())) {
      INFO(name << (bf16 ? ", bf16 parameters" : ", f32"));
      options.mixed_precision = precision(bf16);
      options.bitwise = true;
      const ModelRun run = train_model(model, world(), options, dir.file("world.safetensors"));
      CHECK(run.losses.size() == kModelSteps);
      CHECK(bits(run.losses) == bits(reference.losses));
      CHECK(bits(run.norms) == bits(reference.norms));
      CHECK(file_bytes(run.file) == file_bytes(reference.file));
    }
  }
  if (world().size() == 1) return;
  INFO("without the mode");
  const ModelRun one = one_process(model, {}, dir.file("plain-one.safetensors"));
  CHECK(differences(train_model(model, world(), {}, dir.file("plain-world.safetensors")), one) > 0);
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
