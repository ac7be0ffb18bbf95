// core/binned_sum.h: sums of tensors whose bits do not depend on the order or the grouping of their
// terms: what lets 1, 2, 3 or 4 ranks, each adding its own share of a gradient's parts, agree to the bit.
//
//   BinnedSum sum(n);                                  // on each rank
//   for (const Tensor& part : my_parts) sum.add(part);  // f32/bf16/f16 [n] each
//   Tensor tops = sum.tops().clone();                  // all-reduced with max over the ranks, then
//   Tensor window = sum.window(tops);                  // all-reduced (or reduce-scattered) with sum:
//   Tensor total = round_binned(window, tops);         // the same f32 bits however the parts were split
//
// The method (fixed exponent bins, as ReproBLAS's binned sums, with integer bins): a term is a multiple
// of 2^-149, the smallest f32 step; that integer, up to 277 bits, is cut into digits of kBinBits bits at
// fixed positions (bin j holds bits [16j, 16j + 16)). Per block of kBinBlock elements the sum keeps the
// kBinsKept bins under and at the block's top bin (the bin of the largest term's highest bit seen so far)
// and adds each term's digits there, bin by bin, as integers, dropping the digits below: a bin's content
// is the sum of every term's digit in it, whatever the order, and the top is a maximum, so the kept bins
// are the same in any order or grouping. When a larger term raises the top, the bins below the new window
// are dropped, which is what a sum that had seen that term first would never have kept.
//
// The error: each term loses what lies under the window, less than 2^-32 times the block's largest term
// (whose highest bit is in the top bin); n terms, and the final rounding to f32: |result - exact| <=
// n * 2^-32 * max|term| + ulp(result) / 2, the exact sum being what an f64 sum approaches. Non-finite
// terms make their block's elements NaN.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace shardlab {

inline constexpr int kBinBits = 16;
inline constexpr int kBinsKept = 3;
inline constexpr std::int64_t kBinBlock = 64;
// An f32 as a multiple of 2^-149: the highest bit of the largest finite one is bit 276.
inline constexpr int kHighestF32Bit = 276;
inline constexpr int kLowestTop = kBinsKept - 1;  // an empty block's window starts at bin 0
inline constexpr std::uint8_t kNonFiniteTop = 255;
// Terms per element a sum (and a window summed over ranks) may hold: each bin adds digits below 2^16 in
// an i32, a window of three bins is below terms * 2^48 in an i64.
inline constexpr std::int64_t kMostBinnedTerms = 32767;

// The blocks of kBinBlock elements that `numel` elements make (the last may be shorter).
std::int64_t binned_blocks(std::int64_t numel);

// Per element of a flat tensor of numel() elements, the sum of every tensor added, on the CPU.
class BinnedSum {
 public:
  explicit BinnedSum(std::int64_t numel);  // zero: every block's top at kLowestTop
  // Moved, or copied with clone(): a copy would share the bins.
  BinnedSum(BinnedSum&&) = default;
  BinnedSum& operator=(BinnedSum&&) = default;
  BinnedSum clone() const;

  std::int64_t numel() const { return numel_; }
  // The most terms an element's block holds (each add counts once in every block it reaches, a merged
  // sum's count too): at most kMostBinnedTerms.
  std::int64_t terms() const;

  // Adds one term per element to elements [first, first + terms.numel()): a contiguous f32, bf16 or f16
  // tensor on the CPU (a parameter's gradient part into a flat buffer of several).
  void add(const Tensor& terms, std::int64_t first = 0);
  // Adds another sum of as many elements: the same bins as if its terms had been added here.
  void add(const BinnedSum& other);

  // u8 [binned_blocks(numel())]: each block's top bin, or kNonFiniteTop once a term was not finite.
  const Tensor& tops() const { return tops_; }
  // i64 [numel()]: each element's bins under and at `tops` (u8, as tops(), each at least this sum's
  // top) as one integer in units of the lowest one: what ranks add with their windows at the tops
  // all-reduced with max. Non-finite blocks give 0 (their tops say NaN).
  Tensor window(const Tensor& tops) const;
  // f32 [numel()]: the sum, rounded once to nearest.
  Tensor result() const;

 private:
  // Moves block `block`'s window up to `top`, dropping the bins that fall out of it.
  void raise(std::int64_t block, int top);
  // Zeros block `block`'s bins, before its first term.
  void clear_block(std::int64_t block);

  std::int64_t numel_ = 0;
  std::vector<std::int32_t> terms_;  // per block
  Tensor tops_;                      // u8 [blocks]
  Tensor bins_;                      // i32 [kBinsKept, numel]: the window's lowest bin first
};

// f32 [windows.numel()]: a sum of windows (i64, contiguous, on the CPU) at `tops`, each rounded to the
// nearest f32 (ties to even, beyond the largest: infinity), NaN in a block whose top is kNonFiniteTop.
// The windows may be a shard: element i is element first + i of the flat sum whose blocks tops covers.
Tensor round_binned(const Tensor& windows, const Tensor& tops, std::int64_t first = 0);

}  // namespace shardlab
