// core/exact_sum.cpp: ExactSum's limbs and their rounding (core/exact_sum.h).
#include "core/exact_sum.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>

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

// The f32 bits of element i of f32, bf16 or f16 terms.
template <typename T>
std::uint32_t f32_bits_of(const T& value) {
  if constexpr (std::is_same_v<T, float>) return std::bit_cast<std::uint32_t>(value);
  if constexpr (std::is_same_v<T, bf16>) return static_cast<std::uint32_t>(value.bits) << 16;
  if constexpr (std::is_same_v<T, f16>) return std::bit_cast<std::uint32_t>(f16_to_float(value));
}

}  // namespace

void ExactSum::add_shifted(unsigned __int128 value, int shift) {
  // Below 2^97, shifted by under 32: four digits of 32 bits, added to settled limbs.
  const unsigned __int128 placed = value << (shift % kDigitBits);
  for (int k = 0; k < 4; ++k)
    limbs_[shift / kDigitBits + k] += static_cast<std::int64_t>((placed >> (k * kDigitBits)) & 0xffffffffu);
  settle();
}

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
  if (squares) {
    // x = m 2^(t - 150) with m below 2^24 (t the exponent field, 1 for subnormals), so x^2 = m^2
    // 2^(2t - 300): every square of one field is an integer m^2 below 2^48 times the same power of
    // two. Those integers are added per field (2^49 terms keep a sum below 2^97), each field's sum
    // placed once: the exact sum, in a multiply and an add per term.
    // Per run of 2^16 terms the sums fit 64 bits (2^48 a square); two sets, even and odd terms, so
    // that neighbours of one field do not wait for each other's add.
    std::array<unsigned __int128, 256> by_field{};
    constexpr std::int64_t kRun = std::int64_t{1} << 16;
    const auto add_all = [&](const auto* values) {
      for (std::int64_t start = 0; start < terms.numel(); start += kRun) {
        std::array<std::array<std::uint64_t, 256>, 2> run{};
        const std::int64_t end = std::min(terms.numel(), start + kRun);
        for (std::int64_t i = start; i < end; ++i) {
          const std::uint32_t bits = f32_bits_of(values[i]);
          const std::uint32_t field = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
          if (field == 0xffu) {  // the square of an infinity is +infinity
            add(mantissa != 0 ? std::numeric_limits<double>::quiet_NaN()
                              : std::numeric_limits<double>::infinity());
            continue;
          }
          const std::uint64_t m = field == 0 ? mantissa : mantissa | 0x800000u;
          run[static_cast<std::size_t>(i & 1)][field] += m * m;
        }
        for (std::size_t field = 0; field < 256; ++field)
          by_field[field] += static_cast<unsigned __int128>(run[0][field]) + run[1][field];
      }
    };
    if (terms.dtype() == DType::f32) add_all(terms.data<float>());
    if (terms.dtype() == DType::bf16) add_all(terms.data<bf16>());
    if (terms.dtype() == DType::f16) add_all(terms.data<f16>());
    for (int field = 0; field < 0xff; ++field) {
      if (by_field[field] != 0) add_shifted(by_field[field], 2 * std::max(field, 1) - 300 + 1074);
    }
    return;
  }
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
