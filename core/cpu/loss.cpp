// core/cpu/loss.cpp: cross-entropy from logits, row by row: forward takes each row's logsumexp
// (its largest logit shifted out, the exponentials summed in double as softmax does) and the
// target's logit; backward writes softmax minus the one-hot target from the saved logsumexp. No
// softmax [N, C] is ever in memory.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

template <typename T>
void forward(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index, const Tensor& losses,
             const Tensor& logsumexp) {
  using C = compute_t<T>;
  const std::int64_t rows = logits.size(0), classes = logits.size(1);
  const T* x = logits.data<T>();
  const std::int64_t* target = targets.data<std::int64_t>();
  C* loss = losses.data<C>();
  C* lse = logsumexp.data<C>();
  parallel_for(0, rows, 16, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t r = first; r < last; ++r) {
      const T* row = x + r * classes;
      C largest = -INFINITY;
      for (std::int64_t c = 0; c < classes; ++c) largest = std::max(largest, widen(row[c]));
      // An all -inf row is shifted by 0, as softmax does (no -inf - -inf = NaN).
      const C shift = std::isfinite(largest) ? largest : C(0);
      double total = 0;
      for (std::int64_t c = 0; c < classes; ++c) total += std::exp(widen(row[c]) - shift);
      lse[r] = shift + static_cast<C>(std::log(total));
      loss[r] = target[r] == ignore_index ? C(0) : lse[r] - widen(row[target[r]]);
    }
  });
}

template <typename T>
void backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
              std::int64_t ignore_index, const Tensor& logsumexp, const Tensor& grad_logits) {
  using C = compute_t<T>;
  const std::int64_t rows = logits.size(0), classes = logits.size(1);
  const T* x = logits.data<T>();
  const C* grad_loss = grad_losses.data<C>();
  const std::int64_t* target = targets.data<std::int64_t>();
  const C* lse = logsumexp.data<C>();
  T* grad = grad_logits.data<T>();
  parallel_for(0, rows, 16, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t r = first; r < last; ++r) {
      const bool ignored = target[r] == ignore_index;
      const C scale = ignored ? C(0) : grad_loss[r];
      for (std::int64_t c = 0; c < classes; ++c) {
        const C probability = std::exp(widen(x[r * classes + c]) - lse[r]);
        const C term = ignored ? C(0) : scale * (probability - (c == target[r] ? C(1) : C(0)));
        grad[r * classes + c] = narrow<T>(term);
      }
    }
  });
}

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                           const Tensor& losses, const Tensor& logsumexp) {
  visit_dtype(logits.dtype(), [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>)
      forward<T>(logits, targets, ignore_index, losses, logsumexp);
  });
}

void cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                            std::int64_t ignore_index, const Tensor& logsumexp, const Tensor& grad_logits) {
  visit_dtype(logits.dtype(), [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      backward<T>(grad_losses, logits, targets, ignore_index, logsumexp, grad_logits);
    }
  });
}

}  // namespace

LossKernels loss_kernels() {
  return {.cross_entropy_forward = cross_entropy_forward, .cross_entropy_backward = cross_entropy_backward};
}

}  // namespace shardlab::cpu
