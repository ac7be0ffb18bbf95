// core/exact_sum.h: the exact sum of doubles, rounded once at the end: the same bits in any order and any
// grouping of the terms, for the few numbers a training step sums over its samples and ranks (the loss,
// what it averages over, the squared gradient norm), so that any world size reports the same ones.
//
//   ExactSum loss;
//   loss.add(per_sample_losses);                 // f32/bf16/f16/f64 elements on the CPU
//   Tensor limbs = loss.limbs();                 // all-reduced with sum over the ranks (i64: exact)
//   double total = ExactSum::from_limbs(limbs).value();
//
// The method (a long accumulator, as Kulisch's): a finite double is a whole multiple of 2^-1074, its
// smallest step, below 2^2098 of them; its up to 53 bits are cut into 32-bit digits at fixed positions
// and added as integers into i64 limbs, digit by digit. Integer sums do not depend on the order, so the
// limbs do not, and neither does their value rounded once to the nearest double. Non-finite terms are
// counted apart (NaN, +inf, -inf) and decide the value as IEEE addition would: NaN, or an infinity.
#pragma once

#include <array>
#include <cstdint>

#include "core/tensor.h"

namespace shardlab {

// Limbs of 32 bits from 2^-1074: 2098 bits of terms and 31 more of carries, then the three counts of
// non-finite terms.
inline constexpr int kExactDigitLimbs = 68;
inline constexpr int kExactLimbs = kExactDigitLimbs + 3;

class ExactSum {
 public:
  void add(double term);
  // Every element of `terms` (f32, bf16, f16 or f64, contiguous, on the CPU); with `squares`, each one's
  // square instead (exact: a product of two f32 holds in a double).
  void add(const Tensor& terms, bool squares = false);
  void add(const ExactSum& other);

  // The sum rounded to the nearest double (ties to even, beyond the largest: infinity).
  double value() const;
  // i64 [kExactLimbs]: what ranks all-reduce with sum (carries settled first, so that 2^30 ranks' sums
  // still fit), and what from_limbs reads back.
  Tensor limbs() const;
  static ExactSum from_limbs(const Tensor& limbs);

 private:
  // Carries moved up so that every digit limb but the highest lies in [0, 2^32).
  void settle();
  // Adds value * 2^(shift - 1074), value below 2^97, and settles.
  void add_shifted(unsigned __int128 value, int shift);

  std::array<std::int64_t, kExactLimbs> limbs_{};
  std::int64_t unsettled_ = 0;  // terms added since the last settle()
};

}  // namespace shardlab
