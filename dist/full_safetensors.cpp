// dist/full_safetensors.cpp: one safetensors file written by all ranks in place, in the order the
// work runs: the header every rank derives alike, rank 0's temporary file sized to the whole,
// every rank's own elements at their offsets, rank 0's rename. The ranks agree on every outcome
// (dist/agreement.h), so that none waits in a collective the others left.
#include "dist/full_safetensors.h"

#include <fcntl.h>

#include <bit>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "dist/agreement.h"
#include "dist/file_io.h"
#include "dist/fsdp.h"
#include "nn/safetensors.h"

namespace shardlab::dist {

static_assert(std::endian::native == std::endian::little, "safetensors files hold little-endian f32");

namespace {

constexpr std::uint64_t kElementBytes = 4;  // f32: the dtype of every parameter shard

// What the file must hold besides the parameters: nothing, since persistent buffers are refused.
void refuse_persistent_buffers(nn::Module& root, std::string_view where) {
  std::set<std::string> buffers;
  for (const auto& [name, buffer] : root.named_buffers()) buffers.insert(name);
  for (const auto& [name, tensor] : root.state_dict()) {
    SHARDLAB_CHECK(!buffers.contains(name),
                   "{}: buffer '{}' is persistent model state, and only parameters are written", where, name);
  }
}

std::vector<nn::SafetensorsEntry> entries_of(const nn::Named<ParameterShard>& shards) {
  std::vector<nn::SafetensorsEntry> entries;
  for (const auto& [name, shard] : shards)
    entries.push_back({.name = name, .dtype = DType::f32, .shape = shard.full_shape});
  return entries;
}

// This rank's elements of each parameter it counts for, at their offsets in `temp`, flushed (on
// `flush_anyway`'s rank, rank 0, also when it has none: its header has to reach the disk).
void write_elements(const std::string& temp, const nn::Named<ParameterShard>& shards,
                    const nn::SafetensorsLayout& layout, bool flush_anyway, std::string_view where) {
  std::vector<std::size_t> mine;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].second.first_replica && shards[i].second.count > 0) mine.push_back(i);
  }
  if (mine.empty() && !flush_anyway) return;
  detail::Fd file(temp, O_WRONLY, where);
  for (const std::size_t i : mine) {
    const ParameterShard& shard = shards[i].second;
    const Tensor host = shard.local.data().to(Device::cpu()).contiguous();
    file.pwrite_all(host.raw_data(), static_cast<std::size_t>(shard.count) * kElementBytes,
                    layout.offsets[i] + static_cast<std::uint64_t>(shard.first) * kElementBytes, where);
  }
  file.sync(where);
  file.close(where);
}

}  // namespace

void save_full_safetensors(const std::string& path, nn::Module& root,
                           const std::map<std::string, std::string>& metadata) {
  const std::string where = fmt::format("save_full_safetensors: '{}'", path);
  Communicator& comm = root_communicator(root);
  const bool rank0 = comm.rank() == 0;
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  const std::uint64_t id = detail::agreed_id(comm);
  const std::string temp = detail::PendingFile::temp_name(path, id);
  std::optional<detail::PendingFile> pending;  // rank 0's: removed unless renamed into place

  nn::SafetensorsLayout layout;
  std::string error = detail::attempt(where, [&] {
    refuse_persistent_buffers(root, where);
    layout = nn::safetensors_layout(entries_of(shards), metadata, where);
    if (!rank0) return;
    detail::Fd file(temp, O_WRONLY | O_CREAT | O_EXCL, where);
    pending.emplace(path, id);
    file.pwrite_all(layout.header.data(), layout.header.size(), 0, where);
    file.truncate(layout.file_bytes, where);  // every rank writes into a file of its final size
    file.close(where);
  });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);

  error = detail::attempt(where, [&] { write_elements(temp, shards, layout, rank0, where); });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);

  if (rank0) error = detail::attempt(where, [&] { pending->commit(where); });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);
}

}  // namespace shardlab::dist
