// apps/training_support.h: what the training binaries share: sums over ranks, the per-rank
// JSON-lines metrics file, the directory of sharded checkpoints, the predicted training peak and
// --memory-limit, the progress bar, skipping non-finite steps and step-time statistics.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "apps/cli.h"
#include "autograd/anomaly.h"
#include "core/device.h"
#include "dist/communicator.h"
#include "dist/fsdp.h"
#include "dist/init.h"
#include "dist/trace.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace shardlab::apps {

// The element-wise sums of `values` over all ranks of `comm` (f64: counts stay exact).
std::vector<double> sum_over_ranks(dist::Communicator& comm, const std::vector<double>& values);

// The --metrics file: rank 0 truncates it, then every rank appends whole JSON lines, each with
// one write() on an O_APPEND descriptor, so the ranks' records never interleave within a line.
class MetricsFile {
 public:
  MetricsFile(const std::string& path, dist::Communicator& comm);
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

  void write(const nlohmann::json& record) const;

 private:
  int fd_ = -1;
};

// Runs `work` on rank 0 only. Its failure is thrown on every rank (rank 0's with its message, the
// others' naming `what`), so that no rank waits in a collective that rank 0 never reaches.
void on_rank_zero(dist::Communicator& comm, std::string_view what, const std::function<void()>& work);

// Checks before step 1 (on rank 0, failing on every rank) that the run can write `path`, given by
// `option`: a directory (`is_directory`: created now, as the run would create it) or a file whose
// directory exists; either writable. An output the run could not write would otherwise cost it
// at the end.
void check_output_path(dist::Communicator& comm, std::string_view option, const std::string& path,
                       bool is_directory);

// Rank 0's `text` on every rank (the others' `text` is ignored); a collective.
std::string broadcast_text(dist::Communicator& comm, const std::string& text);

// The sharded checkpoints of a run (dist/checkpoint.h): DIR/step-00001000, ... A checkpoint counts
// once its metadata.json exists (a save renames it into place complete), so a crash mid-save never
// costs an older one, and --keep counts complete ones only.
class CheckpointDir {
 public:
  CheckpointDir(std::string dir, std::int64_t keep) : dir_(std::move(dir)), keep_(keep) {}

  // Saves the run's state at `step` (replacing a checkpoint of that step), then removes all but
  // the newest `keep`; a collective. `state` is what continuing exactly needs besides the shards
  // and the optimizer. Logs the path and the time.
  void save(std::int64_t step, nn::Module& root, const optim::Optimizer& optimizer,
            const nlohmann::json& state, const char* program) const;

  struct Resumed {
    std::string path;
    nlohmann::json state;  // the `state` saved with it
  };
  // Loads the newest complete checkpoint into the model's shards and the optimizer, at any world
  // size and sharding; a collective. Refused when the ranks see different newest checkpoints or
  // none, or when one of `unchanged`'s fields of the saved state differs from `now`'s (checked before
  // anything loads). Removes what crashed saves left (step-N.tmp-*) first. Logs the path and the time.
  Resumed resume(dist::Communicator& comm, nn::Module& root, optim::Optimizer& optimizer,
                 const nlohmann::json& now, const std::vector<std::string>& unchanged,
                 const char* program) const;

  // The steps of the complete checkpoints, oldest first.
  std::vector<std::int64_t> steps() const;
  std::string path(std::int64_t step) const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::int64_t keep_;
};

// dist::init on the CPU (even where a GPU answers), for `program`; null, after printing why on
// stderr, when the processes cannot start.
std::unique_ptr<dist::Session> start_cpu_session(int& argc, char**& argv, const char* program);

// --mixed-precision: "none", or "bf16" (bf16 gathers and compute, f32 reductions and master shards).
dist::MixedPrecision parse_mixed_precision(const std::string& text);

// How a global batch splits over the ranks, for the start-up line: "32 per rank", or where W does
// not divide G, "22 on rank 0, 21 on ranks 1-2" (data::rank_batch_size).
std::string rank_shares(std::int64_t global_batch, int world_size);

// --detect-anomaly and --max-skipped-steps, the same in both training binaries.
void add_numerics_options(CLI::App& app, bool& detect_anomaly, std::int64_t& max_skipped_steps);

// After a rank's error: when every rank failed (within a few seconds), prints it (on rank 0 only
// when `same_everywhere`, errors while building being the same on all ranks, else on each rank
// with its prefix) and returns 1. When only some ranks failed, the others would wait for them in
// a collective until the watchdog fires: the rank prints its error, saying so, and ends the job.
int report_failure(const char* program, dist::Session& session, const std::string& message,
                   bool same_everywhere);

// Builds Training(options, session) on every rank, then runs it; returns the exit status.
template <typename Training, typename Options>
int build_and_run(const char* program, dist::Session& session, const Options& options) {
  std::optional<Training> training;
  try {
    training.emplace(options, session);
  } catch (const std::exception& e) {
    return report_failure(program, session, e.what(), true);
  }
  try {
    // Only around training: the dry runs of the plan need no checks.
    const autograd::DetectAnomaly detect(options.detect_anomaly);
    training->run();
  } catch (const std::exception& e) {
    return report_failure(program, session, e.what(), false);
  }
  return 0;
}

// --- will it fit? -------------------------------------------------------------------------------

// One rank's predicted peak of allocator bytes while training, as terms that add up to it. The
// plan gives the model state and what FSDP gathers and reduces; a dry forward/backward of the
// run's micro-batch measures the rest (activations and temporaries). Measured, not extrapolated
// from a smaller batch: with resharding, a small batch peaks while parameters are gathered and a
// large one while activations are live, so the peak is not linear in the samples (1 and 2 samples
// extrapolated to 12 missed the tiny Llama's peak by 11%). A second run of half the samples gives
// the per-sample slope that the refusal's batch suggestions use.
struct PeakPrediction {
  std::int64_t data = 0;         // in use before the model existed: the loaded data (measured)
  std::int64_t persistent = 0;   // shards, gradient shards and optimizer state (plan)
  std::int64_t gathered = 0;     // gathered parameters in flight: 1 + prefetch units (plan)
  std::int64_t gradients = 0;    // unsharded gradients until the end of backward (plan)
  std::int64_t activations = 0;  // the rest of the forward/backward peak (dry run); 0 before it
  std::int64_t per_sample = 0;   // activations' growth per sample, from micro-batches of half and all
  std::int64_t micro_batch = 0;  // samples per rank and step
  bool measured = false;         // whether a dry run measured the activations

  std::int64_t total() const { return data + persistent + gathered + gradients + activations; }
  // The same run with `samples` per rank instead of micro_batch.
  std::int64_t total_with(std::int64_t samples) const {
    return total() + (samples - micro_batch) * per_sample;
  }
  std::string str() const;  // the terms, one a line, as --explain prints them
};
// "training peak: measured M B, predicted P B (+1.2%); above the D B of loaded data: ...".
std::string peak_report(const PeakPrediction& prediction, std::int64_t measured);
// {"total": ..., "data": ..., ...}: what the metrics files record.
nlohmann::json prediction_json(const PeakPrediction& prediction);
// {"world_size", "sharding", "shard_group_size", "optimizer_state_bytes_per_element", "unit_parameters"}:
// what the summary records so that scripts/plot can recompute the plan's formulas per world size.
nlohmann::json plan_json(const dist::Plan& plan);

// The peak the plan alone predicts: activations not yet measured (a lower bound).
PeakPrediction planned_peak(const dist::Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch);

// planned_peak plus the activations: `forward_backward(n)` runs the step's forward and backward on
// n samples of a batch (on every rank: a collective). Three runs, of half the micro-batch (not
// measured: it records FSDP's unit order and builds caches), half and all of it; each ends with
// optimizer.zero_grad(), no step, so the parameters and the optimizer are untouched. Resets the allocator's
// and FSDP's peaks after.
PeakPrediction predict_peak(const dist::Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch,
                            Device device, optim::Optimizer& optimizer,
                            const std::function<void(std::int64_t samples)>& forward_backward);

// What a run can change to use less memory, for the refusal's suggestions.
struct FitLevers {
  std::int64_t global_batch = 0;
  int world_size = 1;
  std::string sharding;                                         // dist::Plan::sharding
  bool checkpointing_available = false, checkpointing = false;  // --activation-checkpointing
  Device device = Device::cpu();                                // --cpu-offload frees a GPU only
};

// Throws on every rank when some rank's predicted peak exceeds `limit`, with one message (the
// same on every rank, of the rank with the highest peak) naming the peak, the limit, the largest
// terms and what would bring it under, with each change's predicted peak where the terms give
// it. A collective.
void check_memory_limit(dist::Communicator& comm, const PeakPrediction& prediction, const dist::Plan& plan,
                        std::int64_t limit, const FitLevers& levers);

// What --explain and --memory-limit run before step 1: with a limit, planned_peak is checked
// first (a run whose model state alone does not fit allocates nothing more), then predict_peak's
// prediction, which this returns.
PeakPrediction will_it_fit(dist::Communicator& comm, const dist::Plan& plan, std::int64_t data_bytes,
                           std::int64_t micro_batch, std::optional<std::int64_t> limit,
                           const FitLevers& levers, optim::Optimizer& optimizer,
                           const std::function<void(std::int64_t samples)>& forward_backward);

// A progress bar redrawn in place on a terminal; a plain line every tenth of the run otherwise.
// Only the rank that shows it draws. Open MPI hands its ranks a pseudo-terminal whatever
// mpirun's own output is (a log file, a pipe), so under mpirun (OMPI_COMM_WORLD_SIZE set) the
// lines are plain:  "epoch 1 [#####.....] 320/600  loss 0.4123  1520 img/s".
class Progress {
 public:
  Progress(std::string label, std::int64_t total, std::string rate_unit, bool shown);
  // Ends a bar that an early stop left open.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void update(std::int64_t done, double loss, double rate);

 private:
  std::string label_, rate_unit_;
  std::int64_t total_, last_ = -1;
  bool shown_, tty_;
};

// --trace-steps FIRST:LAST: the steps (counted from 1, both included) that --trace records; refused
// unless 1 <= FIRST <= LAST <= total_steps.
struct TraceSteps {
  std::int64_t first = 2, last = 3;
};
TraceSteps parse_trace_steps(const std::string& text, std::int64_t total_steps);

// --trace DIR: records the steps `steps` selects on every rank (dist/trace.h), then writes the
// trace files and keeps the figures per step for report(). Off (empty DIR), each call is a branch.
//   trace.begin_step(step + 1);  ... the step ...  trace.end_step();
// --profile: the kernels' time per op name (core/profile.h) over the steps after the first (which
// builds caches), next to the wall time of those steps from begin_step to end_step; evaluation
// and checkpoints between them are not counted. At the end, a table on rank 0 (where a step's time
// goes: each op's calls and milliseconds per step and share of it, and what no kernel accounts for:
// autograd, FSDP's bookkeeping, collectives, allocation) and every rank's totals in the metrics.
class StepProfile {
 public:
  explicit StepProfile(bool enabled) : enabled_(enabled) {}
  void begin_step(std::int64_t step);
  void end_step();
  void report(const char* program, const MetricsFile* metrics, int rank) const;

 private:
  bool enabled_;
  bool started_ = false, in_step_ = false;
  std::int64_t steps_ = 0;
  double seconds_ = 0;
  trace::Clock::time_point began_;
};

class StepTrace {
 public:
  // Creates `dir` (when given) first, a collective: a directory that cannot be made fails before step 1.
  StepTrace(std::string dir, TraceSteps steps, dist::Communicator& comm);

  void begin_step(std::int64_t step);
  void end_step();
  // Prints rank 0's figures and writes every rank's to `metrics` (when given), one line per step.
  void report(const char* program, const MetricsFile* metrics) const;

 private:
  std::string dir_;
  TraceSteps steps_;
  dist::Communicator* comm_;
  std::int64_t step_ = 0;  // the step being recorded, 0 when none
  trace::Clock::time_point step_began_;
  std::vector<dist::StepFigures> figures_;
};

// Steps whose loss or global gradient norm is not finite (a NaN or an overflow somewhere in forward
// or backward). Such a step is skipped: the parameters and the optimizer state stay as they were
// (the step still counts: its batch is consumed and the schedule moves on, as PyTorch's GradScaler
// does). Each skip is counted and logged; more than `limit` in a row stop the run with an error that
// names the newest checkpoint to resume from. The loss and the norm must be sums over the ranks, so
// that every rank skips, or stops, at the same step.
class NonFiniteSteps {
 public:
  NonFiniteSteps(const char* program, std::int64_t limit) : program_(program), limit_(limit) {}

  // Whether step `step` (from 1) is to be skipped; throws when it is one more than `limit` in a row.
  bool skip(std::int64_t step, double loss, double grad_norm, const CheckpointDir& checkpoints);
  std::int64_t skipped() const { return skipped_; }
  // Logs how many steps were skipped, when any were.
  void report() const;

 private:
  const char* program_;
  std::int64_t limit_;
  std::int64_t in_a_row_ = 0, skipped_ = 0;
};

// The median of `values` (0 when empty).
double median(std::vector<double> values);

}  // namespace shardlab::apps
