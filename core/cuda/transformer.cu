// core/cuda/transformer.cu: the Llama block's fused row and elementwise kernels
// (core/cpu/transformer.cpp's CUDA side): RMS normalisation, one warp per row (16-byte packs where
// the rows allow) with the row's sums in double over the warp's shuffles, and its weight gradient in
// two passes, partial sums per chunk of rows and column, then per column over the chunks, in
// core/column_sums.h's order (no atomics, deterministic, the CPU's order); SwiGLU (in 16-byte packs
// where its operands start on 16 bytes) and the rotary embedding, a warp per row. Computed in the
// compute type. Then the family's entries (core/transformer.h).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/column_sums.h"
#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

constexpr unsigned kAll = 0xffffffffu;
constexpr int kWarpsPerBlock = kBlockSize / 32;

// --- a warp per row: a Llama's rows (768 to 8192 elements, a few KB) are too short for a block,
// whose barriers took longer than the row's loads --------------------------------------------------

__device__ std::int64_t first_warp() {
  return static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}
__device__ std::int64_t warp_step() { return static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock; }
__device__ int lane_of() { return static_cast<int>(threadIdx.x % 32); }

unsigned warp_row_blocks(std::int64_t rows) {
  const std::int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// The sum of every lane's `value` over the warp, on every lane.
__device__ double warp_sum(double value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(kAll, value, offset);
  return value;
}

// A lane's share of a row of `width` elements in runs of V (V divides width; V > 1 only where the row
// starts on 16 bytes): fn(e) for the first element of each run, e = V (lane + 32 k), in order.
template <int V, typename Fn>
__device__ void lane_runs(std::int64_t width, Fn&& fn) {
  for (std::int64_t e = std::int64_t{lane_of()} * V; e < width; e += 32 * V) fn(e);
}

// The run of V elements at `at` (16 bytes, or one element), and its store.
template <int V, typename T>
__device__ Pack<T, V> load_run(const T* at) {
  return *reinterpret_cast<const Pack<T, V>*>(at);
}
template <int V, typename T>
__device__ void store_run(T* at, const Pack<T, V>& run) {
  *reinterpret_cast<Pack<T, V>*>(at) = run;
}

// The run at e of a row normalised: x's, or (added non-null) x + added's as binary add rounds it.
template <int V, typename T>
__device__ Pack<T, V> norm_input(const T* x, const T* added, std::int64_t e) {
  Pack<T, V> value = load_run<V>(x + e);
  if (added == nullptr) return value;
  const Pack<T, V> other = load_run<V>(added + e);
#pragma unroll
  for (int v = 0; v < V; ++v) value.lane[v] = narrow<T>(widen(value.lane[v]) + widen(other.lane[v]));
  return value;
}

// With `added`, each row's sum is written to `sum` on the first pass and taken again from x and added
// on the second (the row is in cache), so the residual stream is read once and written once.
template <typename T, int V>
__global__ void rms_norm_kernel(const T* x, const T* added, const T* weight, double eps, std::int64_t rows,
                                std::int64_t width, T* sum, T* out, compute_t<T>* rstd) {
  using C = compute_t<T>;
  for (std::int64_t row = first_warp(); row < rows; row += warp_step()) {
    const std::int64_t base = row * width;
    const T* row_added = added == nullptr ? nullptr : added + base;
    double squares = 0;
    lane_runs<V>(width, [&](std::int64_t e) {
      const Pack<T, V> value = norm_input<V>(x + base, row_added, e);
      if (added != nullptr) store_run(sum + base + e, value);
#pragma unroll
      for (int v = 0; v < V; ++v) squares += double(widen(value.lane[v])) * widen(value.lane[v]);
    });
    const C r = static_cast<C>(1.0 / sqrt(warp_sum(squares) / static_cast<double>(width) + eps));
    if (lane_of() == 0) rstd[row] = r;
    lane_runs<V>(width, [&](std::int64_t e) {
      const Pack<T, V> value = norm_input<V>(x + base, row_added, e), w = load_run<V>(weight + e);
      Pack<T, V> normed;
#pragma unroll
      for (int v = 0; v < V; ++v) normed.lane[v] = narrow<T>(widen(value.lane[v]) * r * widen(w.lane[v]));
      store_run(out + base + e, normed);
    });
  }
}

template <typename T, int V>
__global__ void rms_norm_grad_x_kernel(const T* grad_out, const T* x, const T* weight,
                                       const compute_t<T>* rstd, std::int64_t rows, std::int64_t width,
                                       T* grad_x) {
  using C = compute_t<T>;
  for (std::int64_t row = first_warp(); row < rows; row += warp_step()) {
    const std::int64_t base = row * width;
    double dot = 0;
    lane_runs<V>(width, [&](std::int64_t e) {
      const Pack<T, V> g = load_run<V>(grad_out + base + e), w = load_run<V>(weight + e),
                       in = load_run<V>(x + base + e);
#pragma unroll
      for (int v = 0; v < V; ++v) dot += double(widen(g.lane[v])) * widen(w.lane[v]) * widen(in.lane[v]);
    });
    const C r = rstd[row];
    const C correction = static_cast<C>(warp_sum(dot) / static_cast<double>(width)) * r * r * r;
    lane_runs<V>(width, [&](std::int64_t e) {
      const Pack<T, V> g = load_run<V>(grad_out + base + e), w = load_run<V>(weight + e),
                       in = load_run<V>(x + base + e);
      Pack<T, V> result;
#pragma unroll
      for (int v = 0; v < V; ++v)
        result.lane[v] = narrow<T>(r * (widen(g.lane[v]) * widen(w.lane[v])) - widen(in.lane[v]) * correction);
      store_run(grad_x + base + e, result);
    });
  }
}

// Runs launch.template operator()<V>() with V the elements of a 16-byte run where every row of
// `width` elements at each of `pointers` starts on 16 bytes, else 1.
template <typename T, typename Launch>
void by_run_width(std::int64_t width, std::initializer_list<const void*> pointers, Launch&& launch) {
  constexpr int kPack = pack_width<T>();
  if (width % kPack == 0 && packable(width, pointers)) {
    launch.template operator()<kPack>();
  } else {
    launch.template operator()<1>();
  }
}

// grad_weight's partial sums: block (column block, chunk) sums its chunk's rows of a column per thread,
// in row order (core/column_sums.h); neighbouring threads read neighbouring columns of a row.
template <typename T>
__global__ void rms_norm_grad_weight_partials_kernel(const T* grad_out, const T* x, const compute_t<T>* rstd,
                                                     std::int64_t rows, std::int64_t width,
                                                     double* partials) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= width) return;
  const RowRange range = chunk_rows(blockIdx.y, rows);
  double sum = 0;
  for (std::int64_t row = range.begin; row < range.end; ++row)
    sum += double(widen(grad_out[row * width + e])) * widen(x[row * width + e]) * rstd[row];
  partials[static_cast<std::int64_t>(blockIdx.y) * width + e] = sum;
}

template <typename T>
__global__ void rms_norm_grad_weight_kernel(const double* partials, std::int64_t chunks, std::int64_t width,
                                            T* grad_weight) {
  using C = compute_t<T>;
  for (std::int64_t e = first_thread(); e < width; e += thread_step())
    grad_weight[e] = narrow<T>(static_cast<C>(sum_of_partials(partials, chunks, width, e)));
}

template <typename C>
__device__ C sigmoid_of(C x) {
  return C(1) / (C(1) + exp(-x));
}

template <typename T>
__device__ T swiglu_of(T gate, T up) {
  const compute_t<T> x = widen(gate);
  return narrow<T>(x * sigmoid_of(x) * widen(up));
}

template <typename T>
__device__ void swiglu_grads(T grad_out, T gate, T up, T& grad_gate, T& grad_up) {
  using C = compute_t<T>;
  const C x = widen(gate), s = sigmoid_of(x), d = widen(grad_out);
  grad_gate = narrow<T>(d * widen(up) * (s * (C(1) + x * (C(1) - s))));
  grad_up = narrow<T>(d * (x * s));
}

// Dense operands: 16-byte packs where they start on 16 bytes (map_elements), element by element else.
template <typename T>
__global__ void swiglu_kernel(const T* gate, const T* up, T* out, Layout<3> layout) {
  map_elements(
      layout, [](T g, T u) { return swiglu_of(g, u); }, out, gate, up);
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* grad_out, const T* gate, const T* up, std::int64_t n,
                                       T* grad_gate, T* grad_up, bool packed) {
  if (!packed) {
    for (std::int64_t i = first_thread(); i < n; i += thread_step())
      swiglu_grads(grad_out[i], gate[i], up[i], grad_gate[i], grad_up[i]);
    return;
  }
  constexpr int V = pack_width<T>();
  for_each_pack<V>(
      static_cast<std::uint32_t>(n),
      [&](std::uint32_t p) {
        const Pack<T, V> d = load_pack<V>(grad_out, 1, p), g = load_pack<V>(gate, 1, p),
                         u = load_pack<V>(up, 1, p);
        Pack<T, V> grad_g, grad_u;
#pragma unroll
        for (int v = 0; v < V; ++v)
          swiglu_grads(d.lane[v], g.lane[v], u.lane[v], grad_g.lane[v], grad_u.lane[v]);
        store_pack(grad_gate, p, grad_g);
        store_pack(grad_up, p, grad_u);
      },
      [&](std::uint32_t i) { swiglu_grads(grad_out[i], gate[i], up[i], grad_gate[i], grad_up[i]); });
}

// A warp per row (b, h, t), read and written through each operand's strides, its lanes over the pairs
// of elements e and e + half: the row's indices are worked out once a row (64-bit divisions for each
// pair took most of the kernel's time).
template <typename T>
__global__ void rotary_kernel(HeadView<const T> x, const T* cos, const T* sin, std::int64_t rows,
                              std::int64_t heads, std::int64_t length, std::int64_t width, bool transpose,
                              HeadView<T> out) {
  using C = compute_t<T>;
  const std::int64_t half = width / 2;
  for (std::int64_t row = first_warp(); row < rows; row += warp_step()) {
    const std::int64_t t = row % length, h = row / length % heads, b = row / (length * heads), at = t * width;
    const T* in = x.at(b, h, t);
    T* to = out.at(b, h, t);
    for (std::int64_t e = lane_of(); e < half; e += 32) {
      const C x1 = widen(in[e]), x2 = widen(in[e + half]);
      const C c1 = widen(cos[at + e]), c2 = widen(cos[at + e + half]);
      const C s1 = widen(sin[at + e]), s2 = widen(sin[at + e + half]);
      to[e] = narrow<T>(transpose ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
      to[e + half] = narrow<T>(transpose ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
  }
}

// Contiguous operands of one floating dtype (false, launching nothing, for the others); rstd in the
// compute type. x [rows, width] with weight [width]; with `added` non-null (x's shape) the rows
// normalised are x + added, written to `sum`.
bool launch_rms_norm(DType dtype, const void* x, const void* added, const void* weight, double eps,
                     std::int64_t rows, std::int64_t width, void* sum, void* out, void* rstd,
                     cudaStream_t stream) {
  return floating(dtype, [&]<typename T>() {
    if (rows == 0) return;
    by_run_width<T>(width, {x, added, weight, sum, out}, [&]<int V>() {
      rms_norm_kernel<T, V><<<warp_row_blocks(rows), kBlockSize, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(added), static_cast<const T*>(weight), eps, rows,
          width, static_cast<T*>(sum), static_cast<T*>(out), static_cast<compute_t<T>*>(rstd));
      SHARDLAB_CUDA_CHECK_LAUNCH();
    });
  });
}

// partials: f64 scratch of [column_chunks(rows), width] (core/column_sums.h) for grad_weight's sums.
bool launch_rms_norm_backward(DType dtype, const void* grad_out, const void* x, const void* weight,
                              const void* rstd, std::int64_t rows, std::int64_t width, void* grad_x,
                              void* grad_weight, double* partials, cudaStream_t stream) {
  return floating(dtype, [&]<typename T>() {
    const auto* g = static_cast<const T*>(grad_out);
    const auto* in = static_cast<const T*>(x);
    const auto* r = static_cast<const compute_t<T>*>(rstd);
    if (rows > 0) {
      by_run_width<T>(width, {grad_out, x, weight, grad_x}, [&]<int V>() {
        rms_norm_grad_x_kernel<T, V><<<warp_row_blocks(rows), kBlockSize, 0, stream>>>(
            g, in, static_cast<const T*>(weight), r, rows, width, static_cast<T*>(grad_x));
        SHARDLAB_CUDA_CHECK_LAUNCH();
      });
    }
    const std::int64_t chunks = column_chunks(rows);
    if (chunks > 0) {
      const dim3 blocks(static_cast<unsigned>((width + kBlockSize - 1) / kBlockSize),
                        static_cast<unsigned>(chunks));
      rms_norm_grad_weight_partials_kernel<T>
          <<<blocks, kBlockSize, 0, stream>>>(g, in, r, rows, width, partials);
      SHARDLAB_CUDA_CHECK_LAUNCH();
    }
    rms_norm_grad_weight_kernel<T>
        <<<grid_size(width), kBlockSize, 0, stream>>>(partials, chunks, width, static_cast<T*>(grad_weight));
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

bool launch_swiglu(DType dtype, const void* gate, const void* up, std::int64_t n, void* out,
                   cudaStream_t stream) {
  return floating(dtype, [&]<typename T>() {
    if (n == 0) return;
    const Layout<3> layout = dense_layout<3>(n, {gate, up, out});
    swiglu_kernel<T><<<map_grid<T, T, T>(layout), kBlockSize, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), layout);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

bool launch_swiglu_backward(DType dtype, const void* grad_out, const void* gate, const void* up,
                            std::int64_t n, void* grad_gate, void* grad_up, cudaStream_t stream) {
  return floating(dtype, [&]<typename T>() {
    if (n == 0) return;
    const bool packed = packable(n, {grad_out, gate, up, grad_gate, grad_up});
    constexpr int V = pack_width<T>();
    swiglu_backward_kernel<T><<<grid_size(packed ? (n + V - 1) / V : n), kBlockSize, 0, stream>>>(
        static_cast<const T*>(grad_out), static_cast<const T*>(gate), static_cast<const T*>(up), n,
        static_cast<T*>(grad_gate), static_cast<T*>(grad_up), packed);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// x and out [rows / (heads * length), heads, length, width] (through their strides) by cos, sin [length,
// width]: row r is position r % length.
bool launch_rotary(DType dtype, Heads x, const void* cos, const void* sin, std::int64_t rows,
                   std::int64_t heads, std::int64_t length, std::int64_t width, bool transpose,
                   MutableHeads out, cudaStream_t stream) {
  return floating(dtype, [&]<typename T>() {
    if (rows * width == 0) return;
    rotary_kernel<T><<<warp_row_blocks(rows), kBlockSize, 0, stream>>>(
        head_view<const T>(x), static_cast<const T*>(cos), static_cast<const T*>(sin), rows, heads, length,
        width, transpose, head_view<T>(out));
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// --- entries --------------------------------------------------------------------------------------

void cuda_rms_norm_forward(const Tensor& x, const Tensor& added, const Tensor& weight, double eps,
                           const Tensor& sum, const Tensor& out, const Tensor& rstd) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1);
  const auto data_or_null = [](const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; };
  SHARDLAB_CHECK(
      launch_rms_norm(x.dtype(), x.raw_data(), data_or_null(added), weight.raw_data(), eps, x.numel() / width,
                      width, data_or_null(sum), out.raw_data(), rstd.raw_data(), context.stream()),
      "rms_norm: no CUDA kernel for {}", dtype_name(x.dtype()));
}

void cuda_rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            const Tensor& grad_x, const Tensor& grad_weight) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1), rows = x.numel() / width;
  const Tensor partials = empty({column_chunks(rows), width}, TensorOptions{DType::f64, x.device()});
  SHARDLAB_CHECK(launch_rms_norm_backward(x.dtype(), grad_out.raw_data(), x.raw_data(), weight.raw_data(),
                                          rstd.raw_data(), rows, width, grad_x.raw_data(),
                                          grad_weight.raw_data(), partials.data<double>(), context.stream()),
                 "rms_norm_backward: no CUDA kernel for {}", dtype_name(x.dtype()));
}

void cuda_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const LaunchContext context(gate);
  SHARDLAB_CHECK(launch_swiglu(gate.dtype(), gate.raw_data(), up.raw_data(), gate.numel(), out.raw_data(),
                               context.stream()),
                 "swiglu: no CUDA kernel for {}", dtype_name(gate.dtype()));
}

void cuda_swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up,
                          const Tensor& grad_gate, const Tensor& grad_up) {
  const LaunchContext context(gate);
  SHARDLAB_CHECK(
      launch_swiglu_backward(gate.dtype(), grad_out.raw_data(), gate.raw_data(), up.raw_data(), gate.numel(),
                             grad_gate.raw_data(), grad_up.raw_data(), context.stream()),
      "swiglu_backward: no CUDA kernel for {}", dtype_name(gate.dtype()));
}

void cuda_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const Tensor& out) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1);
  SHARDLAB_CHECK(launch_rotary(x.dtype(), heads_in(x), cos.raw_data(), sin.raw_data(), x.numel() / width,
                               x.dim() == 4 ? x.size(1) : 1, x.size(-2), width, transpose, heads_out(out),
                               context.stream()),
                 "rotary_embedding: no CUDA kernel for {}", dtype_name(x.dtype()));
}

}  // namespace

TransformerKernels transformer_kernels() {
  return {.rms_norm_forward = cuda_rms_norm_forward,
          .rms_norm_backward = cuda_rms_norm_backward,
          .swiglu_forward = cuda_swiglu_forward,
          .swiglu_backward = cuda_swiglu_backward,
          .rotary = cuda_rotary};
}

}  // namespace shardlab::cuda
