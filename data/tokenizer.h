// data/tokenizer.h: the Tokenizer interface (text <-> token ids, special ids) and ByteTokenizer.
//
//   auto tokenizer = data::make_tokenizer("bytes");
//   std::vector<std::int64_t> ids = tokenizer->encode("hi");  // {104, 105}
//   ids.push_back(tokenizer->eot_id());
//   std::string text = tokenizer->decode(ids);                // "hi[EOT]"
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace shardlab::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual std::string name() const = 0;
  virtual std::int64_t vocab_size() const = 0;  // ids are 0 .. vocab_size - 1

  // The text's ids, with no special tokens added: a caller adds BOT/EOT where it wants them.
  virtual std::vector<std::int64_t> encode(std::string_view text) const = 0;
  // The text of `ids`; a special id decodes to its own text ("[EOT]"). An id outside
  // [0, vocab_size) is an Error naming it and the vocabulary size.
  std::string decode(std::span<const std::int64_t> ids) const;

  virtual std::int64_t bot_id() const = 0;  // begins a document
  virtual std::int64_t eot_id() const = 0;  // ends a document
  virtual std::int64_t pad_id() const = 0;  // fills a sequence after the document

 private:
  // decode() checks every id against the vocabulary first, so each tokenizer reports a bad id
  // the same way and implements only this.
  virtual std::string decode_valid(std::span<const std::int64_t> ids) const = 0;
};

// Ids 0..255 are the bytes themselves, then [BOT], [EOT], [PAD]: every byte string (NUL and
// invalid UTF-8 included) encodes and decodes back exactly.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr std::int64_t kBot = 256;
  static constexpr std::int64_t kEot = 257;
  static constexpr std::int64_t kPad = 258;
  static constexpr std::int64_t kVocabSize = 259;

  std::string name() const override { return "bytes"; }
  std::int64_t vocab_size() const override { return kVocabSize; }
  std::vector<std::int64_t> encode(std::string_view text) const override;
  std::int64_t bot_id() const override { return kBot; }
  std::int64_t eot_id() const override { return kEot; }
  std::int64_t pad_id() const override { return kPad; }

 private:
  std::string decode_valid(std::span<const std::int64_t> ids) const override;
};

// The tokenizer called `name`: "bytes" (ByteTokenizer), or a path ending in ".json" or naming a
// file (BpeTokenizer::load, data/bpe.h). Another name is an Error listing the accepted forms.
std::unique_ptr<Tokenizer> make_tokenizer(std::string_view name);

// The tokenizer a model directory implies: its tokenizer.json (Hugging Face's layout) when it has
// one, else "bytes"; a name for make_tokenizer.
std::string directory_tokenizer(const std::string& dir);

}  // namespace shardlab::data
