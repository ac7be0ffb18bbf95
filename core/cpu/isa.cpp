// core/cpu/isa.cpp: which vector instruction set the multi-versioned CPU kernels run: detection,
// SHARDLAB_CPU_ISA, and the switch tests use.
#include "core/cpu/isa.h"

#include <atomic>
#include <cstdlib>

#include "core/error.h"

namespace shardlab::cpu {
namespace {

constexpr Isa kAll[] = {Isa::baseline, Isa::avx2, Isa::avx512};

Isa from_environment() {
  const char* request = std::getenv("SHARDLAB_CPU_ISA");
  return requested_isa(request == nullptr ? "" : request, widest_isa());
}

std::atomic<Isa>& current() {
  static std::atomic<Isa> isa{from_environment()};
  return isa;
}

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::baseline:
      return "baseline";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  fail("isa_name: unknown instruction set {}", static_cast<int>(isa));
}

Isa widest_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::baseline;
}

Isa requested_isa(std::string_view request, Isa widest) {
  if (request.empty()) return widest;
  for (const Isa isa : kAll) {
    if (request != isa_name(isa)) continue;
    SHARDLAB_CHECK(isa <= widest, "SHARDLAB_CPU_ISA={}: this processor runs at most {}", request,
                   isa_name(widest));
    return isa;
  }
  fail("SHARDLAB_CPU_ISA={}: unknown instruction set (baseline, avx2 or avx512)", request);
}

Isa kernel_isa() { return current().load(std::memory_order_relaxed); }

void set_kernel_isa(Isa isa) {
  current().store(requested_isa(isa_name(isa), widest_isa()), std::memory_order_relaxed);
}

std::string describe_cpu_kernels() { return fmt::format("{} kernels", isa_name(kernel_isa())); }

}  // namespace shardlab::cpu
