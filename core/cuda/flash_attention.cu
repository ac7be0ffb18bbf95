// core/cuda/flash_attention.cu: attention in bf16 and f16 on tensor cores, FlashAttention-2's
// algorithm (core/cpu/attention.cpp's tiles, on the GPU): head dims 64 and 128, GQA by index (K and
// V never repeated), causal tiles skipped, padding keys and other documents' keys hidden, logsumexp in
// f32.
//
// A block is 4 warps; a warp owns 16 rows and multiplies with mma.sync m16n8k16 (bf16 or f16 in,
// f32 accumulate). Forward: a warp's 16 queries against key tiles of 64 in shared memory, an online
// softmax over them, the output accumulated in registers and rescaled when a row's max grows.
// The tiles a block walks land in shared memory by cp.async, two stages of them: the next tile's
// copy is under way while this one is multiplied (at 2 or 3 blocks a multiprocessor, the registers
// allow no more, a block that waited for each tile would leave the tensor cores idle for the whole
// of a load). Operands come out of shared memory by ldmatrix, four 8 x 8 matrices a lane-wide
// instruction (.trans where a tile is the product's k dimension by rows); a warp whose 16 x 64 block
// of pairs is seen whole (core/attention_mask.h's sees_all) skips the per-pair mask.
// Backward recomputes the probabilities from logsumexp, in two kernels that each own their sums:
// one per query tile (dQ), one per key tile (dK and dV, over the group's query heads too). No
// atomics: every run gives the same bits.
//
// The m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + c:
//   A (16 x 16, row-major): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//   B (16 x 8, k x n):      b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]
//   C (16 x 8, f32):        c0, c1 = C[g][2c], C[g][2c+1]; c2, c3 = C[g+8][2c], C[g+8][2c+1]
// so two neighbouring C tiles of 8 columns are, rounded to 16 bits, the A fragment of their 16
// columns: the probabilities go from one product into the next without shared memory.
//
// Every [B, H, T, D] operand is read and written through its strides (q, k and v as a [B, T, H * D]
// projection left them): rows `row` elements apart, 16-byte aligned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/attention_mask.h"
#include "core/cuda/attention_operands.cuh"
#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;              // rows a warp owns
constexpr int kTile = kWarps * kRows;  // queries (or keys) a block owns: 64
constexpr int kKeyTile = 64;           // keys (or queries) a block walks at a time
constexpr int kShift = 8;              // 16 bytes of padding per shared row: fewer bank conflicts
constexpr float kLog2e = 1.4426950408889634f;

// The 64-row tiles that cover `rows` rows.
__host__ __device__ constexpr int tile_count(std::int64_t rows) {
  return static_cast<int>((rows + kKeyTile - 1) / kKeyTile);
}

// The 16-bit format: its conversions and its tensor-core product.
struct Bf16Format {
  static __device__ float to_float(std::uint16_t bits) {
    return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
  }
  static __device__ std::uint16_t from_float(float value) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(value));
  }
  static __device__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

struct F16Format {
  static __device__ float to_float(std::uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  static __device__ std::uint16_t from_float(float value) { return __half_as_ushort(__float2half_rn(value)); }
  static __device__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <typename Format>
__device__ std::uint32_t pack(float low, float high) {
  return static_cast<std::uint32_t>(Format::from_float(low)) |
         (static_cast<std::uint32_t>(Format::from_float(high)) << 16);
}

// Two neighbouring elements of one row (the first at an even column): one 32-bit load.
__device__ std::uint32_t pair(const std::uint16_t* at) { return *reinterpret_cast<const std::uint32_t*>(at); }

// --- shared memory: asynchronous copies in, ldmatrix out ----------------------------------------

// A tile of 64 rows in shared memory, rows D + kShift elements apart.
template <int D>
using SharedTile = std::uint16_t[kKeyTile][D + kShift];

__device__ std::uint32_t shared_address(const void* at) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(at));
}

// `bytes` (4 or 16) from global to shared memory without passing through registers; when `inside` is
// false none is read and the destination is zeros.
template <int Bytes>
__device__ void copy_async(void* to, const void* from, bool inside) {
  static_assert(Bytes == 4 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes; 16 only bypassing L1");
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(to)), "l"(from),
                 "r"(inside ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(to)), "l"(from),
                 "r"(inside ? 4 : 0));
  }
}
// The copies this thread issued since the last commit become one group.
__device__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `Pending` of this thread's newest groups are still in flight.
template <int Pending>
__device__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Rows [first, first + 64) of a [rows, D] matrix (rows `stride` elements apart) copied into a shared
// tile, 16 bytes a copy; rows past the end are zeros. The copies are in flight until waited for.
template <int D>
__device__ void copy_tile_async(SharedTile<D>& tile, const std::uint16_t* matrix, std::int64_t stride,
                                std::int64_t first, std::int64_t rows) {
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row
  for (int i = static_cast<int>(threadIdx.x); i < kKeyTile * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool inside = first + r < rows;
    copy_async<16>(&tile[r][c * 8], inside ? matrix + (first + r) * stride + c * 8 : matrix, inside);
  }
}

// Four 8 x 8 matrices of 16-bit elements; lanes 8 i to 8 i + 7 give the addresses of matrix i's rows
// (16 bytes each). Lane 4 g + c gets, in register i, elements [g][2c] and [g][2c + 1] of matrix i:
// an mma fragment's layout. Transposed, it gets [2c][g] and [2c + 1][g].
__device__ void load_matrices(std::uint32_t (&r)[4], const std::uint16_t* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ void load_matrices_transposed(std::uint32_t (&r)[4], const std::uint16_t* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// The A fragments of 16 rows [row0, row0 + 16) of a [rows, D] matrix in global memory (rows `stride`
// elements apart; zeros past the end).
template <int D>
__device__ void load_rows(std::uint32_t (&fragments)[D / 16][4], const std::uint16_t* matrix,
                          std::int64_t stride, std::int64_t row0, std::int64_t rows) {
  const int g = static_cast<int>(threadIdx.x % 32) / 4, c = static_cast<int>(threadIdx.x % 4);
  const std::int64_t top = row0 + g, bottom = row0 + g + 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int column = kk * 16 + 2 * c;
    fragments[kk][0] = top < rows ? pair(matrix + top * stride + column) : 0;
    fragments[kk][1] = bottom < rows ? pair(matrix + bottom * stride + column) : 0;
    fragments[kk][2] = top < rows ? pair(matrix + top * stride + column + 8) : 0;
    fragments[kk][3] = bottom < rows ? pair(matrix + bottom * stride + column + 8) : 0;
  }
}

// acc[n] (16 x 8 each, 8 of them: 64 columns) += A (16 x D, fragments) times the transpose of the
// tile's rows [0, 64): row r of the tile is column r of the product. B's fragments for columns
// [8n, 8n + 8) and k steps kk, kk + 1 are one ldmatrix: b0 = tile[8n + g][16kk + 2c..], b1 eight
// elements on, then the same for kk + 1, so lane l gives row 8n + l % 8 at column 16kk + 8 (l / 8).
template <typename Format, int D>
__device__ void times_tile_transposed(float (&acc)[8][4], const std::uint32_t (&a)[D / 16][4],
                                      const SharedTile<D>& tile) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
      std::uint32_t b[4];
      load_matrices(b, &tile[n * 8 + lane % 8][kk * 16 + (lane / 8) * 8]);
      Format::mma(acc[n], a[kk], b[0], b[1]);
      Format::mma(acc[n], a[kk + 1], b[2], b[3]);
    }
  }
}

template <int D>
__device__ void zero(float (&acc)[D][4]) {
#pragma unroll
  for (int i = 0; i < D; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
}

// x = a times tile_a's transpose and y = b times tile_b's, from zero: the two products a backward
// kernel takes from each tile pair (the scores, and dO against V).
template <typename Format, int D>
__device__ void both_times_tiles_transposed(float (&x)[8][4], const std::uint32_t (&a)[D / 16][4],
                                            const SharedTile<D>& tile_a, float (&y)[8][4],
                                            const std::uint32_t (&b)[D / 16][4], const SharedTile<D>& tile_b) {
  zero(x);
  zero(y);
  times_tile_transposed<Format, D>(x, a, tile_a);
  times_tile_transposed<Format, D>(y, b, tile_b);
}

// out[d] (16 x 8 each: D columns) += P (16 x 64, as C fragments rounded to 16 bits) times the tile's
// rows [0, 64) (64 x D). B's fragments for k rows [16kp, 16kp + 16) and columns of d, d + 1 are one
// transposed ldmatrix: b0 = tile[16kp + 2c..][8d + g], b1 eight rows on, then the same for d + 1, so
// lane l gives row 16kp + 8 ((l / 8) % 2) + l % 8 at column 8 (d + l / 16).
template <typename Format, int D>
__device__ void probabilities_times_tile(float (&out)[D / 8][4], const float (&p)[8][4],
                                         const SharedTile<D>& tile) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int kp = 0; kp < 4; ++kp) {  // 16 rows of the tile at a time
    const std::uint32_t a[4] = {
        pack<Format>(p[2 * kp][0], p[2 * kp][1]), pack<Format>(p[2 * kp][2], p[2 * kp][3]),
        pack<Format>(p[2 * kp + 1][0], p[2 * kp + 1][1]), pack<Format>(p[2 * kp + 1][2], p[2 * kp + 1][3])};
#pragma unroll
    for (int d = 0; d < D / 8; d += 2) {
      std::uint32_t b[4];
      load_matrices_transposed(b, &tile[kp * 16 + ((lane / 8) % 2) * 8 + lane % 8][(d + lane / 16) * 8]);
      Format::mma(out[d], a, b[0], b[1]);
      Format::mma(out[d + 1], a, b[2], b[3]);
    }
  }
}

// The rows of fragment element e (0..3): the thread's upper row for e < 2, its lower one else.
__device__ int row_of(int e) { return e < 2 ? 0 : 1; }

// The query rows of a forward or dQ block (blockIdx.x: batch row and head, blockIdx.y: the 64-query
// tile): the thread's two rows of its warp's 16 and the column pair it holds of a fragment.
struct QueryBlock {
  std::int64_t bh, b, h, t0, row0, rows[2];
  std::int64_t j;  // its key/value head
  int c;

  __device__ explicit QueryBlock(const AttentionGeometry& g)
      : bh(blockIdx.x),
        b(bh / g.heads),
        h(bh % g.heads),
        t0(static_cast<std::int64_t>(blockIdx.y) * kTile),
        row0(t0 + static_cast<std::int64_t>(threadIdx.x / 32) * kRows),
        rows{row0 + static_cast<std::int64_t>(threadIdx.x % 32) / 4,
             row0 + static_cast<std::int64_t>(threadIdx.x % 32) / 4 + 8},
        j(kv_head_of(h, g.heads, g.kv_heads)),
        c(static_cast<int>(threadIdx.x % 4)) {}
};

// The 16-bit operands of one call, each through its strides; logsumexp and delta in f32.
using MutableHeads16 = HeadView<std::uint16_t>;
using Operands16 = TypedAttentionOperands<std::uint16_t, float>;

// --- the walk over tiles, two stages deep ----------------------------------------------------------

// Runs use(i, stage) for i in [0, count) in order, with tile i in shared stage i % 2; copy(i, stage)
// issues tile i's copies. Tile i + 1's are issued before tile i is waited for, so that they land
// while tile i is multiplied.
template <typename Copy, typename Use>
__device__ void walk_tiles(int count, const Copy& copy, const Use& use) {
  if (count > 0) {
    copy(0, 0);
    commit_copies();
  }
  for (int i = 0; i < count; ++i) {
    const int stage = i % 2;
    if (i + 1 < count) {
      copy(i + 1, 1 - stage);
      commit_copies();
      wait_copies<1>();  // all but tile i + 1's
    } else {
      wait_copies<0>();
    }
    __syncthreads();  // every thread's copies of tile i have landed
    use(i, stage);
    __syncthreads();  // tile i is read: tile i + 2 may be copied over it
  }
}

// The key and value tiles a query block walks (forward and dQ), two stages of each.
template <int D>
struct KeyValueStages {
  SharedTile<D> keys[2], values[2];

  // Copies key tile [s0, s0 + 64) of the block's key/value head into `stage`.
  __device__ void copy(int stage, const Operands16& in, const QueryBlock& block, std::int64_t s0,
                       std::int64_t key_count) {
    copy_tile_async<D>(keys[stage], in.k.at(block.b, block.j), in.k.row, s0, key_count);
    copy_tile_async<D>(values[stage], in.v.at(block.b, block.j), in.v.row, s0, key_count);
  }
};

// The query tiles a key block walks (dK and dV): q, dO, logsumexp and delta, two stages of each.
template <int D>
struct QueryStages {
  SharedTile<D> queries[2], grads[2];
  float lse[2][kKeyTile], delta[2][kKeyTile];  // zeros past the last query (its pairs are hidden)

  // Copies query tile [t0, t0 + 64) of batch row b, head h into `stage`.
  __device__ void copy(int stage, const Operands16& o, const AttentionGeometry& g, std::int64_t b,
                       std::int64_t h, std::int64_t t0) {
    copy_tile_async<D>(queries[stage], o.q.at(b, h), o.q.row, t0, g.queries);
    copy_tile_async<D>(grads[stage], o.grad_out.at(b, h), o.grad_out.row, t0, g.queries);
    const std::int64_t first = (b * g.heads + h) * g.queries + t0;
    for (int i = static_cast<int>(threadIdx.x); i < kKeyTile; i += kThreads) {
      const bool inside = t0 + i < g.queries;
      copy_async<4>(&lse[stage][i], o.logsumexp + (inside ? first + i : 0), inside);
      copy_async<4>(&delta[stage][i], o.delta + (inside ? first + i : 0), inside);
    }
  }
};

// The stages of a kernel live in dynamic shared memory: at head dim 128 they pass the 48 KiB a
// kernel gets unasked.
template <typename Stages>
__device__ Stages& shared_stages() {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  return *reinterpret_cast<Stages*>(shared_bytes);
}

// --- forward -------------------------------------------------------------------------------------

template <typename Format, int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(Operands16 in, AttentionGeometry g, MutableHeads16 out) {
  KeyValueStages<D>& stages = shared_stages<KeyValueStages<D>>();
  const QueryBlock block(g);
  const std::int64_t bh = block.bh, b = block.b, t0 = block.t0, row0 = block.row0;
  const std::int64_t* rows = block.rows;
  const int c = block.c;

  std::uint32_t qf[D / 16][4];
  load_rows<D>(qf, in.q.at(b, block.h), in.q.row, row0, g.queries);
  float o[D / 8][4];
  zero(o);
  float largest[2] = {-INFINITY, -INFINITY}, total[2] = {0.0f, 0.0f};  // total: this thread's share
  const float scale = static_cast<float>(g.scale) * kLog2e;            // scores in log2 units

  const AttentionMask mask = attention_mask(g, in);
  const std::int64_t end = mask.key_end(t0, kTile);
  const auto copy = [&](int i, int stage) { stages.copy(stage, in, block, std::int64_t{i} * kKeyTile, g.keys); };
  walk_tiles(tile_count(end), copy, [&](int i, int stage) {
    const std::int64_t s0 = std::int64_t{i} * kKeyTile;
    float s[8][4];
    zero(s);
    times_tile_transposed<Format, D>(s, qf, stages.keys[stage]);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= scale;
    if (!mask.sees_all(row0, kRows, s0, kKeyTile)) {  // the causal diagonal, padding, the ends
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!mask.sees(b, rows[row_of(e)], s0 + n * 8 + 2 * c + (e & 1))) s[n][e] = -INFINITY;
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[row_of(e)] = fmaxf(tile_max[row_of(e)], s[n][e]);
    float rescale[2], shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The 4 lanes of a row group hold its 64 columns between them.
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float grown = fmaxf(largest[r], tile_max[r]);
      rescale[r] = largest[r] == -INFINITY ? 0.0f : exp2f(largest[r] - grown);
      shift[r] = grown == -INFINITY ? 0.0f : grown;  // a row that sees nothing yet: exp2(-inf - 0) = 0
      largest[r] = grown;
      total[r] *= rescale[r];
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - shift[row_of(e)]);
        total[row_of(e)] += s[n][e];
      }
    }
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] *= rescale[row_of(e)];
    probabilities_times_tile<Format, D>(o, s, stages.values[stage]);
  });

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    total[r] += __shfl_xor_sync(0xffffffffu, total[r], 1);
    total[r] += __shfl_xor_sync(0xffffffffu, total[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= g.queries) continue;
    const float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    std::uint16_t* row_out = out.at(b, block.h, rows[r]);
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      const std::uint32_t two = pack<Format>(o[d][2 * r] * inverse, o[d][2 * r + 1] * inverse);
      *reinterpret_cast<std::uint32_t*>(row_out + d * 8 + 2 * c) = two;
    }
    if (c == 0) {
      in.logsumexp[bh * g.queries + rows[r]] =
          total[r] > 0.0f ? (largest[r] + log2f(total[r])) / kLog2e : -INFINITY;
    }
  }
}

// --- backward ------------------------------------------------------------------------------------

// delta[row] = grad_out[row] . out[row] in f32, one warp per query row (b, h, t).
template <typename Format, int D>
__global__ void row_delta_kernel(Operands16 o, AttentionGeometry g) {
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row >= g.batch * g.heads * g.queries) return;
  const std::int64_t t = row % g.queries, h = row / g.queries % g.heads, b = row / (g.queries * g.heads);
  const std::uint16_t *grad = o.grad_out.at(b, h, t), *out = o.out.at(b, h, t);
  float sum = 0.0f;
  for (int e = static_cast<int>(threadIdx.x % 32); e < D; e += 32)
    sum += Format::to_float(grad[e]) * Format::to_float(out[e]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) o.delta[row] = sum;
}

// dQ of 64 queries: over the key tiles they see, P from logsumexp, dP = dO V^T, dS = P (dP - delta),
// dQ += dS K, then times the scale.
template <typename Format, int D>
__global__ void __launch_bounds__(kThreads) flash_grad_q_kernel(Operands16 o, AttentionGeometry g) {
  KeyValueStages<D>& stages = shared_stages<KeyValueStages<D>>();
  const QueryBlock block(g);
  const std::int64_t bh = block.bh, b = block.b, t0 = block.t0, row0 = block.row0;
  const std::int64_t* rows = block.rows;
  const int c = block.c;

  std::uint32_t qf[D / 16][4], dof[D / 16][4];
  load_rows<D>(qf, o.q.at(b, block.h), o.q.row, row0, g.queries);
  load_rows<D>(dof, o.grad_out.at(b, block.h), o.grad_out.row, row0, g.queries);
  float lse[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool inside = rows[r] < g.queries;
    lse[r] = inside ? o.logsumexp[bh * g.queries + rows[r]] * kLog2e : -INFINITY;
    row_delta[r] = inside ? o.delta[bh * g.queries + rows[r]] : 0.0f;
  }
  float dq[D / 8][4];
  zero(dq);
  const float scale = static_cast<float>(g.scale) * kLog2e;

  const AttentionMask mask = attention_mask(g, o);
  const std::int64_t end = mask.key_end(t0, kTile);
  const auto copy = [&](int i, int stage) { stages.copy(stage, o, block, std::int64_t{i} * kKeyTile, g.keys); };
  walk_tiles(tile_count(end), copy, [&](int i, int stage) {
    const std::int64_t s0 = std::int64_t{i} * kKeyTile;
    float p[8][4], dp[8][4];  // the scores, then P, then dS; dP
    both_times_tiles_transposed<Format, D>(p, qf, stages.keys[stage], dp, dof, stages.values[stage]);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] = exp2f(p[n][e] * scale - lse[row_of(e)]);
    if (!mask.sees_all(row0, kRows, s0, kKeyTile)) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = row_of(e);
          if (lse[r] == -INFINITY || !mask.sees(b, rows[r], s0 + n * 8 + 2 * c + (e & 1))) p[n][e] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] *= dp[n][e] - row_delta[row_of(e)];  // dS
    probabilities_times_tile<Format, D>(dq, p, stages.keys[stage]);
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= g.queries) continue;
    std::uint16_t* row_out = o.grad_q.at(b, block.h, rows[r]);
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      const float s = static_cast<float>(g.scale);
      *reinterpret_cast<std::uint32_t*>(row_out + d * 8 + 2 * c) =
          pack<Format>(dq[d][2 * r] * s, dq[d][2 * r + 1] * s);
    }
  }
}

// dK and dV of 64 keys of one key/value head: over the group's query heads and the query tiles that
// see them, P^T from logsumexp, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
template <typename Format, int D>
__global__ void __launch_bounds__(kThreads) flash_grad_kv_kernel(Operands16 o, AttentionGeometry g) {
  QueryStages<D>& stages = shared_stages<QueryStages<D>>();
  const std::int64_t bj = blockIdx.x, b = bj / g.kv_heads, j = bj % g.kv_heads;
  const std::int64_t group = g.heads / g.kv_heads;
  const std::int64_t s0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t row0 = s0 + static_cast<std::int64_t>(threadIdx.x / 32) * kRows;
  const int lane = static_cast<int>(threadIdx.x % 32), gr = lane / 4, c = lane % 4;
  const std::int64_t rows[2] = {row0 + gr, row0 + gr + 8};  // the thread's keys

  std::uint32_t kf[D / 16][4], vf[D / 16][4];
  load_rows<D>(kf, o.k.at(b, j), o.k.row, row0, g.keys);
  load_rows<D>(vf, o.v.at(b, j), o.v.row, row0, g.keys);
  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  const float scale = static_cast<float>(g.scale) * kLog2e;
  const AttentionMask mask = attention_mask(g, o);
  const std::int64_t first_tile = mask.first_query(s0) / kKeyTile * kKeyTile;  // the tile holding it
  // The walk: the group's query heads one after the other, each over its tiles from first_tile on.
  const int per_head = first_tile < g.queries ? tile_count(g.queries - first_tile) : 0;
  const auto head_of = [&](int i) { return j * group + i / per_head; };
  const auto tile_of = [&](int i) { return first_tile + std::int64_t{i % per_head} * kKeyTile; };
  const auto copy = [&](int i, int stage) { stages.copy(stage, o, g, b, head_of(i), tile_of(i)); };
  walk_tiles(static_cast<int>(group) * per_head, copy, [&](int i, int stage) {
    const std::int64_t t0 = tile_of(i);
    const float* tile_lse = stages.lse[stage];
    const float* tile_delta = stages.delta[stage];
    float pt[8][4], dpt[8][4];  // S^T, then P^T; dP^T, then dS^T: 16 keys x 64 queries
    both_times_tiles_transposed<Format, D>(pt, kf, stages.queries[stage], dpt, vf, stages.grads[stage]);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) pt[n][e] = exp2f(pt[n][e] * scale - tile_lse[n * 8 + 2 * c + (e & 1)] * kLog2e);
    if (!mask.sees_all(t0, kKeyTile, row0, kRows)) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int column = n * 8 + 2 * c + (e & 1);
          if (tile_lse[column] == -INFINITY || !mask.sees(b, t0 + column, rows[row_of(e)])) pt[n][e] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[n][e] = pt[n][e] * (dpt[n][e] - tile_delta[n * 8 + 2 * c + (e & 1)]);  // dS^T
    probabilities_times_tile<Format, D>(dv, pt, stages.grads[stage]);
    probabilities_times_tile<Format, D>(dk, dpt, stages.queries[stage]);
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= g.keys) continue;
    std::uint16_t* k_out = o.grad_k.at(b, j, rows[r]);
    std::uint16_t* v_out = o.grad_v.at(b, j, rows[r]);
    const float s = static_cast<float>(g.scale);
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      *reinterpret_cast<std::uint32_t*>(k_out + d * 8 + 2 * c) =
          pack<Format>(dk[d][2 * r] * s, dk[d][2 * r + 1] * s);
      *reinterpret_cast<std::uint32_t*>(v_out + d * 8 + 2 * c) = pack<Format>(dv[d][2 * r], dv[d][2 * r + 1]);
    }
  }
}

dim3 tiles(std::int64_t heads, std::int64_t rows) {
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>((rows + kTile - 1) / kTile));
}

// Launches a kernel of kThreads a block with its Stages in dynamic shared memory, allowed it first.
template <typename Stages, typename... Args>
void launch_staged(void (*kernel)(Args...), dim3 grid, cudaStream_t stream, std::type_identity_t<Args>... args) {
  constexpr int kBytes = static_cast<int>(sizeof(Stages));
  SHARDLAB_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<grid, kThreads, kBytes, stream>>>(args...);
  SHARDLAB_CUDA_CHECK_LAUNCH();
}

template <typename Format, int D>
void forward(const AttentionOperands& operands, const AttentionGeometry& g, MutableHeads out,
             cudaStream_t stream) {
  launch_staged<KeyValueStages<D>>(flash_forward_kernel<Format, D>, tiles(g.batch * g.heads, g.queries), stream,
                                   typed_attention_operands<std::uint16_t, float>(operands), g,
                                   head_view<std::uint16_t>(out));
}

template <typename Format, int D>
void backward(const AttentionOperands& operands, const AttentionGeometry& g, cudaStream_t stream) {
  const Operands16 o = typed_attention_operands<std::uint16_t, float>(operands);
  const std::int64_t rows = g.batch * g.heads * g.queries;
  row_delta_kernel<Format, D>
      <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(o, g);
  SHARDLAB_CUDA_CHECK_LAUNCH();
  launch_staged<KeyValueStages<D>>(flash_grad_q_kernel<Format, D>, tiles(g.batch * g.heads, g.queries), stream,
                                   o, g);
  launch_staged<QueryStages<D>>(flash_grad_kv_kernel<Format, D>, tiles(g.batch * g.kv_heads, g.keys), stream,
                                o, g);
}

// Calls fn.template operator()<Format, D>() for the dtype and head dim flash attention takes.
template <typename Fn>
bool visit_flash(DType dtype, std::int64_t head_dim, Fn&& fn) {
  const auto by_dim = [&]<typename Format>() {
    if (head_dim == 64) {
      fn.template operator()<Format, 64>();
    } else {
      fn.template operator()<Format, 128>();
    }
  };
  if (dtype == DType::bf16) {
    by_dim.template operator()<Bf16Format>();
  } else {
    by_dim.template operator()<F16Format>();
  }
  return true;
}

// What the kernels take: the dtypes and head dims they are compiled for.
bool takes(DType dtype, const AttentionGeometry& g) {
  return (dtype == DType::bf16 || dtype == DType::f16) && g.head_dim == g.value_dim &&
         (g.head_dim == 64 || g.head_dim == 128);
}

}  // namespace

bool launch_flash_attention_forward(DType dtype, const AttentionOperands& operands,
                                    const AttentionGeometry& g, MutableHeads out, cudaStream_t stream) {
  if (!takes(dtype, g)) return false;
  if (g.batch * g.heads * g.queries == 0) return true;
  return visit_flash(dtype, g.head_dim,
                     [&]<typename Format, int D>() { forward<Format, D>(operands, g, out, stream); });
}

bool launch_flash_attention_backward(DType dtype, const AttentionOperands& operands,
                                     const AttentionGeometry& g, cudaStream_t stream) {
  if (!takes(dtype, g)) return false;
  if (g.batch * g.heads * g.queries == 0 || g.keys == 0) return true;
  return visit_flash(dtype, g.head_dim,
                     [&]<typename Format, int D>() { backward<Format, D>(operands, g, stream); });
}

}  // namespace shardlab::cuda
