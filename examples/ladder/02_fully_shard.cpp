// examples/ladder/02_fully_shard.cpp, rung 2: + FSDP. Each rank trains on its rows of the global
// batch; every decoder layer is an FSDP unit (gathered for its forward and backward, its gradients
// reduce-scattered), the root keeps the embedding, the final norm and the head. The model is made
// with shapes only, so no rank ever holds all of it, and the optimizer holds this rank's shards.
// The losses are rung 1's.
//
//   mpirun -np 2 ./02_fully_shard --steps 20
#include "ladder.h"
#include "recipes/llama.h"

int main(int argc, char** argv) {
  return ladder::run(argc, argv, "02_fully_shard", [](const auto& session, const ladder::Args& args) {
    SHARDLAB_CHECK(args.rest.empty(), "unknown argument '{}' (usage: 02_fully_shard [--steps N])",
                   args.rest.empty() ? "" : args.rest.front());
    shardlab::models::Llama model = ladder::deferred_model();
    shardlab::recipes::apply_fsdp(model, {});  // FSDP2's fully_shard per layer, then the root
    shardlab::optim::AdamW optimizer(model->named_parameters(), ladder::kAdamW);  // the shards
    const ladder::Rows rows = ladder::rows_of(session.rank(), session.world_size());
    ladder::train({model, optimizer, rows, session.world()}, 1, args.steps);
  });
}
