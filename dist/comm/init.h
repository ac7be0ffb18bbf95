// dist/comm/init.h: dist::init, which turns the processes mpirun started into a Session: rank,
// world size, local rank, the device of this rank, and the world Communicator.
//
//   int main(int argc, char** argv) {
//     auto session = shardlab::dist::init(argc, argv);  // a world of 1 without mpirun
//     dist::log("{} ranks on {}", session->world_size(), session->device().str());
//     session->world().all_reduce(loss, dist::ReduceOp::avg).wait();
//   }                                                  // MPI finalised here
#pragma once

#include <chrono>
#include <memory>
#include <optional>

#include "core/device.h"
#include "dist/comm/communicator.h"

namespace shardlab::dist {

class MpiEnvironment;
class MpiComm;

using shardlab::DeviceChoice;  // automatic: CUDA when every rank has a GPU
enum class BackendChoice {
  automatic,
  mpi,
  nccl
};  // automatic: NCCL for CUDA when built and each rank has its own GPU

struct InitOptions {
  DeviceChoice device = DeviceChoice::automatic;
  BackendChoice backend = BackendChoice::automatic;
  // With CUDA, more ranks on a machine than its GPUs share them (collectives through MPI and host
  // memory: a testing mode); otherwise such a job is refused, naming both counts.
  bool share_gpu = false;
  // Fingerprint comparison before every collective. Default: env SHARDLAB_DIST_DEBUG=1.
  std::optional<bool> debug;
  // The watchdog's limit per collective. Default: env SHARDLAB_COLLECTIVE_TIMEOUT (seconds),
  // else 10 minutes.
  std::optional<std::chrono::milliseconds> collective_timeout;
};

class Session {
 public:
  Session(int& argc, char**& argv, const InitOptions& options);
  ~Session();  // drains the communicators, then MPI_Finalize
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // Rank and rank count among the processes on this machine (MPI's shared-memory split).
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  Device device() const { return device_; }
  // All ranks, on this rank's device: NCCL for CUDA tensors when the session chose it.
  Communicator& world() const { return *world_; }
  // All ranks over MPI, for CPU tensors (loss values, sample indices) whatever the device;
  // the same communicator as world() when the device is the CPU.
  Communicator& cpu_world() const { return cpu_world_ ? *cpu_world_ : *world_; }
  Monitor& monitor() const { return *monitor_; }

  // Called by a rank that failed: whether every rank failed too, waiting up to `wait` for them
  // to say so (over a communicator of its own, so that it never meets another collective). True
  // at once when the others failed alike; false when some rank is still working or waiting in a
  // collective for this one, which then only abort_job() ends.
  bool every_rank_failed(std::chrono::milliseconds wait) const;
  // Ends the whole job at once with `exit_code` (MPI_Abort: mpirun kills every rank).
  [[noreturn]] void abort_job(int exit_code) const;

 private:
  std::unique_ptr<MpiEnvironment> mpi_;  // finalised after everything below
  int rank_ = 0, world_size_ = 1, local_rank_ = 0, local_size_ = 1;
  Device device_;
  std::shared_ptr<Monitor> monitor_;
  std::unique_ptr<Communicator> world_;
  std::unique_ptr<Communicator> cpu_world_;  // null when world_ is the MPI one
  std::unique_ptr<MpiComm> failures_;        // every_rank_failed's own
};

// Initialises MPI (once per process) and returns the session; errors are thrown as Error.
std::unique_ptr<Session> init(int& argc, char**& argv, const InitOptions& options = {});

// This process's rank as its launcher (mpirun, srun) wrote it in the environment, known before
// dist::init: what prints a bad command line, or init's own error, once per job. 0 for a process
// started alone.
int launcher_rank();

// The live session, for code that needs the world without being handed it; throws when
// dist::init has not been called (or its session ended).
Session& session();

}  // namespace shardlab::dist
