// examples/custom_model/custom_model.cpp: a model of your own against the installed shardlab: a
// residual MLP defined with nn::Module, sharded with one call, trained with AdamW on synthetic data
// under mpirun. At any number of ranks up to the global batch it prints the losses one process
// prints, up to float rounding (FSDP's promise).
//
//   mpirun -np 2 ./custom_model --steps 30
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include "autograd/functional.h"
#include "autograd/ops.h"
#include "core/ops.h"
#include "core/random.h"
#include "data/loader.h"
#include "dist/comm/init.h"
#include "dist/comm/log.h"
#include "dist/fsdp/fsdp.h"
#include "nn/layers.h"
#include "optim/optimizer.h"

using namespace shardlab;

namespace {

constexpr std::int64_t kFeatures = 16, kClasses = 4, kWidth = 32, kHidden = 64, kBlocks = 3;
constexpr std::int64_t kGlobalBatch = 64;
constexpr std::uint64_t kSeed = 7;

// x + fc2(gelu(fc1(norm(x)))): a pre-norm residual block; each becomes an FSDP unit of its own.
class ResidualBlockImpl : public nn::Module {
 public:
  ResidualBlockImpl(std::int64_t width, std::int64_t hidden)
      : nn::Module("ResidualBlock"),
        norm(width),
        fc1(nn::LinearOptions(width, hidden)),
        fc2(nn::LinearOptions(hidden, width)) {
    register_module("norm", norm.ptr());
    register_module("fc1", fc1.ptr());
    register_module("fc2", fc2.ptr());
  }
  // with_hooks runs FSDP's hooks around the forward: gather the unit's parameters, then free them.
  Variable operator()(const Variable& input) {
    return with_hooks([&](const Variable& x) { return x + fc2(gelu(fc1(norm(x)))); }, input);
  }

  nn::LayerNorm norm;
  nn::Linear fc1, fc2;
};

// features [N, kFeatures] -> logits [N, kClasses]: a stem, the residual blocks, a norm and a head.
class ResidualMlpImpl : public nn::Module {
 public:
  explicit ResidualMlpImpl(std::uint64_t seed)
      : nn::Module("ResidualMlp"),
        stem(nn::LinearOptions(kFeatures, kWidth)),
        norm(kWidth),
        head(nn::LinearOptions(kWidth, kClasses)) {
    register_module("stem", stem.ptr());
    for (std::int64_t i = 0; i < kBlocks; ++i)
      blocks->push_back(std::make_shared<ResidualBlockImpl>(kWidth, kHidden));
    register_module("blocks", blocks.ptr());
    register_module("norm", norm.ptr());
    register_module("head", head.ptr());
    nn::initialize(*this, seed);  // each parameter drawn by its dotted name: the same on any rank count
  }
  Variable operator()(const Variable& input) {
    return with_hooks(
        [&](const Variable& features) {
          Variable x = stem(features);
          for (const auto& block : *blocks) x = (*block)(x);
          return head(norm(x));
        },
        input);
  }

  nn::Linear stem;
  nn::ModuleList<ResidualBlockImpl> blocks;
  nn::LayerNorm norm;
  nn::Linear head;
};
using ResidualMlp = nn::Holder<ResidualMlpImpl>;

struct Batch {
  Tensor features;  // f32 [rows, kFeatures]
  Tensor labels;    // i64 [rows]
};

// Rows [first_row, first_row + rows) of step `step`'s global batch: Gaussian features labelled by a
// fixed random linear teacher (argmax of features x teacher), so the target is learnable. The draws
// are counter-based, so a rank draws just its rows, equal to those rows of the whole batch.
Batch make_batch(std::int64_t step, std::int64_t first_row, std::int64_t rows) {
  const Tensor teacher = normal({kFeatures, kClasses}, {.seed = kSeed, .stream = 1});
  const Tensor features =
      normal({rows, kFeatures}, {.seed = kSeed, .stream = 1000 + static_cast<std::uint64_t>(step)}, 0.0, 1.0,
             {}, first_row * kFeatures);
  return {features, argmax(matmul(features, teacher), {1})};
}

std::int64_t parse_steps(int argc, char** argv) {
  std::int64_t steps = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      char* end = nullptr;
      steps = std::strtoll(argv[++i], &end, 10);
      SHARDLAB_CHECK(*end == '\0' && steps >= 1, "--steps wants a positive integer, got '{}'", argv[i]);
    } else {
      fail("unknown argument '{}' (usage: custom_model [--steps N])", arg);
    }
  }
  return steps;
}

void train(const dist::Session& session, std::int64_t steps) {
  const int rank = session.rank(), world = session.world_size();
  // This rank's consecutive rows of the global batch: 22/21/21 of 64 at 3 ranks (data::rank_batch_size
  // refuses more ranks than rows). The loss below is weighted by the global batch, so any split works.
  std::int64_t first = 0;
  for (int before = 0; before < rank; ++before) first += data::rank_batch_size(kGlobalBatch, world, before);
  const std::int64_t rows = data::rank_batch_size(kGlobalBatch, world, rank);

  // Shapes only: FSDP then draws each rank's shard of every parameter, so no rank holds the model.
  ResidualMlp model = [] {
    const nn::DeferredInitGuard deferred;
    return ResidualMlp(kSeed);
  }();
  std::int64_t parameters = 0;
  for (const auto& [name, parameter] : model->named_parameters()) parameters += parameter.numel();
  // The one call: every ResidualBlock a unit of its own, then the root (stem, norm, head).
  const int units = dist::shard_by_type<ResidualBlockImpl>(*model);
  // As with FSDP2: after sharding, the model's own parameters are this rank's shards.
  optim::AdamW optimizer(model->named_parameters(), {.lr = 3e-3});
  dist::log("custom_model: {} parameters in {} FSDP units over {} rank{}, {} rows each", parameters, units,
            world, world == 1 ? "" : "s", rows);

  double first_loss = 0, loss = 0;
  for (std::int64_t step = 1; step <= steps; ++step) {
    const Batch batch = make_batch(step, first, rows);
    optimizer.zero_grad();
    const Variable loss_sum =
        cross_entropy(model(constant(batch.features)), batch.labels, -100, Reduction::sum);
    // FSDP averages gradients over the ranks: scaled by world / global batch, the average is the
    // gradient of the global batch's mean loss, what one process computes.
    (loss_sum * (static_cast<double>(world) / kGlobalBatch)).backward();
    optimizer.step();
    const Tensor total = full({1}, loss_sum.data().item<double>(), {.dtype = DType::f64});
    session.cpu_world().all_reduce(total, dist::ReduceOp::sum).wait();
    loss = total.item<double>() / kGlobalBatch;
    if (step == 1) first_loss = loss;
    dist::log("step {} loss {:.8f}", step, loss);
  }
  dist::log("custom_model: loss {:.4f} -> {:.4f} in {} steps", first_loss, loss, steps);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // On the CPU whatever the machine has: every rank runs the same kernels as one process would.
    const std::unique_ptr<dist::Session> session =
        dist::init(argc, argv, {.device = dist::DeviceChoice::cpu});
    train(*session, parse_steps(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
