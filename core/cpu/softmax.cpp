// core/cpu/softmax.cpp: numerically stable softmax / log_softmax along one dim.
#include <cmath>
#include <numeric>
#include <type_traits>

#include "core/cpu/kernels.h"
#include "core/cpu/loops.h"

namespace shardlab::cpu {
namespace {

void softmax(const Tensor& in, std::int64_t dim, bool log, const Tensor& out) {
  // Move `dim` last in both operands; each row along it is then one inner row.
  std::vector<std::int64_t> order(static_cast<std::size_t>(in.dim()));
  std::iota(order.begin(), order.end(), 0);
  order.erase(order.begin() + dim);
  order.push_back(dim);
  const Tensor x = in.permute(order), y = out.permute(order);
  visit_dtype(in.dtype(), [&]<typename T>() {
    using C = compute_t<T>;
    if constexpr (!std::is_floating_point_v<C>) {
      fail("softmax: no CPU kernel for {}", dtype_name(in.dtype()));
    } else {
      for_each_row<2>(
          y.shape(), {&y, &x},
          [&](Pointers<2> p, ByteStrides<2> s, std::int64_t n) {
            C largest = -INFINITY;
            for (std::int64_t i = 0; i < n; ++i) largest = std::max(largest, widen(at<T>(p[1], s[1], i)));
            // An all -inf row would give -inf - -inf = NaN; shifting by 0 keeps it -inf/NaN-free.
            const C shift = std::isfinite(largest) ? largest : C(0);
            double total = 0;
            for (std::int64_t i = 0; i < n; ++i) total += std::exp(widen(at<T>(p[1], s[1], i)) - shift);
            const C log_total = static_cast<C>(std::log(total));
            for (std::int64_t i = 0; i < n; ++i) {
              const C shifted = widen(at<T>(p[1], s[1], i)) - shift;
              at<T>(p[0], s[0], i) = narrow<T>(log ? shifted - log_total : std::exp(shifted - log_total));
            }
          },
          /*keep_last=*/true);
    }
  });
}

}  // namespace

SoftmaxKernels softmax_kernels() { return {.softmax = softmax}; }

}  // namespace shardlab::cpu
