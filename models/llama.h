// models/llama.h: the Llama-style decoder (RMSNorm, rotary position embedding, grouped-query
// attention, SwiGLU), with Hugging Face's module and parameter names, so that its state dict is
// a LlamaForCausalLM checkpoint and a HF checkpoint loads into it:
//
//   models::Llama model(models::LlamaConfig::preset("tiny"), /*seed=*/1);
//   Variable logits = model(tokens, padding);       // tokens [B, T] i64 -> logits [B, T, vocab]
//   Variable packed = model(tokens, {}, documents);  // block-causal: each document on its own
//   models::save_pretrained(model, "out/");         // model.safetensors + config.json
//
// The model does not know whether it is sharded: FSDP units wrap its decoder layers and itself.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nn/layers.h"

namespace shardlab::models {

// The fields of Hugging Face's LlamaConfig that shape the model.
struct LlamaConfig {
  std::int64_t vocab_size = 50000;
  std::int64_t hidden_size = 768;
  std::int64_t intermediate_size = 3072;
  std::int64_t num_hidden_layers = 12;
  std::int64_t num_attention_heads = 12;
  std::int64_t num_key_value_heads = 3;  // GQA; 1 = MQA; = num_attention_heads = MHA
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  // Llama 3's rope_scaling (rope_type "llama3"): wavelengths longer than original / low_freq_factor
  // are stretched by `factor`, those shorter than original / high_freq_factor kept, those between
  // blended. None: the plain rotary embedding.
  struct Llama3RopeScaling {
    double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
    std::int64_t original_max_position_embeddings = 8192;
  };
  std::optional<Llama3RopeScaling> rope_scaling;

  std::int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // The rotation frequency of dimension pair i (0 <= i < head_dim / 2), in radians per position:
  // rope_theta^(-2i / head_dim), rescaled as rope_scaling says.
  double inverse_frequency(std::int64_t i) const;
  // Throws naming the fields when the shapes do not fit together (hidden not divisible by the
  // heads, heads not divisible by the key/value heads, an odd head dim, a size below 1).
  void validate() const;
  std::int64_t parameter_count() const;

  // "tiny" (tests: 2 layers, hidden 40, 4/2 heads), "small" (the defaults above, the Llama of
  // PyTorch's FSDP2 article) and "1b"
  // (TinyLlama's shape: 2048/5632, 22 layers, 32/4 heads, vocab 32000).
  static LlamaConfig preset(std::string_view name);
  // Hugging Face's config.json of a LlamaForCausalLM; from_json reads the fields above (missing
  // optional ones take HF's defaults) and refuses other architectures or wrong field types,
  // naming `source` (the file).
  nlohmann::json to_json() const;
  static LlamaConfig from_json(const nlohmann::json& json, const std::string& source);
  static LlamaConfig from_file(const std::string& path);  // a config.json anywhere
};

// Keys and values of the positions seen so far, per decoder layer, for generation: a prompt
// runs once, then each new token attends to the cache instead of recomputing the prefix.
struct KvCache {
  KvCache(const LlamaConfig& config, std::int64_t batch, std::int64_t capacity, const TensorOptions& options);
  std::vector<Tensor> keys, values;  // per layer [B, kv_heads, capacity, head_dim]
  std::int64_t length = 0;           // positions filled
  std::int64_t capacity = 0;
};

// cos and sin of the rotary angles, [max_positions, head_dim] each (rotate-half layout: the
// angle of pair i repeated at i and i + head_dim/2), computed in f64 and stored in f32, kept as
// non-persistent buffers (not in the state dict, as in Hugging Face).
class LlamaRotaryEmbeddingImpl : public nn::Module {
 public:
  explicit LlamaRotaryEmbeddingImpl(const LlamaConfig& config);
  bool has_forward() const override { return false; }
  std::string describe() const override;
  // Rows [offset, offset + length) of the tables, in `dtype`.
  std::pair<Tensor, Tensor> rows(std::int64_t offset, std::int64_t length, DType dtype) const;

  Tensor cos, sin;
};
using LlamaRotaryEmbedding = nn::Holder<LlamaRotaryEmbeddingImpl>;

class LlamaAttentionImpl : public nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  // x [B, T, hidden]; cos/sin [T, head_dim]; padding bool [B, T] (true at padding) or undefined;
  // documents i64 [B, T] (each token's document: a token attends to its own document's only) or
  // undefined. With a cache, keys and values are appended to layer `layer`'s entries and the queries
  // attend to every cached position (a prompt of several tokens only as the cache's first entry).
  Variable operator()(const Variable& x, const Tensor& cos, const Tensor& sin, const Tensor& padding,
                      const Tensor& documents = {}, KvCache* cache = nullptr, std::int64_t layer = 0);

  const std::int64_t heads, kv_heads, head_dim;
  nn::Linear q_proj, k_proj, v_proj, o_proj;
};
using LlamaAttention = nn::Holder<LlamaAttentionImpl>;

// down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMlpImpl : public nn::Module {
 public:
  explicit LlamaMlpImpl(const LlamaConfig& config);
  Variable operator()(const Variable& x);

  nn::Linear gate_proj, up_proj, down_proj;
};
using LlamaMlp = nn::Holder<LlamaMlpImpl>;

// x + attn(norm(x)), then + mlp(norm(.)): the unit FSDP wraps, one per layer.
class LlamaDecoderLayerImpl : public nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  Variable operator()(const Variable& x, const Tensor& cos, const Tensor& sin, const Tensor& padding,
                      const Tensor& documents = {}, KvCache* cache = nullptr, std::int64_t layer = 0);

  LlamaAttention self_attn;
  LlamaMlp mlp;
  nn::RMSNorm input_layernorm, post_attention_layernorm;
};
using LlamaDecoderLayer = nn::Holder<LlamaDecoderLayerImpl>;

// Hugging Face's LlamaModel: embeddings, the decoder layers and the final norm.
class LlamaModelImpl : public nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& config);
  bool has_forward() const override { return false; }  // LlamaImpl runs its pieces

  nn::Embedding embed_tokens;
  nn::ModuleList<LlamaDecoderLayerImpl> layers;
  nn::RMSNorm norm;
  LlamaRotaryEmbedding rotary_emb;
};
using LlamaModel = nn::Holder<LlamaModelImpl>;

// Hugging Face's LlamaForCausalLM: `model` and `lm_head` (absent when tie_word_embeddings:
// the embedding matrix is the head).
class LlamaImpl : public nn::Module {
 public:
  // Every weight N(0, 0.02) and every norm 1, drawn by nn::initialize(*this, seed) by name.
  LlamaImpl(const LlamaConfig& config, std::uint64_t seed = 1);
  // tokens [B, T] (i64/i32), padding bool [B, T] (true at padding tokens: they neither attend
  // nor are attended) or undefined, documents i64 [B, T] or undefined -> logits [B, T, vocab].
  // Documents packed into a row (each token's document, any values: tokens of equal value are one
  // document) attend block-causally, each to its own tokens only, as if alone: the rotary positions
  // run on across the row, and attention depends only on their differences. With a cache (no
  // documents), the tokens continue the cached positions.
  Variable operator()(const Tensor& tokens, const Tensor& padding = {}, const Tensor& documents = {},
                      KvCache* cache = nullptr);

  const LlamaConfig config;
  LlamaModel model;
  std::optional<nn::Linear> lm_head;
};
using Llama = nn::Holder<LlamaImpl>;

// Writes `dir`/model.safetensors (f32, HF names) and `dir`/config.json, creating `dir`: a
// directory transformers' LlamaForCausalLM.from_pretrained reads unchanged. `state` is the
// model's parameters by name (gathered from the shards when sharded).
void save_pretrained(const std::string& dir, const LlamaConfig& config, const nn::StateDict& state);
// Its halves, for a caller that writes the weights itself (dist::save_pretrained_safetensors from the
// shards, a consolidated checkpoint): where they go, and config.json alone (creating `dir`), its
// torch_dtype naming the weights' dtype (f32, bf16 or f16; transformers' dtype="auto" loads that).
std::string pretrained_weights_path(const std::string& dir);
void save_pretrained_config(const std::string& dir, const LlamaConfig& config,
                            DType weights_dtype = DType::f32);
// config.json of a saved or Hugging Face directory.
LlamaConfig load_pretrained_config(const std::string& dir);
// The tensors of `dir`/model.safetensors, or of the files model.safetensors.index.json names,
// checked strictly against `expected` (names and shapes; missing, unexpected and mismatched
// tensors are errors naming them and the file), converted to f32.
nn::StateDict load_pretrained_weights(const std::string& dir, const nn::Named<Shape>& expected);
// Points every parameter of a model made under nn::DeferredInitGuard at its values in `dir` (checked as
// load_pretrained_weights checks them, from the files' headers alone): whoever then draws a parameter,
// or its shard or tensor-parallel piece (dist::fully_shard, parallelize_module), reads just those
// elements from the file, converted to f32, and no rank ever holds the whole model. Refused: a
// parameter that already holds values.
void defer_to_pretrained(Llama& model, const std::string& dir);

}  // namespace shardlab::models
