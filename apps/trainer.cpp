// apps/trainer.cpp: the shared flags and the Trainer's epochs, steps, checkpoints and report.
#include "apps/trainer.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <numeric>
#include <optional>

#include "apps/support/calibration.h"
#include "apps/support/memory_limit.h"
#include "apps/support/ranks.h"
#include "apps/support/resident_memory.h"
#include "apps/support/stop_signals.h"
#include "autograd/batch_chunks.h"
#include "autograd/ops.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/exact_sum.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/trace.h"
#include "dist/checkpoint/checkpoint.h"
#include "dist/comm/log.h"

namespace shardlab::apps {

void add_trainer_options(CLI::App& app, TrainerOptions& options) {
  app.add_option("--sharding", options.sharding,
                 "full (ZeRO-3), grad_op (ZeRO-2), optimizer (ZeRO-1), none (DDP) or hybrid:G (G ranks per "
                 "shard group)");
  app.add_option("--prefetch", options.prefetch, "units whose all-gather is issued ahead")
      ->check(integer_at_least(0));
  app.add_option(
         "--reshard-after-forward-group", options.reshard_after_forward_group,
         "after forward keep each unit sharded over groups of G ranks (FSDP2's reshard_after_forward=G), "
         "so backward gathers inside the group; 0: free it (full, hybrid)")
      ->check(integer_at_least(0));
  app.add_option("--mixed-precision", options.mixed_precision,
                 "none, or bf16 (bf16 gathers and compute, f32 reductions and master shards)");
  auto* explain = app.add_flag(
      "--explain", options.explain,
      "print the FSDP plan (units, bytes, traffic), the training peak and the step time before step 1");
  app.add_flag("--recalibrate", options.recalibrate,
               "measure the device's rates for --explain's step time again (they are kept per machine and "
               "build)")
      ->needs(explain);
  auto* world_size =
      app.add_option("--world-size", options.world_size,
                     "predict this run on N ranks (rank 0's plan, peak and step time) and train nothing")
          ->check(integer_at_least(1))
          ->needs(explain);
  const auto assumed = [&](const char* name, std::optional<double>& value, const char* what, bool positive) {
    return app.add_option(name, value, what)->check(number_at_least(0, positive))->needs(explain);
  };
  assumed("--peak-tflops", options.peak_tflops,
          "--explain's step time with dense kernels (GEMMs, convolutions, attention) at this rate, not the "
          "measured one",
          true);
  assumed("--memory-bandwidth", options.memory_bandwidth,
          "--explain's step time with memory at this many GB/s (the optimizer's update timed by its bytes)",
          true);
  assumed("--launch-overhead", options.launch_overhead,
          "--explain's step time with this many microseconds a kernel call", false);
  auto* link_bandwidth = assumed("--link-bandwidth", options.link_bandwidth,
                                 "--explain's step time with collectives sending this many GB/s per rank "
                                 "(a ring's bus bandwidth), not slowing compute",
                                 true);
  auto* link_latency = assumed("--link-latency", options.link_latency,
                               "--link-bandwidth's latency a collective, microseconds", false);
  link_bandwidth->needs(link_latency);
  link_latency->needs(link_bandwidth);
  app.add_flag("--profile", options.profile,
               "time every kernel per op over the steps after the first and print where a step goes");
  app.add_flag(
      "--detect-anomaly", options.detect_anomaly,
      "check every op's result for NaN and every gradient for NaN/Inf; the first names the op (slow)");
  app.add_option(
         "--max-skipped-steps", options.max_skipped_steps,
         "skip a step whose loss or gradient norm is not finite (no update); stop after more than N in a "
         "row, naming the checkpoint to resume from (0: stop at the first)")
      ->check(integer_at_least(0));
  app.add_option("--metrics", options.metrics, "write JSON lines of every rank's metrics to this file");
  auto* trace =
      app.add_option("--trace", options.trace,
                     "write a Chrome/Perfetto trace per rank and the merged trace.json into this directory");
  app.add_option("--trace-steps", options.trace_steps,
                 "the steps --trace records, FIRST:LAST (from 1, both included)")
      ->needs(trace);
  auto* checkpoint_dir = app.add_option(
      "--checkpoint-dir", options.checkpoint_dir,
      "save sharded checkpoints here (DIR/step-N), at the end and every --checkpoint-every steps");
  app.add_option("--checkpoint-every", options.checkpoint_every,
                 "steps between checkpoints (0: only at the end)")
      ->check(integer_at_least(0));
  app.add_option("--keep", options.keep, "keep the newest K checkpoints")->check(integer_at_least(1));
  auto* async_checkpoint =
      app.add_flag("--async-checkpoint", options.async_checkpoint,
                   "write --checkpoint-every's checkpoints in the background: training waits only while each "
                   "rank copies its pieces into host memory")
          ->needs(checkpoint_dir);
  app.add_option("--checkpoint-staging", options.checkpoint_staging,
                 "host memory per rank for --async-checkpoint's copy (pieces beyond it are written before "
                 "training goes on)")
      ->check(byte_count())
      ->needs(async_checkpoint);
  app.add_flag(
      "--resume", options.resume,
      "continue from the newest complete checkpoint in --checkpoint-dir (any world size or sharding)");
  app.add_option("--memory-limit", options.memory_limit,
                 "refuse before step 1 a run whose predicted peak per rank exceeds BYTES (512M, 2G)")
      ->check(byte_count())
      ->excludes(world_size);
  app.add_option("--threads", options.threads,
                 "CPU threads per rank (default: the cores this process may use)")
      ->check(integer_at_least(0));
  app.add_option("--device", options.device,
                 "auto (a GPU per rank where every rank has one, else the CPU), cpu or cuda")
      ->check(one_of({"auto", "cpu", "cuda"}));
  app.add_flag("--share-gpu", options.share_gpu,
               "let more ranks than GPUs share them, their collectives through MPI and host memory (for "
               "testing on one GPU)");
  auto* bitwise =
      app.add_flag("--bitwise", options.bitwise,
                   "the same bits at any world size and sharding: the global batch in fixed chunks, "
                   "gradients, loss and norm summed exactly (CPU)")
          ->excludes(world_size);
  auto* micro_batches =
      app.add_option("--micro-batches", options.micro_batches,
                     "gradient accumulation: each rank's share of a global batch in K forward and backward "
                     "passes before one optimizer step (the activations of 1/K of it)")
          ->check(integer_at_least(1));
  app.add_option("--micro-batch-sync", options.micro_batch_sync,
                 "how --micro-batches reduce: every (each into the gradient shards), reduce-scatter (each "
                 "reduce-scatters, the all-reduce over replicas waits for the last: hybrid, none), last (only "
                 "the last; the others keep unsharded gradients). Default: every, with --bitwise last")
      ->check(one_of({"every", "reduce-scatter", "last"}))
      ->needs(micro_batches);
  app.add_option("--chunk", options.chunk,
                 "--bitwise's samples per chunk, dividing the global batch (default: its largest divisor at "
                 "most a quarter of it)")
      ->check(integer_at_least(1))
      ->needs(bitwise);
}

std::int64_t bitwise_chunk(const TrainerOptions& options) {
  if (options.chunk > 0) return options.chunk;
  std::int64_t chunk = 1;
  for (std::int64_t d = 1; d <= options.global_batch / 4; ++d)
    if (options.global_batch % d == 0) chunk = d;
  return chunk;
}

dist::Accumulation accumulation_of(const TrainerOptions& options) {
  if (options.micro_batch_sync.empty())
    return {.micro_batches = options.micro_batches,
            .sync = options.bitwise ? dist::MicroBatchSync::last : dist::MicroBatchSync::every};
  const dist::MicroBatchSync sync = dist::parse_micro_batch_sync(options.micro_batch_sync);
  SHARDLAB_CHECK(options.micro_batches > 1,
                 "--micro-batch-sync {}: a step of one micro-batch (--micro-batches 1) reduces once either way",
                 options.micro_batch_sync);
  SHARDLAB_CHECK(!options.bitwise || sync == dist::MicroBatchSync::last,
                 "--micro-batch-sync {}: --bitwise adds every micro-batch into one exact sum and reduces it "
                 "once (--micro-batch-sync last); a reduction per micro-batch would round each",
                 options.micro_batch_sync);
  return {.micro_batches = options.micro_batches, .sync = sync};
}

dist::InitOptions init_options(const TrainerOptions& options) {
  return {.device = parse_device_choice(options.device), .share_gpu = options.share_gpu};
}

dist::MixedPrecision parse_mixed_precision(const std::string& text) {
  if (text == "none") return {};
  if (text == "bf16") return {.param_dtype = DType::bf16, .reduce_dtype = DType::f32};
  fail("--mixed-precision: '{}' is not one of none, bf16", text);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

Trainer::Trainer(const char* program, const TrainerOptions& options, dist::Session& session,
                 bool save_model_is_directory)
    : program_(program),
      common_(options),
      session_(session),
      rank_(session.rank()),
      world_size_(session.world_size()),
      device_(session.device()),
      chunk_(options.bitwise ? bitwise_chunk(options) : 0),
      accumulation_(accumulation_of(options)),
      checkpoints_(options.checkpoint_dir, options.keep),
      non_finite_(program, options.max_skipped_steps) {
  if (options.threads > 0) set_num_threads(options.threads);
  if (options.async_checkpoint) saver_.emplace(*parse_bytes(options.checkpoint_staging));
  const auto [sharding, group] = dist::parse_sharding(options.sharding);
  fsdp_ = {.sharding = sharding,
           .hybrid_group_size = group,
           .reshard_after_forward_group = options.reshard_after_forward_group,
           .prefetch = options.prefetch,
           .mixed_precision = parse_mixed_precision(options.mixed_precision),
           .bitwise = options.bitwise};
  if (options.world_size > 0) {
    what_if_ = dist::PlanAt{.world_size = options.world_size,
                            .sharding = sharding,
                            .hybrid_group_size = group,
                            .reshard_after_forward_group = options.reshard_after_forward_group};
    fsdp_.sharding = dist::Sharding::full;
    fsdp_.hybrid_group_size = 0;
    fsdp_.reshard_after_forward_group = 0;
  }
  if (options.bitwise) {
    SHARDLAB_CHECK(!device_.is_cuda(),
                   "--bitwise: its exact sums run on the CPU, and this run is on {} (--device cpu)",
                   device_.str());
    data::chunk_share(options.global_batch, {.world_size = world_size_, .rank = rank_, .chunk = chunk_});
  }
  if (!options.save_model.empty())
    check_output_path(session.cpu_world(), "--save-model", options.save_model, save_model_is_directory);
  if (!options.checkpoint_dir.empty())
    check_output_path(session.cpu_world(), "--checkpoint-dir", options.checkpoint_dir, /*is_directory=*/true);
}

void Trainer::start(const Setup& setup) {
  setup_ = setup;
  epoch_ = setup.first_epoch;
  plan_ = dist::explain(*setup.root, setup.optimizer_state_bytes_per_element);
  plan_.accumulation = accumulation_;
  if (what_if_) {
    check_accumulation(what_if_plan(), what_if_->world_size);
  } else {
    check_accumulation(plan_, data_parallel_ranks().size());
  }
  // Registered after FSDP's hooks, so it runs once the root's forward is over and every other unit
  // resharded: what it sees stays gathered until backward.
  setup.root->register_forward_hook([held = held_after_forward_](nn::Module&, Variable&) {
    if (is_grad_enabled()) *held = std::max(*held, dist::unsharded_memory().bytes);
  });
  if (common_.explain) {
    const dist::CheckpointPreview checkpoint = dist::preview_checkpoint(*setup.root, *setup.optimizer);
    checkpoint_preview_ = fmt::format(
        "a checkpoint: {} in rank files (the largest {}), metadata.json about {} ({} chunks of {} runs)\n",
        dist::bytes_text(checkpoint.file_bytes), dist::bytes_text(checkpoint.largest_file_bytes),
        dist::bytes_text(checkpoint.metadata_bytes), checkpoint.chunks, checkpoint.runs);
  }
  if (common_.explain || !common_.memory_limit.empty()) {
    const std::optional<std::int64_t> limit =
        common_.memory_limit.empty() ? std::nullopt : parse_bytes(common_.memory_limit);
    dist::Communicator& data_parallel = data_parallel_ranks();
    const FitLevers levers{.global_batch = common_.global_batch,
                           .world_size = world_size_,
                           .data_ranks = data_parallel.size(),
                           .sharding = plan_.sharding,
                           .checkpointing_available = setup.checkpointing_available,
                           .checkpointing = setup.checkpointing,
                           .device = device_,
                           .micro_batches = accumulation_.micro_batches,
                           .rank_batch = what_if_ ? rank_rows(what_if_->world_size, 0)
                                                  : rank_rows(data_parallel.size(), 0)};
    // A what-if measures its activations at its own rank 0's samples; with accumulation, a micro-batch's.
    const std::int64_t micro_batch =
        micro_batch_parts(what_if_ ? rank_rows(what_if_->world_size, 0)
                                   : rank_rows(data_parallel.size(), data_parallel.rank()))
            .front()
            .count;
    const auto run_dry = [&](std::int64_t samples) {
      // This rank's first batches: a what-if of fewer ranks takes more samples than one holds.
      std::vector<std::int64_t> first;
      for (const std::vector<std::int64_t>& batch : setup.loader->batch_indices(setup.first_epoch)) {
        if (std::ssize(first) >= samples) break;
        first.insert(first.end(), batch.begin(), batch.end());
      }
      SHARDLAB_CHECK(std::ssize(first) >= samples,
                     "--explain: a dry step of {} samples, and this rank's epoch holds {}", samples,
                     first.size());
      std::optional<autograd::BatchChunking> chunking;  // bitwise units take gradients in parts only
      if (chunk_ > 0)
        chunking.emplace(autograd::BatchChunks{.samples = samples, .chunk = std::gcd(samples, chunk_)});
      dry_run(batch_on_device({first.begin(), first.begin() + samples}));
    };
    // With micro-batches the peak is a later one's, over the gradients the earlier ones reduced or kept:
    // a dry pass leaves them first.
    const auto run_dry_step = [&](std::int64_t samples) {
      if (accumulation_.micro_batches > 1) {
        sync_micro_batch(/*last=*/false);
        run_dry(samples);
        sync_micro_batch(/*last=*/true);
      }
      run_dry(samples);
    };
    predicted_ = will_it_fit(session_.cpu_world(), plan_, model_bytes_baseline_, micro_batch, limit, levers,
                             *setup.optimizer, run_dry_step);
    if (what_if_) {
      predict_what_if(micro_batch, run_dry);
    } else if (common_.explain) {
      predict_step_time(plan_, micro_batch, run_dry);
    }
  }
  SHARDLAB_CHECK(!common_.resume || !common_.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  SHARDLAB_CHECK(common_.checkpoint_every == 0 || !common_.checkpoint_dir.empty(),
                 "--checkpoint-every needs --checkpoint-dir");
  if (common_.resume) resume(setup.unchanged);
  // A resumed run continues the file: one loss curve across the runs of a job.
  if (!common_.metrics.empty()) metrics_.emplace(common_.metrics, session_.cpu_world(), common_.resume);
  profile_ = StepProfile(common_.profile);
  trace_.emplace(
      common_.trace,
      common_.trace.empty() ? TraceSteps{} : parse_trace_steps(common_.trace_steps, setup.total_steps),
      session_.cpu_world());
}

Trainer::End Trainer::run() {
  if (what_if_) {
    dist::log("{}", what_if_text_);
    if (metrics_) metrics_->write({{"rank", rank_}, {"what_if", what_if_json_}});
    return End::finished;
  }
  if (setup_.evaluate_only) {
    evaluate();
    return End::finished;
  }
  if (common_.explain)
    dist::log("{}{}{}{}{}", plan_.str(), predicted_->str(), step_time_text_, checkpoint_preview_,
              bitwise_preview());
  begin_training();
  while (epoch_ <= setup_.last_epoch && step_ < setup_.total_steps) {
    const bool complete = train_epoch();
    settle_steps();
    end_epoch(complete);
    if (!complete) break;
    ++epoch_;
  }
  if (setup_.evaluate && stopped_by_ == 0 && evaluated_at_ != step_) evaluate();
  // A save in flight counts before the last one (and before the program ends on a stop signal).
  if (saver_) note_committed(saver_->finish(), stopped_by_ != 0 ? "at the stop" : "at the end");
  if (!common_.checkpoint_dir.empty() && last_saved_ != state()) save_checkpoint();
  if (stopped_by_ != 0) {
    report_stop();
    report();
    return End::stopped_by_signal;
  }
  finish();
  report();
  return End::finished;
}

// The rest of epoch_ (a resumed run goes on at the batch where its checkpoint stopped); false
// when the run's last step came first.
bool Trainer::train_epoch() {
  begin_epoch();
  reset_peak_memory(device_);
  const auto batches = setup_.loader->batch_indices(epoch_);
  const std::int64_t done = step_ - (epoch_ - setup_.first_epoch) * setup_.loader->batches_per_epoch();
  bool complete = true;
  for (auto it = batches.begin() + done; it != batches.end(); ++it) {
    if (step_ >= setup_.total_steps || stop_requested()) {
      complete = false;
      break;
    }
    if (saver_) note_committed(saver_->poll(), "");
    train_step(*it);
  }
  peak_bytes_ = std::max(peak_bytes_, memory_stats(device_).peak_bytes);
  return complete;
}

bool Trainer::stop_requested() {
  const int mine = StopSignals::received();
  // Per signal, the ranks it reached: any rank's signal stops them all; the first of the list names it.
  const std::vector<int> signals = {SIGTERM, SIGINT, SIGUSR1};
  std::vector<double> reached;
  for (const int signal : signals) reached.push_back(mine == signal ? 1.0 : 0.0);
  reached = sum_over_ranks(session_.cpu_world(), reached, "stop request");
  for (std::size_t i = 0; i < signals.size() && stopped_by_ == 0; ++i)
    stopped_by_ = reached[i] > 0 ? signals[i] : 0;
  return stopped_by_ != 0;
}

void Trainer::report_stop() const {
  const bool saved = !common_.checkpoint_dir.empty();
  const std::string checkpoint = saved ? checkpoints_.path(step_) : std::string();
  dist::log("{}: stopped by {} after step {}: {}", program_, signal_name(stopped_by_), step_,
            saved ? fmt::format("checkpoint {} saved, continue with --resume", checkpoint)
                  : std::string("nothing saved (no --checkpoint-dir)"));
  if (metrics_)
    metrics_->write({{"rank", rank_},
                     {"stopped_by", signal_name(stopped_by_)},
                     {"step", step_},
                     {"checkpoint", saved ? nlohmann::json(checkpoint) : nlohmann::json()}});
}

data::Batch Trainer::batch_on_device(const std::vector<std::int64_t>& indices) const {
  return data::to_device(setup_.loader->batch(indices), device_);
}

std::optional<HostWaitsForbidden> Trainer::forbid_host_waits(const char* what) const {
  if (device_.is_cuda() && (session_.world().backend_name() != "nccl" || fsdp_.cpu_offload))
    return std::nullopt;
  return std::optional<HostWaitsForbidden>(std::in_place, what);
}

// One step, in the order of PyTorch's loop. Around it, not inside: the step's trace, profile, time
// and host waits (begin_step, end_step), the refusal of host waits on a GPU (forbid_host_waits), and
// the lagged read of the loss and norm: this step's are queued for the host and the previous step's
// read meanwhile (settle_steps), so that no step waits for its own values.
void Trainer::train_step(const std::vector<std::int64_t>& indices) {
  const StepClock clock = begin_step();
  data::Batch on_host;
  {
    const trace::Span span("load batch", "data");
    on_host = setup_.loader->batch(indices);
  }
  LossTotal total;
  Tensor grad_norm;
  {
    const double samples = global_samples(on_host);  // a collective of its own, before FSDP's are counted
    const auto no_waits = forbid_host_waits("forward and backward");
    dist::reset_collective_counters(*setup_.root);
    setup_.optimizer->zero_grad();
    total = forward_backward(on_host, samples);
    // Every collective of the units (hybrid sharding's groups too): what the plan predicts.
    step_bytes_received_ = dist::collective_counters(*setup_.root).total().bytes_received;
    grad_norm = clip_gradients();
  }
  const Tensor finite = queue_for_host(total, grad_norm);
  settle_steps();  // the previous step's values, before this step's update is queued
  {
    const trace::Span span("optimizer step", "compute");
    const auto no_waits = forbid_host_waits("optimizer step");
    setup_.optimizer->step_if(finite);  // on every rank alike, no update where either is not finite
  }
  if (setup_.scheduler != nullptr) setup_.scheduler->step();
  end_step(clock);
  if (common_.checkpoint_every > 0 && step_ % common_.checkpoint_every == 0)
    save_checkpoint(/*in_background=*/true);
  if (setup_.evaluate && setup_.evaluate_every > 0 && step_ % setup_.evaluate_every == 0) evaluate();
}

void Trainer::evaluate() {
  settle_steps();
  const trace::Span span("evaluate", "evaluate");
  setup_.evaluate();
  evaluated_at_ = step_;
}

Trainer::LossTotal Trainer::forward_backward(const data::Batch& on_host, double samples) {
  const std::vector<data::ChunkShare> parts = micro_batch_parts(on_host.inputs.size(0));
  LossTotal total;
  for (std::size_t part = 0; part < parts.size(); ++part) {
    data::Batch batch;
    {
      const trace::Span span("load batch", "data");
      batch = data::to_device(parts.size() == 1 ? on_host : data::rows_of(on_host, parts[part]), device_);
    }
    sync_micro_batch(/*last=*/part + 1 == parts.size());
    StepLoss loss;
    {
      std::optional<autograd::BatchChunking> chunking;  // the ops keep it for their backward
      if (chunk_ > 0) chunking.emplace(autograd::BatchChunks{.samples = parts[part].count, .chunk = chunk_});
      loss = forward_loss(batch, samples);
    }
    total.add(loss, backward(loss), chunk_ > 0);
  }
  return total;
}

bool Trainer::keeps_gradients() const {
  return accumulation_.micro_batches > 1 && accumulation_.sync != dist::MicroBatchSync::every;
}

void Trainer::sync_micro_batch(bool last) const {
  if (!keeps_gradients()) return;
  if (accumulation_.sync == dist::MicroBatchSync::last) {
    dist::set_requires_gradient_sync(*setup_.root, last);
  } else {
    dist::set_requires_all_reduce(*setup_.root, last);
  }
}

std::vector<data::ChunkShare> Trainer::micro_batch_parts(std::int64_t rows) const {
  return data::micro_batch_rows(rows, accumulation_.micro_batches, chunk_);
}

std::int64_t Trainer::rank_rows(int ranks, int rank) const {
  if (chunk_ > 0) return data::chunk_share(common_.global_batch, {.world_size = ranks, .rank = rank, .chunk = chunk_}).count;
  return data::rank_batch_size(common_.global_batch, ranks, rank);
}

void Trainer::check_accumulation(const dist::Plan& plan, int data_ranks) const {
  const int parts = accumulation_.micro_batches;
  if (parts == 1) return;
  // The last rank holds the fewest rows of a global batch.
  const std::int64_t unit = chunk_ > 0 ? chunk_ : 1;
  const std::int64_t fewest = rank_rows(data_ranks, data_ranks - 1) / unit;
  SHARDLAB_CHECK(fewest >= parts,
                 "--micro-batches {}: rank {} of {} holds {} {} of the global batch of {}, and every micro-batch "
                 "needs one (at most --micro-batches {} here)",
                 parts, data_ranks - 1, data_ranks, fewest, chunk_ > 0 ? "chunks" : "samples", common_.global_batch,
                 fewest);
  if (accumulation_.sync != dist::MicroBatchSync::reduce_scatter) return;
  const bool replicated = std::any_of(plan.units.begin(), plan.units.end(),
                                      [](const dist::UnitPlan& unit) { return unit.replica_reduce_bytes > 0; });
  SHARDLAB_CHECK(replicated,
                 "--micro-batch-sync reduce-scatter: no unit of this run has replicas (--sharding {} on {} ranks): "
                 "it leaves the all-reduce over the replicas of hybrid:G (G below the ranks) or none to the last "
                 "micro-batch, and here every micro-batch only reduce-scatters (--micro-batch-sync every)",
                 common_.sharding, plan.world_size);
}

Trainer::StepClock Trainer::begin_step() {
  trace_->begin_step(step_ + 1);
  profile_.begin_step(step_ + 1);
  return {.start = std::chrono::steady_clock::now(), .host_waits = host_wait_total()};
}

void Trainer::end_step(const StepClock& clock) {
  profile_.end_step();
  trace_->end_step();
  ++step_;
  StepResult& result = this_step_->result;
  result.host_waits = host_wait_total() - clock.host_waits;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - clock.start).count();
  if (step_ > 1) {
    step_seconds_.push_back(result.seconds);
    (saver_ && saver_->in_flight() ? steps_during_saves_ : steps_otherwise_).push_back(result.seconds);
    most_host_waits_ = std::max(most_host_waits_, result.host_waits);
  }
  queued_ = std::move(this_step_);  // read during the next step, or by the next settle_steps()
  this_step_.reset();
}

Tensor Trainer::backward(const StepLoss& loss) {
  const double ranks = chunk_ > 0 ? 1.0 : static_cast<double>(data_parallel_ranks().size());
  const Variable summed = sum(loss.losses);
  (summed * (ranks / loss.divisor)).backward();
  return summed.data();
}

void Trainer::LossTotal::add(const StepLoss& loss, const Tensor& summed_here, bool bitwise) {
  samples = loss.samples;
  if (bitwise) {
    exact.add(loss.losses.data().contiguous());
    return;
  }
  const Tensor here = summed_here.to(DType::f64).reshape({1});
  summed = summed.defined() ? shardlab::add(summed, here) : here.clone();
}

Tensor Trainer::global_loss(const LossTotal& total) {
  if (chunk_ > 0) {
    const Tensor limbs = total.exact.limbs();
    data_parallel_ranks().all_reduce(limbs, dist::ReduceOp::sum, "step loss").wait();
    return full({1}, ExactSum::from_limbs(limbs).value() / total.samples, dtype(DType::f64));
  }
  data_parallel_ranks().all_reduce(total.summed, dist::ReduceOp::sum, "step loss").wait();
  return div(total.summed, total.samples);
}

dist::Communicator& Trainer::data_parallel_ranks() const {
  return setup_.data_parallel != nullptr ? *setup_.data_parallel : session_.world();
}

Tensor Trainer::queue_for_host(const LossTotal& total, const Tensor& grad_norm) {
  const Tensor global = global_loss(total);
  const auto no_waits = forbid_host_waits("queuing the step's loss for the host");
  // Offloaded, the norm comes from the gradients in host memory: it joins the loss on the device.
  const Tensor norm = grad_norm.to(DType::f64).to(global.device());
  // Finite exactly when both are: the sum of a finite loss and norm cannot overflow a double.
  const Tensor finite = isfinite(add(global, norm));
  this_step_ = QueuedStep{.result = {.step = step_ + 1, .samples = total.samples},
                          .values = PendingRead({global, norm, finite})};
  return finite;
}

void Trainer::settle_steps() {
  if (!queued_) return;
  QueuedStep queued = std::move(*queued_);
  queued_.reset();
  StepResult& result = queued.result;
  const std::vector<double> read = queued.values.take();
  result.loss = read[0];
  result.grad_norm = read[1];
  // The device's decision, which the update already followed; the loss and the norm are the same
  // on every rank: every rank skips, or stops, alike.
  result.skipped = non_finite_.skip(result.step, read[2] != 0, result.loss, result.grad_norm, checkpoints_);
  setup_.optimizer->settle_step(!result.skipped);
  after_step(result);
}

nlohmann::json Trainer::step_record(const StepResult& result) const {
  return {{"rank", rank_},
          {"step", result.step},
          {"loss", result.loss},
          {"grad_norm", result.grad_norm},
          {"skipped", result.skipped},
          {"host_waits", result.host_waits}};
}

std::string Trainer::bitwise_preview() const {
  if (chunk_ == 0) return "";
  return fmt::format(
      "bitwise: global batch {} {} (whole chunks per rank); each unit's gradient summed exactly once its "
      "backward is over (block tops all-reduced with max, then 8-byte windows reduce-scattered with sum: "
      "twice an f32 gradient's bytes, not overlapped with the backward); the loss and the gradient norm "
      "summed exactly\n",
      common_.global_batch, rank_shares(common_.global_batch, data_parallel_ranks().size(), chunk_));
}

// The step fixes the data cursor, the dropout keys and the schedule; the seed and the global batch
// must not change between the runs.
nlohmann::json Trainer::state() const {
  nlohmann::json state = training_state();
  state["app"] = program_;
  state["step"] = step_;
  state["seed"] = common_.seed;
  state["global_batch"] = common_.global_batch;
  if (chunk_ > 0) state["chunk"] = chunk_;
  return state;
}

void Trainer::save_checkpoint(bool in_background) {
  settle_steps();
  last_saved_ = state();
  if (saver_ && in_background) {
    note_committed(checkpoints_.start(*saver_, step_, *setup_.root, *setup_.optimizer, last_saved_),
                   "before the next save");
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  checkpoints_.save(step_, *setup_.root, *setup_.optimizer, last_saved_, program_);
  save_blocked_seconds_.push_back(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  save_committed_seconds_.push_back(save_blocked_seconds_.back());
}

void Trainer::note_committed(const std::optional<dist::AsyncCheckpointer::Committed>& saved,
                             std::string_view when) {
  if (!saved) return;
  checkpoints_.committed(session_.cpu_world(), *saved, program_, when);
  save_blocked_seconds_.push_back(saved->blocked_seconds + saved->waited_seconds);
  save_committed_seconds_.push_back(saved->seconds);
}

// How long training waited per save, and how the steps during background writes compare.
void Trainer::report_checkpoints() const {
  if (save_blocked_seconds_.empty()) return;
  std::string background;
  if (saver_) {
    background = fmt::format(
        "; in the background: committed {:.2f} s after the start (median), steps during a write {:.1f} ms "
        "against {:.1f} ms otherwise (median, {} and {} steps), {} saves waited for the one before",
        median(save_committed_seconds_), 1e3 * median(steps_during_saves_), 1e3 * median(steps_otherwise_),
        steps_during_saves_.size(), steps_otherwise_.size(), saver_->waits());
  }
  dist::log("{}: rank 0 checkpoints: {} saves, training blocked {:.3f} s per save (median){}", program_,
            save_blocked_seconds_.size(), median(save_blocked_seconds_), background);
}

void Trainer::resume(const std::vector<std::string>& unchanged) {
  std::vector<std::string> fields{"app", "seed", "global_batch"};
  fields.insert(fields.end(), unchanged.begin(), unchanged.end());
  const CheckpointDir::Resumed resumed =
      checkpoints_.resume(session_.cpu_world(), *setup_.root, *setup_.optimizer, state(), fields, program_);
  // A bitwise run continues the bits of one that saved with the same chunks; from a run without
  // them it continues as any resumed run does.
  SHARDLAB_CHECK(
      chunk_ == 0 || !resumed.state.contains("chunk") || resumed.state["chunk"] == chunk_,
      "--resume: '{}' was trained with --bitwise in chunks of {}, this run cuts chunks of {} (--chunk)",
      resumed.path, resumed.state.value("chunk", nlohmann::json()).dump(), chunk_);
  step_ = resumed.state["step"].get<std::int64_t>();
  epoch_ = setup_.first_epoch + step_ / setup_.loader->batches_per_epoch();
  last_saved_ = resumed.state;
  restore(resumed.state, resumed.path);
}

// How often the host waited for the GPU: at most per step after the first (which loads the data
// and builds caches), and by reason over the whole process.
void Trainer::report_host_waits() const {
  std::string reasons;
  for (const HostWaitCount& count : host_wait_counts())
    reasons += fmt::format("{}{} {}", reasons.empty() ? "" : ", ", count.reason, count.count);
  dist::log("{}: rank 0 host waits for {}: at most {} per step after the first (over the run: {})", program_,
            device_.str(), most_host_waits_, reasons.empty() ? "none" : reasons);
}

namespace {

bool offloads(const dist::Plan& plan) {
  return std::any_of(plan.units.begin(), plan.units.end(),
                     [](const dist::UnitPlan& unit) { return unit.offloaded; });
}

}  // namespace

void Trainer::predict_step_time(const dist::Plan& plan, std::int64_t micro_batch,
                                const std::function<void(std::int64_t)>& run_dry) {
  const char* unmodelled = common_.bitwise ? "--bitwise: its exact sums are not modelled"
                           : data_parallel_ranks().size() != world_size_
                               ? "tensor parallelism: its collectives inside the layers are not modelled"
                               : nullptr;
  if (unmodelled != nullptr) {
    step_time_text_ = fmt::format("step time per rank: not predicted under {}\n", unmodelled);
    return;
  }
  const Calibration rates = calibrate(session_.world(), device_, common_.recalibrate);
  const auto per = [](const std::optional<double>& value, double scale) {
    return value ? std::optional<double>(*value * scale) : std::nullopt;
  };
  const DeviceRates device =
      with_assumed_rates(rates.device, {.dense_flops_per_second = per(common_.peak_tflops, 1e12),
                                        .bytes_per_second = per(common_.memory_bandwidth, 1e9),
                                        .seconds_per_call = per(common_.launch_overhead, 1e-6)});
  SHARDLAB_CHECK(common_.link_bandwidth || plan.world_size == 1 || rates.link.ranks > 1,
                 "--world-size {}: one process measures no collectives; give the link (--link-bandwidth, "
                 "--link-latency)",
                 plan.world_size);
  dist::CollectiveRates link = rates.link;
  if (common_.link_bandwidth)
    link = dist::assumed_link(plan.world_size, *common_.link_bandwidth * 1e9, *common_.link_latency * 1e-6);
  const std::vector<KernelCost> dry_step = kernel_costs([&] {
    const dist::StepCostLabel step;
    run_dry(micro_batch);
  });
  setup_.optimizer->zero_grad();
  reset_peak_memory(device_);
  dist::reset_unsharded_peak();
  // Besides the plan's: the samples, the stop request, the loss and the gradient norm. An assumed memory
  // rate times the update by its bytes: the rule measured here says nothing of that device.
  step_time_ = dist::predict_step_time(
      plan, dry_step, device, link,
      {.small_all_reduces = 4,
       .update_seconds_per_element =
           common_.memory_bandwidth ? 0 : setup_.optimizer->update_seconds_per_element(device_),
       .host_update_seconds_per_element =
           offloads(plan) ? setup_.optimizer->update_seconds_per_element(Device::cpu()) : 0});
  step_time_->device += fmt::format(" ({})", rates.source);
  if (common_.link_bandwidth) step_time_->link += " (assumed)";
  step_time_text_ = step_time_->str();
}

dist::Plan Trainer::what_if_plan() const {
  dist::Plan plan = dist::explain(*setup_.root, setup_.optimizer_state_bytes_per_element, *what_if_);
  plan.accumulation = accumulation_;
  return plan;
}

void Trainer::predict_what_if(std::int64_t micro_batch, const std::function<void(std::int64_t)>& run_dry) {
  const int ranks = what_if_->world_size;
  const dist::Plan plan = what_if_plan();
  const dist::PeakPrediction peak = dist::peak_with_plan(*predicted_, plan);
  predict_step_time(plan, micro_batch, run_dry);
  what_if_json_ = {{"world_size", ranks},
                   {"micro_batch", micro_batch},
                   {"plan", dist::plan_json(plan)},
                   {"persistent_bytes", plan.total_persistent_bytes()},
                   {"planned_step_bytes", plan.bytes_per_step()},
                   {"predicted_peak", dist::prediction_json(peak)},
                   {"predicted_step", step_time_ ? step_time_->json() : nlohmann::json()}};
  what_if_text_ = fmt::format(
      "what-if, predicted and not run: this run on {} rank{}, rank 0 with {} of the global batch's {} samples "
      "(its dry step ran here on {} rank{}, sharded fully)\n{}{}{}",
      ranks, ranks == 1 ? "" : "s", micro_batch, common_.global_batch, world_size_, world_size_ == 1 ? "" : "s",
      plan.str(), peak.str(), step_time_text_);
}

void Trainer::report_step_time(double median_seconds) const {
  if (!step_time_ || step_seconds_.empty()) return;
  std::vector<double> shares;
  for (const dist::StepFigures& figure : trace_->figures())
    if (figure.seconds > 0) shares.push_back(figure.overlap.exposed / figure.seconds);
  dist::log("{}: rank 0 {}", program_,
            dist::step_time_report(*step_time_, median_seconds,
                                   shares.empty() ? std::nullopt : std::optional<double>(median(shares))));
}

// Step time and memory against the plan, for comparing sharding strategies and world sizes.
void Trainer::report() const {
  const double median_seconds = median(step_seconds_);  // the first step, which builds caches, excluded
  dist::log("{}: median step {:.1f} ms{} ({} steps, the first excluded)", program_, 1e3 * median_seconds,
            throughput(median_seconds), step_seconds_.size());
  report_step_time(median_seconds);
  non_finite_.report();
  report_checkpoints();
  report_memory();
  // What is left between steps: shards, gradient shards and optimizer state (plus the optimizer's
  // 8-byte step counter per parameter), measured against the plan. Buffers (the Llama's rotary
  // tables) are replicated, the same on every rank: the plan counts the sharded state only.
  std::int64_t buffer_bytes = 0;
  for (const auto& [name, buffer] : setup_.root->named_buffers())
    buffer_bytes += buffer.numel() * static_cast<std::int64_t>(buffer.element_size());
  const std::int64_t persistent = memory_stats(device_).bytes_in_use - model_bytes_baseline_ - buffer_bytes;
  const std::size_t counters = setup_.root->named_parameters().size();
  dist::log("{}: rank 0 persistent model state: measured {} B{}, planned {} B + {} step counters of 8 B",
            program_, persistent,
            buffer_bytes > 0 ? fmt::format(" (besides {} B of buffers)", buffer_bytes) : "",
            plan_.total_persistent_bytes(), counters);
  dist::log("{}: rank 0 peak of gathered parameters: measured {} B, planned {} B", program_,
            dist::unsharded_memory().peak_bytes, plan_.peak_unsharded_bytes());
  dist::log("{}: rank 0 parameters held from forward to backward: measured {} B, planned {} B", program_,
            *held_after_forward_, plan_.held_after_forward_bytes());
  if (predicted_) dist::log("{}: rank 0 {}", program_, dist::peak_report(*predicted_, peak_bytes_));
  const MetricsFile* metrics = metrics_ ? &*metrics_ : nullptr;
  trace_->report(program_, metrics);
  profile_.report(program_, metrics, rank_);
  dist::log("{}: rank 0 collectives of the last step: received {} B, planned {} B", program_,
            step_bytes_received_, plan_.bytes_per_step());
  if (device_.is_cuda()) report_host_waits();
  if (!metrics_) return;
  const std::optional<std::int64_t> resident = peak_resident_bytes();
  nlohmann::json summary{
      {"rank", rank_},
      {"steps", step_},
      {"skipped_steps", non_finite_.skipped()},
      {"train_peak_memory_bytes", peak_bytes_},
      {"largest_allocation_bytes", memory_stats(device_).largest_allocation},
      {"peak_resident_bytes", resident ? nlohmann::json(*resident) : nlohmann::json()},  // null: not known
      {"data_bytes", data_bytes_},
      {"persistent_bytes", plan_.total_persistent_bytes()},
      {"measured_persistent_bytes", persistent},
      {"step_bytes_received", step_bytes_received_},
      {"planned_step_bytes", plan_.bytes_per_step()},
      {"held_after_forward_bytes", *held_after_forward_},
      {"planned_held_after_forward_bytes", plan_.held_after_forward_bytes()},
      {"most_host_waits_per_step", most_host_waits_},
      {"median_step_seconds", median_seconds},
      {"checkpoint_blocked_seconds", save_blocked_seconds_},
      {"checkpoint_committed_seconds", save_committed_seconds_},
      {"median_step_seconds_during_saves",
       steps_during_saves_.empty() ? nlohmann::json() : nlohmann::json(median(steps_during_saves_))},
      {"median_step_seconds_otherwise",
       steps_otherwise_.empty() ? nlohmann::json() : nlohmann::json(median(steps_otherwise_))},
      {"plan", dist::plan_json(plan_)},
      {"predicted_peak", predicted_ ? dist::prediction_json(*predicted_) : nlohmann::json()},
      {"predicted_step", step_time_ ? step_time_->json() : nlohmann::json()}};
  add_summary(summary, median_seconds);
  metrics_->write(summary);
}

}  // namespace shardlab::apps
