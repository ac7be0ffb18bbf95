// tests/dist/test_fsdp_cuda.cpp: FSDP on a GPU against one CPU process: every strategy (hybrid
// groups through the MPI path when several ranks share the GPU), CPU offload, bf16 parameters with
// f32 reduction, Module::to(cuda) before sharding and checkpoints of CUDA shards; and, on the
// session's NCCL world, a step in which the host never waits for the GPU. At 1 rank with NCCL the
// session's world is NCCL; at 2-4 ranks on one GPU the collectives go through MPI.
#include <cmath>
#include <string>

#include "core/host_wait.h"
#include "dist/checkpoint/checkpoint.h"
#include "tests/dist/fsdp_parity.h"
#include "tests/dist/shared_dir.h"

// In the tests' namespace: the parity helpers by their own names.
namespace shardlab::test {

namespace {

constexpr int kSteps = 3;

Device gpu() {
  const Device device = dist::session().device();
  return device.is_cuda() ? device : Device::cuda(0);
}

// This rank's rows of global batch `step`, on the GPU.
TokenBatch batch_on_gpu(int step, std::int64_t vocab) {
  TokenBatch batch = token_batch(step, kGlobalBatch, vocab, world().rank(), world().size());
  batch.tokens = batch.tokens.to(gpu());
  batch.targets = batch.targets.to(gpu());
  return batch;
}

// Nested moved to the GPU (Module::to) and sharded with `options`.
Nested sharded_on_gpu(std::int64_t vocab, const dist::FsdpOptions& options) {
  Nested model(vocab, kSeed);
  model->to(gpu());
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
  return model;
}

// One step with AdamW; returns this rank's loss (read after the step).
float gpu_step(Nested& model, optim::Optimizer& optimizer, std::int64_t vocab, int step) {
  const TokenBatch batch = batch_on_gpu(step, vocab);
  Variable loss = cross_entropy(model(batch.tokens), batch.targets);
  optimizer.zero_grad();
  loss.backward();
  optimizer.step();
  return loss.data().item<float>();
}

Run train_on_gpu(std::int64_t vocab, const dist::FsdpOptions& options) {
  Nested model = sharded_on_gpu(vocab, options);
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
  Run run;
  for (int step = 0; step < kSteps; ++step)
    run.losses.push_back(mean_over_ranks(gpu_step(model, optimizer, vocab, step)));
  run.parameters = dist::gather_full_parameters(*model);
  return run;
}

}  // namespace

TEST_CASE("FSDP on a GPU trains as one CPU process, for every strategy and CPU offload",
          "[dist][fsdp][cuda]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const Run expected = train_alone(vocab, kSteps);
  for (const auto& [name, options] : strategies(world().size())) {
    INFO(name << " at " << world().size() << " ranks on " << gpu().str() << " through "
              << dist::session().world().backend_name());
    CHECK(mismatches_on_any_rank(train_on_gpu(vocab, options), expected, 1e-4, 1e-5) == 0);
  }
}

TEST_CASE("FSDP on a GPU with bf16 parameters and f32 reduction trains as it does on the CPU",
          "[dist][fsdp][cuda]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const dist::FsdpOptions options{
      .mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32}};
  Run on_cpu;
  {
    Nested model(vocab, kSeed);
    for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
    dist::fully_shard(*model, options);
    on_cpu = train_sharded(model, vocab, kSteps, model->named_parameters());
  }
  // bf16 rounds the products of GEMMs summed in another order: a few bf16 steps apart at most.
  CHECK(mismatches_on_any_rank(train_on_gpu(vocab, options), on_cpu, 2e-2, 2e-3) == 0);
}

TEST_CASE("a step of FSDP on a GPU with NCCL makes the host wait for nothing", "[dist][fsdp][cuda]") {
  if (dist::session().world().backend_name() != "nccl") {
    WARN("the session's world is " << dist::session().world().backend_name()
                                   << " (ranks share a GPU): its collectives go through host memory");
    return;
  }
  const std::int64_t vocab = 4 * world().size() + 1;
  for (const auto& [name, options] : strategies(world().size())) {
    if (options.cpu_offload) continue;  // its optimizer step on the host waits for the gradients
    INFO(name);
    Nested model = sharded_on_gpu(vocab, options);
    optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
    (void)gpu_step(model, optimizer, vocab, 0);  // the first step records the orders
    const TokenBatch batch = batch_on_gpu(1, vocab);
    reset_host_wait_counts();
    Tensor loss;
    {
      HostWaitsForbidden step("FSDP step");
      Variable output = cross_entropy(model(batch.tokens), batch.targets);
      optimizer.zero_grad();
      output.backward();
      (void)optim::clip_grad_norm_(model->parameters(), 1.0);
      optimizer.step();
      loss = output.data();
    }
    CHECK(host_wait_total() == 0);
    CHECK(std::isfinite(loss.item<float>()));
  }
}

TEST_CASE("CPU offload from a GPU: pinned shards, and one host wait per backward for the gradients",
          "[dist][fsdp][cuda]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested model = sharded_on_gpu(vocab, {.cpu_offload = true});
  for (const auto& [name, shard] : model->named_parameters()) {
    INFO(name);
    CHECK(shard.data().device().is_cpu());
    CHECK(shard.data().is_pinned());
  }
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
  (void)gpu_step(model, optimizer, vocab, 0);
  const TokenBatch batch = batch_on_gpu(1, vocab);
  reset_host_wait_counts();
  Variable loss = cross_entropy(model(batch.tokens), batch.targets);
  optimizer.zero_grad();
  loss.backward();
  optimizer.step();  // on the host, with the CPU kernel
  std::int64_t gradient_waits = 0;
  for (const HostWaitCount& count : host_wait_counts())
    gradient_waits += count.reason == "offloaded gradients to the host" ? count.count : 0;
  CHECK(gradient_waits == 1);
  for (const auto& [name, shard] : model->named_parameters()) CHECK(shard.grad().device().is_cpu());
}

TEST_CASE(
    "CPU offload from a GPU, the host's AdamW overlapped with the next forward: as in line, bit for bit",
    "[dist][fsdp][cuda]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const auto train = [&](bool overlap) {
    Nested model = sharded_on_gpu(vocab, {.cpu_offload = true});
    optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
    if (overlap) dist::overlap_host_step(optimizer, *model);
    Run run;
    for (int step = 0; step < kSteps; ++step) {
      const TokenBatch batch = batch_on_gpu(step, vocab);
      Variable loss = cross_entropy(model(batch.tokens), batch.targets);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step_if(isfinite(loss.data()));  // a gate on the GPU, read by the host step thread
      run.losses.push_back(mean_over_ranks(loss.data().item<float>()));
      optimizer.settle_step(true);
    }
    run.parameters = dist::gather_full_parameters(*model);
    return run;
  };
  const Run in_line = train(false);
  CHECK(mismatches_on_any_rank(train(true), in_line, 0.0, 0.0) == 0);
}

TEST_CASE("overlap_host_step refuses shards on a GPU", "[dist][fsdp][cuda]") {
  Nested model = sharded_on_gpu(4 * world().size() + 1, {});
  optim::AdamW optimizer(model->named_parameters(), {});
  CHECK_THROWS_ERROR(
      dist::overlap_host_step(optimizer, *model),
      fmt::format("dist::overlap_host_step: unit (root) keeps its shard on {}; the host steps shards in "
                  "host memory only (FsdpOptions::cpu_offload, or training on the CPU)",
                  gpu().str()));
}

TEST_CASE("bitwise gradients are refused for a unit on a GPU", "[dist][fsdp][cuda]") {
  Nested model(5, kSeed);
  model->to(gpu());
  CHECK_THROWS_ERROR(
      dist::fully_shard(*model, {.bitwise = true}),
      fmt::format("fully_shard: bitwise gradients (FsdpOptions::bitwise) are summed on the CPU, but "
                  "'embed.weight' is on {}",
                  gpu().str()));
}

TEST_CASE("a checkpoint of CUDA shards loads into a CPU model over the same ranks, bit for bit",
          "[dist][fsdp][checkpoint][cuda]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  SharedDir dir;
  Nested on_gpu = sharded_on_gpu(vocab, {});
  optim::AdamW gpu_optimizer(on_gpu->named_parameters(), {.lr = 1e-2});
  for (int step = 0; step < 2; ++step) (void)gpu_step(on_gpu, gpu_optimizer, vocab, step);
  dist::save_checkpoint(dir.file("gpu"), *on_gpu, gpu_optimizer, {{"step", 2}});

  Nested on_cpu(vocab, kSeed + 1);
  for (const auto& block : *on_cpu->blocks) dist::fully_shard(*block);
  dist::fully_shard(*on_cpu);
  optim::AdamW cpu_optimizer(on_cpu->named_parameters(), {.lr = 1e-2});
  CHECK(dist::load_checkpoint(dir.file("gpu"), *on_cpu, cpu_optimizer)["step"] == 2);
  const nn::Named<Tensor> saved = dist::gather_full_parameters(*on_gpu),
                          loaded = dist::gather_full_parameters(*on_cpu);
  REQUIRE(saved.size() == loaded.size());
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < saved.size(); ++i)
    wrong += count_mismatches(loaded[i].second.to_vector<double>(), saved[i].second.to_vector<double>(),
                              Tolerance{0.0, 0.0});
  CHECK(sum_over_ranks(wrong) == 0);
}

}  // namespace shardlab::test
