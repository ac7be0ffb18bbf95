// core/op_info.cpp: every family's ops in one lookup by name (core/op_info.h).
#include "core/op_info.h"

#include <string>
#include <unordered_map>

#include "core/error.h"
#include "core/ops.h"
#include "core/random.h"

namespace shardlab {

const char* category_name(OpCategory category) {
  switch (category) {
    case OpCategory::gemm:
      return "GEMM";
    case OpCategory::attention:
      return "attention";
    case OpCategory::reductions:
      return "reductions";
    case OpCategory::indexing:
      return "indexing";
    case OpCategory::optimizer:
      return "optimizer";
    case OpCategory::elementwise:
      return "elementwise";
  }
  __builtin_unreachable();
}

const OpInfo* find_op_info(std::string_view name) {
  static const std::unordered_map<std::string_view, const OpInfo*> by_name = [] {
    std::unordered_map<std::string_view, const OpInfo*> table;
    for (const std::span<const OpInfo> family :
         {elementwise_ops(), reduction_ops(), matmul_ops(), softmax_ops(), loss_ops(), transformer_ops(),
          conv_ops(), attention_ops(), index_ops(), random_ops(), optimizer_ops()}) {
      for (const OpInfo& op : family) {
        const bool added = table.emplace(op.name, &op).second;
        SHARDLAB_CHECK(added, "op_info: two families list an op named '{}'", op.name);
      }
    }
    return table;
  }();
  const auto found = by_name.find(name);
  return found == by_name.end() ? nullptr : found->second;
}

}  // namespace shardlab
