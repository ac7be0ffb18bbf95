// dist/checkpoint/save_steps.cpp: the steps of a sharded checkpoint's save: the temporary directory,
// a rank's pieces through a sink and their description, the metadata every rank derives alike, and
// rank 0's commit. The ranks agree on every outcome (the lowest failing rank's error is thrown on
// all of them, so none waits in a collective the others left).
#include "dist/checkpoint/save_steps.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/checkpoint/format.h"
#include "dist/comm/agreement.h"

namespace shardlab::dist::detail {

static_assert(std::endian::native == std::endian::little, "checkpoint files hold little-endian f32");

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;  // what save writes: tensors in the model's order

constexpr std::string_view kGroupPrefix = "param_groups.";  // Optimizer::state_dict's group keys
constexpr std::string_view kStep = "step";

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

SaveTarget begin_save(Communicator& comm, const std::string& dir, std::string_view what) {
  SaveTarget target{.dir = dir, .where = fmt::format("{}: '{}'", what, dir)};
  while (target.dir.size() > 1 && target.dir.back() == '/') target.dir.pop_back();
  target.id = agreed_id(comm);
  target.temp = fmt::format("{}.tmp-{:016x}", target.dir, target.id);
  target.file = fmt::format("rank-{:05}-of-{:05}.bin", comm.rank(), comm.size());
  std::string error;
  if (comm.rank() == 0) {
    error = attempt(target.where, [&] {
      const std::filesystem::path parent = std::filesystem::absolute(target.dir).parent_path();
      std::filesystem::create_directories(parent);
      SHARDLAB_CHECK(::mkdir(target.temp.c_str(), 0755) == 0, "{}: cannot create '{}': {}", target.where,
                     target.temp, std::strerror(errno));
    });
  }
  if (auto failed = first_error(comm, error)) throw Error(*failed);
  return target;
}

void abandon_save(Communicator& comm, const SaveTarget& target) {
  std::error_code ignored;
  if (comm.rank() == 0) std::filesystem::remove_all(target.temp, ignored);
}

OptimizerState split_state(const nn::StateDict& state, const nn::Named<ParameterShard>& shards,
                           std::string_view where) {
  std::set<std::string> parameters;
  for (const auto& [name, shard] : shards) parameters.insert(name);
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

Json describe_pieces(const ByteSink& sink, bool compact, const std::string& file,
                     const nn::Named<ParameterShard>& shards, const OptimizerState& state,
                     std::string_view where) {
  std::uint64_t offset = 0;
  Json chunks = Json::array();
  // The runs of the whole tensor's elements (one, unless a tensor-parallel piece splits rows), one
  // after another in the file: runs of one length at one distance from each other are one chunk.
  const auto write = [&](const std::string& tensor, const Tensor& local, const ParameterShard& shard) {
    const Tensor host = sink ? local.to(Device::cpu()).contiguous() : Tensor();
    const std::size_t first_chunk = chunks.size();
    for (const ElementRun& run : whole_runs(shard)) {
      const auto bytes = static_cast<std::size_t>(run.count * kElementBytes);
      if (sink) sink(static_cast<const char*>(host.raw_data()) + run.at * kElementBytes, bytes, offset);
      if (chunks.size() == first_chunk || !compact || !extend_chunk(chunks.back(), run)) {
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
        SHARDLAB_CHECK(!sink || (tensor.shape() == Shape{shard.count} && tensor.dtype() == DType::f32),
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
          {"chunks", std::move(chunks)},
          {"parameters", std::move(parameters)},
          {"scalars", state.scalars}};
}

// The same on every rank, so that each finds any disagreement among the ranks itself.
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

std::vector<Json> every_description(Communicator& comm, const Json& mine) {
  std::vector<Json> ranks;
  for (const std::string& text : all_gather_strings(comm, mine.dump())) ranks.push_back(Json::parse(text));
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    for (Json& chunk : ranks[r]["chunks"]) chunk["file"] = ranks[r]["file"];
  }
  return ranks;
}

std::string metadata_text(const OrderedJson& metadata) { return metadata.dump(1) + "\n"; }

void finish_save(Communicator& comm, const SaveTarget& target, const Json& mine,
                 const nn::Named<ParameterShard>& shards, const std::string& sharding, const Json& extra) {
  const auto fail_all = [&](const std::string& message) {
    abandon_save(comm, target);
    throw Error(message);
  };
  // Every rank's description reaches every rank after all have flushed their files: the barrier
  // before the metadata.
  const std::vector<Json> ranks = every_description(comm, mine);
  OrderedJson metadata;
  std::string error =
      attempt(target.where, [&] { metadata = build_metadata(ranks, shards, sharding, extra, target.where); });
  if (auto failed = first_error(comm, error)) fail_all(*failed);
  if (comm.rank() == 0)
    error =
        attempt(target.where, [&] { commit(target.temp, target.dir, metadata, target.id, target.where); });
  if (auto failed = first_error(comm, error)) fail_all(*failed);
}

}  // namespace shardlab::dist::detail
