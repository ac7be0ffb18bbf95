// dist/checkpoint/reader.h: a sharded checkpoint (dist/checkpoint/checkpoint.h) read in one process, without
// its model and without MPI: what it holds, and its tensors put together in one safetensors file.
//
//   const dist::CheckpointInfo info = dist::checkpoint_info("ckpt/step-1000");
//   fmt::print("step {}, {} tensors over {} ranks\n", info.step, info.tensors.size(), info.world_size);
//   dist::consolidate_checkpoint("ckpt/step-1000", "model.safetensors");                  // the parameters
//   dist::consolidate_checkpoint("ckpt/step-1000", "all.safetensors", {.optimizer = true});  // and the slots
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace shardlab::dist {

// `runs` runs of `count` elements of the flattened tensor, the k-th from element first + k * stride,
// stored one after another from byte `offset` of `file` (`bytes` in all). One run is a plain range;
// several are a tensor-parallel piece's rows (a piece of every row, as a split by input features
// holds), described once instead of once per row (format version 2).
struct CheckpointChunk {
  std::string file;
  std::int64_t offset = 0, bytes = 0, first = 0, count = 0;
  std::int64_t runs = 1, stride = 0;  // stride: elements from one run's first to the next's
};

// One run of a chunk: `count` elements from element `first` of the tensor, at byte `offset` of
// `chunk->file`.
struct CheckpointRun {
  const CheckpointChunk* chunk = nullptr;
  std::int64_t first = 0, count = 0, offset = 0;
};

struct CheckpointTensor {
  std::string name;
  Shape shape;                          // F32, the only dtype of the format
  std::vector<CheckpointChunk> chunks;  // sorted by `first`, covering the elements exactly once
  // "optim.<parameter>.<slot>": an optimizer slot (Adam's exp_avg), not a parameter.
  bool optimizer_slot() const;
  // Every run of its chunks, in element order (covering the tensor exactly once).
  std::vector<CheckpointRun> runs() const;
};

struct CheckpointFile {
  std::string name;  // in the checkpoint directory
  std::int64_t bytes = 0;
  std::uint32_t crc32 = 0;
  std::string first_tensor;  // the tensor at its lowest offset ("" when it holds none): errors name it
};

// metadata.json, checked whole: every field present with its type, each chunk inside its file and
// its tensor, each tensor's chunks covering it exactly once.
struct CheckpointInfo {
  std::string format;  // "shardlab-sharded-checkpoint"
  std::int64_t version = 0;
  std::int64_t world_size = 0;
  std::string sharding;               // "full", "hybrid:2", ... (dist::explain when saved)
  std::vector<CheckpointFile> files;  // as metadata.json lists them
  // As saved: the parameters in the model's order (named_parameters()), then the optimizer slots.
  std::vector<CheckpointTensor> tensors;
  std::int64_t step = 0;                                         // Optimizer::steps()
  std::vector<std::pair<std::string, double>> hyper_parameters;  // "param_groups.0.lr", ...
  std::map<std::string, std::int64_t> parameter_steps;           // per parameter with optimizer state
  nlohmann::json extra;                                          // the caller's JSON, as given

  const CheckpointTensor* tensor(const std::string& name) const;  // null when absent
  const CheckpointFile* file(const std::string& name) const;      // null when absent
  std::int64_t total_bytes() const;                               // of all files but metadata.json
};

// Reads and checks `dir`/metadata.json, and that every file it lists exists with its size (the
// bytes themselves are not read). Each problem is an Error naming the directory, the file, the
// tensor and what was expected.
CheckpointInfo checkpoint_info(const std::string& dir);

struct ConsolidateOptions {
  bool optimizer = false;  // also the optimizer slots, as "optim.<parameter>.<slot>" after the parameters
  std::map<std::string, std::string> metadata = {{"format", "pt"}};  // the file's "__metadata__"
};

// Writes the checkpoint's parameters (the model's order, full shapes, F32) as one safetensors
// file at `out_path`: the same bytes as nn::save_safetensors of the gathered parameters and as
// dist::save_full_safetensors of the model that saved it. Checks what checkpoint_info checks and
// every file's CRC32 before writing anything, then copies chunk by chunk through one bounded
// buffer (never the whole model in memory) into a temporary file next to `out_path`, flushed and
// renamed into place; on failure the temporary file is removed.
void consolidate_checkpoint(const std::string& dir, const std::string& out_path,
                            const ConsolidateOptions& options = {});

}  // namespace shardlab::dist
