// apps/training_support.h: what the training binaries share: sums over ranks, the per-rank
// JSON-lines metrics file, the directory of sharded checkpoints, the progress bar and step-time
// statistics.
#pragma once

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

#include "dist/communicator.h"
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
  void save(std::int64_t step, nn::Module& root, const optim::Optimizer& optimizer, const nlohmann::json& state,
            const char* program) const;

  struct Resumed {
    std::string path;
    nlohmann::json state;  // the `state` saved with it
  };
  // Loads the newest complete checkpoint into the model's shards and the optimizer, at any world
  // size and sharding; a collective. Refused when the ranks see different newest checkpoints or
  // none, or when one of `unchanged`'s fields of the saved state differs from `now`'s (checked before
  // anything loads). Removes what crashed saves left (step-N.tmp-*) first. Logs the path and the time.
  Resumed resume(dist::Communicator& comm, nn::Module& root, optim::Optimizer& optimizer,
                 const nlohmann::json& now, const std::vector<std::string>& unchanged, const char* program) const;

  // The steps of the complete checkpoints, oldest first.
  std::vector<std::int64_t> steps() const;
  std::string path(std::int64_t step) const;

 private:
  std::string dir_;
  std::int64_t keep_;
};

// dist::init on the CPU (even where a GPU answers), for `program`; null, after printing why on
// stderr, when the processes cannot start.
std::unique_ptr<dist::Session> start_cpu_session(int& argc, char**& argv, const char* program);

// Builds Training(options, session) on every rank, then runs it; returns the exit status. Errors
// while building are the same on every rank, so rank 0 reports them; errors while training may be
// one rank's own, so each reports its own, prefixed with its rank.
template <typename Training, typename Options>
int build_and_run(const char* program, dist::Session& session, const Options& options) {
  std::optional<Training> training;
  try {
    training.emplace(options, session);
  } catch (const std::exception& e) {
    if (session.rank() == 0) std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
  try {
    training->run();
  } catch (const std::exception& e) {
    const std::string prefix = session.world_size() > 1 ? fmt::format("[rank {}] ", session.rank()) : "";
    std::fputs(fmt::format("{}{}: {}\n", prefix, program, e.what()).c_str(), stderr);  // one write per line
    return 1;
  }
  return 0;
}

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
class StepTrace {
 public:
  StepTrace(std::string dir, TraceSteps steps, dist::Communicator& comm)
      : dir_(std::move(dir)), steps_(steps), comm_(&comm) {}

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

// The median of `values` (0 when empty).
double median(std::vector<double> values);

}  // namespace shardlab::apps
