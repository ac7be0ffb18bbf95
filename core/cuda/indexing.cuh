// core/cuda/indexing.cuh: internal to core/cuda: element offsets of strided operands described by
// a Layout (launch.h), the grid-stride loop over them (32-bit index math where it fits), the packed
// walk of dense operands in 16-byte loads and stores, and accumulation as the CPU kernels do it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/cuda/launch.h"

namespace shardlab::cuda {

// target += value in the compute type, rounded once to T: the CPU kernels' accumulation.
template <typename T>
__device__ void accumulate(T& target, T value) {
  target = narrow<T>(widen(target) + widen(value));
}

// A typed HeadsOf (launch.h): the first element of row t of head h of batch row b.
template <typename T>
struct HeadView {
  T* data;
  std::int64_t batch, head, row;
  __device__ T* at(std::int64_t b, std::int64_t h, std::int64_t t = 0) const {
    return data + b * batch + h * head + t * row;
  }
};
template <typename T, typename Pointer>
HeadView<T> head_view(const HeadsOf<Pointer>& heads) {
  return {static_cast<T*>(heads.data), heads.batch, heads.head, heads.row};
}

// The grid-stride loop's start and step for this thread.
__device__ inline std::int64_t first_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t thread_step() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

template <int N>
struct Offsets {
  std::int64_t of[N];
};

// Offsets of row-major element `index` in each operand: peel coordinates off from the last dim, in
// Index arithmetic (32 bits where the layout's narrow_index allows: no 64-bit division per dim).
template <typename Index, int N>
__device__ Offsets<N> offsets_of(const Layout<N>& layout, Index index) {
  Offsets<N> result{};
  for (int d = layout.rank - 1; d > 0; --d) {
    const Index size = static_cast<Index>(layout.sizes[d]);
    const Index coordinate = index % size;
    index /= size;
    for (int k = 0; k < N; ++k) result.of[k] += coordinate * static_cast<Index>(layout.strides[k][d]);
  }
  if (layout.rank > 0) {
    for (int k = 0; k < N; ++k) result.of[k] += index * static_cast<Index>(layout.strides[k][0]);
  }
  return result;
}

// Grid-stride loop: calls fn(offsets) for every element of the layout.
template <int N, typename Fn>
__device__ void for_each_element(const Layout<N>& layout, Fn&& fn) {
  if (layout.narrow_index) {
    // Unsigned: i + step stays below 2^32 for i < 2^31; each index fits an int32.
    const auto count = static_cast<std::uint32_t>(layout.numel);
    for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
      fn(offsets_of<std::int32_t>(layout, static_cast<std::int32_t>(i)));
    }
    return;
  }
  for (std::int64_t i = first_thread(); i < layout.numel; i += thread_step()) {
    fn(offsets_of<std::int64_t>(layout, i));
  }
}

// The entry of a multi-tensor launch's table (its first_chunk increasing from 0 along the table) whose
// chunks hold `chunk`: the last with first_chunk <= chunk, by binary search.
template <typename Descriptor>
__device__ std::int64_t segment_of(const Descriptor* table, std::int64_t segments, std::int64_t chunk) {
  std::int64_t low = 0, high = segments - 1;
  while (low < high) {
    const std::int64_t middle = (low + high + 1) / 2;
    if (table[middle].first_chunk <= chunk) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

// --- packed layouts: 16 bytes of each operand per load and store ---------------------------------

// V consecutive elements moved as one load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T lane[V];
};

// Elements per pack: 16 bytes of the widest operand (the others move fewer bytes per pack).
template <typename... T>
constexpr int pack_width() {
  std::size_t widest = 1;
  ((widest = sizeof(T) > widest ? sizeof(T) : widest), ...);
  return static_cast<int>(kPackBytes / widest);
}

// Pack p of an operand stepping by `step`: 1, or 0 for one element shared by all.
template <int V, typename T>
__device__ Pack<T, V> load_pack(const T* base, std::int64_t step, std::uint32_t p) {
  if (step != 0) return reinterpret_cast<const Pack<T, V>*>(base)[p];
  Pack<T, V> pack;
  const T shared = base[0];
#pragma unroll
  for (int v = 0; v < V; ++v) pack.lane[v] = shared;
  return pack;
}

// The step of operand k along a packed layout's one dim (0 for a single element: rank 0).
template <int N>
__device__ std::int64_t packed_step(const Layout<N>& layout, int k) {
  return layout.rank == 0 ? 0 : layout.strides[k][0];
}

// n (< 2^31) dense elements in packs of V: pack(p) for each whole pack p (elements p V, ..., p V + V - 1),
// then one(i) for each element i past the last whole pack, grid-stride, in 32-bit indices.
template <int V, typename PackFn, typename OneFn>
__device__ void for_each_pack(std::uint32_t n, PackFn&& pack, OneFn&& one) {
  const std::uint32_t packs = n / V, first = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
  for (std::uint32_t p = first; p < packs; p += step) pack(p);
  for (std::uint32_t i = packs * V + first; i < n; i += step) one(i);
}

template <typename T, int V>
__device__ void store_pack(T* base, std::uint32_t p, const Pack<T, V>& pack) {
  reinterpret_cast<Pack<T, V>*>(base)[p] = pack;
}

// Whether n elements at each of `pointers` can move in 16-byte packs: every start on 16 bytes, n < 2^31.
inline bool packable(std::int64_t n, std::initializer_list<const void*> pointers) {
  if (n > kMaxNarrowIndex) return false;
  for (const void* pointer : pointers) {
    if (reinterpret_cast<std::uintptr_t>(pointer) % kPackBytes != 0) return false;
  }
  return true;
}

// n contiguous elements of each of `pointers` as an elementwise Layout: one dim, packed where they allow.
template <int N>
Layout<N> dense_layout(std::int64_t n, std::initializer_list<const void*> pointers) {
  Layout<N> layout;
  layout.rank = 1;
  layout.numel = n;
  layout.sizes[0] = n;
  for (int k = 0; k < N; ++k) layout.strides[k][0] = 1;
  layout.packed = packable(n, pointers);
  layout.narrow_index = n <= kMaxNarrowIndex;
  return layout;
}

template <typename Fn, typename Out, std::size_t... K, typename... In>
__device__ void map_packed(const Layout<sizeof...(In) + 1>& layout, Fn& fn, Out* out,
                           std::index_sequence<K...>, const In*... in) {
  constexpr int V = pack_width<Out, In...>();
  for_each_pack<V>(
      static_cast<std::uint32_t>(layout.numel),
      [&](std::uint32_t p) {
        const auto apply = [&](const Pack<In, V>&... operand) {
          Pack<Out, V> result;
#pragma unroll
          for (int v = 0; v < V; ++v) result.lane[v] = fn(operand.lane[v]...);
          store_pack(out, p, result);
        };
        apply(load_pack<V>(in, packed_step(layout, K), p)...);
      },
      [&](std::uint32_t i) { out[i * packed_step(layout, sizeof...(In))] = fn(in[i * packed_step(layout, K)]...); });
}

template <typename Fn, typename Out, std::size_t... K, typename... In>
__device__ void map_strided(const Layout<sizeof...(In) + 1>& layout, Fn& fn, Out* out,
                            std::index_sequence<K...>, const In*... in) {
  constexpr int N = sizeof...(In) + 1;
  for_each_element(layout, [&](const Offsets<N>& at) { out[at.of[N - 1]] = fn(in[at.of[K]]...); });
}

// out = fn(in...) for every element of the layout, whose operands are in..., then out: packed where
// the layout allows, strided otherwise.
template <typename Fn, typename Out, typename... In>
__device__ void map_elements(const Layout<sizeof...(In) + 1>& layout, Fn fn, Out* out, const In*... in) {
  if (layout.packed) {
    map_packed(layout, fn, out, std::index_sequence_for<In...>{}, in...);
  } else {
    map_strided(layout, fn, out, std::index_sequence_for<In...>{}, in...);
  }
}

// Blocks for map_elements over `layout`: a thread per pack where packed.
template <typename Out, typename... In>
unsigned map_grid(const Layout<sizeof...(In) + 1>& layout) {
  constexpr int V = pack_width<Out, In...>();
  return grid_size(layout.packed ? (layout.numel + V - 1) / V : layout.numel);
}

}  // namespace shardlab::cuda
