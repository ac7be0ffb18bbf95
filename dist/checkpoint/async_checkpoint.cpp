// dist/checkpoint/async_checkpoint.cpp: a save spread over the steps of training: start() runs the save's
// first steps (dist/checkpoint/save_steps.h) into a staging buffer and leaves the last part of the
// rank file to a thread; poll() and finish() exchange each rank's state and, once all have written,
// run the save's last step (the metadata, rank 0's commit).
#include "dist/checkpoint/async_checkpoint.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/checkpoint/format.h"
#include "dist/checkpoint/save_steps.h"
#include "dist/comm/agreement.h"

namespace shardlab::dist {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// One save between start() and its commit. The thread owns `file`, `staged` and `crc` until it
// sets `written`; `error` is its failure.
struct AsyncCheckpointer::Flight {
  Communicator* comm = nullptr;
  detail::SaveTarget target;
  nn::Named<ParameterShard> shards;
  std::string sharding;
  nlohmann::json extra, mine;
  std::unique_ptr<Fd> file;
  std::vector<char>& staged;  // the pieces not written yet, from byte `staged_at` of the file
  std::uint64_t staged_at = 0;
  std::size_t staged_bytes = 0;
  std::uint32_t crc = 0;  // of the file up to `staged_at`, then of all of it
  std::thread writer;
  std::atomic<bool> written{false};
  std::string error;
  std::chrono::steady_clock::time_point started;
  double blocked_seconds = 0, waited_seconds = 0;

  explicit Flight(std::vector<char>& buffer) : staged(buffer) {}

  // The staged bytes into the file, the CRC carried on: the buffer is free again.
  void write_staged() {
    file->pwrite_all(staged.data(), staged_bytes, staged_at, target.where);
    crc = detail::crc_update(crc, staged.data(), staged_bytes);
    staged_at += staged_bytes;
    staged_bytes = 0;
  }
  // Takes the pieces in file order; a full buffer is written first.
  void stage(const void* data, std::size_t bytes) {
    const auto* from = static_cast<const char*>(data);
    while (bytes > 0) {
      if (staged_bytes == staged.size()) write_staged();
      const std::size_t take = std::min(bytes, staged.size() - staged_bytes);
      std::memcpy(staged.data() + staged_bytes, from, take);
      staged_bytes += take;
      from += take;
      bytes -= take;
    }
  }
  // On the thread, at the lowest priority: where training keeps every core busy (ranks on a CPU),
  // the write takes the time they leave instead of slowing their steps.
  void write_rest() {
    setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
    try {
      write_staged();
      file->sync(target.where);
      file->close(target.where);
    } catch (const std::exception& e) {
      error = e.what();
    }
    written.store(true, std::memory_order_release);
  }
};

AsyncCheckpointer::AsyncCheckpointer(std::int64_t staging_bytes) : staging_bytes_(staging_bytes) {
  SHARDLAB_CHECK(staging_bytes > 0, "AsyncCheckpointer: the staging bound must be positive, got {} bytes",
                 staging_bytes);
}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (flight_ && flight_->writer.joinable()) flight_->writer.join();
}

std::optional<AsyncCheckpointer::Committed> AsyncCheckpointer::start(const std::string& dir, nn::Module& root,
                                                                     const optim::Optimizer& optimizer,
                                                                     const nlohmann::json& extra) {
  const auto started = std::chrono::steady_clock::now();
  std::optional<Committed> previous;
  if (flight_) {
    ++waits_;
    previous = finish();
  }
  auto flight = std::make_unique<Flight>(staging_);
  Flight& f = *flight;
  f.started = started;
  f.waited_seconds = previous ? seconds_since(started) : 0;
  f.comm = &root_communicator(root);
  f.shards = parameter_shards(root);
  f.sharding = explain(root).sharding;
  f.extra = extra;
  f.target = detail::begin_save(*f.comm, dir, "save_checkpoint");
  const std::string& where = f.target.where;
  const std::string error = detail::attempt(where, [&] {
    const detail::OptimizerState state = detail::split_state(optimizer.state_dict(), f.shards, where);
    // The file's size from a description without bytes: the buffer need not be larger.
    const std::int64_t bytes =
        detail::describe_pieces(nullptr, /*compact=*/true, f.target.file, f.shards, state, where)["bytes"];
    // Kept from save to save: its pages are touched once.
    const auto size = static_cast<std::size_t>(std::min(bytes, staging_bytes_));
    if (f.staged.size() < size) f.staged.resize(size);
    f.file =
        std::make_unique<Fd>(join_path(f.target.temp, f.target.file), O_WRONLY | O_CREAT | O_TRUNC, where);
    f.crc = detail::crc_update(0, nullptr, 0);
    const auto sink = [&](const void* data, std::size_t size, std::uint64_t) { f.stage(data, size); };
    f.mine = detail::describe_pieces(sink, /*compact=*/true, f.target.file, f.shards, state, where);
  });
  if (auto failed = detail::first_error(*f.comm, error)) {
    detail::abandon_save(*f.comm, f.target);
    throw Error(*failed);
  }
  f.blocked_seconds = seconds_since(started) - f.waited_seconds;
  f.writer = std::thread([&f] { f.write_rest(); });
  flight_ = std::move(flight);
  return previous;
}

std::optional<AsyncCheckpointer::Committed> AsyncCheckpointer::poll() { return commit_if_written(false); }

std::optional<AsyncCheckpointer::Committed> AsyncCheckpointer::finish() { return commit_if_written(true); }

std::optional<AsyncCheckpointer::Committed> AsyncCheckpointer::commit_if_written(bool wait) {
  if (!flight_) return std::nullopt;
  Flight& f = *flight_;
  if (wait) f.writer.join();
  // "w": written; "p": still writing; else the write's error.
  std::string state = "p";
  if (f.written.load(std::memory_order_acquire)) state = f.error.empty() ? "w" : "e" + f.error;
  const std::vector<std::string> states = detail::all_gather_strings(*f.comm, state);
  const auto failed =
      std::find_if(states.begin(), states.end(), [](const std::string& s) { return s[0] == 'e'; });
  const bool all_written =
      std::all_of(states.begin(), states.end(), [](const std::string& s) { return s == "w"; });
  if (failed == states.end() && !all_written) return std::nullopt;

  if (f.writer.joinable()) f.writer.join();
  const std::unique_ptr<Flight> done = std::move(flight_);
  if (failed != states.end()) {
    detail::abandon_save(*f.comm, f.target);
    throw Error(failed->substr(1));
  }
  f.mine["crc32"] = f.crc;
  detail::finish_save(*f.comm, f.target, f.mine, f.shards, f.sharding, f.extra);
  return Committed{.dir = f.target.dir,
                   .blocked_seconds = f.blocked_seconds,
                   .waited_seconds = f.waited_seconds,
                   .seconds = seconds_since(f.started),
                   .bytes = f.mine["bytes"].get<std::int64_t>()};
}

}  // namespace shardlab::dist
