// dist/checkpoint/full_safetensors.h: one safetensors file of a sharded model's full parameters, written by
// all ranks in place, each its own elements: no rank ever holds the whole model.
//
//   dist::save_full_safetensors("out/model.safetensors", *model);  // on every rank of the model
#pragma once

#include <map>
#include <string>

#include "nn/module.h"

namespace shardlab::dist {

// Writes the parameters under `root` (full shapes, F32, in parameter_shards() order: a tied
// parameter once, under its first name) to `path`, the same bytes as nn::save_safetensors(path,
// gather_full_parameters(root), metadata). A collective over the ranks of root_communicator(root):
// every rank derives the same header (nn::safetensors_layout); rank 0 creates `path`.tmp-<id>
// (one id agreed by all ranks) with the header, sized to the whole file; after a barrier each
// rank that counts for its elements (ParameterShard::first_replica) writes them at their offsets
// and flushes; after a second barrier rank 0 renames the file into place and flushes the
// directory. The directory must exist.
// Persistent buffers are refused (they are model state the file would lose; the models here keep
// only derived tables, which are not persistent). Every failure, on any rank, is thrown on every
// rank with the same Error naming `path` (the lowest failing rank's), and the temporary file is
// removed.
void save_full_safetensors(const std::string& path, nn::Module& root,
                           const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace shardlab::dist
