// data/tokenizer.cpp: the id check every decode shares, ByteTokenizer and the tokenizer factory
// (bytes or a tokenizer.json).
#include "data/tokenizer.h"

#include <filesystem>

#include "core/error.h"
#include "data/bpe.h"

namespace shardlab::data {

std::string Tokenizer::decode(std::span<const std::int64_t> ids) const {
  const std::int64_t vocab = vocab_size();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    SHARDLAB_CHECK(ids[i] >= 0 && ids[i] < vocab,
                   "decode: id {} at position {} is out of range for tokenizer '{}' (vocab_size {})", ids[i],
                   i, name(), vocab);
  }
  return decode_valid(ids);
}

std::vector<std::int64_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<std::int64_t> ids;
  ids.reserve(text.size());
  // Through unsigned char: a plain char is signed here, and bytes >= 0x80 must map to 128..255.
  for (const char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string ByteTokenizer::decode_valid(std::span<const std::int64_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (const std::int64_t id : ids) {
    if (id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else {
      text += id == kBot ? "[BOT]" : id == kEot ? "[EOT]" : "[PAD]";
    }
  }
  return text;
}

std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name) {
  if (name == "bytes") return std::make_unique<ByteTokenizer>();
  const std::string path(name);
  if (path.ends_with(".json") || std::filesystem::is_regular_file(path)) {
    return std::make_unique<BpeTokenizer>(BpeTokenizer::load(path));
  }
  fail("make_tokenizer: unknown tokenizer '{}' (known: bytes, or the path of a tokenizer.json)", name);
}

std::string directory_tokenizer(const std::string& dir) {
  const std::filesystem::path path = std::filesystem::path(dir) / "tokenizer.json";
  return std::filesystem::exists(path) ? path.string() : "bytes";
}

}  // namespace shardlab::data
