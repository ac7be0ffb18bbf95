// dist/checkpoint/full_safetensors.h: a sharded model's full parameters in safetensors files, written by
// all ranks in place, each its own elements: no rank ever holds the whole model. One file, or a
// directory in Hugging Face's layout, cut into files of a bounded size as save_pretrained cuts them.
//
//   dist::save_full_safetensors("out/model.safetensors", *model);          // on every rank of the model
//   dist::save_pretrained_safetensors("out", *model, 2ull << 30, {.dtype = DType::bf16});
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "nn/module.h"

namespace shardlab::dist {

struct FullSafetensorsOptions {
  // What the files hold: f32 (the master weights' bits), or bf16 or f16, each element rounded to
  // the nearest (ties to even) as a cast in PyTorch rounds it.
  DType dtype = DType::f32;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};  // every file's "__metadata__"
};

// Writes the parameters under `root` (full shapes, in parameter_shards() order: a tied parameter
// once, under its first name) to `path`, the same bytes as nn::save_safetensors(path,
// gather_full_parameters(root) cast to options.dtype, options.metadata). A collective over the
// ranks of root_communicator(root): every rank derives the same header (nn::safetensors_layout);
// rank 0 creates `path`.tmp-<id> (one id agreed by all ranks) with the header, sized to the whole
// file; after a barrier each rank that counts for its elements (ParameterShard::first_replica)
// writes them at their offsets and flushes; after a second barrier rank 0 renames the file into
// place and flushes the directory. The directory must exist.
// Persistent buffers are refused (they are model state the file would lose; the models here keep
// only derived tables, which are not persistent); so is a dtype other than f32, bf16 and f16.
// Every failure, on any rank, is thrown on every rank with the same Error naming `path` (the
// lowest failing rank's), and the temporary file is removed.
void save_full_safetensors(const std::string& path, nn::Module& root,
                           const FullSafetensorsOptions& options = {});

// The weight files of a Hugging Face model directory `dir` (which must exist), written as
// save_full_safetensors writes one file. With max_file_bytes 0, or where every tensor's bytes
// together fit in it, the one file model.safetensors; else files model-00001-of-0000n.safetensors
// cut as save_pretrained's max_shard_size cuts (tensors in order; a file closed before the tensor
// that would take its tensors' bytes past the bound; a tensor larger than the bound alone in its
// file) and model.safetensors.index.json naming each tensor's file, with the tensors' total bytes.
// The files are renamed into place, the index last; then weight files of an earlier save the new
// ones do not replace (model.safetensors beside an index, an index beside model.safetensors,
// model-0000k-of-0000m.safetensors of another count) are removed, so that a reader (this
// library's or transformers') cannot take them for the model. Errors as save_full_safetensors's,
// naming `dir`.
void save_pretrained_safetensors(const std::string& dir, nn::Module& root, std::uint64_t max_file_bytes,
                                 const FullSafetensorsOptions& options = {});

// The files into which save_pretrained_safetensors cuts tensors of these byte sizes (in this order)
// under `max_file_bytes` (0: no bound): per file, the indices of its tensors.
std::vector<std::vector<std::size_t>> split_into_files(const std::vector<std::uint64_t>& tensor_bytes,
                                                       std::uint64_t max_file_bytes);

}  // namespace shardlab::dist
