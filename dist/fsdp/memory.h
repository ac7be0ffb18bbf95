// dist/fsdp/memory.h: one rank's predicted training peak, the plan's bytes (dist/fsdp/fsdp.h)
// extended by the activations a dry forward/backward measures; what --explain prints and
// --memory-limit checks.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/device.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"

namespace shardlab::dist {

// One rank's predicted peak of allocator bytes while training, as terms that add up to it. The
// plan gives the model state and what FSDP gathers and reduces; a dry forward/backward of the
// run's micro-batch measures the rest (activations and temporaries). Measured, not extrapolated
// from a smaller batch: with resharding, a small batch peaks while parameters are gathered and a
// large one while activations are live, so the peak is not linear in the samples (1 and 2 samples
// extrapolated to 12 missed the tiny Llama's peak by 11%). A second run of half the samples gives
// the per-sample slope that the refusal's batch suggestions use.
struct PeakPrediction {
  std::int64_t data = 0;         // in use before the model existed: the loaded data (measured)
  std::int64_t persistent = 0;   // shards, gradient shards and optimizer state (plan)
  std::int64_t gathered = 0;     // gathered parameters in flight: 1 + prefetch units (plan)
  std::int64_t gradients = 0;    // unsharded gradients in flight during backward (plan)
  // What `gradients` holds, in words: with micro-batches that keep gradients between them, those too.
  std::string gradients_what = "unsharded gradients in flight (the 3 largest units)";
  std::int64_t activations = 0;  // the rest of the forward/backward peak (dry run); 0 before it
  std::int64_t per_sample = 0;   // activations' growth per sample, from micro-batches of half and all
  std::int64_t micro_batch = 0;  // samples per rank and micro-batch (a step's, without accumulation)
  bool measured = false;         // whether a dry run measured the activations

  std::int64_t total() const { return data + persistent + gathered + gradients + activations; }
  // The same run with `samples` per rank instead of micro_batch.
  std::int64_t total_with(std::int64_t samples) const {
    return total() + (samples - micro_batch) * per_sample;
  }
  std::string str() const;  // the terms, one a line, as --explain prints them
};
// "training peak: measured M B, predicted P B (+1.2%); above the D B of loaded data: ...".
std::string peak_report(const PeakPrediction& prediction, std::int64_t measured);
// {"total": ..., "data": ..., ...}: what the metrics files record.
nlohmann::json prediction_json(const PeakPrediction& prediction);
// {"world_size", "sharding", "shard_group_size", "optimizer_state_bytes_per_element", "unit_parameters"}:
// what the summary records so that scripts/plot can recompute the plan's formulas per world size.
nlohmann::json plan_json(const Plan& plan);

// The peak the plan alone predicts: activations not yet measured (a lower bound).
PeakPrediction planned_peak(const Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch);

// planned_peak plus the activations: `forward_backward(n)` runs the step's forward and backward on
// n samples of a batch (on every rank: a collective). Three runs, of half the micro-batch (not
// measured: it records FSDP's unit order and builds caches), half and all of it; each ends with
// optimizer.zero_grad(), no step, so the parameters and the optimizer are untouched. Resets the allocator's
// and FSDP's peaks after.
PeakPrediction predict_peak(const Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch,
                            Device device, optim::Optimizer& optimizer,
                            const std::function<void(std::int64_t samples)>& forward_backward);

// `measured`'s peak (predict_peak's, at the samples per rank of `plan`'s world) with another plan of the
// same model (explain at another world size): that plan's terms, the data and activations measured.
PeakPrediction peak_with_plan(const PeakPrediction& measured, const Plan& plan);

// "1048576 B (1.0 MiB)".
std::string bytes_text(std::int64_t bytes);

}  // namespace shardlab::dist
