// core/cuda/optimizer.cu: fused optimizer updates, each element's whole update in one thread,
// computed in the parameter's compute type in the CPU kernel's operation order: a strided
// kernel for one parameter, and a multi-segment kernel that updates many contiguous parameters
// in one launch. nvcc may fuse a multiply and an add (the CPU build does not), so the last bit
// can differ from the CPU's. Then the entries (core/optimizer.h), one launch per dtype pair.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/adam_math.h"
#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

// core/ops.h's AdadeltaHyper, in plain types.
struct AdadeltaScalars {
  double lr = 1.0, rho = 0.9, eps = 1e-6, weight_decay = 0.0;
};

// Multi-segment launches: one kernel for many parameters, each a segment of `numel` (> 0)
// contiguous elements per operand with its own hyper-parameters. The kernel reads a table of
// the segments from the device memory `upload` returns (TableUpload, core/cuda/launch.h). False,
// launching nothing, for dtypes without a kernel.

struct AdadeltaSegmentArgs {
  void* param;
  const void* grad;
  void* square_avg;
  void* acc_delta;
  std::int64_t numel;
  AdadeltaScalars hyper;
};
[[nodiscard]] bool launch_adadelta_segments(DType dtype, std::span<const AdadeltaSegmentArgs> segments,
                                            const TableUpload& upload, const bool* apply,
                                            cudaStream_t stream);

struct AdamSegmentArgs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* copy;  // as launch_adam_step's copy, in copy_dtype
  std::int64_t numel;
  AdamScalars hyper;
};
[[nodiscard]] bool launch_adam_segments(DType dtype, DType copy_dtype,
                                        std::span<const AdamSegmentArgs> segments, const TableUpload& upload,
                                        const bool* apply, cudaStream_t stream);

// Adadelta's constants in the compute type, as the CPU kernel rounds them.
template <typename C>
struct AdadeltaCoefficients {
  C lr, rho, keep, eps, decay;
  bool decayed;
};

template <typename C>
AdadeltaCoefficients<C> adadelta_coefficients(const AdadeltaScalars& h) {
  return {static_cast<C>(h.lr),  static_cast<C>(h.rho),          static_cast<C>(1.0 - h.rho),
          static_cast<C>(h.eps), static_cast<C>(h.weight_decay), h.weight_decay != 0};
}

template <typename C, typename T>
__device__ void adadelta_element(const AdadeltaCoefficients<C>& k, T& w, C g, T& sa, T& ad) {
  if (k.decayed) g = g + widen(w) * k.decay;
  const C square = widen(sa) * k.rho + g * g * k.keep;
  sa = narrow<T>(square);
  const C delta = sqrt(widen(ad) + k.eps) / sqrt(widen(sa) + k.eps) * g;
  ad = narrow<T>(widen(ad) * k.rho + delta * delta * k.keep);
  w = narrow<T>(widen(w) - delta * k.lr);
}

template <typename T>
__global__ void adadelta_kernel(T* param, const T* grad, T* square_avg, T* acc_delta, Layout<4> layout,
                                AdadeltaCoefficients<compute_t<T>> k, const bool* apply) {
  if (apply != nullptr && !*apply) return;
  for_each_element(layout, [&](const Offsets<4>& at) {
    adadelta_element(k, param[at.of[0]], widen(grad[at.of[1]]), square_avg[at.of[2]], acc_delta[at.of[3]]);
  });
}

template <typename T, typename Out>
__global__ void adam_kernel(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, Out* copy, Layout<5> layout,
                            AdamCoefficients<compute_t<T>> k, const bool* apply) {
  if (apply != nullptr && !*apply) return;
  for_each_element(layout, [&](const Offsets<5>& at) {
    T& w = param[at.of[0]];
    adam_element(k, w, widen(grad[at.of[1]]), exp_avg[at.of[2]], exp_avg_sq[at.of[3]]);
    copy[at.of[4]] = narrow<Out>(widen(w));
  });
}

// --- multi-segment launches ------------------------------------------------------------------------
// The launch is cut into chunks of kChunk elements, each segment into its own chunks (the last
// one partial), and each block takes chunks in a grid-stride loop. A segment's entry in the
// device table says which chunks are its: a block finds its segment by binary search over
// first_chunk, which increases along the table.

constexpr std::int64_t kChunk = 4 * kBlockSize;

// A segment as the kernels read it from the table: typed operands, the step's constants and
// where its chunks start.
template <typename T>
struct AdadeltaDescriptor {
  T* param;
  const T* grad;
  T* square_avg;
  T* acc_delta;
  std::int64_t numel, first_chunk;
  AdadeltaCoefficients<compute_t<T>> k;
};

template <typename T, typename Out>
struct AdamDescriptor {
  T* param;
  const T* grad;
  T* exp_avg;
  T* exp_avg_sq;
  Out* copy;
  std::int64_t numel, first_chunk;
  AdamCoefficients<compute_t<T>> k;
};

// Calls fn(segment, i) for every element i of every segment of the table.
template <typename Descriptor, typename Fn>
__device__ void for_each_segment_element(const Descriptor* table, std::int64_t segments, std::int64_t chunks,
                                         Fn&& fn) {
  for (std::int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    // A copy in registers: the element loop's stores could otherwise alias the table for nvcc.
    const Descriptor segment = table[segment_of(table, segments, chunk)];
    const std::int64_t begin = (chunk - segment.first_chunk) * kChunk;
    const std::int64_t end = begin + kChunk < segment.numel ? begin + kChunk : segment.numel;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) fn(segment, i);
  }
}

template <typename T>
__global__ void adadelta_segments_kernel(const AdadeltaDescriptor<T>* table, std::int64_t segments,
                                         std::int64_t chunks, const bool* apply) {
  if (apply != nullptr && !*apply) return;
  for_each_segment_element(table, segments, chunks, [](const AdadeltaDescriptor<T>& s, std::int64_t i) {
    adadelta_element(s.k, s.param[i], widen(s.grad[i]), s.square_avg[i], s.acc_delta[i]);
  });
}

template <typename T, typename Out>
__global__ void adam_segments_kernel(const AdamDescriptor<T, Out>* table, std::int64_t segments,
                                     std::int64_t chunks, const bool* apply) {
  if (apply != nullptr && !*apply) return;
  for_each_segment_element(table, segments, chunks, [](const AdamDescriptor<T, Out>& s, std::int64_t i) {
    adam_element(s.k, s.param[i], widen(s.grad[i]), s.exp_avg[i], s.exp_avg_sq[i]);
    s.copy[i] = narrow<Out>(widen(s.param[i]));
  });
}

// Numbers the chunks of `table`'s segments, uploads the table and launches `kernel` over it on
// `stream`, gated by `apply`.
template <typename Descriptor>
void launch_segments(void (*kernel)(const Descriptor*, std::int64_t, std::int64_t, const bool*),
                     std::vector<Descriptor>& table, const TableUpload& upload, const bool* apply,
                     cudaStream_t stream) {
  std::int64_t chunks = 0;
  for (Descriptor& segment : table) {
    segment.first_chunk = chunks;
    chunks += (segment.numel + kChunk - 1) / kChunk;
  }
  const std::size_t bytes = table.size() * sizeof(Descriptor);
  const void* device_table = upload(table.data(), bytes);
  const unsigned blocks = static_cast<unsigned>(chunks < kMaxBlocks ? chunks : kMaxBlocks);
  kernel<<<blocks, kBlockSize, 0, stream>>>(static_cast<const Descriptor*>(device_table),
                                            static_cast<std::int64_t>(table.size()), chunks, apply);
  SHARDLAB_CUDA_CHECK_LAUNCH();
}

// Operands: param, grad, exp_avg, exp_avg_sq (one floating dtype), copy (copy_dtype, floating:
// the updated parameter in its dtype; the parameter itself when there is no copy-out).
bool launch_adam_step(DType dtype, DType copy_dtype, void* param, const void* grad, void* exp_avg,
                      void* exp_avg_sq, void* copy, const Layout<5>& layout, const AdamScalars& hyper,
                      const bool* apply, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    return visit_dtype(copy_dtype, [&]<typename Out>() {
      if constexpr (std::is_floating_point_v<compute_t<T>> && std::is_floating_point_v<compute_t<Out>>) {
        if (layout.numel == 0) return true;
        adam_kernel<T, Out><<<grid_size(layout.numel), kBlockSize, 0, stream>>>(
            static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(exp_avg),
            static_cast<T*>(exp_avg_sq), static_cast<Out*>(copy), layout,
            adam_coefficients<compute_t<T>>(hyper), apply);
        SHARDLAB_CUDA_CHECK_LAUNCH();
        return true;
      } else {
        return false;
      }
    });
  });
}

// Operands: param, grad, square_avg, acc_delta (one floating dtype, any strides); false for
// other dtypes. Every optimizer launch takes `apply`: null, or one bool in device memory that
// the kernel reads first, writing nothing where it is false (core/ops.h's gate).
bool launch_adadelta_step(DType dtype, void* param, const void* grad, void* square_avg, void* acc_delta,
                          const Layout<4>& layout, const AdadeltaScalars& hyper, const bool* apply,
                          cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      if (layout.numel == 0) return true;
      adadelta_kernel<T><<<grid_size(layout.numel), kBlockSize, 0, stream>>>(
          static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(square_avg),
          static_cast<T*>(acc_delta), layout, adadelta_coefficients<compute_t<T>>(hyper), apply);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

bool launch_adadelta_segments(DType dtype, std::span<const AdadeltaSegmentArgs> segments,
                              const TableUpload& upload, const bool* apply, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      std::vector<AdadeltaDescriptor<T>> table;
      for (const AdadeltaSegmentArgs& s : segments) {
        table.push_back({static_cast<T*>(s.param), static_cast<const T*>(s.grad),
                         static_cast<T*>(s.square_avg), static_cast<T*>(s.acc_delta), s.numel, 0,
                         adadelta_coefficients<compute_t<T>>(s.hyper)});
      }
      launch_segments(adadelta_segments_kernel<T>, table, upload, apply, stream);
      return true;
    } else {
      return false;
    }
  });
}

bool launch_adam_segments(DType dtype, DType copy_dtype, std::span<const AdamSegmentArgs> segments,
                          const TableUpload& upload, const bool* apply, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    return visit_dtype(copy_dtype, [&]<typename Out>() {
      if constexpr (std::is_floating_point_v<compute_t<T>> && std::is_floating_point_v<compute_t<Out>>) {
        std::vector<AdamDescriptor<T, Out>> table;
        for (const AdamSegmentArgs& s : segments) {
          table.push_back({static_cast<T*>(s.param), static_cast<const T*>(s.grad),
                           static_cast<T*>(s.exp_avg), static_cast<T*>(s.exp_avg_sq),
                           static_cast<Out*>(s.copy), s.numel, 0, adam_coefficients<compute_t<T>>(s.hyper)});
        }
        launch_segments(adam_segments_kernel<T, Out>, table, upload, apply, stream);
        return true;
      } else {
        return false;
      }
    });
  });
}

// --- entries --------------------------------------------------------------------------------------

bool all_contiguous(std::initializer_list<const Tensor*> tensors) {
  return std::all_of(tensors.begin(), tensors.end(), [](const Tensor* t) { return t->is_contiguous(); });
}

// Contiguous segments go to one multi-segment launch per dtype (pair); segments with a strided
// operand each take the strided kernel.
void cuda_adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply) {
  const LaunchContext context(segments.front().param);
  const bool* gate = apply.defined() ? apply.data<bool>() : nullptr;
  const Device device = segments.front().param.device();
  std::map<DType, std::vector<AdadeltaSegmentArgs>> contiguous;
  for (const auto& [param, grad, square_avg, acc_delta, hyper] : segments) {
    const AdadeltaScalars scalars{hyper.lr, hyper.rho, hyper.eps, hyper.weight_decay};
    if (all_contiguous({&param, &grad, &square_avg, &acc_delta})) {
      contiguous[param.dtype()].push_back({param.raw_data(), grad.raw_data(), square_avg.raw_data(),
                                           acc_delta.raw_data(), param.numel(), scalars});
      continue;
    }
    SHARDLAB_CHECK(
        launch_adadelta_step(param.dtype(), param.raw_data(), grad.raw_data(), square_avg.raw_data(),
                             acc_delta.raw_data(),
                             layout_of<4>("adadelta_step", {&param, &grad, &square_avg, &acc_delta}), scalars,
                             gate, context.stream()),
        "adadelta_step: no CUDA kernel for {}", dtype_name(param.dtype()));
  }
  for (const auto& [dtype, args] : contiguous) {
    Tensor table;
    SHARDLAB_CHECK(launch_adadelta_segments(dtype, args, upload_into(table, device), gate, context.stream()),
                   "adadelta_step: no CUDA kernel for {}", dtype_name(dtype));
  }
}

void cuda_adam_step(std::span<const AdamSegment> segments, const Tensor& apply) {
  const LaunchContext context(segments.front().param);
  const bool* gate = apply.defined() ? apply.data<bool>() : nullptr;
  const Device device = segments.front().param.device();
  std::map<std::pair<DType, DType>, std::vector<AdamSegmentArgs>> contiguous;
  for (const auto& [param, grad, exp_avg, exp_avg_sq, hyper, copy_out] : segments) {
    const Tensor& copy = copy_out.defined() ? copy_out : param;
    if (all_contiguous({&param, &grad, &exp_avg, &exp_avg_sq, &copy})) {
      contiguous[{param.dtype(), copy.dtype()}].push_back(
          {param.raw_data(), grad.raw_data(), exp_avg.raw_data(), exp_avg_sq.raw_data(), copy.raw_data(),
           param.numel(), adam_scalars(hyper)});
      continue;
    }
    SHARDLAB_CHECK(launch_adam_step(param.dtype(), copy.dtype(), param.raw_data(), grad.raw_data(),
                                    exp_avg.raw_data(), exp_avg_sq.raw_data(), copy.raw_data(),
                                    layout_of<5>("adam_step", {&param, &grad, &exp_avg, &exp_avg_sq, &copy}),
                                    adam_scalars(hyper), gate, context.stream()),
                   "adam_step: no CUDA kernel for {} to {}", dtype_name(param.dtype()),
                   dtype_name(copy.dtype()));
  }
  for (const auto& [dtypes, args] : contiguous) {
    Tensor table;
    SHARDLAB_CHECK(launch_adam_segments(dtypes.first, dtypes.second, args, upload_into(table, device), gate,
                                        context.stream()),
                   "adam_step: no CUDA kernel for {} to {}", dtype_name(dtypes.first),
                   dtype_name(dtypes.second));
  }
}

}  // namespace

OptimizerKernels optimizer_kernels() {
  return {.adadelta_step = cuda_adadelta_step, .adam_step = cuda_adam_step};
}

}  // namespace shardlab::cuda
