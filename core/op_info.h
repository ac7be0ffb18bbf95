// core/op_info.h: what the profiler, the cost model and the CUDA kernel choice know of an op from the
// name its kernel calls are logged under: its category and, where its CUDA kernel does not depend on
// the operands, that kernel. Each op family lists its own ops beside them (core/<family>.cpp).
#pragma once

#include <span>
#include <string_view>

namespace shardlab {

// How an op's calls are grouped in a profile, and which rule of the cost model times them
// (core/op_cost.h): GEMMs and attention by their FLOPs, indexing by the rows it moves, the optimizer
// by its update, the rest by their bytes.
enum class OpCategory : unsigned char { gemm, attention, reductions, indexing, optimizer, elementwise };
// "GEMM", "attention", "reductions", "indexing", "optimizer", "elementwise".
const char* category_name(OpCategory category);

struct OpInfo {
  std::string_view name;
  OpCategory category;
  // The CUDA kernel every call of the op takes (core/kernel_choice.h), or empty where a rule of its
  // category chooses it from the operands.
  std::string_view cuda_kernel = {};
  // Whether its CUDA kernel reads [B, H, T, D] operands where they lie (cuda_takes_heads_in_place);
  // any other strided operand is copied first.
  bool heads_in_place = false;
};

// The op logged as `name`, or null where no family lists it.
const OpInfo* find_op_info(std::string_view name);

}  // namespace shardlab
