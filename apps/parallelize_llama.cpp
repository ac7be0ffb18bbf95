// apps/parallelize_llama.cpp: FSDP units and activation checkpointing for the Llama.
#include "apps/parallelize_llama.h"

#include <string>

#include "nn/module.h"

namespace shardlab::apps {

void parallelize_llama(models::Llama& model, const dist::FsdpOptions& fsdp, bool activation_checkpointing) {
  for (auto& layer : *model->model->layers) dist::fully_shard(*layer, fsdp);
  dist::FsdpOptions root = fsdp;
  root.mixed_precision.output_dtype = DType::f32;  // f32 logits for the loss
  dist::fully_shard(*model, root);
  if (activation_checkpointing) {
    nn::apply_activation_checkpointing(*model, [](const std::string&, nn::Module& module) {
      return dynamic_cast<models::LlamaDecoderLayerImpl*>(&module) != nullptr;
    });
  }
}

}  // namespace shardlab::apps
