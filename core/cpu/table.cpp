// core/cpu/table.cpp: the CPU kernel table, complete: every entry has a CPU reference, each family's
// entries from its own file.
#include "core/cpu/kernels.h"

namespace shardlab {

const Kernels& cpu_kernels() {
  static const Kernels table{cpu::elementwise_kernels(), cpu::reduction_kernels(), cpu::matmul_kernels(),
                             cpu::softmax_kernels(),     cpu::loss_kernels(),      cpu::transformer_kernels(),
                             cpu::conv_kernels(),        cpu::pool_kernels(),      cpu::attention_kernels(),
                             cpu::index_kernels(),       cpu::random_kernels(),    cpu::optimizer_kernels()};
  return table;
}

}  // namespace shardlab
