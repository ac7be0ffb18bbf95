// tests/fuzz/targets.cpp: the fuzz targets: each writes its input where its reader looks, calls the
// reader, lets shardlab::Error through as the expected refusal and checks what a success returned.
#include "tests/fuzz/targets.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/bpe.h"
#include "data/idx.h"
#include "data/text_corpus.h"
#include "dist/checkpoint/reader.h"
#include "nn/safetensors.h"

namespace shardlab::fuzz {

namespace {

namespace fs = std::filesystem;

// A reader returned something its input does not allow: thrown rather than aborting so that the
// replay test reports it like any failed check, while libFuzzer sees an uncaught exception.
template <typename... Args>
[[noreturn]] void violated(fmt::format_string<Args...> format, Args&&... args) {
  throw std::logic_error(fmt::format(format, std::forward<Args>(args)...));
}

// This process's scratch directory, in memory (/dev/shm) where there is one: a fuzzer writes a
// file per execution, thousands a second. Removed at exit.
class Scratch {
 public:
  Scratch() {
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    path_ = base / ("shardlab-fuzz-" + std::to_string(::getpid()));
    fs::create_directories(path_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

const Scratch& scratch() {
  static const Scratch instance;
  return instance;
}

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

void write_file(const std::string& path, const void* data, std::size_t size) {
  const std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "wb"));
  // The harness failing is not the reader's bug, but it must not pass for a clean run either.
  if (!file || (size > 0 && std::fwrite(data, 1, size, file.get()) != size))
    throw std::runtime_error(fmt::format("fuzz: cannot write '{}': {}", path, std::strerror(errno)));
}

std::uint64_t little_endian_u64(const std::uint8_t* p) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

std::uint64_t tensor_bytes(const Tensor& tensor) {
  return static_cast<std::uint64_t>(tensor.numel()) * tensor.element_size();
}

// The checkpoint directory: the fixed rank files (targets.h), written once; metadata.json per input.
std::string checkpoint_dir() {
  static const std::string dir = [] {
    const std::string path = scratch().file("checkpoint");
    fs::create_directories(path);
    for (int rank = 0; rank < kCheckpointFiles; ++rank) {
      std::vector<std::uint8_t> bytes(kCheckpointFileBytes);
      for (std::size_t k = 0; k < bytes.size(); ++k)
        bytes[k] = static_cast<std::uint8_t>((static_cast<std::size_t>(rank) * 64 + k) & 0xff);
      write_file(fmt::format("{}/rank-{:05}-of-{:05}.bin", path, rank, kCheckpointFiles), bytes.data(),
                 bytes.size());
    }
    return path;
  }();
  return dir;
}

}  // namespace

void fuzz_idx(const std::uint8_t* data, std::size_t size) {
  const std::string path = scratch().file("input.idx");
  write_file(path, data, size);
  Tensor tensor;
  try {
    tensor = data::read_idx(path);
  } catch (const Error&) {
    return;
  }
  // A gzip stream's header is inside the compressed bytes; a plain file's is the input's.
  if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) return;
  const std::size_t ndim = data[3];
  const std::size_t file_element = data[2] == 0x0E ? 8 : data[2] >= 0x0C ? 4 : data[2] == 0x0B ? 2 : 1;
  if (static_cast<std::size_t>(tensor.dim()) != ndim)
    violated("read_idx: {} dimensions read, the header says {}", tensor.dim(), ndim);
  if (static_cast<std::uint64_t>(tensor.numel()) * file_element != size - 4 - 4 * ndim)
    violated("read_idx: {} elements of {} bytes read from {} data bytes", tensor.numel(), file_element,
             size - 4 - 4 * ndim);
}

void fuzz_safetensors(const std::uint8_t* data, std::size_t size) {
  const std::string path = scratch().file("input.safetensors");
  write_file(path, data, size);
  nn::SafetensorsFile file;
  try {
    file = nn::load_safetensors(path);
  } catch (const Error&) {
    return;
  }
  // A valid file is the length field, the header and the tensors' bytes, nothing else.
  std::uint64_t bytes = 0;
  for (const auto& [name, tensor] : file.tensors) bytes += tensor_bytes(tensor);
  const std::uint64_t header = little_endian_u64(data);
  if (8 + header + bytes != size)
    violated("load_safetensors: a {}-byte file read as an {}-byte header and {} bytes of tensors", size,
             header, bytes);
}

void fuzz_tokenizer(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<data::BpeTokenizer> tokenizer;
  try {
    tokenizer = std::make_unique<data::BpeTokenizer>(data::BpeTokenizer::from_json(text, "fuzz.json"));
  } catch (const Error&) {
    return;
  }
  // What it accepted must encode anything into valid ids, and write a file it reads back the same.
  const std::string sample = "Hello, world[EOT] 42\n\xff\xfe<|endoftext|> " + std::string(text.substr(0, 64));
  const std::vector<std::int64_t> ids = tokenizer->encode(sample);
  for (const std::int64_t id : ids) {
    if (id < 0 || id >= tokenizer->vocab_size())
      violated("BpeTokenizer: encode gave id {} with a vocabulary of {}", id, tokenizer->vocab_size());
  }
  tokenizer->decode(ids);
  const data::BpeTokenizer again = data::BpeTokenizer::from_json(tokenizer->to_json(), "fuzz.json again");
  if (again.vocab_size() != tokenizer->vocab_size() || again.encode(sample) != ids)
    violated("BpeTokenizer: to_json then from_json gives {} tokens and other ids than {}", again.vocab_size(),
             tokenizer->vocab_size());
}

void fuzz_checkpoint(const std::uint8_t* data, std::size_t size) {
  const std::string dir = checkpoint_dir();
  write_file(dir + "/metadata.json", data, size);
  dist::CheckpointInfo info;
  try {
    info = dist::checkpoint_info(dir);
  } catch (const Error&) {
    return;
  }
  // Metadata that passed must also drive a consolidation safely: its chunks are copied byte for byte.
  const std::string out = scratch().file("consolidated.safetensors");
  try {
    dist::consolidate_checkpoint(dir, out, {.optimizer = true});
  } catch (const Error&) {
    return;
  }
  const nn::SafetensorsFile file = nn::load_safetensors(out);
  if (file.tensors.size() != info.tensors.size())
    violated("consolidate_checkpoint: {} tensors written, the metadata lists {}", file.tensors.size(),
             info.tensors.size());
  for (std::size_t i = 0; i < info.tensors.size(); ++i) {
    const auto& [name, tensor] = file.tensors[i];
    if (tensor.shape() != info.tensors[i].shape)
      violated("consolidate_checkpoint: tensor '{}' written with shape {}, the metadata says {}", name,
               shape_str(tensor.shape()), shape_str(info.tensors[i].shape));
  }
}

void fuzz_text_corpus(const std::uint8_t* data, std::size_t size) {
  const std::string path = scratch().file("corpus.txt");
  write_file(path, data, size);
  std::vector<std::string> documents;
  try {
    documents = data::read_documents({path});
  } catch (const Error&) {
    return;
  }
  // Documents are the file's lines minus separators and the newlines before them: never longer.
  const std::size_t total =
      std::accumulate(documents.begin(), documents.end(), std::size_t{0},
                      [](std::size_t sum, const std::string& d) { return sum + d.size(); });
  if (total > size) violated("read_documents: {} bytes of documents from a {}-byte file", total, size);
  for (const std::string& document : documents) {
    if (document.find_first_not_of(" \t\n\v\f\r") == std::string::npos)
      violated("read_documents: a blank document of {} bytes", document.size());
    if (document == "%" || document.starts_with("%\n") || document.ends_with("\n%") ||
        document.find("\n%\n") != std::string::npos)
      violated("read_documents: a document holds the separator line");
  }
}

}  // namespace shardlab::fuzz
