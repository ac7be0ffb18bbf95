// dist/comm/agreement.cpp: agreeing on one outcome (an error, a temporary name) across the ranks.
#include "dist/comm/agreement.h"

#include <algorithm>
#include <cstring>

#include "core/file_io.h"
#include "dist/comm/init.h"

namespace shardlab::dist::detail {

namespace {

constexpr std::string_view kTag = "agreement";

// The device of a communicator's tensors: NCCL takes the session's GPU, MPI the host.
Device control_device(const Communicator& comm) {
  return comm.backend_name() == "nccl" ? session().device() : Device::cpu();
}

}  // namespace

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  if (comm.size() == 1) return {mine};
  const Device device = control_device(comm);
  const Tensor length =
      full({1}, static_cast<std::int64_t>(mine.size()), dtype(DType::i64).with_device(device));
  const Tensor lengths = empty({comm.size()}, dtype(DType::i64).with_device(device));
  comm.all_gather_into(lengths, length, kTag).wait();
  const std::vector<std::int64_t> sizes = lengths.to(Device::cpu()).to_vector<std::int64_t>();
  const std::int64_t longest = std::max<std::int64_t>(1, *std::max_element(sizes.begin(), sizes.end()));
  Tensor padded = zeros({longest}, dtype(DType::u8));
  std::memcpy(padded.raw_data(), mine.data(), mine.size());
  const Tensor gathered = empty({longest * comm.size()}, dtype(DType::u8).with_device(device));
  comm.all_gather_into(gathered, padded.to(device), kTag).wait();
  const Tensor host = gathered.to(Device::cpu());
  const auto* bytes = static_cast<const char*>(host.raw_data());
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r)
    out.emplace_back(bytes + r * longest, static_cast<std::size_t>(sizes[r]));
  return out;
}

std::optional<std::string> first_error(Communicator& comm, const std::string& error) {
  if (comm.size() == 1) return error.empty() ? std::nullopt : std::optional(error);
  const Tensor failed = full({1}, error.empty() ? 0 : 1, dtype(DType::i64).with_device(control_device(comm)));
  comm.all_reduce(failed, ReduceOp::max, kTag).wait();
  if (failed.to(Device::cpu()).item<std::int64_t>() == 0) return std::nullopt;
  for (std::string& message : all_gather_strings(comm, error)) {
    if (!message.empty()) return std::move(message);
  }
  return std::nullopt;
}

std::uint64_t agreed_id(Communicator& comm) {
  const std::uint64_t mine = random_id();
  if (comm.size() == 1) return mine;
  const Tensor id =
      full({1}, static_cast<std::int64_t>(mine), dtype(DType::i64).with_device(control_device(comm)));
  comm.broadcast(id, 0, kTag).wait();
  return static_cast<std::uint64_t>(id.to(Device::cpu()).item<std::int64_t>());
}

}  // namespace shardlab::dist::detail
