// core/cuda/gemm.cpp: GEMMs through cuBLAS, and through cuBLASLt where a bias rides in the epilogue;
// both libraries resolved with dlopen on first use. One cuBLAS handle per (device, thread), since a
// handle must not be used by two threads at once; one cuBLASLt handle and workspace per stream.
#include "core/cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_api.h>
#include <dlfcn.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda/check.h"
#include "core/error.h"
#include "core/matmul_precision.h"

namespace shardlab::cuda {
namespace {

// The functions of libcublas.so we call, by their exported names.
struct CublasLibrary {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  // The C entry point (C++ also sees an overload with 64-bit sizes).
  cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                         const void*, cudaDataType, int, long long, const void*, cudaDataType, int, long long,
                         const void*, void*, cudaDataType, int, long long, int, cublasComputeType_t,
                         cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

template <typename Fn>
void resolve(void* library, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  SHARDLAB_CHECK(fn != nullptr, "cuBLAS: symbol {} not found in its library: {}", name, dlerror());
}

// The toolkit this build was compiled against first, then the loader's search path (a machine with
// the NVIDIA wheels puts their lib directories on LD_LIBRARY_PATH). The library stays loaded.
void* open_library(const std::string& stem, const char* purpose) {
  std::string tried;
  for (const std::string& name : {std::string(SHARDLAB_CUDA_LIB_DIR) + "/" + stem + ".so", stem + ".so",
                                  stem + ".so.13", stem + ".so.12"}) {
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) return handle;
    tried += fmt::format("\n  {}: {}", name, dlerror());
  }
  fail("cuBLAS: cannot load {} ({} needs it); tried:{}", stem, purpose, tried);
}

const CublasLibrary& cublas() {
  static const CublasLibrary library = [] {
    void* handle = open_library("libcublas", "matmul on CUDA");
    CublasLibrary functions;
    resolve(handle, "cublasCreate_v2", functions.create);
    resolve(handle, "cublasDestroy_v2", functions.destroy);
    resolve(handle, "cublasSetStream_v2", functions.set_stream);
    resolve(handle, "cublasGemmStridedBatchedEx", functions.gemm);
    resolve(handle, "cublasGetStatusString", functions.status_string);
    return functions;
  }();
  return library;
}

// The functions of libcublasLt.so we call.
struct CublasLtLibrary {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;
};

const CublasLtLibrary& cublas_lt() {
  static const CublasLtLibrary library = [] {
    void* handle = open_library("libcublasLt", "a Linear's bias in the GEMM's epilogue on CUDA");
    CublasLtLibrary f;
    resolve(handle, "cublasLtCreate", f.create);
    resolve(handle, "cublasLtDestroy", f.destroy);
    resolve(handle, "cublasLtMatmulDescCreate", f.desc_create);
    resolve(handle, "cublasLtMatmulDescDestroy", f.desc_destroy);
    resolve(handle, "cublasLtMatmulDescSetAttribute", f.desc_set);
    resolve(handle, "cublasLtMatrixLayoutCreate", f.layout_create);
    resolve(handle, "cublasLtMatrixLayoutDestroy", f.layout_destroy);
    resolve(handle, "cublasLtMatrixLayoutSetAttribute", f.layout_set);
    resolve(handle, "cublasLtMatmulPreferenceCreate", f.preference_create);
    resolve(handle, "cublasLtMatmulPreferenceDestroy", f.preference_destroy);
    resolve(handle, "cublasLtMatmulPreferenceSetAttribute", f.preference_set);
    resolve(handle, "cublasLtMatmulAlgoGetHeuristic", f.heuristic);
    resolve(handle, "cublasLtMatmul", f.matmul);
    resolve(handle, "cublasLtGetStatusString", f.status_string);
    return f;
  }();
  return library;
}

void check_cublas_status(cublasStatus_t status, const char* (*describe)(cublasStatus_t), const char* expr,
                         const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLAS error at {}:{}: {} failed: {}", file, line, expr, describe(status));
}
#define SHARDLAB_CUBLAS_CHECK(expr) \
  check_cublas_status((expr), cublas().status_string, #expr, __FILE__, __LINE__)
#define SHARDLAB_CUBLASLT_CHECK(expr) \
  check_cublas_status((expr), cublas_lt().status_string, #expr, __FILE__, __LINE__)

class Handle {
 public:
  explicit Handle(int device) : device_(device) {
    const DeviceGuard guard(device);
    SHARDLAB_CUBLAS_CHECK(cublas().create(&handle_));
  }
  ~Handle() {
    const DeviceGuard guard(device_);
    cublas().destroy(handle_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  cublasHandle_t get() const { return handle_; }

 private:
  int device_;
  cublasHandle_t handle_ = nullptr;
};

cublasHandle_t handle_for(int device) {
  thread_local std::map<int, std::unique_ptr<Handle>> handles;
  auto& handle = handles[device];
  if (!handle) handle = std::make_unique<Handle>(device);
  return handle->get();
}

cudaDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::f64:
      return CUDA_R_64F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      fail("matmul on cuda: no GEMM for dtype {}", dtype_name(dtype));
  }
}

int as_int(std::int64_t value, const char* what) {
  SHARDLAB_CHECK(value >= 0 && value <= 0x7fffffff, "matmul on cuda: {} = {} exceeds cuBLAS's int range",
                 what, value);
  return static_cast<int>(value);
}

// f64 in f64; f32 in f32, or on TF32 tensor cores where set_float32_matmul_precision("high") allows;
// halves accumulate in f32.
cublasComputeType_t compute_type(DType dtype) {
  if (dtype == DType::f64) return CUBLAS_COMPUTE_64F;
  const bool tf32 = dtype == DType::f32 && float32_matmul_precision() == MatmulPrecision::high;
  return tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// The scale type cuBLAS(Lt) reads alpha and beta in: double for f64, float otherwise.
struct Scaling {
  explicit Scaling(DType dtype) : f64(dtype == DType::f64) {}
  const void* one() const { return f64 ? static_cast<const void*>(&one_d) : &one_f; }
  const void* zero() const { return f64 ? static_cast<const void*>(&zero_d) : &zero_f; }
  cudaDataType_t type() const { return f64 ? CUDA_R_64F : CUDA_R_32F; }
  bool f64;
  double one_d = 1.0, zero_d = 0.0;
  float one_f = 1.0f, zero_f = 0.0f;
};

// --- cuBLASLt: a handle and its workspace per (device, stream), descriptors owned ------------------

// cuBLASLt's split-K and stream-K algorithms need scratch; without any, the heuristic leaves them out.
// Its own, not the caching allocator's: a model's planned bytes stay what its tensors hold.
constexpr std::size_t kLtWorkspaceBytes = std::size_t{4} << 20;

class LtHandle {
 public:
  explicit LtHandle(int device) : device_(device) {
    const DeviceGuard guard(device);
    SHARDLAB_CUBLASLT_CHECK(cublas_lt().create(&handle_));
    SHARDLAB_CUDA_CHECK(cudaMalloc(&workspace_, kLtWorkspaceBytes));
  }
  ~LtHandle() {
    const DeviceGuard guard(device_);
    cudaFree(workspace_);  // the device waits for queued work that still reads it
    cublas_lt().destroy(handle_);
  }
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  cublasLtHandle_t get() const { return handle_; }
  void* workspace() const { return workspace_; }

 private:
  int device_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

// Two GEMMs queued on different streams must not share scratch; one thread may queue on several.
const LtHandle& lt_handle_for(int device, cudaStream_t stream) {
  thread_local std::map<std::pair<int, cudaStream_t>, std::unique_ptr<LtHandle>> handles;
  auto& handle = handles[{device, stream}];
  if (!handle) handle = std::make_unique<LtHandle>(device);
  return *handle;
}

template <typename T, typename Attribute, typename Value>
void set_attribute(cublasStatus_t (*set)(T, Attribute, const void*, std::size_t), T descriptor,
                   Attribute attribute, const Value& value) {
  SHARDLAB_CUBLASLT_CHECK(set(descriptor, attribute, &value, sizeof(value)));
}

// A column-major matrix as cuBLASLt sees it: stored rows x cols, its leading dimension, `batches` of
// them `batch_stride` elements apart.
class LtLayout {
 public:
  LtLayout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t leading,
           std::int64_t batches, std::int64_t batch_stride) {
    SHARDLAB_CUBLASLT_CHECK(cublas_lt().layout_create(&layout_, type, static_cast<std::uint64_t>(rows),
                                                      static_cast<std::uint64_t>(cols), leading));
    set_attribute(cublas_lt().layout_set, layout_, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                  static_cast<std::int32_t>(as_int(batches, "batch count")));
    set_attribute(cublas_lt().layout_set, layout_, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, batch_stride);
  }
  ~LtLayout() { cublas_lt().layout_destroy(layout_); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
  cublasLtMatrixLayout_t get() const { return layout_; }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

// op(operand) is rows x cols: stored so, or transposed (cols x rows).
LtLayout operand_layout(cudaDataType_t type, const GemmOperand& operand, std::int64_t rows, std::int64_t cols,
                        std::int64_t batches) {
  return operand.transposed ? LtLayout(type, cols, rows, operand.leading, batches, operand.batch_stride)
                            : LtLayout(type, rows, cols, operand.leading, batches, operand.batch_stride);
}

class LtMatmulDesc {
 public:
  LtMatmulDesc(DType dtype, const GemmOperand& a, const GemmOperand& b, const void* bias) {
    SHARDLAB_CUBLASLT_CHECK(cublas_lt().desc_create(&desc_, compute_type(dtype), Scaling(dtype).type()));
    set(CUBLASLT_MATMUL_DESC_TRANSA, a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
    set(CUBLASLT_MATMUL_DESC_TRANSB, b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);  // in the output's dtype, the default
  }
  ~LtMatmulDesc() { cublas_lt().desc_destroy(desc_); }
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;
  cublasLtMatmulDesc_t get() const { return desc_; }

 private:
  template <typename Value>
  void set(cublasLtMatmulDescAttributes_t attribute, const Value& value) {
    set_attribute(cublas_lt().desc_set, desc_, attribute, value);
  }
  cublasLtMatmulDesc_t desc_ = nullptr;
};

// The largest power of two up to 256 that `data`'s address is a multiple of.
std::uint32_t alignment_of(const void* data) {
  const auto address = reinterpret_cast<std::uintptr_t>(data);
  std::uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// cuBLASLt's first choice for the GEMM within the workspace. The heuristic assumes operands on 256
// bytes unless told otherwise, and a view (a Linear's weight inside FSDP's gathered buffer) may start
// anywhere: each operand's own alignment rules out the algorithms it would break.
cublasLtMatmulAlgo_t best_algorithm(cublasLtHandle_t handle, const LtMatmulDesc& desc, const LtLayout& a,
                                    const void* a_data, const LtLayout& b, const void* b_data,
                                    const LtLayout& out, const void* out_data) {
  cublasLtMatmulPreference_t preference = nullptr;
  SHARDLAB_CUBLASLT_CHECK(cublas_lt().preference_create(&preference));
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(cublas_lt().preference_destroy)> owned(
      preference, cublas_lt().preference_destroy);
  const auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
    set_attribute(cublas_lt().preference_set, preference, attribute, value);
  };
  prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(kLtWorkspaceBytes));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(a_data));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(b_data));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(out_data));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(out_data));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  SHARDLAB_CUBLASLT_CHECK(cublas_lt().heuristic(handle, desc.get(), a.get(), b.get(), out.get(), out.get(),
                                                preference, 1, &result, &found));
  SHARDLAB_CHECK(found > 0, "matmul on cuda: cuBLASLt has no algorithm for this GEMM with a bias epilogue");
  return result.algo;
}

void gemm_with_bias(DType dtype, std::int64_t batches, std::int64_t rows, std::int64_t cols,
                    std::int64_t inner, const GemmOperand& a, const GemmOperand& b, void* out,
                    std::int64_t out_leading, std::int64_t out_batch_stride, const void* bias, int device,
                    cudaStream_t stream) {
  const cudaDataType_t type = data_type(dtype);
  const LtHandle& handle = lt_handle_for(device, stream);
  const LtMatmulDesc desc(dtype, a, b, bias);
  const LtLayout a_layout = operand_layout(type, a, rows, inner, batches);
  const LtLayout b_layout = operand_layout(type, b, inner, cols, batches);
  const LtLayout out_layout(type, rows, cols, out_leading, batches, out_batch_stride);
  const cublasLtMatmulAlgo_t algorithm =
      best_algorithm(handle.get(), desc, a_layout, a.data, b_layout, b.data, out_layout, out);
  const Scaling scaling(dtype);
  SHARDLAB_CUBLASLT_CHECK(cublas_lt().matmul(handle.get(), desc.get(), scaling.one(), a.data, a_layout.get(),
                                             b.data, b_layout.get(), scaling.zero(), out, out_layout.get(),
                                             out, out_layout.get(), &algorithm, handle.workspace(),
                                             kLtWorkspaceBytes, stream));
}

}  // namespace

void gemm_batched(DType dtype, std::int64_t batches, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                  const GemmOperand& a, const GemmOperand& b, void* out, std::int64_t out_leading,
                  std::int64_t out_batch_stride, int device, cudaStream_t stream, const void* bias) {
  if (bias != nullptr) {
    return gemm_with_bias(dtype, batches, rows, cols, inner, a, b, out, out_leading, out_batch_stride, bias,
                          device, stream);
  }
  const cudaDataType_t type = data_type(dtype);
  const cublasHandle_t handle = handle_for(device);
  SHARDLAB_CUBLAS_CHECK(cublas().set_stream(handle, stream));
  const Scaling scaling(dtype);
  SHARDLAB_CUBLAS_CHECK(cublas().gemm(
      handle, a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
      as_int(rows, "rows"), as_int(cols, "columns"), as_int(inner, "inner size"), scaling.one(), a.data, type,
      as_int(a.leading, "leading dimension"), a.batch_stride, b.data, type,
      as_int(b.leading, "leading dimension"), b.batch_stride, scaling.zero(), out, type,
      as_int(out_leading, "leading dimension"), out_batch_stride, as_int(batches, "batch count"),
      compute_type(dtype), CUBLAS_GEMM_DEFAULT));
}

}  // namespace shardlab::cuda
