// tests/dist/test_tp_llama.cpp (mpirun): 2-D parallelism on the Llama (recipes/llama.h, whose steps
// taken one by one give its composition bit for bit):
// tensor parallelism inside a group, FSDP across, on a device mesh, against one process computing the
// whole model on the whole batch: the gradient of every parameter piece after one step within 1e-5
// of the whole gradient's, and 20 AdamW steps' losses within 1e-5, with the loss taken by
// dist::vocab_parallel_cross_entropy (no rank holds [B, T, vocab] logits). Every (dp, tp) the world
// allows for the tiny Llama (4 heads, 2 key/value heads; vocabulary 259, which no tp > 1 divides) and
// one with 8 heads and 4 key/value heads. A checkpoint saved at the largest tp loads at every layout
// bit for bit (parameters and optimizer state), and the full safetensors it writes equals the one
// process's file byte for byte. Under bf16 mixed precision the logits stay bf16 and give, bit for
// bit, the losses and weights of logits cast to f32. Also: the one all-reduce per block half each way, the
// refusal of tp 4 for the tiny Llama, and the plan's own refusals. A model pointed at a pretrained
// directory (models::defer_to_pretrained) takes, on each rank, the values loading it whole gives.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "autograd/functional.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "core/random.h"
#include "dist/checkpoint/checkpoint.h"
#include "dist/checkpoint/full_safetensors.h"
#include "dist/checkpoint/reader.h"
#include "dist/comm/mesh.h"
#include "nn/safetensors.h"
#include "optim/optimizer.h"
#include "recipes/llama.h"
#include "tests/dist/shared_dir.h"
#include "tests/dist/world.h"

using namespace shardlab;
using shardlab::test::world;

namespace {

constexpr std::int64_t kBatch = 12, kLength = 8;  // 12 rows: 1, 2, 3 and 4 data-parallel ranks divide them
constexpr std::uint64_t kSeed = 7;

models::LlamaConfig tiny() { return models::LlamaConfig::preset("tiny"); }

models::LlamaConfig eight_heads() {
  models::LlamaConfig config = tiny();
  config.hidden_size = 64;
  config.num_attention_heads = 8;
  config.num_key_value_heads = 4;
  return config;
}

// Step `step`'s tokens and next-token targets [kBatch, kLength], a few targets ignored (-100).
std::pair<Tensor, Tensor> batch(std::int64_t vocab, std::int64_t step) {
  const Tensor tokens =
      cast(mul(uniform({kBatch, kLength + 1}, {.seed = 99, .stream = static_cast<std::uint64_t>(step)}),
               static_cast<double>(vocab)),
           DType::i64);
  const Tensor inputs = tokens.narrow(1, 0, kLength).contiguous();
  const Tensor targets = tokens.narrow(1, 1, kLength).contiguous().clone();
  targets.narrow(1, 0, 2).narrow(0, 0, 1).fill_(Scalar(-100));
  return {inputs, targets};
}

struct Rows {
  std::int64_t first, count;
};

// One process: the mean loss over the whole batch's counted targets.
Variable whole_loss(models::Llama& model, std::int64_t step) {
  const auto [inputs, targets] = batch(model->config.vocab_size, step);
  const Variable logits = model(inputs);
  return cross_entropy(reshape(logits, {-1, model->config.vocab_size}), targets.reshape({-1}));
}

struct Parallel {
  std::unique_ptr<dist::DeviceMesh> mesh;
  models::Llama model;
  recipes::ParallelLlama layout;
};

// `prepare` sees the model before it is parallelised (loads it, or points it at its files).
Parallel parallel_llama(const models::LlamaConfig& config, int dp, int tp, bool deferred,
                        std::uint64_t seed = kSeed, Device device = Device::cpu(),
                        dist::MixedPrecision precision = {}, bool activation_checkpointing = false,
                        const std::function<void(models::Llama&)>& prepare = {}) {
  auto mesh = std::make_unique<dist::DeviceMesh>(world(), std::vector<int>{dp, tp},
                                                 std::vector<std::string>{"dp", "tp"});
  auto build = [&] {
    if (!deferred) return models::Llama(config, seed);
    const nn::DeferredInitGuard guard;
    return models::Llama(config, seed);
  };
  models::Llama model = build();
  if (prepare) prepare(model);
  model->to(device);
  recipes::ParallelLlama layout =
      recipes::parallelize_llama(model, {.fsdp = {.mixed_precision = precision},
                                         .mesh = mesh.get(),
                                         .activation_checkpointing = activation_checkpointing});
  return {std::move(mesh), std::move(model), layout};
}

// This rank's rows of the global batch: the data-parallel coordinate picks them; the ranks of a
// tensor-parallel group share them.
Rows my_rows(const dist::DeviceMesh& mesh) {
  const std::int64_t count = kBatch / mesh.size("dp");
  return {mesh.coordinate("dp") * count, count};
}

// The parallel model's loss (the same on every rank) after its backward: each data-parallel rank's
// sum over its rows, scaled so that FSDP's average over those ranks is the whole mean's gradient.
// With `logits_dtype` the logits are cast to it first (what FSDP's output_dtype would do).
double parallel_step_loss(Parallel& run, std::int64_t step,
                          std::optional<DType> logits_dtype = std::nullopt) {
  const auto [inputs, targets] = batch(run.model->config.vocab_size, step);
  const Rows rows = my_rows(*run.mesh);
  const double counted = sum(ne(targets, -100).to(DType::i64)).item<double>();
  const Device device = run.model->parameters().front().device();
  const Tensor my_targets = targets.narrow(0, rows.first, rows.count).reshape({-1}).to(device);
  Variable logits = run.model(inputs.narrow(0, rows.first, rows.count).contiguous().to(device));
  if (logits_dtype) logits = cast(logits, *logits_dtype);
  // This rank's vocabulary columns only.
  CHECK(logits.size(-1) == dist::split_range(run.model->config.vocab_size, run.mesh->size("tp"),
                                             run.mesh->coordinate("tp"), "vocabulary")
                               .second);
  const Variable local_sum =
      dist::vocab_parallel_cross_entropy(reshape(logits, {-1, logits.size(-1)}), my_targets,
                                         run.layout.vocabulary, (*run.mesh)["tp"], -100, Reduction::sum);
  mul(local_sum, static_cast<double>(run.mesh->size("dp")) / counted).backward();
  const Tensor total = local_sum.data().to(DType::f64).reshape({1}).clone();
  (*run.mesh)["dp"].all_reduce(total).wait();
  return total.item<double>() / counted;
}

// The largest |parallel - whole| over this rank's piece of every parameter's gradient, relative to
// the largest |whole| of that parameter.
double worst_gradient_error(Parallel& run, models::Llama& whole) {
  std::map<std::string, dist::TensorParallelSplit> splits;
  for (const auto& split : run.layout.splits) splits[split.name] = split;
  const auto expected = whole->named_parameters();
  double worst = 0;
  std::size_t index = 0;
  for (const auto& [name, piece] : run.model->named_parameters()) {
    REQUIRE(expected[index].first == name);
    Tensor reference = expected[index++].second.grad();
    const double scale = std::max(1e-12, max(abs(reference)).item<double>());
    if (const auto it = splits.find(name); it != splits.end()) {
      reference = reference.narrow(it->second.dim, it->second.offset, it->second.extent).contiguous();
    }
    const ShardInfo* shard = piece.shard_info();
    REQUIRE(shard != nullptr);
    REQUIRE(shard->full_shape == reference.shape());
    const Tensor mine = reference.reshape({-1}).narrow(0, shard->first, shard->count);
    if (shard->count > 0) {
      worst = std::max(worst, max(abs(sub(piece.grad().to(Device::cpu()), mine))).item<double>() / scale);
    }
  }
  return worst;
}

std::vector<std::pair<int, int>> meshes(int world_size, const models::LlamaConfig& config) {
  std::vector<std::pair<int, int>> out;
  for (int tp = 1; tp <= world_size; ++tp) {
    if (world_size % tp == 0 && config.num_key_value_heads % tp == 0) out.emplace_back(world_size / tp, tp);
  }
  return out;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Under tensor parallelism a piece split by input features holds a run of every row: the metadata
// says so once per piece (version 2), never once per row.
void check_compact_metadata(const std::string& dir) {
  const nlohmann::json metadata = read_json(dir + "/metadata.json");
  std::map<std::pair<std::string, std::string>, int> chunks_per_piece;  // (tensor, file) -> chunks
  std::int64_t strided = 0;
  for (const auto& [name, tensor] : metadata["tensors"].items()) {
    for (const auto& chunk : tensor["chunks"]) {
      ++chunks_per_piece[{name, chunk["file"].get<std::string>()}];
      strided += chunk.value("runs", 1) > 1;
    }
  }
  int most = 0;
  for (const auto& [piece, count] : chunks_per_piece) most = std::max(most, count);
  CHECK(metadata["version"] == 2);
  CHECK(strided > 0);
  CHECK(most <= 3);  // a shard of a piece: a partial first row, whole rows, a partial last row
}

// preview_checkpoint before the first step and after the last against the checkpoint saved then: the
// same files, chunks and runs; metadata.json's size but for the CRC32s' digits (and, before the
// steps, the step counts', 1 then 3).
void check_preview(const dist::CheckpointPreview& before_steps, const dist::CheckpointPreview& after_steps,
                   const std::string& dir) {
  const nlohmann::json metadata = read_json(dir + "/metadata.json");
  std::int64_t file_bytes = 0, largest = 0, chunks = 0, runs = 0, files = 0;
  for (const auto& [name, file] : metadata["files"].items()) {
    file_bytes += file["bytes"].get<std::int64_t>();
    largest = std::max(largest, file["bytes"].get<std::int64_t>());
    ++files;
  }
  for (const auto& [name, tensor] : metadata["tensors"].items()) {
    for (const auto& chunk : tensor["chunks"]) {
      ++chunks;
      runs += chunk.value("runs", std::int64_t{1});
    }
  }
  const auto written = static_cast<std::int64_t>(std::filesystem::file_size(dir + "/metadata.json"));
  for (const dist::CheckpointPreview& preview : {before_steps, after_steps}) {
    CHECK(preview.file_bytes == file_bytes);
    CHECK(preview.largest_file_bytes == largest);
    CHECK(preview.chunks == chunks);
    CHECK(preview.runs == runs);
    CHECK(preview.metadata_bytes <= written);
    CHECK(preview.metadata_bytes >= written - 9 * files);  // a CRC32 has at most 10 digits, 0 has 1
  }
}

// `from` as version 1 of the format wrote it, into `to`: a chunk per run.
void write_version_1(const std::string& from, const std::string& to) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  nlohmann::json metadata = read_json(to + "/metadata.json");
  for (auto& [name, tensor] : metadata["tensors"].items()) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& chunk : tensor["chunks"]) {
      const std::int64_t count = chunk["count"], stride = chunk.value("stride", std::int64_t{0});
      for (std::int64_t k = 0; k < chunk.value("runs", std::int64_t{1}); ++k) {
        chunks.push_back({{"file", chunk["file"]},
                          {"offset", chunk["offset"].get<std::int64_t>() + k * count * 4},
                          {"bytes", count * 4},
                          {"first", chunk["first"].get<std::int64_t>() + k * stride},
                          {"count", count}});
      }
    }
    tensor["chunks"] = std::move(chunks);
  }
  metadata["version"] = 1;
  std::ofstream(to + "/metadata.json") << metadata.dump(1);
}

// Trains 3 steps at (save_dp, save_tp), saves a checkpoint and the full safetensors, and loads the
// checkpoint, and under tensor parallelism its version-1 form, at every layout: saved again, the
// same bytes; and one process writes the same file.
void check_reloads(const models::LlamaConfig& config, int save_dp, int save_tp,
                   const std::vector<std::pair<int, int>>& layouts) {
  const test::SharedDir dir;
  const std::string saved = dir.file("saved"), saved_file = dir.file("saved.safetensors");
  dist::CheckpointPreview per_run;  // what version 1 wrote: a chunk per run
  {
    Parallel run = parallel_llama(config, save_dp, save_tp, true);
    optim::AdamW optimizer(run.model->named_parameters(), {.lr = 1e-3});
    const dist::CheckpointPreview before_steps = dist::preview_checkpoint(*run.model, optimizer);
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      parallel_step_loss(run, step);
      optimizer.step();
    }
    dist::save_checkpoint(saved, *run.model, optimizer);
    dist::save_full_safetensors(saved_file, *run.model);
    check_preview(before_steps, dist::preview_checkpoint(*run.model, optimizer), saved);
    per_run = dist::preview_checkpoint(*run.model, optimizer, /*one_chunk_per_run=*/true);
  }
  std::vector<std::string> sources{saved};
  if (world().rank() == 0) {
    dist::consolidate_checkpoint(saved, dir.file("saved-all.safetensors"), {.optimizer = true});
    if (save_tp > 1) {
      check_compact_metadata(saved);
      write_version_1(saved, dir.file("saved-v1"));
      CHECK(per_run.chunks == per_run.runs);
      const auto v1_bytes =
          static_cast<std::int64_t>(std::filesystem::file_size(dir.file("saved-v1/metadata.json")));
      CHECK(std::abs(per_run.metadata_bytes - v1_bytes) <= 9 * save_dp * save_tp + 1);  // CRC32s, the newline
    }
  }
  if (save_tp > 1) sources.push_back(dir.file("saved-v1"));
  MPI_Barrier(MPI_COMM_WORLD);
  for (const auto& [dp, tp] : layouts) {
    for (const std::string& source : sources) {
      // The version-1 form at the first layout only: enough to show that it loads, at half the cost.
      if (source != saved && std::make_pair(dp, tp) != layouts.front()) continue;
      INFO("saved at dp " << save_dp << " x tp " << save_tp << ", loaded at dp " << dp << " x tp " << tp
                          << " from " << source);
      Parallel run = parallel_llama(config, dp, tp, true, kSeed + 1);  // other values until loaded
      optim::AdamW optimizer(run.model->named_parameters(), {.lr = 1e-3});
      dist::load_checkpoint(source, *run.model, optimizer);
      const std::string again =
          dir.file(fmt::format("again-{}x{}-{}", dp, tp, source == saved ? "v2" : "v1"));
      dist::save_checkpoint(again, *run.model, optimizer);
      dist::save_full_safetensors(again + ".safetensors", *run.model);
      if (world().rank() == 0) {
        dist::consolidate_checkpoint(again, again + "-all.safetensors", {.optimizer = true});
        CHECK(test::read_file(again + "-all.safetensors") ==
              test::read_file(dir.file("saved-all.safetensors")));
        CHECK(test::read_file(again + ".safetensors") == test::read_file(saved_file));
        const dist::CheckpointInfo before = dist::checkpoint_info(saved),
                                   after = dist::checkpoint_info(again);
        CHECK(after.step == before.step);
        CHECK(after.parameter_steps == before.parameter_steps);
      }
    }
  }
  if (world().rank() == 0) {
    // One process, no FSDP and no tensor parallelism: the saved parameters written by safetensors itself.
    const std::string whole_file = dir.file("saved-params.safetensors");
    dist::consolidate_checkpoint(saved, whole_file);
    models::Llama whole(config, kSeed + 2);
    whole->load_state_dict(nn::load_safetensors(whole_file).tensors);
    nn::save_safetensors(dir.file("one-process.safetensors"), whole->state_dict(), {{"format", "pt"}});
    CHECK(test::read_file(dir.file("one-process.safetensors")) == test::read_file(saved_file));
  }
}

}  // namespace

TEST_CASE("2-D Llama: each rank's gradient pieces after one step are the whole model's",
          "[dist][tp][llama]") {
  for (const auto& [label, config] : {std::pair{"tiny", tiny()}, std::pair{"8 heads", eight_heads()}}) {
    models::Llama whole(config, kSeed);
    whole_loss(whole, 0).backward();
    double whole_norm = 0;
    for (const Variable& parameter : whole->parameters())
      whole_norm += sum_squares(parameter.grad()).item<double>();
    whole_norm = std::sqrt(whole_norm);
    for (const auto& [dp, tp] : meshes(world().size(), config)) {
      if (kBatch % dp != 0) continue;
      for (const bool deferred : {false, true}) {
        INFO(label << " at dp " << dp << " x tp " << tp
                   << (deferred ? ", drawn deferred" : ", cut from the whole"));
        Parallel run = parallel_llama(config, dp, tp, deferred);
        const double loss = parallel_step_loss(run, 0);
        CHECK(std::abs(loss - whole_loss(whole, 0).data().item<double>()) <= 1e-5);
        CHECK(worst_gradient_error(run, whole) <= 1e-5);
        // The global gradient norm: split pieces summed over the whole mesh, the rest over dp.
        const double norm = optim::clip_grad_norm_(run.model->parameters(), 1e30).item<double>();
        CHECK(std::abs(norm - whole_norm) <= 1e-5 * whole_norm);
      }
    }
  }
}

TEST_CASE(
    "2-D Llama: recipes' steps taken one by one give parallelize_llama's loss and gradients, bit for bit",
    "[dist][tp][llama]") {
  const models::LlamaConfig config = eight_heads();
  for (const auto& [dp, tp] : meshes(world().size(), config)) {
    if (kBatch % dp != 0) continue;
    INFO("dp " << dp << " x tp " << tp);
    Parallel composed = parallel_llama(config, dp, tp, true, kSeed, Device::cpu(), {}, true);
    Parallel stepwise{std::make_unique<dist::DeviceMesh>(world(), std::vector<int>{dp, tp},
                                                         std::vector<std::string>{"dp", "tp"}),
                      [&] {
                        const nn::DeferredInitGuard guard;
                        return models::Llama(config, kSeed);
                      }(),
                      {}};
    dist::DeviceMesh& mesh = *stepwise.mesh;
    stepwise.layout = tp > 1 ? recipes::apply_tensor_parallel(stepwise.model, mesh["tp"])
                             : recipes::ParallelLlama{.vocabulary = {0, config.vocab_size}};
    recipes::apply_activation_checkpointing(stepwise.model);
    recipes::apply_fsdp(stepwise.model, {.communicator = &mesh["dp"]});
    if (tp > 1) recipes::place_in_mesh(stepwise.model, mesh, stepwise.layout);
    const double loss =
        parallel_step_loss(stepwise, 0);  // every rank in the same order: no two in one expression
    CHECK(loss == parallel_step_loss(composed, 0));
    const auto expected = composed.model->named_parameters();
    std::size_t index = 0;
    for (const auto& [name, parameter] : stepwise.model->named_parameters()) {
      INFO(name);
      CHECK(parameter.grad().to_vector<double>() == expected[index++].second.grad().to_vector<double>());
    }
  }
}

TEST_CASE("2-D Llama on a GPU: each rank's gradient pieces after one step are the CPU whole model's",
          "[dist][tp][llama][cuda]") {
  const Device gpu = dist::session().device().is_cuda() ? dist::session().device() : Device::cuda(0);
  const models::LlamaConfig config = eight_heads();
  models::Llama whole(config, kSeed);
  whole_loss(whole, 0).backward();
  for (const auto& [dp, tp] : meshes(world().size(), config)) {
    INFO("dp " << dp << " x tp " << tp << " on " << gpu.str() << " through " << world().backend_name());
    Parallel run = parallel_llama(config, dp, tp, true, kSeed, gpu);
    const double loss = parallel_step_loss(run, 0);
    CHECK(std::abs(loss - whole_loss(whole, 0).data().item<double>()) <= 1e-4);
    CHECK(worst_gradient_error(run, whole) <= 1e-4);
  }
}

TEST_CASE("2-D Llama: 20 AdamW steps over the model's own parameters give one process's losses",
          "[dist][tp][llama]") {
  constexpr int kSteps = 20;
  for (const auto& [label, config] : {std::pair{"tiny", tiny()}, std::pair{"8 heads", eight_heads()}}) {
    models::Llama whole(config, kSeed);
    optim::AdamW whole_optimizer(whole->named_parameters(), {.lr = 1e-3});
    std::vector<double> expected;
    for (int step = 0; step < kSteps; ++step) {
      whole_optimizer.zero_grad();
      const Variable loss = whole_loss(whole, step);
      loss.backward();
      whole_optimizer.step();
      expected.push_back(loss.data().item<double>());
    }
    for (const auto& [dp, tp] : meshes(world().size(), config)) {
      if (kBatch % dp != 0) continue;
      INFO(label << " at dp " << dp << " x tp " << tp);
      Parallel run = parallel_llama(config, dp, tp, true);
      optim::AdamW optimizer(run.model->named_parameters(), {.lr = 1e-3});
      double worst = 0;
      for (int step = 0; step < kSteps; ++step) {
        optimizer.zero_grad();
        worst = std::max(worst,
                         std::abs(parallel_step_loss(run, step) - expected[static_cast<std::size_t>(step)]));
        optimizer.step();
      }
      CHECK(worst <= 1e-5);
    }
  }
}

TEST_CASE("2-D Llama: a checkpoint saved at each (dp, tp) loads at every other bit for bit",
          "[dist][tp][llama]") {
  const models::LlamaConfig config = eight_heads();
  const auto layouts = meshes(world().size(), config);
  for (const auto& [dp, tp] : layouts) check_reloads(config, dp, tp, layouts);
}

TEST_CASE("2-D Llama: one all-reduce per block half in forward and one in backward on the tp group",
          "[dist][tp][llama]") {
  const int tp = world().size();
  if (tp == 1 || eight_heads().num_key_value_heads % tp != 0) return;
  Parallel run = parallel_llama(eight_heads(), 1, tp, true);
  dist::Communicator& group = (*run.mesh)["tp"];
  const auto [inputs, targets] = batch(eight_heads().vocab_size, 0);
  const auto calls = [&] { return group.counters()[dist::Collective::all_reduce].calls; };
  const auto before = calls();
  const Variable logits = run.model(inputs);
  const auto forward = calls() - before;
  // The embedding's sum, then per layer the attention's and the MLP's outputs.
  CHECK(forward == 1 + 2 * eight_heads().num_hidden_layers);
  CHECK(logits.size(-1) ==
        dist::split_range(eight_heads().vocab_size, tp, group.rank(), "vocabulary").second);
  const Variable loss = dist::vocab_parallel_cross_entropy(
      reshape(logits, {-1, logits.size(-1)}), targets.reshape({-1}), run.layout.vocabulary, group);
  CHECK(calls() - before - forward == 3);  // the loss: max, sum of exponentials, target logit
  const auto before_backward = calls();
  loss.backward();
  // The head's input gradient, then per layer the MLP's and the attention's input gradients.
  CHECK(calls() - before_backward == 1 + 2 * eight_heads().num_hidden_layers);
}

TEST_CASE("2-D Llama: no rank allocates [B, T, vocab] logits", "[dist][tp][llama]") {
  const models::LlamaConfig config = eight_heads();
  const std::int64_t whole_logits = kBatch * kLength * config.vocab_size * 4;  // f32
  for (const auto& [dp, tp] : meshes(world().size(), config)) {
    if (dp != 1) continue;  // every rank runs the whole batch: the largest tensors are the logits
    INFO("dp 1 x tp " << tp);
    Parallel run = parallel_llama(config, dp, tp, true);
    reset_peak_memory(Device::cpu());
    parallel_step_loss(run, 0);
    const std::int64_t largest = memory_stats(Device::cpu()).largest_allocation;
    // One process holds the whole logits; split over tp ranks, none does (the rest are far smaller).
    if (tp == 1) CHECK(largest >= whole_logits);
    if (tp > 1) CHECK(largest < whole_logits);
  }
}

TEST_CASE("2-D Llama in bf16: logits in bf16, with the losses and steps of logits cast to f32, bit for bit",
          "[dist][tp][llama]") {
  const models::LlamaConfig config = eight_heads();
  const dist::MixedPrecision bf16{.param_dtype = DType::bf16, .reduce_dtype = DType::f32};
  for (const auto& [dp, tp] : meshes(world().size(), config)) {
    if (kBatch % dp != 0) continue;
    INFO("dp " << dp << " x tp " << tp);
    Parallel kept = parallel_llama(config, dp, tp, true, kSeed, Device::cpu(), bf16);
    Parallel widened = parallel_llama(config, dp, tp, true, kSeed, Device::cpu(), bf16);
    optim::AdamW kept_optimizer(kept.model->named_parameters(), {.lr = 1e-3});
    optim::AdamW widened_optimizer(widened.model->named_parameters(), {.lr = 1e-3});
    for (int step = 0; step < 3; ++step) {
      kept_optimizer.zero_grad();
      widened_optimizer.zero_grad();
      reset_peak_memory(Device::cpu());
      const double loss = parallel_step_loss(kept, step);
      const std::int64_t kept_peak = memory_stats(Device::cpu()).peak_bytes;
      reset_peak_memory(Device::cpu());
      CHECK(loss == parallel_step_loss(widened, step, DType::f32));
      const std::int64_t widened_peak = memory_stats(Device::cpu()).peak_bytes;
      // At least an f32 copy of this rank's logits and its gradient fewer; one process's checked whole.
      CHECK(kept_peak < widened_peak);
      if (dp == 1 && tp == 1) CHECK(widened_peak - kept_peak >= 2 * kBatch * kLength * config.vocab_size * 4);
      kept_optimizer.step();
      widened_optimizer.step();
    }
    const auto expected = widened.model->named_parameters();
    std::size_t index = 0;
    for (const auto& [name, parameter] : kept.model->named_parameters()) {
      INFO(name);
      CHECK(parameter.data().to_vector<double>() == expected[index++].second.data().to_vector<double>());
    }
  }
}

TEST_CASE("2-D Llama from a pretrained directory: each rank reads its pieces, the values of loading it whole",
          "[dist][tp][llama][pretrained]") {
  const models::LlamaConfig config = tiny();
  const test::SharedDir dir;
  const std::string pretrained = dir.file("pretrained");
  // bf16 weights, as Hugging Face directories hold them: widened to f32 exactly on either path.
  if (world().rank() == 0) {
    models::Llama source(config, kSeed + 3);
    nn::StateDict halves;
    for (const auto& [name, tensor] : source->state_dict()) halves.emplace_back(name, tensor.to(DType::bf16));
    models::save_pretrained_config(pretrained, config);
    nn::save_safetensors(models::pretrained_weights_path(pretrained), halves);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (const auto& [dp, tp] : meshes(world().size(), config)) {
    INFO("dp " << dp << " x tp " << tp);
    Parallel whole =
        parallel_llama(config, dp, tp, false, kSeed, Device::cpu(), {}, false, [&](models::Llama& model) {
          nn::Named<Shape> shapes;
          for (const auto& [name, parameter] : model->named_parameters())
            shapes.emplace_back(name, parameter.shape());
          model->load_state_dict(models::load_pretrained_weights(pretrained, shapes));
        });
    Parallel pieces =
        parallel_llama(config, dp, tp, true, kSeed, Device::cpu(), {}, false,
                       [&](models::Llama& model) { models::defer_to_pretrained(model, pretrained); });
    // FSDP draws (here: reads) each rank's shards when the root first runs: a step, then the values.
    CHECK(parallel_step_loss(pieces, 0) == parallel_step_loss(whole, 0));
    const auto expected = whole.model->named_parameters(), got = pieces.model->named_parameters();
    REQUIRE(got.size() == expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      INFO(got[i].first);
      CHECK(got[i].second.data().to_vector<float>() == expected[i].second.data().to_vector<float>());
    }
  }
}

TEST_CASE("2-D Llama: refusals name what does not fit", "[dist][tp][llama]") {
  if (world().size() == 4) {
    models::Llama model(tiny(), kSeed);
    dist::DeviceMesh mesh(world(), {1, 4}, {"dp", "tp"});
    CHECK_THROWS_ERROR(
        recipes::parallelize_llama(model, {.mesh = &mesh}),
        "4 attention heads (num_attention_heads) and 2 key/value heads (num_key_value_heads) do not "
        "both divide by tp 4");
    // Nothing changed: the model still trains whole.
    CHECK((*model->lm_head)->weight.size(0) == tiny().vocab_size);
  }
  {
    models::Llama model(tiny(), kSeed);
    dist::DeviceMesh mesh(world(), {world().size(), 1}, {"dp", "tp"});
    CHECK_THROWS_ERROR(
        recipes::parallelize_llama(model, {.fsdp = {.communicator = &mesh["tp"]}, .mesh = &mesh}),
        "with a mesh, FSDP runs over its \"dp\" ranks");
    dist::DeviceMesh backwards(world(), {1, world().size()}, {"tp", "dp"});
    CHECK_THROWS_ERROR(recipes::parallelize_llama(model, {.mesh = &backwards}),
                       fmt::format("the mesh must be dp x tp, got tp=1 x dp={}", world().size()));
    dist::fully_shard(*model);
    CHECK_THROWS_ERROR(dist::place_in_mesh(*model, world(), {{"lm_head.bias", {}}}, true),
                       "place_in_mesh: 'lm_head.bias' is no parameter of the LlamaForCausalLM");
  }
  models::Llama model(tiny(), kSeed);
  dist::Communicator& group = world();
  CHECK_THROWS_ERROR(
      dist::parallelize_module(*model, group, {{"model.layers.*.no_such", dist::ParallelStyle::colwise}}),
      "the plan's 'model.layers.*.no_such' (colwise) matches no module of LlamaForCausalLM");
  CHECK_THROWS_ERROR(
      dist::parallelize_module(*model, group, {{"model.embed_tokens", dist::ParallelStyle::colwise}}),
      "colwise fits a Linear, but 'model.embed_tokens' is a Embedding");
  CHECK_THROWS_ERROR(dist::parallelize_module(*model, group,
                                              {{"lm_head", dist::ParallelStyle::colwise},
                                               {"model.layers.*.mlp", dist::ParallelStyle::region_input},
                                               {"lm_head", dist::ParallelStyle::rowwise}}),
                     "module 'lm_head' is matched by 'lm_head' (colwise) and by 'lm_head' (rowwise)");
  CHECK_THROWS_ERROR(
      dist::parallelize_module(*model, group, {{"model.*", dist::ParallelStyle::region_input}}),
      "'model.layers' (ModuleList) has no forward of its own to hook");
  CHECK((*model->lm_head)->weight.size(0) == tiny().vocab_size);
  (void)dist::parallelize_module(*model, group, {{"lm_head", dist::ParallelStyle::colwise}});
  CHECK_THROWS_ERROR(dist::parallelize_module(*model, group, {{"lm_head", dist::ParallelStyle::colwise}}),
                     "'lm_head' is already parallelised");
  CHECK_THROWS_ERROR(dist::split_range(3, 4, 0, "'x'"), "'x' has 3 elements to split over 4 ranks");
  CHECK_THROWS_ERROR(dist::parallelize_module(*model, group, {{"model.norm", dist::ParallelStyle::rowwise}}),
                     "rowwise fits a Linear or an Embedding, but 'model.norm' is a RMSNorm");
  {
    models::Llama sharded(tiny(), kSeed);
    dist::fully_shard(*sharded);
    CHECK_THROWS_ERROR(dist::parallelize_module(*sharded, group, {{"lm_head", dist::ParallelStyle::colwise}}),
                       "'lm_head' is already sharded by FSDP ('weight'); apply tensor parallelism first");
  }
  {
    const nn::DeferredInitGuard deferred;  // and no nn::initialize: nothing to draw the pieces from
    nn::Linear linear(nn::LinearOptions(4, 6));
    CHECK_THROWS_ERROR(
        dist::parallelize_module(*linear, group, {{"", dist::ParallelStyle::colwise}}),
        "'weight' was made under nn::DeferredInitGuard, but nn::initialize(root, seed) was not "
        "called on the root Linear");
  }
  if (world().size() % 2 == 0) {
    models::LlamaConfig tied = tiny();
    tied.tie_word_embeddings = true;
    models::Llama model_tied(tied, kSeed);
    dist::DeviceMesh mesh(world(), {world().size() / 2, 2}, {"dp", "tp"});
    CHECK_THROWS_ERROR(
        recipes::parallelize_llama(model_tied, {.mesh = &mesh}),
        "tensor parallel over 2 ranks: tied embeddings (tie_word_embeddings) are not supported");
  }
}

TEST_CASE("vocab_parallel_cross_entropy refuses bad operands", "[dist][tp]") {
  dist::Communicator& group = world();
  const Variable logits(zeros({2, 5}), true);
  CHECK_THROWS_ERROR(dist::vocab_parallel_cross_entropy(logits, zeros({2}), {0, 5 * group.size()}, group),
                     "targets must be i64 or i32, got f32");
  CHECK_THROWS_ERROR(dist::vocab_parallel_cross_entropy(Variable(zeros({2, 5}, dtype(DType::i64))),
                                                        zeros({2}, dtype(DType::i64)), {0, 5}, group),
                     "logits must be floating, got i64");
  CHECK_THROWS_ERROR(
      dist::vocab_parallel_cross_entropy(Variable(zeros({5})), zeros({5}, dtype(DType::i64)), {0, 5}, group),
      "logits must be 2-D [N, V_r], got [5]");
  CHECK_THROWS_ERROR(dist::vocab_parallel_cross_entropy(logits, zeros({3}, dtype(DType::i64)), {0, 5}, group),
                     "targets must be [2] like the logits' rows, got [3]");
  CHECK_THROWS_ERROR(dist::vocab_parallel_cross_entropy(logits, zeros({2}, dtype(DType::i64)), {3, 5}, group),
                     "this rank's 5 columns from entry 3 do not lie in a vocabulary of 5");
  CHECK_THROWS_ERROR(
      dist::vocab_parallel_cross_entropy(logits, from_vector<std::int64_t>({1, 5}), {0, 5}, group), "5");
}
