// examples/ladder/05_tensor_parallel.cpp, rung 5: + tensor parallelism: the ranks form a dp x tp mesh
// (--tp ranks per group, consecutive ones); inside a group each layer's matrices are split (q, k, v,
// gate and up by output features, o and down by input features, the embedding and the head by
// vocabulary), and FSDP shards across the groups. The ranks of a group train on the same rows, and
// the loss is taken from this rank's vocabulary columns of the logits. The losses are rung 1's.
//
//   mpirun -np 4 ./05_tensor_parallel --steps 20 --tp 2
#include "dist/comm/mesh.h"
#include "dist/tp/cross_entropy.h"
#include "ladder.h"
#include "recipes/llama.h"

int main(int argc, char** argv) {
  using namespace shardlab;
  return ladder::run(argc, argv, "05_tensor_parallel", [](const auto& session, const ladder::Args& args) {
    SHARDLAB_CHECK(args.rest.size() == 2 && args.rest[0] == "--tp",
                   "usage: 05_tensor_parallel [--steps N] --tp T (T ranks per tensor-parallel group)");
    const int tp = static_cast<int>(ladder::positive(args.rest[1].c_str(), "--tp"));
    SHARDLAB_CHECK(session.world_size() % tp == 0, "--tp {} does not divide the {} ranks", tp,
                   session.world_size());
    const dist::DeviceMesh mesh(session.world(), {session.world_size() / tp, tp}, {"dp", "tp"});
    models::Llama model = ladder::deferred_model();
    const recipes::ParallelLlama layout = recipes::parallelize_llama(model, {.mesh = &mesh});
    optim::AdamW optimizer(model->named_parameters(), ladder::kAdamW);
    const ladder::Rung rung{model, optimizer, ladder::rows_of(mesh.coordinate("dp"), mesh.size("dp")),
                            mesh["dp"], [&](const Variable& logits, const Tensor& targets) {
                              return dist::vocab_parallel_cross_entropy(logits, targets, layout.vocabulary,
                                                                        mesh["tp"], -100, Reduction::sum);
                            }};
    ladder::train(rung, 1, args.steps);
  });
}
