// tests/dist/fault_program.cpp: a small mpirun job that misbehaves on purpose, run by
// tests/dist/fault_tests.py: `hang` (rank 1 never joins a collective), `kill` (rank 1 dies by
// SIGKILL while the others are in a collective), `mismatch` (rank 0 all-gathers while the
// others reduce-scatter; run with SHARDLAB_DIST_DEBUG=1), `want-cuda` and `want-nccl` (dist::init
// asked for a GPU or for NCCL, which a CPU-only machine refuses). Like an app, it turns an Error
// into a message and exit status 1.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "core/error.h"
#include "core/tensor.h"
#include "dist/comm/init.h"
#include "dist/comm/log.h"

using namespace shardlab;

namespace {

void warm_up(dist::Communicator& world) {
  for (int k = 0; k < 3; ++k) world.all_reduce(ones({16}), dist::ReduceOp::sum, "warm-up").wait();
}

void hang(dist::Communicator& world) {
  warm_up(world);
  if (world.rank() == 1) {
    dist::log_all("sleeping instead of joining collective #4");
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  world.all_reduce(ones({1024}), dist::ReduceOp::sum, "never matched").wait();
}

void kill_rank_1(dist::Communicator& world) {
  warm_up(world);
  if (world.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the others are inside #4 by now
    dist::log_all("killing myself with SIGKILL");
    raise(SIGKILL);
  }
  world.all_reduce(ones({1024}), dist::ReduceOp::sum, "peer dies").wait();
}

void mismatch(dist::Communicator& world) {
  for (int k = 0; k < 16; ++k) world.barrier().wait();
  if (world.rank() == 0) {
    world.all_gather_into(empty({2048}), empty({2048 / world.size()})).wait();
  } else {
    world.reduce_scatter(empty({1024 / world.size()}), empty({1024})).wait();
  }
}

int run(dist::Session& session, const std::string& scenario) {
  dist::log("scenario {} on {} ranks, collective timeout {} ms, debug {}", scenario, session.world_size(),
            session.monitor().timeout().count(), session.world().debug());
  if (scenario == "hang") {
    hang(session.world());
  } else if (scenario == "kill") {
    kill_rank_1(session.world());
  } else if (scenario == "mismatch") {
    mismatch(session.world());
  } else if (scenario == "want-cuda") {
    dist::log_all("running on {}", session.device().str());
  } else {
    dist::log("usage: fault_program hang|kill|mismatch|want-cuda|want-nccl");
    return 2;
  }
  dist::log_all("finished {} without the expected fault", scenario);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    // The test's ranks may outnumber the GPUs: where the device is a GPU, they share it.
    dist::InitOptions options{.share_gpu = true};
    if (scenario == "want-cuda") options.device = dist::DeviceChoice::cuda;
    if (scenario == "want-nccl")
      options = {.device = dist::DeviceChoice::cpu, .backend = dist::BackendChoice::nccl};
    auto session = dist::init(argc, argv, options);
    try {
      return run(*session, scenario);
    } catch (const Error& error) {
      // Printed while the session lives: MPI_Finalize (session's end) waits for every rank,
      // so no rank exits, and has mpirun end the job, before the others have printed.
      dist::log_all("error: {}", error.what());
      return 1;
    }
  } catch (const Error& error) {
    dist::log_all("error: {}", error.what());
    return 1;
  }
}
