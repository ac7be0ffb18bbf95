// examples/ladder/04_checkpoint.cpp, rung 4: + checkpoint and resume. With --save-at K --dir D it
// trains steps 1..K and saves the model's and the optimizer's shards to D, each rank writing its own;
// with --resume D it loads them, at any number of ranks, and trains from K + 1. Saved at 2 ranks and
// resumed at 3, the losses are rung 1's.
//
//   mpirun -np 2 ./04_checkpoint --steps 20 --save-at 10 --dir ckpt
//   mpirun -np 3 ./04_checkpoint --steps 20 --resume ckpt
#include <string>

#include "dist/checkpoint/checkpoint.h"
#include "ladder.h"
#include "recipes/llama.h"

int main(int argc, char** argv) {
  using namespace shardlab;
  return ladder::run(argc, argv, "04_checkpoint", [](const auto& session, const ladder::Args& args) {
    std::int64_t save_at = 0;
    std::string dir, resume;
    for (std::size_t i = 0; i < args.rest.size(); i += 2) {
      const std::string& flag = args.rest[i];
      SHARDLAB_CHECK(
          flag == "--save-at" || flag == "--dir" || flag == "--resume",
          "unknown argument '{}' (usage: 04_checkpoint [--steps N] (--save-at K --dir D | --resume D))",
          flag);
      SHARDLAB_CHECK(i + 1 < args.rest.size(), "{} wants a value", flag);
      const std::string& value = args.rest[i + 1];
      if (flag == "--save-at") save_at = ladder::positive(value.c_str(), flag);
      if (flag == "--dir") dir = value;
      if (flag == "--resume") resume = value;
    }
    SHARDLAB_CHECK(
        (save_at > 0 && !dir.empty() && resume.empty()) || (save_at == 0 && dir.empty() && !resume.empty()),
        "give --save-at K with --dir D, or --resume D");
    models::Llama model = ladder::deferred_model();
    recipes::apply_fsdp(model, {});
    optim::AdamW optimizer(model->named_parameters(), ladder::kAdamW);
    const ladder::Rung rung{model, optimizer, ladder::rows_of(session.rank(), session.world_size()),
                            session.world()};
    if (!resume.empty()) {
      // Each rank reads the byte ranges of its own shards, whatever the world size that saved them.
      const std::int64_t done =
          dist::load_checkpoint(resume, *model, optimizer).at("step").get<std::int64_t>();
      dist::log("resumed from {} after step {}", resume, done);
      ladder::train(rung, done + 1, args.steps);
      return;
    }
    ladder::train(rung, 1, save_at);
    dist::save_checkpoint(dir, *model, optimizer, {{"step", save_at}});
    dist::log("saved step {} to {}", save_at, dir);
  });
}
