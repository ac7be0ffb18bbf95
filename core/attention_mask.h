// core/attention_mask.h: internal to core: which keys an attention query sees, and which tiles of
// queries and keys can hold a pair it sees, written once for the CPU kernel and both CUDA kernels
// (SHARDLAB_HD), so that the CPU's tests in CI check the tile walks the GPUs take.
#pragma once

#include <cstdint>

#include "core/dtype.h"  // SHARDLAB_HD

namespace shardlab {

// core/attention.h's rule: causal hides keys after the query (top-left aligned), padding keys are
// hidden, when T == S (queries and keys the same tokens) a padding query sees nothing, and with
// documents a query sees only the keys of its own document.
struct AttentionMask {
  bool causal = false;
  const bool* padding = nullptr;            // [B, S], or null
  const std::int64_t* documents = nullptr;  // [B, T] (T == S), or null
  std::int64_t queries = 0, keys = 0;

  // A padding query when queries and keys are the same tokens: it sees no key.
  SHARDLAB_HD bool blind(std::int64_t b, std::int64_t t) const {
    return padding != nullptr && queries == keys && padding[b * keys + t];
  }
  SHARDLAB_HD bool padded_key(std::int64_t b, std::int64_t s) const {
    return padding != nullptr && padding[b * keys + s];
  }
  // Whether query t and key s of batch row b lie in different documents.
  SHARDLAB_HD bool other_document(std::int64_t b, std::int64_t t, std::int64_t s) const {
    return documents != nullptr && documents[b * keys + t] != documents[b * keys + s];
  }
  // Whether query t of batch row b sees key s; false past either end.
  SHARDLAB_HD bool sees(std::int64_t b, std::int64_t t, std::int64_t s) const {
    if (t < 0 || t >= queries || s < 0 || s >= keys) return false;
    if (causal && s > t) return false;
    return !padded_key(b, s) && !blind(b, t) && !other_document(b, t, s);
  }
  // The keys queries [t0, t0 + rows) can see at all: [0, key_end). Causal tiles past it are skipped.
  SHARDLAB_HD std::int64_t key_end(std::int64_t t0, std::int64_t rows) const {
    const std::int64_t last = t0 + rows < queries ? t0 + rows : queries;  // one past the last query
    return causal && last < keys ? last : keys;
  }
  // Whether every query of [t0, t0 + rows) sees every key of [s0, s0 + cols): no padding or documents,
  // the whole block inside both ends, and under causal its last key at or before its first query. The
  // tensor-core kernels then skip the per-pair mask of a warp's block, a uniform branch.
  SHARDLAB_HD bool sees_all(std::int64_t t0, std::int64_t rows, std::int64_t s0, std::int64_t cols) const {
    if (padding != nullptr || documents != nullptr) return false;
    if (t0 < 0 || s0 < 0 || t0 + rows > queries || s0 + cols > keys) return false;
    return !causal || s0 + cols - 1 <= t0;
  }
  // Whether no query of [t0, t0 + rows) shares a document with a key of [s0, s0 + cols) of batch row b:
  // the ranges of their documents' values do not meet, which holds for documents of any layout and, for
  // packed ones (contiguous, increasing), is exactly that they share none. False without documents. The
  // CPU kernel skips such a tile: its pairs would add exactly nothing.
  SHARDLAB_HD bool apart(std::int64_t b, std::int64_t t0, std::int64_t rows, std::int64_t s0,
                         std::int64_t cols) const {
    if (documents == nullptr) return false;
    const std::int64_t* row = documents + b * keys;
    std::int64_t query_low = row[t0], query_high = row[t0], key_low = row[s0], key_high = row[s0];
    for (std::int64_t t = t0 + 1; t < t0 + rows; ++t) {
      query_low = row[t] < query_low ? row[t] : query_low;
      query_high = row[t] > query_high ? row[t] : query_high;
    }
    for (std::int64_t s = s0 + 1; s < s0 + cols; ++s) {
      key_low = row[s] < key_low ? row[s] : key_low;
      key_high = row[s] > key_high ? row[s] : key_high;
    }
    return query_high < key_low || key_high < query_low;
  }
  // The first query that can see key s: the backward's walk over query tiles for a key tile starts at
  // the tile holding it.
  SHARDLAB_HD std::int64_t first_query(std::int64_t s) const { return causal ? s : 0; }
};

// The key/value head that query head h reads under grouped-query attention.
SHARDLAB_HD inline std::int64_t kv_head_of(std::int64_t h, std::int64_t heads, std::int64_t kv_heads) {
  return h / (heads / kv_heads);
}

}  // namespace shardlab
