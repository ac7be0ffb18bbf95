// data/text_corpus.cpp: reading documents from files and directories, and the pretraining
// samples (BOT + tokens + EOT, clipped and padded) built from them.
#include "data/text_corpus.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <utility>
#include <vector>

#include "core/error.h"

namespace shardlab::data {

namespace fs = std::filesystem;

namespace {

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

// The whole file; stdio rather than a stream so that a failure can say why (errno).
std::string read_text(const fs::path& path) {
  errno = 0;
  const std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  SHARDLAB_CHECK(file != nullptr, "read_documents: cannot open '{}': {}", path.string(),
                 std::strerror(errno));
  std::string text;
  char chunk[1 << 16];
  std::size_t got;
  while ((got = std::fread(chunk, 1, sizeof chunk, file.get())) > 0) text.append(chunk, got);
  SHARDLAB_CHECK(!std::ferror(file.get()), "read_documents: cannot read '{}': {}", path.string(),
                 std::strerror(errno));
  return text;
}

// The regular files of a directory in name order, without strfile indexes.
std::vector<fs::path> directory_files(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    // symlink_status does not follow links: a link to a file (fortune's "x.u8" -> "x") would
    // read its target's documents twice.
    std::error_code ignored;
    if (it->symlink_status(ignored).type() != fs::file_type::regular) continue;
    if (it->path().extension() == ".dat") continue;
    files.push_back(it->path());
  }
  SHARDLAB_CHECK(!error, "read_documents: cannot list directory '{}': {}", dir.string(), error.message());
  SHARDLAB_CHECK(!files.empty(),
                 "read_documents: directory '{}' has no file to read (subdirectories, symlinks and .dat "
                 "files are skipped)",
                 dir.string());
  std::sort(files.begin(), files.end());
  return files;
}

bool blank(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
}

// Appends the non-blank documents of one file's text to `documents`.
void split_documents(std::string_view text, std::string_view separator, std::vector<std::string>& documents) {
  std::string document;
  bool has_line = false;  // the next line is joined to the document with a '\n'
  const auto finish = [&] {
    if (!blank(document)) documents.push_back(std::move(document));
    document.clear();
    has_line = false;
  };
  // A final '\n' ends the last line rather than starting an empty one.
  for (std::size_t start = 0; start < text.size();) {
    const std::size_t newline = std::min(text.find('\n', start), text.size());
    const std::string_view line = text.substr(start, newline - start);
    if (line == separator) {
      finish();
    } else {
      if (has_line) document += '\n';
      document += line;
      has_line = true;
    }
    start = newline + 1;
  }
  finish();
}

}  // namespace

std::vector<std::string> read_documents(const std::vector<std::string>& paths, std::string_view separator) {
  SHARDLAB_CHECK(separator.find('\n') == std::string_view::npos,
                 "read_documents: the separator must be a single line, got '{}'", separator);
  std::vector<std::string> documents;
  for (const std::string& path : paths) {
    std::error_code error;
    const fs::file_status status = fs::status(path, error);
    SHARDLAB_CHECK(status.type() != fs::file_type::not_found, "read_documents: '{}' does not exist", path);
    SHARDLAB_CHECK(!error, "read_documents: cannot inspect '{}': {}", path, error.message());
    if (fs::is_directory(status)) {
      for (const fs::path& file : directory_files(path))
        split_documents(read_text(file), separator, documents);
    } else {
      // Anything else (a FIFO, a device) could block or never end.
      SHARDLAB_CHECK(fs::is_regular_file(status), "read_documents: '{}' is neither a file nor a directory",
                     path);
      split_documents(read_text(path), separator, documents);
    }
  }
  SHARDLAB_CHECK(!documents.empty(), "read_documents: empty corpus: no non-blank document in '{}'",
                 fmt::join(paths, "', '"));
  return documents;
}

template <typename Window>
void PretrainingDataset::fill(std::int64_t count, std::int64_t seq, std::int64_t pad, const Window& window) {
  inputs_ = empty({count, seq}, dtype(DType::i64));
  targets_ = empty({count, seq}, dtype(DType::i64));
  std::int64_t* inputs = inputs_.data<std::int64_t>();
  std::int64_t* targets = targets_.data<std::int64_t>();
  const auto length = static_cast<std::size_t>(seq);
  std::vector<std::int64_t> sample(length + 1);
  for (std::int64_t i = 0; i < count; ++i) {
    window(i, sample);
    inputs = std::copy_n(sample.begin(), length, inputs);
    targets = std::copy_n(sample.begin() + 1, length, targets);
    target_tokens_ +=
        std::count_if(sample.begin() + 1, sample.end(), [pad](std::int64_t id) { return id != pad; });
  }
}

PretrainingDataset::PretrainingDataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                                       std::int64_t seq, Packing packing)
    : packing_(packing), bot_id_(tokenizer.bot_id()) {
  SHARDLAB_CHECK(seq >= 1, "PretrainingDataset: seq must be at least 1, got {}", seq);
  SHARDLAB_CHECK(!documents.empty(), "PretrainingDataset: no documents");
  const std::int64_t pad = tokenizer.pad_id();
  const auto length = static_cast<std::size_t>(seq);
  if (packing == Packing::one_per_document) {
    fill(static_cast<std::int64_t>(documents.size()), seq, pad,
         [&](std::int64_t i, std::vector<std::int64_t>& sample) {
           const std::vector<std::int64_t> tokens = tokenizer.encode(documents[static_cast<std::size_t>(i)]);
           const std::size_t kept = std::min(tokens.size(), length);
           std::fill(sample.begin(), sample.end(), pad);
           sample[0] = tokenizer.bot_id();
           std::copy_n(tokens.begin(), kept, sample.begin() + 1);
           if (kept < length) sample[kept + 1] = tokenizer.eot_id();  // a clipped document has no end
         });
    return;
  }
  std::vector<std::int64_t> stream;
  for (const std::string& document : documents) {
    stream.push_back(tokenizer.bot_id());
    const std::vector<std::int64_t> tokens = tokenizer.encode(document);
    stream.insert(stream.end(), tokens.begin(), tokens.end());
    stream.push_back(tokenizer.eot_id());
  }
  const auto ids = static_cast<std::int64_t>(stream.size());
  SHARDLAB_CHECK(
      ids >= seq + 1,
      "PretrainingDataset: the {} documents pack into {} ids, fewer than one sequence of {} and its "
      "next id",
      documents.size(), ids, seq);
  fill((ids - 1) / seq, seq, pad, [&](std::int64_t i, std::vector<std::int64_t>& sample) {
    std::copy_n(stream.begin() + i * seq, length + 1, sample.begin());
  });
}

TensorDataset PretrainingDataset::dataset_with_documents() const {
  SHARDLAB_CHECK(packing_ == Packing::packed,
                 "PretrainingDataset: documents within a sample are for packed samples; these hold one "
                 "document each");
  Tensor documents = empty(inputs_.shape(), dtype(DType::i64));
  const std::int64_t* ids = inputs_.data<std::int64_t>();
  std::int64_t* out = documents.data<std::int64_t>();
  const std::int64_t seq = seq_len();
  for (std::int64_t row = 0; row < size(); ++row, ids += seq, out += seq) {
    std::int64_t document = 0;
    for (std::int64_t t = 0; t < seq; ++t) {
      if (t > 0 && ids[t] == bot_id_) ++document;
      out[t] = document;
    }
  }
  return TensorDataset(inputs_, targets_, std::move(documents));
}

}  // namespace shardlab::data
