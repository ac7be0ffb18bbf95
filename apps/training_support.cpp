// apps/training_support.cpp: sums over ranks, the metrics file, checkpoint directories, the
// predicted training peak and --memory-limit, the progress bar, medians.
#include "apps/training_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "apps/cli.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/profile.h"
#include "core/tensor.h"
#include "dist/checkpoint.h"
#include "dist/checkpoint_reader.h"
#include "dist/fsdp.h"
#include "dist/log.h"

namespace shardlab::apps {

std::vector<double> sum_over_ranks(dist::Communicator& comm, const std::vector<double>& values) {
  const Tensor total = from_vector(values);
  comm.all_reduce(total, dist::ReduceOp::sum, "training").wait();
  return total.to_vector<double>();
}

MetricsFile::MetricsFile(const std::string& path, dist::Communicator& comm) {
  // Rank 0 truncates before anyone appends: the sum over ranks is also the barrier.
  if (comm.rank() == 0) fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
  const int error = errno;
  SHARDLAB_CHECK(sum_over_ranks(comm, {comm.rank() == 0 && fd_ < 0 ? 1.0 : 0.0})[0] == 0,
                 "cannot write metrics to '{}'{}", path,
                 comm.rank() == 0 ? fmt::format(": {}", std::strerror(error)) : "");
  if (comm.rank() != 0) fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND);
  const double failed = sum_over_ranks(comm, {fd_ < 0 ? 1.0 : 0.0})[0];
  SHARDLAB_CHECK(failed == 0, "cannot append metrics to '{}' on {} of {} ranks", path, failed, comm.size());
}

MetricsFile::~MetricsFile() { ::close(fd_); }

void MetricsFile::write(const nlohmann::json& record) const {
  const std::string line = record.dump() + "\n";
  const ssize_t written = ::write(fd_, line.data(), line.size());
  SHARDLAB_CHECK(written == static_cast<ssize_t>(line.size()), "metrics: wrote {} of {} bytes: {}", written,
                 line.size(), std::strerror(errno));
}

void on_rank_zero(dist::Communicator& comm, std::string_view what, const std::function<void()>& work) {
  std::string error;
  if (comm.rank() == 0) {
    try {
      work();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const bool failed = sum_over_ranks(comm, {error.empty() ? 0.0 : 1.0})[0] > 0;
  if (!failed) return;
  if (comm.rank() == 0) throw Error(error);
  fail("{} failed on rank 0", what);
}

void check_output_path(dist::Communicator& comm, std::string_view option, const std::string& path,
                       bool is_directory) {
  on_rank_zero(comm, fmt::format("checking {}", option), [&] {
    namespace fs = std::filesystem;
    std::error_code error;
    fs::path directory = is_directory ? fs::path(path) : fs::path(path).parent_path();
    if (directory.empty()) directory = ".";
    if (is_directory) {
      fs::create_directories(directory, error);
      SHARDLAB_CHECK(!error, "{} '{}': cannot create the directory: {}", option, path, error.message());
    } else {
      SHARDLAB_CHECK(!fs::is_directory(path, error), "{} '{}' is a directory, not a file", option, path);
      SHARDLAB_CHECK(fs::is_directory(directory, error), "{} '{}': '{}' is not an existing directory", option,
                     path, directory.string());
    }
    SHARDLAB_CHECK(::access(directory.c_str(), W_OK) == 0, "{} '{}': cannot write in '{}': {}", option, path,
                   directory.string(), std::strerror(errno));
  });
}

std::string broadcast_text(dist::Communicator& comm, const std::string& text) {
  const Tensor size = from_vector(std::vector<std::int64_t>{static_cast<std::int64_t>(text.size())});
  comm.broadcast(size, 0, "training").wait();
  const Tensor bytes = empty({size.to_vector<std::int64_t>()[0]}, TensorOptions{.dtype = DType::u8});
  if (comm.rank() == 0) std::memcpy(bytes.data<std::uint8_t>(), text.data(), text.size());
  comm.broadcast(bytes, 0, "training").wait();
  return {reinterpret_cast<const char*>(bytes.data<std::uint8_t>()), static_cast<std::size_t>(bytes.numel())};
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A saved field for an error message: whole when short, its start and length when long (a
// recorded tokenizer.json).
std::string brief(const nlohmann::json& value) {
  if (value.is_null()) return "none";
  constexpr std::size_t kShown = 80;
  const std::string text = value.dump();
  return text.size() <= kShown ? text : fmt::format("{}... ({} bytes)", text.substr(0, kShown), text.size());
}

}  // namespace

std::string CheckpointDir::path(std::int64_t step) const { return fmt::format("{}/step-{:08d}", dir_, step); }

std::vector<std::int64_t> CheckpointDir::steps() const {
  std::vector<std::int64_t> steps;
  if (!std::filesystem::is_directory(dir_)) return steps;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    const std::string name = entry.path().filename().string();
    if (name.size() != 13 || !name.starts_with("step-") ||
        name.find_first_not_of("0123456789", 5) != std::string::npos ||
        !std::filesystem::exists(entry.path() / "metadata.json"))
      continue;
    steps.push_back(std::stoll(name.substr(5)));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void CheckpointDir::save(std::int64_t step, nn::Module& root, const optim::Optimizer& optimizer,
                         const nlohmann::json& state, const char* program) const {
  const std::string target = path(step);
  on_rank_zero(dist::root_communicator(root), fmt::format("creating '{}'", dir_),
               [&] { std::filesystem::create_directories(dir_); });
  const auto start = std::chrono::steady_clock::now();
  dist::save_checkpoint(target, root, optimizer, state);
  const double seconds = seconds_since(start);
  if (dist::root_communicator(root).rank() == 0) {
    const std::vector<std::int64_t> saved = steps();
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep_) < saved.size(); ++i) {
      std::filesystem::remove_all(path(saved[i]));
    }
  }
  dist::log("{}: saved checkpoint {} in {:.2f} s", program, target, seconds);
}

CheckpointDir::Resumed CheckpointDir::resume(dist::Communicator& comm, nn::Module& root,
                                             optim::Optimizer& optimizer, const nlohmann::json& now,
                                             const std::vector<std::string>& unchanged,
                                             const char* program) const {
  const std::vector<std::int64_t> saved = steps();
  // Every rank must pick the same checkpoint (they may see the directory at different moments).
  const double newest = saved.empty() ? -1.0 : static_cast<double>(saved.back());
  const std::vector<double> seen = sum_over_ranks(comm, {newest, newest * newest});
  const double mean = seen[0] / comm.size();
  SHARDLAB_CHECK(seen[1] / comm.size() - mean * mean == 0,
                 "--resume: the ranks see different checkpoints in '{}'", dir_);
  SHARDLAB_CHECK(!saved.empty(), "--resume: no complete checkpoint in '{}'", dir_);
  if (comm.rank() == 0) {
    // A save killed before its rename leaves step-N.tmp-<id>: never a checkpoint, only litter.
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("step-") && name.find(".tmp-") != std::string::npos)
        std::filesystem::remove_all(entry);
    }
  }
  Resumed resumed{.path = path(saved.back())};
  // The run's state first (every rank reads the metadata): a changed run is refused by what changed,
  // before the model's shapes are compared with the checkpoint's.
  const nlohmann::json recorded = dist::checkpoint_info(resumed.path).extra;
  for (const std::string& field : unchanged) {
    const nlohmann::json& before = recorded.contains(field) ? recorded[field] : nlohmann::json();
    SHARDLAB_CHECK(before == now.at(field), "--resume: {} was {} when '{}' was saved, now {}", field,
                   brief(before), resumed.path, brief(now.at(field)));
  }
  const auto start = std::chrono::steady_clock::now();
  resumed.state = dist::load_checkpoint(resumed.path, root, optimizer);
  const double seconds = seconds_since(start);
  SHARDLAB_CHECK(resumed.state.contains("step") && resumed.state["step"].is_number_integer(),
                 "--resume: '{}' has no integer step in its training state", resumed.path);
  dist::log("{}: loaded checkpoint {} in {:.2f} s", program, resumed.path, seconds);
  return resumed;
}

void add_numerics_options(CLI::App& app, bool& detect_anomaly, std::int64_t& max_skipped_steps) {
  app.add_flag(
      "--detect-anomaly", detect_anomaly,
      "check every op's result for NaN and every gradient for NaN/Inf; the first names the op (slow)");
  app.add_option(
         "--max-skipped-steps", max_skipped_steps,
         "skip a step whose loss or gradient norm is not finite (no update); stop after more than N in a "
         "row, naming the checkpoint to resume from (0: stop at the first)")
      ->check(apps::integer_at_least(0));
}

int report_failure(const char* program, dist::Session& session, const std::string& message,
                   bool same_everywhere) {
  // Long enough for ranks that fail alike to get there (they fail at the same step, but one may
  // be finishing a save); short next to any collective timeout.
  constexpr std::chrono::seconds kWaitForOthers{3};
  const bool alone = session.world_size() > 1 && !session.every_rank_failed(kWaitForOthers);
  const std::string prefix = session.world_size() > 1 ? fmt::format("[rank {}] ", session.rank()) : "";
  if (alone) {
    std::fputs(fmt::format("{}{}: {}\n{}{}: the other ranks did not fail alike: ending the job\n", prefix,
                           program, message, prefix, program)
                   .c_str(),
               stderr);
    session.abort_job(1);
  }
  if (same_everywhere) {
    if (session.rank() == 0) std::fputs(fmt::format("{}: {}\n", program, message).c_str(), stderr);
  } else {
    std::fputs(fmt::format("{}{}: {}\n", prefix, program, message).c_str(), stderr);  // one write per line
  }
  return 1;
}

std::unique_ptr<dist::Session> start_cpu_session(int& argc, char**& argv, const char* program) {
  try {
    return dist::init(argc, argv, {.device = dist::DeviceChoice::cpu});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return nullptr;
  }
}

namespace {

std::string bytes_text(std::int64_t bytes) {
  return fmt::format("{} B ({:.1f} MiB)", bytes, static_cast<double>(bytes) / (1024.0 * 1024.0));
}

}  // namespace

std::string PeakPrediction::str() const {
  std::string text = fmt::format("training peak per rank, predicted: {}{}\n", bytes_text(total()),
                                 measured ? "" : ", activations not measured");
  const auto line = [&](std::string_view what, std::int64_t bytes) {
    text += fmt::format("  {:<58} {:>14} B\n", what, bytes);
  };
  line("loaded data (in use before the model)", data);
  line("persistent: shards, gradient shards, optimizer state", persistent);
  line("gathered parameters in flight (1 + prefetch units)", gathered);
  line("unsharded gradients until the end of backward", gradients);
  if (measured) {
    line(fmt::format("activations and temporaries ({} samples, {} B each)", micro_batch, per_sample),
         activations);
  }
  return text;
}

std::string peak_report(const PeakPrediction& prediction, std::int64_t measured) {
  const std::int64_t predicted = prediction.total();
  return fmt::format(
      "training peak: measured {} B, predicted {} B ({:+.1f}%); above the {} B of loaded data: measured {} "
      "B, "
      "predicted {} B",
      measured, predicted, 100.0 * static_cast<double>(predicted - measured) / static_cast<double>(measured),
      prediction.data, measured - prediction.data, predicted - prediction.data);
}

nlohmann::json prediction_json(const PeakPrediction& prediction) {
  return {{"total", prediction.total()},         {"data", prediction.data},
          {"persistent", prediction.persistent}, {"gathered", prediction.gathered},
          {"gradients", prediction.gradients},   {"activations", prediction.activations},
          {"per_sample", prediction.per_sample}, {"micro_batch", prediction.micro_batch}};
}

nlohmann::json plan_json(const dist::Plan& plan) {
  std::vector<std::int64_t> unit_parameters;
  for (const dist::UnitPlan& unit : plan.units) unit_parameters.push_back(unit.parameters);
  return {{"world_size", plan.world_size},
          {"sharding", plan.sharding},
          {"shard_group_size", plan.shard_group_size},
          {"optimizer_state_bytes_per_element", plan.optimizer_state_bytes_per_element},
          {"unit_parameters", unit_parameters}};
}

PeakPrediction planned_peak(const dist::Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch) {
  return {.data = data_bytes,
          .persistent = plan.total_persistent_bytes(),
          .gathered = plan.peak_unsharded_bytes(),
          .gradients = plan.gradient_buffer_bytes(),
          .micro_batch = micro_batch};
}

PeakPrediction predict_peak(const dist::Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch,
                            Device device, optim::Optimizer& optimizer,
                            const std::function<void(std::int64_t samples)>& forward_backward) {
  // What one forward/backward adds at its peak to the bytes in use before it.
  const auto added = [&](std::int64_t samples) {
    const std::int64_t before = memory_stats(device).bytes_in_use;
    reset_peak_memory(device);
    forward_backward(samples);
    optimizer.zero_grad();
    return memory_stats(device).peak_bytes - before;
  };
  const std::int64_t half = (micro_batch + 1) / 2;
  added(half);
  // The bytes in use at the start of every step but the first: these and the optimizer state, which
  // its first step allocates.
  const std::int64_t between_steps = memory_stats(device).bytes_in_use + plan.optimizer_state_bytes();
  const std::int64_t at_half = added(half);
  const std::int64_t full = micro_batch > half ? added(micro_batch) : at_half;
  reset_peak_memory(device);
  dist::reset_unsharded_peak();
  PeakPrediction prediction = planned_peak(plan, data_bytes, micro_batch);
  prediction.per_sample = micro_batch > half ? (full - at_half) / (micro_batch - half) : 0;
  prediction.measured = true;
  prediction.activations = between_steps + full - prediction.total();
  return prediction;
}

dist::MixedPrecision parse_mixed_precision(const std::string& text) {
  if (text == "none") return {};
  if (text == "bf16") return {.param_dtype = DType::bf16, .reduce_dtype = DType::f32};
  fail("--mixed-precision: '{}' is not one of none, bf16", text);
}

std::string rank_shares(std::int64_t global_batch, int world_size) {
  const std::int64_t larger = global_batch % world_size;  // ranks 0..larger-1 hold one row more
  const std::int64_t base = global_batch / world_size;
  if (larger == 0) return fmt::format("{} per rank", base);
  const auto ranks = [](std::int64_t first, std::int64_t last) {
    return first == last ? fmt::format("rank {}", first) : fmt::format("ranks {}-{}", first, last);
  };
  return fmt::format("{} on {}, {} on {}", base + 1, ranks(0, larger - 1), base,
                     ranks(larger, world_size - 1));
}

void check_memory_limit(dist::Communicator& comm, const PeakPrediction& prediction, const dist::Plan& plan,
                        std::int64_t limit, const FitLevers& levers) {
  // Every rank's terms, so that every rank words the same message about the same rank.
  constexpr std::size_t kTerms = 6;
  std::vector<double> mine(kTerms * static_cast<std::size_t>(comm.size()), 0.0);
  const std::vector<std::int64_t> terms{prediction.data,      prediction.persistent,  prediction.gathered,
                                        prediction.gradients, prediction.activations, prediction.per_sample};
  for (std::size_t i = 0; i < kTerms; ++i)
    mine[kTerms * static_cast<std::size_t>(comm.rank()) + i] = static_cast<double>(terms[i]);
  const std::vector<double> all = sum_over_ranks(comm, mine);
  int worst = 0;
  std::int64_t worst_total = -1;
  PeakPrediction peak = prediction;
  for (int rank = 0; rank < comm.size(); ++rank) {
    const auto term = [&](std::size_t i) {
      return static_cast<std::int64_t>(all[kTerms * static_cast<std::size_t>(rank) + i]);
    };
    const PeakPrediction theirs{.data = term(0),
                                .persistent = term(1),
                                .gathered = term(2),
                                .gradients = term(3),
                                .activations = term(4),
                                .per_sample = term(5),
                                .micro_batch = prediction.micro_batch,
                                .measured = prediction.measured};
    if (theirs.total() > worst_total) {
      worst = rank;
      worst_total = theirs.total();
      peak = theirs;
    }
  }
  if (worst_total <= limit) return;

  std::vector<std::pair<std::int64_t, std::string>> largest{
      {peak.data, "loaded data"},
      {peak.persistent, "persistent model state (shards, gradient shards, optimizer state)"},
      {peak.gathered, "gathered parameters"},
      {peak.gradients, "unsharded gradients"},
      {peak.activations, fmt::format("activations and temporaries ({} samples)", peak.micro_batch)}};
  std::sort(largest.rbegin(), largest.rend());
  std::string message = fmt::format(
      "will not fit: the predicted training peak of rank {} is {}, over --memory-limit {} by {}\nlargest "
      "terms:",
      worst, bytes_text(worst_total), bytes_text(limit), bytes_text(worst_total - limit));
  for (std::size_t i = 0; i < 3; ++i)
    message += fmt::format(" {} {} B;", largest[i].second, largest[i].first);
  message.back() = '\n';
  message += "what would lower it:";
  const auto suggest = [&](const std::string& change, std::optional<std::int64_t> total) {
    message += fmt::format("\n  {}{}", change,
                           total ? fmt::format(": predicted peak {}, {}", bytes_text(*total),
                                               *total <= limit ? "fits" : "still over")
                                 : "");
  };
  const bool shards_everything = levers.sharding == "full" || levers.sharding == "grad_op";
  // Twice the ranks with the same global batch: half the samples per rank and, where the world is
  // the shard group, half the persistent state.
  const std::int64_t half = (peak.micro_batch + 1) / 2;
  suggest(fmt::format("more ranks (mpirun -np {})", 2 * levers.world_size),
          peak.total_with(half) - (shards_everything ? peak.persistent / 2 : 0));
  if (levers.sharding != "full") {
    // Full sharding over the whole world: the persistent state of one shard group spread over all
    // ranks, and only 1 + prefetch units gathered at once.
    dist::Plan resharded = plan;
    for (std::size_t i = 1; i < resharded.units.size(); ++i)
      resharded.units[i].gathered_through_backward = false;
    const std::int64_t group = levers.sharding == "none" ? 1 : plan.shard_group_size;
    suggest("--sharding full", worst_total - peak.persistent + peak.persistent * group / levers.world_size -
                                   plan.peak_unsharded_bytes() + resharded.peak_unsharded_bytes());
  }
  if (levers.checkpointing_available && !levers.checkpointing)
    suggest("--activation-checkpointing (keeps each layer's input only and recomputes the rest in backward)",
            std::nullopt);
  if (!levers.device.is_cpu()) suggest("--cpu-offload", worst_total - peak.persistent);
  if (peak.per_sample > 0) {
    const std::int64_t fitting =
        peak.micro_batch - (worst_total - limit + peak.per_sample - 1) / peak.per_sample;
    if (fitting >= 1) {
      suggest(fmt::format("--global-batch {} (per-rank batch {})", fitting * levers.world_size, fitting),
              peak.total_with(fitting));
    }
  }
  fail("{}", message);
}

PeakPrediction will_it_fit(dist::Communicator& comm, const dist::Plan& plan, std::int64_t data_bytes,
                           std::int64_t micro_batch, std::optional<std::int64_t> limit,
                           const FitLevers& levers, optim::Optimizer& optimizer,
                           const std::function<void(std::int64_t samples)>& forward_backward) {
  if (limit) check_memory_limit(comm, planned_peak(plan, data_bytes, micro_batch), plan, *limit, levers);
  PeakPrediction prediction =
      predict_peak(plan, data_bytes, micro_batch, levers.device, optimizer, forward_backward);
  if (limit) check_memory_limit(comm, prediction, plan, *limit, levers);
  return prediction;
}

Progress::Progress(std::string label, std::int64_t total, std::string rate_unit, bool shown)
    : label_(std::move(label)),
      rate_unit_(std::move(rate_unit)),
      total_(total),
      shown_(shown),
      tty_(isatty(fileno(stdout)) && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) {}

Progress::~Progress() {
  if (shown_ && tty_ && last_ >= 0 && last_ != total_) std::printf("\n");
}

void Progress::update(std::int64_t done, double loss, double rate) {
  const std::int64_t tenth = std::max<std::int64_t>(1, total_ / 10);
  if (!shown_ || (!tty_ && done != total_ && done / tenth == last_ / tenth)) return;
  last_ = done;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / std::max<std::int64_t>(total_, 1));
  const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
  std::printf("%s%s [%s] %lld/%lld  loss %.4f  %.0f %s%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(),
              static_cast<long long>(done), static_cast<long long>(total_), loss, rate, rate_unit_.c_str(),
              tty_ ? "" : "\n");
  if (tty_ && done == total_) std::printf("\n");
  std::fflush(stdout);
}

TraceSteps parse_trace_steps(const std::string& text, std::int64_t total_steps) {
  TraceSteps steps;
  const auto colon = text.find(':');
  std::size_t first_end = 0, last_end = 0;
  bool parsed = colon != std::string::npos;
  try {
    if (parsed) {
      steps.first = std::stoll(text.substr(0, colon), &first_end);
      steps.last = std::stoll(text.substr(colon + 1), &last_end);
    }
  } catch (const std::exception&) {
    parsed = false;
  }
  SHARDLAB_CHECK(parsed && first_end == colon && last_end == text.size() - colon - 1 && steps.first >= 1 &&
                     steps.first <= steps.last,
                 "--trace-steps '{}': expected FIRST:LAST with 1 <= FIRST <= LAST (steps count from 1, both "
                 "included), e.g. 2:3",
                 text);
  SHARDLAB_CHECK(steps.last <= total_steps,
                 "--trace-steps {}:{} asks for steps the run of {} steps does not have", steps.first,
                 steps.last, total_steps);
  return steps;
}

void StepTrace::begin_step(std::int64_t step) {
  if (dir_.empty() || step < steps_.first || step > steps_.last) return;
  if (!trace::on()) {
    trace::name_this_thread("compute");
    dist::start_trace(*comm_);
  }
  step_ = step;
  step_began_ = trace::Clock::now();
}

void StepProfile::begin_step(std::int64_t step) {
  if (!enabled_ || step < 2) return;
  if (started_) {
    profile::resume();
  } else {
    profile::start();
    started_ = true;
  }
  in_step_ = true;
  began_ = trace::Clock::now();
}

void StepProfile::end_step() {
  if (!in_step_) return;
  profile::stop();
  seconds_ += std::chrono::duration<double>(trace::Clock::now() - began_).count();
  ++steps_;
  in_step_ = false;
}

void StepProfile::report(const char* program, const MetricsFile* metrics, int rank) const {
  if (steps_ == 0) return;
  const std::vector<profile::OpTotal> totals = profile::totals();
  const double steps = static_cast<double>(steps_), step_ms = 1e3 * seconds_ / steps;
  std::string table =
      fmt::format("{}: rank {}'s kernel time per step ({} steps after the first, {:.2f} ms each):\n", program,
                  rank, steps_, step_ms);
  table += fmt::format("  {:<28} {:>10} {:>10} {:>8}\n", "op", "calls", "ms", "% step");
  double kernel_seconds = 0;
  nlohmann::json ops = nlohmann::json::array();
  for (const profile::OpTotal& op : totals) {
    kernel_seconds += op.seconds;
    table +=
        fmt::format("  {:<28} {:>10.1f} {:>10.3f} {:>7.1f}%\n", op.op, static_cast<double>(op.calls) / steps,
                    1e3 * op.seconds / steps, 100 * op.seconds / seconds_);
    ops.push_back({{"op", op.op}, {"calls", op.calls}, {"seconds", op.seconds}});
  }
  table += fmt::format("  {:<28} {:>10} {:>10.3f} {:>7.1f}%\n", "all kernels", "",
                       1e3 * kernel_seconds / steps, 100 * kernel_seconds / seconds_);
  table +=
      fmt::format("  {:<28} {:>10} {:>10.3f} {:>7.1f}%", "outside kernels", "",
                  1e3 * (seconds_ - kernel_seconds) / steps, 100 * (seconds_ - kernel_seconds) / seconds_);
  dist::log("{}", table);
  if (metrics != nullptr) {
    metrics->write(
        {{"rank", rank}, {"profile_steps", steps_}, {"profile_seconds", seconds_}, {"kernels", ops}});
  }
}

StepTrace::StepTrace(std::string dir, TraceSteps steps, dist::Communicator& comm)
    : dir_(std::move(dir)), steps_(steps), comm_(&comm) {
  if (!dir_.empty()) dist::create_trace_directory(comm, dir_);
}

void StepTrace::end_step() {
  if (step_ == 0) return;
  trace::memory_counter();
  trace::complete(fmt::format("step {}", step_), "step", trace::this_thread_track(), step_began_,
                  trace::Clock::now(), {{"step", step_}});
  if (step_ == steps_.last) {
    trace::stop();
    const std::vector<trace::Event> events = trace::take();
    std::vector<dist::StepFigures> figures = dist::step_figures(events);
    figures_.insert(figures_.end(), figures.begin(), figures.end());
    dist::write_trace(*comm_, dir_, events);
    dist::log("trace: wrote {}/trace.json and one trace-rank<R>.json per rank", dir_);
  }
  step_ = 0;
}

void StepTrace::report(const char* program, const MetricsFile* metrics) const {
  for (const dist::StepFigures& figure : figures_) {
    const trace::Overlap& o = figure.overlap;
    std::string waits;
    nlohmann::json wait_json = nlohmann::json::object();
    for (const auto& [unit, seconds] : figure.all_gather_wait) {
      waits += fmt::format(" {}={:.2f}", unit.empty() ? "(root)" : unit, 1e3 * seconds);
      wait_json[unit] = seconds;
    }
    dist::log(
        "{}: rank 0 traced step {}: communication {:.2f} ms, compute {:.2f} ms, exposed communication {:.2f} "
        "ms, "
        "overlap {:.1f}%; all-gather waits (ms):{}",
        program, figure.step, 1e3 * o.communication, 1e3 * o.compute, 1e3 * o.exposed, o.percent(), waits);
    if (metrics) {
      metrics->write({{"rank", comm_->rank()},
                      {"traced_step", figure.step},
                      {"communication_seconds", o.communication},
                      {"compute_seconds", o.compute},
                      {"exposed_communication_seconds", o.exposed},
                      {"overlap_percent", o.percent()},
                      {"all_gather_wait_seconds", wait_json}});
    }
  }
}

namespace {

// A NaN whatever its sign bit (fmt prints "-nan" for some).
std::string number_text(double value) { return std::isnan(value) ? "nan" : fmt::format("{}", value); }

std::string resume_advice(const CheckpointDir& checkpoints) {
  if (checkpoints.dir().empty()) return "there is no checkpoint to resume from (no --checkpoint-dir)";
  const std::vector<std::int64_t> saved = checkpoints.steps();
  if (saved.empty()) return fmt::format("there is no complete checkpoint in '{}'", checkpoints.dir());
  return fmt::format("the newest checkpoint is {}: resume from it with --resume, perhaps with a lower --lr",
                     checkpoints.path(saved.back()));
}

}  // namespace

bool NonFiniteSteps::skip(std::int64_t step, double loss, double grad_norm,
                          const CheckpointDir& checkpoints) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) {
    in_a_row_ = 0;
    return false;
  }
  ++in_a_row_;
  const std::string values =
      fmt::format("the loss ({}) or the gradient norm ({})", number_text(loss), number_text(grad_norm));
  if (in_a_row_ > limit_) {
    const std::int64_t first = step - in_a_row_ + 1;
    fail(
        "stopped at step {}: {} was not finite for {} steps in a row (steps {} to {}), more than "
        "--max-skipped-steps {}; the model is as after step {} (a skipped step changes nothing), and {}",
        step, values, in_a_row_, first, step, limit_, first - 1, resume_advice(checkpoints));
  }
  ++skipped_;
  dist::log(
      "{}: step {} skipped: {} is not finite ({} in a row, {} in all; more than {} in a row stop the run)",
      program_, step, values, in_a_row_, skipped_, limit_);
  return true;
}

void NonFiniteSteps::report() const {
  if (skipped_ > 0)
    dist::log("{}: {} steps skipped for a non-finite loss or gradient norm", program_, skipped_);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

}  // namespace shardlab::apps
