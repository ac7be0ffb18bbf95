// dist/checkpoint/checkpoint.h: sharded checkpoints of an FSDP model and its optimizer: every rank writes its
// own pieces, a metadata file maps each tensor's elements to byte ranges, and any world size and
// sharding strategy loads them back (PyTorch DCP's plan, with safetensors' strict validation).
//
//   dist::save_checkpoint("ckpt/step-1000", *model, optimizer, {{"epoch", 3}, {"cursor", 4096}});
//   ... later, at any world size, with any sharding strategy ...
//   const nlohmann::json extra = dist::load_checkpoint("ckpt/step-1000", *model, optimizer);
//
// The directory (format version 1, or 2 where a chunk has several runs):
//   rank-00002-of-00004.bin  rank 2's pieces, raw little-endian f32, one after the other; empty
//                            for a rank that holds nothing of its own (a second replica)
//   metadata.json            written last, by rank 0:
//     {"format": "shardlab-sharded-checkpoint", "version": 1,
//      "world_size": 4, "sharding": "full",            (explain(root).sharding when saved)
//      "files": {"rank-00000-of-00004.bin": {"bytes": 1188, "crc32": 305419896}, ...},
//      "tensors": {"embed.weight":              {"shape": [17, 7], "dtype": "F32", "chunks": [...]},
//                  "optim.embed.weight.exp_avg": {...}, ...},
//      "optimizer": {"step": 2,                      (Optimizer::steps())
//                    "hyper_parameters": {"param_groups.0.lr": 0.01, ...},
//                    "parameter_steps": {"embed.weight": 2, ...}},   (parameters updated so far)
//      "extra": {...}}                                 (the caller's JSON, as given)
//   A chunk {"file", "offset", "bytes", "first", "count"}: `count` elements of the flattened tensor
//   from element `first` are at byte `offset` of `file`, `bytes` = 4 * count long. Version 2 adds
//   "runs" and "stride" to a chunk of several runs: `runs` runs of `count` elements, the k-th from
//   element first + k * stride, stored one after another (`bytes` = 4 * runs * count): a
//   tensor-parallel piece split by input features, a run of every row, is one chunk instead of a
//   chunk per row. A tensor's chunks cover its elements exactly once. Parameters are stored under their
//   dotted names, each optimizer slot kept per element (Adam's exp_avg and exp_avg_sq, SGD's momentum_buffer)
//   as "optim.<parameter>.<slot>" with the parameter's full shape.
// One process reads a checkpoint without its model (what it holds, one safetensors file of it):
// dist/checkpoint/reader.h.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "nn/module.h"
#include "optim/optimizer.h"

namespace shardlab::dist {

// Writes `dir` atomically: a collective over the ranks of root_communicator(root). Every rank
// writes its pieces (each element once: replicas of none and hybrid sharding leave it to the
// first replica) into `dir.tmp-<id>` (one id agreed by all ranks) and flushes them; after a
// barrier rank 0 writes metadata.json, flushes it and the directory, swaps the directory in for
// an older `dir` (renameat2 RENAME_EXCHANGE, or rename the old one aside first where the file
// system cannot exchange), removes the old one and flushes the parent. A crash before the swap
// leaves the older `dir` as it was (and a `dir.tmp-*` to remove).
// Refused, on every rank with the same Error: optimizer state that differs across the ranks that
// hold a parameter, an optimizer slot neither per element nor the step count, I/O failures.
void save_checkpoint(const std::string& dir, nn::Module& root, const optim::Optimizer& optimizer,
                     const nlohmann::json& extra = {});

// What save_checkpoint will write for `root` and `optimizer` once every parameter with a gradient
// has its optimizer state (after the first step), from the shards' layout alone: no value is read,
// so a model under deferred init, before its first step, will do (--explain prints it). A
// collective over the ranks of root_communicator(root).
struct CheckpointPreview {
  // metadata.json with no extra: exact but for the digits of each file's CRC32 (0 here) and of each
  // parameter's step count (the optimizer's where it has one, else 1).
  std::int64_t metadata_bytes = 0;
  std::int64_t file_bytes = 0;          // the rank files together
  std::int64_t largest_file_bytes = 0;  // the largest rank file
  std::int64_t chunks = 0, runs = 0;    // in metadata.json; runs of the tensors' elements they describe
};
// one_chunk_per_run: as format version 1 described a tensor-parallel piece, a chunk per row.
CheckpointPreview preview_checkpoint(nn::Module& root, const optim::Optimizer& optimizer,
                                     bool one_chunk_per_run = false);

// Loads `dir` into the model's shards and the optimizer at any world size and sharding strategy;
// returns the saved `extra`. A collective over the ranks of root_communicator(root). Every rank
// reads metadata.json and checks it whole, checks that every rank file exists with its size,
// reads each file it needs in full once to verify its CRC32 (so a rank reads the bytes of every
// file that overlaps its pieces: about total / M at M <= N ranks, up to total / N at M > N ranks;
// the second pass that copies its own byte ranges with pread hits the page cache), then builds
// its parameters' local pieces and the optimizer's state_dict and hands them over.
// Strict: a tensor missing or unexpected against the model's parameters, a shape or dtype
// mismatch, a missing or truncated file, a CRC mismatch, malformed metadata (a missing field, a
// wrong type, a chunk outside its file or tensor, chunks overlapping or leaving a gap) and any
// refusal of Optimizer::load_state_dict are each an Error naming the tensor and file, thrown on
// every rank alike (the lowest failing rank's message); then neither the model nor the optimizer
// has changed.
nlohmann::json load_checkpoint(const std::string& dir, nn::Module& root, optim::Optimizer& optimizer);

}  // namespace shardlab::dist
