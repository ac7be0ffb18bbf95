// tests/core/test_attention_mask.cpp: the tile rules of AttentionMask (core/attention_mask.h), which the
// tensor-core kernels walk on a GPU, against the pair rule `sees` tried pair by pair: a block said to
// be seen whole has every pair seen (and, without padding or documents, every block whose pairs are all
// seen is said so); a block said apart shares no document; no query sees a key past key_end or before
// first_query; documents' pairs by hand.
#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "core/attention_mask.h"

using namespace shardlab;

namespace {

// Whether holds(t, s) for every pair of the block of queries [t0, t0 + rows) and keys [s0, s0 + cols).
template <typename Rule>
bool every_pair(std::int64_t t0, std::int64_t rows, std::int64_t s0, std::int64_t cols, const Rule& holds) {
  for (std::int64_t t = t0; t < t0 + rows; ++t)
    for (std::int64_t s = s0; s < s0 + cols; ++s)
      if (!holds(t, s)) return false;
  return true;
}

// Whether every pair of the block is seen, asked pair by pair.
bool every_pair_seen(const AttentionMask& mask, std::int64_t b, std::int64_t t0, std::int64_t rows,
                     std::int64_t s0, std::int64_t cols) {
  return every_pair(t0, rows, s0, cols, [&](std::int64_t t, std::int64_t s) { return mask.sees(b, t, s); });
}

// Documents for 2 batch rows of `length` tokens: row 0 contiguous ones of 2 tokens each (0 0 1 1 2 ...),
// row 1 interleaved (0 1 0 1 ...), which the rule allows too.
std::vector<std::int64_t> documents_of(std::int64_t length) {
  std::vector<std::int64_t> documents(static_cast<std::size_t>(2 * length));
  for (std::int64_t t = 0; t < length; ++t) {
    documents[static_cast<std::size_t>(t)] = t / 2;
    documents[static_cast<std::size_t>(length + t)] = t % 2;
  }
  return documents;
}

// Calls check(mask, b) for every geometry of up to 7 queries and keys, causal or not, without padding
// and with padding on batch row 1's first and last keys, and where queries and keys are the same
// tokens, with documents_of's documents too.
template <typename Check>
void for_every_mask(const Check& check) {
  for (std::int64_t queries = 1; queries <= 7; ++queries) {
    for (std::int64_t keys = 1; keys <= 7; ++keys) {
      std::vector<std::uint8_t> flags(static_cast<std::size_t>(2 * keys), 0);
      flags[static_cast<std::size_t>(keys)] = 1;
      flags[static_cast<std::size_t>(2 * keys - 1)] = 1;
      const bool* padding = reinterpret_cast<const bool*>(flags.data());
      const std::vector<std::int64_t> documents = documents_of(keys);
      std::vector<const std::int64_t*> document_choices{nullptr};
      if (queries == keys) document_choices.push_back(documents.data());
      for (const bool causal : {false, true}) {
        for (const bool* pad : {static_cast<const bool*>(nullptr), padding}) {
          for (const std::int64_t* docs : document_choices) {
            const AttentionMask mask{causal, pad, docs, queries, keys};
            INFO("queries " << queries << ", keys " << keys << (causal ? ", causal" : "")
                            << (pad != nullptr ? ", padding" : "") << (docs != nullptr ? ", documents" : ""));
            for (std::int64_t b = 0; b < 2; ++b) check(mask, b);
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE(
    "AttentionMask::sees_all: a block said seen whole has every pair seen; without padding or documents, "
    "exactly",
    "[attention]") {
  std::int64_t said = 0;
  for_every_mask([&](const AttentionMask& mask, std::int64_t b) {
    for (std::int64_t t0 = -1; t0 <= mask.queries; ++t0) {
      for (std::int64_t rows = 1; rows <= 4; ++rows) {
        for (std::int64_t s0 = -1; s0 <= mask.keys; ++s0) {
          for (std::int64_t cols = 1; cols <= 4; ++cols) {
            INFO("queries [" << t0 << ", " << t0 + rows << "), keys [" << s0 << ", " << s0 + cols << ")");
            const bool whole = mask.sees_all(t0, rows, s0, cols);
            const bool seen = every_pair_seen(mask, b, t0, rows, s0, cols);
            if (whole) CHECK(seen);
            if (mask.padding == nullptr && mask.documents == nullptr)
              CHECK(whole == seen);
            else
              CHECK_FALSE(whole);  // padding or documents: each kernel asks pair by pair
            said += whole ? 1 : 0;
          }
        }
      }
    }
  });
  CHECK(said > 0);
}

TEST_CASE("AttentionMask: no query sees a key past key_end of its block, nor a key before first_query",
          "[attention]") {
  for_every_mask([&](const AttentionMask& mask, std::int64_t b) {
    for (std::int64_t t0 = 0; t0 < mask.queries; ++t0) {
      for (std::int64_t rows = 1; rows <= 4; ++rows) {
        const std::int64_t end = mask.key_end(t0, rows);
        for (std::int64_t t = t0; t < t0 + rows; ++t)
          for (std::int64_t s = end; s < mask.keys; ++s) CHECK_FALSE(mask.sees(b, t, s));
      }
    }
    for (std::int64_t s = 0; s < mask.keys; ++s)
      for (std::int64_t t = 0; t < mask.first_query(s) && t < mask.queries; ++t) CHECK_FALSE(mask.sees(b, t, s));
  });
}

// Whether some query of the block and some key of it share a document, asked pair by pair.
bool shares_a_document(const AttentionMask& mask, std::int64_t b, std::int64_t t0, std::int64_t rows,
                       std::int64_t s0, std::int64_t cols) {
  return !every_pair(t0, rows, s0, cols,
                     [&](std::int64_t t, std::int64_t s) { return mask.other_document(b, t, s); });
}

TEST_CASE("AttentionMask::apart: a block said apart shares no document; for contiguous documents, exactly",
          "[attention]") {
  std::int64_t said = 0;
  for_every_mask([&](const AttentionMask& mask, std::int64_t b) {
    for (std::int64_t t0 = 0; t0 < mask.queries; ++t0) {
      for (std::int64_t rows = 1; t0 + rows <= mask.queries && rows <= 4; ++rows) {
        for (std::int64_t s0 = 0; s0 < mask.keys; ++s0) {
          for (std::int64_t cols = 1; s0 + cols <= mask.keys && cols <= 4; ++cols) {
            INFO("queries [" << t0 << ", " << t0 + rows << "), keys [" << s0 << ", " << s0 + cols << ")");
            const bool apart = mask.apart(b, t0, rows, s0, cols);
            const bool shared = shares_a_document(mask, b, t0, rows, s0, cols);
            if (apart) CHECK_FALSE(shared);
            if (apart) CHECK_FALSE(every_pair_seen(mask, b, t0, rows, s0, cols));
            // Row 0's documents are contiguous (documents_of), row 1's interleaved.
            if (mask.documents == nullptr) CHECK_FALSE(apart);
            if (mask.documents != nullptr && b == 0) CHECK(apart == !shared);
            said += apart ? 1 : 0;
          }
        }
      }
    }
  });
  CHECK(said > 0);
}

TEST_CASE("AttentionMask with documents: a query sees its own document's keys, by hand", "[attention]") {
  // One row of 6 tokens: documents 4 4 7 7 7 and a 4 again (the rule takes any layout); the last
  // token is padding.
  const std::vector<std::int64_t> documents{4, 4, 7, 7, 7, 4};
  const bool padding[6] = {false, false, false, false, false, true};
  // seen[t][s], causal: within a document and at or before the query; the padding query sees nothing.
  const int causal_seen[6][6] = {{1, 0, 0, 0, 0, 0}, {1, 1, 0, 0, 0, 0}, {0, 0, 1, 0, 0, 0},
                                 {0, 0, 1, 1, 0, 0}, {0, 0, 1, 1, 1, 0}, {0, 0, 0, 0, 0, 0}};
  // Not causal, no padding: the whole of each document.
  const int seen[6][6] = {{1, 1, 0, 0, 0, 1}, {1, 1, 0, 0, 0, 1}, {0, 0, 1, 1, 1, 0},
                          {0, 0, 1, 1, 1, 0}, {0, 0, 1, 1, 1, 0}, {1, 1, 0, 0, 0, 1}};
  const AttentionMask causal{true, padding, documents.data(), 6, 6};
  const AttentionMask plain{false, nullptr, documents.data(), 6, 6};
  for (std::int64_t t = 0; t < 6; ++t) {
    for (std::int64_t s = 0; s < 6; ++s) {
      INFO("query " << t << ", key " << s);
      CHECK(causal.sees(0, t, s) == (causal_seen[t][s] == 1));
      CHECK(plain.sees(0, t, s) == (seen[t][s] == 1));
    }
  }
}
