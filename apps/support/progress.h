// apps/support/progress.h: the progress bar of a training run.
#pragma once

#include <cstdint>
#include <string>

namespace shardlab::apps {

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

}  // namespace shardlab::apps
