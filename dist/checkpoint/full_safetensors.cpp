// dist/checkpoint/full_safetensors.cpp: one safetensors file written by all ranks in place, in the order the
// work runs: the header every rank derives alike, rank 0's temporary file sized to the whole,
// every rank's own elements at their offsets, rank 0's rename. The ranks agree on every outcome
// (dist/comm/agreement.h), so that none waits in a collective the others left.
#include "dist/checkpoint/full_safetensors.h"

#include <fcntl.h>

#include <bit>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/comm/agreement.h"
#include "dist/fsdp/fsdp.h"
#include "nn/safetensors.h"

namespace shardlab::dist {

static_assert(std::endian::native == std::endian::little, "safetensors files hold little-endian f32");

namespace {

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
    entries.push_back({.name = name, .dtype = DType::f32, .shape = whole_shape(shard)});
  return entries;
}

// This rank's elements of each parameter it counts for, at their offsets in `temp`, flushed.
void write_elements(const std::string& temp, const nn::Named<ParameterShard>& shards,
                    const nn::SafetensorsLayout& layout, std::string_view where) {
  std::vector<std::size_t> mine;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].second.first_replica && shards[i].second.count > 0) mine.push_back(i);
  }
  if (mine.empty()) return;
  Fd file(temp, O_WRONLY, where);
  for (const std::size_t i : mine) {
    const ParameterShard& shard = shards[i].second;
    const Tensor host = shard.local.data().to(Device::cpu()).contiguous();
    const std::size_t element = host.element_size();  // f32: the dtype of every parameter shard
    for (const ElementRun& run : whole_runs(shard)) {
      file.pwrite_all(static_cast<const char*>(host.raw_data()) + run.at * element,
                      static_cast<std::size_t>(run.count) * element,
                      layout.offsets[i] + static_cast<std::uint64_t>(run.first) * element, where);
    }
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
  const std::string temp = PendingFile::temp_name(path, id);
  std::optional<PendingFile> pending;  // rank 0's: removed unless renamed into place; its commit
                                       // flushes what every rank wrote

  nn::SafetensorsLayout layout;
  std::string error = detail::attempt(where, [&] {
    refuse_persistent_buffers(root, where);
    layout = nn::safetensors_layout(entries_of(shards), metadata, where);
    if (!rank0) return;
    pending.emplace(path, id, where);
    pending->write(layout.header.data(), layout.header.size());
    pending->resize(layout.file_bytes);  // every rank writes into a file of its final size
  });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);

  error = detail::attempt(where, [&] { write_elements(temp, shards, layout, where); });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);

  if (rank0) error = detail::attempt(where, [&] { pending->commit(); });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);
}

}  // namespace shardlab::dist
