// tests/dist/test_ledger.cpp (mpirun): the session's facts, the ledger's records, debug-mode
// fingerprint comparison across ranks, and the watchdog (with a recording timeout action).
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "dist/comm/init.h"
#include "dist/comm/log.h"
#include "dist/comm/monitor.h"
#include "tests/dist/world.h"
#include "tests/thread_bindings.h"

using namespace shardlab;
using dist::CallState;
using dist::Collective;
using test::world;

TEST_CASE("the session knows its rank, world, machine-local rank and device", "[dist][init]") {
  int mpi_rank = -1, mpi_size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
  dist::Session& session = dist::session();
  CHECK(session.rank() == mpi_rank);
  CHECK(session.world_size() == mpi_size);
  // One machine: the shared-memory split holds every rank, in world order.
  CHECK(session.local_size() == mpi_size);
  CHECK(session.local_rank() == mpi_rank);
  CHECK(session.world().rank() == mpi_rank);
  CHECK(session.world().size() == mpi_size);
  CHECK(session.world().name() == "world");
  CHECK(session.cpu_world().backend_name() == "mpi");
  if (session.device().is_cpu()) CHECK(&session.cpu_world() == &session.world());
  CHECK(dist::process_rank() == mpi_rank);
  int argc = 0;
  char** argv = nullptr;
  CHECK_THROWS_ERROR(dist::init(argc, argv),
                     "dist::init: MPI is already initialised in this process (call dist::init once)");
}

TEST_CASE("the ledger records every collective with its sequence number and fingerprint", "[dist][ledger]") {
  auto comm = world().split(0, world().rank(), "ledger");
  const int w = comm->size();
  comm->all_reduce(zeros({8}), dist::ReduceOp::max, "unit.a").wait();
  comm->all_gather_into(zeros({3 * w}, dtype(DType::bf16)), zeros({3}, dtype(DType::bf16)), "unit.b").wait();
  comm->barrier().wait();
  const auto entries = comm->monitor().tail(3);
  REQUIRE(entries.size() == 3);
  CHECK(entries[0].communicator == "ledger");
  CHECK(entries[0].sequence == 1);
  CHECK(entries[0].fingerprint == dist::Fingerprint{.op = Collective::all_reduce,
                                                    .dtype = DType::f32,
                                                    .count = 8,
                                                    .reduce = dist::ReduceOp::max,
                                                    .tag = "unit.a"});
  CHECK(entries[1].sequence == 2);
  CHECK(dist::describe(entries[1].fingerprint) == fmt::format("all_gather(bf16, {}) 'unit.b'", 3 * w));
  CHECK(entries[2].sequence == 3);
  CHECK(dist::describe(entries[2].fingerprint) == "barrier()");
  for (const auto& entry : entries) {
    CHECK(entry.state == CallState::completed);
    CHECK(entry.issued <= entry.started);
    CHECK(entry.started <= entry.finished);
    CHECK(entries[0].id < entries[2].id);
  }
  const std::string tail = comm->monitor().format_tail(1);
  CHECK_THAT(tail, Catch::Matchers::StartsWith("  #3 ledger barrier() completed in "));
}

TEST_CASE("debug mode reports a mismatched collective on every rank, naming both sides",
          "[dist][ledger][debug]") {
  auto comm = world().split(0, world().rank(), "debug");
  comm->set_debug(true);
  const int r = comm->rank(), w = comm->size();
  for (int k = 0; k < 16; ++k) comm->all_reduce(full({4}, 1)).wait();  // #1 .. #16 agree
  if (w == 1) return;                                                  // nobody to disagree with
  // The example at 2 and 4 ranks; 3 ranks need counts that divide by 3.
  const std::int64_t gathered = w == 3 ? 2046 : 2048, scattered = w == 3 ? 1023 : 1024;
  const auto start = dist::Clock::now();
  const auto mismatched = [&] {
    if (r == 0) return comm->all_gather_into(empty({gathered}), empty({gathered / w}));
    return comm->reduce_scatter(empty({scattered / w}), empty({scattered}));
  };
  CHECK_THROWS_ERROR(mismatched(),
                     fmt::format("collective mismatch on communicator 'debug': rank 1 called "
                                 "reduce_scatter(f32, {}) #17 while rank 0 called all_gather(f32, {}) #17",
                                 scattered, gathered));
  const double seconds = std::chrono::duration<double>(dist::Clock::now() - start).count();
  CHECK(test::sum_over_ranks(seconds < 1.0 ? 0 : 1) == 0);
  CHECK(comm->monitor().tail(1).at(0).state == CallState::failed);
  // Details decide when op, dtype and count agree; tags count too.
  const auto reduce = r == 0 ? dist::ReduceOp::sum : dist::ReduceOp::avg;
  CHECK_THROWS_ERROR(
      comm->all_reduce(zeros({5}), reduce),
      "rank 1 called all_reduce(f32, 5, avg) #18 while rank 0 called all_reduce(f32, 5, sum) #18");
  CHECK_THROWS_ERROR(comm->barrier(r == 0 ? "layers.0" : "layers.1"),
                     "rank 1 called barrier() 'layers.1' #19 while rank 0 called barrier() 'layers.0' #19");
  // Nothing was sent, so the communicator is still in step.
  const Tensor ones_tensor = ones({2});
  comm->all_reduce(ones_tensor).wait();
  CHECK(test::wrong_on_any_rank(ones_tensor, [&](std::int64_t) { return w; }) == 0);
  CHECK(comm->monitor().tail(1).at(0).sequence == 20);
}

namespace {

// A monitor whose timeout action records the report instead of ending the job.
struct RecordingMonitor {
  std::mutex mutex;
  std::string report;
  std::atomic<int> fired{0};
  dist::Monitor monitor;

  explicit RecordingMonitor(std::chrono::milliseconds timeout, std::size_t capacity = 256,
                            Device device = Device::cpu())
      : monitor({.rank = 3,
                 .device = device,
                 .timeout = timeout,
                 .ledger_capacity = capacity,
                 .on_timeout = [this](const std::string& text) {
                   std::lock_guard lock(mutex);
                   report = text;
                   ++fired;
                 }}) {}

  bool wait_for_fire(std::chrono::milliseconds limit) {
    const auto deadline = dist::Clock::now() + limit;
    while (fired.load() == 0 && dist::Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return fired.load() > 0;
  }
};

const dist::Fingerprint kReduce{
    .op = Collective::all_reduce, .dtype = DType::f32, .count = 8, .tag = "blocks.1"};

}  // namespace

TEST_CASE("the watchdog reports a collective stuck past the timeout with the ledger tail",
          "[dist][watchdog]") {
  RecordingMonitor recording(std::chrono::milliseconds(100));
  const std::uint64_t done = recording.monitor.record("world", 1, kReduce);
  recording.monitor.set_state(done, CallState::running);
  recording.monitor.set_state(done, CallState::completed);
  const std::uint64_t stuck = recording.monitor.record("world", 2, kReduce);
  recording.monitor.set_state(stuck, CallState::running);
  REQUIRE(recording.wait_for_fire(std::chrono::seconds(10)));
  std::lock_guard lock(recording.mutex);
  CHECK_THAT(
      recording.report,
      Catch::Matchers::StartsWith("[rank 3] collective watchdog: #2 world all_reduce(f32, 8, sum) 'blocks.1' "
                                  "running for "));
  CHECK_THAT(recording.report, Catch::Matchers::Contains("did not complete within the 0.1 s timeout"));
  CHECK_THAT(recording.report,
             Catch::Matchers::Contains("Last 2 collectives of this rank (oldest first):\n"
                                       "[rank 3]   #1 world all_reduce(f32, 8, sum) 'blocks.1' "
                                       "completed in "));
  CHECK_THAT(recording.report, Catch::Matchers::Contains(
                                   "[rank 3]   #2 world all_reduce(f32, 8, sum) 'blocks.1' running for "));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(recording.fired.load() == 1);  // once per process
}

TEST_CASE("the watchdog leaves queued calls and polled work that completes alone", "[dist][watchdog]") {
  RecordingMonitor recording(std::chrono::milliseconds(200));
  const std::uint64_t queued =
      recording.monitor.record("world", 1, kReduce);  // waits behind others: not timed
  std::atomic<bool> event_done{false};
  const std::uint64_t polled = recording.monitor.record("world", 2, kReduce);
  recording.monitor.set_state(polled, CallState::running);
  recording.monitor.poll_until_complete(polled, [&] { return event_done.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  event_done = true;
  const auto deadline = dist::Clock::now() + std::chrono::seconds(10);
  while (recording.monitor.tail(1).at(0).state != CallState::completed && dist::Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(recording.monitor.tail(1).at(0).state == CallState::completed);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(recording.fired.load() == 0);
  CHECK(recording.monitor.tail(2).at(0).id == queued);
  CHECK_THROWS_ERROR(recording.monitor.poll_until_complete(queued, [] { return true; }),
                     "collective ledger: call 1 is not running");
}

TEST_CASE("the ledger keeps the newest entries but still times calls it dropped", "[dist][watchdog]") {
  RecordingMonitor recording(std::chrono::milliseconds(150), 4);
  const std::uint64_t first = recording.monitor.record("world", 1, kReduce);
  recording.monitor.set_state(first, CallState::running);
  for (std::uint64_t k = 2; k <= 10; ++k) recording.monitor.record("world", k, kReduce);
  const auto entries = recording.monitor.tail(100);
  REQUIRE(entries.size() == 4);
  CHECK(entries.front().sequence == 7);
  CHECK(entries.back().sequence == 10);
  REQUIRE(recording.wait_for_fire(std::chrono::seconds(10)));
  std::lock_guard lock(recording.mutex);
  CHECK_THAT(recording.report,
             Catch::Matchers::StartsWith("[rank 3] collective watchdog: #1 world all_reduce"));
}

TEST_CASE("the watchdog fires while a completion query blocks", "[dist][watchdog]") {
  // A CUDA event query can block behind a hung kernel: the timeout report must still come. (What
  // the query uses outlives the monitor, whose poller queries the call until it stops.)
  std::promise<void> release;
  const std::shared_future<void> released = release.get_future().share();
  std::atomic<int> queries{0};
  RecordingMonitor recording(std::chrono::milliseconds(100));
  const std::uint64_t stuck = recording.monitor.record("world", 1, kReduce);
  recording.monitor.set_state(stuck, CallState::running);
  recording.monitor.poll_until_complete(stuck, [&] {
    ++queries;
    released.wait();
    return false;
  });
  const bool fired = recording.wait_for_fire(std::chrono::seconds(10));
  release.set_value();  // lets the query return, so the monitor can stop
  REQUIRE(fired);
  CHECK(queries.load() >= 1);
  std::lock_guard lock(recording.mutex);
  CHECK_THAT(recording.report,
             Catch::Matchers::StartsWith("[rank 3] collective watchdog: #1 world all_reduce"));
  CHECK_THAT(recording.report, Catch::Matchers::Contains("did not complete within the 0.1 s timeout"));
}

TEST_CASE("a completion query that throws fails its call at once, the report naming the error",
          "[dist][watchdog]") {
  RecordingMonitor recording(std::chrono::minutes(10));
  const std::uint64_t broken = recording.monitor.record("world", 1, kReduce);
  recording.monitor.set_state(broken, CallState::running);
  recording.monitor.poll_until_complete(broken, []() -> bool {
    throw Error("NCCL asynchronous error: remote process exited or there was a network error");
  });
  REQUIRE(recording.wait_for_fire(std::chrono::seconds(10)));  // long before the 10 minutes
  std::lock_guard lock(recording.mutex);
  CHECK_THAT(
      recording.report,
      Catch::Matchers::StartsWith("[rank 3] collective watchdog: #1 world all_reduce(f32, 8, sum) 'blocks.1' "
                                  "failed in "));
  CHECK_THAT(
      recording.report,
      Catch::Matchers::Contains(" s: NCCL asynchronous error: remote process exited or there was a network "
                                "error. Last 1 collectives"));
  CHECK(recording.monitor.tail(1).at(0).state == CallState::failed);
}

TEST_CASE("the watchdog runs the backends' aborts before its report, once, the removed ones not",
          "[dist][watchdog]") {
  std::vector<std::string> events;
  std::mutex mutex;
  dist::Monitor monitor(
      {.rank = 1, .timeout = std::chrono::milliseconds(50), .on_timeout = [&](const std::string&) {
         std::lock_guard lock(mutex);
         events.emplace_back("report");
       }});
  const auto note = [&](const char* what) {
    return [&, what] {
      std::lock_guard lock(mutex);
      events.emplace_back(what);
    };
  };
  monitor.add_abort(note("abort world"));
  const std::uint64_t gone = monitor.add_abort(note("abort of a communicator destroyed since"));
  monitor.add_abort([] { throw Error("ncclCommAbort failed"); });  // the report still goes out
  monitor.remove_abort(gone);
  const std::uint64_t stuck = monitor.record("world", 1, kReduce);
  monitor.set_state(stuck, CallState::running);
  const auto deadline = dist::Clock::now() + std::chrono::seconds(10);
  while (dist::Clock::now() < deadline) {
    {
      std::lock_guard lock(mutex);
      if (!events.empty() && events.back() == "report") break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::lock_guard lock(mutex);
  CHECK(events == std::vector<std::string>{"abort world", "report"});
}

TEST_CASE("the watchdog's threads make the rank's device current first", "[dist][watchdog]") {
  const test::ThreadBindings bindings;
  {
    RecordingMonitor recording(std::chrono::minutes(10), 256, Device::cuda(5));
    const auto deadline = dist::Clock::now() + std::chrono::seconds(10);
    while (bindings.by_other_threads().size() < 2 && dist::Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The watchdog and the poller, each once, and nothing on this thread.
  CHECK(bindings.by_other_threads() == std::vector<Device>{Device::cuda(5), Device::cuda(5)});
}

TEST_CASE("the monitor refuses a non-positive timeout or capacity", "[dist][watchdog][errors]") {
  CHECK_THROWS_ERROR(dist::Monitor({.timeout = std::chrono::milliseconds(0)}),
                     "collective watchdog: the timeout must be positive, got 0 ms");
  CHECK_THROWS_ERROR(dist::Monitor({.ledger_capacity = 0}),
                     "collective ledger: the capacity must be positive");
  dist::Monitor monitor({});
  CHECK(monitor.timeout() == std::chrono::minutes(10));
  CHECK_THROWS_ERROR(monitor.set_timeout(std::chrono::milliseconds(-5)),
                     "collective watchdog: the timeout must be positive, got -5 ms");
  monitor.set_timeout(std::chrono::seconds(3));
  CHECK(monitor.timeout() == std::chrono::seconds(3));
}
