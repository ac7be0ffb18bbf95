// apps/checkpoint: sharded checkpoints (dist/checkpoint/checkpoint.h) in one process, without mpirun:
//   checkpoint info DIR                               what it holds
//   checkpoint consolidate DIR OUT.safetensors [--optimizer]   one safetensors file of it
//   checkpoint convert DIR OUT_DIR                    a train_llama checkpoint as a Hugging Face directory
//                                                     (config.json, model.safetensors, a BPE run's
//                                                     tokenizer.json)
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <string>

#include "apps/cli.h"
#include "data/bpe.h"
#include "dist/checkpoint/reader.h"
#include "models/llama.h"

using namespace shardlab;

namespace {

void print_info(const std::string& dir) {
  const dist::CheckpointInfo info = dist::checkpoint_info(dir);
  std::string out = fmt::format("checkpoint '{}'\n", dir);
  out += fmt::format("format: {} version {}\n", info.format, info.version);
  out += fmt::format("saved over {} ranks, sharding {}\n", info.world_size, info.sharding);
  out += fmt::format("files: {}\n", info.files.size());
  for (const dist::CheckpointFile& file : info.files)
    out += fmt::format("  {}  {} bytes  crc32 {:#010x}\n", file.name, file.bytes, file.crc32);
  std::int64_t parameters = 0, slots = 0;
  for (const dist::CheckpointTensor& tensor : info.tensors)
    (tensor.optimizer_slot() ? slots : parameters) += shape_numel(tensor.shape);
  out += fmt::format("tensors: {} ({} parameter elements, {} optimizer slot elements, F32)\n",
                     info.tensors.size(), parameters, slots);
  for (const dist::CheckpointTensor& tensor : info.tensors) {
    out += fmt::format("  {}  {}  {} chunk{}\n", tensor.name, shape_str(tensor.shape), tensor.chunks.size(),
                       tensor.chunks.size() == 1 ? "" : "s");
  }
  out += fmt::format("optimizer: step {}\n", info.step);
  for (const auto& [key, value] : info.hyper_parameters) out += fmt::format("  {} = {:g}\n", key, value);
  out += fmt::format("extra: {}\n", info.extra.dump());
  out += fmt::format("total: {} bytes in {} files\n", info.total_bytes(), info.files.size());
  std::fputs(out.c_str(), stdout);
}

// The Llama a train_llama checkpoint holds: its config from the metadata's extra, checked
// against the checkpoint's parameters (names and shapes) before anything is written.
models::LlamaConfig llama_config(const std::string& dir, const dist::CheckpointInfo& info) {
  const nlohmann::json& extra = info.extra;
  const std::string app = extra.is_object() && extra.contains("app") ? extra["app"].dump() : "missing";
  SHARDLAB_CHECK(app == "\"train_llama\"",
                 "'{}' is not a train_llama checkpoint: its metadata.json's extra has app {}, expected "
                 "\"train_llama\" (only train_llama saves the Llama's config with its checkpoints)",
                 dir, app);
  SHARDLAB_CHECK(extra.contains("config"),
                 "'{}': metadata.json's extra has no 'config' (the Llama's config.json)", dir);
  const models::LlamaConfig config =
      models::LlamaConfig::from_json(extra["config"], fmt::format("{}/metadata.json: extra.config", dir));
  const models::Llama model = [&] {
    const nn::DeferredInitGuard deferred;  // names and shapes only
    return models::Llama(config);
  }();
  std::set<std::string> names;
  for (const auto& [name, parameter] : model->named_parameters()) {
    names.insert(name);
    const dist::CheckpointTensor* tensor = info.tensor(name);
    SHARDLAB_CHECK(tensor != nullptr,
                   "'{}': the Llama of its config has parameter '{}', which the checkpoint lacks", dir, name);
    SHARDLAB_CHECK(tensor->shape == parameter.shape(),
                   "'{}': tensor '{}' has shape {} in the checkpoint but {} in the Llama of its config", dir,
                   name, shape_str(tensor->shape), shape_str(parameter.shape()));
  }
  for (const dist::CheckpointTensor& tensor : info.tensors) {
    SHARDLAB_CHECK(tensor.optimizer_slot() || names.contains(tensor.name),
                   "'{}': tensor '{}' is no parameter of the Llama of its config", dir, tensor.name);
  }
  return config;
}

// The tokenizer.json a train_llama run with a BPE tokenizer records in its state; none for bytes.
std::optional<data::BpeTokenizer> recorded_tokenizer(const std::string& dir, const nlohmann::json& extra) {
  if (!extra.contains("tokenizer_json") || extra["tokenizer_json"].is_null()) return std::nullopt;
  const std::string where = dir + ": metadata.json: extra.tokenizer_json";
  SHARDLAB_CHECK(extra["tokenizer_json"].is_string(),
                 "{} is a JSON {}, expected the text of a tokenizer.json", where,
                 extra["tokenizer_json"].type_name());
  return data::BpeTokenizer::from_json(extra["tokenizer_json"].get<std::string>(), where);
}

// Everything is checked before the first byte is written.
void convert(const std::string& dir, const std::string& out_dir) {
  const dist::CheckpointInfo info = dist::checkpoint_info(dir);
  const models::LlamaConfig config = llama_config(dir, info);
  const std::optional<data::BpeTokenizer> tokenizer = recorded_tokenizer(dir, info.extra);
  std::filesystem::create_directories(out_dir);
  dist::consolidate_checkpoint(dir, models::pretrained_weights_path(out_dir));
  models::save_pretrained_config(out_dir, config);
  if (tokenizer) tokenizer->save(out_dir + "/tokenizer.json");  // the directory cannot be read without it
  std::printf("checkpoint: wrote %s: model.safetensors, config.json%s, from %s\n", out_dir.c_str(),
              tokenizer ? ", tokenizer.json" : "", dir.c_str());
}

void write_consolidated(const std::string& dir, const std::string& out, bool optimizer) {
  dist::consolidate_checkpoint(dir, out, {.optimizer = optimizer});
  std::printf("checkpoint: wrote %s: %ju bytes, the parameters%s of %s\n", out.c_str(),
              static_cast<std::uintmax_t>(std::filesystem::file_size(out)),
              optimizer ? " and their optimizer slots" : "", dir.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "checkpoint: inspect a sharded checkpoint directory (train_cnn or train_llama --checkpoint-dir) and "
      "turn it into one safetensors file, or a train_llama one into a Hugging Face directory, in one "
      "process"};
  app.require_subcommand(0, 1);  // at most one; an unknown word is then named as unexpected
  std::string dir, out;
  bool optimizer = false;

  CLI::App* info = app.add_subcommand("info", "print the files, tensors, optimizer step and extra JSON");
  info->add_option("dir", dir, "checkpoint directory (holds metadata.json)")->required();

  CLI::App* consolidate =
      app.add_subcommand("consolidate", "write the full parameters as one safetensors file, rank by rank");
  consolidate->add_option("dir", dir, "checkpoint directory (holds metadata.json)")->required();
  consolidate->add_option("out", out, "the safetensors file to write")->required();
  consolidate->add_flag("--optimizer", optimizer,
                        "also write the optimizer slots, as optim.<parameter>.<slot> after the parameters");

  CLI::App* convert_command = app.add_subcommand(
      "convert",
      "write a train_llama checkpoint as a Hugging Face directory (model.safetensors + config.json)");
  convert_command->add_option("dir", dir, "checkpoint directory (holds metadata.json)")->required();
  convert_command->add_option("out_dir", out, "the directory to write")->required();

  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "checkpoint", true))
    return *status;
  if (app.get_subcommands().empty()) {
    std::fputs("checkpoint: a subcommand is required: info, consolidate or convert (see --help)\n", stderr);
    return 1;
  }
  try {
    if (info->parsed()) print_info(dir);
    if (consolidate->parsed()) write_consolidated(dir, out, optimizer);
    if (convert_command->parsed()) convert(dir, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint: %s\n", e.what());
    return 1;
  }
  return 0;
}
