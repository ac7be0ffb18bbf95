// tests/dist/test_async_checkpoint.cpp (mpirun): AsyncCheckpointer writes, for every sharding strategy
// and with a staging bound smaller than a rank's pieces, the very files save_checkpoint writes of the
// state when start() was called, though the model trains on before the commit; a save counts only
// once committed, a second start finishes the first, and a write that fails on one rank is thrown
// on every rank, leaving no directory behind.
#include <mpi.h>
#include <sys/resource.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <string>
#include <thread>

#include "dist/checkpoint/async_checkpoint.h"
#include "dist/checkpoint/checkpoint.h"
#include "tests/dist/save_helpers.h"

using namespace shardlab;
namespace fs = std::filesystem;

namespace {

// Every file of `dir` by name, with its bytes, as rank 0 reads them ({} on the other ranks).
std::map<std::string, test::Bytes> files_of(const std::string& dir) {
  std::map<std::string, test::Bytes> files;
  if (test::world().rank() != 0) return files;
  for (const auto& entry : fs::directory_iterator(dir))
    files[entry.path().filename().string()] = test::read_file(entry.path().string());
  return files;
}

// On rank 0: whether `dir` holds no directory but `expected`; true on the other ranks.
bool holds_only(const std::string& dir, const std::vector<std::string>& expected) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world().rank() != 0) return true;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names == expected;
}

// The Nested model fully sharded over the world, after one AdamW step.
struct Trained {
  test::Nested model;
  std::unique_ptr<optim::AdamW> optimizer;
};

Trained trained_one_step() {
  test::Nested model = test::make_model(test::world(), {dist::Sharding::full});
  auto optimizer = test::make_optimizer(model);
  test::train(model, *optimizer, test::world(), 0, 1);
  return {std::move(model), std::move(optimizer)};
}

}  // namespace

TEST_CASE("AsyncCheckpointer writes save_checkpoint's files of the state at start(), for every strategy",
          "[dist][checkpoint][async_checkpoint]") {
  const nlohmann::json extra = {{"epoch", 3}};
  for (const test::Strategy& strategy : test::strategies(test::world().size())) {
    for (const std::int64_t staging : {std::int64_t{1} << 30, std::int64_t{100}}) {
      INFO(test::world().size() << " ranks, " << test::describe(strategy) << ", staging " << staging << " B");
      test::SharedDir dir;
      test::Nested model = test::make_model(test::world(), strategy);
      auto optimizer = test::make_optimizer(model);
      test::train(model, *optimizer, test::world(), 0, 2);
      dist::save_checkpoint(dir.file("now"), *model, *optimizer, extra);

      dist::AsyncCheckpointer saver(staging);
      CHECK_FALSE(saver.start(dir.file("later"), *model, *optimizer, extra));
      CHECK(saver.in_flight());
      test::train(model, *optimizer, test::world(), 2, 1);  // changes what start() copied
      // Written perhaps, but only a temporary directory before the commit.
      CHECK(!fs::exists(dir.file("later")));
      const auto committed = saver.finish();
      REQUIRE(committed);
      CHECK(committed->dir == dir.file("later"));
      CHECK(committed->bytes ==
            static_cast<std::int64_t>(fs::file_size(dir.file(
                fmt::format("later/rank-{:05}-of-{:05}.bin", test::world().rank(), test::world().size())))));
      CHECK_FALSE(saver.in_flight());
      CHECK_FALSE(saver.finish());  // nothing in flight: nothing to commit
      CHECK(files_of(dir.file("later")) == files_of(dir.file("now")));
      MPI_Barrier(MPI_COMM_WORLD);
    }
  }
}

TEST_CASE("AsyncCheckpointer commits at poll() once every rank has written, and one save at a time",
          "[dist][checkpoint][async_checkpoint]") {
  test::SharedDir dir;
  auto [model, optimizer] = trained_one_step();
  dist::save_checkpoint(dir.file("step-1-now"), *model, *optimizer);
  dist::AsyncCheckpointer saver(1 << 20);
  saver.start(dir.file("step-1"), *model, *optimizer);
  std::optional<dist::AsyncCheckpointer::Committed> committed;
  // Each poll a collective: the ranks see the same states and commit at the same poll.
  for (int polls = 0; polls < 30000 && !committed; ++polls) {
    committed = saver.poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(committed);
  CHECK(committed->dir == dir.file("step-1"));
  CHECK(files_of(dir.file("step-1")) == files_of(dir.file("step-1-now")));

  // A second start while the first is in flight finishes (commits) the first, and says so.
  test::train(model, *optimizer, test::world(), 1, 1);
  dist::save_checkpoint(dir.file("step-2-now"), *model, *optimizer);
  saver.start(dir.file("step-2"), *model, *optimizer);
  test::train(model, *optimizer, test::world(), 2, 1);
  dist::save_checkpoint(dir.file("step-3-now"), *model, *optimizer);
  const auto previous = saver.start(dir.file("step-3"), *model, *optimizer);
  REQUIRE(previous);
  CHECK(previous->dir == dir.file("step-2"));
  CHECK(saver.waits() == 1);
  CHECK(saver.finish()->dir == dir.file("step-3"));
  CHECK(files_of(dir.file("step-2")) == files_of(dir.file("step-2-now")));
  CHECK(files_of(dir.file("step-3")) == files_of(dir.file("step-3-now")));
}

TEST_CASE("AsyncCheckpointer: a write that fails on one rank is thrown on every rank, nothing left behind",
          "[dist][checkpoint][async_checkpoint]") {
  test::SharedDir dir;
  // Named members, not a structured binding: the lambda below uses them (clang 15 cannot capture a binding).
  Trained trained = trained_one_step();
  // The last rank's files may not grow past 64 bytes: its thread's write fails (EFBIG, the signal ignored).
  const int last = test::world().size() - 1;
  rlimit before{};
  getrlimit(RLIMIT_FSIZE, &before);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  dist::AsyncCheckpointer saver(1 << 20);
  std::string error;
  if (test::world().rank() == last) {
    rlimit small = before;
    small.rlim_cur = 64;
    setrlimit(RLIMIT_FSIZE, &small);
  }
  error = test::error_of([&] {
    saver.start(dir.file("ckpt"), *trained.model, *trained.optimizer);
    saver.finish();
  });
  if (test::world().rank() == last) setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  CHECK(error.starts_with(fmt::format("save_checkpoint: '{}': ", dir.file("ckpt"))));
  CHECK(error.find("File too large") != std::string::npos);
  CHECK(test::same_on_every_rank(error));
  CHECK_FALSE(saver.in_flight());
  CHECK(holds_only(dir.file(""), {}));

  CHECK(test::error_of([] { dist::AsyncCheckpointer refused(0); }) ==
        "AsyncCheckpointer: the staging bound must be positive, got 0 bytes");
}
