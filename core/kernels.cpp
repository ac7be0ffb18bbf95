// core/kernels.cpp: the table of a device, and how many of a table's entries are set.
#include "core/kernels.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace shardlab {

const Kernels& kernels_for(Device device) { return device.is_cuda() ? cuda_kernels() : cpu_kernels(); }

EntryCount count_entries(const Kernels& table) {
  // The table is function pointers and nothing else, read slot by slot: no entry can be left out.
  static_assert(std::is_trivially_copyable_v<Kernels> && sizeof(Kernels) % sizeof(std::uintptr_t) == 0);
  std::array<std::uintptr_t, sizeof(Kernels) / sizeof(std::uintptr_t)> slots{};
  std::memcpy(slots.data(), &table, sizeof(Kernels));
  EntryCount count{.entries = slots.size()};
  for (const std::uintptr_t slot : slots) count.set += slot != 0 ? 1 : 0;
  return count;
}

}  // namespace shardlab
