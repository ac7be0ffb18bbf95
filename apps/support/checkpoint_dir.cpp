// apps/support/checkpoint_dir.cpp: saving, pruning and resuming a run's sharded checkpoints.
#include "apps/support/checkpoint_dir.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "apps/support/ranks.h"
#include "core/error.h"
#include "dist/checkpoint/checkpoint.h"
#include "dist/checkpoint/reader.h"
#include "dist/comm/log.h"
#include "dist/fsdp/fsdp.h"

namespace shardlab::apps {

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
  prune(dist::root_communicator(root));
  dist::log("{}: saved checkpoint {} in {:.2f} s", program, target, seconds);
}

std::optional<dist::AsyncCheckpointer::Committed> CheckpointDir::start(dist::AsyncCheckpointer& saver,
                                                                       std::int64_t step, nn::Module& root,
                                                                       const optim::Optimizer& optimizer,
                                                                       const nlohmann::json& state) const {
  on_rank_zero(dist::root_communicator(root), fmt::format("creating '{}'", dir_),
               [&] { std::filesystem::create_directories(dir_); });
  return saver.start(path(step), root, optimizer, state);
}

void CheckpointDir::committed(dist::Communicator& comm, const dist::AsyncCheckpointer::Committed& saved,
                              const char* program, std::string_view when) const {
  prune(comm);
  dist::log(
      "{}: saved checkpoint {} in the background{}: training blocked {:.3f} s{}, committed after {:.2f} s",
      program, saved.dir, when.empty() ? "" : fmt::format(" (committed {})", when), saved.blocked_seconds,
      saved.waited_seconds > 0
          ? fmt::format(" (and {:.3f} s finishing the save before it)", saved.waited_seconds)
          : "",
      saved.seconds);
}

void CheckpointDir::prune(dist::Communicator& comm) const {
  if (comm.rank() != 0) return;
  const std::vector<std::int64_t> saved = steps();
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep_) < saved.size(); ++i) {
    std::filesystem::remove_all(path(saved[i]));
  }
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

}  // namespace shardlab::apps
