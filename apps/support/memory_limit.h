// apps/support/memory_limit.h: --memory-limit: a run whose predicted peak (dist/fsdp/memory.h) exceeds the
// limit is refused before step 1, with what would bring it under, in the training programs' flags.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "core/device.h"
#include "dist/comm/communicator.h"
#include "dist/fsdp/memory.h"

namespace shardlab::apps {

// What a run can change to use less memory, for the refusal's suggestions.
struct FitLevers {
  std::int64_t global_batch = 0;
  int world_size = 1;
  int data_ranks = 1;    // the ranks that share out the global batch: world_size / tp
  std::string sharding;  // dist::Plan::sharding
  bool checkpointing_available = false, checkpointing = false;  // --activation-checkpointing
  Device device = Device::cpu();                                // --cpu-offload frees a GPU only
  int micro_batches = 1;           // --micro-batches
  std::int64_t rank_batch = 0;     // the most rows a rank holds of a global batch
};

// Throws on every rank when some rank's predicted peak exceeds `limit`, with one message (the
// same on every rank, of the rank with the highest peak) naming the peak, the limit, the largest
// terms and what would bring it under, with each change's predicted peak where the terms give
// it. A collective.
void check_memory_limit(dist::Communicator& comm, const dist::PeakPrediction& prediction,
                        const dist::Plan& plan, std::int64_t limit, const FitLevers& levers);

// What --explain and --memory-limit run before step 1: with a limit, planned_peak is checked
// first (a run whose model state alone does not fit allocates nothing more), then predict_peak's
// prediction, which this returns.
dist::PeakPrediction will_it_fit(dist::Communicator& comm, const dist::Plan& plan, std::int64_t data_bytes,
                                 std::int64_t micro_batch, std::optional<std::int64_t> limit,
                                 const FitLevers& levers, optim::Optimizer& optimizer,
                                 const std::function<void(std::int64_t samples)>& forward_backward);

}  // namespace shardlab::apps
