// core/cpu/gemm_tiles.cpp: the GEMM's register tiles: AVX-512, AVX2 + FMA and plain x86-64.
#include "core/cpu/gemm_tiles.h"

#include <immintrin.h>

#include <cmath>
#include <utility>

namespace shardlab::cpu {
namespace {

// The vector operations each tile needs, overloaded on the element type. Each carries its
// instruction set so that it inlines into the tile compiled for that set.
#define SHARDLAB_AVX512 gnu::target("avx512f"), gnu::always_inline
[[SHARDLAB_AVX512]] inline __m512 load(const float* p, __m512) { return _mm512_loadu_ps(p); }
[[SHARDLAB_AVX512]] inline __m512d load(const double* p, __m512d) { return _mm512_loadu_pd(p); }
[[SHARDLAB_AVX512]] inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
[[SHARDLAB_AVX512]] inline void store(double* p, __m512d v) { _mm512_storeu_pd(p, v); }
[[SHARDLAB_AVX512]] inline __m512 broadcast(float x, __m512) { return _mm512_set1_ps(x); }
[[SHARDLAB_AVX512]] inline __m512d broadcast(double x, __m512d) { return _mm512_set1_pd(x); }
[[SHARDLAB_AVX512]] inline __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
[[SHARDLAB_AVX512]] inline __m512d fma(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }
#undef SHARDLAB_AVX512

#define SHARDLAB_AVX2 gnu::target("avx2,fma"), gnu::always_inline
[[SHARDLAB_AVX2]] inline __m256 load(const float* p, __m256) { return _mm256_loadu_ps(p); }
[[SHARDLAB_AVX2]] inline __m256d load(const double* p, __m256d) { return _mm256_loadu_pd(p); }
[[SHARDLAB_AVX2]] inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
[[SHARDLAB_AVX2]] inline void store(double* p, __m256d v) { _mm256_storeu_pd(p, v); }
[[SHARDLAB_AVX2]] inline __m256 broadcast(float x, __m256) { return _mm256_set1_ps(x); }
[[SHARDLAB_AVX2]] inline __m256d broadcast(double x, __m256d) { return _mm256_set1_pd(x); }
[[SHARDLAB_AVX2]] inline __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
[[SHARDLAB_AVX2]] inline __m256d fma(__m256d a, __m256d b, __m256d c) { return _mm256_fmadd_pd(a, b, c); }
#undef SHARDLAB_AVX2

// The vector type of each set for float and double (std::conditional would drop their attributes).
template <typename T>
struct Avx512Vector {
  using type = __m512d;
};
template <>
struct Avx512Vector<float> {
  using type = __m512;
};
template <typename T>
struct Avx2Vector {
  using type = __m256d;
};
template <>
struct Avx2Vector<float> {
  using type = __m256;
};

// The tile body shared by both vector sets: kRows rows of two vectors V, written once and
// instantiated inside a function of each set (a macro, because a template without the set's
// target attribute cannot inline the set's intrinsics).
#define SHARDLAB_VECTOR_TILE(V, kRows)                                                       \
  constexpr int kLanes = static_cast<int>(sizeof(V) / sizeof(T));                          \
  V acc[kRows][2];                                                                         \
  _Pragma("GCC unroll 16") for (int r = 0; r < kRows; ++r) {                               \
    __builtin_prefetch(c + r * ldc, 1);                                                    \
    __builtin_prefetch(c + r * ldc + 2 * kLanes - 1, 1);                                   \
  }                                                                                        \
  _Pragma("GCC unroll 16") for (int r = 0; r < kRows; ++r) {                               \
    for (int h = 0; h < 2; ++h) acc[r][h] = from_c ? load(c + r * ldc + h * kLanes, V{}) : V{}; \
  }                                                                                        \
  for (std::int64_t p = 0; p < kc; ++p, a += a_step, b += 2 * kLanes) {                    \
    const V b0 = load(b, V{}), b1 = load(b + kLanes, V{});                                 \
    _Pragma("GCC unroll 16") for (int r = 0; r < kRows; ++r) {                             \
      const V x = broadcast(a[r * lda], V{});                                              \
      acc[r][0] = fma(x, b0, acc[r][0]);                                                   \
      acc[r][1] = fma(x, b1, acc[r][1]);                                                   \
    }                                                                                      \
  }                                                                                        \
  _Pragma("GCC unroll 16") for (int r = 0; r < kRows; ++r) {                               \
    for (int h = 0; h < 2; ++h) store(c + r * ldc + h * kLanes, acc[r][h]);                \
  }

template <typename T, int kRows>
[[gnu::target("avx512f")]] void tile_avx512(std::int64_t kc, const T* a, std::int64_t lda, std::int64_t a_step,
                                            const T* b, T* c, std::int64_t ldc, bool from_c) {
  using V = typename Avx512Vector<T>::type;
  SHARDLAB_VECTOR_TILE(V, kRows)
}

template <typename T, int kRows>
[[gnu::target("avx2,fma")]] void tile_avx2(std::int64_t kc, const T* a, std::int64_t lda, std::int64_t a_step,
                                           const T* b, T* c, std::int64_t ldc, bool from_c) {
  using V = typename Avx2Vector<T>::type;
  SHARDLAB_VECTOR_TILE(V, kRows)
}
#undef SHARDLAB_VECTOR_TILE

// Without FMA instructions std::fma computes the fused result in software: slow, but the bits
// of the vector tiles.
constexpr int kBaselineCols = 4;

template <typename T, int kRows>
void tile_baseline(std::int64_t kc, const T* a, std::int64_t lda, std::int64_t a_step, const T* b, T* c,
                   std::int64_t ldc, bool from_c) {
  T acc[kRows][kBaselineCols];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kBaselineCols; ++j) acc[r][j] = from_c ? c[r * ldc + j] : T(0);
  }
  for (std::int64_t p = 0; p < kc; ++p, a += a_step, b += kBaselineCols) {
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < kBaselineCols; ++j) acc[r][j] = std::fma(a[r * lda], b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kBaselineCols; ++j) c[r * ldc + j] = acc[r][j];
  }
}

// The tiles of 1 to kMax rows of one set, as a kernel.
template <typename T, int kMax, int kCols, template <typename, int> typename Tile>
TileKernel<T> kernel_of() {
  static_assert(kMax <= kMaxTileRows && kCols <= kMaxTileCols);
  TileKernel<T> kernel{kMax, kCols, {}};
  [&]<int... kRows>(std::integer_sequence<int, kRows...>) {
    ((kernel.runs[kRows] = Tile<T, kRows + 1>::run), ...);
  }(std::make_integer_sequence<int, kMax>{});
  return kernel;
}

template <typename T, int kRows>
struct Avx512Tile {
  static constexpr auto run = tile_avx512<T, kRows>;
};
template <typename T, int kRows>
struct Avx2Tile {
  static constexpr auto run = tile_avx2<T, kRows>;
};
template <typename T, int kRows>
struct BaselineTile {
  static constexpr auto run = tile_baseline<T, kRows>;
};

}  // namespace

template <typename T>
TileKernel<T> tile_kernel(Isa isa) {
  constexpr int kAvx512Lanes = 64 / sizeof(T), kAvx2Lanes = 32 / sizeof(T);
  switch (isa) {
    case Isa::avx512:
      return kernel_of<T, 12, 2 * kAvx512Lanes, Avx512Tile>();
    case Isa::avx2:
      return kernel_of<T, 6, 2 * kAvx2Lanes, Avx2Tile>();
    case Isa::baseline:
      break;
  }
  return kernel_of<T, 4, kBaselineCols, BaselineTile>();
}

template TileKernel<float> tile_kernel<float>(Isa);
template TileKernel<double> tile_kernel<double>(Isa);

}  // namespace shardlab::cpu
