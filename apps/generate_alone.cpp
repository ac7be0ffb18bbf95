// apps/generate_alone.cpp: generate's model where shardlab is built without MPI: one process, the whole
// model.
#include "apps/generate_model.h"

namespace shardlab::apps {

GenerationRanks join_ranks(int&, char**&, DeviceChoice device) { return {.device = device_for(device)}; }

models::Llama open_model(const GenerationRanks& ranks, const std::string& dir) {
  return whole_model(dir, ranks.device);
}

bool prints_errors() { return true; }

}  // namespace shardlab::apps
