// apps/training_support.h: what the training binaries share: sums over ranks, the per-rank
// JSON-lines metrics file, the progress bar and step-time statistics.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/communicator.h"

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

// The median of `values` (0 when empty).
double median(std::vector<double> values);

}  // namespace shardlab::apps
