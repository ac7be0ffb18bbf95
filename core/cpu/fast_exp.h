// core/cpu/fast_exp.h: internal to core/cpu: exp and the sigmoid in f32 as plain arithmetic that
// GCC vectorises, where std::exp is a libm call per element. With -ffp-contract=off they give the
// same bits on every instruction set (and processor, which the C library's exp does not promise).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace shardlab::cpu {

// exp(x) for x in [-88, 0], Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a polynomial in r,
// 2^n from the exponent bits. Within 1 ulp of exp on [-87, 0]; 0 below -87 (exp < 2^-125 there),
// by a bit mask rather than a select of products, which GCC would not vectorise. Callers clamp x
// at -88 first, in a loop of its own: with the clamp inside this loop GCC no longer vectorises it.
inline float exp_from_floor(float x) {
  const auto n = static_cast<std::int32_t>(x * 1.44269504088896341f - 0.5f);  // round(x log2 e), x <= 0
  const float whole = static_cast<float>(n);
  const float r = x - whole * 0.693359375f + whole * 2.12194440e-4f;  // x - n ln2 in two parts
  const float p =
      ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
       1.6666665459e-1f) *
          r +
      5.0000001201e-1f;
  const float value = (p * r * r + r + 1.0f) * std::bit_cast<float>((n + 127) << 23);
  const std::uint32_t keep = x < -87.0f ? 0u : ~0u;
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(value) & keep);
}

// exp(-|x|) clamped as exp_from_floor wants it: in (0, 1], 0 for |x| > 87, NaN for NaN.
inline float negative_magnitude(float x) { return std::max(-std::fabs(x), -88.0f); }

// 1 / (1 + exp(-x)) from e = exp(-|x|), which never overflows: 1 / (1 + e) for x >= 0 and
// e / (1 + e) below.
inline float sigmoid_from(float x, float e) {
  const float inverse = 1.0f / (1.0f + e);
  return x >= 0.0f ? inverse : e * inverse;
}

}  // namespace shardlab::cpu
