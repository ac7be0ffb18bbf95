// apps/generate: prints text a saved Llama directory (train_llama --save-model, or a Hugging
// Face LlamaForCausalLM with a byte-level or BPE tokenizer.json) writes after a prompt: greedy, or
// sampled with temperature and top-k, through the KV cache, on the CPU or a GPU; or, with --logits,
// scores the prompt (its logits to a file, its loss printed), for comparing with another library.
// One process holds the whole model; under mpirun the ranks shard it with FSDP, none holding it
// whole, compute the same tokens in step, and rank 0 prints (apps/generate_model.h).
#include "models/generate.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include "apps/cli.h"
#include "apps/generate_model.h"
#include "autograd/functional.h"
#include "core/parallel.h"
#include "data/tokenizer.h"
#include "models/llama.h"
#include "nn/safetensors.h"

using namespace shardlab;

namespace {

struct Options {
  std::string model_dir;
  std::string tokenizer;  // default: the model directory's tokenizer.json, else bytes
  std::string prompt;
  std::int64_t samples = 3;
  bool print_ids = false;
  std::string logits;  // --logits: score the prompt into this file instead of sampling
  models::SamplingOptions sampling;
  int threads = 0;
  std::string device = "auto";
};

// --logits: the logits of [BOT] + the prompt's ids in one forward (f32 [tokens, vocab], with the
// ids, to a safetensors file) and the mean loss of predicting each id from those before it.
void score(models::Llama& model, const std::vector<std::int64_t>& ids, const std::string& path, bool prints) {
  const NoGradGuard no_grad;
  const auto length = static_cast<std::int64_t>(ids.size());
  const Device device = model->parameters().front().device();
  const Tensor tokens = from_vector(ids, {1, length}).to(device);
  const Tensor logits = model(tokens).data().reshape({length, -1}).to(DType::f32);
  double loss = 0;
  if (length > 1) {
    loss = cross_entropy(constant(logits.narrow(0, 0, length - 1)),
                         tokens.reshape({length}).narrow(0, 1, length - 1))
               .data()
               .item<double>();
  }
  if (!prints) return;
  nn::save_safetensors(path, {{"logits", logits.to(Device::cpu())}, {"ids", from_vector(ids, {length})}});
  std::printf("scored %lld tokens: loss %.9g; logits written to %s\n", static_cast<long long>(length), loss,
              path.c_str());
}

void run(int& argc, char**& argv, const Options& options) {
  if (!options.logits.empty()) apps::check_writable_path("--logits", options.logits, /*is_directory=*/false);
  if (options.threads > 0) set_num_threads(options.threads);
  const apps::GenerationRanks ranks = apps::join_ranks(argc, argv, parse_device_choice(options.device));
  const bool prints = ranks.rank == 0;
  const std::unique_ptr<data::Tokenizer> tokenizer = data::make_tokenizer(
      options.tokenizer.empty() ? data::directory_tokenizer(options.model_dir) : options.tokenizer);
  const models::LlamaConfig config = models::load_pretrained_config(options.model_dir);
  SHARDLAB_CHECK(config.vocab_size >= tokenizer->vocab_size(),
                 "'{}' has a vocabulary of {}, fewer than the {} tokenizer's {} ids", options.model_dir,
                 config.vocab_size, tokenizer->name(), tokenizer->vocab_size());
  models::Llama model = apps::open_model(ranks, options.model_dir);

  std::vector<std::int64_t> prompt{tokenizer->bot_id()};
  for (const std::int64_t id : tokenizer->encode(options.prompt)) prompt.push_back(id);
  if (!options.logits.empty()) return score(model, prompt, options.logits, prints);
  for (std::int64_t i = 0; i < options.samples; ++i) {
    models::SamplingOptions sampling = options.sampling;
    sampling.seed += static_cast<std::uint64_t>(i);
    sampling.stop_token = tokenizer->eot_id();
    const std::vector<std::int64_t> tokens = models::generate(*model, prompt, sampling);
    if (!prints) continue;
    std::printf("--- sample %lld ---\n%s%s\n", static_cast<long long>(i + 1), options.prompt.c_str(),
                tokenizer->decode(tokens).c_str());
    if (options.print_ids) std::printf("ids: %s\n", fmt::format("{}", fmt::join(tokens, " ")).c_str());
  }
}

}  // namespace

models::Llama apps::whole_model(const std::string& dir, Device device) {
  models::Llama model = [&] {
    const nn::DeferredInitGuard deferred;  // shapes only: the weights come from the file
    return models::Llama(models::load_pretrained_config(dir));
  }();
  nn::Named<Shape> shapes;
  for (const auto& [name, p] : model->named_parameters()) {
    p.set_data(empty(p.shape()));
    shapes.emplace_back(name, p.shape());
  }
  model->load_state_dict(models::load_pretrained_weights(dir, shapes));
  model->to(device);
  return model;
}

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"generate: sample text from a saved Llama directory"};
  app.add_option("model", options.model_dir,
                 "directory with config.json, model.safetensors and, for a BPE model, tokenizer.json")
      ->required();
  app.add_option("--tokenizer", options.tokenizer,
                 "bytes or a tokenizer.json (default: the model directory's tokenizer.json, else bytes)");
  app.add_option("--prompt", options.prompt, "text the samples continue (default: none, from [BOT])");
  app.add_option("--samples", options.samples, "how many texts")->check(apps::integer_at_least(1));
  app.add_option("--tokens", options.sampling.max_new_tokens, "at most this many new tokens each")
      ->check(apps::integer_at_least(1));
  app.add_option("--temperature", options.sampling.temperature, "0: greedy")->check(apps::number_at_least(0));
  app.add_option("--top-k", options.sampling.top_k, "sample among the k most likely tokens (0: all)")
      ->check(apps::integer_at_least(0));
  app.add_option("--seed", options.sampling.seed, "seed of the draws")->check(apps::integer_at_least(0));
  app.add_flag("--print-ids", options.print_ids,
               "also print each sample's new token ids, on a line 'ids: ...'");
  app.add_option(
      "--logits", options.logits,
      "instead of sampling, score [BOT] + the prompt: write its logits ('logits', f32 [tokens, vocab]) "
      "and ids ('ids') to this safetensors file and print the loss of each next id");
  app.add_option("--threads", options.threads, "CPU threads (default: the cores this process may use)")
      ->check(apps::integer_at_least(0));
  app.add_option("--device", options.device, "auto (a GPU where one answers, else the CPU), cpu or cuda")
      ->check(apps::one_of({"auto", "cpu", "cuda"}));
  if (const std::optional<int> status =
          apps::parse_command_line(app, argc, argv, "generate", apps::prints_errors()))
    return *status;
  try {
    run(argc, argv, options);
  } catch (const std::exception& e) {
    // Under mpirun every rank fails alike (the same files and flags) and rank 0 says why. mpirun ends
    // the job when the first rank exits: the others give rank 0 the time to print first, or its line
    // could be lost with it.
    if (apps::prints_errors()) {
      std::fprintf(stderr, "generate: %s\n", e.what());
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return 1;
  }
  return 0;
}
