// apps/train_llama: trains the Llama (models/llama.h) on a text corpus (Debian's fortunes by
// default) with FSDP over the ranks mpirun starts: one unit per decoder layer plus the root
// (recipes/llama.h); with --tp N, tensor parallelism inside groups of N ranks and FSDP across. AdamW
// (0.9, 0.99, wd 0.1; or SGD), linear warm-up from 0.1 then cosine to 0, gradient clipping at 1.0,
// cross-entropy that ignores [PAD]. Besides what every training program has (apps/trainer.h), prints a
// progress bar with loss and tokens/s, saves a Hugging Face directory, and can print a few samples after
// training.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>

#include "apps/cli.h"
#include "apps/support/progress.h"
#include "apps/support/ranks.h"
#include "apps/trainer.h"
#include "autograd/functional.h"
#include "core/allocator.h"
#include "core/exact_sum.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "data/bpe.h"
#include "data/loader.h"
#include "data/random_tokens.h"
#include "data/text_corpus.h"
#include "data/tokenizer.h"
#include "dist/checkpoint/full_safetensors.h"
#include "dist/comm/log.h"
#include "dist/fsdp/fsdp.h"
#include "models/generate.h"
#include "models/llama.h"
#include "optim/optimizer.h"
#include "optim/scheduler.h"
#include "recipes/llama.h"

using namespace shardlab;

namespace {

struct Options : apps::TrainerOptions {
  Options() { global_batch = 16; }
  std::string config = "tiny";
  std::string tokenizer;  // default: --init-from's tokenizer.json, else bytes
  std::vector<std::string> data{"/usr/share/games/fortunes"};
  std::string separator = "%";
  std::int64_t limit_documents = 0;
  double validation_split = 0;               // percent of the documents held out; 0: none
  std::vector<std::string> validation_data;  // or a held-out set of its own
  std::int64_t eval_every = 0;               // 0: the validation set once, after the last step
  bool pack = false;                         // the documents in one stream cut into sequences
  bool block_causal = false;                 // with pack: each document attends to its own tokens only
  bool eval_only = false;                    // the validation loss of the model as it starts, no step
  std::int64_t seq = 256;
  double lr = 1e-3;
  std::int64_t warmup_steps = -1;  // default: a tenth of the steps
  std::string lr_decay = "cosine";
  double decay_ratio = 1;    // of the steps after the warm-up: the last that decay
  double min_lr_factor = 0;  // where the decay ends, of --lr
  double weight_decay = 0.1;
  std::string optimizer = "adamw";
  std::optional<double> momentum;  // --optimizer sgd's (default 0.9)
  bool no_decay_norms = false;
  double clip = 1.0;
  bool activation_checkpointing = false;
  bool cpu_offload = false;
  int tp = 1;
  std::string init_from;
  std::string save_model_max_file_size;  // empty: one model.safetensors
  std::string save_model_dtype = "f32";
  std::int64_t samples = 0;
  std::int64_t sample_tokens = 200;
  bool random_tokens = false;
};

// --save-model-dtype's words.
DType weights_dtype(const std::string& name) {
  return name == "bf16" ? DType::bf16 : name == "f16" ? DType::f16 : DType::f32;
}

// What the plan counts as optimizer state per element: AdamW's exp_avg and exp_avg_sq in f32, SGD's
// momentum buffer (none without momentum).
std::int64_t optimizer_state_bytes_per_element(const Options& options) {
  if (options.optimizer == "adamw") return 8;
  return options.momentum.value_or(0.9) > 0 ? 4 : 0;
}

// --optimizer: AdamW (betas 0.9, 0.99, decoupled weight decay), or SGD (momentum, L2 weight decay).
std::unique_ptr<optim::Optimizer> make_optimizer(const Options& options,
                                                 std::vector<optim::ParamGroup> groups) {
  if (options.optimizer == "sgd") {
    return std::make_unique<optim::SGD>(std::move(groups),
                                        optim::SGDOptions{.lr = options.lr,
                                                          .momentum = options.momentum.value_or(0.9),
                                                          .weight_decay = options.weight_decay});
  }
  SHARDLAB_CHECK(!options.momentum, "--momentum is SGD's: --optimizer adamw has none");
  return std::make_unique<optim::AdamW>(
      std::move(groups),
      optim::AdamWOptions{
          .lr = options.lr, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = options.weight_decay});
}

// A preset's shape takes the tokenizer's vocabulary; a config file, a directory, and random tokens
// (drawn from the model's vocabulary) keep its own.
bool takes_tokenizer_vocab(const Options& options) {
  return options.init_from.empty() && !options.config.ends_with(".json") && !options.random_tokens;
}

models::LlamaConfig resolve_config(const Options& options) {
  if (!options.init_from.empty()) return models::load_pretrained_config(options.init_from);
  if (options.config.ends_with(".json")) return models::LlamaConfig::from_file(options.config);
  return models::LlamaConfig::preset(options.config);
}

// VOCAB of --tokenizer bpe:VOCAB; nothing for the other forms.
std::optional<std::int64_t> bpe_vocab(const std::string& spec) {
  if (!spec.starts_with("bpe:")) return std::nullopt;
  const std::string digits = spec.substr(4);
  SHARDLAB_CHECK(
      !digits.empty() && digits.size() <= 9 && digits.find_first_not_of("0123456789") == std::string::npos,
      "--tokenizer '{}': expected bpe:VOCAB with VOCAB a positive integer", spec);
  return std::stoll(digits);
}

// --tokenizer: "bytes", a tokenizer.json, or "bpe:VOCAB" learned from the corpus. Rank 0 learns
// the merges and sends its tokenizer.json to every rank: all hold the very same tokenizer (and
// the others spend no time on it), which the checkpoints record and a resumed run must match.
std::unique_ptr<data::Tokenizer> corpus_tokenizer(const std::string& spec,
                                                  const std::vector<std::string>& documents,
                                                  dist::Communicator& comm) {
  const std::optional<std::int64_t> vocab = bpe_vocab(spec);
  if (!vocab) return data::make_tokenizer(spec);
  std::string json;
  apps::on_rank_zero(comm, fmt::format("learning the {} tokenizer", spec),
                     [&] { json = data::BpeTokenizer::train(documents, {.vocab_size = *vocab}).to_json(); });
  return std::make_unique<data::BpeTokenizer>(
      data::BpeTokenizer::from_json(apps::broadcast_text(comm, json), spec));
}

// The tokenizer.json of a BPE tokenizer (null for bytes): what checkpoints record, as text, so that
// its key order survives the checkpoint's metadata.
nlohmann::json tokenizer_document(const data::Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const data::BpeTokenizer*>(&tokenizer);
  return bpe ? nlohmann::json(bpe->to_json()) : nlohmann::json();
}

// --pack's layout of the documents, or a sequence each.
data::Packing packing(const Options& options) {
  return options.pack ? data::Packing::packed : data::Packing::one_per_document;
}

// The samples the model trains or is evaluated on: with --block-causal, each token's document too.
data::TensorDataset samples(const data::PretrainingDataset& corpus, const Options& options) {
  return options.block_causal ? corpus.dataset_with_documents() : corpus.dataset();
}

// --eval-only: a validation set to evaluate, and nothing given that only training would do.
void check_eval_only(const Options& options) {
  if (!options.eval_only) return;
  SHARDLAB_CHECK(options.validation_split > 0 || !options.validation_data.empty(),
                 "--eval-only: there is no validation set (--validation-split or --validation-data)");
  const std::pair<bool, const char*> training_only[] = {{!options.save_model.empty(), "--save-model"},
                                                        {options.samples > 0, "--sample"},
                                                        {options.explain, "--explain"},
                                                        {!options.trace.empty(), "--trace"},
                                                        {options.profile, "--profile"},
                                                        {options.checkpoint_every > 0, "--checkpoint-every"},
                                                        {options.async_checkpoint, "--async-checkpoint"},
                                                        {!options.memory_limit.empty(), "--memory-limit"},
                                                        {options.eval_every > 0, "--eval-every"}};
  for (const auto& [given, flag] : training_only)
    SHARDLAB_CHECK(!given, "--eval-only takes no step: {} is training's", flag);
  SHARDLAB_CHECK(options.checkpoint_dir.empty() || options.resume,
                 "--eval-only saves nothing: --checkpoint-dir is read with --resume (its newest checkpoint "
                 "evaluated) or not at all");
}

// --validation-split: `percent` of the documents (rounded, at least one), drawn with `seed`, taken out of
// `documents` into the validation set; both keep the corpus's order. Refused where either would be empty.
std::vector<std::string> hold_out(std::vector<std::string>& documents, double percent, std::uint64_t seed) {
  SHARDLAB_CHECK(
      percent > 0 && percent < 100,
      "--validation-split {:g}: the percent of the documents held out must be above 0 and below 100",
      percent);
  const auto count = static_cast<std::int64_t>(documents.size());
  const std::int64_t held =
      std::max<std::int64_t>(1, std::llround(static_cast<double>(count) * percent / 100));
  SHARDLAB_CHECK(held < count,
                 "--validation-split {:g}: holding out {} of the {} documents leaves none to train on",
                 percent, held, count);
  std::vector<bool> validation(documents.size(), false);
  const std::vector<std::int64_t> order = data::RandomSampler(count, seed).indices(0);
  for (std::int64_t i = 0; i < held; ++i)
    validation[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = true;
  std::vector<std::string> training, held_out;
  for (std::size_t i = 0; i < documents.size(); ++i)
    (validation[i] ? held_out : training).push_back(std::move(documents[i]));
  documents = std::move(training);
  return held_out;
}

// The schedule: LinearLR from 0.1 over the warm-up (the FSDP2 article's), then the lr held at its peak
// (warm-up-stable-decay, where --decay-ratio is below 1) and decayed over the last --decay-ratio of the
// steps after the warm-up, by cosine annealing (the article's) or linearly (torchtitan's default), to
// --min-lr-factor of the peak.
std::unique_ptr<optim::LRScheduler> make_schedule(optim::Optimizer& optimizer, const Options& options,
                                                  std::int64_t total_steps, std::int64_t warmup_steps) {
  const std::int64_t after = std::max<std::int64_t>(1, total_steps - warmup_steps);
  const std::int64_t decay =
      std::clamp<std::int64_t>(std::llround(options.decay_ratio * static_cast<double>(after)), 1, after);
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  std::vector<std::int64_t> milestones{warmup_steps};
  parts.push_back(std::make_unique<optim::LinearLR>(optimizer, 0.1, 1.0, warmup_steps));
  if (decay < after) {
    parts.push_back(std::make_unique<optim::LinearLR>(optimizer, 1.0, 1.0, after - decay));  // stable
    milestones.push_back(warmup_steps + after - decay);
  }
  if (options.lr_decay == "linear") {
    parts.push_back(std::make_unique<optim::LinearLR>(optimizer, 1.0, options.min_lr_factor, decay));
  } else {
    parts.push_back(
        std::make_unique<optim::CosineAnnealingLR>(optimizer, decay, options.min_lr_factor * options.lr));
  }
  return std::make_unique<optim::SequentialLR>(optimizer, std::move(parts), std::move(milestones));
}

bool is_norm(const std::string& name) { return name.ends_with("norm.weight"); }

// What --tp does not combine with, refused before anything loads.
void check_tensor_parallel(const Options& options, int world_size) {
  SHARDLAB_CHECK(options.tp == 1 || options.world_size == 0,
                 "--world-size: a run with --tp {} is not predicted at another world size (its collectives "
                 "inside the layers are not modelled)",
                 options.tp);
  SHARDLAB_CHECK(world_size % options.tp == 0, "--tp {} does not divide the {} ranks", options.tp,
                 world_size);
  if (options.tp == 1) return;
  SHARDLAB_CHECK(!options.bitwise,
                 "--bitwise is not supported with --tp {}: tensor parallelism's all-reduces add in an order "
                 "that depends on the ranks",
                 options.tp);
  SHARDLAB_CHECK(options.sharding == "full",
                 "--tp shards fully across the tensor-parallel groups; --sharding {} "
                 "is not supported with it",
                 options.sharding);
  for (const auto& [given, flag] :
       {std::pair{options.samples > 0, "--sample"}, std::pair{options.cpu_offload, "--cpu-offload"}}) {
    SHARDLAB_CHECK(!given, "{} is not supported with --tp {}", flag, options.tp);
  }
}

struct ShardedLlama {
  models::Llama model;
  recipes::ParallelLlama layout;
};

// The model on `device`, each rank's shards drawn there, or read from --init-from's files (just
// their elements, by offset): no rank ever holds the whole model. Split over the mesh's "tp" ranks
// when there is one.
ShardedLlama sharded_llama(const Options& options, const models::LlamaConfig& config,
                           const dist::FsdpOptions& fsdp, const dist::DeviceMesh* mesh, Device device) {
  models::Llama model = [&] {
    const nn::DeferredInitGuard deferred;
    return models::Llama(config, options.seed);
  }();
  if (!options.init_from.empty()) models::defer_to_pretrained(model, options.init_from);
  model->to(device);
  recipes::ParallelLlama layout = recipes::parallelize_llama(
      model, {.fsdp = fsdp, .mesh = mesh, .activation_checkpointing = options.activation_checkpointing});
  return {std::move(model), std::move(layout)};
}

class Training : public apps::Trainer {
 public:
  Training(const Options& options, dist::Session& session);

 private:
  double global_samples(const data::Batch& on_host) override;
  StepLoss forward_loss(const data::Batch& batch, double samples) override;
  Tensor clip_gradients() override;
  void dry_run(const data::Batch& batch) override { sum(losses(batch)).backward(); }
  nlohmann::json training_state() const override;
  void restore(const nlohmann::json& state, const std::string& path) override;
  void begin_training() override;
  void after_step(const StepResult& result) override;
  void finish() override;
  std::string throughput(double median_seconds) const override;
  void report_memory() const override;
  void add_summary(nlohmann::json& summary, double median_seconds) const override;

  Variable losses(const data::Batch& batch);
  // The validation set's loss now (Setup::evaluate), logged and written to the metrics.
  void validate();
  // Its forwards over this rank's share and the sums over the ranks: the same value on every rank.
  double validation_loss();
  // The ranks that share out the batch: the mesh's "dp" with --tp, else all.
  dist::Communicator& data_parallel() const { return mesh_ ? (*mesh_)["dp"] : session_.world(); }
  double tokens_per_second(double seconds) const {
    return seconds > 0 ? static_cast<double>(options_.global_batch * options_.seq) / seconds : 0;
  }

  const Options options_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  nlohmann::json tokenizer_document_;  // its tokenizer.json text, null for bytes
  models::LlamaConfig config_;
  std::optional<data::PretrainingDataset> corpus_;  // none with --random-tokens
  std::int64_t sequences_ = 0;                      // in the training set
  std::int64_t pad_id_ = -1;                        // the tokenizer's [PAD]; -1 (no id) with --random-tokens
  std::optional<data::DataLoader> loader_;
  std::optional<data::PretrainingDataset> validation_;  // --validation-split's or --validation-data's
  std::optional<data::TensorDataset> validation_set_;   // its samples as the model takes them, made once
  data::EvaluationForwards validation_forwards_;        // this rank's share of it
  std::optional<double> validation_loss_;               // the last validation's
  std::unique_ptr<dist::DeviceMesh> mesh_;              // dp x tp, with --tp
  std::int64_t tensor_parallel_bytes_ = 0;              // what the tp ranks exchanged in the last step
  std::optional<models::Llama> model_;
  recipes::ParallelLlama layout_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<optim::LRScheduler> scheduler_;
  std::int64_t total_steps_ = 0;
  std::optional<apps::Progress> progress_;
  std::vector<double> recent_losses_;  // the bar shows the mean of the last 10 steps
};

Training::Training(const Options& options, dist::Session& session)
    : apps::Trainer("train_llama", options, session, /*save_model_is_directory=*/true), options_(options) {
  // Options first: a typo fails before the corpus loads.
  bpe_vocab(options.tokenizer);
  SHARDLAB_CHECK(options.decay_ratio <= 1,
                 "--decay-ratio {:g}: the fraction of the steps after the warm-up that decay is at most 1",
                 options.decay_ratio);
  SHARDLAB_CHECK(options.min_lr_factor < 1,
                 "--min-lr-factor {:g}: the decay must end below the peak lr (below 1)",
                 options.min_lr_factor);
  check_eval_only(options);
  SHARDLAB_CHECK(options.eval_every == 0 || options.validation_split > 0 || !options.validation_data.empty(),
                 "--eval-every {}: there is no validation set (--validation-split or --validation-data)",
                 options.eval_every);
  config_ = resolve_config(options);
  SHARDLAB_CHECK(options.seq <= config_.max_position_embeddings, "--seq {} exceeds the model's {} positions",
                 options.seq, config_.max_position_embeddings);
  fsdp_.cpu_offload = options.cpu_offload;
  check_tensor_parallel(options, world_size_);

  std::vector<std::string> documents;
  if (!options.random_tokens) documents = data::read_documents(options.data, options.separator);
  if (options.limit_documents > 0 && options.limit_documents < static_cast<std::int64_t>(documents.size())) {
    documents.resize(static_cast<std::size_t>(options.limit_documents));
  }
  // Held out before the tokenizer learns from the documents: it never sees the validation set.
  const std::vector<std::string> validation_documents =
      options.validation_split > 0      ? hold_out(documents, options.validation_split, options.seed)
      : options.validation_data.empty() ? std::vector<std::string>()
                                        : data::read_documents(options.validation_data, options.separator);
  const std::string tokenizer = !options.tokenizer.empty()  ? options.tokenizer
                                : options.init_from.empty() ? "bytes"
                                                            : data::directory_tokenizer(options.init_from);
  tokenizer_ = corpus_tokenizer(tokenizer, documents, session.cpu_world());
  tokenizer_document_ = tokenizer_document(*tokenizer_);
  if (takes_tokenizer_vocab(options)) config_.vocab_size = tokenizer_->vocab_size();
  SHARDLAB_CHECK(options.random_tokens || config_.vocab_size >= tokenizer_->vocab_size(),
                 "the model's vocab_size {} is smaller than the {} tokenizer's {} ids", config_.vocab_size,
                 tokenizer_->name(), tokenizer_->vocab_size());
  // Random tokens: a fresh batch for every step, the same on every rank and world size.
  const data::TensorDataset training_set =
      options.random_tokens
          ? data::random_token_dataset(options.global_batch * options.steps, options.seq, config_.vocab_size,
                                       static_cast<std::uint64_t>(options.seed))
          : samples(corpus_.emplace(documents, *tokenizer_, options.seq, packing(options)), options);
  sequences_ = training_set.size();
  if (!validation_documents.empty()) {
    validation_.emplace(validation_documents, *tokenizer_, options.seq, packing(options));
    validation_set_.emplace(samples(*validation_, options));
  }
  pad_id_ = options.random_tokens ? -1 : tokenizer_->pad_id();
  if (options.tp > 1) {
    // Consecutive ranks form a tensor-parallel group, as on one machine each.
    mesh_ = std::make_unique<dist::DeviceMesh>(session.world(),
                                               std::vector<int>{world_size_ / options.tp, options.tp},
                                               std::vector<std::string>{"dp", "tp"});
  }
  loader_.emplace(data::rank_loader(training_set, {.size = options.global_batch,
                                                   .world_size = data_parallel().size(),
                                                   .rank = data_parallel().rank(),
                                                   .shuffle = true,
                                                   .seed = options.seed,
                                                   .chunk = chunk_}));
  if (validation_) {
    // Forwards of at most a training micro-batch's rows (rank 0 holds the most): no larger activations.
    const std::int64_t rows =
        data::micro_batch_rows(data::rank_batch_size(options.global_batch, data_parallel().size(), 0),
                               accumulation_.micro_batches, 0)
            .front()
            .count;
    validation_forwards_ = data::evaluation_forwards(
        validation_->size(),
        {.world_size = data_parallel().size(), .rank = data_parallel().rank(), .chunk = chunk_}, rows);
  }
  data_bytes_ = memory_stats(device_).bytes_in_use;
  total_steps_ = options.steps > 0 ? options.steps : options.epochs * loader_->batches_per_epoch();
  SHARDLAB_CHECK(total_steps_ > 0, "nothing to train: {} documents give no batch of {}", documents.size(),
                 options.global_batch);
  const std::int64_t warmup =
      options.warmup_steps >= 0 ? options.warmup_steps : std::max<std::int64_t>(1, total_steps_ / 10);

  model_bytes_baseline_ = memory_stats(device_).bytes_in_use;
  ShardedLlama sharded = sharded_llama(options, config_, fsdp_, mesh_.get(), device_);
  model_.emplace(std::move(sharded.model));
  layout_ = std::move(sharded.layout);
  if (!options.init_from.empty()) {
    // Joining the units to the root draws the shards: each rank reads its elements of the files now.
    const auto start = std::chrono::steady_clock::now();
    dist::sharded_parameters(**model_);
    dist::log("train_llama: read each rank's shards of '{}' in {:.2f} s", options.init_from,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  nn::Named<Variable> decayed, undecayed;
  for (auto& [name, shard] : (*model_)->named_parameters()) {  // this rank's shards, after fully_shard
    (options.no_decay_norms && is_norm(name) ? undecayed : decayed).emplace_back(name, shard);
  }
  std::vector<optim::ParamGroup> groups{{.parameters = decayed}};
  if (!undecayed.empty()) groups.push_back({.parameters = undecayed, .weight_decay = 0.0});
  optimizer_ = make_optimizer(options, std::move(groups));
  // Offloaded, each unit's update runs on a host thread while the next forward gathers the units before it.
  if (options.cpu_offload) dist::overlap_host_step(*optimizer_, **model_);
  scheduler_ = make_schedule(*optimizer_, options, total_steps_, std::max<std::int64_t>(1, warmup));
  start({.root = &**model_,
         .optimizer = optimizer_.get(),
         .loader = &*loader_,
         .scheduler = scheduler_.get(),
         .total_steps = total_steps_,
         .optimizer_state_bytes_per_element = optimizer_state_bytes_per_element(options),
         .checkpointing_available = true,
         .checkpointing = options.activation_checkpointing,
         .unchanged = {"seq", "pack", "block_causal", "validation_split", "sequences", "tokenizer_json",
                       "config"},
         .data_parallel = &data_parallel(),
         .evaluate = validation_ ? std::function<void()>([this] { validate(); }) : nullptr,
         .evaluate_every = options.eval_every,
         .evaluate_only = options.eval_only});

  dist::log(
      "train_llama: {} documents, {} {}sequences of {} tokens ({} tokenizer, vocab {}), model {} with {} "
      "parameters, "
      "{} rank{} x {} threads, sharding {}{}, global batch {} ({}), {} steps, {} lr {:g}{}{}",
      options.random_tokens ? "no" : std::to_string(documents.size()), sequences_,
      options.block_causal ? "packed block-causal "
      : options.pack       ? "packed "
                           : "",
      options.seq, options.random_tokens ? "random token ids, no" : tokenizer_->name(), config_.vocab_size,
      options.init_from.empty() ? options.config : options.init_from, config_.parameter_count(), world_size_,
      world_size_ == 1 ? "" : "s", num_threads(), plan_.sharding,
      mesh_ ? fmt::format(" over {}, tensor parallel in tp", mesh_->str()) : "", options.global_batch,
      apps::rank_shares(options.global_batch, data_parallel().size(), chunk_), total_steps_,
      options.optimizer == "sgd" ? fmt::format("SGD (momentum {:g})", options.momentum.value_or(0.9))
                                 : "AdamW",
      options.lr, options.mixed_precision == "none" ? "" : ", mixed precision " + options.mixed_precision,
      options.activation_checkpointing ? ", activation checkpointing" : "");
  if (validation_) {
    dist::log("train_llama: validation set of {} sequences ({} target tokens, {}), its loss {}",
              validation_->size(), validation_->target_tokens(),
              options.validation_split > 0
                  ? fmt::format("{:g}% of the documents held out", options.validation_split)
                  : fmt::format("--validation-data {}", fmt::join(options.validation_data, " ")),
              options.eval_only ? std::string("of the model as it starts (--eval-only)")
              : options.eval_every > 0
                  ? fmt::format("every {} steps and after the last step", options.eval_every)
                  : std::string("after the last step"));
  }
}

// The plan of what tensor parallelism exchanges in a step, for this rank's rows of the global batch.
recipes::TensorParallelTraffic planned_tensor_parallel_traffic(const Options& options,
                                                               const models::LlamaConfig& config,
                                                               const dist::DeviceMesh& mesh) {
  const std::int64_t rows =
      data::rank_batch_size(options.global_batch, mesh.size("dp"), mesh.coordinate("dp"));
  return recipes::tensor_parallel_traffic(config, mesh.size("tp"), rows * options.seq,
                                          options.mixed_precision == "bf16" ? DType::bf16 : DType::f32,
                                          options.activation_checkpointing);
}

void Training::begin_training() {
  if (options_.explain) {
    // What the FSDP2 article prints as param.placements: where rank 0's piece of each parameter lies.
    std::string shards = "rank 0's shards (parameter, shape: placement):\n";
    for (const auto& [name, shard] : dist::parameter_shards(**model_)) {
      // With --tp, first where the rank's piece lies in the whole, then FSDP's shard of the piece.
      const std::string piece =
          shard.piece
              ? fmt::format(
                    "Shard(dim {}) [{}, {}) of {}, then ", shard.piece->dim, shard.piece->offset,
                    shard.piece->offset + shard.full_shape[static_cast<std::size_t>(shard.piece->dim)],
                    shape_str(shard.piece->whole))
              : "";
      shards += fmt::format("  {} {}: {}{}\n", name, shape_str(shard.full_shape), piece, shard.placement);
    }
    dist::log("{}", shards);
    if (mesh_) {
      dist::log("tensor parallel over {} (FSDP's traffic above is the dp ranks'): {}", mesh_->str(),
                planned_tensor_parallel_traffic(options_, config_, *mesh_).str());
    }
  }
  progress_.emplace("train", total_steps_, "tok/s", rank_ == 0);
}

// What continuing exactly needs besides the step (which fixes the data cursor): the schedule, and
// what must not change between the runs.
nlohmann::json Training::training_state() const {
  return {{"scheduler_epoch", scheduler_->epoch()},
          {"seq", options_.seq},
          {"sequences", sequences_},
          {"total_steps", total_steps_},
          {"config", config_.to_json()},
          {"tokenizer", tokenizer_->name()},
          {"tokenizer_json", tokenizer_document_},
          // How the documents make sequences (null: one each) and attend (null: across a packed
          // sequence), and which train: a resumed run must hold out the same (null: none held out).
          {"pack", options_.pack ? nlohmann::json(true) : nlohmann::json()},
          {"block_causal", options_.block_causal ? nlohmann::json(true) : nlohmann::json()},
          {"validation_split",
           options_.validation_split > 0 ? nlohmann::json(options_.validation_split) : nlohmann::json()}};
}

void Training::restore(const nlohmann::json& state, const std::string& path) {
  SHARDLAB_CHECK(options_.eval_only || step_ < total_steps_,
                 "--resume: '{}' is at step {}, and --steps asks for {}", path, step_, total_steps_);
  scheduler_->set_epoch(state.at("scheduler_epoch").get<std::int64_t>());
  if (options_.eval_only) {
    dist::log("train_llama: evaluating {} (step {})", path, step_);
  } else {
    dist::log("train_llama: resumed from {} (step {}), continuing to step {}", path, step_, total_steps_);
  }
}

// The loss is the mean over the global batch's non-padding targets: each rank sums its own and
// divides by the global count, so any number of ranks computes the 1-process loss.
double Training::global_samples(const data::Batch& on_host) {
  // Once a step, before its forward passes (one per micro-batch): the tp ranks' traffic of the step.
  if (mesh_) (*mesh_)["tp"].reset_counters();
  const double local_targets = sum(ne(on_host.targets, pad_id_).to(DType::i64)).item<double>();
  // The ranks of a tensor-parallel group hold the same rows: the world counts each row tp times.
  return std::max(
      apps::sum_over_ranks(session_.cpu_world(), {local_targets})[0] / static_cast<double>(options_.tp), 1.0);
}

Training::StepLoss Training::forward_loss(const data::Batch& batch, double samples) {
  // The gradient of the global mean over the targets.
  return {.losses = losses(batch), .divisor = samples, .samples = samples};
}

Tensor Training::clip_gradients() {
  // The block halves' all-reduces of this step's forward and backward (clipping's comes next).
  if (mesh_) tensor_parallel_bytes_ = (*mesh_)["tp"].counters().total().bytes_received;
  // Over the shards, the norm of the whole gradient: their sums of squares are added over the ranks.
  if (options_.bitwise) return optim::clip_grad_norm_exact((*model_)->parameters(), options_.clip);
  return optim::clip_grad_norm_((*model_)->parameters(), options_.clip);
}

// The loss of each of the batch's targets (0 for padding).
Variable Training::losses(const data::Batch& batch) {
  // The root's all-gather first, as the FSDP2 article's model.unshard(): it overlaps the padding mask.
  dist::UnshardHandle gathering = dist::unshard(**model_);
  const Tensor padding = eq(batch.inputs, pad_id_);
  gathering.wait();
  const Variable logits = (*model_)(batch.inputs, padding, batch.documents);
  // With --tp the logits hold this rank's vocabulary columns: no rank holds [B, T, vocab].
  const Variable rows = reshape(logits, {-1, logits.size(-1)});
  const Tensor targets = batch.targets.reshape({-1});
  return mesh_ ? dist::vocab_parallel_cross_entropy(rows, targets, layout_.vocabulary, (*mesh_)["tp"],
                                                    pad_id_, Reduction::none)
               : cross_entropy(rows, targets, pad_id_, Reduction::none);
}

// The mean loss over the validation set's non-padding targets: each rank sums its share's (exactly with
// --bitwise, where a forward per chunk computes every chunk alike at any world size) and the data-parallel
// ranks add them, so any world size computes the 1-process loss.
double Training::validation_loss() {
  const NoGradGuard no_grad;
  const data::TensorDataset& set = *validation_set_;
  const std::vector<data::ChunkShare>& mine = validation_forwards_.mine;
  Tensor summed = zeros({1}, dtype(DType::f64).with_device(device_));
  ExactSum exact;
  for (std::int64_t i = 0; i < validation_forwards_.every_rank; ++i) {
    const bool counted = i < static_cast<std::int64_t>(mine.size());
    // A rank out of rows runs its last forward again (the set's first row where it has none) uncounted.
    const data::ChunkShare part = counted        ? mine[static_cast<std::size_t>(i)]
                                  : mine.empty() ? data::ChunkShare{.first = 0, .count = 1}
                                                 : mine.back();
    std::vector<std::int64_t> rows(static_cast<std::size_t>(part.count));
    std::iota(rows.begin(), rows.end(), part.first);
    const Tensor here = losses(data::to_device(set.gather(rows), device_)).data();
    if (!counted) continue;
    if (chunk_ > 0) {
      exact.add(here.contiguous());
    } else {
      summed = add(summed, sum(here).to(DType::f64).reshape({1}));
    }
  }
  double total = 0;
  if (chunk_ > 0) {
    const Tensor limbs = exact.limbs();
    data_parallel().all_reduce(limbs, dist::ReduceOp::sum, "validation loss").wait();
    total = ExactSum::from_limbs(limbs).value();
  } else {
    data_parallel().all_reduce(summed, dist::ReduceOp::sum, "validation loss").wait();
    total = summed.item<double>();
  }
  return total / static_cast<double>(std::max<std::int64_t>(validation_->target_tokens(), 1));
}

void Training::validate() {
  const auto start = std::chrono::steady_clock::now();
  const double loss = validation_loss();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::int64_t tokens = validation_->target_tokens();
  validation_loss_ = loss;
  dist::log(
      "train_llama: validation after step {}: loss {:.4f}, perplexity {:.2f} ({} tokens of {} sequences, "
      "{:.2f} s)",
      step_, loss, std::exp(loss), tokens, validation_->size(), seconds);
  if (metrics_) {
    metrics_->write({{"rank", rank_},
                     {"step", step_},
                     {"validation_loss", loss},
                     {"validation_perplexity", std::exp(loss)},
                     {"validation_tokens", tokens},
                     {"validation_seconds", seconds}});
  }
}

void Training::after_step(const StepResult& result) {
  if (metrics_) {
    const MemoryStats memory = memory_stats(device_);
    nlohmann::json record = step_record(result);
    record.update({{"lr", optimizer_->lr()},
                   {"tokens_per_second", tokens_per_second(result.seconds)},
                   {"step_seconds", result.seconds},
                   {"memory_bytes", memory.bytes_in_use},
                   {"peak_memory_bytes", memory.peak_bytes}});
    metrics_->write(record);
  }
  if (!result.skipped) recent_losses_.push_back(result.loss);
  if (recent_losses_.size() > 10) recent_losses_.erase(recent_losses_.begin());
  double recent = 0;
  for (const double loss : recent_losses_) recent += loss;
  progress_->update(result.step,
                    recent / static_cast<double>(std::max<std::size_t>(1, recent_losses_.size())),
                    tokens_per_second(result.seconds));
}

// --save-model: every rank writes its own shards into model.safetensors, or the files of Hugging
// Face's sharded form (a collective; no rank holds the whole model), and rank 0 writes config.json. --sample
// needs the full parameters: gathered on every rank (a collective), then rank 0 samples from an unsharded
// copy.
void Training::finish() {
  if (!options_.save_model.empty()) {
    const auto start = std::chrono::steady_clock::now();
    apps::on_rank_zero(session_.cpu_world(), fmt::format("writing '{}'", options_.save_model), [&] {
      models::save_pretrained_config(options_.save_model, config_,  // creates the directory
                                     weights_dtype(options_.save_model_dtype));
      if (!tokenizer_document_.is_null()) {
        dynamic_cast<const data::BpeTokenizer&>(*tokenizer_).save(options_.save_model + "/tokenizer.json");
      }
    });
    const std::uint64_t max_file_bytes =
        options_.save_model_max_file_size.empty() ? 0 : *apps::parse_bytes(options_.save_model_max_file_size);
    dist::save_pretrained_safetensors(options_.save_model, **model_, max_file_bytes,
                                      {.dtype = weights_dtype(options_.save_model_dtype)});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    dist::log("train_llama: saved the model to {} in {:.2f} s", options_.save_model, seconds);
  }
  if (options_.samples == 0) return;
  const nn::Named<Tensor> parameters = dist::gather_full_parameters(**model_);
  if (rank_ != 0) return;
  models::Llama copy = [&] {
    const nn::DeferredInitGuard deferred;  // shapes only: the weights come from the shards
    return models::Llama(config_, options_.seed);
  }();
  for (const auto& [name, p] : copy->named_parameters()) p.set_data(empty(p.shape()));
  copy->load_state_dict(parameters);
  for (std::int64_t i = 0; i < options_.samples; ++i) {
    const std::vector<std::int64_t> tokens =
        models::generate(*copy, {tokenizer_->bot_id()},
                         {.max_new_tokens = options_.sample_tokens,
                          .temperature = 0.8,
                          .top_k = 40,
                          .seed = options_.seed + static_cast<std::uint64_t>(i),
                          .stop_token = tokenizer_->eot_id()});
    dist::log("--- sample {} ---\n{}", i + 1, tokenizer_->decode(tokens));
  }
}

void Training::report_memory() const {
  if (!mesh_) return;
  dist::log("train_llama: rank 0 tensor-parallel collectives of the last step: received {} B, planned {} B",
            tensor_parallel_bytes_,
            planned_tensor_parallel_traffic(options_, config_, *mesh_).bytes_received);
}

std::string Training::throughput(double median_seconds) const {
  return fmt::format(", {:.0f} tokens/s", tokens_per_second(median_seconds));
}

void Training::add_summary(nlohmann::json& summary, double median_seconds) const {
  summary.update({{"tokens_per_second", tokens_per_second(median_seconds)},
                  {"peak_memory_bytes", memory_stats(device_).peak_bytes},
                  {"step_counters", (*model_)->named_parameters().size()},
                  {"unsharded_peak_bytes", dist::unsharded_memory().peak_bytes},
                  {"planned_unsharded_peak_bytes", plan_.peak_unsharded_bytes()}});
  if (validation_loss_) summary["validation_loss"] = *validation_loss_;
  if (mesh_) {
    summary.update({{"tensor_parallel_step_bytes", tensor_parallel_bytes_},
                    {"planned_tensor_parallel_step_bytes",
                     planned_tensor_parallel_traffic(options_, config_, *mesh_).bytes_received}});
  }
}

void add_options(CLI::App& app, Options& options) {
  auto* config =
      app.add_option("--config", options.config, "tiny, small, 1b, or a Hugging Face config.json file");
  auto* tokenizer = app.add_option(
      "--tokenizer", options.tokenizer,
      "bytes (256 byte ids + [BOT], [EOT], [PAD]), bpe:VOCAB (byte-level BPE learned from the "
      "corpus), or a Hugging Face tokenizer.json (default: --init-from's tokenizer.json, else bytes)");
  auto* data =
      app.add_option("--data", options.data, "text files or directories of them (default: Debian's fortunes)")
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  auto* separator =
      app.add_option("--separator", options.separator, "the line that separates documents in a file");
  auto* limit_documents =
      app.add_option("--limit-documents", options.limit_documents, "use only the first N documents")
          ->check(apps::integer_at_least(0));
  auto* validation_split =
      app.add_option(
             "--validation-split", options.validation_split,
             "hold out this percent of the corpus's documents (drawn with --seed) as the validation set")
          ->check(apps::number_at_least(0, true));
  auto* validation_data =
      app.add_option("--validation-data", options.validation_data,
                     "text files or directories of a validation set of its own (--separator's documents)")
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
          ->excludes(validation_split);
  app.add_flag(
      "--eval-only", options.eval_only,
      "evaluate the model as it starts (--init-from's, --resume's newest checkpoint, or a fresh one) on "
      "the validation set and exit: no step");
  auto* eval_every =
      app.add_option("--eval-every", options.eval_every,
                     "the validation loss every N steps, and after the last (default: after the last)")
          ->check(apps::integer_at_least(1));
  app.add_option("--seq", options.seq, "tokens per sequence")->check(apps::integer_at_least(1));
  auto* pack = app.add_flag(
      "--pack", options.pack,
      "concatenate the documents ([BOT] text [EOT] each) and cut the stream into sequences of --seq, as "
      "Hugging Face's run_clm groups texts: no padding, attention across documents (unless "
      "--block-causal), the last partial sequence dropped (default: a sequence per document, clipped and "
      "padded)");
  app.add_flag("--block-causal", options.block_causal,
               "with --pack, each document attends only to its own tokens (block-causal attention, "
               "torchtitan's block_causal mask): the documents of a sequence train as they would alone")
      ->needs(pack);
  app.add_option("--global-batch", options.global_batch, "sequences per step over all ranks (any world size)")
      ->check(apps::integer_at_least(1));
  auto* steps = app.add_option("--steps", options.steps, "optimizer steps")->check(apps::integer_at_least(1));
  app.add_option("--epochs", options.epochs, "passes over the corpus (when --steps is not given)")
      ->check(apps::integer_at_least(1))
      ->excludes(steps);
  app.add_option("--lr", options.lr, "peak learning rate")->check(apps::number_at_least(0));
  app.add_option("--warmup-steps", options.warmup_steps,
                 "linear warm-up from 0.1 x lr (default: a tenth of the steps)")
      ->check(apps::integer_at_least(0));
  app.add_option("--lr-decay", options.lr_decay,
                 "how the lr falls after the warm-up (and the stable part): cosine annealing, or linearly")
      ->check(apps::one_of({"cosine", "linear"}));
  app.add_option(
         "--decay-ratio", options.decay_ratio,
         "the last fraction of the steps after the warm-up over which the lr decays, holding at its peak "
         "before them (warm-up-stable-decay; default 1: all of them)")
      ->check(apps::number_at_least(0, true));
  app.add_option("--min-lr-factor", options.min_lr_factor, "the lr the decay ends at, as a fraction of --lr")
      ->check(apps::number_at_least(0));
  app.add_option("--optimizer", options.optimizer,
                 "adamw, or sgd (no second moment: 4 bytes of state per element with momentum, none without)")
      ->check(apps::one_of({"adamw", "sgd"}));
  app.add_option("--momentum", options.momentum, "--optimizer sgd's momentum (default 0.9; 0: none)")
      ->check(apps::number_at_least(0));
  app.add_option("--weight-decay", options.weight_decay,
                 "AdamW's decoupled weight decay, SGD's L2 weight decay")
      ->check(apps::number_at_least(0));
  app.add_flag("--no-decay-norms", options.no_decay_norms, "put the norms in a group without weight decay");
  app.add_option("--clip", options.clip, "clip the global gradient norm to this")
      ->check(apps::number_at_least(0, true));
  app.add_option("--seed", options.seed, "seed of initialisation, shuffling and sampling")
      ->check(apps::integer_at_least(0));
  app.add_flag("--activation-checkpointing", options.activation_checkpointing,
               "recompute each decoder layer in backward instead of keeping its activations");
  app.add_flag("--cpu-offload", options.cpu_offload, "keep shards and optimizer state in host memory");
  app.add_option(
         "--tp", options.tp,
         "tensor-parallel ranks per group (consecutive ranks; they divide the world): the layers split "
         "over them, FSDP across the groups")
      ->check(apps::integer_at_least(1));
  auto* save_model =
      app.add_option("--save-model", options.save_model,
                     "write model.safetensors + config.json here (Hugging Face's LlamaForCausalLM "
                     "format)");
  app.add_option(
         "--save-model-max-file-size", options.save_model_max_file_size,
         "cut --save-model's weights into files of at most this many tensor bytes, "
         "model-0000k-of-0000n.safetensors with their index (save_pretrained's max_shard_size; K, M, G: "
         "powers of 1024)")
      ->check(apps::byte_count())
      ->needs(save_model);
  app.add_option("--save-model-dtype", options.save_model_dtype, "the dtype of --save-model's weights")
      ->check(apps::one_of({"f32", "bf16", "f16"}))
      ->needs(save_model);
  app.add_option("--init-from", options.init_from,
                 "start from a saved or Hugging Face Llama directory (its config)")
      ->excludes(config);
  auto* sample = app.add_option("--sample", options.samples, "print this many generated texts after training")
                     ->check(apps::integer_at_least(0));
  auto* sample_tokens =
      app.add_option("--sample-tokens", options.sample_tokens, "at most this many tokens per sample")
          ->check(apps::integer_at_least(1));
  app.add_flag(
         "--random-tokens", options.random_tokens,
         "train on uniform random token ids in [0, vocab_size) drawn from --seed, a fresh batch each step, "
         "no padding; no corpus or tokenizer is read (for speed comparisons)")
      ->needs(steps)
      ->excludes(data)
      ->excludes(tokenizer)
      ->excludes(separator)
      ->excludes(limit_documents)
      ->excludes(sample)
      ->excludes(sample_tokens)
      ->excludes(validation_split)
      ->excludes(validation_data)
      ->excludes(eval_every)
      ->excludes(pack);
}

}  // namespace

int main(int argc, char** argv) {
  return apps::training_main<Training, Options>(
      argc, argv, "train_llama",
      "train_llama: train the Llama on a text corpus, with FSDP over the ranks of mpirun", add_options);
}
