// recipes/llama.cpp: tensor parallelism, activation checkpointing and FSDP units for the Llama.
#include "recipes/llama.h"

#include <fmt/format.h>

#include "dist/comm/collective.h"
#include "nn/module.h"

namespace shardlab::recipes {

std::vector<std::pair<std::string, dist::ParallelStyle>> llama_tensor_parallel_plan() {
  using enum dist::ParallelStyle;
  // Each block half is one region: its input enters once (one all-reduce of its gradient in
  // backward), its output leaves through the rowwise layer's sum (one all-reduce in forward).
  return {{"model.embed_tokens", rowwise},
          {"model.layers.*.self_attn", region_input},
          {"model.layers.*.self_attn.q_proj", colwise},
          {"model.layers.*.self_attn.k_proj", colwise},
          {"model.layers.*.self_attn.v_proj", colwise},
          {"model.layers.*.self_attn.o_proj", rowwise},
          {"model.layers.*.mlp", region_input},
          {"model.layers.*.mlp.gate_proj", colwise},
          {"model.layers.*.mlp.up_proj", colwise},
          {"model.layers.*.mlp.down_proj", rowwise},
          {"lm_head", colwise}};
}

std::string TensorParallelTraffic::str() const {
  return fmt::format("tp={}: {} all-reduces, {} B received per rank and step", ranks, all_reduces,
                     bytes_received);
}

TensorParallelTraffic tensor_parallel_traffic(const models::LlamaConfig& config, int ranks,
                                              std::int64_t tokens, DType activations,
                                              bool activation_checkpointing) {
  const std::int64_t layers = config.num_hidden_layers;
  const std::int64_t hidden_sums = 2 + 4 * layers + (activation_checkpointing ? 2 * layers : 0);
  const auto received = [&](DType dtype, std::int64_t count) {
    return dist::traffic_of({.op = dist::Collective::all_reduce, .dtype = dtype, .count = count}, 0, ranks)
        .bytes_received;
  };
  constexpr std::int64_t kLossSums = 3;  // max, sum of exponentials, target logit
  return {.ranks = ranks,
          .all_reduces = hidden_sums + kLossSums,
          .bytes_received = hidden_sums * received(activations, tokens * config.hidden_size) +
                            kLossSums * received(DType::f32, tokens)};
}

namespace {

void check_tensor_parallel_fits(const models::LlamaConfig& config, int ranks) {
  SHARDLAB_CHECK(
      config.num_attention_heads % ranks == 0 && config.num_key_value_heads % ranks == 0,
      "tensor parallel over {} ranks: each rank holds whole heads, but the Llama's {} attention heads "
      "(num_attention_heads) and {} key/value heads (num_key_value_heads) do not both divide by tp {}",
      ranks, config.num_attention_heads, config.num_key_value_heads, ranks);
  SHARDLAB_CHECK(
      !config.tie_word_embeddings,
      "tensor parallel over {} ranks: tied embeddings (tie_word_embeddings) are not supported; the head "
      "would need the embedding's split as its own",
      ranks);
}

// FSDP's options over a mesh: its "dp" ranks.
dist::FsdpOptions over_data_parallel(dist::FsdpOptions fsdp, const dist::DeviceMesh& mesh) {
  SHARDLAB_CHECK(mesh.ndim() == 2 && mesh.names()[0] == "dp" && mesh.names()[1] == "tp",
                 "parallelize_llama: the mesh must be dp x tp, got {}", mesh.str());
  SHARDLAB_CHECK(
      fsdp.communicator == nullptr || fsdp.communicator == &mesh["dp"],
      "parallelize_llama: with a mesh, FSDP runs over its \"dp\" ranks; leave fsdp.communicator unset");
  fsdp.communicator = &mesh["dp"];
  return fsdp;
}

}  // namespace

ParallelLlama apply_tensor_parallel(models::Llama& model, dist::Communicator& group) {
  check_tensor_parallel_fits(model->config, group.size());
  ParallelLlama result{.splits = dist::parallelize_module(*model, group, llama_tensor_parallel_plan())};
  for (const dist::TensorParallelSplit& split : result.splits) {
    if (split.name == "lm_head.weight") result.vocabulary = {split.offset, model->config.vocab_size};
  }
  return result;
}

void apply_activation_checkpointing(models::Llama& model) {
  nn::apply_activation_checkpointing(*model, [](const std::string&, nn::Module& module) {
    return dynamic_cast<models::LlamaDecoderLayerImpl*>(&module) != nullptr;
  });
}

void apply_fsdp(models::Llama& model, const dist::FsdpOptions& options) {
  for (auto& layer : *model->model->layers) dist::fully_shard(*layer, options);
  // The root's logits stay in the compute dtype: cross_entropy takes a bf16 row's loss in f32 itself,
  // with the bits of an f32 copy's, which would cost 4 bytes a logit and its f32 gradient.
  dist::fully_shard(*model, options);
}

void place_in_mesh(models::Llama& model, const dist::DeviceMesh& mesh, const ParallelLlama& layout) {
  nn::Named<ShardInfo::Piece> pieces;
  for (const dist::TensorParallelSplit& split : layout.splits) {
    pieces.emplace_back(split.name, ShardInfo::Piece{split.full_shape, split.dim, split.offset});
  }
  dist::place_in_mesh(*model, mesh.world(), pieces, mesh.coordinate("tp") == 0);
}

ParallelLlama parallelize_llama(models::Llama& model, const LlamaParallelism& options) {
  const bool split = options.mesh != nullptr && options.mesh->size("tp") > 1;
  const dist::FsdpOptions fsdp =
      options.mesh ? over_data_parallel(options.fsdp, *options.mesh) : options.fsdp;
  const ParallelLlama layout = split ? apply_tensor_parallel(model, (*options.mesh)["tp"])
                                     : ParallelLlama{.vocabulary = {0, model->config.vocab_size}};
  if (options.activation_checkpointing) apply_activation_checkpointing(model);
  apply_fsdp(model, fsdp);
  if (split) place_in_mesh(model, *options.mesh, layout);
  return layout;
}

}  // namespace shardlab::recipes
