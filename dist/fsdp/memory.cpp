// dist/fsdp/memory.cpp: the predicted training peak: the plan's terms, the dry runs' activations.
#include "dist/fsdp/memory.h"

#include <fmt/format.h>

#include <string_view>

#include "core/allocator.h"

namespace shardlab::dist {

std::string bytes_text(std::int64_t bytes) {
  return fmt::format("{} B ({:.1f} MiB)", bytes, static_cast<double>(bytes) / (1024.0 * 1024.0));
}

std::string PeakPrediction::str() const {
  std::string text = fmt::format("training peak per rank, predicted: {}{}\n", bytes_text(total()),
                                 measured ? "" : ", activations not measured");
  const auto line = [&](std::string_view what, std::int64_t bytes) {
    text += fmt::format("  {:<58} {:>14} B\n", what, bytes);
  };
  line("loaded data (in use before the model)", data);
  line("persistent: shards, gradient shards, optimizer state", persistent);
  line("gathered parameters in flight (1 + prefetch units)", gathered);
  line(gradients_what, gradients);
  if (measured) {
    line(fmt::format("activations and temporaries ({} samples, {} B each)", micro_batch, per_sample),
         activations);
  }
  return text;
}

std::string peak_report(const PeakPrediction& prediction, std::int64_t measured) {
  const std::int64_t predicted = prediction.total();
  return fmt::format(
      "training peak: measured {} B, predicted {} B ({:+.1f}%); above the {} B of loaded data: measured {} "
      "B, "
      "predicted {} B",
      measured, predicted, 100.0 * static_cast<double>(predicted - measured) / static_cast<double>(measured),
      prediction.data, measured - prediction.data, predicted - prediction.data);
}

nlohmann::json prediction_json(const PeakPrediction& prediction) {
  return {{"total", prediction.total()},         {"data", prediction.data},
          {"persistent", prediction.persistent}, {"gathered", prediction.gathered},
          {"gradients", prediction.gradients},   {"activations", prediction.activations},
          {"per_sample", prediction.per_sample}, {"micro_batch", prediction.micro_batch}};
}

nlohmann::json plan_json(const Plan& plan) {
  std::vector<std::int64_t> unit_parameters;
  for (const UnitPlan& unit : plan.units) unit_parameters.push_back(unit.parameters);
  return {{"world_size", plan.world_size},
          {"sharding", plan.sharding},
          {"shard_group_size", plan.shard_group_size},
          {"optimizer_state_bytes_per_element", plan.optimizer_state_bytes_per_element},
          {"unit_parameters", unit_parameters}};
}

namespace {

std::string gradients_what(const Plan& plan) {
  if (plan.accumulation.micro_batches > 1 && plan.accumulation.sync == MicroBatchSync::last)
    return plan.bitwise ? "exact gradient sums of all units, kept across micro-batches"
                        : "unsharded gradients of all units, kept across micro-batches";
  if (plan.accumulation.micro_batches > 1 && plan.accumulation.sync == MicroBatchSync::reduce_scatter)
    return "unsharded gradients in flight, and the partial sums";
  return "unsharded gradients in flight (the 3 largest units)";
}

}  // namespace

PeakPrediction planned_peak(const Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch) {
  return {
      .data = data_bytes,
      .persistent = plan.total_persistent_bytes(),
      .gathered = plan.peak_unsharded_bytes() - plan.persistent_unsharded_bytes(),  // those are persistent
      .gradients = plan.accumulated_gradient_bytes(),
      .gradients_what = gradients_what(plan),
      .micro_batch = micro_batch};
}

PeakPrediction predict_peak(const Plan& plan, std::int64_t data_bytes, std::int64_t micro_batch,
                            Device device, optim::Optimizer& optimizer,
                            const std::function<void(std::int64_t samples)>& forward_backward) {
  // What one forward/backward adds at its peak to the bytes in use before it.
  const auto added = [&](std::int64_t samples) {
    const std::int64_t before = memory_stats(device).bytes_in_use;
    reset_peak_memory(device);
    forward_backward(samples);
    optimizer.zero_grad();
    return memory_stats(device).peak_bytes - before;
  };
  const std::int64_t half = (micro_batch + 1) / 2;
  added(half);
  // The bytes in use at the start of every step but the first: these and the optimizer state, which
  // its first step allocates.
  const std::int64_t between_steps = memory_stats(device).bytes_in_use + plan.optimizer_state_bytes();
  const std::int64_t at_half = added(half);
  const std::int64_t full = micro_batch > half ? added(micro_batch) : at_half;
  reset_peak_memory(device);
  reset_unsharded_peak();
  PeakPrediction prediction = planned_peak(plan, data_bytes, micro_batch);
  prediction.per_sample = micro_batch > half ? (full - at_half) / (micro_batch - half) : 0;
  prediction.measured = true;
  prediction.activations = between_steps + full - prediction.total();
  return prediction;
}

PeakPrediction peak_with_plan(const PeakPrediction& measured, const Plan& plan) {
  PeakPrediction prediction = planned_peak(plan, measured.data, measured.micro_batch);
  prediction.activations = measured.activations;
  prediction.per_sample = measured.per_sample;
  prediction.measured = measured.measured;
  return prediction;
}

}  // namespace shardlab::dist
