// models/generate.h: text generation with a Llama: the prompt once, then one token at a time
// through the KV cache, greedy or sampled with temperature and top-k (llama2.c's run.c loop).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "models/llama.h"

namespace shardlab::models {

struct SamplingOptions {
  std::int64_t max_new_tokens = 200;
  double temperature = 0.8;                // 0: greedy (the most likely token every step)
  std::int64_t top_k = 40;                 // sample among the k most likely tokens; 0: all of them
  std::uint64_t seed = 0;                  // draws keyed by (seed, position): the same text on every run
  std::optional<std::int64_t> stop_token;  // ends the text (not included)
};

// The new tokens after `prompt` (not empty): at most max_new_tokens, fewer when the stop token
// comes or the model's max_position_embeddings is reached. Runs without gradients, in eval mode.
std::vector<std::int64_t> generate(LlamaImpl& model, const std::vector<std::int64_t>& prompt,
                                   const SamplingOptions& options = {});

// The token picked from one position's logits [vocab]: the argmax at temperature 0, else a draw
// from softmax(logits / temperature) restricted to the top_k largest, using `uniform` in [0, 1).
std::int64_t pick_token(const std::vector<float>& logits, double temperature, std::int64_t top_k,
                        double uniform);

}  // namespace shardlab::models
