// tests/dist/test_checkpoint_reader.cpp (mpirun): a checkpoint saved over all ranks with every
// strategy, read by one process: checkpoint_info tells what save_checkpoint wrote (tensors in the
// model's order), consolidate_checkpoint writes the bytes save_full_safetensors writes from the
// live model, and with --optimizer each rank finds its own optimizer state in the file; a
// corrupt checkpoint is refused, naming the file, before anything is written.
#include <mpi.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/checkpoint/checkpoint.h"
#include "dist/checkpoint/full_safetensors.h"
#include "dist/checkpoint/reader.h"
#include "nn/safetensors.h"
#include "tests/dist/save_helpers.h"

using namespace shardlab;

namespace fs = std::filesystem;

namespace {

// Elements of this rank's parameter pieces and optimizer slots that differ from the file's.
std::int64_t wrong_pieces(test::Nested& model, const optim::Optimizer& optimizer,
                          const nn::SafetensorsFile& file) {
  std::map<std::string, Tensor> in_file(file.tensors.begin(), file.tensors.end()), state;
  for (const auto& [key, tensor] : optimizer.state_dict()) state[key] = tensor;
  std::int64_t wrong = 0;
  const auto compare = [&](const Tensor& piece, const std::string& name, const dist::ParameterShard& shard) {
    const auto it = in_file.find(name);
    if (it == in_file.end()) {
      ++wrong;
      return;
    }
    const Tensor expected = it->second.reshape({-1}).narrow(0, shard.first, shard.count);
    wrong += test::count_mismatches(piece.to_vector<double>(), expected.to_vector<double>(), {0.0, 0.0});
  };
  for (const auto& [name, shard] : dist::parameter_shards(*model)) {
    if (shard.count == 0) continue;
    compare(shard.local.data(), name, shard);
    for (const std::string slot : {"exp_avg", "exp_avg_sq"}) {
      const auto it = state.find(name + "." + slot);
      if (it != state.end()) compare(it->second, "optim." + name + "." + slot, shard);
    }
  }
  return wrong;
}

}  // namespace

TEST_CASE("one process reads what a checkpoint of every strategy holds and consolidates it",
          "[dist][checkpoint_reader]") {
  const int w = test::world().size();
  for (const test::Strategy& strategy : test::strategies(w)) {
    INFO("saved over " << w << " ranks, " << test::describe(strategy));
    test::SharedDir dir;
    const std::string ckpt = dir.file("ckpt"), full = dir.file("full.safetensors");
    test::Nested model = test::make_model(test::world(), strategy);
    auto optimizer = test::make_optimizer(model);
    test::train(model, *optimizer, test::world(), 0, 2);
    const nlohmann::json extra = {{"app", "test"}, {"cursor", {1, 2}}};
    dist::save_checkpoint(ckpt, *model, *optimizer, extra);
    dist::save_full_safetensors(full, *model);

    const dist::CheckpointInfo info = dist::checkpoint_info(ckpt);  // every rank reads it alone
    CHECK(info.format == "shardlab-sharded-checkpoint");
    CHECK(info.version == 1);
    CHECK(info.world_size == w);
    CHECK(info.sharding == test::describe(strategy));
    CHECK(info.step == 2);
    CHECK(info.extra == extra);
    CHECK(info.parameter_steps.size() == 14);  // every parameter but the frozen head.bias
    REQUIRE(info.files.size() == static_cast<std::size_t>(w));
    std::int64_t on_disk = 0;
    for (const dist::CheckpointFile& file : info.files)
      on_disk += fs::file_size(dir.file("ckpt/" + file.name));
    CHECK(info.total_bytes() == on_disk);
    // The parameters in the model's order, then their slots.
    std::vector<std::string> expected;
    for (const auto& [name, shard] : dist::parameter_shards(*model)) expected.push_back(name);
    for (const auto& [name, shard] : dist::parameter_shards(*model)) {
      if (name == "head.bias") continue;
      expected.push_back("optim." + name + ".exp_avg");
      expected.push_back("optim." + name + ".exp_avg_sq");
    }
    std::vector<std::string> names;
    for (const dist::CheckpointTensor& tensor : info.tensors) names.push_back(tensor.name);
    CHECK(names == expected);
    CHECK(info.tensor("optim.embed.weight.exp_avg")->shape == Shape{test::kVocab, 7});
    CHECK(info.tensor("optim.embed.weight.exp_avg")->optimizer_slot());
    CHECK(!info.tensor("embed.weight")->optimizer_slot());

    // Rank 0 consolidates the parameters, the last rank everything: one process each, no collective.
    const std::string parameters = dir.file("parameters.safetensors"),
                      everything = dir.file("all.safetensors");
    if (test::world().rank() == 0) {
      dist::consolidate_checkpoint(ckpt, parameters);
      CHECK(test::read_file(parameters) == test::read_file(full));
    }
    if (test::world().rank() == w - 1) dist::consolidate_checkpoint(ckpt, everything, {.optimizer = true});
    MPI_Barrier(MPI_COMM_WORLD);
    const nn::SafetensorsFile file = nn::load_safetensors(everything);
    CHECK(file.metadata == std::map<std::string, std::string>{{"format", "pt"}});
    std::vector<std::string> written;
    for (const auto& [name, tensor] : file.tensors) written.push_back(name);
    CHECK(written == expected);
    CHECK(test::sum_over_ranks(wrong_pieces(model, *optimizer, file)) == 0);
  }
}

TEST_CASE("consolidate_checkpoint refuses a corrupt checkpoint before it writes anything",
          "[dist][checkpoint_reader]") {
  test::SharedDir dir;
  const std::string good = dir.file("good");
  test::Nested model = test::make_model(test::world(), {dist::Sharding::full});
  auto optimizer = test::make_optimizer(model);
  test::train(model, *optimizer, test::world(), 0, 1);
  dist::save_checkpoint(good, *model, *optimizer);
  if (test::world().rank() != 0) return;  // one process reads; the others are done

  const int w = test::world().size();
  const std::string last = fmt::format("rank-{:05}-of-{:05}.bin", w - 1, w);
  const std::int64_t bytes = static_cast<std::int64_t>(fs::file_size(good + "/" + last));
  // The tensor at the start of the last rank's file, from metadata.json itself: the one errors name.
  std::string first_tensor;
  nlohmann::json metadata;
  std::ifstream(good + "/metadata.json") >> metadata;
  for (const auto& [name, tensor] : metadata["tensors"].items()) {
    for (const auto& chunk : tensor["chunks"]) {
      if (chunk["file"] == last && chunk["offset"] == 0) first_tensor = name;
    }
  }
  struct Case {
    std::string name;
    std::function<void(const std::string&)> corrupt;  // in a copy of the good checkpoint
    std::string error;                                // after "consolidate_checkpoint: '<dir>': "
  };
  const std::vector<Case> cases = {
      {"flipped byte",
       [&](const std::string& d) {
         std::fstream file(d + "/" + last, std::ios::in | std::ios::out | std::ios::binary);
         char byte = 0;
         file.seekg(bytes - 1);
         file.read(&byte, 1);
         byte = static_cast<char>(byte ^ 0x01);
         file.seekp(bytes - 1);
         file.write(&byte, 1);
       },
       fmt::format("file '{}' (tensor '{}') fails its CRC32 check", last, first_tensor)},
      {"truncated", [&](const std::string& d) { fs::resize_file(d + "/" + last, bytes - 4); },
       fmt::format("file '{}' (tensor '{}') has {} bytes but metadata.json says {}: truncated or overwritten",
                   last, first_tensor, bytes - 4, bytes)},
      {"missing metadata", [&](const std::string& d) { fs::remove(d + "/metadata.json"); },
       "metadata.json is missing (No such file or directory): not a complete checkpoint"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const std::string path = dir.file(c.name), out = dir.file(c.name + ".safetensors");
    fs::copy(good, path, fs::copy_options::recursive);
    c.corrupt(path);
    const std::string error = test::error_of([&] { dist::consolidate_checkpoint(path, out); });
    const std::string expected = fmt::format("consolidate_checkpoint: '{}': {}", path, c.error);
    CHECK(error.substr(0, expected.size()) == expected);
    CHECK(!fs::exists(out));
  }
  // checkpoint_info reads no tensor bytes: a flipped byte passes, a truncated file does not.
  CHECK(dist::checkpoint_info(dir.file("flipped byte")).files.size() == static_cast<std::size_t>(w));
  CHECK(test::error_of([&] {
          dist::checkpoint_info(dir.file("truncated"));
        }).starts_with(fmt::format("checkpoint_info: '{}': file '{}'", dir.file("truncated"), last)));

  // An output that cannot be written leaves nothing behind, temporary file included.
  const std::string blocked = dir.file("no-such-dir/out.safetensors");
  const std::string error = test::error_of([&] { dist::consolidate_checkpoint(good, blocked); });
  CHECK(error.starts_with(fmt::format("consolidate_checkpoint: '{}': cannot open '{}.tmp-", good, blocked)));
  const fs::path taken = dir.file("taken.safetensors");
  fs::create_directories(taken / "inside");
  CHECK(test::error_of([&] { dist::consolidate_checkpoint(good, taken.string()); }).find("cannot rename") !=
        std::string::npos);
  std::vector<std::string> outputs;
  for (const auto& entry : fs::directory_iterator(dir.file(""))) {
    if (entry.path().filename().string().find(".safetensors") != std::string::npos)
      outputs.push_back(entry.path().filename());
  }
  CHECK(outputs == std::vector<std::string>{"taken.safetensors"});
}
