// tests/core/test_dispatch.cpp: the per-device kernel tables: the CPU table is complete, and so is the
// CUDA one in a CUDA build (empty otherwise); which CUDA kernel each op takes (attention by dtype,
// device and head dim; elementwise ops by their operands' layout), answered without a GPU.
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/call_log.h"
#include "core/kernel_choice.h"
#include "core/kernels.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("the CPU table has a kernel for every entry", "[dispatch]") {
  const EntryCount count = count_entries(cpu_kernels());
  CHECK(count.entries >= 32);  // at least the 31 kernels and strided_heads the families declared at first
  CHECK(count.set == count.entries);
}

TEST_CASE(
    "rotary and attention read heads where they lie: the CPU's any rows, CUDA's 4-D ones that load in "
    "16 bytes",
    "[dispatch]") {
  const auto heads_of = [](DType type, std::int64_t heads, std::int64_t head) {  // split from [2, 5, H * D]
    return empty({2, 5, heads, head}, dtype(type)).transpose(1, 2);
  };
  const Tensor bf16_heads = heads_of(DType::bf16, 3, 64);
  CHECK(cpu_kernels().strided_heads(bf16_heads));
  CHECK(cuda_takes_heads_in_place(layout_of(bf16_heads)));
  // Columns in a stride: both copy.
  CHECK_FALSE(cpu_kernels().strided_heads(bf16_heads.transpose(2, 3)));
  CHECK_FALSE(cuda_takes_heads_in_place(layout_of(bf16_heads.transpose(2, 3))));
  // Half rows 12 elements apart cannot load 16 bytes at a time; f32 ones are read where they lie.
  CHECK_FALSE(cuda_takes_heads_in_place(layout_of(heads_of(DType::bf16, 3, 12))));
  CHECK(cuda_takes_heads_in_place(layout_of(heads_of(DType::f32, 3, 12))));
  // Not [B, H, T, D]: CUDA's kernels take it contiguous, the CPU's as it is.
  const Tensor rows = empty({5, 3, 64}, dtype(DType::bf16)).transpose(0, 1);
  CHECK(cpu_kernels().strided_heads(rows));
  CHECK_FALSE(cuda_takes_heads_in_place(layout_of(rows)));
}

TEST_CASE("the CUDA table has a kernel for every entry when built with CUDA", "[dispatch]") {
  // Built without CUDA every entry is empty (and the ops say so, naming op and device).
  const bool built = supports<&Kernels::fill>(Device::cuda(0));
  const EntryCount count = count_entries(cuda_kernels());
  CHECK(count.set == (built ? count.entries : 0));
}

TEST_CASE("conv2d on cuda through the table: the CPU's values", "[dispatch][cuda]") {
  const Tensor x = test::random_tensor({1, 2, 5, 5}, 1), w = test::random_tensor({3, 2, 3, 3}, 2);
  if (supports<&Kernels::conv2d>(Device::cuda(0))) {
    test::check_close(conv2d(x.to(Device::cuda(0)), w.to(Device::cuda(0)), {}, {}).to(Device::cpu()),
                      conv2d(x, w, {}, {}));
  } else {
    CHECK_THROWS_ERROR(conv2d(x.to(Device::cuda(0)), w.to(Device::cuda(0)), {}, {}),
                       "conv2d: not supported on cuda:0 (no kernel for it in this build)");
  }
}

TEST_CASE("the attention kernel is a function of dtype, device and head dims", "[dispatch][attention]") {
  const Device gpu = Device::cuda(0), cpu = Device::cpu();
  // The seed and 1b Llamas' heads (64 and 64 wide) in bf16 on a GPU: flash attention.
  CHECK(attention_kernel(DType::bf16, gpu, 64, 64) == AttentionKernel::flash);
  CHECK(attention_kernel(DType::f16, gpu, 128, 128) == AttentionKernel::flash);
  // Head dims it is not built for, or q's and v's apart: the f32 kernel on widened operands.
  CHECK(attention_kernel(DType::bf16, gpu, 80, 80) == AttentionKernel::in_f32);
  CHECK(attention_kernel(DType::bf16, gpu, 64, 128) == AttentionKernel::in_f32);
  CHECK(attention_kernel(DType::bf16, cpu, 64, 64) == AttentionKernel::in_f32);
  for (const Device device : {cpu, gpu}) {
    CHECK(attention_kernel(DType::f32, device, 64, 64) == AttentionKernel::fused);
    CHECK(attention_kernel(DType::f64, device, 40, 24) == AttentionKernel::fused);
  }
}

TEST_CASE("an elementwise op's CUDA kernel: packed for dense operands, strided otherwise",
          "[dispatch][elementwise]") {
  const auto kernel_of = [](std::initializer_list<const Tensor*> operands) {
    std::vector<OperandLayout> layouts;
    for (const Tensor* t : operands) layouts.push_back(layout_of(*t));
    return elementwise_kernel(elementwise_layout(layouts));
  };
  // A residual add of the seed Llama in bf16: dense operands, packed.
  const TensorOptions bf16{DType::bf16, Device::cpu()};
  const Tensor x = empty({4, 16, 48}, bf16), y = empty({4, 16, 48}, bf16), out = empty({4, 16, 48}, bf16);
  CHECK(kernel_of({&x, &y, &out}) == ElementwiseKernel::packed);
  // One element for all (a Scalar operand, expanded): still packed.
  const Tensor scale = empty({}, bf16).expand({4, 16, 48});
  CHECK(kernel_of({&x, &scale, &out}) == ElementwiseKernel::packed);
  // A cast f32 -> bf16 of a dense tensor, and a scalar (rank 0): packed.
  const Tensor wide = empty({4, 16, 48});
  CHECK(kernel_of({&wide, &out}) == ElementwiseKernel::packed);
  const Tensor one = empty({}, bf16), one_out = empty({}, bf16);
  CHECK(kernel_of({&one, &one_out}) == ElementwiseKernel::packed);
  // A view starting one element in is off 16 bytes; a transposed operand or a broadcast row needs
  // two dims; an output that is one element for all is never packed.
  const Tensor shifted = empty({3073}, bf16).narrow(0, 1, 3072), dense = empty({3072}, bf16);
  CHECK(kernel_of({&shifted, &dense}) == ElementwiseKernel::strided_32bit);
  const Tensor square = empty({48, 48}, bf16), square_out = empty({48, 48}, bf16);
  const Tensor transposed = square.transpose(0, 1);
  CHECK(kernel_of({&transposed, &square_out}) == ElementwiseKernel::strided_32bit);
  const Tensor bias = empty({48}, bf16).expand({64, 48}), rows = empty({64, 48}, bf16);
  CHECK(kernel_of({&rows, &bias, &rows}) == ElementwiseKernel::strided_32bit);
  const Tensor broadcast_out = empty({1}, bf16).expand({64});
  const Tensor column = empty({64}, bf16);
  CHECK(kernel_of({&column, &broadcast_out}) == ElementwiseKernel::strided_32bit);
}

TEST_CASE("elementwise index math is 32-bit below 2^31 elements and offsets, 64-bit beyond",
          "[dispatch][elementwise]") {
  const std::int64_t limit = std::numeric_limits<std::int32_t>::max();
  // Dense and aligned, 2^31 - 1 elements: packed; one more: strided with 64-bit indices.
  ElementwiseLayout layout = elementwise_layout({limit}, {{1}, {1}}, {256, 512});
  CHECK(layout.sizes == std::vector<std::int64_t>{limit});
  CHECK(elementwise_kernel(layout) == ElementwiseKernel::packed);
  CHECK(elementwise_kernel(elementwise_layout({limit + 1}, {{1}, {1}}, {256, 512})) ==
        ElementwiseKernel::strided_64bit);
  // Few elements, but an operand whose farthest element is 2^31 away.
  const std::int64_t wide_stride = (std::int64_t{1} << 30) + 1;  // 2 steps: 2^31 + 2
  layout = elementwise_layout({4, 3}, {{1, wide_stride}, {3, 1}}, {0, 0});
  CHECK(layout.sizes.size() == 2);
  CHECK(!layout.narrow_index);
  CHECK(elementwise_kernel(layout) == ElementwiseKernel::strided_64bit);
  // Merging: [2, 3, 4] dense in both operands is one dim of 24.
  layout = elementwise_layout({2, 3, 4}, {{12, 4, 1}, {12, 4, 1}}, {16, 32});
  CHECK(layout.sizes == std::vector<std::int64_t>{24});
  CHECK(layout.packed);
}

// --- a bf16 Llama step on CUDA ----------------------------------------------------------------------

namespace {

// The kernel calls `fn` makes, each with the CUDA kernel it would take.
struct Taken {
  std::string op, kernel;
  bool naive;
};
template <typename Fn>
std::vector<Taken> kernels_taken(Fn&& fn) {
  std::vector<Taken> taken;
  for (const call_log::Call& call : call_log::calls_of(fn)) {
    const KernelChoice choice = cuda_kernel_choice(call.op, call.operands);
    taken.push_back({call.op, choice.kernel, choice.naive});
  }
  return taken;
}

// Checks the calls are (op, kernel) in order, none naive.
void check_taken(const std::vector<Taken>& taken,
                 const std::vector<std::pair<std::string, std::string>>& expected) {
  std::string calls;
  for (const Taken& t : taken) calls += t.op + " (" + t.kernel + (t.naive ? ", naive" : "") + ") ";
  INFO("the calls: " << calls);
  REQUIRE(taken.size() == expected.size());
  for (std::size_t i = 0; i < taken.size(); ++i) {
    INFO("call " << i << ": " << taken[i].op << " takes " << taken[i].kernel);
    CHECK(taken[i].op == expected[i].first);
    CHECK(taken[i].kernel == expected[i].second);
    CHECK(!taken[i].naive);
  }
}

const std::string kPacked = "packed", kStrided = "strided (32-bit index)";
const std::string kIndexCheck = "index range check, read at the next host wait";
const std::string kOneGemm = "one cuBLAS GEMM", kFoldedGemm = "one cuBLAS GEMM over the batch's rows";

}  // namespace

// The seed Llama's widths (hidden 768, 12 query heads and 3 KV heads of 64, MLP 3072, vocabulary 50000)
// with few tokens (B 2, T 8): every choice below is the same at T 512, B 64, whose largest tensor (the
// logits' gradient, 1.6e9 elements) stays under 2^31. Each op is called as autograd's Llama calls it,
// on the CPU, and the call log says what a GPU would run.
TEST_CASE("every kernel of a bf16 seed-Llama step on CUDA, and none naive", "[dispatch][llama]") {
  const std::int64_t batch = 2, length = 8, hidden = 768, heads = 12, kv_heads = 3, head = 64, mlp = 3072;
  const std::int64_t vocab = 50000;
  const TensorOptions bf16{DType::bf16, Device::cpu()};
  const auto values = [&](const Shape& shape, std::uint64_t seed) {
    return test::random_tensor(shape, seed).to(DType::bf16);
  };
  const Tensor x = values({batch, length, hidden}, 1), norm_weight = values({hidden}, 2);
  const Tensor w_q = values({hidden, hidden}, 3), w_gate = values({mlp, hidden}, 4),
               w_down = values({hidden, mlp}, 5);

  SECTION("forward: embedding, norm, projections, rotary, attention, MLP, residuals, loss") {
    const Tensor tokens =
        from_vector<std::int64_t>(std::vector<std::int64_t>(batch * length, 7), {batch, length});
    const Tensor table = empty({vocab, hidden}, bf16);
    check_taken(kernels_taken([&] { (void)embedding(table, tokens); }),
                {{"check_index", kIndexCheck}, {"embedding", "row gather"}});
    check_taken(kernels_taken([&] { (void)rms_norm_forward(x, norm_weight, 1e-6); }),
                {{"rms_norm", "a block per row"}});
    check_taken(kernels_taken([&] { (void)add_rms_norm_forward(x, x, norm_weight, 1e-6); }),
                {{"add_rms_norm", "a block per row, the residual add's sum written on the way"}});
    // A Linear: x [B, T, in] times the weight's transpose, one GEMM over the B * T rows.
    check_taken(kernels_taken([&] { (void)matmul(x, w_q.transpose(0, 1)); }), {{"matmul", kFoldedGemm}});
    // With a bias (the Llama's Linears have none; most others do), it rides in the GEMM's epilogue.
    check_taken(kernels_taken([&] { (void)linear(x, w_q, norm_weight); }),
                {{"linear", std::string(kFoldedGemm) + ", the bias in cuBLASLt's epilogue"}});
    // Heads split as views of the projections' [B, T, H * D] outputs, which rotary and attention read
    // where they lie, on both devices: no copies.
    const auto split_heads = [&](const Tensor& projected, std::int64_t count) {
      return projected.reshape({batch, length, count, head}).transpose(1, 2);
    };
    const Tensor q = split_heads(x, heads);
    const Tensor cos = values({length, head}, 6), sin = values({length, head}, 7);
    check_taken(kernels_taken([&] { (void)rotary(q, cos, sin); }),
                {{"rotary_embedding", "fused elementwise over (T, D) tables"}});
    const Tensor k = split_heads(values({batch, length, kv_heads * head}, 9), kv_heads);
    const Tensor v = split_heads(values({batch, length, kv_heads * head}, 10), kv_heads);
    const std::string flash = "flash attention (mma.sync tensor cores, K/V tiles in shared memory)";
    check_taken(kernels_taken([&] { (void)attention_forward(q, k, v, {.causal = true}); }),
                {{"attention_forward", flash}});
    // Heads merged back for o_proj: CUDA's output lies as q did, [B, T, H, D] (test_cuda_attention.cpp
    // checks it on a GPU), so this is a view.
    const Tensor out = empty_in_layout_of(q, q.shape(), bf16);
    check_taken(kernels_taken([&] { (void)out.transpose(1, 2).contiguous(); }), {});
    check_taken(kernels_taken([&] { (void)add(x, x); }), {{"add", kPacked}});
    const Tensor gate = values({batch, length, mlp}, 11);
    check_taken(kernels_taken([&] { (void)matmul(x, w_gate.transpose(0, 1)); }), {{"matmul", kFoldedGemm}});
    check_taken(kernels_taken([&] { (void)swiglu(gate, gate); }),
                {{"swiglu", "fused elementwise, 16-byte packs"}});
    check_taken(kernels_taken([&] { (void)matmul(gate, w_down.transpose(0, 1)); }),
                {{"matmul", kFoldedGemm}});
    const Tensor logits = values({batch * length, 1000}, 12);
    const Tensor targets = from_vector<std::int64_t>(std::vector<std::int64_t>(batch * length, 3));
    // The bf16 logits as they are (no f32 copy): the losses come in f32.
    CrossEntropyResult loss;
    check_taken(kernels_taken([&] { loss = cross_entropy_forward(logits, targets, -100); }),
                {{"fill", kPacked},
                 {"ne", kPacked},
                 {"fill", kPacked},
                 {"where", kPacked},
                 {"check_index", kIndexCheck},
                 {"cross_entropy", "a block per row, online logsumexp over the vocabulary"}});
    check_taken(kernels_taken([&] { (void)sum(loss.losses); }), {{"sum", "a block per output"}});
  }

  SECTION("backward: loss, projections' two gradients, MLP, attention, rotary, norm, embedding") {
    const Tensor logits = values({batch * length, 1000}, 12);
    const Tensor targets = from_vector<std::int64_t>(std::vector<std::int64_t>(batch * length, 3));
    const CrossEntropyResult loss = cross_entropy_forward(logits, targets, -100);
    const Tensor ones_losses = ones({batch * length}, TensorOptions{DType::f32, Device::cpu()});
    check_taken(kernels_taken([&] {
                  (void)cross_entropy_backward(ones_losses, logits, targets, -100, loss.logsumexp);
                }),
                {{"cross_entropy_backward", "elementwise from the saved logsumexp, 16-byte packs"}});
    // dX = dY W over the batch's rows; dW = dY^T X as one GEMM over the flattened batch (2-D).
    check_taken(kernels_taken([&] { (void)matmul(x, w_q); }), {{"matmul", kFoldedGemm}});
    const Tensor rows = x.reshape({batch * length, hidden});
    check_taken(kernels_taken([&] { (void)matmul(rows.transpose(0, 1), rows); }), {{"matmul", kOneGemm}});
    const Tensor gate = values({batch, length, mlp}, 11);
    check_taken(kernels_taken([&] { (void)swiglu_backward(gate, gate, gate); }),
                {{"swiglu_backward", "fused elementwise, 16-byte packs"}});
    const RmsNormResult norm = rms_norm_forward(x, norm_weight, 1e-6);
    check_taken(kernels_taken([&] { (void)rms_norm_backward(x, x, norm_weight, norm.rstd); }),
                {{"rms_norm_backward", "a block per row; the weight gradient in two-pass column sums"}});
    // The heads as the forward split them, and the output's gradient as o_proj's backward leaves it.
    const auto split_heads = [&](const Tensor& projected, std::int64_t count) {
      return projected.reshape({batch, length, count, head}).transpose(1, 2);
    };
    const Tensor q = split_heads(x, heads),
                 k = split_heads(values({batch, length, kv_heads * head}, 9), kv_heads);
    const Tensor v = split_heads(values({batch, length, kv_heads * head}, 10), kv_heads);
    const AttentionResult attended = attention_forward(q, k, v, {.causal = true});
    const Tensor grad_out = split_heads(values({batch, length, hidden}, 8), heads);
    const std::string flash = "flash attention (mma.sync tensor cores, K/V tiles in shared memory)";
    check_taken(
        kernels_taken([&] { (void)attention_backward(grad_out, q, k, v, attended, {.causal = true}); }),
        {{"attention_backward", flash}});
    const Tensor cos = values({length, head}, 6), sin = values({length, head}, 7);
    check_taken(kernels_taken([&] { (void)rotary(q, cos, sin, /*transpose=*/true); }),
                {{"rotary_embedding", "fused elementwise over (T, D) tables"}});
    const Tensor tokens =
        from_vector<std::int64_t>(std::vector<std::int64_t>(batch * length, 7), {batch, length});
    check_taken(kernels_taken([&] { (void)embedding_backward(x, tokens, vocab); }),
                {{"check_index", kIndexCheck},
                 {"fill", kPacked},
                 {"embedding_backward", "sorted segments (CUB radix sort), each row's picks in order"}});
  }

  SECTION("FSDP and the optimizer: casts, the gradient norm, clipping, AdamW, zeroing") {
    const Tensor grad = values({mlp, hidden}, 13), master = test::random_tensor({mlp, hidden}, 14);
    check_taken(kernels_taken([&] { (void)grad.to(DType::f32); }), {{"cast", kPacked}});
    check_taken(kernels_taken([&] { (void)master.to(DType::bf16); }), {{"cast", kPacked}});
    const std::vector<Tensor> grads = {master, test::random_tensor({hidden}, 15)};
    check_taken(
        kernels_taken([&] { (void)foreach_sum_squares(grads); }),  // no fill: the kernel writes the sum
        {{"foreach_sum_squares", "one launch for all tensors: a block per chunk, then a fixed-order fold"}});
    const Tensor factor = scalar_tensor(0.5, dtype(DType::f32));
    check_taken(kernels_taken([&] { (void)mul(master, factor); }), {{"mul", kPacked}});
    const Tensor param = master.clone(), exp_avg = zeros_like(master), exp_avg_sq = zeros_like(master);
    const Tensor copy = empty({mlp, hidden}, bf16);
    check_taken(kernels_taken([&] {
                  adam_step(param, master, exp_avg, exp_avg_sq, {.weight_decay = 0.1, .decoupled = true},
                            copy);
                }),
                {{"adam_step", "multi-tensor: one launch per dtype"}});
    check_taken(kernels_taken([&] { (void)master.fill_(0.0); }), {{"fill", kPacked}});
  }
}
