// core/cpu/attention.cpp: fused attention on the CPU, FlashAttention-2 style: 64 x 64 tiles of
// scores multiplied by shardlab's GEMM, an online softmax over the key tiles, GQA by index.
//
// Forward keeps, per query, the running max and sum of exp(score - max) of the keys seen so far
// and rescales its output accumulator when the max grows, so no [T, S] matrix exists; it saves
// logsumexp, from which backward recomputes each tile's probabilities exactly. Causal tiles above
// the diagonal are never visited, nor tiles whose queries and keys lie in different documents. A query
// that sees no key has logsumexp -inf: its probabilities are set to 0 rather than computed as
// exp(-inf - -inf) = NaN.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/attention_mask.h"
#include "core/cpu/fast_exp.h"
#include "core/cpu/gemm.h"
#include "core/cpu/isa.h"
#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

constexpr std::int64_t kTile = 64;  // queries and keys per tile: a score tile fits in L1/L2

// Sizes of q [B, H, T, D], k [B, Hkv, S, D] and v [B, Hkv, S, Dv].
struct Layout {
  std::int64_t batch, heads, kv_heads, queries, keys, head_dim, value_dim;

  std::int64_t group() const { return heads / kv_heads; }
  std::int64_t query_tiles() const { return (queries + kTile - 1) / kTile; }
  std::int64_t key_tiles() const { return (keys + kTile - 1) / kTile; }
  // Index of query (b, h, t) in the contiguous [B, H, T] (logsumexp, delta).
  std::int64_t query(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return (b * heads + h) * queries + t;
  }
};

// A 4-D operand [B, heads, positions, width] read through its strides, its rows in unit stride:
// q, k, v, out, grad_out and the gradients may be transposed views of [B, T, heads, width].
template <typename T>
struct HeadRows {
  T* data;
  std::int64_t batch_stride, head_stride, row_stride;

  explicit HeadRows(const Tensor& t)
      : data(t.data<std::remove_const_t<T>>()),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.stride(2)) {}
  // Row (b, head, position).
  T* at(std::int64_t b, std::int64_t head, std::int64_t position) const {
    return data + b * batch_stride + head * head_stride + position * row_stride;
  }
};

template <typename T>
struct Problem {
  Layout layout;
  AttentionMask visibility;
  T scale;
  HeadRows<const T> q, k, v;

  Problem(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const AttentionParams& params)
      : layout{q_in.size(0), q_in.size(1), k_in.size(1), q_in.size(2),
               k_in.size(2), q_in.size(3), v_in.size(3)},
        visibility{params.causal, params.padding.defined() ? params.padding.data<bool>() : nullptr,
                   params.documents.defined() ? params.documents.data<std::int64_t>() : nullptr,
                   layout.queries, layout.keys},
        scale(static_cast<T>(*params.scale)),
        q(q_in),
        k(k_in),
        v(v_in) {}
};

// Queries t0..t0+rows of head h (key/value head j) of batch row b against keys s0..s0+cols.
struct Tile {
  std::int64_t b, h, j, t0, rows, s0, cols;
};

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

// scores[i, c] (leading dim kTile) = scale * q . k for the tile's pairs, -inf for hidden ones.
template <typename T>
void score_tile(const Problem<T>& p, const Tile& tile, T* scores) {
  gemm(tile.rows, tile.cols, p.layout.head_dim, row_major(p.q.at(tile.b, tile.h, tile.t0), p.q.row_stride),
       transposed(p.k.at(tile.b, tile.j, tile.s0), p.k.row_stride), scores, kTile, false);
  const AttentionMask& vis = p.visibility;
  for (std::int64_t i = 0; i < tile.rows; ++i) {
    const std::int64_t t = tile.t0 + i;
    T* row = scores + i * kTile;
    for (std::int64_t c = 0; c < tile.cols; ++c) row[c] *= p.scale;
    // Causal: keys s > t, i.e. columns from t + 1 - s0 on, are hidden; a blind query sees none.
    const std::int64_t hidden_from = vis.blind(tile.b, t) ? 0
                                     : vis.causal ? std::clamp<std::int64_t>(t + 1 - tile.s0, 0, tile.cols)
                                                  : tile.cols;
    std::fill(row + hidden_from, row + tile.cols, T(kMinusInf));
    if (vis.padding == nullptr && vis.documents == nullptr) continue;
    for (std::int64_t c = 0; c < hidden_from; ++c) {
      const std::int64_t s = tile.s0 + c;
      if (vis.padded_key(tile.b, s) || vis.other_document(tile.b, t, s)) row[c] = T(kMinusInf);
    }
  }
}

// row[c] = exp(row[c] - shift) for row[c] <= shift: scores minus their running max or their
// logsumexp (-inf gives 0). f64 calls std::exp (gradchecks); f32 core/cpu/fast_exp.h's, where
// std::exp, a libm call per element, took a third of the time.
void exp_shifted(double* row, std::int64_t count, double shift) {
  for (std::int64_t c = 0; c < count; ++c) row[c] = std::exp(row[c] - shift);
}

SHARDLAB_CPU_CLONES(void, exp_shifted_f32, (float* row, std::int64_t count, float shift),
                    (row, count, shift)) {
  for (std::int64_t c = 0; c < count; ++c) row[c] = std::max(row[c] - shift, -88.0f);
  for (std::int64_t c = 0; c < count; ++c) row[c] = exp_from_floor(row[c]);
}

void exp_shifted(float* row, std::int64_t count, float shift) { exp_shifted_f32(row, count, shift); }

// A row's max (from `start`) and sum. f32 in 16 lanes (lane j takes elements j, j + 16, ...) folded
// in a fixed order: 16 chains that vectorise instead of one, the same bits under every instruction
// set. f64 (gradchecks) in one chain.
double row_max(const double* row, std::int64_t count, double start) {
  for (std::int64_t c = 0; c < count; ++c) start = std::max(start, row[c]);
  return start;
}

double row_sum(const double* row, std::int64_t count) {
  double sum = 0;
  for (std::int64_t c = 0; c < count; ++c) sum += row[c];
  return sum;
}

constexpr std::int64_t kLanes = 16;

SHARDLAB_CPU_CLONES(float, row_max_f32, (const float* row, std::int64_t count, float start),
                    (row, count, start)) {
  float lanes[kLanes];
  std::fill_n(lanes, kLanes, start);
  std::int64_t c = 0;
  for (; c + kLanes <= count; c += kLanes) {
    for (std::int64_t j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], row[c + j]);
  }
  for (; c < count; ++c) lanes[c % kLanes] = std::max(lanes[c % kLanes], row[c]);
  for (std::int64_t j = 1; j < kLanes; ++j) lanes[0] = std::max(lanes[0], lanes[j]);
  return lanes[0];
}

SHARDLAB_CPU_CLONES(float, row_sum_f32, (const float* row, std::int64_t count), (row, count)) {
  float lanes[kLanes] = {};
  std::int64_t c = 0;
  for (; c + kLanes <= count; c += kLanes) {
    for (std::int64_t j = 0; j < kLanes; ++j) lanes[j] += row[c + j];
  }
  for (; c < count; ++c) lanes[c % kLanes] += row[c];
  for (std::int64_t width = kLanes / 2; width >= 1; width /= 2) {
    for (std::int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

float row_max(const float* row, std::int64_t count, float start) { return row_max_f32(row, count, start); }
float row_sum(const float* row, std::int64_t count) { return row_sum_f32(row, count); }

// --- forward ---------------------------------------------------------------------------------

// Per query row of a tile: the running max and sum of exp(score - max), and the output
// accumulator sum of exp(score - max) v, all over the keys seen so far.
template <typename T>
struct RunningSoftmax {
  std::vector<T> max, total, acc;

  RunningSoftmax(std::int64_t rows, std::int64_t value_dim)
      : max(rows, T(kMinusInf)), total(rows, T(0)), acc(rows * value_dim, T(0)) {}
};

// Turns a tile's scores into exp(score - new max) and rescales each row's total and
// accumulator from its old max to the new one (FlashAttention's online softmax).
template <typename T>
void fold_scores(const Tile& tile, std::int64_t value_dim, T* scores, RunningSoftmax<T>& state) {
  for (std::int64_t i = 0; i < tile.rows; ++i) {
    T* row = scores + i * kTile;
    const T new_max = row_max(row, tile.cols, state.max[i]);
    if (new_max == T(kMinusInf)) {  // nothing seen yet: the row adds nothing
      std::fill(row, row + tile.cols, T(0));
      continue;
    }
    const T rescale = std::exp(state.max[i] - new_max);  // 0 when nothing was seen before
    exp_shifted(row, tile.cols, new_max);
    state.total[i] = state.total[i] * rescale + row_sum(row, tile.cols);
    if (rescale != T(1)) {
      for (std::int64_t e = 0; e < value_dim; ++e) state.acc[i * value_dim + e] *= rescale;
    }
    state.max[i] = new_max;
  }
}

// out = acc / total and logsumexp = max + log(total) per row; zeros and -inf for a row that saw
// no key (total 0).
template <typename T>
void write_rows(const Problem<T>& p, const Tile& tile, const RunningSoftmax<T>& state, const HeadRows<T>& out,
                T* logsumexp) {
  const std::int64_t dv = p.layout.value_dim, first = p.layout.query(tile.b, tile.h, tile.t0);
  for (std::int64_t i = 0; i < tile.rows; ++i) {
    const T total = state.total[i];
    const T inverse = total > 0 ? T(1) / total : T(0);
    T* row = out.at(tile.b, tile.h, tile.t0 + i);
    for (std::int64_t e = 0; e < dv; ++e) row[e] = state.acc[i * dv + e] * inverse;
    logsumexp[first + i] = total > 0 ? state.max[i] + std::log(total) : T(kMinusInf);
  }
}

template <typename T>
void forward_query_tile(const Problem<T>& p, std::int64_t b, std::int64_t h, std::int64_t t0,
                        const HeadRows<T>& out, T* logsumexp) {
  const Layout& l = p.layout;
  const std::int64_t rows = std::min(kTile, l.queries - t0), dv = l.value_dim,
                     j = kv_head_of(h, l.heads, l.kv_heads);
  // Causal: keys after the tile's last query are hidden from all of it; their tiles are skipped.
  const std::int64_t key_end = p.visibility.key_end(t0, rows);
  RunningSoftmax<T> state(rows, dv);
  std::vector<T> scores(kTile * kTile);
  for (std::int64_t s0 = 0; s0 < key_end; s0 += kTile) {
    const Tile tile{b, h, j, t0, rows, s0, std::min(kTile, key_end - s0)};
    if (p.visibility.apart(b, t0, rows, s0, tile.cols)) continue;  // other documents only
    score_tile(p, tile, scores.data());
    fold_scores(tile, dv, scores.data(), state);
    gemm(rows, dv, tile.cols, row_major(scores.data(), kTile), row_major(p.v.at(b, j, s0), p.v.row_stride),
         state.acc.data(), dv, true);
  }
  write_rows(p, Tile{b, h, j, t0, rows, 0, 0}, state, out, logsumexp);
}

template <typename T>
void forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
             const AttentionResult& result) {
  const Problem<T> p(q, k, v, params);
  const Layout& l = p.layout;
  const std::int64_t tiles = l.query_tiles();
  const HeadRows<T> out(result.out);
  T* logsumexp = result.logsumexp.data<T>();
  // One task per (batch row, head, query tile): each writes only its own rows.
  parallel_for(0, l.batch * l.heads * tiles, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t item = first; item < last; ++item) {
      const std::int64_t head_row = item / tiles;
      forward_query_tile(p, head_row / l.heads, head_row % l.heads, item % tiles * kTile, out, logsumexp);
    }
  });
}

// --- backward --------------------------------------------------------------------------------

template <typename T>
struct BackwardOperands {
  HeadRows<const T> grad_out;  // [B, H, T, Dv]
  const T* logsumexp;          // [B, H, T]
  const T* delta;              // [B, H, T]: rowsum(grad_out * out)
  HeadRows<T> grad_q, grad_k, grad_v;
};

// delta[row] = grad_out[row] . out[row], the softmax backward's row term (FlashAttention-2's D), in
// the contiguous [B, H, T] order.
template <typename T>
std::vector<T> row_deltas(const Tensor& grad_out, const Tensor& out) {
  const std::int64_t heads = out.size(1), queries = out.size(2), width = out.size(3);
  const HeadRows<const T> g(grad_out), o(out);
  std::vector<T> delta(out.numel() / width);  // the op skips empty outputs
  parallel_for(0, static_cast<std::int64_t>(delta.size()), 256, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t r = first; r < last; ++r) {
      const std::int64_t b = r / (heads * queries), h = r / queries % heads, t = r % queries;
      const T *gr = g.at(b, h, t), *orow = o.at(b, h, t);
      T sum = 0;
      for (std::int64_t e = 0; e < width; ++e) sum += gr[e] * orow[e];
      delta[r] = sum;
    }
  });
  return delta;
}

// scores -> probabilities exp(score - logsumexp) of the tile's rows, recomputed as forward had them.
template <typename T>
void probabilities(const Layout& l, const Tile& tile, const T* logsumexp, T* scores) {
  for (std::int64_t i = 0; i < tile.rows; ++i) {
    T* row = scores + i * kTile;
    const T lse = logsumexp[l.query(tile.b, tile.h, tile.t0 + i)];
    if (lse == T(kMinusInf)) {  // the query sees no key: no probability, no gradient
      std::fill(row, row + tile.cols, T(0));
      continue;
    }
    exp_shifted(row, tile.cols, lse);
  }
}

// The gradients one tile contributes: dV += P^T dO; dS = scale P * (dO V^T - delta);
// dQ += dS K; dK += dS^T Q.
template <typename T>
void backward_tile(const Problem<T>& p, const BackwardOperands<T>& o, const Tile& tile, T* probs,
                   T* dscores) {
  const Layout& l = p.layout;
  const std::int64_t d = l.head_dim, dv = l.value_dim;
  score_tile(p, tile, probs);
  probabilities(l, tile, o.logsumexp, probs);
  const std::int64_t query = l.query(tile.b, tile.h, tile.t0);
  const MatrixView<T> grad_out = row_major(o.grad_out.at(tile.b, tile.h, tile.t0), o.grad_out.row_stride);
  gemm(tile.cols, dv, tile.rows, transposed(probs, kTile), grad_out, o.grad_v.at(tile.b, tile.j, tile.s0),
       o.grad_v.row_stride, true);
  gemm(tile.rows, tile.cols, dv, grad_out, transposed(p.v.at(tile.b, tile.j, tile.s0), p.v.row_stride),
       dscores, kTile, false);
  for (std::int64_t i = 0; i < tile.rows; ++i) {
    const T delta = o.delta[query + i];
    for (std::int64_t c = 0; c < tile.cols; ++c) {
      dscores[i * kTile + c] = p.scale * probs[i * kTile + c] * (dscores[i * kTile + c] - delta);
    }
  }
  gemm(tile.rows, d, tile.cols, row_major(dscores, kTile),
       row_major(p.k.at(tile.b, tile.j, tile.s0), p.k.row_stride), o.grad_q.at(tile.b, tile.h, tile.t0),
       o.grad_q.row_stride, true);
  gemm(tile.cols, d, tile.rows, transposed(dscores, kTile),
       row_major(p.q.at(tile.b, tile.h, tile.t0), p.q.row_stride), o.grad_k.at(tile.b, tile.j, tile.s0),
       o.grad_k.row_stride, true);
}

// Every tile of key tile s0 of key/value head j: the group's query heads, the queries that can
// see these keys (causal: from s0 on).
template <typename T>
void backward_key_tile(const Problem<T>& p, const BackwardOperands<T>& o, std::int64_t b, std::int64_t j,
                       std::int64_t s0) {
  const Layout& l = p.layout;
  const std::int64_t cols = std::min(kTile, l.keys - s0), group = l.group();
  for (std::int64_t s = s0; s < s0 + cols; ++s) {  // the tiles below add into them
    std::fill_n(o.grad_k.at(b, j, s), l.head_dim, T(0));
    std::fill_n(o.grad_v.at(b, j, s), l.value_dim, T(0));
  }
  std::vector<T> probs(kTile * kTile), dscores(kTile * kTile);
  for (std::int64_t h = j * group; h < (j + 1) * group; ++h) {
    for (std::int64_t t0 = p.visibility.first_query(s0); t0 < l.queries; t0 += kTile) {
      const std::int64_t rows = std::min(kTile, l.queries - t0);
      if (p.visibility.apart(b, t0, rows, s0, cols)) continue;  // other documents only
      backward_tile(p, o, Tile{b, h, j, t0, rows, s0, cols}, probs.data(), dscores.data());
    }
  }
}

// dQ's rows of key/value head j's query heads in batch b, which only the task of (b, j) adds into.
template <typename T>
void zero_query_rows(const Layout& l, const HeadRows<T>& grad_q, std::int64_t b, std::int64_t j) {
  for (std::int64_t h = j * l.group(); h < (j + 1) * l.group(); ++h) {
    for (std::int64_t t = 0; t < l.queries; ++t) std::fill_n(grad_q.at(b, h, t), l.head_dim, T(0));
  }
}

// grad_q = the sum, from 0, of `chunks` consecutive copies of it in `partials`, each laid out as
// grad_q's elements are (dense: offsets 0 to its size - 1 in some order).
template <typename T>
void sum_partials(const std::vector<T>& partials, std::int64_t chunks, T* grad_q) {
  const auto size = static_cast<std::int64_t>(partials.size()) / chunks;
  parallel_for(0, size, 4096, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) grad_q[i] = T(0) + partials[i];
    for (std::int64_t chunk = 1; chunk < chunks; ++chunk) {
      for (std::int64_t i = first; i < last; ++i) grad_q[i] += partials[chunk * size + i];
    }
  });
}

// Backward writes dK and dV of key/value head j only from tasks owning (b, j) and some of its key
// tiles, so they never race. dQ of the group's query heads gets a term from every key tile: with
// one task per (b, j) it is owned too; when there are fewer (b, j) than kMinTasks, the key tiles
// are dealt to `chunks` tasks per (b, j), each adding its dQ terms into its own copy, summed after.
// The chunks follow from the shape, not the thread count, so dQ has the same bits on any number
// of threads.
constexpr std::int64_t kMinTasks = 16;

template <typename T>
void backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
              const AttentionResult& forward, const AttentionParams& params, const AttentionGrads& grads) {
  const Problem<T> p(q, k, v, params);
  const Layout& l = p.layout;
  const std::vector<T> delta = row_deltas<T>(grad_out, forward.out);
  const std::int64_t owners = l.batch * l.kv_heads, key_tiles = l.key_tiles();
  const std::int64_t chunks = std::clamp<std::int64_t>((kMinTasks + owners - 1) / owners, 1, key_tiles);
  const std::int64_t q_numel = q.numel();
  std::vector<T> partial_q(chunks > 1 ? chunks * q_numel : 0, T(0));
  parallel_for(0, owners * chunks, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t item = first; item < last; ++item) {
      const std::int64_t owner = item / chunks, chunk = item % chunks;
      HeadRows<T> grad_q(grads.q);
      if (chunks > 1) {
        grad_q.data = partial_q.data() + chunk * q_numel;  // zeros
      } else {
        zero_query_rows(l, grad_q, owner / l.kv_heads, owner % l.kv_heads);
      }
      const BackwardOperands<T> o{
          HeadRows<const T>(grad_out), forward.logsumexp.data<T>(), delta.data(), grad_q,
          HeadRows<T>(grads.k),        HeadRows<T>(grads.v)};
      // Dealt round robin: causal key tiles late in the sequence have less work.
      for (std::int64_t tile = chunk; tile < key_tiles; tile += chunks) {
        backward_key_tile(p, o, owner / l.kv_heads, owner % l.kv_heads, tile * kTile);
      }
    }
  });
  if (chunks > 1) sum_partials(partial_q, chunks, grads.q.data<T>());
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                       const AttentionResult& result) {
  if (q.dtype() == DType::f64) return forward<double>(q, k, v, params, result);
  forward<float>(q, k, v, params, result);
}

void attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionResult& forward, const AttentionParams& params,
                        const AttentionGrads& grads) {
  if (q.dtype() == DType::f64) return backward<double>(grad_out, q, k, v, forward, params, grads);
  backward<float>(grad_out, q, k, v, forward, params, grads);
}

// The pairs causal (or not) lets through in the tiles the kernels visit: below key_end and not apart.
double scored_pairs(const Tensor& documents, bool causal) {
  const std::int64_t batch = documents.size(0), length = documents.size(1);
  const AttentionMask mask{causal, nullptr, documents.data<std::int64_t>(), length, length};
  double pairs = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t t0 = 0; t0 < length; t0 += kTile) {
      const std::int64_t rows = std::min(kTile, length - t0), key_end = mask.key_end(t0, rows);
      for (std::int64_t s0 = 0; s0 < key_end; s0 += kTile) {
        const std::int64_t cols = std::min(kTile, key_end - s0);
        if (mask.apart(b, t0, rows, s0, cols)) continue;
        for (std::int64_t t = t0; t < t0 + rows; ++t)
          pairs += static_cast<double>(causal ? std::clamp<std::int64_t>(t + 1 - s0, 0, cols) : cols);
      }
    }
  }
  return pairs;
}

}  // namespace

AttentionKernels attention_kernels() {
  return {.attention_forward = attention_forward,
          .attention_backward = attention_backward,
          .strided_heads = [](const Tensor& t) { return t.stride(-1) == 1; },
          .scored_pairs = scored_pairs};
}

}  // namespace shardlab::cpu
