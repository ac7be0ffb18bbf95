// apps/train_llama: trains the Llama (models/llama.h) on a text corpus (Debian's fortunes by
// default) with FSDP over the ranks mpirun starts: one unit per decoder layer plus the root
// (embedding, final norm and head), as the FSDP2 article's script shards it. AdamW (0.9, 0.99, wd 0.1),
// linear warm-up from 0.1 then cosine to 0, gradient clipping at 1.0, cross-entropy that ignores
// [PAD]. Prints a progress bar with loss and tokens/s, writes per-step JSON-lines metrics, saves
// a Hugging Face directory, and can print a few samples after training.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>

#include "apps/cli.h"
#include "apps/training_support.h"
#include "autograd/functional.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/trace.h"
#include "data/bpe.h"
#include "data/loader.h"
#include "data/text_corpus.h"
#include "data/tokenizer.h"
#include "dist/checkpoint.h"
#include "dist/fsdp.h"
#include "dist/full_safetensors.h"
#include "dist/init.h"
#include "dist/log.h"
#include "models/generate.h"
#include "models/llama.h"
#include "optim/optimizer.h"
#include "optim/scheduler.h"

using namespace shardlab;

namespace {

struct Options {
  std::string config = "tiny";
  std::string tokenizer;  // default: --init-from's tokenizer.json, else bytes
  std::vector<std::string> data{"/usr/share/games/fortunes"};
  std::string separator = "%";
  std::int64_t limit_documents = 0;
  std::int64_t seq = 256;
  std::int64_t global_batch = 16;
  std::int64_t epochs = 1;
  std::int64_t steps = 0;  // 0: --epochs decides
  double lr = 1e-3;
  std::int64_t warmup_steps = -1;  // default: a tenth of the steps
  double weight_decay = 0.1;
  bool no_decay_norms = false;
  double clip = 1.0;
  std::uint64_t seed = 1;
  std::string sharding = "full";
  int prefetch = 1;
  std::string mixed_precision = "none";
  bool activation_checkpointing = false;
  bool cpu_offload = false;
  bool explain = false;
  bool profile = false;
  bool detect_anomaly = false;
  std::int64_t max_skipped_steps = 5;  // non-finite steps in a row before the run stops
  std::string metrics;
  std::string trace, trace_steps = "2:3";
  std::string save_model;
  std::string init_from;
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;  // 0: only at the end, when --checkpoint-dir is given
  std::int64_t keep = 2;
  bool resume = false;
  std::int64_t samples = 0;
  std::int64_t sample_tokens = 200;
  int threads = 0;
  std::string memory_limit;  // none by default: the CPU's memory is the host's, shared with everything else
};

// AdamW keeps exp_avg and exp_avg_sq in f32: what the plan counts as optimizer state.
constexpr std::int64_t kOptimizerStateBytesPerElement = 8;

// A preset's shape takes the tokenizer's vocabulary; a config file or a directory keeps its own.
bool takes_tokenizer_vocab(const Options& options) {
  return options.init_from.empty() && !options.config.ends_with(".json");
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

// The FSDP2 article's schedule: LinearLR from 0.1 over the warm-up, then cosine annealing to 0.
std::unique_ptr<optim::LRScheduler> make_schedule(optim::Optimizer& optimizer, std::int64_t total_steps,
                                                  std::int64_t warmup_steps) {
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  parts.push_back(std::make_unique<optim::LinearLR>(optimizer, 0.1, 1.0, warmup_steps));
  parts.push_back(std::make_unique<optim::CosineAnnealingLR>(
      optimizer, std::max<std::int64_t>(1, total_steps - warmup_steps)));
  return std::make_unique<optim::SequentialLR>(optimizer, std::move(parts),
                                               std::vector<std::int64_t>{warmup_steps});
}

bool is_norm(const std::string& name) { return name.ends_with("norm.weight"); }

// Everything a run needs, built (and checked) on every rank before the first step: errors
// thrown here are the same on all ranks.
class Training {
 public:
  Training(const Options& options, dist::Session& session);
  void run();

 private:
  struct StepResult {
    double loss = 0, grad_norm = 0, seconds = 0;
    bool skipped = false;  // a non-finite loss or gradient norm: no update
  };
  StepResult train_step(const data::Batch& batch);
  Variable forward_backward(const data::Batch& batch, double scale);
  void write_step_metrics(const StepResult& result);
  void save_and_sample();
  void save_checkpoint();
  void resume();
  nlohmann::json training_state() const;
  void report();

  const Options options_;
  dist::Session& session_;
  const int rank_, world_size_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  nlohmann::json tokenizer_document_;  // its tokenizer.json text, null for bytes
  models::LlamaConfig config_;
  std::optional<data::PretrainingDataset> corpus_;
  std::optional<data::DataLoader> loader_;
  std::int64_t data_bytes_ = 0;            // CPU bytes in use once the corpus is loaded
  std::int64_t model_bytes_baseline_ = 0;  // before the shards existed
  std::optional<models::Llama> model_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<optim::LRScheduler> scheduler_;
  dist::Plan plan_;
  std::optional<apps::PeakPrediction> predicted_;  // with --explain or --memory-limit
  std::int64_t peak_bytes_ = 0;                    // while training
  std::optional<apps::MetricsFile> metrics_;
  std::optional<apps::StepTrace> trace_;
  apps::StepProfile profile_{false};
  apps::CheckpointDir checkpoints_;
  apps::NonFiniteSteps non_finite_;
  std::int64_t total_steps_ = 0, step_ = 0;
  std::int64_t last_saved_step_ = -1;  // saved or resumed from: the end need not save it again
  std::vector<double> step_seconds_;   // every step after the first
  std::int64_t step_bytes_received_ = 0;
};

// The model with its parameters sharded over the ranks: drawn shard by shard (no rank holds the
// whole model), or loaded from a directory (each rank reads it and keeps its shards).
models::Llama sharded_llama(const Options& options, const models::LlamaConfig& config,
                            const dist::FsdpOptions& fsdp) {
  auto build = [&] {
    if (!options.init_from.empty()) {
      models::Llama model(config, options.seed);
      nn::Named<Shape> shapes;
      for (const auto& [name, p] : model->named_parameters()) shapes.emplace_back(name, p.shape());
      model->load_state_dict(models::load_pretrained_weights(options.init_from, shapes));
      return model;
    }
    const nn::DeferredInitGuard deferred;
    return models::Llama(config, options.seed);
  };
  models::Llama model = build();
  for (auto& layer : *model->model->layers) dist::fully_shard(*layer, fsdp);
  dist::FsdpOptions root = fsdp;
  root.mixed_precision.output_dtype = DType::f32;  // f32 logits for the loss
  dist::fully_shard(*model, root);
  if (options.activation_checkpointing) {
    nn::apply_activation_checkpointing(*model, [](const std::string&, nn::Module& module) {
      return dynamic_cast<models::LlamaDecoderLayerImpl*>(&module) != nullptr;
    });
  }
  return model;
}

Training::Training(const Options& options, dist::Session& session)
    : options_(options),
      session_(session),
      rank_(session.rank()),
      world_size_(session.world_size()),
      checkpoints_(options.checkpoint_dir, options.keep),
      non_finite_("train_llama", options.max_skipped_steps) {
  if (options.threads > 0) set_num_threads(options.threads);
  // Options first: a typo fails before the corpus loads.
  bpe_vocab(options.tokenizer);
  config_ = resolve_config(options);
  SHARDLAB_CHECK(options.seq <= config_.max_position_embeddings, "--seq {} exceeds the model's {} positions",
                 options.seq, config_.max_position_embeddings);
  const auto [sharding, group] = dist::parse_sharding(options.sharding);
  const dist::FsdpOptions fsdp{.sharding = sharding,
                               .hybrid_group_size = group,
                               .prefetch = options.prefetch,
                               .mixed_precision = apps::parse_mixed_precision(options.mixed_precision),
                               .cpu_offload = options.cpu_offload};
  const std::int64_t per_rank_batch = data::rank_batch_size(options.global_batch, world_size_, rank_);
  if (!options.save_model.empty())
    apps::check_output_path(session.cpu_world(), "--save-model", options.save_model, /*is_directory=*/true);
  if (!options.checkpoint_dir.empty())
    apps::check_output_path(session.cpu_world(), "--checkpoint-dir", options.checkpoint_dir,
                            /*is_directory=*/true);

  std::vector<std::string> documents = data::read_documents(options.data, options.separator);
  if (options.limit_documents > 0 && options.limit_documents < static_cast<std::int64_t>(documents.size())) {
    documents.resize(static_cast<std::size_t>(options.limit_documents));
  }
  const std::string tokenizer = !options.tokenizer.empty()  ? options.tokenizer
                                : options.init_from.empty() ? "bytes"
                                                            : data::directory_tokenizer(options.init_from);
  tokenizer_ = corpus_tokenizer(tokenizer, documents, session.cpu_world());
  tokenizer_document_ = tokenizer_document(*tokenizer_);
  if (takes_tokenizer_vocab(options)) config_.vocab_size = tokenizer_->vocab_size();
  SHARDLAB_CHECK(config_.vocab_size >= tokenizer_->vocab_size(),
                 "the model's vocab_size {} is smaller than the {} tokenizer's {} ids", config_.vocab_size,
                 tokenizer_->name(), tokenizer_->vocab_size());
  corpus_.emplace(documents, *tokenizer_, options.seq);
  loader_.emplace(data::rank_loader(corpus_->dataset(), {.size = options.global_batch,
                                                         .world_size = world_size_,
                                                         .rank = rank_,
                                                         .shuffle = true,
                                                         .seed = options.seed}));
  data_bytes_ = memory_stats(Device::cpu()).bytes_in_use;
  total_steps_ = options.steps > 0 ? options.steps : options.epochs * loader_->batches_per_epoch();
  SHARDLAB_CHECK(total_steps_ > 0, "nothing to train: {} documents give no batch of {}", documents.size(),
                 options.global_batch);
  const std::int64_t warmup =
      options.warmup_steps >= 0 ? options.warmup_steps : std::max<std::int64_t>(1, total_steps_ / 10);

  model_bytes_baseline_ = memory_stats(Device::cpu()).bytes_in_use;
  model_.emplace(sharded_llama(options, config_, fsdp));
  nn::Named<Variable> decayed, undecayed;
  for (auto& [name, shard] : dist::sharded_parameters(**model_)) {
    (options.no_decay_norms && is_norm(name) ? undecayed : decayed).emplace_back(name, shard);
  }
  std::vector<optim::ParamGroup> groups{{.parameters = decayed}};
  if (!undecayed.empty()) groups.push_back({.parameters = undecayed, .weight_decay = 0.0});
  optimizer_ = std::make_unique<optim::AdamW>(
      std::move(groups),
      optim::AdamWOptions{
          .lr = options.lr, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = options.weight_decay});
  scheduler_ = make_schedule(*optimizer_, total_steps_, std::max<std::int64_t>(1, warmup));
  plan_ = dist::explain(**model_, kOptimizerStateBytesPerElement);
  if (options.explain || !options.memory_limit.empty()) {
    const std::optional<std::int64_t> limit =
        options.memory_limit.empty() ? std::nullopt : apps::parse_bytes(options.memory_limit);
    predicted_ =
        apps::will_it_fit(session.cpu_world(), plan_, model_bytes_baseline_, per_rank_batch, limit,
                          {.global_batch = options.global_batch,
                           .world_size = world_size_,
                           .sharding = plan_.sharding,
                           .checkpointing_available = true,
                           .checkpointing = options.activation_checkpointing},
                          *optimizer_, [&](std::int64_t samples) {
                            const std::vector<std::int64_t> first = loader_->batch_indices(0).front();
                            forward_backward(loader_->batch({first.begin(), first.begin() + samples}), 1.0);
                          });
  }
  SHARDLAB_CHECK(!options.resume || !options.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  if (options.resume) resume();
  if (!options.metrics.empty()) metrics_.emplace(options.metrics, session.cpu_world());
  profile_ = apps::StepProfile(options.profile);
  trace_.emplace(
      options.trace,
      options.trace.empty() ? apps::TraceSteps{} : apps::parse_trace_steps(options.trace_steps, total_steps_),
      session.cpu_world());

  dist::log(
      "train_llama: {} documents, {} sequences of {} tokens ({} tokenizer, vocab {}), model {} with {} "
      "parameters, "
      "{} rank{} x {} threads, sharding {}, global batch {} ({}), {} steps, AdamW lr {:g}{}{}",
      documents.size(), corpus_->size(), options.seq, tokenizer_->name(), config_.vocab_size,
      options.init_from.empty() ? options.config : options.init_from, config_.parameter_count(), world_size_,
      world_size_ == 1 ? "" : "s", num_threads(), plan_.sharding, options.global_batch,
      apps::rank_shares(options.global_batch, world_size_), total_steps_, options.lr,
      options.mixed_precision == "none" ? "" : ", mixed precision " + options.mixed_precision,
      options.activation_checkpointing ? ", activation checkpointing" : "");
}

void Training::run() {
  if (options_.explain) {
    dist::log("{}{}", plan_.str(), predicted_->str());
    // What the FSDP2 article prints as param.placements: where rank 0's piece of each parameter lies.
    std::string shards = "rank 0's shards (parameter, shape: placement):\n";
    for (const auto& [name, shard] : dist::parameter_shards(**model_)) {
      shards += fmt::format("  {} {}: {}\n", name, shape_str(shard.full_shape), shard.placement);
    }
    dist::log("{}", shards);
  }
  apps::Progress progress("train", total_steps_, "tok/s", rank_ == 0);
  std::vector<double> recent_losses;  // the bar shows the mean of the last 10 steps
  // A resumed run continues in the epoch and at the batch where its checkpoint stopped: the
  // global batches depend only on (seed, epoch), never on the world size.
  const std::int64_t per_epoch = loader_->batches_per_epoch();
  reset_peak_memory(Device::cpu());
  for (std::int64_t epoch = step_ / per_epoch; step_ < total_steps_; ++epoch) {
    const auto batches = loader_->batch_indices(epoch);
    for (auto it = batches.begin() + (step_ - epoch * per_epoch); it != batches.end(); ++it) {
      if (step_ >= total_steps_) break;
      trace_->begin_step(step_ + 1);
      profile_.begin_step(step_ + 1);
      const data::Batch batch = [&] {
        const trace::Span span("load batch", "data");
        return loader_->batch(*it);
      }();
      const StepResult result = train_step(batch);
      profile_.end_step();
      trace_->end_step();
      ++step_;
      if (options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0) save_checkpoint();
      if (step_ > 1) step_seconds_.push_back(result.seconds);
      write_step_metrics(result);
      if (!result.skipped) recent_losses.push_back(result.loss);
      if (recent_losses.size() > 10) recent_losses.erase(recent_losses.begin());
      double recent = 0;
      for (const double loss : recent_losses) recent += loss;
      progress.update(step_, recent / static_cast<double>(std::max<std::size_t>(1, recent_losses.size())),
                      static_cast<double>(options_.global_batch * options_.seq) / result.seconds);
    }
  }
  peak_bytes_ = memory_stats(Device::cpu()).peak_bytes;
  if (!options_.checkpoint_dir.empty() && last_saved_step_ != step_) save_checkpoint();
  save_and_sample();
  report();
}

// What continuing exactly needs besides the shards and the optimizer: the step (which fixes the
// data cursor and the schedule), and what must not change between the runs.
nlohmann::json Training::training_state() const {
  return {{"app", "train_llama"},
          {"step", step_},
          {"scheduler_epoch", scheduler_->epoch()},
          {"seed", options_.seed},
          {"global_batch", options_.global_batch},
          {"seq", options_.seq},
          {"sequences", corpus_->size()},
          {"total_steps", total_steps_},
          {"config", config_.to_json()},
          {"tokenizer", tokenizer_->name()},
          {"tokenizer_json", tokenizer_document_}};
}

void Training::save_checkpoint() {
  checkpoints_.save(step_, **model_, *optimizer_, training_state(), "train_llama");
  last_saved_step_ = step_;
}

void Training::resume() {
  const apps::CheckpointDir::Resumed resumed = checkpoints_.resume(
      session_.cpu_world(), **model_, *optimizer_, training_state(),
      {"app", "seed", "global_batch", "seq", "sequences", "tokenizer_json", "config"}, "train_llama");
  step_ = resumed.state["step"].get<std::int64_t>();
  SHARDLAB_CHECK(step_ < total_steps_, "--resume: '{}' is at step {}, and --steps asks for {}", resumed.path,
                 step_, total_steps_);
  scheduler_->set_epoch(resumed.state.at("scheduler_epoch").get<std::int64_t>());
  last_saved_step_ = step_;
  dist::log("train_llama: resumed from {} (step {}), continuing to step {}", resumed.path, step_,
            total_steps_);
}

Training::StepResult Training::train_step(const data::Batch& batch) {
  const auto start = std::chrono::steady_clock::now();
  // The loss is the mean over the global batch's non-padding targets: each rank sums its own and
  // divides by the global count, so any number of ranks computes the 1-process loss.
  const double local_targets = sum(ne(batch.targets, tokenizer_->pad_id()).to(DType::i64)).item<double>();
  const double targets = apps::sum_over_ranks(session_.cpu_world(), {local_targets})[0];
  dist::reset_collective_counters(**model_);
  // FSDP averages gradients over the ranks: scaled by W, the average is the global mean's gradient.
  const Variable loss_sum =
      forward_backward(batch, static_cast<double>(world_size_) / std::max(targets, 1.0));
  // FSDP's collectives of the step, what the plan predicts (clipping's all-reduce comes after).
  step_bytes_received_ = dist::collective_counters(**model_).total().bytes_received;
  StepResult result;
  result.loss = apps::sum_over_ranks(session_.cpu_world(), {loss_sum.data().item<double>()})[0] /
                std::max(targets, 1.0);
  result.grad_norm = dist::clip_grad_norm_(**model_, options_.clip);
  result.skipped = non_finite_.skip(step_ + 1, result.loss, result.grad_norm, checkpoints_);
  if (!result.skipped) {
    const trace::Span span("optimizer step", "compute");
    optimizer_->step();
  }
  scheduler_->step();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// The loss summed over the batch's targets, and the gradients of `scale` times it.
Variable Training::forward_backward(const data::Batch& batch, double scale) {
  // The root's all-gather first, as the FSDP2 article's model.unshard(): it overlaps preparing the step.
  dist::UnshardHandle gathering = dist::unshard(**model_);
  const Tensor padding = eq(batch.inputs, tokenizer_->pad_id());
  optimizer_->zero_grad();
  gathering.wait();
  const Variable logits = (*model_)(batch.inputs, padding);
  const Variable loss_sum = cross_entropy(reshape(logits, {-1, config_.vocab_size}),
                                          batch.targets.reshape({-1}), tokenizer_->pad_id(), Reduction::sum);
  (loss_sum * scale).backward();
  return loss_sum;
}

void Training::write_step_metrics(const StepResult& result) {
  if (!metrics_) return;
  const MemoryStats memory = memory_stats(Device::cpu());
  metrics_->write(
      {{"rank", rank_},
       {"step", step_},
       {"loss", result.loss},
       {"lr", optimizer_->lr()},
       {"grad_norm", result.grad_norm},
       {"skipped", result.skipped},
       {"tokens_per_second", static_cast<double>(options_.global_batch * options_.seq) / result.seconds},
       {"step_seconds", result.seconds},
       {"memory_bytes", memory.bytes_in_use},
       {"peak_memory_bytes", memory.peak_bytes}});
}

// --save-model: every rank writes its own shards into model.safetensors (a collective; no rank
// holds the whole model) and rank 0 writes config.json. --sample needs the full parameters:
// gathered on every rank (a collective), then rank 0 samples from an unsharded copy.
void Training::save_and_sample() {
  if (!options_.save_model.empty()) {
    const auto start = std::chrono::steady_clock::now();
    apps::on_rank_zero(session_.cpu_world(), fmt::format("writing '{}'", options_.save_model), [&] {
      models::save_pretrained_config(options_.save_model, config_);  // creates the directory
      if (!tokenizer_document_.is_null()) {
        dynamic_cast<const data::BpeTokenizer&>(*tokenizer_).save(options_.save_model + "/tokenizer.json");
      }
    });
    dist::save_full_safetensors(models::pretrained_weights_path(options_.save_model), **model_);
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

void Training::report() {
  const double median_seconds = apps::median(step_seconds_);
  const double tokens_per_second =
      median_seconds > 0 ? static_cast<double>(options_.global_batch * options_.seq) / median_seconds : 0;
  dist::log("train_llama: median step {:.1f} ms, {:.0f} tokens/s ({} steps, the first excluded)",
            1e3 * median_seconds, tokens_per_second, step_seconds_.size());
  non_finite_.report();
  // The plan counts the sharded state; the rotary tables are replicated buffers, the same on every rank.
  std::int64_t buffer_bytes = 0;
  for (const auto& [name, buffer] : (*model_)->named_buffers())
    buffer_bytes += buffer.numel() * static_cast<std::int64_t>(buffer.element_size());
  const std::int64_t persistent =
      memory_stats(Device::cpu()).bytes_in_use - model_bytes_baseline_ - buffer_bytes;
  dist::log(
      "train_llama: rank 0 persistent model state: measured {} B (besides {} B of buffers), planned {} B + "
      "{} step "
      "counters of 8 B",
      persistent, buffer_bytes, plan_.total_persistent_bytes(), dist::sharded_parameters(**model_).size());
  dist::log("train_llama: rank 0 peak of gathered parameters: measured {} B, planned {} B",
            dist::unsharded_memory().peak_bytes, plan_.peak_unsharded_bytes());
  if (predicted_) {
    dist::log("train_llama: rank 0 {}", apps::peak_report(*predicted_, peak_bytes_));
  }
  trace_->report("train_llama", metrics_ ? &*metrics_ : nullptr);
  profile_.report("train_llama", metrics_ ? &*metrics_ : nullptr, rank_);
  dist::log("train_llama: rank 0 collectives of the last step: received {} B, planned {} B",
            step_bytes_received_, plan_.bytes_per_step());
  if (metrics_) {
    metrics_->write({{"rank", rank_},
                     {"steps", step_},
                     {"skipped_steps", non_finite_.skipped()},
                     {"median_step_seconds", median_seconds},
                     {"tokens_per_second", tokens_per_second},
                     {"peak_memory_bytes", memory_stats(Device::cpu()).peak_bytes},
                     {"data_bytes", data_bytes_},
                     {"persistent_bytes", plan_.total_persistent_bytes()},
                     {"measured_persistent_bytes", persistent},
                     {"step_counters", dist::sharded_parameters(**model_).size()},
                     {"unsharded_peak_bytes", dist::unsharded_memory().peak_bytes},
                     {"planned_unsharded_peak_bytes", plan_.peak_unsharded_bytes()},
                     {"step_bytes_received", step_bytes_received_},
                     {"planned_step_bytes", plan_.bytes_per_step()},
                     {"plan", apps::plan_json(plan_)},
                     {"train_peak_memory_bytes", peak_bytes_},
                     {"predicted_peak", predicted_ ? apps::prediction_json(*predicted_) : nlohmann::json()}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::unique_ptr<dist::Session> session = apps::start_cpu_session(argc, argv, "train_llama");
  if (!session) return 1;
  const int rank = session->rank();

  Options options;
  CLI::App app{"train_llama: train the Llama on a text corpus, with FSDP over the ranks of mpirun"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // later flags win
  auto* config =
      app.add_option("--config", options.config, "tiny, small, 1b, or a Hugging Face config.json file");
  app.add_option(
      "--tokenizer", options.tokenizer,
      "bytes (256 byte ids + [BOT], [EOT], [PAD]), bpe:VOCAB (byte-level BPE learned from the "
      "corpus), or a Hugging Face tokenizer.json (default: --init-from's tokenizer.json, else bytes)");
  app.add_option("--data", options.data, "text files or directories of them (default: Debian's fortunes)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--separator", options.separator, "the line that separates documents in a file");
  app.add_option("--limit-documents", options.limit_documents, "use only the first N documents")
      ->check(apps::integer_at_least(0));
  app.add_option("--seq", options.seq, "tokens per sequence")->check(apps::integer_at_least(1));
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
  app.add_option("--weight-decay", options.weight_decay, "AdamW's decoupled weight decay")
      ->check(apps::number_at_least(0));
  app.add_flag("--no-decay-norms", options.no_decay_norms, "put the norms in a group without weight decay");
  app.add_option("--clip", options.clip, "clip the global gradient norm to this")
      ->check(apps::number_at_least(0, true));
  app.add_option("--seed", options.seed, "seed of initialisation, shuffling and sampling")
      ->check(apps::integer_at_least(0));
  app.add_option("--sharding", options.sharding, "full, grad_op, none or hybrid:G (G ranks per shard group)");
  app.add_option("--prefetch", options.prefetch, "units whose all-gather is issued ahead")
      ->check(apps::integer_at_least(0));
  app.add_option("--mixed-precision", options.mixed_precision,
                 "none, or bf16 (bf16 gathers and compute, f32 reductions and master shards)");
  app.add_flag("--activation-checkpointing", options.activation_checkpointing,
               "recompute each decoder layer in backward instead of keeping its activations");
  app.add_flag("--cpu-offload", options.cpu_offload, "keep shards and optimizer state in host memory");
  app.add_flag("--explain", options.explain, "print the FSDP plan (units, bytes, traffic) before step 1");
  app.add_flag("--profile", options.profile,
               "time every kernel per op over the steps after the first and print where a step goes");
  apps::add_numerics_options(app, options.detect_anomaly, options.max_skipped_steps);
  app.add_option("--metrics", options.metrics, "write JSON lines of every rank's metrics to this file");
  auto* trace =
      app.add_option("--trace", options.trace,
                     "write a Chrome/Perfetto trace per rank and the merged trace.json into this directory");
  app.add_option("--trace-steps", options.trace_steps,
                 "the steps --trace records, FIRST:LAST (from 1, both included)")
      ->needs(trace);
  app.add_option("--save-model", options.save_model,
                 "write model.safetensors + config.json here (Hugging Face's LlamaForCausalLM format)");
  app.add_option("--init-from", options.init_from,
                 "start from a saved or Hugging Face Llama directory (its config)")
      ->excludes(config);
  app.add_option("--checkpoint-dir", options.checkpoint_dir,
                 "save sharded checkpoints here (DIR/step-N), at the end and every --checkpoint-every steps");
  app.add_option("--checkpoint-every", options.checkpoint_every,
                 "steps between checkpoints (0: only at the end)")
      ->check(apps::integer_at_least(0));
  app.add_option("--keep", options.keep, "keep the newest K checkpoints")->check(apps::integer_at_least(1));
  app.add_flag(
      "--resume", options.resume,
      "continue from the newest complete checkpoint in --checkpoint-dir (any world size or sharding)");
  app.add_option("--memory-limit", options.memory_limit,
                 "refuse before step 1 a run whose predicted peak per rank exceeds BYTES (512M, 2G)")
      ->check(apps::byte_count());
  app.add_option("--sample", options.samples, "print this many generated texts after training")
      ->check(apps::integer_at_least(0));
  app.add_option("--sample-tokens", options.sample_tokens, "at most this many tokens per sample")
      ->check(apps::integer_at_least(1));
  app.add_option("--threads", options.threads,
                 "CPU threads per rank (default: the cores this process may use)")
      ->check(apps::integer_at_least(0));
  // --help and usage errors, printed once.
  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "train_llama", rank == 0))
    return *status;

  return apps::build_and_run<Training>("train_llama", *session, options);
}
