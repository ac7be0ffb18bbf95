// core/exact_sum.cpp: ExactSum's limbs and their rounding (core/exact_sum.h).
#include "core/exact_sum.h"

#include <bit>
#include <cmath>
#include <limits>

#include "core/ops.h"

namespace shardlab {
namespace {

constexpr int kNaNs = kExactDigitLimbs, kPlusInfinities = kExactDigitLimbs + 1,
              kMinusInfinities = kExactDigitLimbs + 2;
constexpr int kDigitBits = 32;
// Each term adds below 2^32 to a limb; settled limbs are below 2^32: 2^30 terms keep them below 2^63.
constexpr std::int64_t kTermsBetweenSettles = std::int64_t{1} << 30;

using Limbs = std::array<std::int64_t, kExactLimbs>;

bool bit_at(const Limbs& limbs, int position) {
  return ((limbs[position / kDigitBits] >> (position % kDigitBits)) & 1) != 0;
}

// Bits [low, low + count) of settled, non-negative digit limbs, count <= 64.
std::uint64_t bits_at(const Limbs& limbs, int low, int count) {
  std::uint64_t bits = 0;
  for (int i = count - 1; i >= 0; --i) bits = (bits << 1) | (bit_at(limbs, low + i) ? 1 : 0);
  return bits;
}

bool any_bit_below(const Limbs& limbs, int position) {
  for (int limb = 0; limb < position / kDigitBits; ++limb) {
    if (limbs[limb] != 0) return true;
  }
  const int rest = position % kDigitBits;
  return rest > 0 && (limbs[position / kDigitBits] & ((std::int64_t{1} << rest) - 1)) != 0;
}

double term_of(const Tensor& terms, std::int64_t i) {
  switch (terms.dtype()) {
    case DType::f64:
      return terms.data<double>()[i];
    case DType::f32:
      return terms.data<float>()[i];
    case DType::bf16:
      return bf16_to_float(terms.data<bf16>()[i]);
    default:
      return f16_to_float(terms.data<f16>()[i]);
  }
}

}  // namespace

void ExactSum::add(double term) {
  const auto bits = std::bit_cast<std::uint64_t>(term);
  const auto exponent = static_cast<int>((bits >> 52) & 0x7ff);
  const std::uint64_t mantissa = bits & ((std::uint64_t{1} << 52) - 1);
  const bool negative = (bits >> 63) != 0;
  if (exponent == 0x7ff) {
    ++limbs_[mantissa != 0 ? kNaNs : negative ? kMinusInfinities : kPlusInfinities];
    return;
  }
  // term = magnitude * 2^(shift - 1074), the magnitude below 2^53.
  const std::uint64_t magnitude = exponent == 0 ? mantissa : mantissa | (std::uint64_t{1} << 52);
  const int shift = exponent == 0 ? 0 : exponent - 1;
  const unsigned __int128 placed = static_cast<unsigned __int128>(magnitude) << (shift % kDigitBits);
  for (int k = 0; k < 3; ++k) {
    const auto digit = static_cast<std::int64_t>((placed >> (k * kDigitBits)) & 0xffffffffu);
    limbs_[shift / kDigitBits + k] += negative ? -digit : digit;
  }
  if (++unsettled_ == kTermsBetweenSettles) settle();
}

void ExactSum::add(const Tensor& terms, bool squares) {
  const bool floating = terms.defined() && (terms.dtype() == DType::f64 || terms.dtype() == DType::f32 ||
                                            terms.dtype() == DType::bf16 || terms.dtype() == DType::f16);
  SHARDLAB_CHECK(floating, "ExactSum::add: the terms must be f64, f32, bf16 or f16, got {}",
                 terms.defined() ? dtype_name(terms.dtype()) : "an undefined tensor");
  SHARDLAB_CHECK(terms.device().is_cpu() && terms.is_contiguous(),
                 "ExactSum::add: the terms must be contiguous on the CPU, got {}{}", terms.device().str(),
                 terms.is_contiguous() ? "" : " (not contiguous)");
  SHARDLAB_CHECK(!squares || terms.dtype() != DType::f64,
                 "ExactSum::add: the square of an f64 term is not exact in a double; square f32 or halves");
  for (std::int64_t i = 0; i < terms.numel(); ++i) {
    const double term = term_of(terms, i);
    add(squares ? term * term : term);
  }
}

void ExactSum::add(const ExactSum& other) {
  ExactSum settled = other;
  settled.settle();
  settle();
  for (int i = 0; i < kExactLimbs; ++i) limbs_[i] += settled.limbs_[i];
  settle();
}

void ExactSum::settle() {
  for (int i = 0; i + 1 < kExactDigitLimbs; ++i) {
    const std::int64_t carry = limbs_[i] >> kDigitBits;  // floor division: the remainder in [0, 2^32)
    limbs_[i] -= carry * (std::int64_t{1} << kDigitBits);
    limbs_[i + 1] += carry;
  }
  unsettled_ = 0;
}

double ExactSum::value() const {
  if (limbs_[kNaNs] > 0 || (limbs_[kPlusInfinities] > 0 && limbs_[kMinusInfinities] > 0))
    return std::numeric_limits<double>::quiet_NaN();
  if (limbs_[kPlusInfinities] > 0) return std::numeric_limits<double>::infinity();
  if (limbs_[kMinusInfinities] > 0) return -std::numeric_limits<double>::infinity();
  ExactSum magnitude = *this;
  magnitude.settle();
  const bool negative = magnitude.limbs_[kExactDigitLimbs - 1] < 0;
  if (negative) {
    for (int i = 0; i < kExactDigitLimbs; ++i) magnitude.limbs_[i] = -magnitude.limbs_[i];
    magnitude.settle();
  }
  const Limbs& limbs = magnitude.limbs_;
  int highest_limb = kExactDigitLimbs - 1;
  while (highest_limb >= 0 && limbs[highest_limb] == 0) --highest_limb;
  if (highest_limb < 0) return 0.0;
  const int highest =
      highest_limb * kDigitBits + std::bit_width(static_cast<std::uint64_t>(limbs[highest_limb])) - 1;
  // A double's step at that magnitude: 2^(highest - 52) of the units, one unit (2^-1074) below the normals.
  const int dropped = std::max(highest - 52, 0);
  std::uint64_t kept = bits_at(limbs, dropped, highest - dropped + 1);
  if (dropped > 0 && bit_at(limbs, dropped - 1) && ((kept & 1) != 0 || any_bit_below(limbs, dropped - 1)))
    ++kept;
  const double value = std::ldexp(static_cast<double>(kept), dropped - 1074);
  return negative ? -value : value;
}

Tensor ExactSum::limbs() const {
  ExactSum settled = *this;
  settled.settle();
  return from_vector(std::vector<std::int64_t>(settled.limbs_.begin(), settled.limbs_.end()), {kExactLimbs});
}

ExactSum ExactSum::from_limbs(const Tensor& limbs) {
  SHARDLAB_CHECK(limbs.defined() && limbs.dtype() == DType::i64 && limbs.numel() == kExactLimbs,
                 "ExactSum::from_limbs: expected {} i64 limbs, got {}", kExactLimbs,
                 limbs.defined() ? fmt::format("{} {}", shape_str(limbs.shape()), dtype_name(limbs.dtype()))
                                 : std::string("an undefined tensor"));
  const std::vector<std::int64_t> values = limbs.to_vector<std::int64_t>();
  ExactSum sum;
  std::copy(values.begin(), values.end(), sum.limbs_.begin());
  sum.settle();
  return sum;
}

}  // namespace shardlab
