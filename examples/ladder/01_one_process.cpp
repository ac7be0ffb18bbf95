// examples/ladder/01_one_process.cpp, rung 1: the tiny Llama trained by one process, nothing
// sharded: the losses every later rung prints again.
//
//   ./01_one_process --steps 20
#include "ladder.h"

int main(int argc, char** argv) {
  return ladder::run(argc, argv, "01_one_process", [](const auto& session, const ladder::Args& args) {
    SHARDLAB_CHECK(session.world_size() == 1,
                   "trains in one process, not {} (02_fully_shard is the rung that shares the work)",
                   session.world_size());
    SHARDLAB_CHECK(args.rest.empty(), "unknown argument '{}' (usage: 01_one_process [--steps N])",
                   args.rest.empty() ? "" : args.rest.front());
    shardlab::models::Llama model(ladder::config(), ladder::kSeed);
    shardlab::optim::AdamW optimizer(model->named_parameters(), ladder::kAdamW);
    ladder::train({model, optimizer, ladder::rows_of(0, 1), session.world()}, 1, args.steps);
  });
}
