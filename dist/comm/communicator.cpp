// dist/comm/communicator.cpp: argument checks, sequence numbers, counters and the debug-mode
// fingerprint comparison shared by both backends.
#include "dist/comm/communicator.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "dist/comm/backend.h"
#include "dist/comm/fault_injection.h"
#include "dist/comm/mpi_support.h"

namespace shardlab::dist {

Communicator::Communicator(std::string name, MpiComm control, std::unique_ptr<Backend> backend,
                           std::shared_ptr<Monitor> monitor, bool debug)
    : name_(std::move(name)),
      control_(std::make_unique<MpiComm>(std::move(control))),
      backend_(std::move(backend)),
      monitor_(std::move(monitor)),
      rank_(control_->rank()),
      size_(control_->size()),
      debug_(debug) {}

Communicator::~Communicator() = default;

std::string_view Communicator::backend_name() const { return backend_->name(); }

void Communicator::check_tensor(const Tensor& tensor, std::string_view op, std::string_view role) const {
  SHARDLAB_CHECK(tensor.defined(), "{}: the {} is undefined", op, role);
  SHARDLAB_CHECK(tensor.is_contiguous(), "{}: the {} must be contiguous (shape [{}], strides [{}])", op, role,
                 fmt::join(tensor.shape(), ", "), fmt::join(tensor.strides(), ", "));
  mpi_datatype(tensor.dtype(), op);  // throws for dtypes collectives do not carry
  backend_->check_device(tensor, op);
}

namespace {

void check_same_kind(const Tensor& output, const Tensor& input, std::string_view op) {
  SHARDLAB_CHECK(output.dtype() == input.dtype(), "{}: output dtype {} differs from input dtype {}", op,
                 dtype_name(output.dtype()), dtype_name(input.dtype()));
  SHARDLAB_CHECK(output.device() == input.device(), "{}: output is on {} but input is on {}", op,
                 output.device().str(), input.device().str());
}

// Byte ranges of two contiguous tensors.
bool overlap(const Tensor& a, const Tensor& b) {
  const auto* a_begin = static_cast<const char*>(a.raw_data());
  const auto* b_begin = static_cast<const char*>(b.raw_data());
  const auto* a_end = a_begin + a.numel() * a.element_size();
  const auto* b_end = b_begin + b.numel() * b.element_size();
  return a.numel() > 0 && b.numel() > 0 && a_begin < b_end && b_begin < a_end;
}

}  // namespace

Work Communicator::all_gather_into(const Tensor& output, const Tensor& input, std::string_view tag) {
  constexpr std::string_view op = "all_gather_into";
  check_tensor(output, op, "output");
  check_tensor(input, op, "input");
  check_same_kind(output, input, op);
  SHARDLAB_CHECK(output.numel() == input.numel() * size_,
                 "{}: output has {} elements but {} ranks x {} input elements = {}", op, output.numel(),
                 size_, input.numel(), input.numel() * size_);
  if (overlap(output, input)) {
    const Tensor slot = output.view({output.numel()}).narrow(0, rank_ * input.numel(), input.numel());
    SHARDLAB_CHECK(slot.raw_data() == input.raw_data(),
                   "{}: the input overlaps the output other than as this rank's slot {} (elements [{}, {}))",
                   op, rank_, rank_ * input.numel(), (rank_ + 1) * input.numel());
  }
  Fingerprint fingerprint{.op = Collective::all_gather, .dtype = input.dtype(), .count = output.numel()};
  fingerprint.tag = tag;
  return issue(std::move(fingerprint), input, output);
}

Work Communicator::reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp reduce,
                                  std::string_view tag) {
  constexpr std::string_view op = "reduce_scatter";
  check_tensor(output, op, "output");
  check_tensor(input, op, "input");
  check_same_kind(output, input, op);
  SHARDLAB_CHECK(
      input.numel() == output.numel() * size_,
      "{}: input has {} elements but {} ranks x {} output elements = {} (pad the buffer to a multiple "
      "of the world size)",
      op, input.numel(), size_, output.numel(), output.numel() * size_);
  SHARDLAB_CHECK(!overlap(output, input), "{}: output and input overlap", op);
  Fingerprint fingerprint{
      .op = Collective::reduce_scatter, .dtype = input.dtype(), .count = input.numel(), .reduce = reduce};
  fingerprint.tag = tag;
  return issue(std::move(fingerprint), input, output);
}

Work Communicator::all_reduce(const Tensor& tensor, ReduceOp reduce, std::string_view tag) {
  check_tensor(tensor, "all_reduce", "tensor");
  Fingerprint fingerprint{
      .op = Collective::all_reduce, .dtype = tensor.dtype(), .count = tensor.numel(), .reduce = reduce};
  fingerprint.tag = tag;
  return issue(std::move(fingerprint), tensor, tensor);
}

Work Communicator::broadcast(const Tensor& tensor, int root, std::string_view tag) {
  check_tensor(tensor, "broadcast", "tensor");
  SHARDLAB_CHECK(root >= 0 && root < size_, "broadcast: root {} is not a rank of communicator '{}' (size {})",
                 root, name_, size_);
  Fingerprint fingerprint{
      .op = Collective::broadcast, .dtype = tensor.dtype(), .count = tensor.numel(), .root = root};
  fingerprint.tag = tag;
  return issue(std::move(fingerprint), tensor, tensor);
}

Work Communicator::barrier(std::string_view tag) {
  Fingerprint fingerprint{.op = Collective::barrier};
  fingerprint.tag = tag;
  return issue(std::move(fingerprint), Tensor(), Tensor());
}

Work Communicator::issue(Fingerprint fingerprint, const Tensor& input, const Tensor& output) {
  CollectiveCall call;
  call.fingerprint = std::move(fingerprint);
  call.input = input;
  call.output = output;
  std::lock_guard lock(mutex_);
  const std::uint64_t sequence = ++sequence_;
  call.ledger_id = monitor_->record(name_, sequence, call.fingerprint);
  if (debug_) compare_fingerprints(call, sequence);
  counters_[call.fingerprint.op] += traffic_of(call.fingerprint, rank_, size_);
  const bool die = before_collective(call.fingerprint, call.input);
  if (!die) return backend_->launch(std::move(call));
  const Fingerprint launched = call.fingerprint;
  Work work = backend_->launch(std::move(call));
  kill_after_collective(launched);
}

namespace {

// A Fingerprint as plain bytes for MPI_Allgather (tags are compared up to their first 95 bytes).
struct WireFingerprint {
  std::uint64_t sequence;
  std::int64_t count;
  std::int32_t root;
  std::uint8_t op, dtype, reduce;
  char tag[96];
};

WireFingerprint to_wire(const Fingerprint& fingerprint, std::uint64_t sequence) {
  WireFingerprint wire;
  std::memset(&wire, 0, sizeof(wire));  // padding too: fingerprints are compared bytewise
  wire.sequence = sequence;
  wire.count = fingerprint.count;
  wire.root = fingerprint.root;
  wire.op = static_cast<std::uint8_t>(fingerprint.op);
  wire.dtype = static_cast<std::uint8_t>(fingerprint.dtype);
  wire.reduce = static_cast<std::uint8_t>(fingerprint.reduce);
  std::strncpy(wire.tag, fingerprint.tag.c_str(), sizeof(wire.tag) - 1);
  return wire;
}

Fingerprint from_wire(const WireFingerprint& wire) {
  return {.op = static_cast<Collective>(wire.op),
          .dtype = static_cast<DType>(wire.dtype),
          .count = wire.count,
          .reduce = static_cast<ReduceOp>(wire.reduce),
          .root = wire.root,
          .tag = std::string(wire.tag, strnlen(wire.tag, sizeof(wire.tag)))};
}

bool operator==(const WireFingerprint& a, const WireFingerprint& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

}  // namespace

// Every rank sends its fingerprint to every other and all compare against rank 0's, so all
// raise the same Error. The exchange runs on the control communicator, whose collectives are
// always matched (one fixed-size all-gather per call), so a mismatch is reported within one
// round trip instead of hanging in the backend.
void Communicator::compare_fingerprints(const CollectiveCall& call, std::uint64_t sequence) {
  monitor_->set_state(call.ledger_id, CallState::checking);
  const WireFingerprint mine = to_wire(call.fingerprint, sequence);
  std::vector<WireFingerprint> all(static_cast<std::size_t>(size_));
  try {
    SHARDLAB_MPI_CHECK(
        MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all.data(), sizeof(mine), MPI_BYTE, control_->get()));
  } catch (...) {
    monitor_->set_state(call.ledger_id, CallState::failed);
    throw;
  }
  const auto differing =
      std::find_if(all.begin(), all.end(), [&](const auto& other) { return !(other == all[0]); });
  if (differing == all.end()) {
    monitor_->set_state(call.ledger_id, CallState::queued);
    return;
  }
  monitor_->set_state(call.ledger_id, CallState::failed);
  const Fingerprint theirs = from_wire(*differing), first = from_wire(all[0]);
  const bool coarse_differs = describe(theirs) != describe(first);
  const auto text = [&](const Fingerprint& f) {
    return coarse_differs ? describe(f) : describe_in_detail(f);
  };
  fail("collective mismatch on communicator '{}': rank {} called {} #{} while rank 0 called {} #{}", name_,
       differing - all.begin(), text(theirs), differing->sequence, text(first), all[0].sequence);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, std::string name) {
  std::lock_guard lock(mutex_);
  MpiComm control = control_->split(color, key);
  std::unique_ptr<Backend> backend = backend_->split(color, key);
  if (name.empty()) name = fmt::format("{}/{}", name_, color);
  return std::make_unique<Communicator>(std::move(name), std::move(control), std::move(backend), monitor_,
                                        debug_);
}

CollectiveCounters Communicator::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

void Communicator::reset_counters() {
  std::lock_guard lock(mutex_);
  counters_ = {};
}

}  // namespace shardlab::dist
