// core/matmul_precision.cpp: the process-wide f32 matmul precision (core/matmul_precision.h).
#include "core/matmul_precision.h"

#include <atomic>

#include "core/error.h"

namespace shardlab {

namespace {
std::atomic<MatmulPrecision> precision{MatmulPrecision::highest};
}  // namespace

void set_float32_matmul_precision(std::string_view name) {
  if (name == "highest") {
    precision.store(MatmulPrecision::highest);
  } else if (name == "high") {
    precision.store(MatmulPrecision::high);
  } else {
    fail("set_float32_matmul_precision: '{}' is not one of highest (f32), high (TF32 on a GPU)", name);
  }
}

MatmulPrecision float32_matmul_precision() { return precision.load(); }

std::string_view matmul_precision_name(MatmulPrecision value) {
  return value == MatmulPrecision::high ? "high" : "highest";
}

}  // namespace shardlab
