// apps/support/memory_limit.cpp: the --memory-limit check and its suggestions.
#include "apps/support/memory_limit.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "apps/support/ranks.h"
#include "core/error.h"

namespace shardlab::apps {

using dist::bytes_text;
using dist::PeakPrediction;

void check_memory_limit(dist::Communicator& comm, const PeakPrediction& prediction, const dist::Plan& plan,
                        std::int64_t limit, const FitLevers& levers) {
  // Every rank's terms, so that every rank words the same message about the same rank.
  constexpr std::size_t kTerms = 6;
  std::vector<double> mine(kTerms * static_cast<std::size_t>(comm.size()), 0.0);
  const std::vector<std::int64_t> terms{prediction.data,      prediction.persistent,  prediction.gathered,
                                        prediction.gradients, prediction.activations, prediction.per_sample};
  for (std::size_t i = 0; i < kTerms; ++i)
    mine[kTerms * static_cast<std::size_t>(comm.rank()) + i] = static_cast<double>(terms[i]);
  const std::vector<double> all = sum_over_ranks(comm, mine);
  int worst = 0;
  std::int64_t worst_total = -1;
  PeakPrediction peak = prediction;
  for (int rank = 0; rank < comm.size(); ++rank) {
    const auto term = [&](std::size_t i) {
      return static_cast<std::int64_t>(all[kTerms * static_cast<std::size_t>(rank) + i]);
    };
    const PeakPrediction theirs{.data = term(0),
                                .persistent = term(1),
                                .gathered = term(2),
                                .gradients = term(3),
                                .gradients_what = prediction.gradients_what,
                                .activations = term(4),
                                .per_sample = term(5),
                                .micro_batch = prediction.micro_batch,
                                .measured = prediction.measured};
    if (theirs.total() > worst_total) {
      worst = rank;
      worst_total = theirs.total();
      peak = theirs;
    }
  }
  if (worst_total <= limit) return;

  std::vector<std::pair<std::int64_t, std::string>> largest{
      {peak.data, "loaded data"},
      {peak.persistent, "persistent model state (shards, gradient shards, optimizer state)"},
      {peak.gathered, "gathered parameters"},
      {peak.gradients, peak.gradients_what},
      {peak.activations, fmt::format("activations and temporaries ({} samples)", peak.micro_batch)}};
  std::sort(largest.rbegin(), largest.rend());
  std::string message = fmt::format(
      "will not fit: the predicted training peak of rank {} is {}, over --memory-limit {} by {}\nlargest "
      "terms:",
      worst, bytes_text(worst_total), bytes_text(limit), bytes_text(worst_total - limit));
  for (std::size_t i = 0; i < 3; ++i)
    message += fmt::format(" {} {} B;", largest[i].second, largest[i].first);
  message.back() = '\n';
  message += "what would lower it:";
  const auto suggest = [&](const std::string& change, std::optional<std::int64_t> total) {
    message += fmt::format("\n  {}{}", change,
                           total ? fmt::format(": predicted peak {}, {}", bytes_text(*total),
                                               *total <= limit ? "fits" : "still over")
                                 : "");
  };
  const bool shards_everything = levers.sharding == "full" || levers.sharding == "grad_op";
  // Twice the ranks with the same global batch: half the samples per rank and, where the world is
  // the shard group, half the persistent state.
  const std::int64_t half = (peak.micro_batch + 1) / 2;
  suggest(fmt::format("more ranks (mpirun -np {})", 2 * levers.world_size),
          peak.total_with(half) - (shards_everything ? peak.persistent / 2 : 0));
  if (levers.sharding != "full") {
    // Full sharding over the whole world: the persistent state of one shard group spread over all
    // ranks, and only 1 + prefetch units gathered at once.
    dist::Plan resharded = plan;
    for (std::size_t i = 1; i < resharded.units.size(); ++i) {
      resharded.units[i].gathered_through_backward = false;
      resharded.units[i].gathered_between_steps = false;
    }
    const std::int64_t group = levers.sharding == "none" ? 1 : plan.shard_group_size;
    suggest("--sharding full", worst_total - peak.persistent + peak.persistent * group / levers.world_size -
                                   plan.peak_unsharded_bytes() + resharded.peak_unsharded_bytes());
  }
  if (levers.checkpointing_available && !levers.checkpointing)
    suggest("--activation-checkpointing (keeps each layer's input only and recomputes the rest in backward)",
            std::nullopt);
  if (!levers.device.is_cpu()) suggest("--cpu-offload", worst_total - peak.persistent);
  if (peak.per_sample > 0) {
    const std::int64_t fitting =
        peak.micro_batch - (worst_total - limit + peak.per_sample - 1) / peak.per_sample;
    if (fitting >= 1) {
      // The same global batch in more micro-batches, each of at most `fitting` samples.
      const std::int64_t parts = (levers.rank_batch + fitting - 1) / fitting;
      if (parts > levers.micro_batches) {
        const std::int64_t largest = (levers.rank_batch + parts - 1) / parts;
        suggest(fmt::format("--micro-batches {} (the same global batch, micro-batches of at most {} samples)",
                            parts, largest),
                peak.total_with(largest));
      }
      const std::int64_t rank_batch = fitting * levers.micro_batches;
      suggest(fmt::format("--global-batch {} (per-rank batch {}{})", rank_batch * levers.data_ranks, rank_batch,
                          levers.micro_batches > 1 ? fmt::format(" in {} micro-batches", levers.micro_batches) : ""),
              peak.total_with(fitting));
    }
  }
  fail("{}", message);
}

PeakPrediction will_it_fit(dist::Communicator& comm, const dist::Plan& plan, std::int64_t data_bytes,
                           std::int64_t micro_batch, std::optional<std::int64_t> limit,
                           const FitLevers& levers, optim::Optimizer& optimizer,
                           const std::function<void(std::int64_t samples)>& forward_backward) {
  if (limit) check_memory_limit(comm, planned_peak(plan, data_bytes, micro_batch), plan, *limit, levers);
  PeakPrediction prediction =
      predict_peak(plan, data_bytes, micro_batch, levers.device, optimizer, forward_backward);
  if (limit) check_memory_limit(comm, prediction, plan, *limit, levers);
  return prediction;
}

}  // namespace shardlab::apps
