// tests/dist/test_checkpoint.cpp (mpirun): sharded checkpoints saved over all ranks and loaded over
// groups of every size the job allows (split communicators), for every sharding strategy: the
// gathered parameters and optimizer state come back bit for bit and the next step matches; and
// every corruption (truncated, flipped, missing file, malformed metadata, another model) is
// refused with the same named error on every rank, leaving model and optimizer as they were.
#include <mpi.h>

#include <bit>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "dist/checkpoint/checkpoint.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/dist/save_helpers.h"

using namespace shardlab;
using test::describe;
using test::error_of;
using test::kSeed;
using test::kVocab;
using test::make_model;
using test::make_optimizer;
using test::Nested;
using test::same_on_every_rank;
using test::SharedDir;
using test::strategies;
using test::Strategy;
using test::sum_over_ranks;
using test::train;
using test::world;

namespace {

namespace fs = std::filesystem;

// The full values of everything a checkpoint holds, gathered over `comm`.
struct Snapshot {
  nn::Named<Tensor> parameters;
  std::map<std::string, std::vector<float>> slots;  // "<parameter>.<slot>", where some rank has it
  std::map<std::string, std::int64_t> steps;        // per parameter; -1 without state
  std::vector<double> scalars;                      // each group's lr and weight decay, then steps()
};

Snapshot snapshot(Nested& model, const optim::AdamW& optimizer, dist::Communicator& comm) {
  Snapshot out;
  out.parameters = dist::gather_full_parameters(*model);
  std::map<std::string, Tensor> state;
  for (const auto& [key, tensor] : optimizer.state_dict()) state[key] = tensor;
  for (const auto& [name, shard] : dist::parameter_shards(*model)) {
    const std::int64_t numel = shape_numel(shard.full_shape);
    for (const std::string slot : {"exp_avg", "exp_avg_sq"}) {
      // Each rank's piece and a mask of the elements it counts; the first replica's only.
      Tensor values = zeros({numel}), mask = zeros({numel});
      const auto it = state.find(name + "." + slot);
      if (it != state.end() && shard.first_replica && shard.count > 0) {
        values.narrow(0, shard.first, shard.count).copy_(it->second);
        mask.narrow(0, shard.first, shard.count).copy_(ones({shard.count}));
      }
      Tensor all_values = empty({numel * comm.size()}), all_masks = empty({numel * comm.size()});
      comm.all_gather_into(all_values, values).wait();
      comm.all_gather_into(all_masks, mask).wait();
      const float* v = all_values.data<float>();
      const float* m = all_masks.data<float>();
      std::vector<float> full(static_cast<std::size_t>(numel));
      bool any = false;
      for (std::int64_t e = 0; e < numel; ++e) {
        for (int r = 0; r < comm.size(); ++r) {
          if (m[r * numel + e] != 0) {
            full[static_cast<std::size_t>(e)] = v[r * numel + e];
            any = true;
          }
        }
      }
      if (any) out.slots[name + "." + slot] = full;
    }
    const auto step = state.find(name + ".step");
    const Tensor agreed = full(
        {1}, step == state.end() ? std::int64_t{-1} : step->second.item<std::int64_t>(), dtype(DType::i64));
    comm.all_reduce(agreed, dist::ReduceOp::max).wait();
    out.steps[name] = agreed.item<std::int64_t>();
  }
  for (std::size_t g = 0; g < optimizer.num_groups(); ++g) {
    out.scalars.push_back(optimizer.lr(g));
    out.scalars.push_back(optimizer.options(g).weight_decay);
  }
  out.scalars.push_back(static_cast<double>(optimizer.steps()));
  return out;
}

std::int64_t bit_differences(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return static_cast<std::int64_t>(std::max(a.size(), b.size()));
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    wrong += std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]);
  return wrong;
}

std::vector<float> floats(const Tensor& tensor) { return tensor.contiguous().to_vector<float>(); }

// Values (and names) that differ at all between two snapshots, on this rank.
std::int64_t differences(const Snapshot& a, const Snapshot& b) {
  std::int64_t wrong = a.parameters.size() == b.parameters.size() ? 0 : 1;
  for (std::size_t i = 0; i < std::min(a.parameters.size(), b.parameters.size()); ++i) {
    wrong += a.parameters[i].first != b.parameters[i].first;
    wrong += bit_differences(floats(a.parameters[i].second), floats(b.parameters[i].second));
  }
  wrong += a.slots.size() != b.slots.size();
  for (const auto& [key, values] : a.slots) {
    const auto it = b.slots.find(key);
    wrong += it == b.slots.end() ? 1 : bit_differences(values, it->second);
  }
  wrong += a.steps != b.steps;
  wrong += a.scalars != b.scalars;
  return wrong;
}

std::int64_t far_apart(const nn::Named<Tensor>& a, const nn::Named<Tensor>& b, test::Tolerance tolerance) {
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    wrong +=
        test::count_mismatches(a[i].second.to_vector<double>(), b[i].second.to_vector<double>(), tolerance);
  }
  return wrong;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_json(const std::string& path, const nlohmann::json& value) {
  std::ofstream out(path, std::ios::trunc);
  out << value.dump(1);
}

}  // namespace

TEST_CASE("checkpoints saved over all ranks load over groups of every size and strategy, bit for bit",
          "[dist][checkpoint]") {
  const int w = world().size(), r = world().rank();
  for (const Strategy& saved_as : strategies(w)) {
    INFO("saved over " << w << " ranks, " << describe(saved_as));
    SharedDir dir;
    const std::string path = dir.file("ckpt");
    Nested model = make_model(world(), saved_as);
    auto optimizer = make_optimizer(model);
    train(model, *optimizer, world(), 0, 2);
    const nlohmann::json extra = {{"epoch", 2}, {"cursor", {1, 2, 3}}, {"rng", "0x1234"}};
    dist::save_checkpoint(path, *model, *optimizer, extra);
    const Snapshot saved = snapshot(model, *optimizer, world());
    CHECK(saved.steps.at("head.bias") == -1);  // frozen: no state, none saved
    CHECK(saved.steps.at("embed.weight") == 2);
    train(model, *optimizer, world(), 2, 1);  // the step the loads must match
    const nn::Named<Tensor> next = dist::gather_full_parameters(*model);

    const nlohmann::json metadata = read_json(path + "/metadata.json");
    CHECK(metadata["format"] == "shardlab-sharded-checkpoint");
    CHECK(metadata["version"] == 1);
    CHECK(metadata["world_size"] == w);
    CHECK(metadata["sharding"] == describe(saved_as));
    CHECK(metadata["extra"] == extra);
    CHECK(metadata["files"].size() == static_cast<std::size_t>(w));
    CHECK(metadata["optimizer"]["step"] == 2);
    CHECK(!metadata["tensors"].contains("optim.head.bias.exp_avg"));
    CHECK(metadata["tensors"]["optim.embed.weight.exp_avg_sq"]["shape"] == nlohmann::json({kVocab, 7}));
    std::int64_t total = 0;
    for (const auto& [name, file] : metadata["files"].items()) total += file["bytes"].get<std::int64_t>();
    // Each element once: 3 blocks + embedding + head; Adam's two slots for all but the frozen bias.
    const std::int64_t parameters = 247 + 277 + 247 + 2 * kVocab * 7 + kVocab;
    CHECK(total == 4 * (parameters + 2 * (parameters - kVocab)));

    std::int64_t wrong = 0, wrong_next = 0;
    for (int m = 1; m <= w; ++m) {
      auto group = world().split(r / m, r, "load");
      for (const Strategy& loaded_as : strategies(group->size())) {
        INFO("loaded over " << group->size() << " ranks, " << describe(loaded_as));
        Nested fresh = make_model(*group, loaded_as, kSeed + 1);
        auto fresh_optimizer = make_optimizer(fresh, 5e-3);
        train(fresh, *fresh_optimizer, *group, 5, 1);  // state to replace
        CHECK(dist::load_checkpoint(path, *fresh, *fresh_optimizer) == extra);
        wrong += differences(saved, snapshot(fresh, *fresh_optimizer, *group));
        train(fresh, *fresh_optimizer, *group, 2, 1);
        const nn::Named<Tensor> after = dist::gather_full_parameters(*fresh);
        // Bitwise where the arithmetic is the same (the same ranks and strategy); else the
        // gradient averages differ in their rounding only.
        const bool same = group->size() == w && describe(loaded_as) == describe(saved_as);
        wrong_next += far_apart(after, next, same ? test::Tolerance{0, 0} : test::Tolerance{1e-5, 1e-4});
      }
    }
    CHECK(sum_over_ranks(wrong) == 0);
    CHECK(sum_over_ranks(wrong_next) == 0);
  }
}

TEST_CASE("a checkpoint saved over N ranks loads over M ranks for every N and M the job allows",
          "[dist][checkpoint]") {
  const int w = world().size(), r = world().rank();
  SharedDir dir;
  // The truth, the same on every rank: a model trained alone, which rank 0 saves as the origin.
  auto alone = world().split(r, 0, "alone");
  Nested model = make_model(*alone, {dist::Sharding::full});
  auto optimizer = make_optimizer(model);
  train(model, *optimizer, *alone, 0, 2);
  const Snapshot truth = snapshot(model, *optimizer, *alone);
  if (r == 0) dist::save_checkpoint(dir.file("origin"), *model, *optimizer, {{"from", 1}});
  MPI_Barrier(MPI_COMM_WORLD);

  std::int64_t wrong = 0;
  for (int n = 1; n <= w; ++n) {
    auto savers = world().split(r < n ? 0 : 1, r, "save");
    for (std::size_t s = 0; s < strategies(n).size(); ++s) {
      // Ranks 0..n-1 load the origin and save it again over n ranks with strategy s.
      const std::string saved = dir.file(fmt::format("n{}-s{}", n, s));
      if (r < n) {
        Nested source = make_model(*savers, strategies(n)[s], kSeed + 2);
        auto source_optimizer = make_optimizer(source);
        dist::load_checkpoint(dir.file("origin"), *source, *source_optimizer);
        dist::save_checkpoint(saved, *source, *source_optimizer, {{"from", n}});
      }
      MPI_Barrier(MPI_COMM_WORLD);
      for (int m = 1; m <= w; ++m) {
        auto group = world().split(r / m, r, "load");
        const Strategy loaded_as = strategies(group->size())[(s + static_cast<std::size_t>(m)) % 4];
        INFO("saved over " << n << " ranks " << describe(strategies(n)[s]) << ", loaded over "
                           << group->size() << " ranks " << describe(loaded_as));
        Nested fresh = make_model(*group, loaded_as, kSeed + 1);
        auto fresh_optimizer = make_optimizer(fresh, 5e-3);
        CHECK(dist::load_checkpoint(saved, *fresh, *fresh_optimizer) == nlohmann::json{{"from", n}});
        wrong += differences(truth, snapshot(fresh, *fresh_optimizer, *group));
      }
    }
  }
  CHECK(sum_over_ranks(wrong) == 0);
}

TEST_CASE("save_checkpoint replaces an older checkpoint whole and leaves no temporary directory",
          "[dist][checkpoint]") {
  SharedDir dir;
  const std::string path = dir.file("ckpt");
  Nested model = make_model(world(), {dist::Sharding::full});
  auto optimizer = make_optimizer(model);
  train(model, *optimizer, world(), 0, 1);
  dist::save_checkpoint(path, *model, *optimizer, {{"step", 1}});
  train(model, *optimizer, world(), 1, 1);
  dist::save_checkpoint(path + "/", *model, *optimizer, {{"step", 2}});
  const Snapshot saved = snapshot(model, *optimizer, world());

  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(fs::path(path).parent_path()))
    names.push_back(entry.path().filename());
  CHECK(names == std::vector<std::string>{"ckpt"});
  Nested fresh = make_model(world(), {dist::Sharding::full}, kSeed + 1);
  auto fresh_optimizer = make_optimizer(fresh);
  CHECK(dist::load_checkpoint(path, *fresh, *fresh_optimizer) == nlohmann::json{{"step", 2}});
  CHECK(sum_over_ranks(differences(saved, snapshot(fresh, *fresh_optimizer, world()))) == 0);
  // A save that cannot write is refused on every rank alike, and the checkpoint stays.
  if (world().rank() == 0) std::ofstream(dir.file("a-file")) << "x";
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string refused =
      error_of([&] { dist::save_checkpoint(dir.file("a-file/ckpt"), *model, *optimizer); });
  CHECK(refused.starts_with(fmt::format("save_checkpoint: '{}': ", dir.file("a-file/ckpt"))));
  CHECK(same_on_every_rank(refused));
  // A save that died before its rename leaves a temporary directory, never a changed checkpoint.
  if (world().rank() == 0) fs::create_directory(path + ".tmp-00000000deadbeef");
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(dist::load_checkpoint(path, *fresh, *fresh_optimizer) == nlohmann::json{{"step", 2}});
}

TEST_CASE("load_checkpoint refuses a corrupt or foreign checkpoint on every rank and changes nothing",
          "[dist][checkpoint]") {
  const int w = world().size();
  SharedDir dir;
  const std::string good = dir.file("good");
  {
    Nested model = make_model(world(), {dist::Sharding::full});
    auto optimizer = make_optimizer(model);
    train(model, *optimizer, world(), 0, 2);
    dist::save_checkpoint(good, *model, *optimizer);
  }
  const nlohmann::json metadata = read_json(good + "/metadata.json");
  const auto rank_file = [&](int rank) { return fmt::format("rank-{:05}-of-{:05}.bin", rank, w); };
  const auto bytes_of = [&](int rank) {
    return metadata["files"][rank_file(rank)]["bytes"].get<std::int64_t>();
  };
  // The tensor at the start of a rank's file: the one its errors name.
  const auto first_tensor = [&](int rank) {
    for (const auto& [name, tensor] : metadata["tensors"].items()) {
      for (const auto& chunk : tensor["chunks"]) {
        if (chunk["file"] == rank_file(rank) && chunk["offset"] == 0) return name;
      }
    }
    return std::string("?");
  };
  const std::string first0 = first_tensor(0), last = rank_file(w - 1);
  const auto& embed_chunk = metadata["tensors"]["embed.weight"]["chunks"][0];
  const std::int64_t embed_count = embed_chunk["count"];
  const auto with_version = [&](int version) {
    nlohmann::json m = metadata;
    m["version"] = version;
    return m;
  };
  // embed.weight's chunk 0 as `runs` runs `stride` apart, in a checkpoint of format `version`.
  const auto with_embed_runs = [&](int version, std::int64_t runs, std::int64_t stride) {
    nlohmann::json m = with_version(version);
    m["tensors"]["embed.weight"]["chunks"][0]["runs"] = runs;
    m["tensors"]["embed.weight"]["chunks"][0]["stride"] = stride;
    return m;
  };

  // The target: another model with state of its own, which must come out untouched.
  Nested model = make_model(world(), {dist::Sharding::full}, kSeed + 1);
  auto optimizer = make_optimizer(model, 5e-3);
  train(model, *optimizer, world(), 4, 1);
  const Snapshot before = snapshot(model, *optimizer, world());

  struct Case {
    std::string name;
    std::function<void(const std::string&)> corrupt;  // on rank 0, in a copy of the good checkpoint
    std::string error;                                // after "load_checkpoint: '<dir>': "
  };
  const std::vector<Case> cases = {
      {"truncated", [&](const std::string& d) { fs::resize_file(d + "/" + rank_file(0), bytes_of(0) - 4); },
       fmt::format("file '{}' (tensor '{}') has {} bytes but metadata.json says {}: truncated or overwritten",
                   rank_file(0), first0, bytes_of(0) - 4, bytes_of(0))},
      {"flipped byte",
       [&](const std::string& d) {
         std::fstream file(d + "/" + rank_file(0), std::ios::in | std::ios::out | std::ios::binary);
         char byte = 0;
         file.seekg(5);
         file.read(&byte, 1);
         byte = static_cast<char>(byte ^ 0x10);
         file.seekp(5);
         file.write(&byte, 1);
       },
       fmt::format("file '{}' (tensor '{}') fails its CRC32 check", rank_file(0), first0)},
      {"missing file", [&](const std::string& d) { fs::remove(d + "/" + last); },
       fmt::format("file '{}' (tensor '{}') is missing: No such file or directory", last,
                   first_tensor(w - 1))},
      {"missing metadata", [&](const std::string& d) { fs::remove(d + "/metadata.json"); },
       "metadata.json is missing (No such file or directory): not a complete checkpoint"},
      {"metadata not JSON", [&](const std::string& d) { fs::resize_file(d + "/metadata.json", 100); },
       "metadata.json: not valid JSON: "},
      {"missing field",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         m["tensors"]["blocks.1.up.bias"].erase("dtype");
         write_json(d + "/metadata.json", m);
       },
       "metadata.json: tensor 'blocks.1.up.bias' has no 'dtype'"},
      {"wrong type",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         m["tensors"]["embed.weight"]["chunks"][0]["count"] = "12";
         write_json(d + "/metadata.json", m);
       },
       "metadata.json: tensor 'embed.weight' chunk 0 has 'count' = \"12\", expected a non-negative integer"},
      {"chunk beyond its file",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         m["tensors"]["embed.weight"]["chunks"][0]["offset"] = bytes_of(0);
         write_json(d + "/metadata.json", m);
       },
       fmt::format(
           "metadata.json: tensor 'embed.weight' chunk 0 holds bytes [{}, {}) of file '{}', beyond its {} "
           "bytes",
           bytes_of(0), bytes_of(0) + embed_chunk["bytes"].get<std::int64_t>(),
           embed_chunk["file"].get<std::string>(), bytes_of(0))},
      {"chunks overlapping",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         auto& chunks = m["tensors"]["head.bias"]["chunks"];
         chunks.push_back(chunks[0]);
         write_json(d + "/metadata.json", m);
       },
       fmt::format("metadata.json: tensor 'head.bias' has chunks overlapping at element {} (in file '{}')",
                   metadata["tensors"]["head.bias"]["chunks"][0]["first"].get<std::int64_t>(),
                   metadata["tensors"]["head.bias"]["chunks"][0]["file"].get<std::string>())},
      {"unexpected tensor",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         m["tensors"]["extra.weight"] = m["tensors"]["head.bias"];
         write_json(d + "/metadata.json", m);
       },
       fmt::format("metadata.json: tensor 'extra.weight' is not a parameter of the model (file '{}')",
                   metadata["tensors"]["head.bias"]["chunks"][0]["file"].get<std::string>())},
      {"missing tensor",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         m["tensors"].erase("blocks.2.down.weight");
         write_json(d + "/metadata.json", m);
       },
       "metadata.json: the model's parameter 'blocks.2.down.weight' is not in the checkpoint"},
      {"dtype",
       [&](const std::string& d) {
         nlohmann::json m = metadata;
         m["tensors"]["head.weight"]["dtype"] = "BF16";
         write_json(d + "/metadata.json", m);
       },
       "metadata.json: tensor 'head.weight' has dtype 'BF16', expected 'F32'"},
      {"a later version", [&](const std::string& d) { write_json(d + "/metadata.json", with_version(3)); },
       "metadata.json: format version 3, this shardlab reads versions 1 to 2"},
      {"runs in version 1",
       [&](const std::string& d) { write_json(d + "/metadata.json", with_embed_runs(1, 1, 0)); },
       "metadata.json: tensor 'embed.weight' chunk 0 has 'runs', which format version 1 does not have"},
      {"no runs", [&](const std::string& d) { write_json(d + "/metadata.json", with_embed_runs(2, 0, 0)); },
       "metadata.json: tensor 'embed.weight' chunk 0 has 'runs' = 0, expected at least 1"},
      {"runs overlapping",
       [&](const std::string& d) {
         write_json(d + "/metadata.json", with_embed_runs(2, 2, embed_count - 1));
       },
       fmt::format(
           "metadata.json: tensor 'embed.weight' chunk 0 has runs of {} elements {} apart: they overlap",
           embed_count, embed_count - 1)},
      {"runs beyond the tensor",
       [&](const std::string& d) { write_json(d + "/metadata.json", with_embed_runs(2, 2, 17 * 7)); },
       fmt::format(
           "metadata.json: tensor 'embed.weight' chunk 0 holds elements beyond the tensor's 119: 2 runs "
           "of {} from {}, 119 apart",
           embed_count, embed_chunk["first"].get<std::int64_t>())},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    INFO(c.name);
    const std::string path = dir.file("case-" + std::to_string(i));
    if (world().rank() == 0) {
      fs::copy(good, path, fs::copy_options::recursive);
      c.corrupt(path);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const std::string error = error_of([&] { dist::load_checkpoint(path, *model, *optimizer); });
    const std::string expected = fmt::format("load_checkpoint: '{}': {}", path, c.error);
    CHECK(error.substr(0, expected.size()) == expected);
    CHECK(same_on_every_rank(error));
    CHECK(sum_over_ranks(differences(before, snapshot(model, *optimizer, world()))) == 0);
  }

  // Another model: a shape mismatch, named.
  Nested other = make_model(world(), {dist::Sharding::full}, kSeed, kVocab - 4);
  auto other_optimizer = make_optimizer(other);
  const std::string error = error_of([&] { dist::load_checkpoint(good, *other, *other_optimizer); });
  CHECK(error ==
        fmt::format("load_checkpoint: '{}': metadata.json: tensor 'embed.weight' has shape [17, 7] in the "
                    "checkpoint but [13, 7] in the model",
                    good));
  // An optimizer of another type: its own refusal, on every rank, and nothing changed.
  optim::SGD sgd(dist::sharded_parameters(*model), {.lr = 0.1, .momentum = 0.9});
  const std::string refused = error_of([&] { dist::load_checkpoint(good, *model, sgd); });
  CHECK(refused.starts_with(fmt::format("load_checkpoint: '{}': SGD.load_state_dict: ", good)));
  CHECK(same_on_every_rank(refused));
  CHECK(sum_over_ranks(differences(before, snapshot(model, *optimizer, world()))) == 0);
}
