// apps/train_cnn: trains the tutorial CNN (models/cnn.h) on MNIST-format data with FSDP over the
// ranks mpirun starts (one process is a world of 1), following the PyTorch FSDP tutorial:
// Adadelta(lr) + StepLR(gamma), nll_loss summed over the batch, "Train Epoch" and "Test set"
// lines, plus a progress bar, per-rank JSON-lines metrics, step timing, sharded checkpoints to
// resume from (at any world size) and a safetensors file.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "apps/cli.h"
#include "apps/training_support.h"
#include "autograd/functional.h"
#include "autograd/random_context.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/trace.h"
#include "data/idx.h"
#include "data/loader.h"
#include "dist/checkpoint.h"
#include "dist/fsdp.h"
#include "dist/full_safetensors.h"
#include "dist/init.h"
#include "dist/log.h"
#include "models/cnn.h"
#include "optim/optimizer.h"
#include "optim/scheduler.h"

using namespace shardlab;

namespace {

// The CNN with shapes but no parameter bytes: FSDP draws each rank's shards (sharded
// initialisation), so the full model never exists on any rank.
models::Cnn shapes_only_cnn(std::uint64_t seed) {
  const nn::DeferredInitGuard deferred;
  return models::Cnn(seed);
}

struct Options {
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::int64_t global_batch = 64;
  std::int64_t test_batch_size = 1000;
  std::int64_t epochs = 10;
  std::int64_t steps = 0;  // 0: no limit but --epochs
  std::string optimizer = "adadelta";
  std::optional<double> lr;  // default: the optimizer's (Adadelta 1.0, Adam 1e-3)
  double gamma = 0.7;
  std::uint64_t seed = 1;
  std::int64_t limit_train = 0;
  std::int64_t limit_test = 0;
  std::string sharding = "full";
  std::string mixed_precision = "none";
  bool explain = false;
  bool profile = false;
  bool detect_anomaly = false;
  std::int64_t max_skipped_steps = 5;  // non-finite steps in a row before the run stops
  std::string save_model;
  std::string metrics;
  std::string trace, trace_steps = "2:3";
  int prefetch = 1;
  int threads = 0;
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;  // 0: only at the end, when --checkpoint-dir is given
  std::int64_t keep = 2;
  bool resume = false;
  std::string memory_limit;  // none by default: the CPU's memory is the host's, shared with everything else
};

// Both optimizers keep two f32 slots per element (Adadelta: square_avg and acc_delta; Adam:
// exp_avg and exp_avg_sq): what the plan counts as optimizer state.
constexpr std::int64_t kOptimizerStateBytesPerElement = 8;

enum class OptimizerKind { adadelta, adam };

OptimizerKind parse_optimizer(const std::string& text) {
  if (text == "adadelta") return OptimizerKind::adadelta;
  if (text == "adam") return OptimizerKind::adam;
  fail("--optimizer: '{}' is not one of adadelta, adam", text);
}

std::unique_ptr<optim::Optimizer> make_optimizer(OptimizerKind kind, std::optional<double> lr,
                                                 nn::Named<Variable> parameters) {
  switch (kind) {
    case OptimizerKind::adadelta:
      return std::make_unique<optim::Adadelta>(std::move(parameters),
                                               optim::AdadeltaOptions{.lr = lr.value_or(1.0)});
    case OptimizerKind::adam:
      return std::make_unique<optim::Adam>(std::move(parameters),
                                           optim::AdamOptions{.lr = lr.value_or(1e-3)});
  }
  fail("optimizer kind {} is not handled", static_cast<int>(kind));
}

struct TestResult {
  double average_loss = 0;
  std::int64_t correct = 0, total = 0;
};

// Everything a run needs, built (and checked) on every rank before the first step: errors
// thrown here are the same on all ranks.
class Training {
 public:
  Training(const Options& options, dist::Session& session);
  void run();

 private:
  // The epoch in progress: its loss and images so far (over all ranks), saved with a checkpoint
  // so that a resumed run prints the same "Train Epoch" line as an uninterrupted one. A skipped
  // step's images count as trained but not in the loss.
  struct EpochProgress {
    std::int64_t epoch = 1;
    double loss_sum = 0;
    std::int64_t images = 0, skipped_images = 0;
    double mean_loss() const { return loss_sum / static_cast<double>(images - skipped_images); }
  };
  // Trains the rest of epoch_.epoch; false when --steps ended it early.
  bool train_epoch();
  Variable forward_backward(const data::Batch& batch);
  TestResult evaluate();
  void save_checkpoint();
  void resume();
  nlohmann::json training_state() const;
  void report();

  const Options options_;
  dist::Session& session_;
  const int rank_, world_size_;
  dist::FsdpOptions fsdp_;
  data::ImageSet train_, test_;
  std::optional<data::DataLoader> loader_;
  Tensor test_images_, test_labels_;  // this rank's rows r, r + W, ... of the test set
  std::int64_t training_images_ = 0;
  std::int64_t test_total_ = 0;
  std::int64_t data_bytes_ = 0;  // CPU bytes in use once the data sets are loaded
  models::Cnn model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::optional<optim::StepLR> scheduler_;
  dist::Plan plan_;
  std::optional<apps::PeakPrediction> predicted_;  // with --explain or --memory-limit
  std::optional<apps::MetricsFile> metrics_;
  std::optional<apps::StepTrace> trace_;
  apps::StepProfile profile_{false};
  apps::CheckpointDir checkpoints_;
  apps::NonFiniteSteps non_finite_;
  nlohmann::json last_saved_;  // the state saved or resumed from: the end need not save it again
  EpochProgress epoch_;
  std::int64_t step_ = 0;
  std::vector<double> step_ms_;  // every optimizer step after the first
  std::int64_t peak_bytes_ = 0;
  std::int64_t model_bytes_baseline_ = 0;  // CPU bytes in use before the shards existed
  std::int64_t step_bytes_received_ = 0;   // the last step's collectives, per rank
};

Training::Training(const Options& options, dist::Session& session)
    : options_(options),
      session_(session),
      rank_(session.rank()),
      world_size_(session.world_size()),
      model_(shapes_only_cnn(options.seed)),
      checkpoints_(options.checkpoint_dir, options.keep),
      non_finite_("train_cnn", options.max_skipped_steps) {
  if (options.threads > 0) set_num_threads(options.threads);
  // Options first: a typo fails before the data sets load.
  const OptimizerKind optimizer = parse_optimizer(options.optimizer);
  const auto [sharding, group] = dist::parse_sharding(options.sharding);
  fsdp_ = {.sharding = sharding,
           .hybrid_group_size = group,
           .prefetch = options.prefetch,
           .mixed_precision = apps::parse_mixed_precision(options.mixed_precision)};
  const std::int64_t per_rank_batch = data::rank_batch_size(options.global_batch, world_size_, rank_);
  if (!options.save_model.empty())
    apps::check_output_path(session.cpu_world(), "--save-model", options.save_model, /*is_directory=*/false);
  if (!options.checkpoint_dir.empty())
    apps::check_output_path(session.cpu_world(), "--checkpoint-dir", options.checkpoint_dir,
                            /*is_directory=*/true);

  train_ = data::load_mnist(options.data_dir, true);
  test_ = data::load_mnist(options.data_dir, false);
  data_bytes_ = memory_stats(Device::cpu()).bytes_in_use;
  data::TensorDataset train_set(train_.images, train_.labels);
  if (options.limit_train > 0) train_set = train_set.head(std::min(options.limit_train, train_set.size()));
  training_images_ = train_set.size();
  loader_.emplace(data::rank_loader(train_set, {.size = options.global_batch,
                                                .world_size = world_size_,
                                                .rank = rank_,
                                                .shuffle = true,
                                                .seed = options.seed}));
  test_total_ = test_.images.size(0);
  if (options.limit_test > 0) test_total_ = std::min(options.limit_test, test_total_);
  test_images_ = test_.images.slice(0, rank_, test_total_, world_size_).contiguous();
  test_labels_ = test_.labels.slice(0, rank_, test_total_, world_size_).contiguous();

  // The big layers are units of their own, the root (conv1 and fc2) last. Each rank draws only
  // its shards of the parameters (the values one process would draw): no rank holds the model.
  model_bytes_baseline_ = memory_stats(Device::cpu()).bytes_in_use;
  dist::fully_shard(*model_->conv2, fsdp_);
  dist::fully_shard(*model_->fc1, fsdp_);
  dist::fully_shard(*model_, fsdp_);
  optimizer_ = make_optimizer(optimizer, options.lr, dist::sharded_parameters(*model_));
  scheduler_.emplace(*optimizer_, 1, options.gamma);
  plan_ = dist::explain(*model_, kOptimizerStateBytesPerElement);
  if (options.explain || !options.memory_limit.empty()) {
    const std::optional<std::int64_t> limit =
        options.memory_limit.empty() ? std::nullopt : apps::parse_bytes(options.memory_limit);
    predicted_ = apps::will_it_fit(
        session.cpu_world(), plan_, model_bytes_baseline_, per_rank_batch, limit,
        {.global_batch = options.global_batch, .world_size = world_size_, .sharding = plan_.sharding},
        *optimizer_, [&](std::int64_t samples) {
          const std::vector<std::int64_t> first = loader_->batch_indices(epoch_.epoch).front();
          forward_backward(loader_->batch({first.begin(), first.begin() + samples}));
        });
  }
  SHARDLAB_CHECK(!options.resume || !options.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  if (options.resume) resume();
  if (!options.metrics.empty()) metrics_.emplace(options.metrics, session.cpu_world());
  profile_ = apps::StepProfile(options.profile);
  trace_.emplace(options.trace,
                 options.trace.empty()
                     ? apps::TraceSteps{}
                     : apps::parse_trace_steps(
                           options.trace_steps,
                           options.steps > 0 ? options.steps : options.epochs * loader_->batches_per_epoch()),
                 session.cpu_world());

  dist::log(
      "train_cnn: {} training images, {} test images, {} rank{} x {} threads, sharding {}, "
      "global batch {} ({}), {} lr {:g}{}",
      train_set.size(), test_total_, world_size_, world_size_ == 1 ? "" : "s", num_threads(), plan_.sharding,
      options.global_batch, apps::rank_shares(options.global_batch, world_size_), options.optimizer,
      optimizer_->lr(),
      options.mixed_precision == "none" ? "" : ", mixed precision " + options.mixed_precision);
}

void Training::run() {
  if (options_.explain) dist::log("{}{}", plan_.str(), predicted_->str());
  for (; epoch_.epoch <= options_.epochs; epoch_ = {.epoch = epoch_.epoch + 1}) {
    reset_peak_memory(Device::cpu());
    const auto start = std::chrono::steady_clock::now();
    const std::int64_t images_before = epoch_.images;
    const bool complete = train_epoch();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    peak_bytes_ = std::max(peak_bytes_, memory_stats(Device::cpu()).peak_bytes);
    if (!complete) {
      dist::log("train_cnn: stopped after {} steps, in epoch {}", step_, epoch_.epoch);
      break;
    }
    const double train_loss = epoch_.mean_loss();
    dist::log("Train Epoch: {} \tLoss: {:.6f}", epoch_.epoch, train_loss);
    const TestResult tested = evaluate();
    const double accuracy = static_cast<double>(tested.correct) / static_cast<double>(tested.total);
    dist::log("Test set: Average loss: {:.4f}, Accuracy: {}/{} ({:.2f}%)\n", tested.average_loss,
              tested.correct, tested.total, 100.0 * accuracy);
    if (metrics_) {
      metrics_->write({{"rank", rank_},
                       {"epoch", epoch_.epoch},
                       {"step", step_},
                       {"lr", optimizer_->lr()},
                       {"train_loss", train_loss},
                       {"test_loss", tested.average_loss},
                       {"accuracy", accuracy},
                       {"images_per_second", static_cast<double>(epoch_.images - images_before) / seconds},
                       {"peak_memory_bytes", memory_stats(Device::cpu()).peak_bytes}});
    }
    scheduler_->step();
    if (options_.steps > 0 && step_ >= options_.steps) {
      epoch_ = {.epoch = epoch_.epoch + 1};
      break;
    }
  }
  if (!options_.checkpoint_dir.empty() && last_saved_ != training_state()) save_checkpoint();
  if (!options_.save_model.empty()) {
    // A collective: every rank writes its own shards into the one file.
    dist::save_full_safetensors(options_.save_model, *model_, {{"format", "pt"}, {"model", "shardlab Cnn"}});
    dist::log("train_cnn: saved the model to {}", options_.save_model);
  }
  report();
}

bool Training::train_epoch() {
  model_->train();
  const auto batches = loader_->batch_indices(epoch_.epoch);
  std::int64_t mine = 0;
  for (const auto& b : batches) mine += static_cast<std::int64_t>(b.size());
  // The ranks' shares of a global batch differ by a row where W does not divide it.
  const auto total =
      static_cast<std::int64_t>(apps::sum_over_ranks(session_.cpu_world(), {static_cast<double>(mine)})[0]);
  apps::Progress progress(fmt::format("epoch {}", epoch_.epoch), total, "img/s", rank_ == 0);
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t images_before = epoch_.images;
  // A resumed run goes on at the batch where its checkpoint stopped.
  const std::int64_t done = step_ - (epoch_.epoch - 1) * loader_->batches_per_epoch();
  for (auto it = batches.begin() + done; it != batches.end(); ++it) {
    if (options_.steps > 0 && step_ >= options_.steps) return false;
    const auto step_start = std::chrono::steady_clock::now();
    trace_->begin_step(step_ + 1);
    profile_.begin_step(step_ + 1);
    const data::Batch batch = [&] {
      const trace::Span span("load batch", "data");
      return loader_->batch(*it);
    }();
    optimizer_->zero_grad();
    dist::reset_collective_counters(*model_);
    const Variable loss = forward_backward(batch);
    // Every communicator the units use: hybrid sharding's groups are not the world.
    step_bytes_received_ = dist::collective_counters(*model_).total().bytes_received;
    // One all-reduce for the step's loss, images and squared gradient norm, before the update: a
    // non-finite loss or norm skips the step on every rank alike.
    const std::vector<double> global = apps::sum_over_ranks(
        session_.cpu_world(), {loss.data().item<double>(), static_cast<double>(it->size()),
                               dist::local_gradient_sum_of_squares(*model_)});
    const double grad_norm = std::sqrt(global[2]);
    const bool skipped = non_finite_.skip(step_ + 1, global[0] / global[1], grad_norm, checkpoints_);
    if (!skipped) {
      const trace::Span span("optimizer step", "compute");
      optimizer_->step();
    }
    profile_.end_step();
    trace_->end_step();
    ++step_;
    const double step_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count();
    if (step_ > 1) step_ms_.push_back(step_ms);

    const auto images = static_cast<std::int64_t>(global[1]);
    epoch_.images += images;
    if (skipped) {
      epoch_.skipped_images += images;
    } else {
      epoch_.loss_sum += global[0];
    }
    if (metrics_ && options_.steps > 0) {
      metrics_->write({{"rank", rank_},
                       {"step", step_},
                       {"loss", global[0] / global[1]},
                       {"grad_norm", grad_norm},
                       {"skipped", skipped}});
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    progress.update(epoch_.images, epoch_.mean_loss(),
                    static_cast<double>(epoch_.images - images_before) / seconds);
    if (options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0) save_checkpoint();
  }
  return true;
}

// The loss summed over the batch, and its gradients.
Variable Training::forward_backward(const data::Batch& batch) {
  // Dropout masks are keyed by (seed, step, global sample index): the same on any number of ranks.
  const RandomContextGuard context({options_.seed, step_, batch.sample_indices});
  const Variable output = model_(constant(batch.inputs));  // f32: a bf16 root casts its inputs
  const Variable loss = nll_loss(output, batch.targets, -100, Reduction::sum);
  // FSDP averages gradients over the ranks; scaled by W, the average is the gradient of the
  // global batch's summed loss, as one process computes it.
  (loss * static_cast<double>(world_size_)).backward();
  return loss;
}

// What continuing exactly needs besides the shards and the optimizer: the step (which fixes the
// data cursor and the dropout keys), the epoch in progress, the schedule, and what must not change
// between the runs.
nlohmann::json Training::training_state() const {
  return {{"app", "train_cnn"},
          {"step", step_},
          {"epoch", epoch_.epoch},
          {"epoch_loss_sum", epoch_.loss_sum},
          {"epoch_images", epoch_.images},
          {"epoch_skipped_images", epoch_.skipped_images},
          {"scheduler_epoch", scheduler_->epoch()},
          {"seed", options_.seed},
          {"global_batch", options_.global_batch},
          {"training_images", training_images_},
          {"optimizer", options_.optimizer}};
}

void Training::save_checkpoint() {
  last_saved_ = training_state();
  checkpoints_.save(step_, *model_, *optimizer_, last_saved_, "train_cnn");
}

void Training::resume() {
  const apps::CheckpointDir::Resumed resumed =
      checkpoints_.resume(session_.cpu_world(), *model_, *optimizer_, training_state(),
                          {"app", "seed", "global_batch", "training_images", "optimizer"}, "train_cnn");
  const nlohmann::json& state = resumed.state;
  step_ = state["step"].get<std::int64_t>();
  epoch_ = {.epoch = state.at("epoch").get<std::int64_t>(),
            .loss_sum = state.at("epoch_loss_sum").get<double>(),
            .images = state.at("epoch_images").get<std::int64_t>(),
            .skipped_images = state.at("epoch_skipped_images").get<std::int64_t>()};
  scheduler_->set_epoch(state.at("scheduler_epoch").get<std::int64_t>());
  last_saved_ = state;
  const std::int64_t per_epoch = loader_->batches_per_epoch();
  SHARDLAB_CHECK(step_ >= (epoch_.epoch - 1) * per_epoch && step_ <= epoch_.epoch * per_epoch,
                 "--resume: '{}' is at step {}, outside its epoch {} of {} steps", resumed.path, step_,
                 epoch_.epoch, per_epoch);
  SHARDLAB_CHECK(options_.steps == 0 || step_ < options_.steps,
                 "--resume: '{}' is at step {}, and --steps asks for {}", resumed.path, step_,
                 options_.steps);
  SHARDLAB_CHECK(epoch_.epoch <= options_.epochs,
                 "--resume: '{}' has finished {} epochs, and --epochs asks for {}", resumed.path,
                 epoch_.epoch - 1, options_.epochs);
  dist::log("train_cnn: resumed from {} (step {}: epoch {} at batch {} of {})", resumed.path, step_,
            epoch_.epoch, step_ - (epoch_.epoch - 1) * per_epoch, per_epoch);
}

TestResult Training::evaluate() {
  model_->eval();
  const NoGradGuard no_grad;
  // Every forward gathers parameters, so every rank runs the same number of them: rank 0 has
  // the most rows; a rank out of rows forwards its last row again (or the set's first, when it
  // has none) and does not count it.
  const std::int64_t batch_size = (options_.test_batch_size + world_size_ - 1) / world_size_;
  const std::int64_t most_rows = (test_total_ + world_size_ - 1) / world_size_;
  const std::int64_t rows = test_images_.size(0);
  double loss_sum = 0, correct = 0;
  for (std::int64_t start = 0; start < most_rows; start += batch_size) {
    const std::int64_t count = std::clamp<std::int64_t>(rows - start, 0, batch_size);
    if (count == 0) {
      model_(constant(rows > 0 ? test_images_.narrow(0, rows - 1, 1) : test_.images.narrow(0, 0, 1)));
      continue;
    }
    const Tensor targets = test_labels_.narrow(0, start, count);
    const Variable output = model_(constant(test_images_.narrow(0, start, count)));
    loss_sum += nll_loss(output, targets, -100, Reduction::sum).data().item<double>();
    correct += sum(eq(argmax(output.data(), {1}), targets)).item<double>();
  }
  const std::vector<double> global = apps::sum_over_ranks(session_.cpu_world(), {loss_sum, correct});
  return {.average_loss = global[0] / static_cast<double>(test_total_),
          .correct = static_cast<std::int64_t>(global[1]),
          .total = test_total_};
}

// Step time (median of the steps after the first, which also builds caches) and memory, for
// comparing sharding strategies and world sizes.
void Training::report() {
  const double median_ms = apps::median(step_ms_);
  constexpr double kMiB = 1024.0 * 1024.0;
  dist::log("train_cnn: median step {:.1f} ms ({} steps, the first excluded)", median_ms, step_ms_.size());
  non_finite_.report();
  dist::log(
      "train_cnn: rank 0 memory: peak while training {} B ({:.1f} MiB, {:.1f} MiB above the {:.1f} MiB of "
      "loaded data)",
      peak_bytes_, static_cast<double>(peak_bytes_) / kMiB,
      static_cast<double>(peak_bytes_ - data_bytes_) / kMiB, static_cast<double>(data_bytes_) / kMiB);
  // What is left between steps: shards, gradient shards and optimizer state (plus the
  // optimizer's 8-byte step counter per parameter), measured against the plan.
  const std::int64_t persistent = memory_stats(Device::cpu()).bytes_in_use - model_bytes_baseline_;
  dist::log("train_cnn: rank 0 persistent model state: measured {} B, planned {} B + {} step counters of 8 B",
            persistent, plan_.total_persistent_bytes(), dist::sharded_parameters(*model_).size());
  dist::log("train_cnn: rank 0 peak of gathered parameters: measured {} B, planned {} B",
            dist::unsharded_memory().peak_bytes, plan_.peak_unsharded_bytes());
  if (predicted_) {
    dist::log("train_cnn: rank 0 {}", apps::peak_report(*predicted_, peak_bytes_));
  }
  trace_->report("train_cnn", metrics_ ? &*metrics_ : nullptr);
  profile_.report("train_cnn", metrics_ ? &*metrics_ : nullptr, rank_);
  dist::log("train_cnn: rank 0 collectives of the last step: received {} B, planned {} B",
            step_bytes_received_, plan_.bytes_per_step());
  if (metrics_) {
    metrics_->write({{"rank", rank_},
                     {"steps", step_},
                     {"skipped_steps", non_finite_.skipped()},
                     {"median_step_ms", median_ms},
                     {"train_peak_memory_bytes", peak_bytes_},
                     {"data_bytes", data_bytes_},
                     {"persistent_bytes", plan_.total_persistent_bytes()},
                     {"measured_persistent_bytes", persistent},
                     {"step_bytes_received", step_bytes_received_},
                     {"planned_step_bytes", plan_.bytes_per_step()},
                     {"plan", apps::plan_json(plan_)},
                     {"predicted_peak", predicted_ ? apps::prediction_json(*predicted_) : nlohmann::json()}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::unique_ptr<dist::Session> session = apps::start_cpu_session(argc, argv, "train_cnn");
  if (!session) return 1;
  const int rank = session->rank();

  Options options;
  double lr = 0;
  CLI::App app{
      "train_cnn: train the FSDP tutorial's CNN on (Fashion-)MNIST, with FSDP over the ranks of mpirun"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // later flags win
  app.add_option("--data", options.data_dir, "directory with the four IDX files (.gz or plain)");
  app.add_option("--global-batch,--batch-size", options.global_batch,
                 "training batch over all ranks (any world size: rank r takes rows r, r + W, ...)")
      ->check(apps::integer_at_least(1));
  app.add_option("--test-batch-size", options.test_batch_size, "evaluation batch over all ranks")
      ->check(apps::integer_at_least(1));
  app.add_option("--epochs", options.epochs, "epochs to train")->check(apps::integer_at_least(0));
  app.add_option("--steps", options.steps, "stop after N optimizer steps, with one metrics record per step")
      ->check(apps::integer_at_least(1));
  app.add_option("--optimizer", options.optimizer, "adadelta (the tutorial's) or adam");
  CLI::Option* lr_option = app.add_option("--lr", lr, "learning rate (default: Adadelta 1.0, Adam 1e-3)")
                               ->check(apps::number_at_least(0));
  app.add_option("--gamma", options.gamma, "StepLR factor per epoch")->check(apps::number_at_least(0, true));
  app.add_option("--seed", options.seed, "seed of initialisation, shuffling and dropout")
      ->check(apps::integer_at_least(0));
  app.add_option("--limit-train", options.limit_train, "use only the first N training images")
      ->check(apps::integer_at_least(0));
  app.add_option("--limit-test", options.limit_test, "evaluate only the first N test images")
      ->check(apps::integer_at_least(0));
  app.add_option("--sharding", options.sharding, "full, grad_op, none or hybrid:G (G ranks per shard group)");
  app.add_option("--mixed-precision", options.mixed_precision,
                 "none, or bf16 (bf16 gathers and compute, f32 reductions and master shards)");
  app.add_flag("--explain", options.explain, "print the FSDP plan (units, bytes, traffic) before step 1");
  app.add_flag("--profile", options.profile,
               "time every kernel per op over the steps after the first and print where a step goes");
  apps::add_numerics_options(app, options.detect_anomaly, options.max_skipped_steps);
  app.add_option("--save-model", options.save_model, "write the trained weights to this safetensors file");
  app.add_option("--metrics", options.metrics, "write JSON lines of every rank's metrics to this file");
  auto* trace =
      app.add_option("--trace", options.trace,
                     "write a Chrome/Perfetto trace per rank and the merged trace.json into this directory");
  app.add_option("--trace-steps", options.trace_steps,
                 "the steps --trace records, FIRST:LAST (from 1, both included)")
      ->needs(trace);
  app.add_option("--prefetch", options.prefetch, "units whose all-gather is issued ahead")
      ->check(apps::integer_at_least(0));
  app.add_option("--threads", options.threads,
                 "CPU threads per rank (default: the cores this process may use)")
      ->check(apps::integer_at_least(0));
  app.add_option("--checkpoint-dir", options.checkpoint_dir,
                 "save sharded checkpoints here (DIR/step-N), at the end and every --checkpoint-every steps");
  app.add_option("--checkpoint-every", options.checkpoint_every,
                 "steps between checkpoints (0: only at the end)")
      ->check(apps::integer_at_least(0));
  app.add_option("--keep", options.keep, "keep the newest K checkpoints")->check(apps::integer_at_least(1));
  app.add_option("--memory-limit", options.memory_limit,
                 "refuse before step 1 a run whose predicted peak per rank exceeds BYTES (512M, 2G)")
      ->check(apps::byte_count());
  app.add_flag(
      "--resume", options.resume,
      "continue from the newest complete checkpoint in --checkpoint-dir (any world size or sharding)");
  // --help and usage errors, printed once.
  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "train_cnn", rank == 0))
    return *status;
  if (lr_option->count() > 0) options.lr = lr;

  return apps::build_and_run<Training>("train_cnn", *session, options);
}
