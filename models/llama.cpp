// models/llama.cpp: the Llama's configuration, layers and forward, and its Hugging Face
// directory format (config.json + model.safetensors).
#include "models/llama.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numbers>
#include <set>

#include "autograd/functional.h"
#include "core/ops.h"
#include "nn/safetensors.h"

namespace shardlab::models {

namespace fs = std::filesystem;

// --- configuration -------------------------------------------------------------------------------

void LlamaConfig::validate() const {
  for (const auto& [value, field] :
       {std::pair{vocab_size, "vocab_size"}, std::pair{hidden_size, "hidden_size"},
        std::pair{intermediate_size, "intermediate_size"}, std::pair{num_hidden_layers, "num_hidden_layers"},
        std::pair{num_attention_heads, "num_attention_heads"},
        std::pair{num_key_value_heads, "num_key_value_heads"},
        std::pair{max_position_embeddings, "max_position_embeddings"}}) {
    SHARDLAB_CHECK(value >= 1, "LlamaConfig: {} must be at least 1, got {}", field, value);
  }
  SHARDLAB_CHECK(hidden_size % num_attention_heads == 0,
                 "LlamaConfig: hidden_size {} is not divisible by num_attention_heads {}", hidden_size,
                 num_attention_heads);
  SHARDLAB_CHECK(num_attention_heads % num_key_value_heads == 0,
                 "LlamaConfig: num_attention_heads {} is not divisible by num_key_value_heads {}",
                 num_attention_heads, num_key_value_heads);
  SHARDLAB_CHECK(head_dim() % 2 == 0,
                 "LlamaConfig: the head dim hidden_size / num_attention_heads = {} / {} = {} must be even "
                 "(rotary embedding rotates pairs)",
                 hidden_size, num_attention_heads, head_dim());
  SHARDLAB_CHECK(rms_norm_eps > 0, "LlamaConfig: rms_norm_eps must be positive, got {}", rms_norm_eps);
  SHARDLAB_CHECK(rope_theta > 0, "LlamaConfig: rope_theta must be positive, got {}", rope_theta);
  if (rope_scaling) {
    const Llama3RopeScaling& r = *rope_scaling;
    SHARDLAB_CHECK(r.factor > 0 && r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor &&
                       r.original_max_position_embeddings >= 1,
                   "LlamaConfig: rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                   "original_max_position_embeddings >= 1, got {}, {}, {} and {}",
                   r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
  }
}

std::int64_t LlamaConfig::parameter_count() const {
  const std::int64_t kv_dim = num_key_value_heads * head_dim();
  const std::int64_t attention = 2 * hidden_size * hidden_size + 2 * hidden_size * kv_dim;
  const std::int64_t layer = attention + 3 * hidden_size * intermediate_size + 2 * hidden_size;
  const std::int64_t embedding = vocab_size * hidden_size;
  return embedding + num_hidden_layers * layer + hidden_size + (tie_word_embeddings ? 0 : embedding);
}

LlamaConfig LlamaConfig::preset(std::string_view name) {
  if (name == "small") return {};
  if (name == "tiny") {
    // Small enough for gradchecks and golden files; a layer holds 16400 parameters, which 3
    // ranks do not divide (uneven shards).
    return {.vocab_size = 259,
            .hidden_size = 40,
            .intermediate_size = 96,
            .num_hidden_layers = 2,
            .num_attention_heads = 4,
            .num_key_value_heads = 2,
            .max_position_embeddings = 512};
  }
  if (name == "1b") {
    return {.vocab_size = 32000,
            .hidden_size = 2048,
            .intermediate_size = 5632,
            .num_hidden_layers = 22,
            .num_attention_heads = 32,
            .num_key_value_heads = 4,
            .max_position_embeddings = 2048};
  }
  fail("LlamaConfig: no preset named '{}' (tiny, small, 1b)", name);
}

double LlamaConfig::inverse_frequency(std::int64_t i) const {
  const double plain =
      1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / static_cast<double>(head_dim()));
  if (!rope_scaling) return plain;
  const Llama3RopeScaling& r = *rope_scaling;
  const double original = static_cast<double>(r.original_max_position_embeddings);
  const double wavelength = 2 * std::numbers::pi / plain;
  if (wavelength < original / r.high_freq_factor) return plain;
  if (wavelength > original / r.low_freq_factor) return plain / r.factor;
  const double smooth =
      (original / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return (1 - smooth) * plain / r.factor + smooth * plain;
}

nlohmann::json LlamaConfig::to_json() const {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden_size},
          {"intermediate_size", intermediate_size},
          {"num_hidden_layers", num_hidden_layers},
          {"num_attention_heads", num_attention_heads},
          {"num_key_value_heads", num_key_value_heads},
          {"head_dim", head_dim()},
          {"max_position_embeddings", max_position_embeddings},
          {"rms_norm_eps", rms_norm_eps},
          {"rope_theta", rope_theta},
          {"rope_scaling", rope_scaling ? nlohmann::json{{"rope_type", "llama3"},
                                                         {"factor", rope_scaling->factor},
                                                         {"low_freq_factor", rope_scaling->low_freq_factor},
                                                         {"high_freq_factor", rope_scaling->high_freq_factor},
                                                         {"original_max_position_embeddings",
                                                          rope_scaling->original_max_position_embeddings}}
                                        : nlohmann::json()},
          {"tie_word_embeddings", tie_word_embeddings},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"attention_dropout", 0.0},
          {"initializer_range", 0.02},
          {"pretraining_tp", 1},
          {"use_cache", true},
          {"torch_dtype", "float32"}};
}

namespace {

// The value of `field`, when present, as T; a field of another JSON type is an error naming it.
template <typename T>
std::optional<T> json_field(const nlohmann::json& json, const char* field, const std::string& source) {
  const auto it = json.find(field);
  if (it == json.end() || it->is_null()) return std::nullopt;
  const bool fits = std::is_same_v<T, bool>          ? it->is_boolean()
                    : std::is_same_v<T, std::string> ? it->is_string()
                    : std::is_integral_v<T>          ? it->is_number_integer()
                                                     : it->is_number();
  SHARDLAB_CHECK(fits, "{}: field '{}' has the wrong type ({})", source, field, it->dump());
  return it->get<T>();
}

template <typename T>
T required_field(const nlohmann::json& json, const char* field, const std::string& source) {
  const std::optional<T> value = json_field<T>(json, field, source);
  SHARDLAB_CHECK(value.has_value(), "{}: required field '{}' is missing", source, field);
  return *value;
}

// A rope description, transformers 4's rope_scaling or 5's rope_parameters: no scaling for rope_type
// (or the older "type") "default" or absent, Llama 3's with its four numbers for "llama3"; any other
// kind is refused by name.
std::optional<LlamaConfig::Llama3RopeScaling> rope_scaling_of(const nlohmann::json& rope,
                                                              const std::string& where) {
  const std::string kind = json_field<std::string>(rope, "rope_type", where)
                               .value_or(json_field<std::string>(rope, "type", where).value_or("default"));
  if (kind == "default") return std::nullopt;
  SHARDLAB_CHECK(kind == "llama3", "{}: rope kind '{}' is not supported (llama3, or default for none)", where,
                 kind);
  return LlamaConfig::Llama3RopeScaling{
      .factor = required_field<double>(rope, "factor", where),
      .low_freq_factor = required_field<double>(rope, "low_freq_factor", where),
      .high_freq_factor = required_field<double>(rope, "high_freq_factor", where),
      .original_max_position_embeddings =
          required_field<std::int64_t>(rope, "original_max_position_embeddings", where)};
}

// rope_theta and the scaling: from rope_parameters where transformers 5 wrote them (rope_theta inside),
// else from transformers 4's rope_theta and rope_scaling (what Llama 3's own config.json holds).
void read_rope(const nlohmann::json& json, const std::string& source, LlamaConfig& config) {
  for (const char* field : {"rope_parameters", "rope_scaling"}) {
    const auto it = json.find(field);
    if (it == json.end() || it->is_null()) continue;
    SHARDLAB_CHECK(it->is_object(), "{}: {} {} is not an object", source, field, it->dump());
    const std::string where = source + ": " + field;
    if (std::string_view(field) == "rope_parameters")
      config.rope_theta = json_field<double>(*it, "rope_theta", where).value_or(config.rope_theta);
    config.rope_scaling = rope_scaling_of(*it, where);
    return;
  }
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const nlohmann::json& json, const std::string& source) {
  SHARDLAB_CHECK(json.is_object(), "{}: expected a JSON object", source);
  const auto model_type = json_field<std::string>(json, "model_type", source);
  SHARDLAB_CHECK(!model_type || *model_type == "llama", "{}: model_type is '{}', expected 'llama'", source,
                 model_type.value_or(""));
  const auto act = json_field<std::string>(json, "hidden_act", source);
  SHARDLAB_CHECK(!act || *act == "silu", "{}: hidden_act '{}' is not supported (silu)", source,
                 act.value_or(""));
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    SHARDLAB_CHECK(!json_field<bool>(json, bias, source).value_or(false), "{}: {} = true is not supported",
                   source, bias);
  }
  LlamaConfig config{
      .vocab_size = required_field<std::int64_t>(json, "vocab_size", source),
      .hidden_size = required_field<std::int64_t>(json, "hidden_size", source),
      .intermediate_size = required_field<std::int64_t>(json, "intermediate_size", source),
      .num_hidden_layers = required_field<std::int64_t>(json, "num_hidden_layers", source),
      .num_attention_heads = required_field<std::int64_t>(json, "num_attention_heads", source),
  };
  // Hugging Face's defaults for the optional fields.
  config.num_key_value_heads =
      json_field<std::int64_t>(json, "num_key_value_heads", source).value_or(config.num_attention_heads);
  config.max_position_embeddings =
      json_field<std::int64_t>(json, "max_position_embeddings", source).value_or(2048);
  config.rms_norm_eps = json_field<double>(json, "rms_norm_eps", source).value_or(1e-6);
  config.rope_theta = json_field<double>(json, "rope_theta", source).value_or(10000.0);
  config.tie_word_embeddings = json_field<bool>(json, "tie_word_embeddings", source).value_or(false);
  read_rope(json, source, config);
  try {
    config.validate();
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
  const auto head_dim = json_field<std::int64_t>(json, "head_dim", source);
  SHARDLAB_CHECK(!head_dim || *head_dim == config.head_dim(),
                 "{}: head_dim {} differs from hidden_size / num_attention_heads = {} (not supported)",
                 source, head_dim.value_or(0), config.head_dim());
  return config;
}

// --- layers --------------------------------------------------------------------------------------

KvCache::KvCache(const LlamaConfig& config, std::int64_t batch, std::int64_t cache_capacity,
                 const TensorOptions& options)
    : capacity(cache_capacity) {
  SHARDLAB_CHECK(batch >= 1, "KvCache: batch {} must be at least 1", batch);
  SHARDLAB_CHECK(capacity >= 1 && capacity <= config.max_position_embeddings,
                 "KvCache: capacity {} must be in [1, max_position_embeddings = {}]", capacity,
                 config.max_position_embeddings);
  const Shape shape{batch, config.num_key_value_heads, capacity, config.head_dim()};
  for (std::int64_t i = 0; i < config.num_hidden_layers; ++i) {
    keys.push_back(empty(shape, options));
    values.push_back(empty(shape, options));
  }
}

LlamaRotaryEmbeddingImpl::LlamaRotaryEmbeddingImpl(const LlamaConfig& config)
    : nn::Module("LlamaRotaryEmbedding") {
  const std::int64_t positions = config.max_position_embeddings, dim = config.head_dim(), half = dim / 2;
  std::vector<float> cos_values(static_cast<std::size_t>(positions * dim));
  std::vector<float> sin_values(cos_values.size());
  for (std::int64_t i = 0; i < half; ++i) {
    const double inverse_frequency = config.inverse_frequency(i);
    for (std::int64_t t = 0; t < positions; ++t) {
      const double angle = static_cast<double>(t) * inverse_frequency;
      for (const std::int64_t column : {i, i + half}) {
        cos_values[static_cast<std::size_t>(t * dim + column)] = static_cast<float>(std::cos(angle));
        sin_values[static_cast<std::size_t>(t * dim + column)] = static_cast<float>(std::sin(angle));
      }
    }
  }
  register_buffer("cos", from_vector(cos_values, {positions, dim}), /*persistent=*/false);
  register_buffer("sin", from_vector(sin_values, {positions, dim}), /*persistent=*/false);
}

std::string LlamaRotaryEmbeddingImpl::describe() const {
  const Tensor table = named_buffers(false).front().second;
  return fmt::format("LlamaRotaryEmbedding(positions={}, head_dim={})", table.size(0), table.size(1));
}

std::pair<Tensor, Tensor> LlamaRotaryEmbeddingImpl::rows(std::int64_t offset, std::int64_t length,
                                                         DType dtype) const {
  // Looked up by name each call: Module::to() replaces the buffers.
  const nn::Named<Tensor> tables = named_buffers(false);
  const std::int64_t positions = tables[0].second.size(0);
  SHARDLAB_CHECK(offset >= 0 && offset + length <= positions,
                 "Llama: positions [{}, {}) exceed max_position_embeddings = {}", offset, offset + length,
                 positions);
  return {tables[0].second.narrow(0, offset, length).to(dtype).contiguous(),
          tables[1].second.narrow(0, offset, length).to(dtype).contiguous()};
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config)
    : nn::Module("LlamaAttention"),
      heads(config.num_attention_heads),
      kv_heads(config.num_key_value_heads),
      head_dim(config.head_dim()),
      q_proj(nn::LinearOptions(config.hidden_size, heads * head_dim).bias(false)),
      k_proj(nn::LinearOptions(config.hidden_size, kv_heads * head_dim).bias(false)),
      v_proj(nn::LinearOptions(config.hidden_size, kv_heads * head_dim).bias(false)),
      o_proj(nn::LinearOptions(heads * head_dim, config.hidden_size).bias(false)) {
  register_module("q_proj", q_proj.ptr());
  register_module("k_proj", k_proj.ptr());
  register_module("v_proj", v_proj.ptr());
  register_module("o_proj", o_proj.ptr());
}

namespace {

// [B, T, heads * head_dim] -> [B, heads, T, head_dim]. The heads are the projection's width over
// head_dim, as in Hugging Face's attention: a projection split over tensor-parallel ranks gives each
// rank its own heads.
Variable split_heads(const Variable& x, std::int64_t head_dim) {
  return transpose(reshape(x, {x.size(0), x.size(1), -1, head_dim}), 1, 2);
}

// Writes the new keys or values [B, kv_heads, T, D] at the cache's next positions and returns
// every position so far.
Variable append_to_cache(const Tensor& entry, const Variable& fresh, std::int64_t length) {
  const std::int64_t count = fresh.size(2);
  SHARDLAB_CHECK(length + count <= entry.size(2),
                 "KvCache: {} cached + {} new positions exceed its capacity {}", length, count,
                 entry.size(2));
  entry.narrow(2, length, count).copy_(fresh.data());
  return constant(entry.narrow(2, 0, length + count));
}

}  // namespace

Variable LlamaAttentionImpl::operator()(const Variable& input, const Tensor& cos_rows, const Tensor& sin_rows,
                                        const Tensor& padding_mask, const Tensor& document_ids,
                                        KvCache* cache, std::int64_t layer) {
  // Captures by value: under activation checkpointing the forward runs again in backward.
  return with_hooks(
      [this, cache, layer](const Variable& x, const Tensor& cos, const Tensor& sin, const Tensor& padding,
                           const Tensor& documents) {
        const std::int64_t batch = x.size(0), length = x.size(1);
        const Variable q = rotary_embedding(split_heads(q_proj(x), head_dim), cos, sin);
        Variable k = rotary_embedding(split_heads(k_proj(x), head_dim), cos, sin);
        Variable v = split_heads(v_proj(x), head_dim);
        bool causal = true;
        if (cache != nullptr) {
          // Generation only: a recomputed forward (activation checkpointing) would append twice.
          SHARDLAB_CHECK(!is_grad_enabled(),
                         "LlamaAttention: a KvCache is for generation; run it under NoGradGuard");
          // A cached step's one query attends to every cached key: no causal mask needed. A prompt
          // is the cache's first entry, where the queries and keys are the same positions.
          SHARDLAB_CHECK(cache->length == 0 || length == 1,
                         "LlamaAttention: with {} cached positions, feed one token at a time (got {})",
                         cache->length, length);
          causal = cache->length == 0;
          k = append_to_cache(cache->keys.at(static_cast<std::size_t>(layer)), k, cache->length);
          v = append_to_cache(cache->values.at(static_cast<std::size_t>(layer)), v, cache->length);
        }
        const Variable attended = scaled_dot_product_attention(
            q, k, v, {.causal = causal, .padding = padding, .documents = documents});
        return o_proj(reshape(contiguous(transpose(attended, 1, 2)), {batch, length, -1}));
      },
      input, cos_rows, sin_rows, padding_mask, document_ids);
}

LlamaMlpImpl::LlamaMlpImpl(const LlamaConfig& config)
    : nn::Module("LlamaMLP"),
      gate_proj(nn::LinearOptions(config.hidden_size, config.intermediate_size).bias(false)),
      up_proj(nn::LinearOptions(config.hidden_size, config.intermediate_size).bias(false)),
      down_proj(nn::LinearOptions(config.intermediate_size, config.hidden_size).bias(false)) {
  register_module("gate_proj", gate_proj.ptr());
  register_module("up_proj", up_proj.ptr());
  register_module("down_proj", down_proj.ptr());
}

Variable LlamaMlpImpl::operator()(const Variable& input) {
  return with_hooks([this](const Variable& x) { return down_proj(swiglu(gate_proj(x), up_proj(x))); }, input);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config)
    : nn::Module("LlamaDecoderLayer"),
      self_attn(config),
      mlp(config),
      input_layernorm(config.hidden_size, config.rms_norm_eps),
      post_attention_layernorm(config.hidden_size, config.rms_norm_eps) {
  register_module("self_attn", self_attn.ptr());
  register_module("mlp", mlp.ptr());
  register_module("input_layernorm", input_layernorm.ptr());
  register_module("post_attention_layernorm", post_attention_layernorm.ptr());
}

Variable LlamaDecoderLayerImpl::operator()(const Variable& input, const Tensor& cos_rows,
                                           const Tensor& sin_rows, const Tensor& padding_mask,
                                           const Tensor& document_ids, KvCache* cache, std::int64_t layer) {
  // Captures by value: under activation checkpointing the forward runs again in backward.
  return with_hooks(
      [this, cache, layer](const Variable& x, const Tensor& cos, const Tensor& sin, const Tensor& padding,
                           const Tensor& documents) {
        // The add before the second norm is fused into it; the one after the MLP is the layer's
        // output (hooks and checkpoints take the layer whole).
        const auto [h, normed] = post_attention_layernorm->add_then_norm(
            x, self_attn(input_layernorm(x), cos, sin, padding, documents, cache, layer));
        return add(h, mlp(normed));
      },
      input, cos_rows, sin_rows, padding_mask, document_ids);
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config)
    : nn::Module("LlamaModel"),
      embed_tokens(config.vocab_size, config.hidden_size),
      norm(config.hidden_size, config.rms_norm_eps),
      rotary_emb(config) {
  register_module("embed_tokens", embed_tokens.ptr());
  register_module("layers", layers.ptr());
  for (std::int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers->push_back(std::make_shared<LlamaDecoderLayerImpl>(config));
  }
  register_module("norm", norm.ptr());
  register_module("rotary_emb", rotary_emb.ptr());
}

namespace {

LlamaConfig validated(const LlamaConfig& config) {
  config.validate();
  return config;
}

// Hugging Face's _init_weights with initializer_range 0.02: every projection and the embedding
// N(0, 0.02); the norms keep their ones. (A walk over children: named_modules() needs the
// shared_ptr a constructor does not have yet.)
void use_llama_init(nn::Module& module) {
  if (dynamic_cast<nn::RMSNormImpl*>(&module) == nullptr) {
    for (const auto& [name, variable] : module.named_parameters(false)) {
      module.set_init(name, nn::Init::normal(0.0, 0.02));
    }
  }
  for (const auto& [name, child] : module.named_children()) use_llama_init(*child);
}

}  // namespace

LlamaImpl::LlamaImpl(const LlamaConfig& llama_config, std::uint64_t seed)
    : nn::Module("LlamaForCausalLM"), config(validated(llama_config)), model(config) {
  register_module("model", model.ptr());
  if (!config.tie_word_embeddings) {
    lm_head.emplace(nn::LinearOptions(config.hidden_size, config.vocab_size).bias(false));
    register_module("lm_head", lm_head->ptr());
  }
  use_llama_init(*this);
  nn::initialize(*this, seed);
}

namespace {

// A cache made for another batch, model depth, dtype or device would fail deep inside attention
// (or write past a layer's entries); name the mismatch at the model's door instead.
void check_cache_fits(const KvCache& cache, const Tensor& hidden, std::size_t layers) {
  SHARDLAB_CHECK(cache.keys.size() == layers && cache.values.size() == layers,
                 "Llama: the KvCache has {} layers, the model {}", cache.keys.size(), layers);
  const Tensor& entry = cache.keys.front();
  SHARDLAB_CHECK(entry.size(0) == hidden.size(0), "Llama: the KvCache holds a batch of {}, the tokens are {}",
                 entry.size(0), hidden.size(0));
  SHARDLAB_CHECK(entry.dtype() == hidden.dtype() && entry.device() == hidden.device(),
                 "Llama: the KvCache is {} on {}, the model computes in {} on {}", dtype_name(entry.dtype()),
                 entry.device().str(), dtype_name(hidden.dtype()), hidden.device().str());
}

}  // namespace

Variable LlamaImpl::operator()(const Tensor& input_tokens, const Tensor& padding_mask,
                               const Tensor& document_ids, KvCache* cache) {
  return with_hooks(
      [this, cache](const Tensor& tokens, const Tensor& padding, const Tensor& documents) {
        SHARDLAB_CHECK(tokens.dim() == 2, "Llama: expected tokens [B, T], got {}", shape_str(tokens.shape()));
        SHARDLAB_CHECK(
            !padding.defined() || (padding.shape() == tokens.shape() && padding.dtype() == DType::boolean),
            "Llama: padding must be bool {} like the tokens, got {} {}", shape_str(tokens.shape()),
            dtype_name(padding.dtype()), shape_str(padding.shape()));
        SHARDLAB_CHECK(
            !documents.defined() || (documents.shape() == tokens.shape() && documents.dtype() == DType::i64),
            "Llama: documents must be i64 {} like the tokens, got {} {}", shape_str(tokens.shape()),
            dtype_name(documents.dtype()), shape_str(documents.shape()));
        SHARDLAB_CHECK(cache == nullptr || !documents.defined(),
                       "Llama: documents are for packed sequences; a KvCache generates one sequence a row");
        const std::int64_t offset = cache != nullptr ? cache->length : 0;
        Variable h = model->embed_tokens(tokens);
        if (cache != nullptr) check_cache_fits(*cache, h.data(), model->layers->size());
        const auto [cos, sin] = model->rotary_emb->rows(offset, tokens.size(1), h.dtype());
        for (std::size_t i = 0; i < model->layers->size(); ++i) {
          h = (*model->layers)[i](h, cos, sin, padding, documents, cache, static_cast<std::int64_t>(i));
        }
        h = model->norm(h);
        if (cache != nullptr) cache->length += tokens.size(1);
        if (lm_head) return (*lm_head)(h);
        return matmul(h, transpose(model->embed_tokens->weight, 0, 1));
      },
      input_tokens, padding_mask, document_ids);
}

// --- Hugging Face directories --------------------------------------------------------------------

namespace {

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    SHARDLAB_CHECK(out.good(), "cannot write '{}'", temporary.string());
    out << text;
    out.flush();
    SHARDLAB_CHECK(out.good(), "writing '{}' failed", temporary.string());
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  SHARDLAB_CHECK(!error, "cannot rename '{}' to '{}': {}", temporary.string(), path.string(),
                 error.message());
}

nlohmann::json read_json(const fs::path& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  SHARDLAB_CHECK(in.good(), "cannot read the {} '{}'", what, path.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("'{}' is not valid JSON: {}", path.string(), e.what());
  }
}

// Derived tables older Hugging Face checkpoints saved; they are recomputed, never loaded.
bool derived_buffer(const std::string& name) { return name.ends_with("rotary_emb.inv_freq"); }

// The weight files of `dir`: model.safetensors, or those model.safetensors.index.json names.
std::vector<fs::path> weight_files(const fs::path& dir) {
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(single)) return {single};
  SHARDLAB_CHECK(fs::exists(index), "'{}' holds neither model.safetensors nor model.safetensors.index.json",
                 dir.string());
  const nlohmann::json map = read_json(index, "weight index");
  SHARDLAB_CHECK(map.contains("weight_map") && map["weight_map"].is_object(), "'{}': no weight_map object",
                 index.string());
  std::set<std::string> names;
  for (const auto& [tensor, file] : map["weight_map"].items()) {
    SHARDLAB_CHECK(file.is_string(), "'{}': weight_map entry '{}' is not a file name", index.string(),
                   tensor);
    names.insert(file.get<std::string>());
  }
  std::vector<fs::path> files;
  for (const std::string& name : names) files.push_back(dir / name);
  return files;
}

// Where each expected parameter's values are: its file and entry, from the files' headers alone
// (no tensor read), checked strictly against `expected`: missing, unexpected, misshapen and
// non-floating tensors are errors naming them and the file.
struct WeightSource {
  std::string name, file;
  nn::SafetensorsTensor tensor;
};
std::vector<WeightSource> weight_sources(const std::string& dir, const nn::Named<Shape>& expected) {
  std::map<std::string, std::pair<nn::SafetensorsTensor, std::string>> found;  // name -> (entry, file)
  for (const fs::path& path : weight_files(fs::path(dir))) {
    for (nn::SafetensorsTensor& tensor : nn::read_safetensors_header(path.string())) {
      if (derived_buffer(tensor.name)) continue;
      const std::string name = tensor.name;
      SHARDLAB_CHECK(found.emplace(name, std::pair{std::move(tensor), path.string()}).second,
                     "'{}': tensor '{}' appears in two files", dir, name);
    }
  }
  std::vector<WeightSource> sources;
  for (const auto& [name, shape] : expected) {
    const auto it = found.find(name);
    SHARDLAB_CHECK(it != found.end(), "'{}': missing tensor '{}' (expected shape {})", dir, name,
                   shape_str(shape));
    const auto& [tensor, file] = it->second;
    SHARDLAB_CHECK(tensor.shape == shape, "'{}': tensor '{}' has shape {}, the model expects {}", file, name,
                   shape_str(tensor.shape), shape_str(shape));
    SHARDLAB_CHECK(is_floating(tensor.dtype), "'{}': tensor '{}' is {}, expected a floating dtype", file,
                   name, dtype_name(tensor.dtype));
    sources.push_back({name, file, tensor});
    found.erase(it);
  }
  SHARDLAB_CHECK(found.empty(), "'{}': unexpected tensor '{}' (shape {}) in '{}'", dir,
                 found.empty() ? "" : found.begin()->first,
                 found.empty() ? "" : shape_str(found.begin()->second.first.shape),
                 found.empty() ? "" : found.begin()->second.second);
  return sources;
}

}  // namespace

std::string pretrained_weights_path(const std::string& dir) {
  return (fs::path(dir) / "model.safetensors").string();
}

void save_pretrained_config(const std::string& dir, const LlamaConfig& config, DType weights_dtype) {
  SHARDLAB_CHECK(weights_dtype == DType::f32 || weights_dtype == DType::bf16 || weights_dtype == DType::f16,
                 "save_pretrained: weights in {}: f32, bf16 or f16", dtype_name(weights_dtype));
  std::error_code error;
  fs::create_directories(dir, error);
  SHARDLAB_CHECK(!error, "save_pretrained: cannot create the directory '{}': {}", dir, error.message());
  nlohmann::json json = config.to_json();
  json["torch_dtype"] = weights_dtype == DType::bf16  ? "bfloat16"
                        : weights_dtype == DType::f16 ? "float16"
                                                      : "float32";
  write_text_atomically(fs::path(dir) / "config.json", json.dump(2) + "\n");
}

void save_pretrained(const std::string& dir, const LlamaConfig& config, const nn::StateDict& state) {
  save_pretrained_config(dir, config);
  nn::save_safetensors(pretrained_weights_path(dir), state, {{"format", "pt"}});
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  return from_json(read_json(path, "config file"), path);
}

LlamaConfig load_pretrained_config(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  SHARDLAB_CHECK(fs::exists(path), "'{}' has no config.json", dir);
  return LlamaConfig::from_file(path.string());
}

nn::StateDict load_pretrained_weights(const std::string& dir, const nn::Named<Shape>& expected) {
  nn::StateDict out;
  for (const WeightSource& source : weight_sources(dir, expected)) {
    const Tensor values = empty(source.tensor.shape);  // f32
    nn::read_safetensors_elements(source.file, source.tensor, 0, values);
    out.emplace_back(source.name, values);
  }
  return out;
}

void defer_to_pretrained(Llama& model, const std::string& dir) {
  nn::Named<Shape> expected;
  for (const auto& [name, parameter] : model->named_parameters()) {
    SHARDLAB_CHECK(nn::deferred(parameter.data()),
                   "defer_to_pretrained: parameter '{}' already holds values (make the model under "
                   "nn::DeferredInitGuard, or load them with load_pretrained_weights)",
                   name);
    expected.emplace_back(name, parameter.shape());
  }
  for (const WeightSource& source : weight_sources(dir, expected))
    model->set_init(source.name, nn::Init::from_file(source.file, source.tensor));
}

}  // namespace shardlab::models
