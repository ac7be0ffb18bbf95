// core/optimizer.cpp: the fused optimizer steps: every segment checked, then one run per device.
#include "core/optimizer.h"

#include <string>

#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

namespace {
// A fused optimizer step's parameter is floating; its gradient and state tensors match it.
void check_optimizer_operands(const char* op, const Tensor& param,
                              std::initializer_list<const Tensor*> others) {
  check_defined(op, param, "param");
  check_floating(op, param);
  for (const Tensor* t : others) {
    check_defined(op, *t, "state");
    check_same_device(op, param, *t);
    SHARDLAB_CHECK(t->shape() == param.shape() && t->dtype() == param.dtype(),
                   "{}: every operand must match the parameter [{} {}], got [{} {}]", op,
                   shape_str(param.shape()), dtype_name(param.dtype()), shape_str(t->shape()),
                   dtype_name(t->dtype()));
  }
}

// What an error about segment `index` starts with: the op alone for a single segment (the
// single-parameter call), "<op>: segment <index>" among several.
std::string segment_context(const char* op, std::size_t index, std::size_t count) {
  return count == 1 ? std::string(op) : fmt::format("{}: segment {}", op, index);
}

// The gate of a multi-segment step: undefined, or one bool on the device of every segment.
template <typename Segment>
void check_apply(const char* op, std::span<const Segment> segments, const Tensor& apply) {
  if (!apply.defined()) return;
  SHARDLAB_CHECK(apply.dtype() == DType::boolean && apply.numel() == 1,
                 "{}: apply must be one bool, got [{} {}]", op, shape_str(apply.shape()),
                 dtype_name(apply.dtype()));
  for (std::size_t i = 0; i < segments.size(); ++i) {
    SHARDLAB_CHECK(segments[i].param.device() == apply.device(),
                   "{}: apply is on {} but segment {} is on {}: the gate must be on the device it gates", op,
                   apply.device().str(), i, segments[i].param.device().str());
  }
}

// Calls the kernel of each device the segments are on once, with that device's non-empty
// segments in their given order.
template <auto Entry, typename Segment>
void run_per_device(const char* op, std::span<const Segment> segments, const Tensor& apply) {
  std::vector<Segment> pending;
  for (const Segment& segment : segments) {
    if (segment.param.numel() > 0) pending.push_back(segment);
  }
  while (!pending.empty()) {
    const Device device = pending.front().param.device();
    std::vector<Segment> here, elsewhere;
    for (Segment& segment : pending) (segment.param.device() == device ? here : elsewhere).push_back(segment);
    kernel<Entry>(device, op)(here, apply);
    pending = std::move(elsewhere);
  }
}
}  // namespace

void adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply) {
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const AdadeltaSegment& s = segments[i];
    check_optimizer_operands(segment_context("adadelta_step", i, segments.size()).c_str(), s.param,
                             {&s.grad, &s.square_avg, &s.acc_delta});
  }
  check_apply("adadelta_step", segments, apply);
  run_per_device<&Kernels::adadelta_step>("adadelta_step", segments, apply);
}

void adadelta_step(const Tensor& param, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                   const AdadeltaHyper& hyper) {
  const AdadeltaSegment segment{param, grad, square_avg, acc_delta, hyper};
  adadelta_step(std::span(&segment, 1));
}

void adam_step(std::span<const AdamSegment> segments, const Tensor& apply) {
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const AdamSegment& s = segments[i];
    const std::string context = segment_context("adam_step", i, segments.size());
    const char* op = context.c_str();
    check_optimizer_operands(op, s.param, {&s.grad, &s.exp_avg, &s.exp_avg_sq});
    SHARDLAB_CHECK(s.hyper.step >= 1, "{}: step must be >= 1, got {}", op, s.hyper.step);
    if (s.copy_out.defined()) {
      check_same_device(op, s.param, s.copy_out);
      check_floating(op, s.copy_out);
      SHARDLAB_CHECK(s.copy_out.shape() == s.param.shape(),
                     "{}: copy_out {} must have the parameter's shape {}", op, shape_str(s.copy_out.shape()),
                     shape_str(s.param.shape()));
    }
  }
  check_apply("adam_step", segments, apply);
  run_per_device<&Kernels::adam_step>("adam_step", segments, apply);
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const AdamHyper& hyper, const Tensor& copy_out) {
  const AdamSegment segment{param, grad, exp_avg, exp_avg_sq, hyper, copy_out};
  adam_step(std::span(&segment, 1));
}

std::span<const OpInfo> optimizer_ops() {
  static constexpr OpInfo ops[] = {{"adam_step", OpCategory::optimizer},
                                   {"adadelta_step", OpCategory::optimizer}};
  return ops;
}

}  // namespace shardlab
