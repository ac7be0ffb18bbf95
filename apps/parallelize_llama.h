// apps/parallelize_llama.h: how the training program parallelises the Llama: one FSDP unit per
// decoder layer plus the root (embedding, final norm and head), as the FSDP2 article's script
// shards it, and activation checkpointing per decoder layer. The one place that knows both the
// model (models/llama.h) and FSDP (dist/fsdp/fsdp.h): the model does not know it is sharded, and
// FSDP does not know the model.
#pragma once

#include "dist/fsdp/fsdp.h"
#include "models/llama.h"

namespace shardlab::apps {

// Shards `model` in place: the decoder layers with `fsdp`, then the root, whose output stays f32
// (the loss's logits) under mixed precision. Parameters still deferred (nn::DeferredInitGuard) are
// drawn shard by shard; materialised ones (a loaded model) are cut into shards.
void parallelize_llama(models::Llama& model, const dist::FsdpOptions& fsdp, bool activation_checkpointing);

}  // namespace shardlab::apps
