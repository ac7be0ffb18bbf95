// tests/models/test_llama.cpp: the Llama against Hugging Face transformers' LlamaForCausalLM (golden
// logits, loss and gradients of the tiny config from tests/tools/make_llama_golden.py), its Hugging
// Face names and sizes, gradchecks of its pieces in f64, the KV cache, padding, packed documents (against
// Hugging Face's under a block-causal 4-D mask too), and the directory format's errors.
#include <filesystem>
#include <fstream>
#include <map>
#include <numbers>

#include "autograd/functional.h"
#include "autograd/gradcheck.h"
#include "models/generate.h"
#include "models/llama.h"
#include "nn/safetensors.h"
#include "tests/check.h"
#include "tests/temp_dir.h"

#ifndef SHARDLAB_MODELS_GOLDEN_DIR
#error "tests/meson.build defines SHARDLAB_MODELS_GOLDEN_DIR, the directory of the committed golden files"
#endif

using namespace shardlab;

namespace {

const std::string kGoldenDir = SHARDLAB_MODELS_GOLDEN_DIR;
constexpr std::int64_t kPad = 258;  // data::ByteTokenizer's [PAD]

nn::Named<Shape> parameter_shapes(nn::Module& model) {
  nn::Named<Shape> shapes;
  for (const auto& [name, p] : model.named_parameters()) shapes.emplace_back(name, p.shape());
  return shapes;
}

models::Llama load_tiny_golden_model() {
  const models::LlamaConfig config = models::load_pretrained_config(kGoldenDir + "/llama_tiny");
  models::Llama model(config);
  model->load_state_dict(
      models::load_pretrained_weights(kGoldenDir + "/llama_tiny", parameter_shapes(*model)));
  return model;
}

std::map<std::string, Tensor> golden_tensors() {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : nn::load_safetensors(kGoldenDir + "/llama_tiny_golden.safetensors").tensors) {
    out[name] = t;
  }
  return out;
}

Variable language_model_loss(const Variable& logits, const Tensor& targets) {
  const std::int64_t vocab = logits.size(-1);
  return cross_entropy(reshape(logits, {-1, vocab}), targets.reshape({-1}), kPad);
}

// |actual - expected| <= 1e-5 |expected| + 1e-5 max|expected|: relative in f32, with an
// absolute floor at the tensor's scale for elements that cancel to near zero.
void check_golden(const std::string& what, const Tensor& actual, const Tensor& expected) {
  INFO(what);
  REQUIRE(actual.shape() == expected.shape());
  const double scale = max(abs(expected)).item<double>();
  test::check_close(actual, expected, {1e-5 * scale, 1e-5});
}

void check_gradients(const std::string& what, const GradcheckFn& fn, const std::vector<Variable>& inputs) {
  const GradcheckResult result = gradcheck(fn, inputs);
  INFO(what << ": " << result.report);
  CHECK(result.ok);
}

Variable leaf(const Shape& shape, std::uint64_t seed) {
  return Variable(test::random_tensor(shape, seed, DType::f64), true);
}

}  // namespace

TEST_CASE("the tiny Llama's logits, loss and every gradient equal Hugging Face transformers'",
          "[models][llama][golden]") {
  const std::map<std::string, Tensor> golden = golden_tensors();
  const Tensor tokens = golden.at("tokens"), targets = golden.at("targets");
  const Tensor padding = eq(tokens, kPad);
  test::check_equal(padding.to(DType::u8), test::values(golden.at("padding").to(DType::u8)));

  // Twice: the second run must be bit-identical to the first.
  std::vector<std::vector<float>> runs;
  for (int run = 0; run < 2; ++run) {
    models::Llama model = load_tiny_golden_model();
    const Variable logits = model(tokens, padding);
    const Variable loss = language_model_loss(logits, targets);
    loss.backward();
    // Hugging Face's padding queries attend to the row's tokens, ours to nothing: their logits
    // differ by design and are left out (no loss term reads them); every other one is compared.
    const Tensor is_token = ne(tokens, kPad).unsqueeze(-1);
    check_golden("logits where the query is a token", where(is_token, logits.data(), 0.0),
                 where(is_token, golden.at("logits"), 0.0));
    check_golden("loss", loss.data(), golden.at("loss"));
    std::vector<float> all = logits.data().to_vector<float>();
    for (const auto& [name, p] : model->named_parameters()) {
      REQUIRE(golden.contains("grad." + name));
      check_golden("gradient of " + name, p.grad(), golden.at("grad." + name));
      const std::vector<float> g = p.grad().to_vector<float>();
      all.insert(all.end(), g.begin(), g.end());
    }
    runs.push_back(all);
  }
  CHECK(runs[0] == runs[1]);
}

TEST_CASE(
    "packed documents under the block-causal mask: logits, loss and every gradient equal Hugging Face's",
    "[models][llama][golden]") {
  std::map<std::string, Tensor> golden;
  for (auto& [name, t] : nn::load_safetensors(kGoldenDir + "/llama_tiny_packed_golden.safetensors").tensors) {
    golden[name] = t;
  }
  const Tensor tokens = golden.at("tokens"), documents = golden.at("documents");
  // The golden rows' documents are those the packed dataset gives their ids: up by one at each [BOT]
  // after a row's first position.
  const std::vector<std::int64_t> ids = tokens.to_vector<std::int64_t>();
  const auto length = static_cast<std::size_t>(tokens.size(1));
  std::vector<double> expected(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const bool starts = i % length > 0 && ids[i] == 256;
    expected[i] = i % length == 0 ? 0 : expected[i - 1] + (starts ? 1 : 0);
  }
  test::check_equal(documents, expected);
  models::Llama model = load_tiny_golden_model();
  const Variable logits = model(tokens, Tensor(), documents);
  const Variable loss = language_model_loss(logits, golden.at("targets"));
  loss.backward();
  check_golden("logits", logits.data(), golden.at("logits"));
  check_golden("loss", loss.data(), golden.at("loss"));
  for (const auto& [name, p] : model->named_parameters()) {
    REQUIRE(golden.contains("grad." + name));
    check_golden("gradient of " + name, p.grad(), golden.at("grad." + name));
  }
}

TEST_CASE("the Llama has Hugging Face's parameter names and shapes; buffers stay out of the state dict",
          "[models][llama]") {
  const models::LlamaConfig config = models::LlamaConfig::preset("tiny");
  models::Llama model(config);
  std::vector<std::string> expected;
  expected.push_back("model.embed_tokens.weight");
  for (int i = 0; i < 2; ++i) {
    const std::string layer = "model.layers." + std::to_string(i) + ".";
    for (const char* name :
         {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight"}) {
      expected.push_back(layer + name);
    }
  }
  expected.push_back("model.norm.weight");
  expected.push_back("lm_head.weight");
  std::vector<std::string> names;
  for (const auto& [name, tensor] : model->state_dict()) names.push_back(name);
  CHECK(names == expected);
  CHECK(model->named_buffers().size() == 2);  // the rotary tables, not persistent
  CHECK((*model->model->layers)[0].self_attn->k_proj->weight.shape() == Shape{20, 40});  // 2 KV heads of 10
  CHECK(model->parameter_count() == config.parameter_count());
  CHECK(model->parameter_count() == 259 * 40 * 2 + 2 * 16400 + 40);

  models::LlamaConfig tied = config;
  tied.tie_word_embeddings = true;
  models::Llama tied_model(tied);
  CHECK(tied_model->named_parameters().back().first == "model.norm.weight");
  CHECK(tied_model->parameter_count() == 259 * 40 + 2 * 16400 + 40);
}

TEST_CASE("the presets have the documented sizes (TinyLlama's 1,100,048,384 for 1b)", "[models][llama]") {
  CHECK(models::LlamaConfig::preset("1b").parameter_count() == 1100048384);
  const models::LlamaConfig small = models::LlamaConfig::preset("small");
  CHECK(small.vocab_size == 50000);
  CHECK(small.num_key_value_heads == 3);
  CHECK_THROWS_ERROR(models::LlamaConfig::preset("seed"), "no preset named 'seed' (tiny, small, 1b)");
  // The small model built with shapes only: its parameters add up to the formula's count.
  const nn::DeferredInitGuard deferred;
  models::Llama shapes_only(small);
  CHECK(shapes_only->parameter_count() == small.parameter_count());
  CHECK_THROWS_ERROR(models::LlamaConfig::preset("7b"), "no preset named '7b' (tiny, small, 1b)");
}

TEST_CASE("inconsistent configs are refused with the fields named", "[models][llama]") {
  models::LlamaConfig c = models::LlamaConfig::preset("tiny");
  c.hidden_size = 42;
  CHECK_THROWS_ERROR(c.validate(), "hidden_size 42 is not divisible by num_attention_heads 4");
  c = models::LlamaConfig::preset("tiny");
  c.num_key_value_heads = 3;
  CHECK_THROWS_ERROR(c.validate(), "num_attention_heads 4 is not divisible by num_key_value_heads 3");
  c = models::LlamaConfig::preset("tiny");
  c.hidden_size = 36;  // head dim 9
  CHECK_THROWS_ERROR(c.validate(), "= 9 must be even");
  c = models::LlamaConfig::preset("tiny");
  c.num_hidden_layers = 0;
  CHECK_THROWS_ERROR(models::Llama(c), "num_hidden_layers must be at least 1, got 0");
}

TEST_CASE("config.json: Hugging Face's fields round trip; other architectures and bad fields are refused",
          "[models][llama]") {
  const models::LlamaConfig tiny = models::LlamaConfig::preset("tiny");
  const models::LlamaConfig back = models::LlamaConfig::from_json(tiny.to_json(), "config.json");
  CHECK(back.to_json() == tiny.to_json());

  nlohmann::json minimal = {{"vocab_size", 100},
                            {"hidden_size", 32},
                            {"intermediate_size", 64},
                            {"num_hidden_layers", 1},
                            {"num_attention_heads", 4}};
  const models::LlamaConfig defaults = models::LlamaConfig::from_json(minimal, "c.json");
  CHECK(defaults.num_key_value_heads == 4);  // HF: MHA when absent
  CHECK(defaults.rms_norm_eps == 1e-6);
  CHECK(defaults.max_position_embeddings == 2048);

  nlohmann::json j = minimal;
  j.erase("hidden_size");
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "c.json: required field 'hidden_size' is missing");
  j = minimal;
  j["hidden_size"] = "32";
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "c.json: field 'hidden_size' has the wrong type");
  j = minimal;
  j["model_type"] = "mistral";
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "model_type is 'mistral', expected 'llama'");
  j = minimal;
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  CHECK_THROWS_ERROR(
      models::LlamaConfig::from_json(j, "c.json"),
      "c.json: rope_scaling: rope kind 'linear' is not supported (llama3, or default for none)");
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "rope kind 'yarn' is not supported");
  j["rope_scaling"] = {
      {"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}};
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "c.json: rope_scaling: required field 'original_max_position_embeddings' is missing");
  j["rope_scaling"]["original_max_position_embeddings"] = 64;
  j["rope_scaling"]["high_freq_factor"] = 0.5;
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor");
  j["rope_scaling"] = 3;
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"), "c.json: rope_scaling 3 is not an object");
  j["rope_scaling"] = {{"rope_type", "default"}};  // transformers' plain embedding
  CHECK_FALSE(models::LlamaConfig::from_json(j, "c.json").rope_scaling.has_value());
  j = minimal;
  j["hidden_act"] = "gelu";
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"), "hidden_act 'gelu' is not supported");
  j = minimal;
  j["num_key_value_heads"] = 3;
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"),
                     "c.json: LlamaConfig: num_attention_heads 4 is not divisible by num_key_value_heads 3");
  j = minimal;
  j["head_dim"] = 16;
  CHECK_THROWS_ERROR(models::LlamaConfig::from_json(j, "c.json"), "head_dim 16 differs");
}

TEST_CASE("Llama 3's rope_scaling: read from config.json, written back, and the rotary tables it gives",
          "[models][llama]") {
  // Llama-3.2-1B's rope_scaling with a short original context, so that every branch is taken at head dim 16.
  const nlohmann::json scaling = {{"rope_type", "llama3"},
                                  {"factor", 8.0},
                                  {"low_freq_factor", 1.0},
                                  {"high_freq_factor", 4.0},
                                  {"original_max_position_embeddings", 64}};
  nlohmann::json json = {{"vocab_size", 100},        {"hidden_size", 64},
                         {"intermediate_size", 96},  {"num_hidden_layers", 1},
                         {"num_attention_heads", 4}, {"max_position_embeddings", 256},
                         {"rope_theta", 500000.0},   {"rope_scaling", scaling}};
  const models::LlamaConfig config = models::LlamaConfig::from_json(json, "config.json");
  REQUIRE(config.rope_scaling.has_value());
  CHECK(config.rope_scaling->original_max_position_embeddings == 64);
  CHECK(config.to_json()["rope_scaling"] == scaling);
  CHECK(models::LlamaConfig::from_json(config.to_json(), "again").to_json() == config.to_json());
  // transformers 5 writes rope_parameters instead, with rope_theta inside.
  nlohmann::json v5 = json;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = scaling;
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  CHECK(models::LlamaConfig::from_json(v5, "v5.json").to_json() == config.to_json());
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 250000.0}};
  const models::LlamaConfig plain = models::LlamaConfig::from_json(v5, "v5.json");
  CHECK(plain.rope_theta == 250000.0);
  CHECK_FALSE(plain.rope_scaling.has_value());
  // transformers' _compute_llama3_parameters, step by step: wavelengths under 64 / 4 = 16 positions
  // kept, over 64 / 1 divided by 8, the rest blended by where 64 / wavelength lies between 1 and 4.
  int kept = 0, divided = 0, blended = 0;
  for (std::int64_t i = 0; i < 8; ++i) {
    const double plain = std::pow(500000.0, -static_cast<double>(2 * i) / 16),
                 wavelength = 2 * std::numbers::pi / plain;
    double expected = plain;
    if (wavelength > 64) {
      expected = plain / 8, ++divided;
    } else if (wavelength >= 16) {
      const double smooth = (64 / wavelength - 1) / 3;
      expected = (1 - smooth) * plain / 8 + smooth * plain, ++blended;
    } else {
      ++kept;
    }
    INFO("pair " << i);
    CHECK(std::abs(config.inverse_frequency(i) - expected) <= 1e-15 * expected);
  }
  CHECK(kept > 0);
  CHECK(divided > 0);
  CHECK(blended > 0);
  // The rotary tables: cos and sin of position t times each pair's frequency, in both halves.
  models::LlamaRotaryEmbedding rotary(config);
  std::vector<float> cos;
  for (const auto& [name, buffer] : rotary->named_buffers())
    if (name == "cos") cos = buffer.to_vector<float>();
  REQUIRE(cos.size() == 256 * 16);
  for (const std::int64_t t : {0, 1, 37, 255}) {
    for (std::int64_t i = 0; i < 8; ++i) {
      const float expected =
          static_cast<float>(std::cos(static_cast<double>(t) * config.inverse_frequency(i)));
      CHECK(cos[static_cast<std::size_t>(t * 16 + i)] == expected);
      CHECK(cos[static_cast<std::size_t>(t * 16 + i + 8)] == expected);
    }
  }
}

TEST_CASE("initialisation: projections and embedding N(0, 0.02), norms 1, by seed", "[models][llama]") {
  models::Llama a(models::LlamaConfig::preset("tiny"), 7), b(models::LlamaConfig::preset("tiny"), 7),
      c(models::LlamaConfig::preset("tiny"), 8);
  const Tensor w = (*a->model->layers)[1].mlp->up_proj->weight.data();
  const double mean_value = mean(w).item<double>();
  const double std_value = std::sqrt(mean(mul(w, w)).item<double>() - mean_value * mean_value);
  CHECK(std::abs(mean_value) < 0.002);
  CHECK(std::abs(std_value - 0.02) < 0.001);
  test::check_equal(a->model->norm->weight.data(), std::vector<double>(40, 1.0));
  CHECK((*a->lm_head)->weight.data().to_vector<float>() == (*b->lm_head)->weight.data().to_vector<float>());
  CHECK((*a->lm_head)->weight.data().to_vector<float>() != (*c->lm_head)->weight.data().to_vector<float>());
}

TEST_CASE("rotary embedding: gradients (f64) and a closed form", "[models][llama][gradcheck]") {
  // Tables of arbitrary angles: the gradient does not care that they come from positions.
  std::vector<double> cos_values, sin_values;
  for (const double angle : test::values(test::random_tensor({5, 3}, 3, DType::f64, -3.0, 3.0))) {
    cos_values.push_back(std::cos(angle));
    sin_values.push_back(std::sin(angle));
  }
  // The rotate-half layout: pair i's angle at columns i and i + 3.
  const Tensor cos_half = from_vector(cos_values, {5, 3}), sin_half = from_vector(sin_values, {5, 3});
  const Tensor cos_table = cat({cos_half, cos_half}, 1), sin_table = cat({sin_half, sin_half}, 1);
  check_gradients(
      "rotary_embedding",
      [&](const std::vector<Variable>& x) { return rotary_embedding(x[0], cos_table, sin_table); },
      {leaf({2, 3, 5, 6}, 4)});
  // One pair (x0, x1) rotated by a: (x0 cos a - x1 sin a, x1 cos a + x0 sin a).
  const double a = 0.7;
  const Tensor x = from_vector(std::vector<double>{2.0, -1.0}, {1, 2});
  const Tensor c = full({1, 2}, std::cos(a), dtype(DType::f64)),
               s = full({1, 2}, std::sin(a), dtype(DType::f64));
  test::check_close(rotary_embedding(constant(x), c, s).data(),
                    {2 * std::cos(a) + std::sin(a), -std::cos(a) + 2 * std::sin(a)});
  CHECK_THROWS_ERROR(rotary_embedding(constant(zeros({2, 5})), zeros({2, 5}), zeros({2, 5})), "must be even");
  CHECK_THROWS_ERROR(rotary_embedding(constant(zeros({3, 4})), zeros({2, 4}), zeros({3, 4})),
                     "cos must be [3, 4] for x [3, 4], got [2, 4]");
  CHECK_THROWS_ERROR(
      rotary_embedding(constant(zeros({3, 4})), zeros({3, 4}, dtype(DType::f64)), zeros({3, 4})),
      "rotary_embedding: cos is f64 but x is f32");
}

TEST_CASE("SwiGLU MLP and a whole decoder layer (GQA, padding) have the gradients of finite differences",
          "[models][llama][gradcheck]") {
  models::LlamaConfig config{.vocab_size = 11,
                             .hidden_size = 8,
                             .intermediate_size = 6,
                             .num_hidden_layers = 1,
                             .num_attention_heads = 4,
                             .num_key_value_heads = 2,
                             .max_position_embeddings = 16};
  models::Llama model(config, 3);
  model->to(DType::f64);
  for (auto& [name, p] : model->named_parameters())
    p.set_data(mul(p.data(), 10.0));  // beyond the linear regime
  models::LlamaDecoderLayerImpl& layer = (*model->model->layers)[0];
  // Named tensors, not a structured binding: lambdas below capture them (clang before 16 cannot).
  const std::pair<Tensor, Tensor> rotary = model->model->rotary_emb->rows(0, 5, DType::f64);
  const Tensor& cos = rotary.first;
  const Tensor& sin = rotary.second;
  // Row 1 ends in two padding tokens.
  const Tensor padding = from_vector(
      std::vector<bool>{false, false, false, false, false, false, false, false, true, true}, {2, 5});
  check_gradients("mlp", [&](const std::vector<Variable>& x) { return (*layer.mlp)(x[0]); },
                  {leaf({2, 5, 8}, 5)});
  check_gradients("decoder layer",
                  [&](const std::vector<Variable>& x) { return layer(x[0], cos, sin, padding); },
                  {leaf({2, 5, 8}, 6)});
  // And with respect to every weight of the layer.
  std::vector<Variable> weights;
  for (const auto& [name, p] : layer.named_parameters()) weights.push_back(p);
  const Tensor input = test::random_tensor({2, 5, 8}, 7, DType::f64);
  check_gradients(
      "decoder layer weights",
      [&](const std::vector<Variable>&) { return layer(constant(input), cos, sin, padding); }, weights);
}

TEST_CASE("padding does not change the logits of real tokens; padding queries give finite logits",
          "[models][llama]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), 2);
  model->eval();
  const NoGradGuard no_grad;
  const Tensor short_row = from_vector(std::vector<std::int64_t>{256, 72, 105, 33}, {1, 4});
  const Tensor padded = from_vector(std::vector<std::int64_t>{256, 72, 105, 33, 258, 258, 258}, {1, 7});
  const Tensor alone = model(short_row).data();
  const Tensor with_padding = model(padded, eq(padded, kPad)).data();
  test::check_close(with_padding.narrow(1, 0, 4).contiguous(), alone);
  CHECK(sum(isfinite(with_padding).to(DType::i64)).item<std::int64_t>() == with_padding.numel());
}

TEST_CASE("documents packed into a row give the logits each gives alone; without documents they mix",
          "[models][llama]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), 2);
  model->eval();
  const NoGradGuard no_grad;
  const std::vector<std::int64_t> first{256, 72, 105, 33}, second{256, 87, 111, 114, 108, 100, 257};
  std::vector<std::int64_t> ids = first;
  ids.insert(ids.end(), second.begin(), second.end());
  const Tensor packed = from_vector(ids, {1, 11});
  const Tensor documents = from_vector(std::vector<std::int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, {1, 11});
  const Tensor logits = model(packed, Tensor(), documents).data();
  // The second document's rotary positions are 4..10 in the row, 0..6 alone: the scores depend on
  // differences of positions only, so they agree to the f32 rounding of the tables.
  test::check_close(logits.narrow(1, 0, 4).contiguous(), model(from_vector(first, {1, 4})).data());
  const Tensor alone = model(from_vector(second, {1, 7})).data();
  test::check_close(logits.narrow(1, 4, 7).contiguous(), alone, {1e-5, 1e-4});
  const Tensor mixed = model(packed).data().narrow(1, 4, 7).contiguous();
  CHECK(max(abs(sub(mixed, alone))).item<double>() > 1e-2);
}

TEST_CASE("the KV cache gives the logits of the full forward, one token at a time", "[models][llama]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), 4);
  model->eval();
  const NoGradGuard no_grad;
  const Tensor tokens = from_vector(std::vector<std::int64_t>{256, 10, 200, 3, 99, 7, 250}, {1, 7});
  const Tensor full_logits = model(tokens).data();
  models::KvCache cache(model->config, 1, 7, {});
  const Tensor prompt_logits = model(tokens.narrow(1, 0, 3), Tensor(), Tensor(), &cache).data();
  test::check_close(prompt_logits, full_logits.narrow(1, 0, 3).contiguous());
  for (std::int64_t t = 3; t < 7; ++t) {
    const Tensor step = model(tokens.narrow(1, t, 1), Tensor(), Tensor(), &cache).data();
    INFO("position " << t);
    test::check_close(step, full_logits.narrow(1, t, 1).contiguous());
  }
  CHECK(cache.length == 7);
  CHECK_THROWS_ERROR(model(tokens.narrow(1, 0, 1), Tensor(), Tensor(), &cache), "exceed its capacity 7");
  models::KvCache other(model->config, 1, 7, {});
  model(tokens.narrow(1, 0, 2), Tensor(), Tensor(), &other);
  CHECK_THROWS_ERROR(model(tokens.narrow(1, 2, 2), Tensor(), Tensor(), &other),
                     "with 2 cached positions, feed one token at a time");
  CHECK_THROWS_ERROR(models::KvCache(model->config, 1, 513, {}),
                     "capacity 513 must be in [1, max_position_embeddings = 512]");
  CHECK_THROWS_ERROR(models::KvCache(model->config, 0, 7, {}), "KvCache: batch 0 must be at least 1");
  models::KvCache for_two(model->config, 2, 7, {});
  CHECK_THROWS_ERROR(model(tokens.narrow(1, 0, 2), Tensor(), Tensor(), &for_two),
                     "Llama: the KvCache holds a batch of 2, the tokens are 1");
  models::KvCache in_f64(model->config, 1, 7, dtype(DType::f64));
  CHECK_THROWS_ERROR(model(tokens.narrow(1, 0, 2), Tensor(), Tensor(), &in_f64),
                     "Llama: the KvCache is f64 on cpu, the model computes in f32 on cpu");
  models::LlamaConfig deeper = model->config;
  deeper.num_hidden_layers = 3;
  models::KvCache too_deep(deeper, 1, 7, {});
  CHECK_THROWS_ERROR(model(tokens.narrow(1, 0, 2), Tensor(), Tensor(), &too_deep),
                     "Llama: the KvCache has 3 layers, the model 2");
  CHECK(for_two.length == 0);  // a refused step leaves the cache as it was
  const GradModeGuard grad(true);
  models::KvCache third(model->config, 1, 7, {});
  CHECK_THROWS_ERROR(model(tokens.narrow(1, 0, 2), Tensor(), Tensor(), &third),
                     "a KvCache is for generation; run it under NoGradGuard");
}

TEST_CASE("bad inputs name what is wrong", "[models][llama]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), 1);
  const NoGradGuard no_grad;
  CHECK_THROWS_ERROR(model(zeros({3}, dtype(DType::i64))), "Llama: expected tokens [B, T], got [3]");
  CHECK_THROWS_ERROR(model(zeros({1, 3}, dtype(DType::i64)), zeros({1, 4}, dtype(DType::boolean))),
                     "Llama: padding must be bool [1, 3] like the tokens");
  CHECK_THROWS_ERROR(model(zeros({1, 3}, dtype(DType::i64)), Tensor(), zeros({1, 3}, dtype(DType::i32))),
                     "Llama: documents must be i64 [1, 3] like the tokens, got i32 [1, 3]");
  models::KvCache cache(model->config, 1, 4, {});
  CHECK_THROWS_ERROR(
      model(zeros({1, 3}, dtype(DType::i64)), Tensor(), zeros({1, 3}, dtype(DType::i64)), &cache),
      "Llama: documents are for packed sequences; a KvCache generates one sequence a row");
  CHECK(cache.length == 0);
  CHECK_THROWS_ERROR(model(zeros({1, 513}, dtype(DType::i64))),
                     "positions [0, 513) exceed max_position_embeddings = 512");
}

TEST_CASE(
    "save_pretrained writes a directory load_pretrained reads; missing, unexpected and misshapen "
    "tensors are refused",
    "[models][llama]") {
  test::TempDir dir;
  const std::string path = dir.path() + "/tiny";
  models::Llama model(models::LlamaConfig::preset("tiny"), 5);
  models::save_pretrained(path, model->config, model->state_dict());
  CHECK(std::filesystem::exists(path + "/config.json"));
  // A directory that cannot be made (a file is in the way) is named, as a shardlab Error.
  const std::string blocked = path + "/config.json/inner";
  CHECK_THROWS_ERROR(
      models::save_pretrained(blocked, model->config, model->state_dict()),
      fmt::format("save_pretrained: cannot create the directory '{}': Not a directory", blocked));
  const models::LlamaConfig config = models::load_pretrained_config(path);
  models::Llama loaded(config, 6);
  loaded->load_state_dict(models::load_pretrained_weights(path, parameter_shapes(*loaded)));
  const nn::StateDict original = model->state_dict(), reloaded = loaded->state_dict();
  REQUIRE(original.size() == reloaded.size());
  for (std::size_t i = 0; i < original.size(); ++i) {
    INFO(original[i].first);
    CHECK(original[i].second.to_vector<float>() == reloaded[i].second.to_vector<float>());
  }

  // A HF checkpoint split over files with an index, in bf16, with an old derived buffer.
  const std::string split = dir.path() + "/split";
  std::filesystem::create_directories(split);
  nn::StateDict first, second;
  nlohmann::json map;
  int i = 0;
  for (const auto& [name, t] : model->state_dict()) {
    const std::string file =
        i++ % 2 == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    (file.starts_with("model-00001") ? first : second).emplace_back(name, t.to(DType::bf16));
    map["weight_map"][name] = file;
  }
  first.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", zeros({5}));
  map["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = "model-00001-of-00002.safetensors";
  nn::save_safetensors(split + "/model-00001-of-00002.safetensors", first);
  nn::save_safetensors(split + "/model-00002-of-00002.safetensors", second);
  std::ofstream(split + "/model.safetensors.index.json") << map.dump();
  const nn::StateDict from_split = models::load_pretrained_weights(split, parameter_shapes(*loaded));
  CHECK(from_split.size() == model->state_dict().size());
  test::check_close(from_split.back().second, (*model->lm_head)->weight.data().to(DType::bf16).to(DType::f32),
                    {0, 0});

  // The same directory for a model made with shapes only: each parameter's init reads its values, or
  // any range of them, from the files by offset: the bits load_pretrained_weights gives.
  models::Llama pointed = [&] {
    const nn::DeferredInitGuard deferred;
    return models::Llama(config, 7);
  }();
  models::defer_to_pretrained(pointed, split);
  const nn::Named<nn::Init> inits = pointed->named_inits();
  REQUIRE(inits.size() == from_split.size());
  for (std::size_t k = 0; k < inits.size(); ++k) {
    INFO(inits[k].first);
    CHECK(inits[k].first == from_split[k].first);
    const Tensor whole = empty(from_split[k].second.shape());
    inits[k].second.fill(whole, 0, inits[k].first);
    CHECK(test::values(whole) == test::values(from_split[k].second));
    const Tensor tail = empty({3});
    inits[k].second.fill(tail, 0, inits[k].first, whole.numel() - 3);
    CHECK(test::values(tail) == test::values(whole.flatten().narrow(0, whole.numel() - 3, 3)));
  }
  CHECK_THROWS_ERROR(models::defer_to_pretrained(loaded, split),
                     "defer_to_pretrained: parameter 'model.embed_tokens.weight' already holds values");

  nn::Named<Shape> shapes = parameter_shapes(*loaded);
  shapes.back().second = {259, 41};
  CHECK_THROWS_ERROR(models::load_pretrained_weights(path, shapes),
                     "tensor 'lm_head.weight' has shape [259, 40], the model expects [259, 41]");
  shapes = parameter_shapes(*loaded);
  shapes.emplace_back("extra.weight", Shape{2});
  CHECK_THROWS_ERROR(models::load_pretrained_weights(path, shapes), "missing tensor 'extra.weight'");
  shapes = parameter_shapes(*loaded);
  shapes.pop_back();
  CHECK_THROWS_ERROR(models::load_pretrained_weights(path, shapes), "unexpected tensor 'lm_head.weight'");
  CHECK_THROWS_ERROR(models::load_pretrained_weights(dir.path(), shapes),
                     "holds neither model.safetensors nor model.safetensors.index.json");
  CHECK_THROWS_ERROR(models::load_pretrained_config(dir.path()), "has no config.json");
  // An index without a weight_map object, one naming a non-file, and a non-floating tensor.
  const std::string bad_index = dir.path() + "/bad_index";
  std::filesystem::create_directories(bad_index);
  std::ofstream(bad_index + "/model.safetensors.index.json") << R"({"metadata": {}})";
  CHECK_THROWS_ERROR(models::load_pretrained_weights(bad_index, shapes), "no weight_map object");
  std::ofstream(bad_index + "/model.safetensors.index.json") << R"({"weight_map": {"lm_head.weight": 3}})";
  CHECK_THROWS_ERROR(models::load_pretrained_weights(bad_index, shapes),
                     "weight_map entry 'lm_head.weight' is not a file name");
  const std::string integer_weights = dir.path() + "/integer_weights";
  std::filesystem::create_directories(integer_weights);
  nn::StateDict integers;
  for (const auto& [name, shape] : parameter_shapes(*loaded))
    integers.emplace_back(name, zeros(shape, dtype(DType::i32)));
  nn::save_safetensors(integer_weights + "/model.safetensors", integers);
  CHECK_THROWS_ERROR(models::load_pretrained_weights(integer_weights, parameter_shapes(*loaded)),
                     "is i32, expected a floating dtype");
  std::ofstream(path + "/config.json") << "{\"vocab_size\": ";
  CHECK_THROWS_ERROR(models::load_pretrained_config(path), "config.json' is not valid JSON");
}

TEST_CASE("pick_token: argmax at temperature 0 and with top_k 1; draws split by the softmax",
          "[models][generate]") {
  const std::vector<float> logits{0.0f, static_cast<float>(std::log(3.0)), -5.0f};
  CHECK(models::pick_token(logits, 0.0, 0, 0.99) == 1);
  CHECK(models::pick_token(logits, 1.0, 1, 0.99) == 1);
  // Probabilities 3/4 for token 1 and 1/4 for token 0 among the top 2: the draw's cumulative split.
  CHECK(models::pick_token(logits, 1.0, 2, 0.70) == 1);
  CHECK(models::pick_token(logits, 1.0, 2, 0.80) == 0);
  CHECK(models::pick_token(logits, 1.0, 2, 0.9999) == 0);
  CHECK_THROWS_ERROR(models::pick_token(logits, -1.0, 0, 0.5), "temperature must be >= 0, got -1");
  CHECK_THROWS_ERROR(models::pick_token({}, 1.0, 0, 0.5), "pick_token: no logits");
  CHECK_THROWS_ERROR(models::pick_token(logits, 1.0, -1, 0.5), "pick_token: top_k must be >= 0, got -1");
}

TEST_CASE("greedy generation with the cache equals the argmax of full forwards; sampling is reproducible",
          "[models][generate]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), 9);
  std::vector<std::int64_t> tokens{256, 70, 111};
  const std::vector<std::int64_t> generated =
      models::generate(*model, tokens, {.max_new_tokens = 6, .temperature = 0});
  REQUIRE(generated.size() == 6);
  {
    const NoGradGuard no_grad;
    for (const std::int64_t token : generated) {
      const auto length = static_cast<std::int64_t>(tokens.size());
      const Tensor logits = model(from_vector(tokens, {1, length})).data().select(1, length - 1);
      CHECK(argmax(logits, {1}).item<std::int64_t>() == token);
      tokens.push_back(token);
    }
  }
  const models::SamplingOptions sampled{.max_new_tokens = 20, .temperature = 1.0, .top_k = 0, .seed = 3};
  CHECK(models::generate(*model, {256}, sampled) == models::generate(*model, {256}, sampled));
  CHECK(model->is_training());  // restored
  CHECK_THROWS_ERROR(models::generate(*model, {}, sampled), "generate: the prompt is empty");
  CHECK_THROWS_ERROR(models::generate(*model, std::vector<std::int64_t>(512, 70), sampled),
                     "generate: the prompt has 512 tokens, the model at most 512 positions");
}
