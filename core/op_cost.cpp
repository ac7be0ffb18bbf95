// core/op_cost.cpp: the operations and bytes of each logged kernel call (core/op_cost.h).
#include "core/op_cost.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iterator>
#include <string_view>

#include "core/call_log.h"
#include "core/error.h"
#include "core/profile.h"

namespace shardlab {
namespace {

double elements(const OperandLayout& operand) {
  double count = 1;
  for (const std::int64_t size : operand.shape) count *= static_cast<double>(size);
  return count;
}

// The distinct elements an operand holds: an expanded dim (stride 0) counts once.
double distinct_elements(const OperandLayout& operand) {
  double count = 1;
  for (std::size_t d = 0; d < operand.shape.size(); ++d) {
    if (operand.strides.empty() || operand.strides[d] != 0) count *= static_cast<double>(operand.shape[d]);
  }
  return count;
}

double bytes_of(const OperandLayout& operand, double count) {
  return count * static_cast<double>(dtype_size(operand.dtype));
}
double bytes_of(const OperandLayout& operand) { return bytes_of(operand, distinct_elements(operand)); }

double all_bytes(const std::vector<OperandLayout>& operands) {
  double total = 0;
  for (const OperandLayout& operand : operands) total += bytes_of(operand);
  return total;
}

std::int64_t dim(const OperandLayout& operand, int from_end) {
  return operand.shape[operand.shape.size() - static_cast<std::size_t>(from_end)];
}

void need(const call_log::Call& call, std::size_t count, std::size_t rank_of_first = 0) {
  SHARDLAB_CHECK(call.operands.size() >= count &&
                     (rank_of_first == 0 || call.operands.front().shape.size() == rank_of_first),
                 "kernel_cost: {} needs {} operands{}, got {}", call.op, count,
                 rank_of_first == 0 ? "" : fmt::format(" (the first of rank {})", rank_of_first),
                 call.operands.size());
}

// a [B, M, K], b [B, K, N], bias [N] or none, out [B, M, N].
KernelCost matmul_cost(const call_log::Call& call, KernelCost cost) {
  need(call, 3, 3);
  const OperandLayout &a = call.operands.front(), &out = call.operands.back();
  const double products = elements(out) * static_cast<double>(dim(a, 1));
  cost.flops = 2 * products + (call.operands.size() > 3 ? elements(out) : 0);
  return cost;
}

// Per output element of a convolution (the forward's out, or the grad_out of both gradients), one
// multiply-add for each of the weight's [C / groups, KH, KW] elements.
KernelCost conv_cost(const call_log::Call& call, KernelCost cost) {
  need(call, 3, 4);
  const bool forward = call.op == "conv2d";
  const OperandLayout& outputs = forward ? call.operands.back() : call.operands.front();
  const OperandLayout& weight = call.op == "conv2d_backward_weight" ? call.operands.back() : call.operands[1];
  const double per_output = static_cast<double>(dim(weight, 3)) * static_cast<double>(dim(weight, 2)) *
                            static_cast<double>(dim(weight, 1));
  const bool bias = forward && call.operands.size() > 3;
  cost.flops = 2 * elements(outputs) * per_output + (bias ? elements(outputs) : 0);
  return cost;
}

// q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (after grad_out for the backward). The forward
// scores each pair (D multiply-adds) and sums values (Dv); the backward scores again, then makes dV
// (Dv), dP (Dv), dQ (D) and dK (D). Also counted: the output (and for the backward the gradients of
// q, k and v and the forward's output) and the logsumexp (f32 per query) that are not in the log.
KernelCost attention_cost(const call_log::Call& call, KernelCost cost) {
  const bool backward = call.op == "attention_backward";
  need(call, backward ? 4 : 3, 4);
  const std::size_t first = backward ? 1 : 0;
  const OperandLayout &q = call.operands[first], &k = call.operands[first + 1], &v = call.operands[first + 2];
  const double heads = static_cast<double>(q.shape[0]) * static_cast<double>(q.shape[1]);
  // Where documents decide which tiles the kernel visits, the pairs it scores there, per head.
  const double pairs = call.scored_pairs > 0 ? static_cast<double>(q.shape[1]) * call.scored_pairs
                                             : heads * attention_pairs(dim(q, 2), dim(k, 2), call.causal);
  const auto d = static_cast<double>(dim(q, 1)), dv = static_cast<double>(dim(v, 1));
  cost.flops = 2 * pairs * (backward ? 3 * d + 2 * dv : d + dv);
  cost.pairs = pairs;
  const double out = bytes_of(q, heads * static_cast<double>(dim(q, 2)) * dv);
  const double logsumexp = heads * static_cast<double>(dim(q, 2)) * 4;
  const double inputs = bytes_of(q) + bytes_of(k) + bytes_of(v);
  cost.bytes =
      backward ? bytes_of(call.operands.front()) + 2 * inputs + out + logsumexp : inputs + out + logsumexp;
  return cost;
}

// Index ops move the rows they pick, not the table: index_select / embedding / gather (in, index,
// out) read the index and out's worth of in and write out; index_add / embedding_backward /
// scatter_add (out, index, src) read the index and src and read and write src's worth of out.
KernelCost indexing_cost(const call_log::Call& call, KernelCost cost) {
  if (call.op == "check_index") {
    need(call, 1);
    cost.bytes = bytes_of(call.operands.front());
    return cost;
  }
  need(call, 3);
  const OperandLayout& index = call.operands[1];
  const bool adds = call.op == "index_add" || call.op == "embedding_backward" || call.op == "scatter_add";
  const OperandLayout& moved = adds ? call.operands[2] : call.operands.back();
  cost.bytes = bytes_of(index) + (adds ? 3 : 2) * bytes_of(moved);
  cost.flops = adds ? elements(moved) : 0;
  return cost;
}

// Segments logged as (param, grad) pairs: the step reads the parameter, its gradient and two states
// of the parameter's dtype and writes the parameter and the states back.
KernelCost optimizer_cost(const call_log::Call& call, KernelCost cost) {
  need(call, 2);
  for (std::size_t i = 0; i + 1 < call.operands.size(); i += 2) {
    const OperandLayout &param = call.operands[i], &grad = call.operands[i + 1];
    cost.bytes += 6 * bytes_of(param) + bytes_of(grad);
    cost.flops += 10 * elements(param);
  }
  return cost;
}

}  // namespace

namespace {
thread_local std::vector<std::string> open_labels;
}  // namespace

void open_cost_label(std::string label) { open_labels.push_back(std::move(label)); }

void close_cost_label(std::string_view label) {
  const auto innermost = std::find(open_labels.rbegin(), open_labels.rend(), label);
  SHARDLAB_CHECK(innermost != open_labels.rend(), "close_cost_label: no label '{}' is open on this thread{}",
                 label, open_labels.empty() ? "" : fmt::format(" (open: {})", fmt::join(open_labels, ", ")));
  open_labels.erase(std::next(innermost).base());
}

void close_cost_labels() { open_labels.clear(); }

bool cost_label_open(std::string_view label) {
  return std::find(open_labels.begin(), open_labels.end(), label) != open_labels.end();
}

std::string innermost_cost_label() { return open_labels.empty() ? std::string() : open_labels.back(); }

double attention_pairs(std::int64_t queries, std::int64_t keys, bool causal) {
  const auto t = static_cast<double>(queries), s = static_cast<double>(keys);
  if (!causal) return t * s;
  // Queries 0..S-1 see t + 1 keys, the rest all S.
  const double growing = std::min(t, s);
  return growing * (growing + 1) / 2 + (t - growing) * s;
}

KernelCost kernel_cost(const call_log::Call& call) {
  KernelCost cost{.op = call.op,
                  .label = call.label,
                  .device = call.device,
                  .dtype = call.operands.empty() ? DType::f32 : call.operands.front().dtype};
  const std::string_view category = profile::category_of(call.op);
  if (category == "GEMM") {
    cost.dense = true;
    cost.bytes = all_bytes(call.operands);
    return call.op.starts_with("conv2d") ? conv_cost(call, cost) : matmul_cost(call, cost);
  }
  if (category == "attention") {
    cost.dense = true;
    return attention_cost(call, cost);
  }
  if (category == "indexing") return indexing_cost(call, cost);
  if (category == "optimizer") return optimizer_cost(call, cost);
  SHARDLAB_CHECK(category == "elementwise" || category == "reductions",
                 "kernel_cost: no rule for op '{}' (category '{}')", call.op, category);
  // One operation per element of the largest operand (the input of a reduction, the output of the rest).
  need(call, 1);
  cost.bytes = all_bytes(call.operands);
  for (const OperandLayout& operand : call.operands) cost.flops = std::max(cost.flops, elements(operand));
  return cost;
}

std::vector<KernelCost> kernel_costs(const std::function<void()>& work) {
  std::vector<KernelCost> costs;
  for (const call_log::Call& call : call_log::calls_of(work)) costs.push_back(kernel_cost(call));
  return costs;
}

}  // namespace shardlab
