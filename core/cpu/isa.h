// core/cpu/isa.h: internal to core/cpu: the vector instruction set of the CPU kernels compiled
// once per set (SHARDLAB_CPU_CLONES): the widest this processor runs, or a narrower one named by
// SHARDLAB_CPU_ISA, so that every body can be tested on one machine.
#pragma once

#include <string>
#include <string_view>

namespace shardlab::cpu {

enum class Isa { baseline, avx2, avx512 };  // x86-64 (SSE2); AVX2 and FMA; AVX-512F

std::string_view isa_name(Isa isa);

// The widest set this processor and its operating system run.
Isa widest_isa();

// The set SHARDLAB_CPU_ISA asks for ("baseline", "avx2" or "avx512"), checked against `widest`:
// an unknown name, or a set wider than `widest`, throws. An empty request means `widest`.
Isa requested_isa(std::string_view request, Isa widest);

// The set the kernels use now: SHARDLAB_CPU_ISA's when the process starts, else widest_isa().
Isa kernel_isa();

// Makes the kernels use `isa` from now on (tests compare the bodies); throws when the processor
// lacks it.
void set_kernel_isa(Isa isa);

// What the CPU kernels run on, for logs: "avx2 kernels". Every set gives the same bits (the GEMM
// included); what may still differ between processors is the C library's exp and log, which
// pick an implementation by processor.
std::string describe_cpu_kernels();

}  // namespace shardlab::cpu

// Defines `ret name params` as a function compiled three times (AVX-512F, AVX2, baseline) from the
// body that follows the macro, calling the body of kernel_isa(). `args` names the parameters, in
// parentheses. The bodies differ in vector width only: with -ffp-contract=off no multiply-add is
// fused, so a body written to keep its loop's order gives the same bits under every set.
#define SHARDLAB_CPU_CLONES(ret, name, params, args)                               \
  [[gnu::always_inline]] inline ret name##_body params;                            \
  [[gnu::target("avx512f")]] ret name##_avx512 params { return name##_body args; } \
  [[gnu::target("avx2")]] ret name##_avx2 params { return name##_body args; }      \
  ret name##_baseline params { return name##_body args; }                          \
  ret name params {                                                                \
    switch (::shardlab::cpu::kernel_isa()) {                                       \
      case ::shardlab::cpu::Isa::avx512:                                           \
        return name##_avx512 args;                                                 \
      case ::shardlab::cpu::Isa::avx2:                                             \
        return name##_avx2 args;                                                   \
      case ::shardlab::cpu::Isa::baseline:                                         \
        break;                                                                     \
    }                                                                              \
    return name##_baseline args;                                                   \
  }                                                                                \
  [[gnu::always_inline]] inline ret name##_body params
