// data/bpe_train.cpp: BpeTokenizer::train, HF BpeTrainer's algorithm: pair counts kept up to date
// merge by merge through an index from each pair to the words holding it, and a max-heap of
// pairs whose stale counts are corrected when they surface.
#include <algorithm>
#include <unordered_map>

#include "core/error.h"
#include "data/bpe.h"
#include "data/byte_level.h"

namespace shardlab::data {
namespace {

using Pair = std::uint64_t;  // left id << 32 | right id: compares as (left, right) does

Pair make_pair(std::int32_t left, std::int32_t right) {
  return static_cast<Pair>(left) << 32 | static_cast<std::uint32_t>(right);
}

// A pair queued with its count when queued and the words (indexes, each once) to merge it in.
// HF queues a pair again with only the words that newly formed it, so one pair may be queued
// twice with different words; entries equal in count and pair pop in an unspecified order, in
// HF as here, which matters only when two different merges make the same token.
struct Entry {
  std::int64_t count;
  Pair pair;
  std::vector<std::int32_t> words;
};

// The max-heap order: the higher count; on a tie the smaller pair (HF's rule).
bool lower_priority(const Entry& a, const Entry& b) {
  return a.count != b.count ? a.count < b.count : a.pair > b.pair;
}

struct Change {
  Pair pair;
  int delta;
};

// Replaces each (left, right) in `word`, left to right, by `merged`, reporting the pairs it
// removes and forms next to each occurrence, as HF's Word::merge does.
void merge_in_word(std::vector<std::int32_t>& word, std::int32_t left, std::int32_t right,
                   std::int32_t merged, std::vector<Change>& changes) {
  for (std::size_t i = 0; i + 1 < word.size(); ++i) {
    if (word[i] != left || word[i + 1] != right) continue;
    if (i > 0) {
      changes.push_back({make_pair(word[i - 1], left), -1});
      changes.push_back({make_pair(word[i - 1], merged), +1});
    }
    word[i] = merged;
    word.erase(word.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    if (i + 1 < word.size()) {
      changes.push_back({make_pair(right, word[i + 1]), -1});
      changes.push_back({make_pair(merged, word[i + 1]), +1});
    }
  }
}

}  // namespace

BpeTokenizer BpeTokenizer::train(std::span<const std::string> documents, const BpeTrainOptions& options) {
  const auto specials = static_cast<std::int64_t>(options.special_tokens.size());
  SHARDLAB_CHECK(options.vocab_size >= specials + 256,
                 "BpeTokenizer::train: vocab_size {} is below the {} special tokens + 256 byte symbols = {}",
                 options.vocab_size, specials, specials + 256);

  // The vocabulary: specials, then the byte symbols by code point (HF sorts its alphabet so).
  std::vector<std::string> vocab;
  std::unordered_map<std::string, std::int32_t> ids;
  const auto add = [&](const std::string& token) {
    const auto [at, inserted] = ids.emplace(token, static_cast<std::int32_t>(vocab.size()));
    if (inserted) vocab.push_back(token);
    return at->second;
  };
  std::vector<AddedToken> added;
  for (const std::string& token : options.special_tokens) {
    if (!ids.contains(token))
      added.push_back({.id = add(token), .content = token, .normalized = false, .special = true});
  }
  std::vector<std::string> alphabet(byte_symbols().begin(), byte_symbols().end());
  // UTF-8 byte order is code point order.
  std::sort(alphabet.begin(), alphabet.end());
  for (const std::string& symbol : alphabet) add(symbol);

  // The words: every distinct pre-tokenizer piece with its count, as symbol ids, in sorted order
  // so that the result does not depend on hash order.
  std::unordered_map<std::string_view, std::int64_t> counted;
  std::vector<std::string_view> pieces;
  for (const std::string& document : documents) {
    pieces.clear();
    split_words(document, pieces);
    for (const std::string_view piece : pieces) ++counted[piece];
  }
  std::vector<std::pair<std::string_view, std::int64_t>> sorted(counted.begin(), counted.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::vector<std::int32_t>> words;
  std::vector<std::int64_t> counts;
  for (const auto& [piece, count] : sorted) {
    std::vector<std::int32_t> symbols;
    for (const char byte : piece) symbols.push_back(ids.at(byte_symbols()[static_cast<unsigned char>(byte)]));
    words.push_back(std::move(symbols));
    counts.push_back(count);
  }

  std::unordered_map<Pair, std::int64_t> pair_counts;
  std::unordered_map<Pair, std::vector<std::int32_t>> where;  // words newly holding each pair
  const auto note = [&](Pair pair, int delta, std::int32_t word) {
    pair_counts[pair] += delta * counts[word];
    if (delta <= 0) return;
    std::vector<std::int32_t>& holders = where[pair];
    if (holders.empty() || holders.back() != word) holders.push_back(word);
  };
  for (std::size_t w = 0; w < words.size(); ++w) {
    for (std::size_t i = 0; i + 1 < words[w].size(); ++i) {
      note(make_pair(words[w][i], words[w][i + 1]), 1, static_cast<std::int32_t>(w));
    }
  }
  std::vector<Entry> heap;
  const auto queue_new_pairs = [&] {
    for (auto& [pair, holders] : where) {
      if (pair_counts[pair] > 0) {
        heap.push_back({pair_counts[pair], pair, std::move(holders)});
        std::push_heap(heap.begin(), heap.end(), lower_priority);
      }
    }
    where.clear();
  };
  queue_new_pairs();

  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  std::vector<Change> changes;
  while (static_cast<std::int64_t>(vocab.size()) < options.vocab_size && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower_priority);
    Entry top = std::move(heap.back());
    heap.pop_back();
    const std::int64_t current = pair_counts[top.pair];
    if (top.count != current) {
      top.count = current;
      heap.push_back(std::move(top));
      std::push_heap(heap.begin(), heap.end(), lower_priority);
      continue;
    }
    if (top.count < 1 || top.count < options.min_frequency) break;
    const auto left = static_cast<std::int32_t>(top.pair >> 32);
    const auto right = static_cast<std::int32_t>(top.pair & 0xFFFFFFFFu);
    const std::int32_t merged = add(vocab[left] + vocab[right]);
    merges.emplace_back(left, right);
    for (const std::int32_t w : top.words) {
      changes.clear();
      merge_in_word(words[w], left, right, merged, changes);
      for (const Change& change : changes) note(change.pair, change.delta, w);
    }
    queue_new_pairs();
  }

  const std::string name = fmt::format("bpe:{}", vocab.size());
  return BpeTokenizer(name, trained_document(), std::move(vocab), std::move(merges), std::move(added));
}

}  // namespace shardlab::data
