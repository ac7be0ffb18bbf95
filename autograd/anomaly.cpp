// autograd/anomaly.cpp: the anomaly detection switch and the NaN/infinity checks of forward
// results and backward gradients, with messages that say where the value first appeared.
#include "autograd/anomaly.h"

#include <atomic>
#include <optional>

#include "autograd/node.h"
#include "core/error.h"
#include "core/ops.h"

namespace shardlab::autograd {
namespace {

std::atomic<bool> detecting{false};

struct Found {
  std::int64_t count = 0;  // elements marked
  std::int64_t first = 0;  // flat index of the first
  double value = 0;        // x there
};

// The elements of `x` that the bool tensor `marked` (x's shape) marks, if any.
std::optional<Found> find_marked(const Tensor& x, const Tensor& marked) {
  const Tensor flags = cast(marked, DType::f32).reshape({x.numel()});
  const auto count = static_cast<std::int64_t>(sum(flags).to(Device::cpu()).item<float>());
  if (count == 0) return std::nullopt;
  const std::int64_t first = argmax(flags).to(Device::cpu()).item<std::int64_t>();  // the first maximum
  const double value =
      cast(x.reshape({x.numel()}).narrow(0, first, 1), DType::f64).to(Device::cpu()).item<double>();
  return Found{count, first, value};
}

// Where a gradient for input `input` of `node` goes: a leaf (named), another node, or nowhere.
std::string destination(const Node& node, std::size_t input) {
  if (input >= node.next_edges().size() || node.next_edges()[input].node == nullptr) return "no node";
  const Node& next = *node.next_edges()[input].node;
  if (const auto* leaf = dynamic_cast<const AccumulateGrad*>(&next))
    return leaf->leaf_name().empty() ? "an unnamed leaf" : "leaf '" + leaf->leaf_name() + "'";
  return "'" + next.name() + "'";
}

}  // namespace

bool anomaly_detection_on() { return detecting.load(std::memory_order_relaxed); }

DetectAnomaly::DetectAnomaly(bool on) : previous_(detecting.exchange(on)) {}
DetectAnomaly::~DetectAnomaly() { detecting.store(previous_); }

void check_forward(const char* op, const Tensor& output) {
  if (!output.defined() || !is_floating(output.dtype()) || output.numel() == 0) return;
  if (const auto found = find_marked(output, ne(output, output))) {  // NaN alone differs from itself
    fail(
        "detect_anomaly: the forward of '{}' produced {} NaN of {} elements in its output {} {} (the first "
        "at "
        "flat index {})",
        op, found->count, output.numel(), shape_str(output.shape()), dtype_name(output.dtype()),
        found->first);
  }
}

void check_gradient(const Node& node, std::size_t input, const Tensor& grad) {
  if (!grad.defined() || !is_floating(grad.dtype()) || grad.numel() == 0) return;
  if (const auto found = find_marked(grad, eq(cast(isfinite(grad), DType::f32), 0))) {
    fail(
        "detect_anomaly: '{}' returned {} non-finite values of {} in the gradient of its input {} {} {} (the "
        "first at flat index {}: {}), which flows to {}",
        node.name(), found->count, grad.numel(), input, shape_str(grad.shape()), dtype_name(grad.dtype()),
        found->first, found->value, destination(node, input));
  }
}

}  // namespace shardlab::autograd
