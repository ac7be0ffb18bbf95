// apps/bench_tokenizer: BpeTokenizer's training time and encode throughput (MB/s, tokens/s) over
// a corpus, one thread, with the word cache cold (a fresh tokenizer each pass) and warm; can save
// the tokenizer, the documents and their ids so that bench/tokenizer_cpu.sh times Hugging Face
// tokenizers on the same and the interoperability checks compare its ids with ours.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apps/cli.h"
#include "core/error.h"
#include "data/bpe.h"
#include "data/text_corpus.h"

using namespace shardlab;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

struct Pass {
  double seconds;
  std::size_t tokens;
};

// Encodes every document once, as a caller tokenizing a corpus document by document does.
Pass encode_all(const data::BpeTokenizer& tokenizer, const std::vector<std::string>& documents) {
  const auto start = std::chrono::steady_clock::now();
  std::size_t tokens = 0;
  for (const std::string& document : documents) tokens += tokenizer.encode(document).size();
  return {seconds_since(start), tokens};
}

void report(const char* what, const std::vector<Pass>& passes, std::size_t bytes) {
  std::vector<double> times;
  for (const Pass& pass : passes) times.push_back(pass.seconds);
  const double seconds = median(times);
  fmt::print("encode {}: {:.2f} MB/s, {:.0f} tokens/s (median of {} passes, {:.3f} s each)\n", what,
             static_cast<double>(bytes) / seconds / 1e6, static_cast<double>(passes.front().tokens) / seconds,
             passes.size(), seconds);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BpeTokenizer training and encode throughput"};
  std::vector<std::string> corpus = {"/usr/share/games/fortunes"};
  std::int64_t vocab = 4096;
  std::string tokenizer_path, save_path, documents_path, ids_path;
  int passes = 5;
  app.add_option("--corpus", corpus, "files or directories of fortune-format documents");
  app.add_option("--vocab", vocab, "vocabulary size to train to")->check(apps::integer_at_least(1));
  app.add_option("--tokenizer", tokenizer_path, "load this tokenizer.json instead of training");
  app.add_option("--save", save_path, "write the tokenizer.json here");
  app.add_option("--save-documents", documents_path, "write the documents here as a JSON array of strings");
  app.add_option(
      "--save-ids", ids_path,
      "write every document's ids (encoded without special tokens) here as a JSON array of arrays");
  app.add_option("--passes", passes, "timed passes per measurement")->check(apps::integer_at_least(1));
  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "bench_tokenizer", true))
    return *status;

  try {
    // Before the corpus is read and the tokenizer trained: an output that cannot be written fails now.
    for (const auto& [option, path] :
         {std::pair{"--save", save_path}, std::pair{"--save-documents", documents_path},
          std::pair{"--save-ids", ids_path}}) {
      if (!path.empty()) apps::check_writable_path(option, path, /*is_directory=*/false);
    }
    const std::vector<std::string> documents = data::read_documents(corpus);
    std::size_t bytes = 0;
    for (const std::string& document : documents) bytes += document.size();
    fmt::print("corpus: {} documents, {} bytes\n", documents.size(), bytes);

    const auto start = std::chrono::steady_clock::now();
    const data::BpeTokenizer trained = tokenizer_path.empty()
                                           ? data::BpeTokenizer::train(documents, {.vocab_size = vocab})
                                           : data::BpeTokenizer::load(tokenizer_path);
    fmt::print("{} {} (vocab {}) in {:.3f} s\n", tokenizer_path.empty() ? "trained" : "loaded",
               trained.name(), trained.vocab_size(), seconds_since(start));
    if (!save_path.empty()) trained.save(save_path);
    if (!documents_path.empty()) {
      std::ofstream out(documents_path, std::ios::binary);
      // Invalid UTF-8 (a few fortunes are Latin-1) becomes U+FFFD: JSON strings are Unicode.
      out << nlohmann::json(documents).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      SHARDLAB_CHECK(out.good(), "writing '{}' failed", documents_path);
    }
    if (!ids_path.empty()) {
      nlohmann::json ids = nlohmann::json::array();
      for (const std::string& document : documents) ids.push_back(trained.encode(document));
      std::ofstream out(ids_path, std::ios::binary);
      out << ids.dump();
      SHARDLAB_CHECK(out.good(), "writing '{}' failed", ids_path);
    }

    const std::string json = trained.to_json();
    std::vector<Pass> cold, warm;
    for (int pass = 0; pass < passes; ++pass) {
      const data::BpeTokenizer fresh = data::BpeTokenizer::from_json(json, trained.name());
      cold.push_back(encode_all(fresh, documents));
    }
    encode_all(trained, documents);  // fills the cache
    for (int pass = 0; pass < passes; ++pass) warm.push_back(encode_all(trained, documents));
    report("cold cache", cold, bytes);
    report("warm cache", warm, bytes);
    fmt::print("bytes per token: {:.3f}\n",
               static_cast<double>(bytes) / static_cast<double>(warm.front().tokens));
  } catch (const Error& error) {
    fmt::print(stderr, "bench_tokenizer: {}\n", error.what());
    return 1;
  }
}
