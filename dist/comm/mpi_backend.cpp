// dist/comm/mpi_backend.cpp: the MPI backend: a communication thread per communicator that runs
// blocking MPI collectives in issue order. A thread (rather than non-blocking MPI calls) is
// what guarantees progress while the caller computes: Open MPI progresses non-blocking
// collectives only inside MPI calls. The caller and this thread both call MPI, hence
// MPI_THREAD_MULTIPLE (dist/comm/mpi_support.h).
#include "dist/comm/mpi_backend.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "core/cuda/runtime.h"
#include "core/device.h"
#include "core/error.h"

namespace shardlab::dist {

void HostWork::complete(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    completed_ = true;
    error_ = std::move(error);
  }
  done_.notify_all();
}

void HostWork::wait() {
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return completed_; });
  if (error_) std::rethrow_exception(error_);
}

bool HostWork::completed() {
  std::lock_guard lock(mutex_);
  return completed_;
}

namespace {

// The element count as MPI's int (launch() checks every tensor before it is queued).
int mpi_count(const Tensor& tensor, std::string_view op) {
  SHARDLAB_CHECK(tensor.numel() <= INT_MAX,
                 "{}: {} elements exceed MPI's count limit of {}; split the buffer", op, tensor.numel(),
                 INT_MAX);
  return static_cast<int>(tensor.numel());
}

// avg = sum / world size, element by element in the dtype's compute type (integers truncate,
// as NCCL's ncclAvg does).
void divide_by(const Tensor& tensor, int divisor) {
  visit_dtype(tensor.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("reduce avg: bool is not supported");
    } else {
      T* data = tensor.data<T>();
      for (std::int64_t i = 0; i < tensor.numel(); ++i) {
        data[i] = narrow<T>(widen(data[i]) / static_cast<compute_t<T>>(divisor));
      }
    }
  });
}

// The tensors MPI reads and writes: the call's own CPU tensors, or host copies of CUDA ones
// (made on the caller's thread, in order with its stream; copied back by the comm thread). With
// MpiStaging::every_tensor CPU tensors are copied as well, so that the staging runs, under the
// sanitizers, where there is no GPU.
struct HostBuffers {
  Tensor input, output;
  bool staged = false;
};

bool inside(const Tensor& part, const Tensor& whole) {
  const auto* begin = static_cast<const char*>(whole.raw_data());
  const auto* at = static_cast<const char*>(part.raw_data());
  return at >= begin && at < begin + static_cast<std::size_t>(whole.numel()) * whole.element_size();
}

HostBuffers stage(const CollectiveCall& call, MpiStaging staging) {
  if (!call.output.defined() || (call.output.device().is_cpu() && staging == MpiStaging::device_tensors))
    return {call.input, call.output, false};
  // One host buffer of the output's size; an input inside the output (the same tensor for
  // all-reduce and broadcast, this rank's slot for an in-place all-gather) is the same part of it,
  // so that MPI sees the aliasing it is told of (MPI_IN_PLACE) and writes within the buffer.
  const Tensor output = empty({call.output.numel()}, dtype(call.output.dtype()));
  const bool in_place = call.input.numel() > 0 && inside(call.input, call.output);
  const std::int64_t offset = in_place ? (static_cast<const char*>(call.input.raw_data()) -
                                          static_cast<const char*>(call.output.raw_data())) /
                                             static_cast<std::int64_t>(call.output.element_size())
                                       : 0;
  const Tensor input = in_place ? output.narrow(0, offset, call.input.numel())
                                : empty({call.input.numel()}, dtype(call.input.dtype()));
  input.copy_(call.input.reshape({call.input.numel()}));
  return {input, output, true};
}

// The staged output back into the caller's tensor.
void unstage(const HostBuffers& host, const Tensor& output) {
  const std::size_t bytes = static_cast<std::size_t>(output.numel()) * output.element_size();
  if (!host.staged || bytes == 0) return;  // an empty tensor's data may be null
  if (output.device().is_cpu()) {
    std::memcpy(output.raw_data(), host.output.raw_data(), bytes);
  } else {
    cuda::copy_bytes(output.raw_data(), true, host.output.raw_data(), false, bytes, output.device().index);
  }
}

// MPI_IN_PLACE when the input already is this rank's slot of the output (the Communicator
// refuses any other overlap), which MPI requires instead of aliased buffers.
const void* all_gather_source(const HostBuffers& host, int rank) {
  const auto* slot = static_cast<const char*>(host.output.raw_data()) +
                     static_cast<std::size_t>(rank) * host.input.numel() * host.input.element_size();
  return host.input.raw_data() == slot && host.input.numel() > 0 ? MPI_IN_PLACE : host.input.raw_data();
}

// Integer reductions add exactly in any grouping, so a large one runs in pieces of about kPieceBytes
// (all ranks' slices together): each piece's slices are gathered into one small buffer that MPI reads
// while it is in cache. On one host (2 and 4 ranks on 2 cores) Open MPI reduce-scattered 8 MiB 3 to 8
// times faster in such pieces than in one call (the integer windows of bitwise training); a float
// reduction keeps one call: the algorithm Open MPI picks by size fixes the order of its adds.
constexpr std::int64_t kPieceBytes = 64 << 10;

bool runs_in_pieces(const Fingerprint& fingerprint, const Tensor& output) {
  return !is_floating(fingerprint.dtype) && fingerprint.dtype != DType::boolean &&
         output.numel() * static_cast<std::int64_t>(output.element_size()) > kPieceBytes;
}

void reduce_scatter_in_pieces(const Fingerprint& fingerprint, const HostBuffers& host, const MpiComm& comm,
                              int size) {
  const std::int64_t part = host.output.numel(),
                     element = static_cast<std::int64_t>(host.output.element_size());
  const std::int64_t slice = std::max<std::int64_t>(1, kPieceBytes / (element * size));
  const MPI_Datatype type = mpi_datatype(fingerprint.dtype, "reduce_scatter");
  const MPI_Op reduction = mpi_reduction(fingerprint.reduce, fingerprint.dtype);
  std::vector<char> gathered(static_cast<std::size_t>(slice * size * element));
  const auto* input = static_cast<const char*>(host.input.raw_data());
  auto* output = static_cast<char*>(host.output.raw_data());
  for (std::int64_t first = 0; first < part; first += slice) {
    const std::int64_t count = std::min(slice, part - first);
    for (int rank = 0; rank < size; ++rank)
      std::memcpy(gathered.data() + rank * count * element, input + (rank * part + first) * element,
                  static_cast<std::size_t>(count * element));
    SHARDLAB_MPI_CHECK(MPI_Reduce_scatter_block(gathered.data(), output + first * element,
                                                static_cast<int>(count), type, reduction, comm.get()));
  }
}

void all_reduce_in_pieces(const Fingerprint& fingerprint, const HostBuffers& host, const MpiComm& comm) {
  const std::int64_t element = static_cast<std::int64_t>(host.output.element_size());
  const std::int64_t slice = kPieceBytes / element;
  auto* data = static_cast<char*>(host.output.raw_data());
  for (std::int64_t first = 0; first < host.output.numel(); first += slice) {
    SHARDLAB_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + first * element,
                                     static_cast<int>(std::min(slice, host.output.numel() - first)),
                                     mpi_datatype(fingerprint.dtype, "all_reduce"),
                                     mpi_reduction(fingerprint.reduce, fingerprint.dtype), comm.get()));
  }
}

void run_mpi(const Fingerprint& fingerprint, const HostBuffers& host, const MpiComm& comm, int size) {
  const std::string_view op = collective_name(fingerprint.op);
  switch (fingerprint.op) {
    case Collective::all_gather: {
      const MPI_Datatype type = mpi_datatype(fingerprint.dtype, op);
      const int count = mpi_count(host.input, op);
      SHARDLAB_MPI_CHECK(MPI_Allgather(all_gather_source(host, comm.rank()), count, type,
                                       host.output.raw_data(), count, type, comm.get()));
      return;
    }
    case Collective::reduce_scatter: {
      const int count = mpi_count(host.output, op);
      if (runs_in_pieces(fingerprint, host.output)) {
        reduce_scatter_in_pieces(fingerprint, host, comm, size);
      } else {
        SHARDLAB_MPI_CHECK(MPI_Reduce_scatter_block(
            host.input.raw_data(), host.output.raw_data(), count, mpi_datatype(fingerprint.dtype, op),
            mpi_reduction(fingerprint.reduce, fingerprint.dtype), comm.get()));
      }
      if (fingerprint.reduce == ReduceOp::avg) divide_by(host.output, size);
      return;
    }
    case Collective::all_reduce:
      if (runs_in_pieces(fingerprint, host.output)) {
        all_reduce_in_pieces(fingerprint, host, comm);
      } else {
        SHARDLAB_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, host.output.raw_data(), mpi_count(host.output, op),
                                         mpi_datatype(fingerprint.dtype, op),
                                         mpi_reduction(fingerprint.reduce, fingerprint.dtype), comm.get()));
      }
      if (fingerprint.reduce == ReduceOp::avg) divide_by(host.output, size);
      return;
    case Collective::broadcast:
      SHARDLAB_MPI_CHECK(MPI_Bcast(host.output.raw_data(), mpi_count(host.output, op),
                                   mpi_datatype(fingerprint.dtype, op), fingerprint.root, comm.get()));
      return;
    case Collective::barrier:
      SHARDLAB_MPI_CHECK(MPI_Barrier(comm.get()));
      return;
  }
}

class MpiBackend final : public Backend {
 public:
  MpiBackend(MpiComm comm, std::shared_ptr<Monitor> monitor, MpiStaging staging)
      : comm_(std::move(comm)), size_(comm_.size()), monitor_(std::move(monitor)), staging_(staging) {
    worker_ = std::thread([this] { serve(); });
  }

  ~MpiBackend() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    worker_.join();  // runs what is queued first: MPI needs every rank to finish its collectives
  }

  std::string_view name() const override { return "mpi"; }

  // CPU tensors, and CUDA tensors through host copies: any device works.
  void check_device(const Tensor&, std::string_view) const override {}

  Work launch(CollectiveCall call) override {
    try {
      for (const Tensor* tensor : {&call.input, &call.output}) {
        if (tensor->defined()) mpi_count(*tensor, collective_name(call.fingerprint.op));
      }
    } catch (...) {
      monitor_->set_state(call.ledger_id, CallState::failed);
      throw;
    }
    auto work = std::make_shared<HostWork>();
    Task task{std::move(call), {}, work};
    task.host = stage(task.call, staging_);
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(task));
    }
    wake_.notify_all();
    return Work(work);
  }

  std::unique_ptr<Backend> split(int color, int key) override {
    return std::make_unique<MpiBackend>(comm_.split(color, key), monitor_, staging_);
  }

 private:
  struct Task {
    CollectiveCall call;
    HostBuffers host;
    std::shared_ptr<HostWork> work;
  };

  void serve() {
    bind_thread_to_device(monitor_->device());  // its staging copies use the rank's GPU
    std::unique_lock lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      Task task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      run(task);
      lock.lock();
    }
  }

  void run(Task& task) {
    monitor_->set_state(task.call.ledger_id, CallState::running);
    std::exception_ptr error;
    try {
      run_mpi(task.call.fingerprint, task.host, comm_, size_);
      unstage(task.host, task.call.output);
    } catch (...) {
      error = std::current_exception();
    }
    // Drop this thread's references to the tensors before the caller learns the call is done:
    // once wait() returns, the caller's memory accounting must not see them.
    task.call.input = task.call.output = Tensor();
    task.host = {};
    monitor_->set_state(task.call.ledger_id, error ? CallState::failed : CallState::completed);
    task.work->complete(error);
  }

  MpiComm comm_;
  int size_;
  std::shared_ptr<Monitor> monitor_;
  MpiStaging staging_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts once everything it uses exists
};

}  // namespace

std::unique_ptr<Backend> make_mpi_backend(const MpiComm& comm, std::shared_ptr<Monitor> monitor,
                                          MpiStaging staging) {
  return std::make_unique<MpiBackend>(MpiComm::duplicate(comm.get()), std::move(monitor), staging);
}

}  // namespace shardlab::dist
