// data/bpe.h: BpeTokenizer, byte-level BPE (train, encode, decode) read and written in Hugging
// Face's tokenizer.json format.
//
//   auto docs = data::read_documents({"/usr/share/games/fortunes"});
//   data::BpeTokenizer bpe = data::BpeTokenizer::train(docs, {.vocab_size = 4096});
//   bpe.save("tokenizer.json");                           // loads in HF tokenizers, same ids
//   std::vector<std::int64_t> ids = bpe.encode("Hello world[EOT]");
//   data::BpeTokenizer same = data::BpeTokenizer::load("tokenizer.json");
//
// Ids: the special tokens first (as HF's BpeTrainer gives them), then the 256 byte symbols in
// code point order, then one token per merge. Every byte has a token, so any bytes encode and
// decode(encode(x)) == x exactly (with add_prefix_space false, which is what we write).
//
// The roles: bot_id/eot_id/pad_id are the added tokens "[BOT]" / "[EOT]" / "[PAD]" (ours), or
// the common HF names ("<s>", "<|begin_of_text|>", "<|startoftext|>"; "</s>", "<|end_of_text|>",
// "<|endoftext|>"; "<pad>", "<|pad|>"). A role with none of them gets ours as a new special
// token at the end of the vocabulary (or at its id, when the vocabulary holds that text as an
// ordinary token), and to_json writes it, so HF sees the same ids.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/tokenizer.h"

namespace shardlab::data {

struct BpeTrainOptions {
  std::int64_t vocab_size = 4096;  // specials + 256 byte symbols + merges; training stops there
  // Ids 0.. in this order. Training reads their text in a document as plain text, as HF's trainer
  // does on a tokenizer with no added tokens yet; encode never splits them.
  std::vector<std::string> special_tokens = {"[BOT]", "[EOT]", "[PAD]"};
  std::int64_t min_frequency = 2;  // training stops when the most frequent pair is rarer
};

class BpeTokenizer final : public Tokenizer {
 public:
  // Learns merges as HF's BpeTrainer does: words from the ByteLevel pre-tokenizer counted over
  // the documents; then, until vocab_size, the most frequent adjacent pair is merged, ties going
  // to the pair whose (left id, right id) is smallest. A vocab_size below the specials + 256
  // byte symbols is an Error naming both.
  static BpeTokenizer train(std::span<const std::string> documents, const BpeTrainOptions& options);

  // A tokenizer.json (HF's format; model BPE over ByteLevel). Strict: what we do not implement
  // (other models, normalizers, pre-tokenizers, decoders, dropout, byte fallback, truncation,
  // padding, stripped added tokens) and every inconsistency (a merge naming a token the vocab
  // lacks, ids repeated or not exactly 0..N-1, a byte with no token) is an Error naming `source`
  // and the field. name() is `source`.
  static BpeTokenizer from_json(std::string_view json_text, const std::string& source);
  static BpeTokenizer load(const std::string& path);
  // What current HF tokenizers writes: merges as [left, right] pairs, the vocab in id order.
  std::string to_json() const;
  // Written to a temporary name, then renamed: a reader never sees half a file.
  void save(const std::string& path) const;

  // "bpe:VOCAB" for a trained tokenizer, the source (path) for a loaded one.
  std::string name() const override { return name_; }
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(id_bytes_.size()); }
  // Added tokens' text is matched first (leftmost, then longest) and gives their id; the rest is
  // split into words, and each word's byte symbols merged lowest merge rank first, leftmost on
  // ties. Thread-safe: words seen are cached in one table shared by every thread behind a
  // shared mutex (lookups shared, inserts exclusive), up to 10000 words, then only read.
  std::vector<std::int64_t> encode(std::string_view text) const override;
  std::int64_t bot_id() const override { return bot_; }
  std::int64_t eot_id() const override { return eot_; }
  std::int64_t pad_id() const override { return pad_; }

  // The merges in rank order, as the two tokens' text (byte symbols: "Ġ" + "t").
  std::vector<std::pair<std::string, std::string>> merges() const;

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer() override;

 private:
  struct AddedToken {
    std::int64_t id;
    std::string content;
    bool normalized, special;
  };
  struct MergeRule {
    std::int32_t rank, result;
  };
  struct WordCache;

  // `document` is a tokenizer.json whose added_tokens, model.vocab and model.merges are
  // ignored: those come from `vocab` (token text by id), `merges` (ids, in rank order) and
  // `added`. Everything is already checked.
  BpeTokenizer(std::string name, nlohmann::ordered_json document, std::vector<std::string> vocab,
               std::vector<std::pair<std::int32_t, std::int32_t>> merge_pairs, std::vector<AddedToken> added);
  // The tokenizer.json sections of a trained tokenizer: ByteLevel without a prefix space.
  static nlohmann::ordered_json trained_document();
  std::string decode_valid(std::span<const std::int64_t> ids) const override;
  std::int64_t find_or_add_role(const std::vector<std::string>& names);
  void encode_text(std::string_view text, std::vector<std::int64_t>& ids) const;
  void encode_word(std::string_view word, std::vector<std::int64_t>& ids) const;
  void merge_word(std::string_view word, std::vector<std::int32_t>& symbols) const;

  std::string name_;
  nlohmann::ordered_json document_;  // the tokenizer.json sections we keep as read
  std::vector<std::string> vocab_;   // model.vocab: token text (byte symbols) by id
  std::vector<std::pair<std::int32_t, std::int32_t>> merge_pairs_;  // in rank order
  std::vector<AddedToken> added_;
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;

  std::unordered_map<std::string, std::int32_t> vocab_ids_;
  std::unordered_map<std::uint64_t, MergeRule> merge_rules_;  // key: left id << 32 | right id
  std::int32_t byte_ids_[256];
  std::vector<std::string> id_bytes_;    // what each id decodes to
  std::vector<AddedToken> match_order_;  // added tokens, longest content first
  std::int64_t bot_ = 0, eot_ = 0, pad_ = 0;
  std::unique_ptr<WordCache> cache_;
};

}  // namespace shardlab::data
