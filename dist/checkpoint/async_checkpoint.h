// dist/checkpoint/async_checkpoint.h: sharded checkpoints written while training goes on (torchtitan's
// asynchronous save): each rank copies its pieces into host memory and returns to training, a thread
// writes them into its file, and the ranks commit the save together at a later step boundary, once
// every rank has written. The same directory, files and metadata as save_checkpoint's.
//
//   dist::AsyncCheckpointer saver(1ll << 30);                  // staging: at most 1 GiB of host memory
//   saver.start("ckpt/step-1000", *model, optimizer, extra);  // returns once the pieces are copied
//   ... train; every step, at the same point on every rank:
//   if (auto saved = saver.poll()) log("saved {}", saved->dir);
//   saver.finish();                                           // before exiting: waits, then commits
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/comm/communicator.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"

namespace shardlab::dist {

namespace detail {
struct SaveTarget;
}

class AsyncCheckpointer {
 public:
  // At most `staging_bytes` (> 0) of host memory per rank hold a save's pieces: a rank's pieces
  // beyond it are written by start() itself, as the buffer fills, and only the last part is left
  // to the thread.
  explicit AsyncCheckpointer(std::int64_t staging_bytes);
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;
  // Waits for the thread's write; a save not committed then leaves only its `dir`.tmp-<id> (the
  // older checkpoint untouched; CheckpointDir's resume removes it).
  ~AsyncCheckpointer();

  // A save committed, as this rank saw it.
  struct Committed {
    std::string dir;
    double blocked_seconds = 0;  // in start(): the copy, and the parts the staging bound wrote there
    double waited_seconds = 0;   // in start(), before those: finishing the save before it
    double seconds = 0;          // from start() to the commit
    std::int64_t bytes = 0;      // this rank's file
  };

  // As save_checkpoint, a collective over root_communicator(root) with the same refusals, except
  // that the pieces are copied (the model and optimizer may change once it returns) and written
  // by a thread; the save counts once poll() or finish() commits it. A save still in flight is
  // finished first (at most one is), and returned. `root` and its communicator must live until
  // the commit.
  std::optional<Committed> start(const std::string& dir, nn::Module& root, const optim::Optimizer& optimizer,
                                 const nlohmann::json& extra = {});
  // Commits the save in flight once every rank's thread has written its file: a collective (one
  // exchange of each rank's state while a save is in flight, nothing otherwise) that every rank
  // calls at the same point, between two steps. A write that failed on any rank is thrown on
  // every rank, the save's temporary directory removed.
  std::optional<Committed> poll();
  // Waits for this rank's write, then commits as poll() does: a collective.
  std::optional<Committed> finish();

  bool in_flight() const { return flight_ != nullptr; }
  std::int64_t waits() const { return waits_; }  // saves whose start() had to finish the one before

 private:
  struct Flight;
  std::optional<Committed> commit_if_written(bool wait);

  std::int64_t staging_bytes_;
  std::vector<char> staging_;  // the flights' buffer, kept from save to save
  std::unique_ptr<Flight> flight_;
  std::int64_t waits_ = 0;
};

}  // namespace shardlab::dist
