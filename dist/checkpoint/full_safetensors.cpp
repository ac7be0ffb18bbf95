// dist/checkpoint/full_safetensors.cpp: safetensors files written by all ranks in place, in the order the
// work runs: the files' layouts every rank derives alike, rank 0's temporary files sized to the
// whole, every rank's own elements at their offsets, rank 0's renames (and, for a model
// directory, its index and the removal of stale files). The ranks agree on every outcome
// (dist/comm/agreement.h), so that none waits in a collective the others left.
#include "dist/checkpoint/full_safetensors.h"

#include <fcntl.h>

#include <bit>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/comm/agreement.h"
#include "dist/fsdp/fsdp.h"
#include "nn/safetensors.h"

namespace shardlab::dist {

static_assert(std::endian::native == std::endian::little, "safetensors files hold little-endian elements");

namespace {

namespace fs = std::filesystem;

// What the file must hold besides the parameters: nothing, since persistent buffers are refused.
void refuse_persistent_buffers(nn::Module& root, std::string_view where) {
  std::set<std::string> buffers;
  for (const auto& [name, buffer] : root.named_buffers()) buffers.insert(name);
  for (const auto& [name, tensor] : root.state_dict()) {
    SHARDLAB_CHECK(!buffers.contains(name),
                   "{}: buffer '{}' is persistent model state, and only parameters are written", where, name);
  }
}

void check_dtype(DType dtype, std::string_view where) {
  SHARDLAB_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
                 "{}: cannot write parameters as {}: f32, bf16 or f16", where, dtype_name(dtype));
}

// One file of a save: where it goes, which parameters (indices into the shards) it holds, and
// where each one's bytes lie in it.
struct FilePlan {
  std::string path;
  std::vector<std::size_t> shards;
  nn::SafetensorsLayout layout;
};

FilePlan plan_file(std::string path, std::vector<std::size_t> indices,
                   const nn::Named<ParameterShard>& shards, const FullSafetensorsOptions& options,
                   std::string_view where) {
  std::vector<nn::SafetensorsEntry> entries;
  for (const std::size_t i : indices)
    entries.push_back(
        {.name = shards[i].first, .dtype = options.dtype, .shape = whole_shape(shards[i].second)});
  nn::SafetensorsLayout layout = nn::safetensors_layout(entries, options.metadata, where);
  return {.path = std::move(path), .shards = std::move(indices), .layout = std::move(layout)};
}

// This rank's elements of each parameter of `file` it counts for, in the file's dtype, at their
// offsets in `temp`, flushed.
void write_elements(const std::string& temp, const FilePlan& file, const nn::Named<ParameterShard>& shards,
                    DType dtype, std::string_view where) {
  std::vector<std::size_t> mine;  // positions in the file
  for (std::size_t k = 0; k < file.shards.size(); ++k) {
    const ParameterShard& shard = shards[file.shards[k]].second;
    if (shard.first_replica && shard.count > 0) mine.push_back(k);
  }
  if (mine.empty()) return;
  Fd out(temp, O_WRONLY, where);
  for (const std::size_t k : mine) {
    const ParameterShard& shard = shards[file.shards[k]].second;
    const Tensor host = shard.local.data().to(Device::cpu()).to(dtype).contiguous();
    const std::size_t element = host.element_size();
    for (const ElementRun& run : whole_runs(shard)) {
      out.pwrite_all(static_cast<const char*>(host.raw_data()) + run.at * element,
                     static_cast<std::size_t>(run.count) * element,
                     file.layout.offsets[k] + static_cast<std::uint64_t>(run.first) * element, where);
    }
  }
  out.sync(where);
  out.close(where);
}

// Writes the files `plan` lays out for the parameters of `root` (alike on every rank) as the
// header of save_full_safetensors says, then runs `after_commit(files, shards)` on rank 0.
template <typename Plan, typename AfterCommit>
void write_files(nn::Module& root, const FullSafetensorsOptions& options, const std::string& where,
                 Plan&& plan, AfterCommit&& after_commit) {
  Communicator& comm = root_communicator(root);
  const nn::Named<ParameterShard> shards = parameter_shards(root);
  std::vector<FilePlan> files;
  std::string error = detail::attempt(where, [&] {
    check_dtype(options.dtype, where);
    refuse_persistent_buffers(root, where);
    files = plan(shards);
  });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);
  const bool rank0 = comm.rank() == 0;
  const std::uint64_t id = detail::agreed_id(comm);
  std::vector<std::optional<PendingFile>> pending(files.size());  // rank 0's: removed unless renamed
                                                                  // into place; a commit flushes
                                                                  // what every rank wrote
  error = detail::attempt(where, [&] {
    if (!rank0) return;
    for (std::size_t f = 0; f < files.size(); ++f) {
      pending[f].emplace(files[f].path, id, where);
      pending[f]->write(files[f].layout.header.data(), files[f].layout.header.size());
      pending[f]->resize(files[f].layout.file_bytes);  // every rank writes into a file of its final size
    }
  });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);

  error = detail::attempt(where, [&] {
    for (const FilePlan& file : files)
      write_elements(PendingFile::temp_name(file.path, id), file, shards, options.dtype, where);
  });
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);

  if (rank0) {
    error = detail::attempt(where, [&] {
      for (auto& file : pending) file->commit();
      after_commit(files, shards);
    });
  }
  if (auto failed = detail::first_error(comm, error)) throw Error(*failed);
}

std::uint64_t tensor_bytes(const ParameterShard& shard, DType dtype) {
  return static_cast<std::uint64_t>(shape_numel(whole_shape(shard))) * dtype_size(dtype);
}

std::string numbered_name(std::size_t k, std::size_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

// model.safetensors.index.json: each tensor's file and the tensors' total bytes, as transformers
// writes it (keys sorted, two-space indent).
void write_index(const std::string& dir, const std::vector<FilePlan>& files,
                 const nn::Named<ParameterShard>& shards, DType dtype, const std::string& where) {
  nlohmann::json weight_map = nlohmann::json::object();
  std::uint64_t total = 0;
  for (const FilePlan& file : files) {
    for (const std::size_t i : file.shards) {
      weight_map[shards[i].first] = fs::path(file.path).filename().string();
      total += tensor_bytes(shards[i].second, dtype);
    }
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  PendingFile file(join_path(dir, "model.safetensors.index.json"), where);
  file.write(text.data(), text.size());
  file.commit();
}

// Removes the weight files of an earlier save into `dir` that `kept` does not name.
void remove_stale_weight_files(const std::string& dir, const std::set<std::string>& kept,
                               const std::string& where) {
  static const std::regex numbered(R"(model-\d{5}-of-\d{5}\.safetensors)");
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool weights = name == "model.safetensors" || name == "model.safetensors.index.json" ||
                         std::regex_match(name, numbered);
    if (!weights || kept.contains(name) || !entry.is_regular_file()) continue;
    std::error_code error;
    fs::remove(entry.path(), error);
    SHARDLAB_CHECK(!error, "{}: cannot remove the stale weight file '{}': {}", where, entry.path().string(),
                   error.message());
  }
  sync_directory(dir, where);
}

}  // namespace

std::vector<std::vector<std::size_t>> split_into_files(const std::vector<std::uint64_t>& tensor_bytes,
                                                       std::uint64_t max_file_bytes) {
  std::vector<std::vector<std::size_t>> files;
  std::vector<std::size_t> current;
  std::uint64_t current_bytes = 0;
  for (std::size_t i = 0; i < tensor_bytes.size(); ++i) {
    const std::uint64_t bytes = tensor_bytes[i];
    if (max_file_bytes > 0 && bytes > max_file_bytes) {  // alone, where it comes
      files.push_back({i});
      continue;
    }
    if (max_file_bytes > 0 && current_bytes + bytes > max_file_bytes) {
      files.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += bytes;
  }
  if (!current.empty() || files.empty()) files.push_back(std::move(current));
  return files;
}

void save_full_safetensors(const std::string& path, nn::Module& root, const FullSafetensorsOptions& options) {
  const std::string where = fmt::format("save_full_safetensors: '{}'", path);
  const auto plan = [&](const nn::Named<ParameterShard>& shards) {
    std::vector<std::size_t> all(shards.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    return std::vector<FilePlan>{plan_file(path, std::move(all), shards, options, where)};
  };
  write_files(root, options, where, plan, [](const auto&, const auto&) {});
}

void save_pretrained_safetensors(const std::string& dir, nn::Module& root, std::uint64_t max_file_bytes,
                                 const FullSafetensorsOptions& options) {
  const std::string where = fmt::format("save_pretrained_safetensors: '{}'", dir);
  const auto plan = [&](const nn::Named<ParameterShard>& shards) {
    SHARDLAB_CHECK(fs::is_directory(dir), "{}: not a directory", where);
    std::vector<std::uint64_t> bytes;
    for (const auto& [name, shard] : shards) bytes.push_back(tensor_bytes(shard, options.dtype));
    std::vector<std::vector<std::size_t>> split = split_into_files(bytes, max_file_bytes);
    std::vector<FilePlan> files;
    for (std::size_t k = 0; k < split.size(); ++k) {
      const std::string name = split.size() == 1 ? "model.safetensors" : numbered_name(k, split.size());
      files.push_back(plan_file(join_path(dir, name), std::move(split[k]), shards, options, where));
    }
    return files;
  };
  const auto finish = [&](const std::vector<FilePlan>& files, const nn::Named<ParameterShard>& shards) {
    std::set<std::string> kept;
    for (const FilePlan& file : files) kept.insert(fs::path(file.path).filename().string());
    if (files.size() > 1) {
      write_index(dir, files, shards, options.dtype, where);
      kept.insert("model.safetensors.index.json");
    }
    remove_stale_weight_files(dir, kept, where);
  };
  write_files(root, options, where, plan, finish);
}

}  // namespace shardlab::dist
