// apps/train_cnn: trains the seed CNN (models/cnn.h) on MNIST-format data, following the
// PyTorch FSDP tutorial: Adadelta(lr) + StepLR(gamma), nll_loss summed over the batch,
// "Train Epoch" and "Test set" lines, plus a progress bar, JSON-lines metrics and a
// safetensors model file.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "autograd/functional.h"
#include "autograd/random_context.h"
#include "core/allocator.h"
#include "core/parallel.h"
#include "data/idx.h"
#include "data/loader.h"
#include "models/cnn.h"
#include "nn/safetensors.h"
#include "optim/optimizer.h"
#include "optim/scheduler.h"

using namespace shardlab;

namespace {

struct Options {
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::int64_t batch_size = 64;
  std::int64_t test_batch_size = 1000;
  std::int64_t epochs = 10;
  double lr = 1.0;
  double gamma = 0.7;
  std::uint64_t seed = 1;
  std::int64_t limit_train = 0;
  std::string save_model;
  std::string metrics;
  int threads = 0;
};

// A progress bar redrawn in place on a terminal; a plain line every tenth of the epoch otherwise.
class Progress {
 public:
  Progress(std::int64_t epoch, std::int64_t total)
      : epoch_(epoch), total_(total), tty_(isatty(fileno(stdout))) {}

  void update(std::int64_t done, double loss, double images_per_second) {
    const std::int64_t tenth = std::max<std::int64_t>(1, total_ / 10);
    if (!tty_ && done != total_ && done / tenth == last_ / tenth) return;
    last_ = done;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done / std::max<std::int64_t>(total_, 1));
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    std::printf("%sepoch %lld [%s] %lld/%lld  loss %.4f  %.0f img/s%s", tty_ ? "\r" : "",
                static_cast<long long>(epoch_), bar.c_str(), static_cast<long long>(done),
                static_cast<long long>(total_), loss, images_per_second, tty_ ? "" : "\n");
    if (tty_ && done == total_) std::printf("\n");
    std::fflush(stdout);
  }

 private:
  std::int64_t epoch_, total_, last_ = -1;
  bool tty_;
};

struct EpochResult {
  double loss_sum = 0;
  std::int64_t images = 0;
  double seconds = 0;
};

EpochResult train_epoch(models::Cnn& model, optim::Optimizer& optimizer, const data::DataLoader& loader,
                        const Options& options, std::int64_t epoch, std::int64_t& step) {
  model->train();
  EpochResult result;
  const auto batches = loader.batch_indices(epoch);
  std::int64_t total = 0;
  for (const auto& b : batches) total += static_cast<std::int64_t>(b.size());
  Progress progress(epoch, total);
  const auto start = std::chrono::steady_clock::now();
  for (const auto& indices : batches) {
    const data::Batch batch = loader.batch(indices);
    // Dropout masks are keyed by (seed, step, global sample index): the same on any number of ranks.
    const RandomContextGuard context({options.seed, step, batch.sample_indices});
    optimizer.zero_grad();
    const Variable output = model(constant(batch.inputs));
    const Variable loss = nll_loss(output, batch.targets, -100, Reduction::sum);
    loss.backward();
    optimizer.step();
    ++step;
    result.loss_sum += loss.data().item<double>();
    result.images += static_cast<std::int64_t>(indices.size());
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    progress.update(result.images, result.loss_sum / static_cast<double>(result.images),
                    static_cast<double>(result.images) / result.seconds);
  }
  return result;
}

struct TestResult {
  double average_loss = 0;
  std::int64_t correct = 0, total = 0;
};

TestResult evaluate(models::Cnn& model, const data::ImageSet& test, std::int64_t batch_size) {
  model->eval();
  const NoGradGuard no_grad;
  TestResult result;
  double loss_sum = 0;
  const std::int64_t n = test.images.size(0);
  for (std::int64_t start = 0; start < n; start += batch_size) {
    const std::int64_t count = std::min(batch_size, n - start);
    const Tensor targets = test.labels.narrow(0, start, count);
    const Variable output = model(constant(test.images.narrow(0, start, count)));
    loss_sum += nll_loss(output, targets, -100, Reduction::sum).data().item<double>();
    result.correct += sum(eq(argmax(output.data(), {1}), targets)).item<std::int64_t>();
  }
  result.total = n;
  result.average_loss = loss_sum / static_cast<double>(n);
  return result;
}

void run(const Options& options) {
  if (options.threads > 0) set_num_threads(options.threads);
  data::ImageSet train = data::load_mnist(options.data_dir, true);
  const data::ImageSet test = data::load_mnist(options.data_dir, false);
  data::TensorDataset train_set(train.images, train.labels);
  if (options.limit_train > 0) train_set = train_set.head(std::min(options.limit_train, train_set.size()));
  const data::DataLoader loader(train_set, options.batch_size,
                                std::make_shared<data::RandomSampler>(train_set.size(), options.seed));
  std::printf("train_cnn: %lld training images, %lld test images, %d threads\n",
              static_cast<long long>(train_set.size()), static_cast<long long>(test.images.size(0)),
              num_threads());

  models::Cnn model(options.seed);
  optim::Adadelta optimizer(model->named_parameters(), {.lr = options.lr});
  optim::StepLR scheduler(optimizer, 1, options.gamma);
  std::ofstream metrics;
  if (!options.metrics.empty()) {
    metrics.open(options.metrics);
    SHARDLAB_CHECK(metrics.good(), "train_cnn: cannot write metrics to '{}'", options.metrics);
  }

  std::int64_t step = 0;
  for (std::int64_t epoch = 1; epoch <= options.epochs; ++epoch) {
    reset_peak_memory(Device::cpu());
    const EpochResult trained = train_epoch(model, optimizer, loader, options, epoch, step);
    const double train_loss = trained.loss_sum / static_cast<double>(trained.images);
    std::printf("Train Epoch: %lld \tLoss: %.6f\n", static_cast<long long>(epoch), train_loss);
    const TestResult tested = evaluate(model, test, options.test_batch_size);
    const double accuracy = 100.0 * static_cast<double>(tested.correct) / static_cast<double>(tested.total);
    std::printf("Test set: Average loss: %.4f, Accuracy: %lld/%lld (%.2f%%)\n\n", tested.average_loss,
                static_cast<long long>(tested.correct), static_cast<long long>(tested.total), accuracy);
    std::fflush(stdout);
    if (metrics.is_open()) {
      const nlohmann::json line = {
          {"epoch", epoch},
          {"step", step},
          {"lr", optimizer.lr()},
          {"train_loss", train_loss},
          {"test_loss", tested.average_loss},
          {"accuracy", accuracy / 100.0},
          {"images_per_second", static_cast<double>(trained.images) / trained.seconds},
          {"peak_memory_bytes", memory_stats(Device::cpu()).peak_bytes}};
      metrics << line.dump() << '\n' << std::flush;
    }
    scheduler.step();
  }
  if (!options.save_model.empty()) {
    nn::save_safetensors(options.save_model, model->state_dict(),
                         {{"format", "pt"}, {"model", "shardlab Cnn"}});
    std::printf("train_cnn: saved the model to %s\n", options.save_model.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"train_cnn: train the seed CNN on (Fashion-)MNIST"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // later flags win
  app.add_option("--data", options.data_dir, "directory with the four IDX files (.gz or plain)");
  app.add_option("--batch-size", options.batch_size, "training batch size")->check(CLI::PositiveNumber);
  app.add_option("--test-batch-size", options.test_batch_size, "evaluation batch size")
      ->check(CLI::PositiveNumber);
  app.add_option("--epochs", options.epochs, "epochs to train")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", options.lr, "Adadelta learning rate")->check(CLI::NonNegativeNumber);
  app.add_option("--gamma", options.gamma, "StepLR factor per epoch")->check(CLI::PositiveNumber);
  app.add_option("--seed", options.seed, "seed of initialisation, shuffling and dropout");
  app.add_option("--limit-train", options.limit_train, "use only the first N training images")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--save-model", options.save_model, "write the trained weights to this safetensors file");
  app.add_option("--metrics", options.metrics, "append one JSON object per epoch to this file");
  app.add_option("--threads", options.threads, "CPU threads (default: the cores this process may use)");
  CLI11_PARSE(app, argc, argv);
  try {
    run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_cnn: %s\n", e.what());
    return 1;
  }
  return 0;
}
