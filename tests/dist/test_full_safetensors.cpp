// tests/dist/test_full_safetensors.cpp (mpirun): save_full_safetensors over every sharding strategy
// writes, from the shards alone, the very bytes nn::save_safetensors writes from the gathered
// parameters (a 1-process model's file), for the Nested model and the tiny Llama, fresh and after
// an optimizer step; a save that fails is refused on every rank alike and leaves no file behind.
// save_pretrained_safetensors cuts the files as save_pretrained does (by hand), writes the gathered
// values in f32 and bf16 with an index naming each tensor's file, removes an earlier save's stale
// files, and what it wrote reads back, each rank its shards, to the same parameters.
#include <mpi.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "autograd/functional.h"
#include "dist/checkpoint/full_safetensors.h"
#include "models/llama.h"
#include "nn/safetensors.h"
#include "tests/dist/save_helpers.h"

using namespace shardlab;

namespace {

constexpr std::int64_t kSeq = 6;

// The tiny Llama (layers of 16400 parameters: uneven shards at 3 ranks) sharded by decoder layer.
models::Llama sharded_llama(dist::Communicator& comm, const test::Strategy& strategy) {
  models::Llama model(models::LlamaConfig::preset("tiny"), /*seed=*/3);
  const dist::FsdpOptions options{
      .sharding = strategy.sharding, .hybrid_group_size = strategy.group, .communicator = &comm};
  for (auto& layer : *model->model->layers) dist::fully_shard(*layer, options);
  dist::fully_shard(*model, options);
  return model;
}

// One AdamW step on this rank's rows of a fixed batch of 4 sequences.
void train_llama_step(models::Llama& model, dist::Communicator& comm) {
  const std::int64_t vocab = model->config.vocab_size;
  std::vector<std::int64_t> tokens, targets;
  for (std::int64_t row = comm.rank(); row < 4; row += comm.size()) {
    for (std::int64_t t = 0; t < kSeq; ++t) {
      tokens.push_back((row * 37 + t * 11 + 5) % vocab);
      targets.push_back((row * 13 + t * 7 + 1) % vocab);
    }
  }
  const auto rows = static_cast<std::int64_t>(tokens.size()) / kSeq;
  optim::AdamW optimizer(dist::sharded_parameters(*model), {.lr = 1e-2});
  const Variable logits = model(from_vector(tokens, {rows, kSeq}));
  cross_entropy(reshape(logits, {-1, vocab}), from_vector(targets, {rows * kSeq})).backward();
  optimizer.step();
}

// Whether `path` holds the bytes of rank 0's nn::save_safetensors of the gathered parameters (a
// collective: every rank gathers; rank 0 writes and compares), on every rank.
bool equals_gathered(nn::Module& model, const std::string& path, const std::string& reference,
                     const std::map<std::string, std::string>& metadata = {{"format", "pt"}}) {
  const nn::Named<Tensor> gathered = dist::gather_full_parameters(model);
  std::int64_t different = 0;
  if (test::world().rank() == 0) {
    nn::save_safetensors(reference, gathered, metadata);
    different = test::read_file(path) != test::read_file(reference);
  }
  return test::sum_over_ranks(different) == 0;
}

// The file one process writes of a model never sharded, trained on nothing: what a fresh sharded
// model's file must equal.
std::string one_process_file(const nn::Module& model, const test::SharedDir& dir, const std::string& name) {
  const std::string path = dir.file(name);
  if (test::world().rank() == 0) nn::save_safetensors(path, model.state_dict(), {{"format", "pt"}});
  MPI_Barrier(MPI_COMM_WORLD);
  return path;
}

}  // namespace

TEST_CASE("save_full_safetensors writes the bytes of the gathered parameters for every strategy",
          "[dist][full_safetensors]") {
  test::SharedDir dir;
  test::Nested alone(test::kVocab, test::kSeed);
  const std::string nested_file = one_process_file(*alone, dir, "nested-alone.safetensors");
  models::Llama llama_alone(models::LlamaConfig::preset("tiny"), /*seed=*/3);
  const std::string llama_file = one_process_file(*llama_alone, dir, "llama-alone.safetensors");

  for (const test::Strategy& strategy : test::strategies(test::world().size())) {
    INFO(test::world().size() << " ranks, " << test::describe(strategy));
    const std::string name = test::describe(strategy);
    test::Nested nested = test::make_model(test::world(), strategy);
    const std::string path = dir.file(name + "-nested.safetensors");
    dist::save_full_safetensors(path, *nested);
    CHECK(test::read_file(path) == test::read_file(nested_file));
    auto optimizer = test::make_optimizer(nested);
    test::train(nested, *optimizer, test::world(), 0, 2);
    const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"model", "Nested"}};
    dist::save_full_safetensors(path, *nested, {.metadata = metadata});  // replaces the fresh file
    CHECK(equals_gathered(*nested, path, dir.file(name + "-nested-gathered.safetensors"), metadata));

    models::Llama llama = sharded_llama(test::world(), strategy);
    const std::string llama_path = dir.file(name + "-llama.safetensors");
    dist::save_full_safetensors(llama_path, *llama);
    CHECK(test::read_file(llama_path) == test::read_file(llama_file));
    train_llama_step(llama, test::world());
    dist::save_full_safetensors(llama_path, *llama);
    CHECK(equals_gathered(*llama, llama_path, dir.file(name + "-llama-gathered.safetensors")));
    CHECK(test::read_file(llama_path) != test::read_file(llama_file));  // the step changed the values
  }
}

namespace {

// A linear layer and a persistent buffer (a running statistic), which the file cannot hold.
class WithBufferImpl : public nn::Module {
 public:
  WithBufferImpl() : nn::Module("WithBuffer"), linear(nn::LinearOptions(3, 2)) {
    register_module("linear", linear.ptr());
    register_buffer("running_mean", zeros({2}));
    nn::initialize(*this, 1);
  }
  nn::Linear linear;
};

}  // namespace

TEST_CASE("save_full_safetensors refuses on every rank alike and leaves no file behind",
          "[dist][full_safetensors]") {
  test::SharedDir dir;
  test::Nested model = test::make_model(test::world(), {dist::Sharding::full});
  // What the directory holds, seen by every rank between two barriers (before rank 0 changes it).
  const auto entries = [&] {
    MPI_Barrier(MPI_COMM_WORLD);
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir.file("")))
      names.push_back(entry.path().filename());
    std::sort(names.begin(), names.end());
    MPI_Barrier(MPI_COMM_WORLD);
    return names;
  };

  const std::string missing = dir.file("missing/model.safetensors");
  const std::string error = test::error_of([&] { dist::save_full_safetensors(missing, *model); });
  CHECK(
      error.starts_with(fmt::format("save_full_safetensors: '{}': cannot open '{}.tmp-", missing, missing)));
  CHECK(error.ends_with("': No such file or directory"));
  CHECK(test::same_on_every_rank(error));
  CHECK(entries().empty());

  // The rename fails (a non-empty directory has the name) after every rank wrote: the temporary
  // file goes.
  if (test::world().rank() == 0) {
    std::filesystem::create_directories(dir.file("taken/inside"));
  }
  const std::string taken = dir.file("taken");
  const std::string refused = test::error_of([&] { dist::save_full_safetensors(taken, *model); });
  CHECK(
      refused.starts_with(fmt::format("save_full_safetensors: '{}': cannot rename '{}.tmp-", taken, taken)));
  CHECK(test::same_on_every_rank(refused));
  CHECK(entries() == std::vector<std::string>{"taken"});

  const std::string path = dir.file("buffer.safetensors");
  auto with_buffer = std::make_shared<WithBufferImpl>();
  dist::fully_shard(*with_buffer, {.communicator = &test::world()});
  const std::string buffer_error = test::error_of([&] { dist::save_full_safetensors(path, *with_buffer); });
  CHECK(buffer_error ==
        fmt::format("save_full_safetensors: '{}': buffer 'running_mean' is persistent model state, "
                    "and only parameters are written",
                    path));
  CHECK(test::same_on_every_rank(buffer_error));
  CHECK(entries() == std::vector<std::string>{"taken"});
}

TEST_CASE("split_into_files cuts tensors as save_pretrained's max_shard_size cuts them",
          "[dist][full_safetensors]") {
  using Files = std::vector<std::vector<std::size_t>>;
  CHECK(dist::split_into_files({4, 4, 4}, 0) == Files{{0, 1, 2}});   // no bound: one file
  CHECK(dist::split_into_files({4, 4, 4}, 12) == Files{{0, 1, 2}});  // the bound reached, not passed
  CHECK(dist::split_into_files({4, 4, 4}, 8) == Files{{0, 1}, {2}});
  CHECK(dist::split_into_files({4, 5, 4}, 8) == Files{{0}, {1}, {2}});
  // A tensor past the bound gets a file of its own where it comes; the open file goes on after it.
  CHECK(dist::split_into_files({3, 20, 4, 1}, 8) == Files{{1}, {0, 2, 3}});
  CHECK(dist::split_into_files({20, 30}, 8) == Files{{0}, {1}});
  CHECK(dist::split_into_files({}, 8) == Files{{}});
}

namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The names in `dir`, sorted.
std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// Rank 0 checks `dir` against the gathered parameters: the files of a save cut at `max_bytes` in
// `dtype` (each element the gathered f32 rounded to it, by float_to_bf16 for bf16), the index naming
// each tensor's file and the total bytes, and nothing else but `others`. Every rank returns the
// number of problems.
std::int64_t check_pretrained_dir(const std::string& dir, const nn::Named<Tensor>& gathered,
                                  std::uint64_t max_bytes, DType dtype,
                                  const std::vector<std::string>& others) {
  if (test::world().rank() != 0) return test::sum_over_ranks(0);
  std::int64_t problems = 0;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) ++problems;
    INFO(what);
    CHECK(ok);
  };
  std::vector<std::uint64_t> bytes;
  for (const auto& [name, tensor] : gathered) bytes.push_back(tensor.numel() * dtype_size(dtype));
  const auto files = dist::split_into_files(bytes, max_bytes);
  expect(files.size() >= 3, "the bound cuts the model into several files");
  std::vector<std::string> expected_names = others;
  expected_names.push_back("model.safetensors.index.json");
  for (std::size_t k = 0; k < files.size(); ++k)
    expected_names.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, files.size()));
  std::sort(expected_names.begin(), expected_names.end());
  expect(listing(dir) == expected_names, "the directory holds the files and the index, and no stale file");

  const nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
  std::uint64_t total = 0;
  for (const std::uint64_t b : bytes) total += b;
  expect(index["metadata"]["total_size"] == total, "total_size is the tensors' bytes");
  expect(index["weight_map"].size() == gathered.size(), "the index names every tensor");
  for (std::size_t k = 0; k < files.size(); ++k) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, files.size());
    const nn::SafetensorsFile loaded = nn::load_safetensors(dir + "/" + file);
    expect(loaded.metadata == std::map<std::string, std::string>{{"format", "pt"}}, file + ": metadata");
    expect(loaded.tensors.size() == files[k].size(), file + ": its tensors");
    for (std::size_t j = 0; j < std::min(files[k].size(), loaded.tensors.size()); ++j) {
      const auto& [name, want] = gathered[files[k][j]];
      const Tensor& got = loaded.tensors[j].second;
      expect(loaded.tensors[j].first == name && index["weight_map"][name] == file, name + ": its file");
      expect(got.dtype() == dtype && got.shape() == want.shape(), name + ": dtype and shape");
      const std::vector<float> values = want.to_vector<float>();
      if (dtype == DType::f32) {
        expect(got.to_vector<float>() == values, name + ": the gathered values");
        continue;
      }
      const auto* halves = static_cast<const bf16*>(got.raw_data());
      std::int64_t wrong = 0;
      for (std::size_t e = 0; e < values.size(); ++e)
        wrong += halves[e].bits != float_to_bf16(values[e]).bits;
      expect(wrong == 0, name + ": each value rounded to bf16");
    }
  }
  return test::sum_over_ranks(problems);
}

}  // namespace

TEST_CASE(
    "save_pretrained_safetensors writes Hugging Face's sharded form, which reads back to the same parameters",
    "[dist][full_safetensors][pretrained]") {
  test::SharedDir dir;
  const models::LlamaConfig config = models::LlamaConfig::preset("tiny");
  constexpr std::uint64_t kMaxBytes = 40000;  // a decoder layer's matrices: 4096 to 16384 bytes in f32
  for (const test::Strategy& strategy : test::strategies(test::world().size())) {
    INFO(test::world().size() << " ranks, " << test::describe(strategy));
    models::Llama llama = sharded_llama(test::world(), strategy);
    train_llama_step(llama, test::world());
    const nn::Named<Tensor> gathered = dist::gather_full_parameters(*llama);

    // An earlier save's files, which the new one must not leave behind, and a file of the user's.
    const std::string out = dir.file(test::describe(strategy) + "-pretrained");
    if (test::world().rank() == 0) {
      std::filesystem::create_directories(out);
      for (const char* stale : {"model.safetensors", "model-00001-of-00009.safetensors", "notes.txt"})
        std::ofstream(out + "/" + stale) << "stale";
    }
    MPI_Barrier(MPI_COMM_WORLD);
    dist::save_pretrained_safetensors(out, *llama, kMaxBytes);
    CHECK(check_pretrained_dir(out, gathered, kMaxBytes, DType::f32, {"notes.txt"}) == 0);

    // Read back, each rank its shards (FSDP draws them at the first forward), under another sharding.
    models::Llama back = [&] {
      const nn::DeferredInitGuard deferred;
      return models::Llama(config);
    }();
    models::defer_to_pretrained(back, out);
    for (auto& layer : *back->model->layers) dist::fully_shard(*layer, {.communicator = &test::world()});
    dist::fully_shard(*back, {.communicator = &test::world()});
    {
      const NoGradGuard no_grad;
      back(from_vector(std::vector<std::int64_t>{1, 2, 3}, {1, 3}));
    }
    const nn::Named<Tensor> read = dist::gather_full_parameters(*back);
    REQUIRE(read.size() == gathered.size());
    for (std::size_t i = 0; i < read.size(); ++i) {
      INFO(read[i].first);
      CHECK(read[i].first == gathered[i].first);
      CHECK(read[i].second.to_vector<float>() == gathered[i].second.to_vector<float>());
    }

    // bf16 into a fresh directory; a later save without a bound leaves model.safetensors alone.
    const std::string halves = dir.file(test::describe(strategy) + "-bf16");
    if (test::world().rank() == 0) std::filesystem::create_directories(halves);
    MPI_Barrier(MPI_COMM_WORLD);
    dist::save_pretrained_safetensors(halves, *llama, kMaxBytes / 2, {.dtype = DType::bf16});
    CHECK(check_pretrained_dir(halves, gathered, kMaxBytes / 2, DType::bf16, {}) == 0);
    dist::save_pretrained_safetensors(halves, *llama, 0, {.dtype = DType::bf16});
    if (test::world().rank() == 0) CHECK(listing(halves) == std::vector<std::string>{"model.safetensors"});
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_CASE(
    "save_pretrained_safetensors refuses a missing directory and an unwritable dtype on every rank alike",
    "[dist][full_safetensors][pretrained]") {
  test::SharedDir dir;
  test::Nested model = test::make_model(test::world(), {dist::Sharding::full});
  const std::string missing = dir.file("missing");
  const std::string error = test::error_of([&] { dist::save_pretrained_safetensors(missing, *model, 0); });
  CHECK(error == fmt::format("save_pretrained_safetensors: '{}': not a directory", missing));
  CHECK(test::same_on_every_rank(error));
  const std::string path = dir.file("model.safetensors");
  const std::string dtype_error =
      test::error_of([&] { dist::save_full_safetensors(path, *model, {.dtype = DType::i64}); });
  CHECK(dtype_error ==
        fmt::format("save_full_safetensors: '{}': cannot write parameters as i64: f32, bf16 or f16", path));
  CHECK(test::same_on_every_rank(dtype_error));
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(listing(dir.file("")).empty());
}
