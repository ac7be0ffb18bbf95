// dist/comm/init.cpp: the session: MPI, ranks, the device choice, the monitor and the world.
#include "dist/comm/init.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "core/cuda/runtime.h"
#include "core/error.h"
#include "dist/comm/backend.h"
#include "dist/comm/fault_injection.h"
#include "dist/comm/log.h"
#include "dist/comm/mpi_backend.h"
#include "dist/comm/mpi_support.h"
#include "dist/comm/nccl_backend.h"

namespace shardlab::dist {

namespace {

std::atomic<int> rank_for_logs{0};
std::atomic<Session*> live_session{nullptr};

bool debug_from_env() {
  const char* value = std::getenv("SHARDLAB_DIST_DEBUG");
  if (value == nullptr) return false;
  const std::string text(value);
  if (text == "1" || text == "true") return true;
  if (text.empty() || text == "0" || text == "false") return false;
  fail("dist::init: SHARDLAB_DIST_DEBUG must be 1, true, 0 or false, not '{}'", text);
}

std::chrono::milliseconds timeout_from_env() {
  const char* value = std::getenv("SHARDLAB_COLLECTIVE_TIMEOUT");
  if (value == nullptr) return std::chrono::minutes(10);
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  SHARDLAB_CHECK(end != value && *end == '\0' && seconds > 0,
                 "dist::init: SHARDLAB_COLLECTIVE_TIMEOUT must be a positive number of seconds, not '{}'",
                 value);
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

// "rank 2" or "ranks 1, 3": the ranks whose flag is 0.
std::string ranks_without(const std::vector<int>& flags) {
  std::string out;
  int count = 0;
  for (std::size_t rank = 0; rank < flags.size(); ++rank) {
    if (flags[rank] != 0) continue;
    out += (count++ == 0 ? "" : ", ") + std::to_string(rank);
  }
  return (count == 1 ? "rank " : "ranks ") + out;
}

// The same kind of device on every rank: CUDA when asked for, or, automatically, when every rank
// has a GPU; then one GPU per rank by local rank, several ranks on one GPU only with share_gpu.
Device choose_device(const InitOptions& options, const MpiComm& world, int local_rank, int local_size) {
  if (options.device == DeviceChoice::cpu) return Device::cpu();
  const bool mine = cuda::available();
  std::vector<int> has_gpu(static_cast<std::size_t>(world.size()));
  int flag = mine ? 1 : 0;
  SHARDLAB_MPI_CHECK(MPI_Allgather(&flag, 1, MPI_INT, has_gpu.data(), 1, MPI_INT, world.get()));
  const bool every_rank = std::find(has_gpu.begin(), has_gpu.end(), 0) == has_gpu.end();
  if (options.device == DeviceChoice::automatic && !every_rank) return Device::cpu();
  // A rank without a GPU names its own reason; the others name the ranks that lack one.
  SHARDLAB_CHECK(every_rank, "dist::init: device cuda was requested but {}",
                 mine
                     ? ranks_without(has_gpu) + " of " + std::to_string(world.size()) + " found no usable GPU"
                     : cuda::unavailable_reason());
  const int gpus = cuda::device_count();
  SHARDLAB_CHECK(local_size <= gpus || options.share_gpu,
                 "dist::init: {} ranks on this machine and {} GPU{}: one GPU per rank, unless the ranks "
                 "are to share them (InitOptions::share_gpu; --share-gpu in the training programs), "
                 "when their collectives go through MPI and host memory",
                 local_size, gpus, gpus == 1 ? "" : "s");
  return Device::cuda(local_rank % gpus);
}

bool use_nccl(BackendChoice choice, Device device, int local_size) {
  if (choice == BackendChoice::mpi) return false;
  if (choice == BackendChoice::nccl) {
    SHARDLAB_CHECK(device.is_cuda(),
                   "dist::init: the NCCL backend needs a CUDA device, but this rank runs on {}",
                   device.str());
    return true;
  }
  // NCCL needs a GPU per rank; ranks sharing a GPU stage through host memory over MPI.
  return device.is_cuda() && nccl_built() && local_size <= cuda::device_count();
}

}  // namespace

int process_rank() { return rank_for_logs.load(); }

int launcher_rank() {
  // Open MPI, PMIx launchers, MPICH/Hydra (and Intel MPI), Slurm's srun.
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    int rank = -1;
    const std::string_view text(value);
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), rank);
    if (error == std::errc() && end == text.data() + text.size() && rank >= 0) return rank;
  }
  return 0;
}
void set_process_rank(int rank) { rank_for_logs.store(rank); }

void write_line(std::string_view line) {
  std::string text(line);
  text += '\n';
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

Session::Session(int& argc, char**& argv, const InitOptions& options)
    : mpi_(std::make_unique<MpiEnvironment>(argc, argv)) {
  const MpiComm world = MpiComm::duplicate(MPI_COMM_WORLD);
  rank_ = world.rank();
  world_size_ = world.size();
  const MpiComm machine = world.split_by_machine();
  local_rank_ = machine.rank();
  local_size_ = machine.size();
  device_ = choose_device(options, world, local_rank_, local_size_);
  if (device_.is_cuda()) cuda::set_current_device(device_.index);
  monitor_ = std::make_shared<Monitor>(
      MonitorOptions{.rank = rank_,
                     .host = host_name(),
                     .device = device_,
                     .timeout = options.collective_timeout.value_or(timeout_from_env())});
  const bool debug = options.debug.value_or(debug_from_env());
  const char* fault_text = std::getenv("SHARDLAB_INJECT_FAULT");
  const std::optional<FaultInjection> fault = parse_fault_injection(fault_text == nullptr ? "" : fault_text);
  if (use_nccl(options.backend, device_, local_size_)) {
    world_ =
        std::make_unique<Communicator>("world", MpiComm::duplicate(world.get()),
                                       make_nccl_backend(world, device_.index, monitor_), monitor_, debug);
    cpu_world_ = std::make_unique<Communicator>("cpu_world", MpiComm::duplicate(world.get()),
                                                make_mpi_backend(world, monitor_), monitor_, debug);
  } else {
    world_ = std::make_unique<Communicator>("world", MpiComm::duplicate(world.get()),
                                            make_mpi_backend(world, monitor_), monitor_, debug);
  }
  failures_ = std::make_unique<MpiComm>(MpiComm::duplicate(world.get()));
  arm_fault_injection(fault, rank_);
  set_process_rank(rank_);
  live_session.store(this);
}

Session::~Session() {
  live_session.store(nullptr);
  arm_fault_injection(std::nullopt, rank_);
  set_process_rank(0);
  cpu_world_.reset();  // each joins its communication thread after its queued collectives
  world_.reset();
  monitor_.reset();
}

bool Session::every_rank_failed(std::chrono::milliseconds wait) const {
  int failed = 1, total = 0;
  MPI_Request request = MPI_REQUEST_NULL;
  SHARDLAB_MPI_CHECK(MPI_Iallreduce(&failed, &total, 1, MPI_INT, MPI_SUM, failures_->get(), &request));
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (int done = 0;;) {
    SHARDLAB_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) return total == world_size_;
    // Left pending: the caller ends the job, and MPI with it.
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Session::abort_job(int exit_code) const {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; should it, this still ends the process
}

std::unique_ptr<Session> init(int& argc, char**& argv, const InitOptions& options) {
  return std::make_unique<Session>(argc, argv, options);
}

Session& session() {
  Session* live = live_session.load();
  SHARDLAB_CHECK(live != nullptr, "dist::session: no live session (call dist::init first)");
  return *live;
}

}  // namespace shardlab::dist
