// apps/generate_model.h: the Llama `generate` runs on: one process's whole model, or, started by mpirun,
// one sharded over the ranks with FSDP, each rank reading only its shards of the weight files (built
// where MPI is: apps/generate_ranks.cpp; elsewhere apps/generate_alone.cpp).
#pragma once

#include <memory>
#include <string>

#include "core/device.h"
#include "models/llama.h"

namespace shardlab::apps {

// The processes generate runs as: one, or the ranks mpirun started, each on `device`.
struct GenerationRanks {
  Device device = Device::cpu();
  int rank = 0, size = 1;
  std::shared_ptr<void> session;  // the ranks' session, for as long as they work together
};

// Starts the ranks (a device that does not answer is refused here, before anything is read).
GenerationRanks join_ranks(int& argc, char**& argv, DeviceChoice device);

// `dir`'s model: whole in one process (whole_model), sharded when several ranks run. Every rank
// then computes the same tokens in step; rank 0 prints.
models::Llama open_model(const GenerationRanks& ranks, const std::string& dir);

// Whether this process prints an error: once per job (every rank meets the same ones).
bool prints_errors();

// `dir`'s model, every weight read whole, on `device`.
models::Llama whole_model(const std::string& dir, Device device);

}  // namespace shardlab::apps
