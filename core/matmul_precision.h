// core/matmul_precision.h: how f32 matrix products and convolutions may round on a GPU, as PyTorch's
// torch.set_float32_matmul_precision: "highest" (f32 multiply-adds: the default, and what the CPU
// computes) or "high" (TF32 tensor cores: each input rounded to 10 bits of mantissa, the products
// summed in f32, several times faster on an A100 or an H100). f64, bf16 and f16 products are not
// affected, and neither is the CPU, which computes f32 in f32 either way.
//
//   set_float32_matmul_precision("high");  // a GPU's f32 GEMMs and convolutions on TF32 from here on
#pragma once

#include <string_view>

namespace shardlab {

enum class MatmulPrecision : unsigned char { highest, high };

// "highest" or "high"; throws Error naming any other. Process-wide, for every thread.
void set_float32_matmul_precision(std::string_view name);
MatmulPrecision float32_matmul_precision();
std::string_view matmul_precision_name(MatmulPrecision precision);

}  // namespace shardlab
