// core/binned_sum.cpp: BinnedSum's bins and round_binned (core/binned_sum.h), on the CPU.
#include "core/binned_sum.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "core/ops.h"
#include "core/parallel.h"

namespace shardlab {
namespace {

constexpr std::int64_t kBlocksPerTask = 64;
constexpr std::uint32_t kDigitMask = (1u << kBinBits) - 1;

// A finite f32 as |x| / 2^-149 = magnitude << shift, the magnitude below 2^24.
struct Fixed {
  std::uint32_t magnitude = 0;
  int shift = 0;
  bool negative = false;
  bool finite = true;
};

Fixed fixed_of(std::uint32_t bits) {
  const std::uint32_t exponent = (bits >> 23) & 0xffu;
  const std::uint32_t mantissa = bits & 0x7fffffu;
  if (exponent == 0xffu) return {.finite = false};
  if (exponent == 0) return {.magnitude = mantissa, .shift = 0, .negative = (bits >> 31) != 0};
  return {.magnitude = mantissa | 0x800000u,
          .shift = static_cast<int>(exponent) - 1,
          .negative = (bits >> 31) != 0};
}

// The bin of the highest bit of a term (kLowestTop for zero and anything below it).
int top_of(const Fixed& term) {
  if (term.magnitude == 0) return kLowestTop;
  const int highest = std::bit_width(term.magnitude) - 1 + term.shift;
  return std::max(kLowestTop, highest / kBinBits);
}

// The term's bits from bin `low` up, truncated below it: under 2^48 where its top is at most low + 2.
std::uint64_t bits_from(const Fixed& term, int low) {
  const int shift = term.shift - low * kBinBits;
  if (shift >= 0) return static_cast<std::uint64_t>(term.magnitude) << shift;
  return -shift >= 24 ? 0 : term.magnitude >> -shift;
}

std::uint32_t term_bits(const Tensor& terms, std::int64_t i) {
  switch (terms.dtype()) {
    case DType::f32:
      return float_bits(terms.data<float>()[i]);
    case DType::bf16:
      return static_cast<std::uint32_t>(terms.data<bf16>()[i].bits) << 16;
    default:
      return float_bits(f16_to_float(terms.data<f16>()[i]));
  }
}

// Element i's bins from `drop` up as one integer in units of bin `drop`.
std::int64_t window_value(const std::int32_t* bins, std::int64_t numel, std::int64_t i, int drop) {
  std::int64_t value = 0;
  for (int b = kBinsKept - 1; b >= drop; --b)
    value = value * (std::int64_t{1} << kBinBits) + bins[b * numel + i];
  return value;
}

float round_to_f32(std::int64_t window, int top) {
  if (window == 0) return 0.0f;
  const std::uint64_t magnitude =
      window < 0 ? ~static_cast<std::uint64_t>(window) + 1 : static_cast<std::uint64_t>(window);
  const int base = (top - (kBinsKept - 1)) * kBinBits;  // the window's lowest bit, in units of 2^-149
  const int highest = std::bit_width(magnitude) - 1 + base;
  float value = std::numeric_limits<float>::infinity();
  if (highest <= kHighestF32Bit) {
    // f32's step at that magnitude: 2^(highest - 23) for normal numbers, 2^-149 (one unit) below them.
    const int dropped = std::max(highest - 23, 0) - base;
    std::uint64_t kept = magnitude;
    if (dropped > 0) {
      kept = magnitude >> dropped;
      const std::uint64_t rest = magnitude & ((std::uint64_t{1} << dropped) - 1);
      const std::uint64_t half = std::uint64_t{1} << (dropped - 1);
      if (rest > half || (rest == half && (kept & 1) != 0)) ++kept;
    }
    value = std::ldexp(static_cast<float>(kept), base + std::max(dropped, 0) - 149);
  }
  return window < 0 ? -value : value;
}

void check_tops(const Tensor& tops, std::int64_t blocks, const char* what) {
  SHARDLAB_CHECK(
      tops.defined() && tops.dtype() == DType::u8 && tops.device().is_cpu() && tops.is_contiguous(),
      "{}: the tops must be a contiguous u8 tensor on the CPU, got {}", what,
      tops.defined() ? fmt::format("{} on {}", dtype_name(tops.dtype()), tops.device().str())
                     : std::string("an undefined tensor"));
  SHARDLAB_CHECK(tops.numel() >= blocks, "{}: {} tops for {} blocks of {} elements", what, tops.numel(),
                 blocks, kBinBlock);
}

}  // namespace

std::int64_t binned_blocks(std::int64_t numel) { return (numel + kBinBlock - 1) / kBinBlock; }

BinnedSum::BinnedSum(std::int64_t numel) : numel_(numel) {
  SHARDLAB_CHECK(numel >= 0, "BinnedSum: a negative element count ({})", numel);
  tops_ = full({binned_blocks(numel)}, kLowestTop, dtype(DType::u8));
  bins_ = zeros({kBinsKept, numel}, dtype(DType::i32));
  terms_.assign(static_cast<std::size_t>(binned_blocks(numel)), 0);
}

std::int64_t BinnedSum::terms() const {
  return terms_.empty() ? 0 : *std::max_element(terms_.begin(), terms_.end());
}

BinnedSum BinnedSum::clone() const {
  BinnedSum copy(0);
  copy.numel_ = numel_;
  copy.terms_ = terms_;
  copy.tops_ = tops_.clone();
  copy.bins_ = bins_.clone();
  return copy;
}

void BinnedSum::raise(std::int64_t block, int top) {
  std::uint8_t& current = tops_.data<std::uint8_t>()[block];
  if (top <= current) return;
  const int drop = top == kNonFiniteTop ? kBinsKept : top - current;
  std::int32_t* bins = bins_.data<std::int32_t>();
  const std::int64_t first = block * kBinBlock, last = std::min(numel_, first + kBinBlock);
  for (int b = 0; b < kBinsKept; ++b) {
    for (std::int64_t i = first; i < last; ++i)
      bins[b * numel_ + i] = b + drop < kBinsKept ? bins[(b + drop) * numel_ + i] : 0;
  }
  current = static_cast<std::uint8_t>(top);
}

void BinnedSum::add(const Tensor& terms, std::int64_t first) {
  SHARDLAB_CHECK(terms.defined() && (terms.dtype() == DType::f32 || terms.dtype() == DType::bf16 ||
                                     terms.dtype() == DType::f16),
                 "BinnedSum::add: the terms must be f32, bf16 or f16, got {}",
                 terms.defined() ? dtype_name(terms.dtype()) : "an undefined tensor");
  SHARDLAB_CHECK(terms.device().is_cpu(), "BinnedSum::add: binned sums run on the CPU, got terms on {}",
                 terms.device().str());
  SHARDLAB_CHECK(terms.is_contiguous() && first >= 0 && first + terms.numel() <= numel_,
                 "BinnedSum::add: expected contiguous terms for elements [{}, {} + n) of {}, got {}{}", first,
                 first, numel_, shape_str(terms.shape()), terms.is_contiguous() ? "" : " (not contiguous)");
  const std::int64_t end = first + terms.numel();
  if (end == first) return;
  const std::int64_t first_block = first / kBinBlock, end_block = binned_blocks(end);
  for (std::int64_t block = first_block; block < end_block; ++block) {
    SHARDLAB_CHECK(terms_[block] < kMostBinnedTerms, "BinnedSum::add: more than {} terms per element",
                   kMostBinnedTerms);
  }
  for (std::int64_t block = first_block; block < end_block; ++block) ++terms_[block];
  std::int32_t* bins = bins_.data<std::int32_t>();
  parallel_for(first_block, end_block, kBlocksPerTask, [&](std::int64_t begin_task, std::int64_t end_task) {
    for (std::int64_t block = begin_task; block < end_task; ++block) {
      const std::int64_t low_element = std::max(first, block * kBinBlock),
                         high_element = std::min(end, (block + 1) * kBinBlock);
      int top = kLowestTop;
      for (std::int64_t i = low_element; i < high_element; ++i) {
        const Fixed term = fixed_of(term_bits(terms, i - first));
        top = std::max(top, term.finite ? top_of(term) : int{kNonFiniteTop});
      }
      raise(block, top);
      const int current = tops_.data<std::uint8_t>()[block];
      if (current == kNonFiniteTop) continue;
      const int low = current - (kBinsKept - 1);
      for (std::int64_t i = low_element; i < high_element; ++i) {
        const Fixed term = fixed_of(term_bits(terms, i - first));
        const std::uint64_t bits = bits_from(term, low);
        for (int b = 0; b < kBinsKept; ++b) {
          const auto digit = static_cast<std::int32_t>((bits >> (b * kBinBits)) & kDigitMask);
          bins[b * numel_ + i] += term.negative ? -digit : digit;
        }
      }
    }
  });
}

void BinnedSum::add(const BinnedSum& other) {
  SHARDLAB_CHECK(other.numel_ == numel_, "BinnedSum::add: a sum of {} elements added to one of {}",
                 other.numel_, numel_);
  for (std::size_t block = 0; block < terms_.size(); ++block) {
    SHARDLAB_CHECK(terms_[block] + other.terms_[block] <= kMostBinnedTerms,
                   "BinnedSum::add: more than {} terms per element", kMostBinnedTerms);
  }
  for (std::size_t block = 0; block < terms_.size(); ++block) terms_[block] += other.terms_[block];
  std::int32_t* bins = bins_.data<std::int32_t>();
  const std::int32_t* others = other.bins_.data<std::int32_t>();
  parallel_for(0, binned_blocks(numel_), kBlocksPerTask, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t block = begin; block < end; ++block) {
      const int theirs = other.tops_.data<std::uint8_t>()[block];
      raise(block, theirs);
      const int current = tops_.data<std::uint8_t>()[block];
      if (current == kNonFiniteTop) continue;
      const int drop = current - theirs;
      const std::int64_t first = block * kBinBlock, last = std::min(numel_, first + kBinBlock);
      for (int b = 0; b + drop < kBinsKept; ++b) {
        for (std::int64_t i = first; i < last; ++i) bins[b * numel_ + i] += others[(b + drop) * numel_ + i];
      }
    }
  });
}

Tensor BinnedSum::window(const Tensor& tops) const {
  const std::int64_t blocks = binned_blocks(numel_);
  check_tops(tops, blocks, "BinnedSum::window");
  Tensor out = empty({numel_}, dtype(DType::i64));
  std::int64_t* values = out.data<std::int64_t>();
  const std::int32_t* bins = bins_.data<std::int32_t>();
  const std::uint8_t* mine = tops_.data<std::uint8_t>();
  const std::uint8_t* wanted = tops.data<std::uint8_t>();
  for (std::int64_t block = 0; block < blocks; ++block) {
    SHARDLAB_CHECK(wanted[block] >= mine[block],
                   "BinnedSum::window: block {}'s top {} is below this sum's {}", block, wanted[block],
                   mine[block]);
  }
  parallel_for(0, blocks, kBlocksPerTask, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t block = begin; block < end; ++block) {
      const int drop = wanted[block] == kNonFiniteTop ? kBinsKept : wanted[block] - mine[block];
      const std::int64_t first = block * kBinBlock, last = std::min(numel_, first + kBinBlock);
      for (std::int64_t i = first; i < last; ++i) values[i] = window_value(bins, numel_, i, drop);
    }
  });
  return out;
}

Tensor BinnedSum::result() const { return round_binned(window(tops_), tops_); }

Tensor round_binned(const Tensor& windows, const Tensor& tops, std::int64_t first) {
  SHARDLAB_CHECK(windows.defined() && windows.dtype() == DType::i64 && windows.device().is_cpu() &&
                     windows.is_contiguous(),
                 "round_binned: the windows must be a contiguous i64 tensor on the CPU, got {}",
                 windows.defined()
                     ? fmt::format("{} on {}", dtype_name(windows.dtype()), windows.device().str())
                     : std::string("an undefined tensor"));
  SHARDLAB_CHECK(first >= 0, "round_binned: a negative first element ({})", first);
  const std::int64_t numel = windows.numel();
  check_tops(tops, binned_blocks(first + numel), "round_binned");
  Tensor out = empty({numel}, dtype(DType::f32));
  float* values = out.data<float>();
  const std::int64_t* sums = windows.data<std::int64_t>();
  const std::uint8_t* top = tops.data<std::uint8_t>();
  parallel_for(0, numel, kBlocksPerTask * kBinBlock, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const int block_top = top[(first + i) / kBinBlock];
      values[i] = block_top == kNonFiniteTop ? std::numeric_limits<float>::quiet_NaN()
                                             : round_to_f32(sums[i], block_top);
    }
  });
  return out;
}

}  // namespace shardlab
