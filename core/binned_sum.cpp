// core/binned_sum.cpp: BinnedSum's bins and round_binned (core/binned_sum.h), on the CPU.
#include "core/binned_sum.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu/isa.h"
#include "core/ops.h"
#include "core/parallel.h"

namespace shardlab {
namespace {

constexpr std::int64_t kBlocksPerTask = 64;
constexpr std::uint32_t kDigitMask = (1u << kBinBits) - 1;

// The bin of the highest bit of a term |x| / 2^-149 = magnitude << shift (kLowestTop for zero and
// anything below it).
int top_of(std::uint32_t magnitude, int shift) {
  if (magnitude == 0) return kLowestTop;
  const int highest = std::bit_width(magnitude) - 1 + shift;
  return std::max(kLowestTop, highest / kBinBits);
}

// Terms [first, first + count) of `terms` as f32 bits, into `out`.
void term_bits(const Tensor& terms, std::int64_t first, std::int64_t count, std::uint32_t* out) {
  switch (terms.dtype()) {
    case DType::f32: {
      const float* values = terms.data<float>() + first;
      for (std::int64_t i = 0; i < count; ++i) out[i] = float_bits(values[i]);
      return;
    }
    case DType::bf16: {
      const bf16* values = terms.data<bf16>() + first;
      for (std::int64_t i = 0; i < count; ++i) out[i] = static_cast<std::uint32_t>(values[i].bits) << 16;
      return;
    }
    default: {
      const f16* values = terms.data<f16>() + first;
      for (std::int64_t i = 0; i < count; ++i) out[i] = float_bits(f16_to_float(values[i]));
      return;
    }
  }
}

// 2^power as a double, for powers where it is a normal number.
double power_of_two(int power) {
  return std::bit_cast<double>(static_cast<std::uint64_t>(power + 1023) << 52);
}

float round_to_f32(std::int64_t window, int top) {
  if (window == 0) return 0.0f;
  const std::uint64_t magnitude =
      window < 0 ? ~static_cast<std::uint64_t>(window) + 1 : static_cast<std::uint64_t>(window);
  const int base = (top - (kBinsKept - 1)) * kBinBits;  // the window's lowest bit, in units of 2^-149
  if (magnitude < (std::uint64_t{1} << 53)) {
    // Exact in a double, and so is its product with 2^(base - 149) (a normal double for every top):
    // converting that to f32 is the one rounding, to nearest, ties to even, subnormals and overflow
    // included.
    return static_cast<float>(static_cast<double>(window) * power_of_two(base - 149));
  }
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
    // kept (at most 2^24) times 2^power is an f32 (or 2^128, infinity); made in a double, where the
    // power of two is a normal number and the product exact, it converts without rounding.
    value = static_cast<float>(static_cast<double>(kept) * power_of_two(base + std::max(dropped, 0) - 149));
  }
  return window < 0 ? -value : value;
}

// The largest of `count` terms' magnitudes (f32 bits without the sign): they order as the values do,
// infinity and NaN above every finite one.
SHARDLAB_CPU_CLONES(std::uint32_t, largest_magnitude, (const std::uint32_t* bits, std::int64_t count),
                    (bits, count)) {
  std::uint32_t widest = 0;
  for (std::int64_t i = 0; i < count; ++i) widest = std::max(widest, bits[i] & 0x7fffffffu);
  return widest;
}

// The bin of the largest of `count` terms (as f32 bits), or kNonFiniteTop when one is not finite.
int block_top(const std::uint32_t* bits, std::int64_t count) {
  const std::uint32_t widest = largest_magnitude(bits, count);
  if (widest >= 0x7f800000u) return kNonFiniteTop;
  // A normal number's highest bit is its exponent field's; a subnormal's (field 0), its mantissa's.
  const std::uint32_t field = widest >> 23;
  return field > 0 ? top_of(0x800000u, static_cast<int>(field) - 1) : top_of(widest, 0);
}

// Each term's bits from bit `low_bit` up (its magnitude as a multiple of 2^-149, truncated below the
// window), cut into the three digits added to rows[0..2] (kStore: written there, a block's first terms),
// negated for a negative term. Integers only, branch-free, so that every instruction set's clone
// vectorises it to the same sums.
template <bool kStore>
[[gnu::always_inline]] inline void digits_into(const std::uint32_t* term, std::int64_t count, int low_bit,
                                               std::int32_t* const* rows) {
  std::int32_t* const low = rows[0];
  std::int32_t* const middle = rows[1];
  std::int32_t* const high = rows[2];
  for (std::int64_t i = 0; i < count; ++i) {
    const std::uint32_t field = (term[i] >> 23) & 0xffu;
    const std::uint64_t magnitude = (term[i] & 0x7fffffu) | (field != 0 ? 0x800000u : 0u);
    const int shift = static_cast<int>(field != 0 ? field - 1 : 0) - low_bit;
    const std::uint64_t up = magnitude << (shift > 0 ? shift : 0);
    const std::uint64_t down = magnitude >> (shift < 0 && shift > -24 ? -shift : 0);
    const std::uint64_t bits = shift >= 0 ? up : (shift > -24 ? down : 0);
    const auto negative = static_cast<std::int32_t>(term[i] >> 31);  // 0 or 1
    const std::int32_t digits[kBinsKept] = {
        (static_cast<std::int32_t>(bits & kDigitMask) ^ -negative) + negative,
        (static_cast<std::int32_t>((bits >> kBinBits) & kDigitMask) ^ -negative) + negative,
        (static_cast<std::int32_t>((bits >> (2 * kBinBits)) & kDigitMask) ^ -negative) + negative};
    if constexpr (kStore) {
      low[i] = digits[0], middle[i] = digits[1], high[i] = digits[2];
    } else {
      low[i] += digits[0], middle[i] += digits[1], high[i] += digits[2];
    }
  }
}

SHARDLAB_CPU_CLONES(void, add_digits,
                    (const std::uint32_t* term, std::int64_t count, int low_bit, bool store,
                     std::int32_t* const* rows),
                    (term, count, low_bit, store, rows)) {
  if (store) {
    digits_into<true>(term, count, low_bit, rows);
  } else {
    digits_into<false>(term, count, low_bit, rows);
  }
}

// Elements' bins from `drop` up as one integer in units of bin `drop` (0 when drop is kBinsKept).
SHARDLAB_CPU_CLONES(void, window_values,
                    (const std::int32_t* low, const std::int32_t* middle, const std::int32_t* high,
                     std::int64_t count, int drop, std::int64_t* out),
                    (low, middle, high, count, drop, out)) {
  constexpr std::int64_t kDigit = std::int64_t{1} << kBinBits;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t h = high[i], m = middle[i];
    out[i] = drop == 0 ? (h * kDigit + m) * kDigit + low[i] : drop == 1 ? h * kDigit + m : drop == 2 ? h : 0;
  }
}

// Windows below 2^51 in magnitude made doubles exactly (through 2^52 + 2^51, integers only, so that
// every instruction set's clone vectorises it), times `scale` (2^(base - 149), exact) and rounded once to
// f32, round_to_f32's result; returns whether some window was larger (round_to_f32 then redoes the block).
SHARDLAB_CPU_CLONES(bool, round_small_windows,
                    (const std::int64_t* windows, std::int64_t count, double scale, float* out),
                    (windows, count, scale, out)) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 51;
  constexpr double kOffset = 6755399441055744.0;  // 2^52 + 2^51: a window w is the double kOffset + w
  const auto offset_bits = std::bit_cast<std::uint64_t>(kOffset);
  bool large = false;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t window = windows[i];
    large |= window >= kLimit || window <= -kLimit;
    // Added as unsigned integers: a large window (redone below) wraps instead of overflowing.
    const double exact = std::bit_cast<double>(static_cast<std::uint64_t>(window) + offset_bits) - kOffset;
    out[i] = static_cast<float>(exact * scale);
  }
  return large;
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
  // Left uncleared: a block's bins are cleared by the first add that reaches it (one pass over the
  // bins less, and that one while they are in cache); a block no add reached reads as zero.
  bins_ = empty({kBinsKept, numel}, dtype(DType::i32));
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

void BinnedSum::clear_block(std::int64_t block) {
  const std::int64_t first = block * kBinBlock, count = std::min(numel_, first + kBinBlock) - first;
  for (int b = 0; b < kBinsKept; ++b)
    std::memset(bins_.data<std::int32_t>() + b * numel_ + first, 0,
                static_cast<std::size_t>(count) * sizeof(std::int32_t));
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
      const std::int64_t count = high_element - low_element;
      std::uint32_t term[kBinBlock];
      term_bits(terms, low_element - first, count, term);
      // A block's first add, reaching all of it, writes its digits (the bins were never cleared) and its
      // top (at least the empty block's); any other adds to them.
      const int top = block_top(term, count);
      const bool first_add = terms_[block] == 1;
      const bool writes = first_add && count == std::min(numel_, (block + 1) * kBinBlock) - block * kBinBlock;
      if (writes) {
        tops_.data<std::uint8_t>()[block] = static_cast<std::uint8_t>(top);
      } else {
        if (first_add) clear_block(block);
        raise(block, top);
      }
      const int current = tops_.data<std::uint8_t>()[block];
      if (current == kNonFiniteTop) continue;
      const int low = current - (kBinsKept - 1);
      std::int32_t* row[kBinsKept];
      for (int b = 0; b < kBinsKept; ++b) row[b] = bins + b * numel_ + low_element;
      add_digits(term, count, low * kBinBits, writes, row);
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
      if (other.terms_[block] == 0) continue;  // nothing added there: its bins are not cleared
      if (terms_[block] == other.terms_[block]) clear_block(block);  // this sum had nothing there
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
      // No term reached the block (its bins never cleared): a window of zero.
      const int drop = wanted[block] == kNonFiniteTop || terms_[static_cast<std::size_t>(block)] == 0
                           ? kBinsKept
                           : std::min(wanted[block] - mine[block], kBinsKept);
      const std::int64_t first = block * kBinBlock, last = std::min(numel_, first + kBinBlock);
      window_values(bins + first, bins + numel_ + first, bins + 2 * numel_ + first, last - first, drop,
                    values + first);
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
  // Block by block of the flat sum: element i is element first + i of it.
  const std::int64_t first_block = first / kBinBlock, end_block = binned_blocks(first + numel);
  parallel_for(first_block, end_block, kBlocksPerTask, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t block = begin; block < end; ++block) {
      const int block_top = top[block];
      const std::int64_t low = std::max(block * kBinBlock, first) - first,
                         high = std::min((block + 1) * kBinBlock, first + numel) - first;
      if (block_top == kNonFiniteTop) {
        std::fill(values + low, values + high, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const double scale = power_of_two((block_top - (kBinsKept - 1)) * kBinBits - 149);
      if (!round_small_windows(sums + low, high - low, scale, values + low)) continue;
      for (std::int64_t i = low; i < high; ++i) values[i] = round_to_f32(sums[i], block_top);
    }
  });
  return out;
}

}  // namespace shardlab
