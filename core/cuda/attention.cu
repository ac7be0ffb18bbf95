// core/cuda/attention.cu: fused attention on CUDA (core/cpu/attention.cpp's CUDA side), a first
// correct version: one warp per query row in forward, keys taken 32 at a time (a lane's score each)
// with the online softmax over them, so no [T, S] matrix exists; logsumexp saved. Backward
// recomputes the probabilities from it: one warp per query row sums dQ over the keys it sees, one
// warp per key row sums dK and dV over the queries that see it, over the group's query heads too
// (GQA by index, K and V never repeated). Every sum has one owner: no atomics, deterministic.
// Every operand is read and written through its own strides (q, k and v as a [B, T, H * D] projection
// left them). Masks as the CPU's: causal (key s > query t hidden), padding keys hidden, with T == S a
// padding query sees nothing (zeros out, logsumexp -inf, no gradient), and with documents a query sees
// its own document's keys only. Its entries take flash attention (core/cuda/flash_attention.cu) for
// halves.
#include <cmath>
#include <cstdint>

#include "core/attention_mask.h"
#include "core/cuda/attention_operands.cuh"
#include "core/cuda/indexing.cuh"
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

// a . b over `n` elements, summed by the calling lane alone.
template <typename T>
__device__ T dot(const T* a, const T* b, std::int64_t n) {
  T sum = 0;
  for (std::int64_t e = 0; e < n; ++e) sum += a[e] * b[e];
  return sum;
}

// The flat index of query (b, h, t) in [B, H, T]: its logsumexp and delta.
__device__ std::int64_t query_row(const AttentionGeometry& g, std::int64_t b, std::int64_t h,
                                  std::int64_t t) {
  return (b * g.heads + h) * g.queries + t;
}

// The typed operands of one call, each read through its strides.
template <typename T>
using Operands = TypedAttentionOperands<T, T>;

// One warp per query row (b, h, t). Lane l holds the output elements e = l, l + 32, ... < Dv.
template <typename T>
__global__ void attention_forward_kernel(Operands<T> o, AttentionGeometry g, HeadView<T> out) {
  const std::int64_t row = warp_index();
  if (row >= g.batch * g.heads * g.queries) return;  // whole warps leave together
  const std::int64_t t = row % g.queries, h = row / g.queries % g.heads, b = row / (g.queries * g.heads);
  const std::int64_t j = kv_head_of(h, g.heads, g.kv_heads);
  const T* query = o.q.at(b, h, t);
  T acc[kMaxValuesPerLane] = {};
  T largest = -INFINITY, total = 0;
  const std::int64_t key_end = attention_mask(g, o).key_end(t, 1);
  for (std::int64_t s0 = 0; s0 < key_end; s0 += kWarp) {
    const std::int64_t s = s0 + lane();
    const bool mine = s < key_end && attention_mask(g, o).sees(b, t, s);
    const T score = mine ? T(g.scale) * dot(query, o.k.at(b, j, s), g.head_dim) : T(-INFINITY);
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
      const T* value = o.v.at(b, j, s0 + c);
      for (int i = 0; i < kMaxValuesPerLane; ++i) {
        const std::int64_t e = lane() + i * kWarp;
        if (e < g.value_dim) acc[i] += weight * value[e];
      }
    }
    largest = new_largest;
  }
  const T inverse = total > 0 ? T(1) / total : T(0);
  T* out_row = out.at(b, h, t);
  for (int i = 0; i < kMaxValuesPerLane; ++i) {
    const std::int64_t e = lane() + i * kWarp;
    if (e < g.value_dim) out_row[e] = acc[i] * inverse;
  }
  if (lane() == 0) o.logsumexp[row] = total > 0 ? largest + log(total) : T(-INFINITY);
}

// delta[row] = grad_out[row] . out[row], one warp per query row.
template <typename T>
__global__ void row_delta_kernel(Operands<T> o, AttentionGeometry g) {
  const std::int64_t row = warp_index();
  if (row >= g.batch * g.heads * g.queries) return;
  const std::int64_t t = row % g.queries, h = row / g.queries % g.heads, b = row / (g.queries * g.heads);
  const T *grad = o.grad_out.at(b, h, t), *out = o.out.at(b, h, t);
  T sum = 0;
  for (std::int64_t e = lane(); e < g.value_dim; e += kWarp) sum += grad[e] * out[e];
  sum = warp_sum(sum);
  if (lane() == 0) o.delta[row] = sum;
}

// The probability query (b, h, t) gives key s, and its softmax-backward term
// ds = p * (dO . v_s - delta); (0, 0) for a hidden pair or a query that sees nothing.
template <typename T>
struct PairTerms {
  T p, ds;
};
template <typename T>
__device__ PairTerms<T> pair_terms(const Operands<T>& o, const AttentionGeometry& g, std::int64_t b,
                                   std::int64_t h, std::int64_t t, std::int64_t j, std::int64_t s) {
  const std::int64_t row = query_row(g, b, h, t);
  const T lse = o.logsumexp[row];
  if (lse == T(-INFINITY) || !attention_mask(g, o).sees(b, t, s)) return {T(0), T(0)};
  const T p = exp(T(g.scale) * dot(o.q.at(b, h, t), o.k.at(b, j, s), g.head_dim) - lse);
  const T dp = dot(o.grad_out.at(b, h, t), o.v.at(b, j, s), g.value_dim);
  return {p, p * (dp - o.delta[row])};
}

// One warp per query row: dQ = scale * sum over the keys it sees of ds * k_s.
template <typename T>
__global__ void attention_grad_q_kernel(Operands<T> o, AttentionGeometry g) {
  const std::int64_t row = warp_index();
  if (row >= g.batch * g.heads * g.queries) return;
  const std::int64_t t = row % g.queries, h = row / g.queries % g.heads, b = row / (g.queries * g.heads);
  const std::int64_t j = kv_head_of(h, g.heads, g.kv_heads);
  T acc[kMaxValuesPerLane] = {};
  const std::int64_t key_end = attention_mask(g, o).key_end(t, 1);
  for (std::int64_t s0 = 0; s0 < key_end; s0 += kWarp) {
    const std::int64_t s = s0 + lane();
    const T ds = s < key_end ? pair_terms(o, g, b, h, t, j, s).ds : T(0);
    const std::int64_t in_tile = key_end - s0 < kWarp ? key_end - s0 : kWarp;
    for (std::int64_t c = 0; c < in_tile; ++c) {
      const T weight = __shfl_sync(kAll, ds, static_cast<int>(c));
      const T* key = o.k.at(b, j, s0 + c);
      for (int i = 0; i < kMaxValuesPerLane; ++i) {
        const std::int64_t e = lane() + i * kWarp;
        if (e < g.head_dim) acc[i] += weight * key[e];
      }
    }
  }
  T* grad_row = o.grad_q.at(b, h, t);
  for (int i = 0; i < kMaxValuesPerLane; ++i) {
    const std::int64_t e = lane() + i * kWarp;
    if (e < g.head_dim) grad_row[e] = T(g.scale) * acc[i];
  }
}

// One warp per key row (b, j, s): dV = sum of p * dO_t and dK = scale * sum of ds * q_t over every
// query t of the group's query heads that sees it.
template <typename T>
__global__ void attention_grad_kv_kernel(Operands<T> o, AttentionGeometry g) {
  const std::int64_t key = warp_index();
  if (key >= g.batch * g.kv_heads * g.keys) return;
  const std::int64_t s = key % g.keys, j = key / g.keys % g.kv_heads, b = key / (g.keys * g.kv_heads);
  const std::int64_t group = g.heads / g.kv_heads;
  T acc_k[kMaxValuesPerLane] = {}, acc_v[kMaxValuesPerLane] = {};
  const std::int64_t first_query = attention_mask(g, o).first_query(s);
  for (std::int64_t h = j * group; h < (j + 1) * group; ++h) {
    for (std::int64_t t0 = first_query; t0 < g.queries; t0 += kWarp) {
      const std::int64_t t = t0 + lane();
      const PairTerms<T> terms = t < g.queries ? pair_terms(o, g, b, h, t, j, s) : PairTerms<T>{T(0), T(0)};
      const std::int64_t in_tile = g.queries - t0 < kWarp ? g.queries - t0 : kWarp;
      for (std::int64_t c = 0; c < in_tile; ++c) {
        const T p = __shfl_sync(kAll, terms.p, static_cast<int>(c));
        const T ds = __shfl_sync(kAll, terms.ds, static_cast<int>(c));
        if (p == T(0) && ds == T(0)) continue;
        const T *grad = o.grad_out.at(b, h, t0 + c), *query = o.q.at(b, h, t0 + c);
        for (int i = 0; i < kMaxValuesPerLane; ++i) {
          const std::int64_t e = lane() + i * kWarp;
          if (e < g.value_dim) acc_v[i] += p * grad[e];
          if (e < g.head_dim) acc_k[i] += ds * query[e];
        }
      }
    }
  }
  T *grad_k = o.grad_k.at(b, j, s), *grad_v = o.grad_v.at(b, j, s);
  for (int i = 0; i < kMaxValuesPerLane; ++i) {
    const std::int64_t e = lane() + i * kWarp;
    if (e < g.value_dim) grad_v[e] = acc_v[i];
    if (e < g.head_dim) grad_k[e] = T(g.scale) * acc_k[i];
  }
}

unsigned warp_blocks(std::int64_t rows) {
  const std::int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(blocks);
}

// f32 and f64 (false, launching nothing, for others): the forward writes out and logsumexp.
bool launch_attention_forward(DType dtype, const AttentionOperands& operands, const AttentionGeometry& g,
                              MutableHeads out, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const std::int64_t rows = g.batch * g.heads * g.queries;
      if (rows == 0) return true;
      attention_forward_kernel<T><<<warp_blocks(rows), kBlockSize, 0, stream>>>(
          typed_attention_operands<T, T>(operands), g, head_view<T>(out));
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

bool launch_attention_backward(DType dtype, const AttentionOperands& operands, const AttentionGeometry& g,
                               cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const std::int64_t rows = g.batch * g.heads * g.queries, keys = g.batch * g.kv_heads * g.keys;
      if (rows == 0 || keys == 0) return true;
      const Operands<T> o = typed_attention_operands<T, T>(operands);
      row_delta_kernel<T><<<warp_blocks(rows), kBlockSize, 0, stream>>>(o, g);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      attention_grad_q_kernel<T><<<warp_blocks(rows), kBlockSize, 0, stream>>>(o, g);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      attention_grad_kv_kernel<T><<<warp_blocks(keys), kBlockSize, 0, stream>>>(o, g);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

// --- entries --------------------------------------------------------------------------------------

AttentionGeometry attention_geometry(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttentionParams& params) {
  SHARDLAB_CHECK(q.size(3) <= kMaxAttentionHeadDim && v.size(3) <= kMaxAttentionHeadDim,
                 "{} on cuda: head dims of at most {} (q {}, v {})", op, kMaxAttentionHeadDim,
                 shape_str(q.shape()), shape_str(v.shape()));
  return {.batch = q.size(0),
          .heads = q.size(1),
          .kv_heads = k.size(1),
          .queries = q.size(2),
          .keys = k.size(2),
          .head_dim = q.size(3),
          .value_dim = v.size(3),
          .causal = params.causal,
          .scale = *params.scale};
}

const bool* padding_of(const AttentionParams& params) {
  return params.padding.defined() ? params.padding.data<bool>() : nullptr;
}

const std::int64_t* documents_of(const AttentionParams& params) {
  return params.documents.defined() ? params.documents.data<std::int64_t>() : nullptr;
}

bool is_half(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16; }

// `t`, or a copy of it where its data does not start on 16 bytes (a view's offset), as flash
// attention's 16-byte loads need. The copy is freed after the call, stream-ordered behind the kernel.
Tensor aligned(const Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.raw_data()) % 16 == 0 ? t : t.clone();
}

void cuda_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                            const AttentionResult& result) {
  const LaunchContext context(q);
  const AttentionGeometry geometry = attention_geometry("attention", q, k, v, params);
  if (is_half(q.dtype())) {  // core/attention.cpp's attention_kernel sends only the head dims flash attention
                             // takes
    const Tensor q16 = aligned(q), k16 = aligned(k), v16 = aligned(v);
    const AttentionOperands operands{.q = heads_in(q16),
                                     .k = heads_in(k16),
                                     .v = heads_in(v16),
                                     .padding = padding_of(params),
                                     .documents = documents_of(params),
                                     .logsumexp = result.logsumexp.raw_data()};
    SHARDLAB_CHECK(launch_flash_attention_forward(q.dtype(), operands, geometry, heads_out(result.out),
                                                  context.stream()),
                   "attention: flash attention does not take {} with head dims {} and {}",
                   dtype_name(q.dtype()), q.size(3), v.size(3));
    return;
  }
  const AttentionOperands operands{.q = heads_in(q),
                                   .k = heads_in(k),
                                   .v = heads_in(v),
                                   .padding = padding_of(params),
                                   .documents = documents_of(params),
                                   .logsumexp = result.logsumexp.raw_data()};
  SHARDLAB_CHECK(
      launch_attention_forward(q.dtype(), operands, geometry, heads_out(result.out), context.stream()),
      "attention: no CUDA kernel for {}", dtype_name(q.dtype()));
}

void cuda_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionResult& forward, const AttentionParams& params,
                             const AttentionGrads& grads) {
  const LaunchContext context(q);
  const AttentionGeometry geometry = attention_geometry("attention_backward", q, k, v, params);
  const bool half = is_half(q.dtype());
  const auto operand = [half](const Tensor& t) { return half ? aligned(t) : t; };
  const Tensor dout = operand(grad_out), q_in = operand(q), k_in = operand(k), v_in = operand(v),
               out = operand(forward.out);
  // f32 for the flash kernels, the compute dtype of the fused ones.
  const Tensor delta =
      empty(forward.logsumexp.shape(), TensorOptions{half ? DType::f32 : q.dtype(), q.device()});
  const AttentionOperands operands{.q = heads_in(q_in),
                                   .k = heads_in(k_in),
                                   .v = heads_in(v_in),
                                   .out = heads_in(out),
                                   .grad_out = heads_in(dout),
                                   .padding = padding_of(params),
                                   .documents = documents_of(params),
                                   .logsumexp = forward.logsumexp.raw_data(),
                                   .delta = delta.raw_data(),
                                   .grad_q = heads_out(grads.q),
                                   .grad_k = heads_out(grads.k),
                                   .grad_v = heads_out(grads.v)};
  if (half) {
    SHARDLAB_CHECK(launch_flash_attention_backward(q.dtype(), operands, geometry, context.stream()),
                   "attention_backward: flash attention does not take {} with head dims {} and {}",
                   dtype_name(q.dtype()), q.size(3), v.size(3));
    return;
  }
  SHARDLAB_CHECK(launch_attention_backward(q.dtype(), operands, geometry, context.stream()),
                 "attention_backward: no CUDA kernel for {}", dtype_name(q.dtype()));
}

}  // namespace

AttentionKernels attention_kernels() {
  return {.attention_forward = cuda_attention_forward,
          .attention_backward = cuda_attention_backward,
          .strided_heads = [](const Tensor& t) { return cuda_takes_heads_in_place(layout_of(t)); },
          // The kernels visit every tile the shapes allow, documents or not.
          .scored_pairs = [](const Tensor&, bool) { return 0.0; }};
}

}  // namespace shardlab::cuda
