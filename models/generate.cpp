// models/generate.cpp: the generation loop and the token picker.
#include "models/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/random.h"

namespace shardlab::models {

std::int64_t pick_token(const std::vector<float>& logits, double temperature, std::int64_t top_k,
                        double uniform) {
  SHARDLAB_CHECK(!logits.empty(), "pick_token: no logits");
  SHARDLAB_CHECK(temperature >= 0, "pick_token: temperature must be >= 0, got {}", temperature);
  SHARDLAB_CHECK(top_k >= 0, "pick_token: top_k must be >= 0, got {}", top_k);
  if (temperature == 0) return std::max_element(logits.begin(), logits.end()) - logits.begin();
  std::vector<std::int64_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const std::size_t kept =
      top_k == 0 ? order.size() : std::min(order.size(), static_cast<std::size_t>(top_k));
  // Largest first; ties by index, so the choice never depends on the sort's whims.
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kept), order.end(),
                    [&](std::int64_t a, std::int64_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  const double top = logits[order[0]];
  std::vector<double> weights(kept);
  for (std::size_t i = 0; i < kept; ++i) weights[i] = std::exp((logits[order[i]] - top) / temperature);
  double threshold = uniform * std::accumulate(weights.begin(), weights.end(), 0.0);
  for (std::size_t i = 0; i < kept; ++i) {
    threshold -= weights[i];
    if (threshold < 0) return order[i];
  }
  return order[kept - 1];  // uniform * total rounded up to the total
}

std::vector<std::int64_t> generate(LlamaImpl& model, const std::vector<std::int64_t>& prompt,
                                   const SamplingOptions& options) {
  SHARDLAB_CHECK(!prompt.empty(), "generate: the prompt is empty (start with the tokenizer's [BOT])");
  const std::int64_t limit = model.config.max_position_embeddings;
  const auto prompt_length = static_cast<std::int64_t>(prompt.size());
  SHARDLAB_CHECK(prompt_length < limit, "generate: the prompt has {} tokens, the model at most {} positions",
                 prompt_length, limit);
  const bool was_training = model.is_training();
  model.eval();
  const NoGradGuard no_grad;
  // The parameters as named_parameters() gives them (a sharded model's shards): where the model
  // computes, and in what.
  const Variable first = model.named_parameters().front().second;
  const Device device = first.device();
  const std::int64_t capacity = std::min(limit, prompt_length + options.max_new_tokens);
  KvCache cache(model.config, 1, capacity, TensorOptions{}.with_device(device).with_dtype(first.dtype()));
  std::vector<std::int64_t> out;
  Tensor input = from_vector(prompt, {1, prompt_length}, device);
  while (static_cast<std::int64_t>(out.size()) < options.max_new_tokens && cache.length < capacity) {
    const Tensor logits = model(input, {}, {}, &cache).data();
    const std::vector<float> last = logits.select(1, logits.size(1) - 1).to(DType::f32).to_vector<float>();
    const double draw = uniform({1}, RandomKey{options.seed, static_cast<std::uint64_t>(cache.length)}, 0.0,
                                1.0, TensorOptions{}.with_dtype(DType::f64))
                            .item<double>();
    const std::int64_t token = pick_token(last, options.temperature, options.top_k, draw);
    if (options.stop_token && token == *options.stop_token) break;
    out.push_back(token);
    input = from_vector(std::vector<std::int64_t>{token}, {1, 1}, device);
  }
  model.train(was_training);
  return out;
}

}  // namespace shardlab::models
