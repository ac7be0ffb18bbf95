// core/kernels.h: the dispatch table: one Kernels table per device type, made of each op family's
// entries (declared with the family's ops: core/elementwise.h, core/reduce.h, ...), each entry a
// function that computes into outputs the family's op has already validated and allocated. A device
// without a kernel for an entry leaves it null; supports() says so.
#pragma once

#include <cstddef>

#include "core/ops.h"
#include "core/random.h"

namespace shardlab {

// Every entry: inputs and outputs are on the table's device, outputs freshly allocated and contiguous
// unless the family says otherwise.
struct Kernels : ElementwiseKernels,
                 ReductionKernels,
                 MatmulKernels,
                 SoftmaxKernels,
                 LossKernels,
                 TransformerKernels,
                 ConvKernels,
                 PoolKernels,
                 AttentionKernels,
                 IndexKernels,
                 RandomKernels,
                 OptimizerKernels {};

const Kernels& kernels_for(Device device);
const Kernels& cpu_kernels();
const Kernels& cuda_kernels();  // entries are null for ops without a CUDA kernel yet

// How many entries `table` has, and how many of them are set. A table made whole (the CPU's; the CUDA
// one in a CUDA build) has them all, in a program linked against the static archives too: each family's
// entries come from a function the table calls, so the linker cannot drop them.
struct EntryCount {
  std::size_t set = 0, entries = 0;
};
EntryCount count_entries(const Kernels& table);

// Whether `device` has a kernel for the entry, e.g. supports<&Kernels::softmax>(device).
template <auto Entry>
bool supports(Device device) {
  return kernels_for(device).*Entry != nullptr;
}

}  // namespace shardlab
