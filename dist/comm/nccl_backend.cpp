// dist/comm/nccl_backend.cpp: the NCCL backend. Collectives run on a communication stream of
// their own; an event recorded on the caller's compute stream orders them after the kernels
// that produced their inputs, and Work::wait() makes the caller's stream wait on an event
// recorded after the collective. Nothing synchronises the device or blocks the host.
#include "dist/comm/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>

#include "core/cuda/check.h"
#include "core/cuda/runtime.h"
#include "core/error.h"
#include "core/profile.h"

namespace shardlab::dist {

namespace {

void check_nccl(ncclResult_t result, const char* expr, const char* file, int line) {
  if (result == ncclSuccess) return;
  fail("NCCL error at {}:{}: {} failed: {} ({})", file, line, expr, ncclGetErrorString(result),
       ncclGetLastError(nullptr));
}

#define SHARDLAB_NCCL_CHECK(expr) check_nccl((expr), #expr, __FILE__, __LINE__)

ncclDataType_t nccl_datatype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i64:
      return ncclInt64;
    case DType::i32:
      return ncclInt32;
    case DType::u8:
      return ncclUint8;
    case DType::boolean:
      break;
  }
  fail("NCCL: dtype {} is not supported by collectives",
       dtype_name(dtype));  // the Communicator refuses it first
}

// The average over a one-rank communicator is its input: NCCL computes it as a sum there, because
// NCCL before 2.29.7 skips the last n % blocks elements of a one-rank ncclAvg of floating values
// (NVIDIA/nccl#1950, oneRankReduce), which an H100 run of shardlab's tests met at world size 1.
ncclRedOp_t nccl_reduction(ReduceOp op, int ranks) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ranks == 1 ? ncclSum : ncclAvg;
    case ReduceOp::max:
      return ncclMax;
  }
  fail("NCCL: unknown reduction");
}

// A collective's name in the profile: a literal, as the profiler keys its ops.
const char* profiled_name(Collective op) {
  switch (op) {
    case Collective::all_gather:
      return "nccl all_gather";
    case Collective::reduce_scatter:
      return "nccl reduce_scatter";
    case Collective::all_reduce:
      return "nccl all_reduce";
    case Collective::broadcast:
      return "nccl broadcast";
    case Collective::barrier:
      return "nccl barrier";
  }
  return "nccl collective";
}

// An owned ncclComm_t.
class NcclComm {
 public:
  NcclComm(const MpiComm& bootstrap, int device) {
    ncclUniqueId id;
    if (bootstrap.rank() == 0) SHARDLAB_NCCL_CHECK(ncclGetUniqueId(&id));
    SHARDLAB_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, bootstrap.get()));
    cuda::DeviceGuard guard(device);
    SHARDLAB_NCCL_CHECK(ncclCommInitRank(&comm_, bootstrap.size(), id, bootstrap.rank()));
  }
  ~NcclComm() {
    if (!aborted_) ncclCommDestroy(comm_);  // an aborted communicator is freed by the abort
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }

  // From the watchdog: ends the communicator's kernels in flight, so a rank stuck in one returns.
  void abort() {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }

  // Throws the error NCCL met in the background (a peer gone, a network failure), if any.
  void check_async_error() const {
    ncclResult_t state = ncclSuccess;
    SHARDLAB_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress)
      fail("NCCL asynchronous error: {} ({})", ncclGetErrorString(state), ncclGetLastError(comm_));
  }

 private:
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
};

// Complete when the event recorded after the collective on the communication stream is; a
// communicator's asynchronous error fails it.
class StreamWork final : public WorkState {
 public:
  StreamWork(int device, const NcclComm& comm) : device_(device), comm_(&comm), done_(device) {}
  cuda::Event& done() { return done_; }
  void wait() override { done_.wait(cuda::current_stream(device_)); }
  bool completed() override {
    if (done_.query()) return true;
    comm_->check_async_error();
    return false;
  }

 private:
  int device_;
  const NcclComm* comm_;  // the backend outlives its calls: its destructor waits for them
  cuda::Event done_;
};

class NcclBackend final : public Backend {
 public:
  NcclBackend(MpiComm bootstrap, int device, std::shared_ptr<Monitor> monitor)
      : bootstrap_(std::move(bootstrap)),
        device_(device),
        monitor_(std::move(monitor)),
        comm_(bootstrap_, device),
        stream_(device),
        barrier_word_(zeros({1}, dtype(DType::i32).with_device(Device::cuda(device)))),
        abort_key_(monitor_->add_abort([this] { comm_.abort(); })) {}

  // Queued collectives finish before the communicator and stream they use are destroyed.
  ~NcclBackend() override {
    monitor_->remove_abort(abort_key_);
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_.handle()));
  }

  std::string_view name() const override { return "nccl"; }

  void check_device(const Tensor& tensor, std::string_view op) const override {
    SHARDLAB_CHECK(tensor.device() == Device::cuda(device_),
                   "{}: the NCCL communicator works on cuda:{}, not {}", op, device_, tensor.device().str());
  }

  Work launch(CollectiveCall call) override {
    cuda::DeviceGuard guard(device_);
    try {
      cuda::Event inputs_ready(device_);
      inputs_ready.record(cuda::current_stream(device_));
      inputs_ready.wait(stream_);
      monitor_->set_state(call.ledger_id, CallState::running);
      // --profile: the collective's time on the communication stream joins the kernels' (category
      // "communication"), which it overlaps.
      auto span = profile::on() ? std::make_unique<cuda::TimingSpan>(stream_) : nullptr;
      enqueue(call);
      if (span) {
        span->stop(stream_);
        profile::add_device_span(profiled_name(call.fingerprint.op), std::move(span));
      }
      for (const Tensor* tensor : {&call.input, &call.output}) {
        // By the block that holds it: a view (rank r's slot of an in-place all-gather) starts inside one.
        if (tensor->defined() && tensor->numel() > 0) cuda::record_stream(tensor->storage()->data(), stream_);
      }
      auto work = std::make_shared<StreamWork>(device_, comm_);
      work->done().record(stream_);
      monitor_->poll_until_complete(call.ledger_id, [work] { return work->completed(); });
      return Work(work);
    } catch (...) {
      monitor_->set_state(call.ledger_id, CallState::failed);
      throw;
    }
  }

  std::unique_ptr<Backend> split(int color, int key) override {
    return std::make_unique<NcclBackend>(bootstrap_.split(color, key), device_, monitor_);
  }

 private:
  void enqueue(const CollectiveCall& call) {
    const Fingerprint& f = call.fingerprint;
    auto* stream = static_cast<cudaStream_t>(stream_.handle());
    switch (f.op) {
      case Collective::all_gather:
        SHARDLAB_NCCL_CHECK(ncclAllGather(call.input.raw_data(), call.output.raw_data(),
                                          static_cast<std::size_t>(call.input.numel()),
                                          nccl_datatype(f.dtype), comm_.get(), stream));
        return;
      case Collective::reduce_scatter:
        SHARDLAB_NCCL_CHECK(ncclReduceScatter(
            call.input.raw_data(), call.output.raw_data(), static_cast<std::size_t>(call.output.numel()),
            nccl_datatype(f.dtype), nccl_reduction(f.reduce, bootstrap_.size()), comm_.get(), stream));
        return;
      case Collective::all_reduce:
        SHARDLAB_NCCL_CHECK(ncclAllReduce(
            call.input.raw_data(), call.output.raw_data(), static_cast<std::size_t>(call.output.numel()),
            nccl_datatype(f.dtype), nccl_reduction(f.reduce, bootstrap_.size()), comm_.get(), stream));
        return;
      case Collective::broadcast:
        SHARDLAB_NCCL_CHECK(ncclBroadcast(call.input.raw_data(), call.output.raw_data(),
                                          static_cast<std::size_t>(call.output.numel()),
                                          nccl_datatype(f.dtype), f.root, comm_.get(), stream));
        return;
      case Collective::barrier:
        // NCCL has no barrier: a one-word all-reduce completes only once every rank joined.
        SHARDLAB_NCCL_CHECK(ncclAllReduce(barrier_word_.raw_data(), barrier_word_.raw_data(), 1, ncclInt32,
                                          ncclSum, comm_.get(), stream));
        return;
    }
  }

  MpiComm bootstrap_;
  int device_;
  std::shared_ptr<Monitor> monitor_;
  NcclComm comm_;
  cuda::Stream stream_;
  Tensor barrier_word_;
  std::uint64_t abort_key_;
};

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Backend> make_nccl_backend(const MpiComm& comm, int device,
                                           std::shared_ptr<Monitor> monitor) {
  cuda::require_device(device);
  return std::make_unique<NcclBackend>(MpiComm::duplicate(comm.get()), device, std::move(monitor));
}

}  // namespace shardlab::dist
