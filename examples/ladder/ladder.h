// examples/ladder/ladder.h: what every rung of the ladder shares, so that each numbered program shows
// only the one thing it adds: the model (the tiny Llama), the task (sequences counting up by a stride,
// which the model learns), this rank's rows of the global batch, the training loop and main().
//
// Every rung prints "step N loss L" with the same losses as rung 1 at any number of ranks (rung 3,
// in bf16, close to them): the global batch, the seed and the loss are the same; only where the
// parameters, gradients and optimizer state live changes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "autograd/functional.h"
#include "core/random.h"
#include "data/loader.h"
#include "dist/comm/init.h"
#include "dist/comm/log.h"
#include "models/llama.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace ladder {

using namespace shardlab;

constexpr std::int64_t kGlobalBatch = 8, kLength = 32;
constexpr std::uint64_t kSeed = 11;
inline const optim::AdamWOptions kAdamW{.lr = 1e-2};

inline models::LlamaConfig config() { return models::LlamaConfig::preset("tiny"); }

// The tiny Llama with shapes only: parallelising it (FSDP, tensor parallelism) then draws each rank's
// pieces, the values one process draws for them, and no rank ever holds the whole model.
inline models::Llama deferred_model() {
  const nn::DeferredInitGuard deferred;
  return models::Llama(config(), kSeed);
}

// The rows [first, first + count) of the global batch that a group of ranks trains on: `index` of
// `groups` (a rank of the data-parallel world, or a tensor-parallel group, whose ranks share rows).
struct Rows {
  std::int64_t first = 0, count = 0;
};
inline Rows rows_of(int index, int groups) {
  Rows rows;
  for (int before = 0; before < index; ++before)
    rows.first += data::rank_batch_size(kGlobalBatch, groups, before);
  rows.count = data::rank_batch_size(kGlobalBatch, groups, index);
  return rows;
}

// Tokens [rows, kLength + 1] of step `step`: row r counts up from a start by a stride of 1 to 3, both
// drawn for (step, global row), so a rank draws its rows alone with the values of the whole batch.
inline Tensor tokens(std::int64_t step, Rows rows) {
  const std::int64_t vocab = config().vocab_size;
  const std::vector<double> draws =
      uniform({rows.count, 2}, {.seed = kSeed, .stream = static_cast<std::uint64_t>(step)}, 0.0, 1.0, {},
              rows.first * 2)
          .to_vector<double>();
  std::vector<std::int64_t> values;
  for (std::int64_t r = 0; r < rows.count; ++r) {
    const auto start = static_cast<std::int64_t>(draws[2 * r] * vocab);
    const auto stride = 1 + static_cast<std::int64_t>(draws[2 * r + 1] * 3);
    for (std::int64_t t = 0; t <= kLength; ++t) values.push_back((start + stride * t) % vocab);
  }
  return from_vector(values, {rows.count, kLength + 1});
}

// The summed loss of logits [rows * kLength, vocab] against targets [rows * kLength].
using LossSum = std::function<Variable(const Variable& logits, const Tensor& targets)>;
inline Variable cross_entropy_sum(const Variable& logits, const Tensor& targets) {
  return cross_entropy(logits, targets, -100, Reduction::sum);
}

// What a rung trains and how its ranks share the work.
struct Rung {
  models::Llama& model;
  optim::Optimizer& optimizer;
  Rows rows;                     // this rank's rows of each global batch
  dist::Communicator& replicas;  // the data-parallel ranks: FSDP averages the gradients over them
  LossSum loss_sum = cross_entropy_sum;
};

// Steps first..last, each read top to bottom: zero_grad, forward and loss, backward, optimizer step.
// The loss is summed over this rank's tokens and its backward scaled by replicas / global tokens, so
// that FSDP's average over the replicas is the gradient of the global batch's mean loss, what one
// process computes. Prints the global mean loss of every step.
inline void train(const Rung& rung, std::int64_t first_step, std::int64_t last_step) {
  const double global_tokens = static_cast<double>(kGlobalBatch * kLength);
  for (std::int64_t step = first_step; step <= last_step; ++step) {
    const Tensor batch = tokens(step, rung.rows);
    const Tensor inputs = batch.narrow(1, 0, kLength), targets = batch.narrow(1, 1, kLength).reshape({-1});
    rung.optimizer.zero_grad();
    const Variable logits = rung.model(inputs);
    const Variable loss_sum = rung.loss_sum(reshape(logits, {-1, logits.size(-1)}), targets);
    (loss_sum * (rung.replicas.size() / global_tokens)).backward();
    rung.optimizer.step();
    const Tensor total = full({1}, loss_sum.data().item<double>(), {.dtype = DType::f64});
    rung.replicas.all_reduce(total, dist::ReduceOp::sum).wait();
    dist::log("step {} loss {:.8f}", step, total.item<double>() / global_tokens);
  }
}

// The command line every rung takes: --steps N (20), and the rung's own flags, which `extra` reads
// (returning false for a flag it does not know).
struct Args {
  std::int64_t steps = 20;
  std::vector<std::string> rest;  // the flags after the program's own, in order
};
inline std::int64_t positive(const char* text, std::string_view flag) {
  char* end = nullptr;
  const std::int64_t value = std::strtoll(text, &end, 10);
  SHARDLAB_CHECK(*end == '\0' && value >= 1, "{} wants a positive integer, got '{}'", flag, text);
  return value;
}
inline Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      args.steps = positive(argv[++i], arg);
    } else {
      args.rest.emplace_back(arg);
    }
  }
  return args;
}

// main() of every rung: MPI started (on the CPU), `body` run, any error printed with the program's
// name and a non-zero exit.
inline int run(int argc, char** argv, const char* name,
               const std::function<void(const dist::Session&, const Args&)>& body) {
  try {
    const std::unique_ptr<dist::Session> session =
        dist::init(argc, argv, {.device = dist::DeviceChoice::cpu});
    body(*session, parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
  return 0;
}

}  // namespace ladder
