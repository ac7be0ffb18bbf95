// dist/checkpoint/checkpoint.cpp: sharded checkpoints. The ranks agree on every outcome (the lowest failing
// rank's error is thrown on all of them, so none waits in a collective the others left), in the
// order the work runs: save (temporary directory, each rank's pieces, the metadata every rank
// derives alike, rank 0's commit), then load (metadata checked whole, files checked, this rank's
// byte ranges read, the optimizer's state and the parameters handed over last).
#include "dist/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/checkpoint/format.h"
#include "dist/comm/agreement.h"
#include "dist/fsdp/fsdp.h"

namespace shardlab::dist {

static_assert(std::endian::native == std::endian::little, "checkpoint files hold little-endian f32");

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;  // what save writes: tensors in the model's order
using detail::agreed_id;
using detail::all_gather_strings;
using detail::attempt;
using detail::crc_update;
using detail::first_error;
using detail::kElementBytes;
using detail::kMetadata;
using detail::kOptimPrefix;

constexpr std::string_view kGroupPrefix = "param_groups.";  // Optimizer::state_dict's group keys
constexpr std::string_view kStep = "step";

std::string rank_file(int rank, int size) { return fmt::format("rank-{:05}-of-{:05}.bin", rank, size); }

// =================================================================================================
// save
// =================================================================================================

// This rank's per-parameter optimizer state: slot -> tensor, by parameter name.
using SlotsByParameter = std::map<std::string, std::map<std::string, Tensor>>;

struct OptimizerState {
  SlotsByParameter slots;
  Json scalars;  // "param_groups.<g>.<name>" (f64) and "step" (i64)
};

OptimizerState split_state(const nn::StateDict& state, const std::set<std::string>& parameters,
                           std::string_view where) {
  OptimizerState out;
  out.scalars = Json::object();
  for (const auto& [key, tensor] : state) {
    if (key == kStep) {
      out.scalars[key] = tensor.item<std::int64_t>();
    } else if (key.starts_with(kGroupPrefix)) {
      out.scalars[key] = tensor.item<double>();
    } else {
      const std::size_t dot = key.rfind('.');
      const std::string name = dot == std::string::npos ? key : key.substr(0, dot);
      SHARDLAB_CHECK(dot != std::string::npos && parameters.contains(name),
                     "{}: the optimizer's state key '{}' names no parameter of the model", where, key);
      out.slots[name][key.substr(dot + 1)] = tensor;
    }
  }
  return out;
}

// Makes `chunk` (its runs stored one after another) take `next`, stored right after them, when
// `next` has their length and continues their stride (a second run sets it).
bool extend_chunk(Json& chunk, const ElementRun& next) {
  const std::int64_t count = chunk["count"], first = chunk["first"];
  const std::int64_t runs = chunk.value("runs", std::int64_t{1});
  if (next.count != count) return false;
  const std::int64_t stride = runs == 1 ? next.first - first : chunk["stride"].get<std::int64_t>();
  if (stride < count || next.first != first + runs * stride) return false;
  chunk["runs"] = runs + 1;
  chunk["stride"] = stride;
  chunk["bytes"] = (runs + 1) * count * kElementBytes;
  return true;
}

// How write_pieces writes: into a file (null: only describing what a save would write, the slots'
// tensors then unread), and whether runs of one length at one stride share a chunk (format version
// 2) or each has its own (version 1).
struct PieceOutput {
  Fd* file = nullptr;
  bool compact = true;
};

// Writes this rank's pieces into `output.file` and describes them: the file's size and CRC32, its
// chunks, and per parameter the elements held, the step count and the slots (for the ranks to
// compare).
Json write_pieces(PieceOutput output, const std::string& file, const nn::Named<ParameterShard>& shards,
                  const OptimizerState& state, std::string_view where) {
  std::uint64_t offset = 0;
  std::uint32_t crc = crc_update(0, nullptr, 0);
  Json chunks = Json::array();
  // The runs of the whole tensor's elements (one, unless a tensor-parallel piece splits rows), one
  // after another in the file: runs of one length at one distance from each other are one chunk.
  const auto write = [&](const std::string& tensor, const Tensor& local, const ParameterShard& shard) {
    const Tensor host = output.file != nullptr ? local.to(Device::cpu()).contiguous() : Tensor();
    const std::size_t first_chunk = chunks.size();
    for (const ElementRun& run : whole_runs(shard)) {
      const auto bytes = static_cast<std::size_t>(run.count * kElementBytes);
      if (output.file != nullptr) {
        const auto* from = static_cast<const char*>(host.raw_data()) + run.at * kElementBytes;
        output.file->pwrite_all(from, bytes, offset, where);
        crc = crc_update(crc, from, bytes);
      }
      if (chunks.size() == first_chunk || !output.compact || !extend_chunk(chunks.back(), run)) {
        chunks.push_back({{"tensor", tensor},
                          {"offset", offset},
                          {"bytes", bytes},
                          {"first", run.first},
                          {"count", run.count}});
      }
      offset += bytes;
    }
  };
  Json parameters = Json::object();
  for (const auto& [name, shard] : shards) {
    Json described = {{"count", shard.count}, {"step", nullptr}, {"slots", Json::array()}};
    const bool writes = shard.first_replica && shard.count > 0;
    if (writes) write(name, shard.local.data(), shard);
    if (const auto it = state.slots.find(name); it != state.slots.end()) {
      for (const auto& [slot, tensor] : it->second) {
        if (slot == kStep) {
          SHARDLAB_CHECK(tensor.numel() == 1, "{}: the optimizer's '{}.{}' has shape {}, expected a scalar",
                         where, name, slot, shape_str(tensor.shape()));
          described["step"] = tensor.item<std::int64_t>();
          continue;
        }
        SHARDLAB_CHECK(
            output.file == nullptr || (tensor.shape() == Shape{shard.count} && tensor.dtype() == DType::f32),
            "{}: the optimizer's '{}.{}' is {} {}, expected f32 {} (this rank's piece of the "
            "parameter): only per-element slots and the step count can be sharded",
            where, name, slot, dtype_name(tensor.dtype()), shape_str(tensor.shape()),
            shape_str(Shape{shard.count}));
        described["slots"].push_back(slot);
        if (writes) write(fmt::format("{}{}.{}", kOptimPrefix, name, slot), tensor, shard);
      }
    }
    parameters[name] = std::move(described);
  }
  return {{"file", file},
          {"bytes", offset},
          {"crc32", crc},
          {"chunks", std::move(chunks)},
          {"parameters", std::move(parameters)},
          {"scalars", state.scalars}};
}

// The metadata, from every rank's description; the same on every rank, so that each finds any
// disagreement among the ranks itself.
OrderedJson build_metadata(const std::vector<Json>& ranks, const nn::Named<ParameterShard>& shards,
                           const std::string& sharding, const Json& extra, std::string_view where) {
  OrderedJson files = OrderedJson::object();
  std::map<std::string, std::vector<Json>> chunks_of;  // tensor -> chunks, from all ranks
  for (const Json& rank : ranks) {
    files[rank["file"].get<std::string>()] = {{"bytes", rank["bytes"].get<std::int64_t>()},
                                              {"crc32", rank["crc32"].get<std::uint32_t>()}};
    for (const Json& chunk : rank["chunks"]) chunks_of[chunk["tensor"].get<std::string>()].push_back(chunk);
  }
  for (std::size_t r = 1; r < ranks.size(); ++r) {
    SHARDLAB_CHECK(ranks[r]["scalars"] == ranks[0]["scalars"],
                   "{}: the optimizer's hyper-parameters or step count differ across ranks: rank 0 has {}, "
                   "rank {} has {}",
                   where, ranks[0]["scalars"].dump(), r, ranks[r]["scalars"].dump());
  }
  OrderedJson tensors = OrderedJson::object(), optim_tensors = OrderedJson::object();
  OrderedJson parameter_steps = OrderedJson::object();
  bool several_runs = false;  // a chunk of several runs: version 2, else 1 (what older readers read)
  const auto entry = [&](const std::string& tensor, const Shape& shape) {
    std::vector<Json> chunks = chunks_of[tensor];
    std::sort(chunks.begin(), chunks.end(),
              [](const Json& a, const Json& b) { return a["first"] < b["first"]; });
    OrderedJson list = OrderedJson::array();
    for (const Json& chunk : chunks) {
      list.push_back({{"file", chunk["file"].get<std::string>()},
                      {"offset", chunk["offset"].get<std::int64_t>()},
                      {"bytes", chunk["bytes"].get<std::int64_t>()},
                      {"first", chunk["first"].get<std::int64_t>()},
                      {"count", chunk["count"].get<std::int64_t>()}});
      if (chunk.contains("runs")) {
        list.back()["runs"] = chunk["runs"].get<std::int64_t>();
        list.back()["stride"] = chunk["stride"].get<std::int64_t>();
        several_runs = true;
      }
    }
    return OrderedJson{{"shape", shape}, {"dtype", "F32"}, {"chunks", std::move(list)}};
  };
  for (const auto& [name, shard] : shards) {
    tensors[name] = entry(name, whole_shape(shard));
    // The ranks that hold elements of the parameter (all ranks for an empty one) must agree on
    // its state; the others update a piece of no elements and may have any.
    const std::int64_t numel = shape_numel(shard.full_shape);
    std::optional<std::size_t> reference;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const Json& described = ranks[r]["parameters"][name];
      if (numel > 0 && described["count"].get<std::int64_t>() == 0) continue;
      if (!reference) {
        reference = r;
        continue;
      }
      const Json& first = ranks[*reference]["parameters"][name];
      SHARDLAB_CHECK(
          described["step"] == first["step"] && described["slots"] == first["slots"],
          "{}: the optimizer state of parameter '{}' differs across the ranks that hold it: rank {} "
          "has step {} and slots {}, rank {} has step {} and slots {}",
          where, name, *reference, first["step"].dump(), first["slots"].dump(), r, described["step"].dump(),
          described["slots"].dump());
    }
    const Json& state = ranks[reference.value_or(0)]["parameters"][name];
    if (state["step"].is_null()) continue;
    parameter_steps[name] = state["step"].get<std::int64_t>();
    for (const Json& slot : state["slots"]) {
      const std::string tensor = fmt::format("{}{}.{}", kOptimPrefix, name, slot.get<std::string>());
      optim_tensors[tensor] = entry(tensor, whole_shape(shard));
    }
  }
  for (auto& [name, value] : optim_tensors.items()) tensors[name] = std::move(value);
  OrderedJson hyper = OrderedJson::object();
  for (const auto& [key, value] : ranks[0]["scalars"].items()) {
    if (key != kStep) hyper[key] = value.get<double>();
  }
  return {{"format", detail::kCheckpointFormat},
          {"version", several_runs ? detail::kCheckpointVersion : 1},
          {"world_size", ranks.size()},
          {"sharding", sharding},
          {"files", std::move(files)},
          {"tensors", std::move(tensors)},
          {"optimizer",
           {{"step", ranks[0]["scalars"][std::string(kStep)].get<std::int64_t>()},
            {"hyper_parameters", std::move(hyper)},
            {"parameter_steps", std::move(parameter_steps)}}},
          {"extra", OrderedJson::parse(extra.dump())}};
}

// Every rank's description of its pieces, each chunk naming its rank's file: on every rank.
std::vector<Json> every_description(Communicator& comm, const Json& mine) {
  std::vector<Json> ranks;
  for (const std::string& text : all_gather_strings(comm, mine.dump())) ranks.push_back(Json::parse(text));
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    for (Json& chunk : ranks[r]["chunks"]) chunk["file"] = ranks[r]["file"];
  }
  return ranks;
}

// metadata.json's text as the commit writes it.
std::string metadata_text(const OrderedJson& metadata) { return metadata.dump(1) + "\n"; }

// Rank 0: metadata.json into the temporary directory, then the directory in place of `dir`.
void commit(const std::string& temp, const std::string& dir, const OrderedJson& metadata, std::uint64_t id,
            std::string_view where) {
  const std::string path = join_path(temp, kMetadata);
  const std::string text = metadata_text(metadata);
  Fd out(path, O_WRONLY | O_CREAT | O_TRUNC, where);
  out.pwrite_all(text.data(), text.size(), 0, where);
  out.sync(where);
  out.close(where);
  sync_directory(temp, where);
  std::error_code error;
  const bool exists = std::filesystem::exists(dir, error);
  if (!exists) {
    SHARDLAB_CHECK(std::rename(temp.c_str(), dir.c_str()) == 0, "{}: cannot rename '{}' to '{}': {}", where,
                   temp, dir, std::strerror(errno));
  } else {
    SHARDLAB_CHECK(std::filesystem::is_directory(dir, error),
                   "{}: '{}' exists and is not a directory; refusing to replace it", where, dir);
    // One atomic exchange where the file system has it; else the old directory goes aside first.
    if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
      std::filesystem::remove_all(temp, error);  // now the old checkpoint
    } else {
      const std::string aside = fmt::format("{}.old-{:016x}", dir, id);
      SHARDLAB_CHECK(std::rename(dir.c_str(), aside.c_str()) == 0, "{}: cannot rename '{}' to '{}': {}",
                     where, dir, aside, std::strerror(errno));
      SHARDLAB_CHECK(std::rename(temp.c_str(), dir.c_str()) == 0, "{}: cannot rename '{}' to '{}': {}", where,
                     temp, dir, std::strerror(errno));
      std::filesystem::remove_all(aside, error);
    }
  }
  const std::filesystem::path parent = std::filesystem::absolute(dir).parent_path();
  sync_directory(parent.string(), where);
}

}  // namespace

void save_checkpoint(const std::string& dir, nn::Module& root, const optim::Optimizer& optimizer,
                     const nlohmann::json& extra) {
  const std::string where = fmt::format("save_checkpoint: '{}'", dir);
  Communicator& comm = root_communicator(root);
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  const std::string sharding = explain(root).sharding;
  const int rank = comm.rank();
  std::string trimmed = dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::uint64_t id = agreed_id(comm);
  const std::string temp = fmt::format("{}.tmp-{:016x}", trimmed, id);
  const auto fail_all = [&](const std::string& message) {
    std::error_code ignored;
    if (rank == 0) std::filesystem::remove_all(temp, ignored);
    throw Error(message);
  };

  std::string error;
  if (rank == 0) {
    error = attempt(where, [&] {
      const std::filesystem::path parent = std::filesystem::absolute(trimmed).parent_path();
      std::filesystem::create_directories(parent);
      SHARDLAB_CHECK(::mkdir(temp.c_str(), 0755) == 0, "{}: cannot create '{}': {}", where, temp,
                     std::strerror(errno));
    });
  }
  if (auto failed = first_error(comm, error)) fail_all(*failed);

  const std::string file = rank_file(rank, comm.size());
  Json mine;
  error = attempt(where, [&] {
    std::set<std::string> names;
    for (const auto& [name, shard] : shards) names.insert(name);
    Fd out(join_path(temp, file), O_WRONLY | O_CREAT | O_TRUNC, where);
    mine =
        write_pieces({.file = &out}, file, shards, split_state(optimizer.state_dict(), names, where), where);
    out.sync(where);
    out.close(where);
  });
  if (auto failed = first_error(comm, error)) fail_all(*failed);

  // Every rank's description reaches every rank after all have flushed their files: the barrier
  // before the metadata.
  const std::vector<Json> ranks = every_description(comm, mine);
  OrderedJson metadata;
  error = attempt(where, [&] { metadata = build_metadata(ranks, shards, sharding, extra, where); });
  if (auto failed = first_error(comm, error)) fail_all(*failed);

  if (rank == 0) error = attempt(where, [&] { commit(temp, trimmed, metadata, id, where); });
  if (auto failed = first_error(comm, error)) fail_all(*failed);
}

CheckpointPreview preview_checkpoint(nn::Module& root, const optim::Optimizer& optimizer,
                                     bool one_chunk_per_run) {
  const std::string where = "preview_checkpoint";
  Communicator& comm = root_communicator(root);
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  std::set<std::string> names;
  for (const auto& [name, shard] : shards) names.insert(name);
  // The state a step gives every parameter it updates (those with a gradient to come): a step
  // count and the type's slots, whose values are not read.
  OptimizerState state = split_state(optimizer.state_dict(), names, where);
  for (const auto& [name, shard] : shards) {
    const std::optional<std::vector<std::string>> slots = optimizer.state_slots(name);
    if (!slots || !shard.local.requires_grad() || state.slots.contains(name)) continue;
    state.slots[name][std::string(kStep)] = scalar_tensor(1, dtype(DType::i64));
    for (const std::string& slot : *slots) state.slots[name][slot] = Tensor();
  }
  const std::string file = rank_file(comm.rank(), comm.size());
  const Json mine = write_pieces({.compact = !one_chunk_per_run}, file, shards, state, where);
  const std::vector<Json> ranks = every_description(comm, mine);
  const OrderedJson metadata = build_metadata(ranks, shards, explain(root).sharding, nlohmann::json(), where);
  CheckpointPreview preview{.metadata_bytes = static_cast<std::int64_t>(metadata_text(metadata).size())};
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
