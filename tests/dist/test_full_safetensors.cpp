// tests/dist/test_full_safetensors.cpp (mpirun): save_full_safetensors over every sharding strategy
// writes, from the shards alone, the very bytes nn::save_safetensors writes from the gathered
// parameters (a 1-process model's file), for the Nested model and the tiny Llama, fresh and after
// an optimizer step; a save that fails is refused on every rank alike and leaves no file behind.
#include <mpi.h>

#include <algorithm>
#include <filesystem>
#include <map>
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
    dist::save_full_safetensors(path, *nested, metadata);  // replaces the fresh file
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
