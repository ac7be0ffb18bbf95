// dist/checkpoint/checkpoint.cpp: sharded checkpoints. The ranks agree on every outcome (the lowest failing
// rank's error is thrown on all of them, so none waits in a collective the others left), in the
// order the work runs: save (dist/checkpoint/save_steps.h one after the other: temporary directory,
// each rank's pieces into its file, the metadata every rank derives alike, rank 0's commit), then
// load (metadata checked whole, files checked, this rank's byte ranges read, the optimizer's state
// and the parameters handed over last).
#include "dist/checkpoint/checkpoint.h"

#include <fcntl.h>

#include <algorithm>
#include <bit>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/checkpoint/format.h"
#include "dist/checkpoint/save_steps.h"
#include "dist/comm/agreement.h"
#include "dist/fsdp/fsdp.h"

namespace shardlab::dist {

static_assert(std::endian::native == std::endian::little, "checkpoint files hold little-endian f32");

namespace {

using Json = nlohmann::json;
using detail::attempt;
using detail::crc_update;
using detail::first_error;
using detail::kElementBytes;
using detail::kMetadata;
using detail::kOptimPrefix;

constexpr std::string_view kStep = "step";

}  // namespace

// =================================================================================================
// save
// =================================================================================================

void save_checkpoint(const std::string& dir, nn::Module& root, const optim::Optimizer& optimizer,
                     const nlohmann::json& extra) {
  Communicator& comm = root_communicator(root);
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  const detail::SaveTarget target = detail::begin_save(comm, dir, "save_checkpoint");
  Json mine;
  const std::string error = attempt(target.where, [&] {
    Fd out(join_path(target.temp, target.file), O_WRONLY | O_CREAT | O_TRUNC, target.where);
    std::uint32_t crc = crc_update(0, nullptr, 0);
    const auto sink = [&](const void* data, std::size_t bytes, std::uint64_t offset) {
      out.pwrite_all(data, bytes, offset, target.where);
      crc = crc_update(crc, data, bytes);
    };
    mine = detail::describe_pieces(sink, /*compact=*/true, target.file, shards,
                                   detail::split_state(optimizer.state_dict(), shards, target.where),
                                   target.where);
    mine["crc32"] = crc;
    out.sync(target.where);
    out.close(target.where);
  });
  if (auto failed = first_error(comm, error)) {
    detail::abandon_save(comm, target);
    throw Error(*failed);
  }
  detail::finish_save(comm, target, mine, shards, explain(root).sharding, extra);
}

CheckpointPreview preview_checkpoint(nn::Module& root, const optim::Optimizer& optimizer,
                                     bool one_chunk_per_run) {
  const std::string where = "preview_checkpoint";
  Communicator& comm = root_communicator(root);
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  // The state a step gives every parameter it updates (those with a gradient to come): a step
  // count and the type's slots, whose values are not read.
  detail::OptimizerState state = detail::split_state(optimizer.state_dict(), shards, where);
  for (const auto& [name, shard] : shards) {
    const std::optional<std::vector<std::string>> slots = optimizer.state_slots(name);
    if (!slots || !shard.local.requires_grad() || state.slots.contains(name)) continue;
    state.slots[name][std::string(kStep)] = scalar_tensor(1, dtype(DType::i64));
    for (const std::string& slot : *slots) state.slots[name][slot] = Tensor();
  }
  const std::string file = fmt::format("rank-{:05}-of-{:05}.bin", comm.rank(), comm.size());
  Json mine = detail::describe_pieces(nullptr, !one_chunk_per_run, file, shards, state, where);
  mine["crc32"] = 0;
  const std::vector<Json> ranks = detail::every_description(comm, mine);
  const nlohmann::ordered_json metadata =
      detail::build_metadata(ranks, shards, explain(root).sharding, nlohmann::json(), where);
  CheckpointPreview preview{.metadata_bytes =
                                static_cast<std::int64_t>(detail::metadata_text(metadata).size())};
  for (const Json& rank : ranks) {
    const std::int64_t bytes = rank["bytes"];
    preview.file_bytes += bytes;
    preview.largest_file_bytes = std::max(preview.largest_file_bytes, bytes);
    for (const Json& chunk : rank["chunks"]) {
      ++preview.chunks;
      preview.runs += chunk.value("runs", std::int64_t{1});
    }
  }
  return preview;
}

// =================================================================================================
// load
// =================================================================================================

namespace {

// Metadata against the model: exactly its parameters, with its shapes, and optimizer slots of
// parameters with a step count.
void check_against_model(const CheckpointInfo& metadata, const nn::Named<ParameterShard>& shards,
                         std::string_view where) {
  std::map<std::string, const ParameterShard*> parameters;
  for (const auto& [name, shard] : shards) {
    parameters[name] = &shard;
    const CheckpointTensor* tensor = metadata.tensor(name);
    SHARDLAB_CHECK(tensor != nullptr, "{}: {}: the model's parameter '{}' is not in the checkpoint", where,
                   kMetadata, name);
    SHARDLAB_CHECK(tensor->shape == whole_shape(shard),
                   "{}: {}: tensor '{}' has shape {} in the checkpoint but {} in the model", where, kMetadata,
                   name, shape_str(tensor->shape), shape_str(whole_shape(shard)));
  }
  for (const CheckpointTensor& entry : metadata.tensors) {
    const std::string& name = entry.name;
    if (parameters.contains(name)) continue;
    SHARDLAB_CHECK(entry.optimizer_slot(), "{}: {}: tensor '{}' is not a parameter of the model (file '{}')",
                   where, kMetadata, name,
                   entry.chunks.empty() ? std::string(kMetadata) : entry.chunks.front().file);
    const std::string key = name.substr(kOptimPrefix.size());
    const std::size_t dot = key.rfind('.');
    const std::string parameter = key.substr(0, dot == std::string::npos ? 0 : dot);
    const auto it = parameters.find(parameter);
    SHARDLAB_CHECK(dot != std::string::npos && it != parameters.end(),
                   "{}: {}: tensor '{}' is optimizer state of no parameter of the model", where, kMetadata,
                   name);
    SHARDLAB_CHECK(metadata.parameter_steps.contains(parameter),
                   "{}: {}: tensor '{}' is optimizer state of parameter '{}', which has no step count in "
                   "'parameter_steps'",
                   where, kMetadata, name, parameter);
    SHARDLAB_CHECK(entry.shape == whole_shape(*it->second),
                   "{}: {}: tensor '{}' has shape {} in the checkpoint but its parameter has shape {}", where,
                   kMetadata, name, shape_str(entry.shape), shape_str(whole_shape(*it->second)));
  }
  for (const auto& [name, step] : metadata.parameter_steps) {
    SHARDLAB_CHECK(parameters.contains(name),
                   "{}: {}: 'parameter_steps' names '{}', no parameter of the model", where, kMetadata, name);
  }
}

// `count` elements from byte `offset` of `file` to element `at` of `into`.
struct Read {
  const std::string* file;
  std::int64_t offset, count, at;
  Tensor* into;
};

// Appends the read, or lengthens the last one where it continues it in the file and in `into`
// (a piece saved and loaded in one layout: a chunk of many runs becomes one read).
void add_read(std::vector<Read>& reads, const Read& read) {
  if (!reads.empty()) {
    Read& last = reads.back();
    if (last.file == read.file && last.into == read.into &&
        last.offset + last.count * kElementBytes == read.offset && last.at + last.count == read.at) {
      last.count += read.count;
      return;
    }
  }
  reads.push_back(read);
}

struct Prepared {
  std::vector<Tensor> parameters;  // in shards order
  nn::StateDict optimizer;
  Json extra;
};

Prepared prepare_load(const std::string& dir, const nn::Named<ParameterShard>& shards,
                      std::string_view where) {
  const CheckpointInfo metadata = detail::read_metadata(dir, where);
  check_against_model(metadata, shards, where);
  detail::check_files(dir, metadata, where);

  Prepared out;
  out.parameters.resize(shards.size());
  std::vector<std::pair<std::string, Tensor>> slots;  // "<parameter>.<slot>" -> this rank's piece
  std::vector<Read> reads;
  // Each of this rank's runs from the stored runs overlapping it (found by bisection: a piece of a
  // large matrix has a run per row, and so may the checkpoint).
  const auto plan = [&](const CheckpointTensor& entry, const ParameterShard& shard, Tensor* into) {
    *into = empty({shard.count}, dtype(DType::f32));
    const std::vector<CheckpointRun> stored = entry.runs();
    for (const ElementRun& run : whole_runs(shard)) {
      auto it = std::upper_bound(stored.begin(), stored.end(), run.first,
                                 [](std::int64_t first, const CheckpointRun& s) { return first < s.first; });
      if (it != stored.begin()) --it;
      for (; it != stored.end() && it->first < run.first + run.count; ++it) {
        const std::int64_t from = std::max(it->first, run.first),
                           to = std::min(it->first + it->count, run.first + run.count);
        if (from >= to) continue;
        add_read(reads, {&it->chunk->file, it->offset + (from - it->first) * kElementBytes, to - from,
                         run.at + from - run.first, into});
      }
    }
  };
  std::map<std::string, std::vector<std::string>> slots_of;
  for (const CheckpointTensor& entry : metadata.tensors) {
    if (!entry.optimizer_slot()) continue;
    const std::string key = entry.name.substr(kOptimPrefix.size());
    const std::size_t dot = key.rfind('.');
    slots_of[key.substr(0, dot)].push_back(entry.name);
  }
  std::size_t slot_count = 0;
  for (const auto& [name, names] : slots_of) slot_count += names.size();
  slots.reserve(slot_count);  // `reads` points into it
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto& [name, shard] = shards[i];
    plan(*metadata.tensor(name), shard, &out.parameters[i]);
    const auto step = metadata.parameter_steps.find(name);
    if (step == metadata.parameter_steps.end()) continue;
    out.optimizer.emplace_back(name + ".step", scalar_tensor(step->second, dtype(DType::i64)));
    for (const std::string& tensor : slots_of[name]) {
      slots.emplace_back(tensor.substr(kOptimPrefix.size()), Tensor());
      plan(*metadata.tensor(tensor), shard, &slots.back().second);
    }
  }

  std::set<std::string> files;
  for (const Read& read : reads) files.insert(*read.file);
  for (const std::string& name : files) detail::check_crc(dir, *metadata.file(name), where);
  std::map<std::string, std::unique_ptr<Fd>> open;
  for (const std::string& name : files)
    open[name] = std::make_unique<Fd>(join_path(dir, name), O_RDONLY, where);
  for (const Read& read : reads) {
    auto* into = static_cast<char*>(read.into->raw_data()) + read.at * kElementBytes;
    open.at(*read.file)
        ->pread_all(into, static_cast<std::size_t>(read.count * kElementBytes),
                    static_cast<std::uint64_t>(read.offset), where);
  }

  for (auto& slot : slots) out.optimizer.push_back(std::move(slot));
  for (const auto& [key, value] : metadata.hyper_parameters)
    out.optimizer.emplace_back(key, scalar_tensor(value, dtype(DType::f64)));
  out.optimizer.emplace_back(std::string(kStep), scalar_tensor(metadata.step, dtype(DType::i64)));
  out.extra = metadata.extra;
  return out;
}

nn::StateDict copy_of(const nn::StateDict& state) {
  nn::StateDict out;
  for (const auto& [key, tensor] : state) out.emplace_back(key, tensor.clone());
  return out;
}

}  // namespace

nlohmann::json load_checkpoint(const std::string& dir, nn::Module& root, optim::Optimizer& optimizer) {
  const std::string where = fmt::format("load_checkpoint: '{}'", dir);
  Communicator& comm = root_communicator(root);
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  Prepared prepared;
  std::string error = attempt(where, [&] { prepared = prepare_load(dir, shards, where); });
  if (auto failed = first_error(comm, error)) throw Error(*failed);

  // The optimizer checks the state itself; a rank whose load went through while another's was
  // refused takes its old state back.
  const nn::StateDict before = copy_of(optimizer.state_dict());
  error = attempt(where, [&] {
    try {
      optimizer.load_state_dict(prepared.optimizer);
    } catch (const Error& refused) {
      fail("{}: {}", where, refused.what());
    }
  });
  if (auto failed = first_error(comm, error)) {
    if (error.empty()) optimizer.load_state_dict(before);
    throw Error(*failed);
  }
  for (std::size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].second.count > 0) shards[i].second.local.data().copy_(prepared.parameters[i]);
  }
  return prepared.extra;
}

}  // namespace shardlab::dist
