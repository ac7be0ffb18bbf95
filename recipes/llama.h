// recipes/llama.h: how to parallelise the Llama, as torchtitan's parallelize_llama, in named steps:
// apply_tensor_parallel inside a group of ranks (Megatron's split: q, k, v, gate and up by output
// features, o and down by input features, the vocabulary of the embedding and the head), then
// apply_activation_checkpointing per decoder layer, then apply_fsdp across the groups (one unit per
// decoder layer plus the root: embedding, final norm and head, as the FSDP2 article's script shards
// it), then place_in_mesh; parallelize_llama composes them. recipes/ is the one layer that knows both
// the models and dist/: the model does not know it is sharded, and dist/ does not know the model.
//
//   models::Llama model(config, seed);                       // under nn::DeferredInitGuard for big ones
//   const recipes::ParallelLlama layout = recipes::parallelize_llama(model, {.mesh = &mesh});
//   optim::AdamW optimizer(model->named_parameters(), {});  // the shards
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dist/comm/mesh.h"
#include "dist/fsdp/fsdp.h"
#include "dist/tp/cross_entropy.h"
#include "dist/tp/parallelize.h"
#include "models/llama.h"

namespace shardlab::recipes {

struct LlamaParallelism {
  dist::FsdpOptions fsdp;  // over fsdp.communicator (the world by default) without a mesh
  // "dp" x "tp" (dist/comm/mesh.h): tensor parallelism inside each "tp" group, FSDP over "dp" (which
  // fsdp.communicator then is, or is left unset for).
  const dist::DeviceMesh* mesh = nullptr;
  bool activation_checkpointing = false;
};

// What the training program needs of the result.
struct ParallelLlama {
  std::vector<dist::TensorParallelSplit> splits;  // the split parameters; none without tensor parallelism
  dist::VocabPiece vocabulary;                    // the logits' columns on this rank: all of them without
};

// What the tensor-parallel ranks exchange in one training step of `tokens` tokens per rank: the
// plan's all-reduces (per decoder layer two in forward and two in backward, two more under
// activation checkpointing's recompute; the embedding's and the head's; the loss's three of one f32
// per token), the bytes each rank receives as dist::traffic_of counts them.
struct TensorParallelTraffic {
  int ranks = 1;
  std::int64_t all_reduces = 0, bytes_received = 0;
  std::string str() const;  // "tp=2: 13 all-reduces, 8160 B received per rank and step"
};
TensorParallelTraffic tensor_parallel_traffic(const models::LlamaConfig& config, int ranks,
                                              std::int64_t tokens, DType activations,
                                              bool activation_checkpointing);

// The Llama's tensor-parallel plan for dist::parallelize_module.
std::vector<std::pair<std::string, dist::ParallelStyle>> llama_tensor_parallel_plan();

// The steps, in the order parallelize_llama takes them.
// Splits the layers over `group` by llama_tensor_parallel_plan(): each rank keeps its pieces. Refused,
// naming the numbers: heads or key/value heads that the group's size does not divide, tied embeddings.
ParallelLlama apply_tensor_parallel(models::Llama& model, dist::Communicator& group);
// Each decoder layer's forward recomputed in its backward (nn::apply_activation_checkpointing).
void apply_activation_checkpointing(models::Llama& model);
// One FSDP unit per decoder layer, then the root (embedding, final norm, head), with `options`.
void apply_fsdp(models::Llama& model, const dist::FsdpOptions& options);
// After FSDP, with tensor parallelism: the split parameters as pieces of the whole over the mesh's
// world (dist::place_in_mesh), the others counted on its first tensor-parallel rank, so that gradient
// norms, checkpoints and full safetensors run over all its ranks, each element counted once.
void place_in_mesh(models::Llama& model, const dist::DeviceMesh& mesh, const ParallelLlama& layout);

// The steps composed: parallelises `model` in place; under mixed precision its logits come in param_dtype
// (the losses of autograd's cross_entropy and vocab_parallel_cross_entropy are f32 all the same). Parameters
// still deferred (nn::DeferredInitGuard) are drawn piece by piece; materialised ones (a loaded model) are
// cut. With tensor parallelism the model's logits hold this rank's vocabulary columns: take the loss with
// dist::vocab_parallel_cross_entropy. The parameters are placed in the mesh (dist::place_in_mesh): gradient
// norms, checkpoints and the full safetensors run over all its ranks, each element counted once. Refused,
// naming the numbers: heads or key/value heads that tp does not divide, tied embeddings with tensor
// parallelism, a mesh without "dp" and "tp", an FSDP communicator other than the mesh's "dp".
ParallelLlama parallelize_llama(models::Llama& model, const LlamaParallelism& options);

}  // namespace shardlab::recipes
