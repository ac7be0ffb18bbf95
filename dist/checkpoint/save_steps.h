// dist/checkpoint/save_steps.h: internal to dist/: the steps of a sharded checkpoint's save, which
// save_checkpoint runs one after the other and AsyncCheckpointer spreads over the steps of training:
// the temporary directory, a rank's pieces through a byte sink (a file, host memory, or nothing),
// and the metadata every rank derives alike, committed by rank 0.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "dist/comm/communicator.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"

namespace shardlab::dist::detail {

// Where one save goes: `dir`, the temporary directory its files are written in, the id the ranks
// agreed, and this rank's file in it.
struct SaveTarget {
  std::string dir, temp, file;
  std::uint64_t id = 0;
  std::string where;  // what errors begin with: "save_checkpoint: 'ckpt/step-10'"
};

// A collective: the ranks agree on an id, rank 0 creates `dir`.tmp-<id> (and `dir`'s parent). A
// failure is thrown on every rank.
SaveTarget begin_save(Communicator& comm, const std::string& dir, std::string_view what);

// Removes `target`'s temporary directory on rank 0 (after a failure on any rank).
void abandon_save(Communicator& comm, const SaveTarget& target);

// This rank's per-parameter optimizer state, slot -> tensor by parameter name, and the scalars
// ("param_groups.<g>.<name>" f64 and "step" i64).
struct OptimizerState {
  std::map<std::string, std::map<std::string, Tensor>> slots;
  nlohmann::json scalars;
};
OptimizerState split_state(const nn::StateDict& state, const nn::Named<ParameterShard>& shards,
                           std::string_view where);

// Takes `bytes` bytes of a rank file at `offset` (the pieces come in file order, from 0).
using ByteSink = std::function<void(const void* data, std::size_t bytes, std::uint64_t offset)>;

// This rank's pieces of the parameters and slots it counts for, through `sink` (null: only
// described, the slots' tensors unread), and their description: the file's bytes, its chunks, per
// parameter the elements held, the step count and the slots (for the ranks to compare), and the
// scalars; "crc32" is the caller's to add. `compact`: runs of one length at one stride share a
// chunk (format version 2), else each has its own (version 1).
nlohmann::json describe_pieces(const ByteSink& sink, bool compact, const std::string& file,
                               const nn::Named<ParameterShard>& shards, const OptimizerState& state,
                               std::string_view where);

// Every rank's description, each chunk naming its rank's file, on every rank (a collective), and
// the metadata derived from them, the same on every rank.
std::vector<nlohmann::json> every_description(Communicator& comm, const nlohmann::json& mine);
nlohmann::ordered_json build_metadata(const std::vector<nlohmann::json>& ranks,
                                      const nn::Named<ParameterShard>& shards, const std::string& sharding,
                                      const nlohmann::json& extra, std::string_view where);
// metadata.json's text as the commit writes it.
std::string metadata_text(const nlohmann::ordered_json& metadata);

// A collective, once every rank's file is complete and flushed (`mine` holding its CRC32): the
// metadata, then rank 0 writes it into the temporary directory and swaps that in for `dir`. A
// failure on any rank is thrown on every rank, the temporary directory removed.
void finish_save(Communicator& comm, const SaveTarget& target, const nlohmann::json& mine,
                 const nn::Named<ParameterShard>& shards, const std::string& sharding,
                 const nlohmann::json& extra);

}  // namespace shardlab::dist::detail
