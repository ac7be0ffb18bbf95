// examples/ladder/03_mixed_precision.cpp, rung 3: + bf16 and activation checkpointing. The units
// gather their parameters in bf16 and compute in it, the gradients are reduced in f32 into f32
// master shards (the optimizer's); each decoder layer's forward runs again in its backward instead of
// keeping its activations. The losses are rung 1's to about 1e-2.
//
//   mpirun -np 2 ./03_mixed_precision --steps 20
#include "ladder.h"
#include "recipes/llama.h"

int main(int argc, char** argv) {
  using namespace shardlab;
  return ladder::run(argc, argv, "03_mixed_precision", [](const auto& session, const ladder::Args& args) {
    SHARDLAB_CHECK(args.rest.empty(), "unknown argument '{}' (usage: 03_mixed_precision [--steps N])",
                   args.rest.empty() ? "" : args.rest.front());
    models::Llama model = ladder::deferred_model();
    recipes::apply_activation_checkpointing(model);  // before FSDP, as torchtitan orders them
    recipes::apply_fsdp(model, {.mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32}});
    optim::AdamW optimizer(model->named_parameters(), ladder::kAdamW);
    const ladder::Rows rows = ladder::rows_of(session.rank(), session.world_size());
    ladder::train({model, optimizer, rows, session.world()}, 1, args.steps);
  });
}
