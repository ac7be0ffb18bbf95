// core/cuda/attention.cu: fused attention on CUDA (core/cpu/attention.cpp's CUDA side), a first
// correct version: one warp per query row in forward, keys taken 32 at a time (a lane's score each)
// with the online softmax over them, so no [T, S] matrix exists; logsumexp saved. Backward
// recomputes the probabilities from it: one warp per query row sums dQ over the keys it sees, one
// warp per key row sums dK and dV over the queries that see it, over the group's query heads too
// (GQA by index, K and V never repeated). Every sum has one owner: no atomics, deterministic.
// Masks as the CPU's: causal (key s > query t hidden), padding keys hidden, and with T == S a
// padding query sees nothing (zeros out, logsumexp -inf, no gradient).
#include <cmath>
#include <cstdint>

#include "core/attention_mask.h"
#include "core/cuda/check.h"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

constexpr unsigned kAll = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kBlockSize / kWarp;

// The warp's global index and lane: one row per warp.
__device__ std::int64_t warp_index() {
  return (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}
__device__ int lane() { return static_cast<int>(threadIdx.x % kWarp); }

template <typename T>
__device__ T warp_sum(T value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(kAll, value, offset);
  return value;
}

template <typename T>
__device__ T warp_max(T value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    value = fmax(value, __shfl_xor_sync(kAll, value, offset));
  return value;
}

// Whether query t of batch row b sees key s (core/attention_mask.h, shared with the CPU).
__device__ bool sees(const AttentionGeometry& g, const bool* padding, std::int64_t b, std::int64_t t,
                     std::int64_t s) {
  return AttentionMask{g.causal, padding, g.queries, g.keys}.sees(b, t, s);
}

// a . b over `n` elements, summed by the calling lane alone.
template <typename T>
__device__ T dot(const T* a, const T* b, std::int64_t n) {
  T sum = 0;
  for (std::int64_t e = 0; e < n; ++e) sum += a[e] * b[e];
  return sum;
}

// Offsets of query (b, h, t) in [B, H, T, *] and key (b, j, s) in [B, Hkv, S, *], in rows.
__device__ std::int64_t query_row(const AttentionGeometry& g, std::int64_t b, std::int64_t h,
                                  std::int64_t t) {
  return (b * g.heads + h) * g.queries + t;
}
__device__ std::int64_t key_row(const AttentionGeometry& g, std::int64_t b, std::int64_t j, std::int64_t s) {
  return (b * g.kv_heads + j) * g.keys + s;
}

// One warp per query row (b, h, t). Lane l holds the output elements e = l, l + 32, ... < Dv.
template <typename T>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, const bool* padding,
                                         AttentionGeometry g, T* out, T* logsumexp) {
  const std::int64_t row = warp_index();
  if (row >= g.batch * g.heads * g.queries) return;  // whole warps leave together
  const std::int64_t t = row % g.queries, h = row / g.queries % g.heads, b = row / (g.queries * g.heads);
  const std::int64_t j = kv_head_of(h, g.heads, g.kv_heads);
  const T* query = q + row * g.head_dim;
  T acc[kMaxValuesPerLane] = {};
  T largest = -INFINITY, total = 0;
  const std::int64_t key_end = AttentionMask{g.causal, padding, g.queries, g.keys}.key_end(t, 1);
  for (std::int64_t s0 = 0; s0 < key_end; s0 += kWarp) {
    const std::int64_t s = s0 + lane();
    const bool mine = s < key_end && sees(g, padding, b, t, s);
    const T score =
        mine ? T(g.scale) * dot(query, k + key_row(g, b, j, s) * g.head_dim, g.head_dim) : T(-INFINITY);
    const T new_largest = fmax(largest, warp_max(score));
    if (new_largest == T(-INFINITY)) continue;  // nothing seen yet
    const T p = mine ? exp(score - new_largest) : T(0);
    const T rescale = exp(largest - new_largest);  // 0 when nothing was seen before
    total = total * rescale + warp_sum(p);
    for (int i = 0; i < kMaxValuesPerLane; ++i) acc[i] *= rescale;
    const std::int64_t in_tile = key_end - s0 < kWarp ? key_end - s0 : kWarp;
    for (std::int64_t c = 0; c < in_tile; ++c) {
      const T weight = __shfl_sync(kAll, p, static_cast<int>(c));
      if (weight == T(0)) continue;
      const T* value = v + key_row(g, b, j, s0 + c) * g.value_dim;
      for (int i = 0; i < kMaxValuesPerLane; ++i) {
        const std::int64_t e = lane() + i * kWarp;
        if (e < g.value_dim) acc[i] += weight * value[e];
      }
    }
    largest = new_largest;
  }
  const T inverse = total > 0 ? T(1) / total : T(0);
  for (int i = 0; i < kMaxValuesPerLane; ++i) {
    const std::int64_t e = lane() + i * kWarp;
    if (e < g.value_dim) out[row * g.value_dim + e] = acc[i] * inverse;
  }
  if (lane() == 0) logsumexp[row] = total > 0 ? largest + log(total) : T(-INFINITY);
}

// delta[row] = grad_out[row] . out[row], one warp per row.
template <typename T>
__global__ void row_delta_kernel(const T* grad_out, const T* out, std::int64_t rows, std::int64_t width,
                                 T* delta) {
  const std::int64_t row = warp_index();
  if (row >= rows) return;
  T sum = 0;
  for (std::int64_t e = lane(); e < width; e += kWarp)
    sum += grad_out[row * width + e] * out[row * width + e];
  sum = warp_sum(sum);
  if (lane() == 0) delta[row] = sum;
}

// The probability query row `row` gives key s, and its softmax-backward term
// ds = p * (dO . v_s - delta); (0, 0) for a hidden pair or a query that sees nothing.
template <typename T>
struct PairTerms {
  T p, ds;
};
template <typename T>
__device__ PairTerms<T> pair_terms(const T* q, const T* k, const T* v, const T* grad_out, const T* logsumexp,
                                   const T* delta, const bool* padding, const AttentionGeometry& g,
                                   std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t j,
                                   std::int64_t s) {
  const std::int64_t row = query_row(g, b, h, t);
  const T lse = logsumexp[row];
  if (lse == T(-INFINITY) || !sees(g, padding, b, t, s)) return {T(0), T(0)};
  const std::int64_t key = key_row(g, b, j, s);
  const T p = exp(T(g.scale) * dot(q + row * g.head_dim, k + key * g.head_dim, g.head_dim) - lse);
  const T dp = dot(grad_out + row * g.value_dim, v + key * g.value_dim, g.value_dim);
  return {p, p * (dp - delta[row])};
}

// One warp per query row: dQ = scale * sum over the keys it sees of ds * k_s.
template <typename T>
__global__ void attention_grad_q_kernel(const T* q, const T* k, const T* v, const T* grad_out,
                                        const T* logsumexp, const T* delta, const bool* padding,
                                        AttentionGeometry g, T* grad_q) {
  const std::int64_t row = warp_index();
  if (row >= g.batch * g.heads * g.queries) return;
  const std::int64_t t = row % g.queries, h = row / g.queries % g.heads, b = row / (g.queries * g.heads);
  const std::int64_t j = kv_head_of(h, g.heads, g.kv_heads);
  T acc[kMaxValuesPerLane] = {};
  const std::int64_t key_end = AttentionMask{g.causal, padding, g.queries, g.keys}.key_end(t, 1);
  for (std::int64_t s0 = 0; s0 < key_end; s0 += kWarp) {
    const std::int64_t s = s0 + lane();
    const T ds =
        s < key_end ? pair_terms(q, k, v, grad_out, logsumexp, delta, padding, g, b, h, t, j, s).ds : T(0);
    const std::int64_t in_tile = key_end - s0 < kWarp ? key_end - s0 : kWarp;
    for (std::int64_t c = 0; c < in_tile; ++c) {
      const T weight = __shfl_sync(kAll, ds, static_cast<int>(c));
      const T* key = k + key_row(g, b, j, s0 + c) * g.head_dim;
      for (int i = 0; i < kMaxValuesPerLane; ++i) {
        const std::int64_t e = lane() + i * kWarp;
        if (e < g.head_dim) acc[i] += weight * key[e];
      }
    }
  }
  for (int i = 0; i < kMaxValuesPerLane; ++i) {
    const std::int64_t e = lane() + i * kWarp;
    if (e < g.head_dim) grad_q[row * g.head_dim + e] = T(g.scale) * acc[i];
  }
}

// One warp per key row (b, j, s): dV = sum of p * dO_t and dK = scale * sum of ds * q_t over every
// query t of the group's query heads that sees it.
template <typename T>
__global__ void attention_grad_kv_kernel(const T* q, const T* k, const T* v, const T* grad_out,
                                         const T* logsumexp, const T* delta, const bool* padding,
                                         AttentionGeometry g, T* grad_k, T* grad_v) {
  const std::int64_t key = warp_index();
  if (key >= g.batch * g.kv_heads * g.keys) return;
  const std::int64_t s = key % g.keys, j = key / g.keys % g.kv_heads, b = key / (g.keys * g.kv_heads);
  const std::int64_t group = g.heads / g.kv_heads;
  T acc_k[kMaxValuesPerLane] = {}, acc_v[kMaxValuesPerLane] = {};
  const std::int64_t first_query = AttentionMask{g.causal, padding, g.queries, g.keys}.first_query(s);
  for (std::int64_t h = j * group; h < (j + 1) * group; ++h) {
    for (std::int64_t t0 = first_query; t0 < g.queries; t0 += kWarp) {
      const std::int64_t t = t0 + lane();
      const PairTerms<T> terms =
          t < g.queries ? pair_terms(q, k, v, grad_out, logsumexp, delta, padding, g, b, h, t, j, s)
                        : PairTerms<T>{T(0), T(0)};
      const std::int64_t in_tile = g.queries - t0 < kWarp ? g.queries - t0 : kWarp;
      for (std::int64_t c = 0; c < in_tile; ++c) {
        const T p = __shfl_sync(kAll, terms.p, static_cast<int>(c));
        const T ds = __shfl_sync(kAll, terms.ds, static_cast<int>(c));
        if (p == T(0) && ds == T(0)) continue;
        const std::int64_t row = query_row(g, b, h, t0 + c);
        for (int i = 0; i < kMaxValuesPerLane; ++i) {
          const std::int64_t e = lane() + i * kWarp;
          if (e < g.value_dim) acc_v[i] += p * grad_out[row * g.value_dim + e];
          if (e < g.head_dim) acc_k[i] += ds * q[row * g.head_dim + e];
        }
      }
    }
  }
  for (int i = 0; i < kMaxValuesPerLane; ++i) {
    const std::int64_t e = lane() + i * kWarp;
    if (e < g.value_dim) grad_v[key * g.value_dim + e] = acc_v[i];
    if (e < g.head_dim) grad_k[key * g.head_dim + e] = T(g.scale) * acc_k[i];
  }
}

unsigned warp_blocks(std::int64_t rows) {
  const std::int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(blocks);
}

}  // namespace

bool launch_attention_forward(DType dtype, const void* q, const void* k, const void* v, const bool* padding,
                              const AttentionGeometry& g, void* out, void* logsumexp, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const std::int64_t rows = g.batch * g.heads * g.queries;
      if (rows == 0) return true;
      attention_forward_kernel<T><<<warp_blocks(rows), kBlockSize, 0, stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), padding, g,
          static_cast<T*>(out), static_cast<T*>(logsumexp));
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

bool launch_attention_backward(DType dtype, const void* grad_out, const void* q, const void* k, const void* v,
                               const void* out, const void* logsumexp, const bool* padding,
                               const AttentionGeometry& g, void* delta, void* grad_q, void* grad_k,
                               void* grad_v, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const std::int64_t rows = g.batch * g.heads * g.queries, keys = g.batch * g.kv_heads * g.keys;
      if (rows == 0 || keys == 0) return true;
      const auto* dout = static_cast<const T*>(grad_out);
      const auto *tq = static_cast<const T*>(q), *tk = static_cast<const T*>(k),
                 *tv = static_cast<const T*>(v);
      const auto* lse = static_cast<const T*>(logsumexp);
      auto* d = static_cast<T*>(delta);
      row_delta_kernel<T><<<warp_blocks(rows), kBlockSize, 0, stream>>>(dout, static_cast<const T*>(out),
                                                                        rows, g.value_dim, d);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      attention_grad_q_kernel<T><<<warp_blocks(rows), kBlockSize, 0, stream>>>(
          tq, tk, tv, dout, lse, d, padding, g, static_cast<T*>(grad_q));
      SHARDLAB_CUDA_CHECK_LAUNCH();
      attention_grad_kv_kernel<T><<<warp_blocks(keys), kBlockSize, 0, stream>>>(
          tq, tk, tv, dout, lse, d, padding, g, static_cast<T*>(grad_k), static_cast<T*>(grad_v));
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

}  // namespace shardlab::cuda
