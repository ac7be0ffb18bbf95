// apps/generate_ranks.cpp: generate's model where shardlab is built with MPI: alone, the whole model; under
// mpirun, FSDP over the ranks (a unit per decoder layer and the root), each rank reading only its
// shards of the files, so that no rank holds the whole model; every forward gathers the units.
#include <chrono>

#include "apps/generate_model.h"
#include "dist/comm/init.h"
#include "dist/comm/log.h"
#include "dist/fsdp/fsdp.h"
#include "recipes/llama.h"

namespace shardlab::apps {

GenerationRanks join_ranks(int& argc, char**& argv, DeviceChoice device) {
  std::shared_ptr<dist::Session> session = dist::init(argc, argv, {.device = device});
  return {.device = session->device(),
          .rank = session->rank(),
          .size = session->world_size(),
          .session = session};
}

models::Llama open_model(const GenerationRanks& ranks, const std::string& dir) {
  if (ranks.size == 1) return whole_model(dir, ranks.device);
  models::Llama model = [&] {
    const nn::DeferredInitGuard deferred;  // shapes only: each rank's shards come from the files
    return models::Llama(models::load_pretrained_config(dir), /*seed=*/0);  // every value from the files
  }();
  models::defer_to_pretrained(model, dir);
  model->to(ranks.device);
  recipes::parallelize_llama(model, {});
  const auto start = std::chrono::steady_clock::now();
  dist::sharded_parameters(*model);  // joining the units to the root reads each rank's shards
  dist::log("generate: read each rank's shards of '{}' in {:.2f} s ({} ranks)", dir,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), ranks.size);
  return model;
}

bool prints_errors() { return dist::launcher_rank() == 0; }

}  // namespace shardlab::apps
