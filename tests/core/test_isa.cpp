// tests/core/test_isa.cpp: the CPU kernels compiled per instruction set give the same bits under every
// set this processor runs, and SHARDLAB_CPU_ISA's requests are checked.
#include <cmath>
#include <limits>
#include <vector>

#include "core/cpu/isa.h"
#include "tests/check.h"
#include "tests/core/runnable_isas.h"

using namespace shardlab;
using cpu::Isa;

namespace {

// Restores the instruction set in use when the test ends, failed or not.
struct KeepKernelIsa {
  Isa saved = cpu::kernel_isa();
  ~KeepKernelIsa() { cpu::set_kernel_isa(saved); }
};

// Every multi-versioned kernel's output on inputs with full vectors of every width and a tail
// (1037 = 16 * 64 + 13), as raw values: compared with ==, a single flipped bit fails.
std::vector<std::vector<double>> outputs_of_every_clone() {
  std::vector<std::vector<double>> out;
  const Tensor row = test::random_tensor({3, 1037}, 41, DType::f32, -3.0, 3.0);
  out.push_back(test::values(sum(row, {1})));
  out.push_back(test::values(sum_squares(row, {1})));
  const Tensor integers = mul(test::random_tensor({2, 1037}, 42, DType::f64, -1e6, 1e6), 1e12).to(DType::i64);
  out.push_back(test::values(max(integers, {1})));
  out.push_back(test::values(min(integers, {1})));
  out.push_back(test::values(bernoulli({5003}, RandomKey{7, 99}, 0.3, {}, 3)));
  const Tensor w = test::random_tensor({1037}, 43, DType::f32), m = zeros({1037}), v = zeros({1037});
  for (std::int64_t step = 1; step <= 2; ++step) {
    const AdamHyper h{.lr = 1e-2, .weight_decay = 0.1, .decoupled = step == 2, .step = step};
    adam_step(w, test::random_tensor({1037}, 44 + step, DType::f32), m, v, h);
  }
  for (const Tensor& t : {w, m, v}) out.push_back(test::values(t));
  const Tensor gate = test::random_tensor({1037}, 47, DType::f32, -100.0, 100.0);
  out.push_back(test::values(swiglu(gate, row.select(0, 0))));
  const SwigluGrads swiglu_grads = swiglu_backward(row.select(0, 1), gate, row.select(0, 2));
  for (const Tensor& t : {swiglu_grads.gate, swiglu_grads.up}) out.push_back(test::values(t));
  const RmsNormResult norm = rms_norm_forward(row, row.select(0, 0).narrow(0, 0, 1037), 1e-6);
  const RmsNormGrads norm_grads = rms_norm_backward(row, row, row.select(0, 1), norm.rstd);
  for (const Tensor& t : {norm.out, norm.rstd, norm_grads.x, norm_grads.weight})
    out.push_back(test::values(t));
  // Attention's exp, row max and row sum in their lanes: 70 keys (a tile and a tail), causal.
  const Tensor q = test::random_tensor({1, 2, 70, 16}, 48, DType::f32, -2.0, 2.0);
  const Tensor kv = test::random_tensor({1, 1, 70, 16}, 49, DType::f32, -2.0, 2.0);
  const AttentionResult attended = attention_forward(q, kv, kv, {.causal = true});
  for (const Tensor& t : {attended.out, attended.logsumexp}) out.push_back(test::values(t));
  // The rotary embedding both ways, rows of 2 x 40 (a vector of 16 or 8 and a tail per half).
  const Tensor heads = test::random_tensor({2, 37, 3, 80}, 50, DType::f32).transpose(1, 2);
  const Tensor cos = test::random_tensor({37, 80}, 51, DType::f32),
               sin = test::random_tensor({37, 80}, 52, DType::f32);
  for (const bool transpose : {false, true}) out.push_back(test::values(rotary(heads, cos, sin, transpose)));
  const Tensor image = test::random_tensor({2, 3, 18, 35}, 46, DType::f32);
  image.select(0, 0).select(0, 1).select(0, 5).select(0, 7).fill_(std::numeric_limits<float>::quiet_NaN());
  const MaxPool2dResult pooled = max_pool2d(image, {.kernel_size = 2});
  out.push_back(test::values(pooled.values));
  out.push_back(test::values(pooled.indices));
  return out;
}

// NaN == NaN here: the pooled NaN must sit where the baseline put it.
bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

}  // namespace

TEST_CASE("every instruction set's kernels give the baseline's bits", "[isa]") {
  const KeepKernelIsa keep;
  cpu::set_kernel_isa(Isa::baseline);
  const std::vector<std::vector<double>> baseline = outputs_of_every_clone();
  for (const Isa isa : test::runnable_isas()) {
    INFO(cpu::isa_name(isa));
    cpu::set_kernel_isa(isa);
    CHECK(cpu::kernel_isa() == isa);
    const std::vector<std::vector<double>> results = outputs_of_every_clone();
    for (std::size_t i = 0; i < results.size(); ++i) {
      INFO("output " << i);
      CHECK(same_bits(results[i], baseline[i]));
    }
  }
}

TEST_CASE("SHARDLAB_CPU_ISA requests are checked against the processor", "[isa]") {
  CHECK(cpu::requested_isa("", Isa::avx2) == Isa::avx2);
  CHECK(cpu::requested_isa("baseline", Isa::avx512) == Isa::baseline);
  CHECK(cpu::requested_isa("avx2", Isa::avx2) == Isa::avx2);
  CHECK(cpu::requested_isa("avx512", Isa::avx512) == Isa::avx512);
  CHECK_THROWS_ERROR(cpu::requested_isa("avx512", Isa::avx2),
                     "SHARDLAB_CPU_ISA=avx512: this processor runs at most avx2");
  CHECK_THROWS_ERROR(cpu::requested_isa("avx2", Isa::baseline),
                     "SHARDLAB_CPU_ISA=avx2: this processor runs at most baseline");
  CHECK_THROWS_ERROR(cpu::requested_isa("AVX2", Isa::avx512),
                     "SHARDLAB_CPU_ISA=AVX2: unknown instruction set (baseline, avx2 or avx512)");
  CHECK_THROWS_ERROR(cpu::requested_isa("sse4", Isa::avx512),
                     "SHARDLAB_CPU_ISA=sse4: unknown instruction set (baseline, avx2 or avx512)");
}

TEST_CASE("the kernels cannot be switched to a set the processor lacks", "[isa]") {
  const KeepKernelIsa keep;
  if (cpu::widest_isa() == Isa::avx512) {
    SUCCEED("this processor runs every set");
    return;
  }
  const Isa before = cpu::kernel_isa();
  CHECK_THROWS_ERROR(cpu::set_kernel_isa(Isa::avx512),
                     fmt::format("SHARDLAB_CPU_ISA=avx512: this processor runs at most {}",
                                 cpu::isa_name(cpu::widest_isa())));
  CHECK(cpu::kernel_isa() == before);
}
