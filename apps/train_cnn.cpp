// apps/train_cnn: trains the tutorial CNN (models/cnn.h) on MNIST-format data with FSDP over the
// ranks mpirun starts (one process is a world of 1), following the PyTorch FSDP tutorial:
// Adadelta(lr) + StepLR(gamma), nll_loss summed over the batch, "Train Epoch" and "Test set"
// lines, plus what every training program has (apps/trainer.h): a progress bar, per-rank
// JSON-lines metrics, step timing, sharded checkpoints to resume from (at any world size) and a
// safetensors file.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "apps/cli.h"
#include "apps/support/progress.h"
#include "apps/support/ranks.h"
#include "apps/trainer.h"
#include "autograd/functional.h"
#include "autograd/random_context.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "data/idx.h"
#include "data/loader.h"
#include "dist/checkpoint/full_safetensors.h"
#include "dist/comm/log.h"
#include "dist/fsdp/fsdp.h"
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

struct Options : apps::TrainerOptions {
  Options() {
    global_batch = 64;
    epochs = 10;
  }
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::int64_t test_batch_size = 1000;
  std::string optimizer = "adadelta";
  std::optional<double> lr;  // default: the optimizer's (Adadelta 1.0, Adam 1e-3)
  double gamma = 0.7;
  std::int64_t limit_train = 0;
  std::int64_t limit_test = 0;
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

class Training : public apps::Trainer {
 public:
  Training(const Options& options, dist::Session& session);

 private:
  // The epoch in progress: its loss and images so far (over all ranks), saved with a checkpoint
  // so that a resumed run prints the same "Train Epoch" line as an uninterrupted one. A skipped
  // step's images count as trained but not in the loss.
  struct EpochProgress {
    double loss_sum = 0;
    std::int64_t images = 0, skipped_images = 0;
    double mean_loss() const { return loss_sum / static_cast<double>(images - skipped_images); }
  };

  double global_samples(const data::Batch& on_host) override;
  StepLoss forward_loss(const data::Batch& batch, double samples) override;
  Tensor clip_gradients() override;
  void dry_run(const data::Batch& batch) override { sum(losses(batch)).backward(); }
  nlohmann::json training_state() const override;
  void restore(const nlohmann::json& state, const std::string& path) override;
  void begin_epoch() override;
  void after_step(const StepResult& result) override;
  void end_epoch(bool complete) override;
  void finish() override;
  void report_memory() const override;
  void add_summary(nlohmann::json& summary, double median_seconds) const override;

  Variable losses(const data::Batch& batch);
  TestResult evaluate();

  const Options options_;
  const OptimizerKind optimizer_kind_;  // checked before the data sets load
  data::ImageSet train_, test_;
  std::optional<data::DataLoader> loader_;
  Tensor test_images_, test_labels_;  // this rank's rows r, r + W, ... of the test set
  std::int64_t training_images_ = 0;
  std::int64_t test_total_ = 0;
  models::Cnn model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::optional<optim::StepLR> scheduler_;
  EpochProgress epoch_progress_;
  std::optional<apps::Progress> progress_;  // the epoch's bar
  std::chrono::steady_clock::time_point epoch_began_;
  std::int64_t images_before_ = 0;  // the epoch's images when this run took it up
};

Training::Training(const Options& options, dist::Session& session)
    : apps::Trainer("train_cnn", options, session, /*save_model_is_directory=*/false),
      options_(options),
      optimizer_kind_(parse_optimizer(options.optimizer)),
      model_(shapes_only_cnn(options.seed)) {
  train_ = data::load_mnist(options.data_dir, true);
  test_ = data::load_mnist(options.data_dir, false);
  data_bytes_ = memory_stats(device_).bytes_in_use;
  data::TensorDataset train_set(train_.images, train_.labels);
  if (options.limit_train > 0) train_set = train_set.head(std::min(options.limit_train, train_set.size()));
  training_images_ = train_set.size();
  loader_.emplace(data::rank_loader(train_set, {.size = options.global_batch,
                                                .world_size = world_size_,
                                                .rank = rank_,
                                                .shuffle = true,
                                                .seed = options.seed,
                                                .chunk = chunk_}));
  test_total_ = test_.images.size(0);
  if (options.limit_test > 0) test_total_ = std::min(options.limit_test, test_total_);
  test_images_ = test_.images.slice(0, rank_, test_total_, world_size_).contiguous().to(device_);
  test_labels_ = test_.labels.slice(0, rank_, test_total_, world_size_).contiguous().to(device_);

  // The big layers are units of their own, the root (conv1 and fc2) last. Each rank draws only
  // its shards of the parameters (the values one process would draw): no rank holds the model.
  model_bytes_baseline_ = memory_stats(device_).bytes_in_use;
  model_->to(device_);  // still without bytes: the units draw their shards there
  dist::fully_shard(*model_->conv2, fsdp_);
  dist::fully_shard(*model_->fc1, fsdp_);
  dist::fully_shard(*model_, fsdp_);
  // After fully_shard the model's parameters are this rank's shards: the optimizer holds those.
  optimizer_ = make_optimizer(optimizer_kind_, options.lr, model_->named_parameters());
  scheduler_.emplace(*optimizer_, 1, options.gamma);
  // The loader numbers the epochs from 1, as the tutorial prints them.
  start({.root = &*model_,
         .optimizer = optimizer_.get(),
         .loader = &*loader_,
         .total_steps = options.steps > 0 ? options.steps : options.epochs * loader_->batches_per_epoch(),
         .first_epoch = 1,
         .last_epoch = options.epochs,
         .optimizer_state_bytes_per_element = kOptimizerStateBytesPerElement,
         .unchanged = {"training_images", "optimizer"}});

  dist::log(
      "train_cnn: {} training images, {} test images, {} rank{} x {} threads, sharding {}, "
      "global batch {} ({}), {} lr {:g}{}",
      train_set.size(), test_total_, world_size_, world_size_ == 1 ? "" : "s", num_threads(), plan_.sharding,
      options.global_batch, apps::rank_shares(options.global_batch, world_size_, chunk_), options.optimizer,
      optimizer_->lr(),
      options.mixed_precision == "none" ? "" : ", mixed precision " + options.mixed_precision);
}

void Training::begin_epoch() {
  model_->train();
  std::int64_t mine = 0;
  for (const auto& b : loader_->batch_indices(epoch_)) mine += static_cast<std::int64_t>(b.size());
  // The ranks' shares of a global batch differ by a row where W does not divide it.
  const auto total =
      static_cast<std::int64_t>(apps::sum_over_ranks(session_.cpu_world(), {static_cast<double>(mine)})[0]);
  progress_.emplace(fmt::format("epoch {}", epoch_), total, "img/s", rank_ == 0);
  epoch_began_ = std::chrono::steady_clock::now();
  images_before_ = epoch_progress_.images;
}

double Training::global_samples(const data::Batch& on_host) {
  return apps::sum_over_ranks(session_.cpu_world(), {static_cast<double>(on_host.inputs.size(0))})[0];
}

Training::StepLoss Training::forward_loss(const data::Batch& batch, double images) {
  // The gradient of the global batch's summed loss, as one process computes it.
  return {.losses = losses(batch), .divisor = 1, .samples = images};
}

// The tutorial does not clip: the norm alone, for the records, from every rank's share of the
// squared gradient summed over the ranks on the device.
Tensor Training::clip_gradients() {
  if (options_.bitwise) return optim::gradient_norm_exact(model_->parameters());
  const Tensor sum = dist::local_gradient_sum_of_squares(*model_).to(device_).reshape({1}).clone();
  session_.world().all_reduce(sum, dist::ReduceOp::sum, "gradient norm").wait();
  return sqrt(sum);
}

// The loss of each image of the batch.
Variable Training::losses(const data::Batch& batch) {
  // Dropout masks are keyed by (seed, step, global sample index): the same on any number of ranks.
  const RandomContextGuard context({options_.seed, step_, batch.sample_indices});
  const Variable output = model_(constant(batch.inputs));  // f32: a bf16 root casts its inputs
  return nll_loss(output, batch.targets, -100, Reduction::none);
}

void Training::after_step(const StepResult& result) {
  const auto images = static_cast<std::int64_t>(result.samples);
  epoch_progress_.images += images;
  if (result.skipped) {
    epoch_progress_.skipped_images += images;
  } else {
    epoch_progress_.loss_sum += result.loss * result.samples;
  }
  if (metrics_ && options_.steps > 0) metrics_->write(step_record(result));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_began_).count();
  progress_->update(epoch_progress_.images, epoch_progress_.mean_loss(),
                    static_cast<double>(epoch_progress_.images - images_before_) / seconds);
}

void Training::end_epoch(bool complete) {
  progress_.reset();
  if (!complete) {
    dist::log("train_cnn: stopped after {} steps, in epoch {}", step_, epoch_);
    return;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_began_).count();
  const double train_loss = epoch_progress_.mean_loss();
  dist::log("Train Epoch: {} \tLoss: {:.6f}", epoch_, train_loss);
  const TestResult tested = evaluate();
  const double accuracy = static_cast<double>(tested.correct) / static_cast<double>(tested.total);
  dist::log("Test set: Average loss: {:.4f}, Accuracy: {}/{} ({:.2f}%)\n", tested.average_loss,
            tested.correct, tested.total, 100.0 * accuracy);
  if (metrics_) {
    metrics_->write(
        {{"rank", rank_},
         {"epoch", epoch_},
         {"step", step_},
         {"lr", optimizer_->lr()},
         {"train_loss", train_loss},
         {"test_loss", tested.average_loss},
         {"accuracy", accuracy},
         {"images_per_second", static_cast<double>(epoch_progress_.images - images_before_) / seconds},
         {"peak_memory_bytes", memory_stats(device_).peak_bytes}});
  }
  scheduler_->step();
  epoch_progress_ = {};
}

// What continuing exactly needs besides the step: the epoch in progress, the schedule, and what
// must not change between the runs.
nlohmann::json Training::training_state() const {
  return {{"epoch", epoch_},
          {"epoch_loss_sum", epoch_progress_.loss_sum},
          {"epoch_images", epoch_progress_.images},
          {"epoch_skipped_images", epoch_progress_.skipped_images},
          {"scheduler_epoch", scheduler_->epoch()},
          {"training_images", training_images_},
          {"optimizer", options_.optimizer}};
}

void Training::restore(const nlohmann::json& state, const std::string& path) {
  epoch_ = state.at("epoch").get<std::int64_t>();
  epoch_progress_ = {.loss_sum = state.at("epoch_loss_sum").get<double>(),
                     .images = state.at("epoch_images").get<std::int64_t>(),
                     .skipped_images = state.at("epoch_skipped_images").get<std::int64_t>()};
  scheduler_->set_epoch(state.at("scheduler_epoch").get<std::int64_t>());
  const std::int64_t per_epoch = loader_->batches_per_epoch();
  SHARDLAB_CHECK(step_ >= (epoch_ - 1) * per_epoch && step_ <= epoch_ * per_epoch,
                 "--resume: '{}' is at step {}, outside its epoch {} of {} steps", path, step_, epoch_,
                 per_epoch);
  SHARDLAB_CHECK(options_.steps == 0 || step_ < options_.steps,
                 "--resume: '{}' is at step {}, and --steps asks for {}", path, step_, options_.steps);
  SHARDLAB_CHECK(epoch_ <= options_.epochs, "--resume: '{}' has finished {} epochs, and --epochs asks for {}",
                 path, epoch_ - 1, options_.epochs);
  dist::log("train_cnn: resumed from {} (step {}: epoch {} at batch {} of {})", path, step_, epoch_,
            step_ - (epoch_ - 1) * per_epoch, per_epoch);
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
      model_(constant(rows > 0 ? test_images_.narrow(0, rows - 1, 1)
                               : test_.images.narrow(0, 0, 1).to(device_)));
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

void Training::finish() {
  if (options_.save_model.empty()) return;
  // A collective: every rank writes its own shards into the one file.
  dist::save_full_safetensors(options_.save_model, *model_,
                              {.metadata = {{"format", "pt"}, {"model", "shardlab Cnn"}}});
  dist::log("train_cnn: saved the model to {}", options_.save_model);
}

void Training::report_memory() const {
  constexpr double kMiB = 1024.0 * 1024.0;
  dist::log(
      "train_cnn: rank 0 memory: peak while training {} B ({:.1f} MiB, {:.1f} MiB above the {:.1f} MiB of "
      "loaded data)",
      peak_bytes_, static_cast<double>(peak_bytes_) / kMiB,
      static_cast<double>(peak_bytes_ - data_bytes_) / kMiB, static_cast<double>(data_bytes_) / kMiB);
}

void Training::add_summary(nlohmann::json& summary, double median_seconds) const {
  summary["median_step_ms"] = 1e3 * median_seconds;
}

void add_options(CLI::App& app, Options& options) {
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
  app.add_option_function<double>(
         "--lr", [&options](const double& lr) { options.lr = lr; },
         "learning rate (default: Adadelta 1.0, Adam 1e-3)")
      ->check(apps::number_at_least(0));
  app.add_option("--gamma", options.gamma, "StepLR factor per epoch")->check(apps::number_at_least(0, true));
  app.add_option("--seed", options.seed, "seed of initialisation, shuffling and dropout")
      ->check(apps::integer_at_least(0));
  app.add_option("--limit-train", options.limit_train, "use only the first N training images")
      ->check(apps::integer_at_least(0));
  app.add_option("--limit-test", options.limit_test, "evaluate only the first N test images")
      ->check(apps::integer_at_least(0));
  app.add_option("--save-model", options.save_model, "write the trained weights to this safetensors file");
}

}  // namespace

int main(int argc, char** argv) {
  return apps::training_main<Training, Options>(
      argc, argv, "train_cnn",
      "train_cnn: train the FSDP tutorial's CNN on (Fashion-)MNIST, with FSDP over the ranks of mpirun",
      add_options);
}
