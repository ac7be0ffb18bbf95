// core/cuda/cudnn_conv.cpp: conv2d through cuDNN's convolution API (core/cuda/cudnn_conv.h). The
// algorithms are fixed, deterministic ones (implicit precomputed GEMM forward, algorithm 1 for both
// gradients), so a run repeats bit for bit; f32 and f64 use FMA math only (no TF32 tensor cores,
// whose 10-bit mantissas would leave the CPU's tolerance) unless set_float32_matmul_precision("high")
// allows TF32 for f32; bf16 and f16 tensor cores accumulating in f32. Workspace comes from the device's
// caching allocator on the stream the call runs on.
#include "core/cuda/cudnn_conv.h"

#include <cudnn.h>

#include <map>

#include "core/allocator.h"
#include "core/cuda/check.h"
#include "core/cuda/runtime.h"
#include "core/error.h"
#include "core/matmul_precision.h"
#include "core/notice.h"

namespace shardlab::cuda::cudnn {

namespace {

void check(cudnnStatus_t status, const char* expr, const char* file, int line) {
  if (status != CUDNN_STATUS_SUCCESS)
    fail("cuDNN error at {}:{}: {} failed: {}", file, line, expr, cudnnGetErrorString(status));
}
#define SHARDLAB_CUDNN_CHECK(expr) check((expr), #expr, __FILE__, __LINE__)

// A cuDNN handle per device, per thread (cuDNN handles are not to be shared between threads).
cudnnHandle_t handle_for(int device, cudaStream_t stream) {
  struct Handles {
    std::map<int, cudnnHandle_t> by_device;
    ~Handles() {
      for (const auto& [device, handle] : by_device) cudnnDestroy(handle);
    }
  };
  thread_local Handles handles;
  cudnnHandle_t& handle = handles.by_device[device];
  if (handle == nullptr) {
    const DeviceGuard guard(device);
    SHARDLAB_CUDNN_CHECK(cudnnCreate(&handle));
  }
  SHARDLAB_CUDNN_CHECK(cudnnSetStream(handle, stream));
  return handle;
}

cudnnDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDNN_DATA_FLOAT;
    case DType::f64:
      return CUDNN_DATA_DOUBLE;
    case DType::bf16:
      return CUDNN_DATA_BFLOAT16;
    case DType::f16:
      return CUDNN_DATA_HALF;
    default:
      fail("conv2d on cuda: cuDNN takes floating dtypes, not {}", dtype_name(dtype));
  }
}

// Halves on tensor cores; f32 on TF32 ones where set_float32_matmul_precision("high") allows, else
// FMA math, as f64.
cudnnMathType_t math_type(DType dtype) {
  if (dtype == DType::bf16 || dtype == DType::f16) return CUDNN_TENSOR_OP_MATH;
  const bool tf32 = dtype == DType::f32 && float32_matmul_precision() == MatmulPrecision::high;
  return tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
}

// The descriptors of one convolution: input, output, filter and the convolution itself.
class Descriptors {
 public:
  Descriptors(DType dtype, const ConvShape& g) {
    const cudnnDataType_t type = data_type(dtype);
    SHARDLAB_CUDNN_CHECK(cudnnCreateTensorDescriptor(&input));
    SHARDLAB_CUDNN_CHECK(cudnnCreateTensorDescriptor(&output));
    SHARDLAB_CUDNN_CHECK(cudnnCreateFilterDescriptor(&filter));
    SHARDLAB_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&convolution));
    // The sizes fit: convolve checked them (cudnn_size_problem) first.
    const auto i = [](std::int64_t v) { return static_cast<int>(v); };
    SHARDLAB_CUDNN_CHECK(cudnnSetTensor4dDescriptor(input, CUDNN_TENSOR_NCHW, type, i(g.batch), i(g.channels),
                                                    i(g.height), i(g.width)));
    SHARDLAB_CUDNN_CHECK(cudnnSetTensor4dDescriptor(output, CUDNN_TENSOR_NCHW, type, i(g.batch), i(g.outs),
                                                    i(g.out_h), i(g.out_w)));
    SHARDLAB_CUDNN_CHECK(cudnnSetFilter4dDescriptor(filter, type, CUDNN_TENSOR_NCHW, i(g.outs), i(g.channels),
                                                    i(g.kernel_h), i(g.kernel_w)));
    // Halves accumulate in f32; f32 and f64 in themselves.
    const cudnnDataType_t compute = dtype == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    SHARDLAB_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(convolution, i(g.padding), i(g.padding), i(g.stride),
                                                         i(g.stride), 1, 1, CUDNN_CROSS_CORRELATION,
                                                         compute));
    SHARDLAB_CUDNN_CHECK(cudnnSetConvolutionMathType(convolution, math_type(dtype)));
  }
  ~Descriptors() {
    cudnnDestroyConvolutionDescriptor(convolution);
    cudnnDestroyFilterDescriptor(filter);
    cudnnDestroyTensorDescriptor(output);
    cudnnDestroyTensorDescriptor(input);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;

  cudnnTensorDescriptor_t input = nullptr, output = nullptr;
  cudnnFilterDescriptor_t filter = nullptr;
  cudnnConvolutionDescriptor_t convolution = nullptr;
};

// Scratch memory for one call, from the caching allocator on the call's stream: freed after the call
// is queued, it is reused only by later work on that stream.
class Workspace {
 public:
  Workspace(int device, std::size_t bytes) : allocator_(&device_allocator(device)), bytes_(bytes) {
    if (bytes_ > 0) data_ = allocator_->allocate(bytes_);
  }
  ~Workspace() {
    if (data_ != nullptr) allocator_->deallocate(data_, bytes_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  Allocator* allocator_;
  std::size_t bytes_;
  void* data_ = nullptr;
};

// alpha 1 and beta 0 in the scaling type cuDNN reads for `dtype`: double for f64, float otherwise.
struct Scaling {
  explicit Scaling(DType dtype) : f64(dtype == DType::f64) {}
  const void* one() const { return f64 ? static_cast<const void*>(&one_d) : &one_f; }
  const void* zero() const { return f64 ? static_cast<const void*>(&zero_d) : &zero_f; }
  bool f64;
  double one_d = 1.0, zero_d = 0.0;
  float one_f = 1.0f, zero_f = 0.0f;
};

// Says once per op and dtype why cuDNN declined, and that im2col + cuBLAS takes the op instead.
bool declined(const char* op, DType dtype, const std::string& why) {
  notice_once(fmt::format("cudnn {} {}", op, dtype_name(dtype)),
              fmt::format("{} in {} on cuda: cuDNN declined ({}); im2col + cuBLAS computes it instead", op,
                          dtype_name(dtype), why));
  return false;
}

// One convolution call: its workspace size asked by `size`, the workspace allocated, `run` called
// with it (alpha 1, beta 0: the output is overwritten). False where cuDNN does not support it.
template <typename Size, typename Run>
bool convolve(const char* op, DType dtype, const ConvShape& shape, int device, cudaStream_t stream,
              Size&& size, Run&& run) {
  if (const std::string problem = cudnn_size_problem(shape); !problem.empty())
    return declined(op, dtype, problem);
  const Descriptors d(dtype, shape);
  cudnnHandle_t handle = handle_for(device, stream);
  std::size_t bytes = 0;
  cudnnStatus_t status = size(handle, d, &bytes);
  if (status == CUDNN_STATUS_NOT_SUPPORTED) return declined(op, dtype, cudnnGetErrorString(status));
  SHARDLAB_CUDNN_CHECK(status);
  const Workspace workspace(device, bytes);
  const Scaling scaling(dtype);
  // NOT_SUPPORTED is answered before anything is queued, so the fallback starts from the same state.
  status = run(handle, d, workspace.data(), workspace.bytes(), scaling.one(), scaling.zero());
  if (status == CUDNN_STATUS_NOT_SUPPORTED) return declined(op, dtype, cudnnGetErrorString(status));
  SHARDLAB_CUDNN_CHECK(status);
  return true;
}

}  // namespace

bool conv2d(DType dtype, const void* input, const void* weight, void* out, const ConvShape& shape, int device,
            cudaStream_t stream) {
  constexpr cudnnConvolutionFwdAlgo_t algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
  return convolve(
      "conv2d", dtype, shape, device, stream,
      [&](cudnnHandle_t h, const Descriptors& d, std::size_t* bytes) {
        return cudnnGetConvolutionForwardWorkspaceSize(h, d.input, d.filter, d.convolution, d.output, algo,
                                                       bytes);
      },
      [&](cudnnHandle_t h, const Descriptors& d, void* work, std::size_t bytes, const void* one,
          const void* zero) {
        return cudnnConvolutionForward(h, one, d.input, input, d.filter, weight, d.convolution, algo, work,
                                       bytes, zero, d.output, out);
      });
}

bool conv2d_backward_input(DType dtype, const void* grad_out, const void* weight, void* grad_in,
                           const ConvShape& shape, int device, cudaStream_t stream) {
  constexpr cudnnConvolutionBwdDataAlgo_t algo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  return convolve(
      "conv2d_backward_input", dtype, shape, device, stream,
      [&](cudnnHandle_t h, const Descriptors& d, std::size_t* bytes) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(h, d.filter, d.output, d.convolution, d.input,
                                                            algo, bytes);
      },
      [&](cudnnHandle_t h, const Descriptors& d, void* work, std::size_t bytes, const void* one,
          const void* zero) {
        return cudnnConvolutionBackwardData(h, one, d.filter, weight, d.output, grad_out, d.convolution, algo,
                                            work, bytes, zero, d.input, grad_in);
      });
}

bool conv2d_backward_weight(DType dtype, const void* grad_out, const void* input, void* grad_weight,
                            const ConvShape& shape, int device, cudaStream_t stream) {
  constexpr cudnnConvolutionBwdFilterAlgo_t algo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
  return convolve(
      "conv2d_backward_weight", dtype, shape, device, stream,
      [&](cudnnHandle_t h, const Descriptors& d, std::size_t* bytes) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, d.input, d.output, d.convolution, d.filter,
                                                              algo, bytes);
      },
      [&](cudnnHandle_t h, const Descriptors& d, void* work, std::size_t bytes, const void* one,
          const void* zero) {
        return cudnnConvolutionBackwardFilter(h, one, d.input, input, d.output, grad_out, d.convolution, algo,
                                              work, bytes, zero, d.filter, grad_weight);
      });
}

}  // namespace shardlab::cuda::cudnn
