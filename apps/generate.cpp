// apps/generate: prints text a saved Llama directory (train_llama --save-model, or a Hugging
// Face LlamaForCausalLM with a byte-level vocabulary) writes after a prompt: greedy, or sampled
// with temperature and top-k, through the KV cache, on the CPU or a GPU. One process, no MPI.
#include "models/generate.h"

#include <CLI/CLI.hpp>
#include <cstdio>

#include "apps/cli.h"
#include "core/parallel.h"
#include "data/tokenizer.h"
#include "models/llama.h"

using namespace shardlab;

namespace {

struct Options {
  std::string model_dir;
  std::string tokenizer;  // default: the model directory's tokenizer.json, else bytes
  std::string prompt;
  std::int64_t samples = 3;
  models::SamplingOptions sampling;
  int threads = 0;
  std::string device = "auto";
};

void run(const Options& options) {
  if (options.threads > 0) set_num_threads(options.threads);
  const Device device = device_for(parse_device_choice(options.device));
  const std::unique_ptr<data::Tokenizer> tokenizer = data::make_tokenizer(
      options.tokenizer.empty() ? data::directory_tokenizer(options.model_dir) : options.tokenizer);
  const models::LlamaConfig config = models::load_pretrained_config(options.model_dir);
  SHARDLAB_CHECK(config.vocab_size >= tokenizer->vocab_size(),
                 "'{}' has a vocabulary of {}, fewer than the {} tokenizer's {} ids", options.model_dir,
                 config.vocab_size, tokenizer->name(), tokenizer->vocab_size());
  models::Llama model = [&] {
    const nn::DeferredInitGuard deferred;  // shapes only: the weights come from the file
    return models::Llama(config);
  }();
  nn::Named<Shape> shapes;
  for (const auto& [name, p] : model->named_parameters()) {
    p.set_data(empty(p.shape()));
    shapes.emplace_back(name, p.shape());
  }
  model->load_state_dict(models::load_pretrained_weights(options.model_dir, shapes));
  model->to(device);

  std::vector<std::int64_t> prompt{tokenizer->bot_id()};
  for (const std::int64_t id : tokenizer->encode(options.prompt)) prompt.push_back(id);
  for (std::int64_t i = 0; i < options.samples; ++i) {
    models::SamplingOptions sampling = options.sampling;
    sampling.seed += static_cast<std::uint64_t>(i);
    sampling.stop_token = tokenizer->eot_id();
    const std::vector<std::int64_t> tokens = models::generate(*model, prompt, sampling);
    std::printf("--- sample %lld ---\n%s%s\n", static_cast<long long>(i + 1), options.prompt.c_str(),
                tokenizer->decode(tokens).c_str());
  }
}

}  // namespace

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
  app.add_option("--threads", options.threads, "CPU threads (default: the cores this process may use)")
      ->check(apps::integer_at_least(0));
  app.add_option("--device", options.device, "auto (a GPU where one answers, else the CPU), cpu or cuda")
      ->check(apps::one_of({"auto", "cpu", "cuda"}));
  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "generate", true))
    return *status;
  try {
    run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate: %s\n", e.what());
    return 1;
  }
  return 0;
}
