// apps/support/checkpoint_dir.h: a run's directory of sharded checkpoints, DIR/step-00001000, with
// --keep, and --resume from the newest complete one.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/checkpoint/async_checkpoint.h"
#include "dist/comm/communicator.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace shardlab::apps {

// The sharded checkpoints of a run (dist/checkpoint/checkpoint.h): DIR/step-00001000, ... A checkpoint counts
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
  // As save(), written by `saver`'s thread: returns once the pieces are copied, and the save before
  // it, which it finished, if one was in flight. A save counts once committed (what saver's poll()
  // and finish() return), and committed() then prunes and logs it.
  std::optional<dist::AsyncCheckpointer::Committed> start(dist::AsyncCheckpointer& saver, std::int64_t step,
                                                          nn::Module& root, const optim::Optimizer& optimizer,
                                                          const nlohmann::json& state) const;
  // `when` says what committed it: "" at a step boundary, "before the next save", "at the stop".
  void committed(dist::Communicator& comm, const dist::AsyncCheckpointer::Committed& saved,
                 const char* program, std::string_view when) const;

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
  void prune(dist::Communicator& comm) const;  // on rank 0: all but the newest `keep`

  std::string dir_;
  std::int64_t keep_;
};

}  // namespace shardlab::apps
