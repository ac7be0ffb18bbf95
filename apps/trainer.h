// apps/trainer.h: the skeleton of both training programs: the flags they share, and a Trainer that
// runs the epochs and steps (non-finite steps skipped, the optimizer step, checkpoints and
// --resume, --trace and --profile, --explain and --memory-limit, the final report) around what
// a program supplies by overriding its hooks: the model, the data and the loss.
//
//   class Training : public apps::Trainer { ... };  // builds its model, then calls start()
//   int main(int argc, char** argv) {
//     return apps::training_main<Training, Options>(argc, argv, "train_x", "train_x: ...", add_options);
//   }
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "apps/support/checkpoint_dir.h"
#include "apps/support/job.h"
#include "apps/support/metrics_file.h"
#include "apps/support/non_finite.h"
#include "apps/support/step_profile.h"
#include "apps/support/step_trace.h"
#include "core/exact_sum.h"
#include "core/host_wait.h"
#include "core/pending_read.h"
#include "data/loader.h"
#include "dist/comm/init.h"
#include "dist/fsdp/fsdp.h"
#include "dist/fsdp/memory.h"
#include "dist/fsdp/step_time.h"
#include "nn/module.h"
#include "optim/optimizer.h"
#include "optim/scheduler.h"

namespace shardlab::apps {

// The flags both training programs have. A program's Options derives from it and sets its own
// defaults (the CNN trains 10 epochs of 64 images, the Llama 1 epoch of 16 sequences).
struct TrainerOptions {
  std::int64_t global_batch = 1;
  std::int64_t epochs = 1;
  std::int64_t steps = 0;  // 0: --epochs decides
  std::uint64_t seed = 1;
  std::string sharding = "full";
  int prefetch = 1;
  int reshard_after_forward_group = 0;  // FsdpOptions::reshard_after_forward_group
  std::string mixed_precision = "none";
  bool explain = false;
  bool recalibrate = false;  // --explain: measure the device's rates again instead of the cached ones
  // --explain's what-if: the plan, peak and step time of this run on world_size ranks (0: the run's own),
  // printed instead of training; and rates given instead of measured (GB/s, TFLOP/s, us).
  int world_size = 0;
  std::optional<double> peak_tflops, memory_bandwidth, launch_overhead, link_bandwidth, link_latency;
  bool profile = false;
  bool detect_anomaly = false;
  std::int64_t max_skipped_steps = 5;  // non-finite steps in a row before the run stops
  std::string metrics;
  std::string trace, trace_steps = "2:3";
  std::string save_model;
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;  // 0: only at the end, when --checkpoint-dir is given
  bool async_checkpoint = false;      // --checkpoint-every's saves written while training goes on
  std::string checkpoint_staging = "2G";
  std::int64_t keep = 2;
  bool resume = false;
  int threads = 0;
  std::string memory_limit;  // none by default: the CPU's memory is the host's, shared with everything else
  std::string device = "auto";
  bool share_gpu = false;
  // The same bits at any world size and sharding (FsdpOptions::bitwise): the global batch in chunks of
  // `chunk` samples (0: bitwise_chunk's choice), each rank whole chunks; CPU only.
  bool bitwise = false;
  std::int64_t chunk = 0;
  // Gradient accumulation: each rank's share of a global batch as this many forward and backward
  // passes before the one optimizer step, reducing as `micro_batch_sync` says (empty: "every", or
  // with --bitwise "last").
  int micro_batches = 1;
  std::string micro_batch_sync;
};

// --micro-batches (at least 1: the flag checks it) and --micro-batch-sync, checked: a sync without
// micro-batches to sync, and with --bitwise a reduction per micro-batch (each would round), are refused
// by name.
dist::Accumulation accumulation_of(const TrainerOptions& options);

// --chunk, or where it is 0 the largest divisor of the global batch at most a quarter of it (16 for
// 64, 2 for 10), so that up to 4 ranks hold whole chunks: what bitwise training cuts a batch into.
std::int64_t bitwise_chunk(const TrainerOptions& options);

// The TrainerOptions flags whose words are the same in both programs; --global-batch, --epochs,
// --steps, --seed and --save-model each program words for itself.
void add_trainer_options(CLI::App& app, TrainerOptions& options);

// What dist::init gets from --device and --share-gpu.
dist::InitOptions init_options(const TrainerOptions& options);

// --mixed-precision: "none", or "bf16" (bf16 gathers and compute, f32 reductions and master shards).
dist::MixedPrecision parse_mixed_precision(const std::string& text);

// The median of `values` (0 when empty).
double median(std::vector<double> values);

// Everything a run needs, built (and checked) on every rank before the first step: errors thrown
// while building are the same on all ranks.
class Trainer {
 public:
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  virtual ~Trainer() = default;

  // How a run ended: all its steps trained, or stopped between two steps by a signal (SIGTERM,
  // SIGINT, SIGUSR1: apps/support/stop_signals.h) on some rank, every rank at the same step.
  enum class End { finished, stopped_by_signal };
  // Trains from the step the run stands at until --steps or the last epoch, then saves the final
  // checkpoint, calls finish() and reports step time, memory and traffic against the plan. Stopped
  // by a signal, it saves the checkpoint (with --checkpoint-dir) and reports, without finish().
  End run();

 protected:
  // What the program's forward leaves for the step: this rank's losses (one per image or target,
  // 0 for padding), what the step's gradient divides the global batch's summed loss by (the Llama:
  // the global count, for the mean's gradient; the CNN: 1, for the sum's), and what the reported
  // loss averages over (images, targets) in the whole global batch, known on the host. The Trainer
  // sums the losses and scales the backward: FSDP averages the gradients over the data-parallel
  // ranks, so by their number over the divisor; bitwise training sums them, so by 1 over it.
  struct StepLoss {
    Variable losses;
    double divisor = 1;
    double samples = 0;
  };

  // A training step's outcome over all ranks, read on the host while the next step is queued.
  struct StepResult {
    std::int64_t step = 0;  // from 1
    double loss = 0;        // the global batch's loss, as the program reports it
    double grad_norm = 0;   // the global gradient norm
    double samples = 0;     // as StepLoss
    bool skipped = false;   // not finite: no update
    double seconds = 0;     // the host's time for the step, the batch's loading included
    // The host's waits for the device during the step (core/host_wait.h).
    std::int64_t host_waits = 0;
  };

  // The run's shape, known once the program has built its model, optimizer and data.
  struct Setup {
    nn::Module* root = nullptr;  // sharded (dist::fully_shard)
    optim::Optimizer* optimizer = nullptr;
    const data::DataLoader* loader = nullptr;
    // Stepped once after every optimizer step, skipped ones included (a schedule per epoch is the
    // program's, in end_epoch); may be null.
    optim::LRScheduler* scheduler = nullptr;
    std::int64_t total_steps = 0;  // where training stops, unless the last epoch comes first
    // The epochs, as the loader's shuffle knows them (batch_indices(epoch)).
    std::int64_t first_epoch = 0, last_epoch = std::numeric_limits<std::int64_t>::max();
    std::int64_t optimizer_state_bytes_per_element = 8;           // what the plan counts as optimizer state
    bool checkpointing_available = false, checkpointing = false;  // for --memory-limit's advice
    // The fields of training_state() a resumed run must have unchanged.
    std::vector<std::string> unchanged;
    // The ranks that share out the global batch (a mesh's "dp" under tensor parallelism); the world
    // when null.
    dist::Communicator* data_parallel = nullptr;
    // The program's evaluation of a held-out set, with every step before it settled: after each
    // `evaluate_every` steps (0: none before the end) and after the last step; none where empty.
    std::function<void()> evaluate;
    std::int64_t evaluate_every = 0;
    bool evaluate_only = false;  // run() evaluates once and takes no step
  };

  // Sets the threads, the FSDP options (fsdp_) and checks --save-model (a file, or a directory
  // where `save_model_is_directory`) and --checkpoint-dir before anything loads.
  Trainer(const char* program, const TrainerOptions& options, dist::Session& session,
          bool save_model_is_directory);

  // Plans the run (--explain, --memory-limit), resumes it (--resume) and opens the metrics file,
  // the trace and the profile. The program calls it once its model, optimizer and data exist.
  void start(const Setup& setup);

  // What the loss averages over in the whole global batch (images, non-padding targets), counted
  // from `on_host`, this rank's batch in host memory (on a GPU, reading a count back from the
  // device would wait for it), and summed over the ranks on the host.
  virtual double global_samples(const data::Batch& on_host) = 0;
  // The program's forward and loss of `batch` on device_ (train_step has zeroed the gradients and
  // runs the backward), for a global batch of `samples`. On a GPU with NCCL it runs where host waits
  // are refused (core/host_wait.h).
  virtual StepLoss forward_loss(const data::Batch& batch, double samples) = 0;
  // After the backward: the global gradient norm, a one-element tensor on device_, the same on every
  // rank, and the gradients clipped to it where the program clips.
  virtual Tensor clip_gradients() = 0;
  // Forward and backward of `batch` alone, for the prediction of the training peak.
  virtual void dry_run(const data::Batch& batch) = 0;
  // What continuing exactly needs besides the shards and the optimizer, beyond the step, the seed
  // and the global batch, which the Trainer adds.
  virtual nlohmann::json training_state() const = 0;
  // Continues from a checkpoint's state (step_ and epoch_ already set from it).
  virtual void restore(const nlohmann::json& state, const std::string& path) = 0;
  // After each step, once its loss and norm are read (during the next step): the program's
  // records and progress.
  virtual void after_step(const StepResult& result) = 0;

  virtual void begin_training() {}
  virtual void begin_epoch() {}
  // `complete`: its last batch trained; else --steps stopped it.
  virtual void end_epoch(bool /*complete*/) {}
  // After the final checkpoint: the program's outputs (--save-model, samples).
  virtual void finish() {}
  // The report's additions: a throughput after the median step time (", 1234 tokens/s"), lines
  // after the skipped steps', and fields of the summary record.
  virtual std::string throughput(double /*median_seconds*/) const { return ""; }
  virtual void report_memory() const {}
  virtual void add_summary(nlohmann::json& /*summary*/, double /*median_seconds*/) const {}

  // Every step queued so far read and accounted (after_step called): at the end of an epoch, before
  // a checkpoint or anything else that needs the optimizer settled.
  void settle_steps();

  // {"rank", "step", "loss", "grad_norm", "skipped", "host_waits"}: what every per-step metrics record holds.
  nlohmann::json step_record(const StepResult& result) const;

  const char* const program_;
  const TrainerOptions common_;
  dist::Session& session_;
  const int rank_, world_size_;
  const Device device_;  // the session's: the model, the batches and the measured memory
  dist::FsdpOptions fsdp_;
  // --world-size: the world and strategy planned; fsdp_ then shards fully here, which any world can.
  std::optional<dist::PlanAt> what_if_;
  const std::int64_t chunk_;               // bitwise training's samples per chunk; 0 without it
  const dist::Accumulation accumulation_;  // --micro-batches, --micro-batch-sync
  std::int64_t step_ = 0;                  // optimizer steps taken, skipped ones included
  std::int64_t epoch_ = 0;                 // the epoch in progress, as the loader numbers it
  std::int64_t data_bytes_ = 0;            // device_'s bytes in use once the data is loaded (the program's)
  std::int64_t model_bytes_baseline_ = 0;  // device_'s, before the shards existed (the program's)
  std::int64_t step_bytes_received_ = 0;   // FSDP's collectives of the last step (the program's)
  std::int64_t peak_bytes_ = 0;            // while training
  std::int64_t most_host_waits_ = 0;       // in one step after the first
  // The most gathered parameter bytes seen at the end of a forward in grad mode: what stays for backward.
  std::shared_ptr<std::int64_t> held_after_forward_ = std::make_shared<std::int64_t>(0);
  dist::Plan plan_;
  std::optional<dist::PeakPrediction> predicted_;  // with --explain or --memory-limit
  std::string checkpoint_preview_;                 // with --explain: what a checkpoint will write
  // With --explain: the predicted step time, and its lines (or why there is none).
  std::optional<dist::StepTimePrediction> step_time_;
  std::string step_time_text_;
  std::string what_if_text_;     // --world-size's prediction, printed instead of training
  nlohmann::json what_if_json_;  // and its --metrics record
  std::optional<MetricsFile> metrics_;

 private:
  bool train_epoch();
  // Whether a stop signal reached any rank: every rank asks before each step (one small
  // all-reduce), so all stop after the same one. Notes the signal in stopped_by_.
  bool stop_requested();
  void report_stop() const;
  // The loader's batch of these samples, on device_ (the data set stays in host memory).
  data::Batch batch_on_device(const std::vector<std::int64_t>& indices) const;
  // A scope refusing host waits (named `what`) where the step must not have any: on a GPU with
  // NCCL and without CPU offload (whose optimizer step on the host waits for the gradients); on a
  // CPU no wait can happen. Through MPI a GPU's collectives go through host memory.
  std::optional<HostWaitsForbidden> forbid_host_waits(const char* what) const;
  void train_step(const std::vector<std::int64_t>& indices);
  // Setup::evaluate, once the steps so far are settled.
  void evaluate();
  // Whether micro-batches before a step's last keep their gradients (all-reduce or sync left out).
  bool keeps_gradients() const;
  // Before micro-batch `last` or another of a step: what its backward reduces (accumulation_.sync).
  void sync_micro_batch(bool last) const;
  // This rank's rows of a global batch over `ranks` data-parallel ranks (whole chunks, bitwise).
  std::int64_t rank_rows(int ranks, int rank) const;
  // --world-size's plan: rank 0's at that world, with this run's accumulation.
  dist::Plan what_if_plan() const;
  // The rows of this rank's batch each micro-batch takes (one part without accumulation).
  std::vector<data::ChunkShare> micro_batch_parts(std::int64_t rows) const;
  // Refuses, before anything trains, micro-batches that `plan` cannot run: more than the smallest rank
  // share of the global batch over `data_ranks` holds, or a reduce-scatter sync without replicas.
  void check_accumulation(const dist::Plan& plan, int data_ranks) const;
  // What train_step measures around a step: when it began, and the host's waits until then.
  struct StepClock {
    std::chrono::steady_clock::time_point start;
    std::int64_t host_waits = 0;
  };
  StepClock begin_step();
  void end_step(const StepClock& clock);
  // This rank's losses of a step, added over its micro-batches: on the device, and bitwise exactly
  // (core/exact_sum.h).
  struct LossTotal {
    Tensor summed;  // f64 [1]
    ExactSum exact;
    double samples = 0;  // StepLoss::samples
    void add(const StepLoss& loss, const Tensor& summed_here, bool bitwise);
  };
  // Forward and backward of this rank's batch (on the host), one pass per micro-batch, each moved to
  // device_ in turn; the losses added over them.
  LossTotal forward_backward(const data::Batch& on_host, double samples);
  // The loss of the global batch: the data-parallel ranks' sums added on the device, over the
  // samples counted on the host; bitwise, every loss added exactly.
  Tensor global_loss(const LossTotal& total);
  // The gradient of `loss`: forward_loss's losses summed, scaled as StepLoss says; returns the sum.
  Tensor backward(const StepLoss& loss);
  // Setup::data_parallel, or the world.
  dist::Communicator& data_parallel_ranks() const;
  // Queues this step's loss and gradient norm for the host, read during the next step; returns,
  // on the device, whether both are finite (the gate of the update).
  Tensor queue_for_host(const LossTotal& total, const Tensor& grad_norm);
  // The previous step, queued and not yet read: its values on their way to the host.
  struct QueuedStep {
    StepResult result;   // loss, grad_norm and skipped still to come
    PendingRead values;  // loss, grad_norm, finite
  };
  nlohmann::json state() const;
  // --explain's lines on bitwise training (none without it).
  std::string bitwise_preview() const;
  // --explain: the step time of `plan` predicted from a dry forward and backward of `micro_batch` samples
  // (`run_dry`), the device's and the link's rates (measured, or as the flags assume them), into
  // step_time_ and step_time_text_.
  void predict_step_time(const dist::Plan& plan, std::int64_t micro_batch,
                         const std::function<void(std::int64_t)>& run_dry);
  // --world-size: the plan, peak and step time of this run on that many ranks (rank 0's `micro_batch`
  // samples), into what_if_text_; predicted_ holds the peak measured here at those samples.
  void predict_what_if(std::int64_t micro_batch, const std::function<void(std::int64_t)>& run_dry);
  // The measured step beside the predicted one (rank 0's traced steps give the exposed communication).
  void report_step_time(double median_seconds) const;
  // A checkpoint of the state now: with --async-checkpoint and `in_background`, written by the
  // saver's thread while training goes on.
  void save_checkpoint(bool in_background = false);
  void note_committed(const std::optional<dist::AsyncCheckpointer::Committed>& saved, std::string_view when);
  void report_checkpoints() const;
  void resume(const std::vector<std::string>& unchanged);
  void report() const;
  void report_host_waits() const;

  Setup setup_;
  CheckpointDir checkpoints_;
  NonFiniteSteps non_finite_;
  std::optional<StepTrace> trace_;
  StepProfile profile_{false};
  nlohmann::json last_saved_;  // the state saved or resumed from: the end need not save it again
  std::vector<double> step_seconds_;
  std::optional<dist::AsyncCheckpointer> saver_;  // with --async-checkpoint
  // Per save, how long training waited for it (a synchronous save: all of it); per step after the
  // first, its time while a background save was in flight, or else.
  std::vector<double> save_blocked_seconds_, save_committed_seconds_;
  std::vector<double> steps_during_saves_, steps_otherwise_;
  std::optional<QueuedStep> queued_;     // the last step taken, until settle_steps() reads it
  std::optional<QueuedStep> this_step_;  // the step in progress, queued once its update is
  int stopped_by_ = 0;                   // the signal that stopped the run, 0 while none has
  std::int64_t evaluated_at_ = -1;       // the step of the last evaluation
};

// A training program's main(): parses the program's own flags (`add_own_options`) and the shared
// ones (before the processes start, which needs --device), starts them, builds Training(options,
// session) on every rank and runs it; returns the exit status.
template <typename Training, typename Options>
int training_main(int argc, char** argv, const char* program, const std::string& description,
                  void (*add_own_options)(CLI::App&, Options&)) {
  Options options;
  CLI::App app{description};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // later flags win
  add_own_options(app, options);
  add_trainer_options(app, options);
  // --help and usage errors, printed once.
  if (const std::optional<int> status =
          parse_command_line(app, argc, argv, program, dist::launcher_rank() == 0))
    return *status;
  const std::unique_ptr<dist::Session> session = start_session(argc, argv, program, init_options(options));
  if (!session) return 1;
  return build_and_run<Training>(program, *session, options);
}

}  // namespace shardlab::apps
