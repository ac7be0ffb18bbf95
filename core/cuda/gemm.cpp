// core/cuda/gemm.cpp: the cuBLAS entry points we use, resolved with dlopen on first use; one
// handle per (device, thread), since a cuBLAS handle must not be used by two threads at once.
#include "core/cuda/gemm.h"

#include <cublas_api.h>
#include <dlfcn.h>

#include <map>
#include <memory>
#include <string>

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
  SHARDLAB_CHECK(fn != nullptr, "cuBLAS: symbol {} not found in libcublas: {}", name, dlerror());
}

const CublasLibrary& cublas() {
  static const CublasLibrary library = [] {
    // The toolkit this build was compiled against first, then the loader's search path (a
    // machine with the NVIDIA wheels puts their lib directories on LD_LIBRARY_PATH).
    std::string tried;
    void* handle = nullptr;
    for (const std::string& name :
         {std::string(SHARDLAB_CUDA_LIB_DIR) + "/libcublas.so", std::string("libcublas.so"),
          std::string("libcublas.so.13"), std::string("libcublas.so.12")}) {
      handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      tried += fmt::format("\n  {}: {}", name, dlerror());
    }
    SHARDLAB_CHECK(handle != nullptr, "cuBLAS: cannot load libcublas (matmul on CUDA needs it); tried:{}",
                   tried);
    CublasLibrary functions;
    resolve(handle, "cublasCreate_v2", functions.create);
    resolve(handle, "cublasDestroy_v2", functions.destroy);
    resolve(handle, "cublasSetStream_v2", functions.set_stream);
    resolve(handle, "cublasGemmStridedBatchedEx", functions.gemm);
    resolve(handle, "cublasGetStatusString", functions.status_string);
    return functions;  // the library stays loaded for the process
  }();
  return library;
}

void check_cublas(cublasStatus_t status, const char* expr, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail("cuBLAS error at {}:{}: {} failed: {}", file, line, expr, cublas().status_string(status));
  }
}
#define SHARDLAB_CUBLAS_CHECK(expr) check_cublas((expr), #expr, __FILE__, __LINE__)

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

}  // namespace

void gemm_batched(DType dtype, std::int64_t batches, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                  const GemmOperand& a, const GemmOperand& b, void* out, std::int64_t out_leading,
                  std::int64_t out_batch_stride, int device, cudaStream_t stream) {
  const cudaDataType_t type = data_type(dtype);
  const cublasHandle_t handle = handle_for(device);
  SHARDLAB_CUBLAS_CHECK(cublas().set_stream(handle, stream));
  const bool f64 = dtype == DType::f64;
  const double alpha64 = 1.0, beta64 = 0.0;
  const float alpha32 = 1.0f, beta32 = 0.0f;
  SHARDLAB_CUBLAS_CHECK(cublas().gemm(
      handle, a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N,
      as_int(rows, "rows"), as_int(cols, "columns"), as_int(inner, "inner size"),
      f64 ? static_cast<const void*>(&alpha64) : &alpha32, a.data, type,
      as_int(a.leading, "leading dimension"), a.batch_stride, b.data, type,
      as_int(b.leading, "leading dimension"), b.batch_stride,
      f64 ? static_cast<const void*>(&beta64) : &beta32, out, type, as_int(out_leading, "leading dimension"),
      out_batch_stride, as_int(batches, "batch count"), compute_type(dtype), CUBLAS_GEMM_DEFAULT));
}

}  // namespace shardlab::cuda
