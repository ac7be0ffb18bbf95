// core/op_cost.h: what the kernel calls of some work cost: the floating-point operations each makes
// and the bytes it reads and writes, from its operands' dtypes and shapes as the kernel call log
// records them: the inputs of a roofline, which times a dense kernel (GEMM, convolution, attention)
// by its operations at the device's dense rate and every other one by its bytes at its memory rate.
//
//   const std::vector<KernelCost> costs = kernel_costs([&] { loss.backward(); });
//   for (const KernelCost& cost : costs) ... cost.flops, cost.bytes
//
// The counts are the work's minimum, not a kernel's traffic: each operand's elements once (an
// expanded operand's distinct ones; an index op's rows it picks, not the whole table), a multiply-add
// two operations, attention's score pairs those its mask lets through (causal: the lower triangle;
// with documents on a kernel that skips the tiles between them, those of the tiles it visits).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"

namespace shardlab {

namespace call_log {
struct Call;
}

struct KernelCost {
  std::string op;     // the profiler's name: "linear", "conv2d_backward_weight", "adam_step", ...
  std::string label;  // the innermost cost label open on the calling thread, "" where none
  Device device;
  DType dtype = DType::f32;  // of the first operand: the dense rate depends on it
  bool dense = false;        // GEMM and attention: timed by flops; the rest by bytes
  double flops = 0;
  double bytes = 0;
  double pairs = 0;  // attention: the query-key pairs scored (each a softmax term besides its flops)
};

// One logged call's cost; an op without a rule here is an Error naming it.
KernelCost kernel_cost(const call_log::Call& call);

// Runs `work` with the kernel call log on and returns the cost of every outermost kernel call it made,
// in order (the log is left off, also when `work` throws).
std::vector<KernelCost> kernel_costs(const std::function<void()>& work);

// Names what the kernel calls that follow belong to, until closed (FSDP: a unit's forward, its backward):
// each call's cost carries the innermost label its thread has open. Per thread.
void open_cost_label(std::string label);
// Closes the innermost open label called `label` (labels may close out of order: a unit's backward can
// end after one opened inside it ended, or before); an Error naming it where none of that name is open.
void close_cost_label(std::string_view label);
// Closes every label this thread has open (what a forward or backward that threw left open).
void close_cost_labels();
// Whether a label called `label` is open on this thread.
bool cost_label_open(std::string_view label);
// The thread's innermost open label, "" where none.
std::string innermost_cost_label();

// Of the query-key pairs of attention over T queries and S keys, those scored: T S, or with a causal
// mask (query t sees keys 0..t, top-left aligned) the sum over t of min(t + 1, S).
double attention_pairs(std::int64_t queries, std::int64_t keys, bool causal);

}  // namespace shardlab
