// core/call_log.h: internal to core (and its tests): the kernel call log: while it is on, each outermost kernel call of a thread
// records its op name (the profiler's), device and tensor operands (dtype, shape, strides, where the
// data starts), so a test can ask core/kernel_choice.h which kernel every call of a real training
// step takes on a GPU, without one. Off, a kernel call costs one relaxed load.
//
//   call_log::start();  run a step;  for (const call_log::Call& call : call_log::stop()) ...
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/kernel_choice.h"
#include "core/ops.h"
#include "core/tensor.h"

namespace shardlab::call_log {

struct Call {
  std::string op;
  Device device;
  std::vector<OperandLayout> operands;  // the tensor arguments, in the kernel entry's order
  bool causal = false;                  // attention: each query sees only the keys up to it
  double scored_pairs = 0;              // attention with documents: attention_scored_pairs; 0: by the shapes
  std::string label;                    // the thread's innermost open cost label (core/op_cost.h)
};

namespace detail {
inline std::atomic<bool> enabled{false};
void record(Call call);
bool enter();  // whether this is the thread's outermost logged call
void leave();

inline void add(std::vector<OperandLayout>& out, const Tensor& t) {
  if (t.defined()) out.push_back(layout_of(t));
}
inline void add(std::vector<OperandLayout>& out, std::span<const Tensor> tensors) {
  for (const Tensor& t : tensors) add(out, t);
}
inline void add(std::vector<OperandLayout>& out, const std::vector<Tensor>& tensors) {
  add(out, std::span<const Tensor>(tensors));
}
// Optimizer segments: each one's parameter and gradient.
template <typename Segment>
  requires requires(const Segment& s) { s.param; s.grad; }
void add(std::vector<OperandLayout>& out, std::span<const Segment> segments) {
  for (const Segment& s : segments) {
    add(out, s.param);
    add(out, s.grad);
  }
}
template <typename Segment>
  requires requires(const Segment& s) { s.param; s.grad; }
void add(std::vector<OperandLayout>& out, const std::vector<Segment>& segments) {
  add(out, std::span<const Segment>(segments));
}
// Anything else (scalars, op codes, dims, parameters) is not an operand.
template <typename T>
void add(std::vector<OperandLayout>&, const T&) {}

// What of the other arguments changes the work: attention's mask.
template <typename T>
void note(Call& call, const T& argument) {
  if constexpr (std::is_same_v<T, AttentionParams>) {
    call.causal = argument.causal;
    call.scored_pairs = attention_scored_pairs(call.device, argument);
  }
}
}  // namespace detail

inline bool on() { return detail::enabled.load(std::memory_order_relaxed); }
void start();  // clears the log
std::vector<Call> stop();
// The calls `work` makes, the log on around it (and off again when it throws).
std::vector<Call> calls_of(const std::function<void()>& work);

// Logs the kernel call in its scope (op: a literal) unless it runs inside another logged call.
class Scope {
 public:
  template <typename... Args>
  explicit Scope(const char* op, Device device, const Args&... args) {
    if (!on()) return;
    entered_ = true;
    if (!detail::enter()) return;
    Call call{.op = op, .device = device};
    (detail::add(call.operands, args), ...);
    (detail::note(call, args), ...);
    detail::record(std::move(call));
  }
  ~Scope() {
    if (entered_) detail::leave();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool entered_ = false;
};

}  // namespace shardlab::call_log
