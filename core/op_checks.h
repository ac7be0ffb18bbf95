// core/op_checks.h: internal to core: what the op families' files share: the call into a device's
// kernel (timed and logged), argument checks with errors that name the op, broadcasting, and the layout
// the attention and rotary kernels read heads in.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "core/call_log.h"
#include "core/kernels.h"
#include "core/profile.h"

namespace shardlab::detail {

template <auto Entry>
constexpr bool is_index_check() {
  if constexpr (std::is_same_v<decltype(Entry), decltype(&Kernels::check_index)>) {
    return Entry == &Kernels::check_index;
  } else {
    return false;
  }
}

// The device's kernel for `Entry`, or an Error naming the op and device; the call is timed
// under `op` while the profiler is on.
template <auto Entry>
auto kernel(Device device, const char* op) {
  auto fn = kernels_for(device).*Entry;
  SHARDLAB_CHECK(fn != nullptr, "{}: not supported on {} (no kernel for it in this build)", op, device.str());
  return [fn, op, device](auto&&... args) {
    // The call log names an index check for what it is; the profiler counts it to the op it serves.
    const call_log::Scope logged(is_index_check<Entry>() ? "check_index" : op, device, args...);
    const profile::KernelTimer timer(op, device);
    return fn(std::forward<decltype(args)>(args)...);
  };
}

void check_defined(const char* op, const Tensor& t, const char* what = "input");
void check_same_device(const char* op, const Tensor& a, const Tensor& b);
void check_floating(const char* op, const Tensor& t);
void check_index_dtype(const char* op, const Tensor& index);
Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b);

// A Scalar operand as a 0-d tensor next to `like`: it keeps like's dtype unless it is
// floating and like is not (then f32), or it is a number and like is bool (then i64).
Tensor wrap_scalar(const Tensor& like, Scalar value);

// Validated dims of a reduction: wrapped, sorted, distinct; empty means all.
Dims reduction_dims(const char* op, const Tensor& x, const Dims& dims);

// Index tensors as contiguous i64, with every value checked against [0, size) by the device
// (Kernels::check_index: on CUDA without the host waiting). op and what are string literals.
Tensor checked_index(const char* op, const Tensor& index, std::int64_t size, const char* what);

// Class targets as contiguous i64, each checked against [0, classes) unless it is ignore_index
// (which becomes 0).
Tensor checked_targets(const char* op, const Tensor& targets, std::int64_t ignore_index,
                       std::int64_t classes);

// The dtype of a row statistic saved for backward: f32 for halves.
DType logsumexp_dtype(DType logits);

// Whether the device's attention and rotary kernels read `t` where it lies (Kernels::strided_heads):
// a transposed view of [B, T, H, D] then needs no copy.
bool takes_heads_in_place(const Tensor& t);
// `t` as those kernels read it: where it lies, or a contiguous copy.
Tensor head_rows(const Tensor& t);
// An output of `shape` for those kernels: in the layout of the operand `like` where they take strided
// heads (an output of q in [B, T, H, D] memory transposes back for free), else contiguous.
Tensor empty_for_heads(const Tensor& like, const Shape& shape);

}  // namespace shardlab::detail
