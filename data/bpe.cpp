// data/bpe.cpp: BpeTokenizer's tables, the special roles, encode (added tokens, words, merges by
// rank, the word cache), decode, writing tokenizer.json and load/save.
#include "data/bpe.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <shared_mutex>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"
#include "data/byte_level.h"

namespace shardlab::data {
namespace {

std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
  return static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32 |
         static_cast<std::uint32_t>(right);
}

// Lets the cache be searched with a string_view: no string is built for a hit.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};

}  // namespace

// As HF's BPE cache: a bounded map from word bytes to ids, filled until full and then only read.
struct BpeTokenizer::WordCache {
  static constexpr std::size_t kCapacity = 10000;
  std::shared_mutex mutex;
  std::unordered_map<std::string, std::vector<std::int32_t>, StringHash, std::equal_to<>> words;
};

BpeTokenizer::BpeTokenizer(std::string name, nlohmann::ordered_json document, std::vector<std::string> vocab,
                           std::vector<std::pair<std::int32_t, std::int32_t>> merge_pairs,
                           std::vector<AddedToken> added)
    : name_(std::move(name)),
      document_(std::move(document)),
      vocab_(std::move(vocab)),
      merge_pairs_(std::move(merge_pairs)),
      added_(std::move(added)),
      cache_(std::make_unique<WordCache>()) {
  add_prefix_space_ = document_["pre_tokenizer"]["add_prefix_space"].get<bool>();
  ignore_merges_ = document_["model"].value("ignore_merges", false);
  for (std::size_t id = 0; id < vocab_.size(); ++id)
    vocab_ids_.emplace(vocab_[id], static_cast<std::int32_t>(id));
  for (int b = 0; b < 256; ++b) byte_ids_[b] = vocab_ids_.at(byte_symbols()[b]);
  // A pair listed twice keeps its last rank, as HF's merge map (built by collecting the list) does.
  for (std::size_t rank = 0; rank < merge_pairs_.size(); ++rank) {
    const auto [left, right] = merge_pairs_[rank];
    merge_rules_[pair_key(left, right)] = {static_cast<std::int32_t>(rank),
                                           vocab_ids_.at(vocab_[left] + vocab_[right])};
  }
  id_bytes_.resize(vocab_.size());
  for (std::size_t id = 0; id < vocab_.size(); ++id)
    id_bytes_[id] = symbols_to_bytes(vocab_[id]).value_or("");
  for (const AddedToken& token : added_) {
    if (token.id >= static_cast<std::int64_t>(id_bytes_.size())) id_bytes_.resize(token.id + 1);
    id_bytes_[token.id] = token.content;
  }
  bot_ = find_or_add_role({"[BOT]", "<s>", "<|begin_of_text|>", "<|startoftext|>"});
  eot_ = find_or_add_role({"[EOT]", "</s>", "<|end_of_text|>", "<|endoftext|>"});
  pad_ = find_or_add_role({"[PAD]", "<pad>", "<|pad|>"});
  match_order_ = added_;
  std::stable_sort(match_order_.begin(), match_order_.end(), [](const AddedToken& a, const AddedToken& b) {
    return a.content.size() > b.content.size();
  });
}

BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

std::int64_t BpeTokenizer::find_or_add_role(const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    for (const AddedToken& token : added_) {
      if (token.content == name) return token.id;
    }
  }
  // Ours, names.front(): at its vocabulary id when the model has that text, else a new id.
  const std::string& content = names.front();
  const auto in_vocab = vocab_ids_.find(content);
  const std::int64_t id = in_vocab != vocab_ids_.end() ? in_vocab->second : vocab_size();
  added_.push_back({.id = id, .content = content, .normalized = false, .special = true});
  if (id == static_cast<std::int64_t>(id_bytes_.size())) id_bytes_.push_back(content);
  return id;
}

std::vector<std::pair<std::string, std::string>> BpeTokenizer::merges() const {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merge_pairs_.size());
  for (const auto& [left, right] : merge_pairs_) out.emplace_back(vocab_[left], vocab_[right]);
  return out;
}

// --- encode ------------------------------------------------------------------------------------

std::vector<std::int64_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<std::int64_t> ids;
  ids.reserve(text.size() / 3);
  // Where each added token next occurs at or after `pos`; searched again only once passed.
  std::vector<std::size_t> next(match_order_.size());
  for (std::size_t k = 0; k < next.size(); ++k) next[k] = text.find(match_order_[k].content);
  std::size_t pos = 0;
  while (true) {
    std::size_t best = std::string_view::npos, best_k = 0;
    for (std::size_t k = 0; k < next.size(); ++k) {
      if (next[k] != std::string_view::npos && next[k] < pos)
        next[k] = text.find(match_order_[k].content, pos);
      // Strictly before: at one position the longest token (first in match_order_) wins.
      if (next[k] < best) best = next[k], best_k = k;
    }
    encode_text(text.substr(pos, best == std::string_view::npos ? std::string_view::npos : best - pos), ids);
    if (best == std::string_view::npos) return ids;
    ids.push_back(match_order_[best_k].id);
    pos = best + match_order_[best_k].content.size();
  }
}

void BpeTokenizer::encode_text(std::string_view text, std::vector<std::int64_t>& ids) const {
  if (text.empty()) return;
  // As HF's ByteLevel: each piece of text between added tokens gets the space.
  std::string prefixed;
  if (add_prefix_space_ && text.front() != ' ') {
    prefixed.push_back(' ');
    prefixed.append(text);
    text = prefixed;
  }
  std::vector<std::string_view> words;
  split_words(text, words);
  for (const std::string_view word : words) encode_word(word, ids);
}

void BpeTokenizer::encode_word(std::string_view word, std::vector<std::int64_t>& ids) const {
  if (word.size() == 1) {
    ids.push_back(byte_ids_[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (ignore_merges_) {
    const auto whole = vocab_ids_.find(bytes_to_symbols(word));
    if (whole != vocab_ids_.end()) {
      ids.push_back(whole->second);
      return;
    }
  }
  {
    std::shared_lock lock(cache_->mutex);
    const auto hit = cache_->words.find(word);
    if (hit != cache_->words.end()) {
      ids.insert(ids.end(), hit->second.begin(), hit->second.end());
      return;
    }
  }
  std::vector<std::int32_t> symbols;
  merge_word(word, symbols);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  std::unique_lock lock(cache_->mutex);
  if (cache_->words.size() < WordCache::kCapacity) cache_->words.emplace(word, std::move(symbols));
}

// HF's order: a min-heap of (rank, position) over adjacent pairs; merging joins the right symbol
// into the left one's slot and queues the two pairs it forms; an entry whose pair has changed
// since it was queued is skipped.
void BpeTokenizer::merge_word(std::string_view word, std::vector<std::int32_t>& out) const {
  struct Symbol {
    std::int32_t id, prev, next;
    bool alive;
  };
  struct Candidate {
    std::int32_t rank, pos, result;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : pos > other.pos;
    }
  };
  const auto n = static_cast<std::int32_t>(word.size());
  std::vector<Symbol> symbols(n);
  for (std::int32_t i = 0; i < n; ++i) {
    symbols[i] = {byte_ids_[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  }
  std::vector<Candidate> heap;
  const auto push = [&](std::int32_t pos) {
    const auto rule = merge_rules_.find(pair_key(symbols[pos].id, symbols[symbols[pos].next].id));
    if (rule == merge_rules_.end()) return;
    heap.push_back({rule->second.rank, pos, rule->second.result});
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  };
  for (std::int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const auto rule = merge_rules_.find(pair_key(left.id, symbols[left.next].id));
    if (rule == merge_rules_.end() || rule->second.result != top.result) continue;
    Symbol& right = symbols[left.next];
    right.alive = false;
    left.id = top.result;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    if (left.next >= 0) push(top.pos);
  }
  for (const Symbol& symbol : symbols) {
    if (symbol.alive) out.push_back(symbol.id);
  }
}

std::string BpeTokenizer::decode_valid(std::span<const std::int64_t> ids) const {
  std::string text;
  for (const std::int64_t id : ids) text += id_bytes_[id];
  return text;
}

// --- tokenizer.json ----------------------------------------------------------------------------

std::string BpeTokenizer::to_json() const {
  nlohmann::ordered_json document = document_;
  std::vector<AddedToken> added = added_;
  std::sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  nlohmann::ordered_json tokens = nlohmann::ordered_json::array();
  for (const AddedToken& token : added) {
    tokens.push_back({{"id", token.id},
                      {"content", token.content},
                      {"single_word", false},
                      {"lstrip", false},
                      {"rstrip", false},
                      {"normalized", token.normalized},
                      {"special", token.special}});
  }
  document["added_tokens"] = std::move(tokens);
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (std::size_t id = 0; id < vocab_.size(); ++id) vocab[vocab_[id]] = id;
  document["model"]["vocab"] = std::move(vocab);
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (const auto& [left, right] : merge_pairs_) merges.push_back({vocab_[left], vocab_[right]});
  document["model"]["merges"] = std::move(merges);
  return document.dump(2);
}

void BpeTokenizer::save(const std::string& path) const {
  const std::string text = to_json();
  PendingFile file(path, "BpeTokenizer::save");
  file.write(text.data(), text.size());
  file.commit();
}

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SHARDLAB_CHECK(in, "BpeTokenizer::load: cannot open '{}'", path);
  std::ostringstream text;
  text << in.rdbuf();
  SHARDLAB_CHECK(!in.bad(), "BpeTokenizer::load: reading '{}' failed", path);
  return from_json(text.str(), path);
}

}  // namespace shardlab::data
