// apps/bench_ops: GEMM and conv2d throughput of shardlab's kernels next to OpenBLAS's own
// sgemm on the same shapes (and CUDA next to it when a GPU and a kernel exist), one table; then
// what the thread pool costs a parallel_for with nothing to do; then fused attention against the
// composed one on the CPU, forward and backward; then the Llama block's fused ops on the CPU, forward
// and backward apart (bench/torch_llama_ops.py adds PyTorch's own); with a GPU, flash attention at
// the GPU Llamas' shapes (bench/torch_gpu_attention.py adds PyTorch's).
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "apps/cli.h"
#include "autograd/functional.h"
#include "core/cuda/runtime.h"
#include "core/kernels.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/random.h"

using namespace shardlab;

namespace {

// Seconds of one run of fn, then `sync` (which waits for asynchronous devices).
double seconds(const std::function<void()>& fn, const std::function<void()>& sync) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  sync();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

// Median seconds per call of fn over `reps` samples, after a warm-up call. Each sample
// repeats the call enough times to last about 20 ms: short calls are otherwise all noise
// on a VM.
double measure(int reps, const std::function<void()>& fn, const std::function<void()>& sync) {
  const double once = seconds(fn, sync);
  const int calls = static_cast<int>(std::clamp(0.02 / std::max(once, 1e-7), 1.0, 10000.0));
  std::vector<double> times;
  for (int sample = 0; sample < reps; ++sample) {
    times.push_back(seconds(
                        [&] {
                          for (int i = 0; i < calls; ++i) fn();
                        },
                        sync) /
                    calls);
  }
  return median(times);
}

// Which operands of a GEMM are read transposed: stored [k, m] for A, [n, k] for B.
struct Transposes {
  bool a = false, b = false;
};

// OpenBLAS sgemm on row-major [m, k] x [k, n] (either stored transposed) into a preallocated C:
// the baseline.
std::function<void()> openblas_sgemm(std::int64_t m, std::int64_t n, std::int64_t k, Transposes t) {
  auto a = std::make_shared<Tensor>(uniform({m, k}, {1, 1}));
  auto b = std::make_shared<Tensor>(uniform({k, n}, {1, 2}));
  auto c = std::make_shared<Tensor>(empty({m, n}));
  const auto i = [](std::int64_t v) { return static_cast<int>(v); };
  return [=] {
    cblas_sgemm(CblasRowMajor, t.a ? CblasTrans : CblasNoTrans, t.b ? CblasTrans : CblasNoTrans, i(m), i(n),
                i(k), 1.0f, a->data<float>(), i(t.a ? m : k), b->data<float>(), i(t.b ? k : n), 0.0f,
                c->data<float>(), i(n));
  };
}

// One table row: shardlab's op on a device, and the GEMM it amounts to.
struct Row {
  std::string name;
  double flops;
  std::function<std::function<void()>(Device)> prepare;  // inputs made once, op run per call
  std::int64_t m, n, k;
  Transposes transposes{};
};

// Seconds per call of ours on the CPU, OpenBLAS on the same GEMM shape, and ours on CUDA.
struct Timing {
  double ours = 0, openblas = 0, cuda = 0;
};

void print_row(const Row& row, const Timing& t) {
  const std::string cuda_column = t.cuda > 0 ? fmt::format("{:.1f}", row.flops / t.cuda / 1e9) : "-";
  fmt::print("{:<64} {:>12.1f} {:>14.1f} {:>8.2f} {:>14}\n", row.name, row.flops / t.ours / 1e9,
             row.flops / t.openblas / 1e9, t.openblas / t.ours, cuda_column);
}

// matmul [m, k] x [k, n]; a transposed operand is a transposed view of a contiguous tensor, as a
// Linear's weight is in its forward (B) and its gradient's input in the weight gradient (A).
Row gemm_row(std::int64_t m, std::int64_t n, std::int64_t k, Transposes t = {},
             const std::string& label = "") {
  return {fmt::format("matmul [{}, {}]{} x [{}, {}]{}{}", m, k, t.a ? "^T" : "", k, n, t.b ? "^T" : "",
                      label.empty() ? "" : " " + label),
          2.0 * m * n * k,
          [=](Device d) -> std::function<void()> {
            const Tensor a = t.a ? uniform({k, m}, {7, 1}, -1, 1, device(d)).transpose(0, 1)
                                 : uniform({m, k}, {7, 1}, -1, 1, device(d));
            const Tensor b = t.b ? uniform({n, k}, {7, 2}, -1, 1, device(d)).transpose(0, 1)
                                 : uniform({k, n}, {7, 2}, -1, 1, device(d));
            return [a, b] { (void)matmul(a, b); };
          },
          m,
          n,
          k,
          t};
}

// The three GEMMs of a Linear(in, out) on `rows` input rows: forward x W^T, input gradient
// dY W, weight gradient dY^T X.
void add_linear_rows(std::vector<Row>& rows, const std::string& label, std::int64_t tokens, std::int64_t in,
                     std::int64_t out) {
  rows.push_back(gemm_row(tokens, out, in, {.b = true}, label));
  rows.push_back(gemm_row(tokens, in, out, {}, label + " grad input"));
  rows.push_back(gemm_row(out, in, tokens, {.a = true}, label + " grad weight"));
}

// Which of conv2d's three GEMMs a row times.
enum class ConvPass { forward, backward_input, backward_weight };

Row conv_row(const std::string& label, Shape input, Shape weight, Conv2dParams p,
             ConvPass pass = ConvPass::forward) {
  const std::int64_t oh = (input[2] + 2 * p.padding - weight[2]) / p.stride + 1;
  const std::int64_t ow = (input[3] + 2 * p.padding - weight[3]) / p.stride + 1;
  const std::int64_t patch = weight[1] * weight[2] * weight[3], columns = input[0] * oh * ow;
  const Shape output{input[0], weight[0], oh, ow};
  const char* suffix = pass == ConvPass::forward          ? ""
                       : pass == ConvPass::backward_input ? " grad input"
                                                          : " grad weight";
  // The GEMM each pass amounts to: O x columns x patch, patch x columns x O, O x patch x columns.
  const std::int64_t m = pass == ConvPass::backward_input ? patch : weight[0];
  const std::int64_t n = pass == ConvPass::backward_weight ? patch : columns;
  const std::int64_t k = pass == ConvPass::forward          ? patch
                         : pass == ConvPass::backward_input ? weight[0]
                                                            : columns;
  return {fmt::format("conv2d {} {} * {}{}", label, shape_str(input), shape_str(weight), suffix),
          2.0 * weight[0] * patch * columns,
          [=](Device d) -> std::function<void()> {
            const Tensor x = uniform(input, {9, 1}, -1, 1, device(d));
            const Tensor w = uniform(weight, {9, 2}, -1, 1, device(d));
            const Tensor g = uniform(output, {9, 3}, -1, 1, device(d));
            switch (pass) {
              case ConvPass::forward:
                return [x, w, p] { (void)conv2d(x, w, {}, p); };
              case ConvPass::backward_input:
                return [g, w, input, p] { (void)conv2d_backward_input(g, w, input, p); };
              case ConvPass::backward_weight:
                break;
            }
            return [g, x, weight, p] { (void)conv2d_backward_weight(g, x, weight, p); };
          },
          m,
          n,
          k};
}

// The pool's own cost in seconds: an empty parallel_for over every thread, back to back (the workers
// spinning for the next task) and after 1 ms of idle (asleep: woken through the kernel).
struct PoolCost {
  double back_to_back = 0, after_idle = 0;
};

PoolCost measure_thread_pool(int reps) {
  const auto empty_call = [] { parallel_for(0, num_threads(), 1, [](std::int64_t, std::int64_t) {}); };
  const auto none = [] {};
  PoolCost cost{.back_to_back = measure(reps, empty_call, none)};
  std::vector<double> after_idle;
  for (int sample = 0; sample < 20 * reps; ++sample) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    after_idle.push_back(seconds(empty_call, none));
  }
  cost.after_idle = median(after_idle);
  return cost;
}

void print_thread_pool(const PoolCost& cost) {
  if (num_threads() < 2) {
    fmt::print("thread pool: 1 thread, no workers to wake\n");
    return;
  }
  fmt::print(
      "thread pool: an empty parallel_for over {} threads {:.2f} us back to back, {:.2f} us after 1 ms "
      "idle\n",
      num_threads(), 1e6 * cost.back_to_back, 1e6 * cost.after_idle);
}

using AttentionPath = Variable (*)(const Variable&, const Variable&, const Variable&,
                                   const AttentionOptions&);

// Forward and backward of an attention path on the Llama's shape: causal, padding at the end of
// every other sequence.
std::function<void()> attention_step(AttentionPath path) {
  const std::int64_t batch = 16, heads = 8, kv_heads = 2, length = 256, head_dim = 32;
  const Tensor q = uniform({batch, heads, length, head_dim}, {13, 1}, -1, 1);
  const Tensor k = uniform({batch, kv_heads, length, head_dim}, {13, 2}, -1, 1);
  const Tensor v = uniform({batch, kv_heads, length, head_dim}, {13, 3}, -1, 1);
  std::vector<std::int64_t> lengths;
  for (std::int64_t b = 0; b < batch; ++b) lengths.push_back(b % 2 == 0 ? length : length - 48);
  const Tensor padded = ge(arange(length).unsqueeze(0), from_vector<std::int64_t>(lengths, {batch, 1}));
  const AttentionOptions options{.causal = true, .padding = padded};
  return [=] {
    const Variable qv(q, true), kv(k, true), vv(v, true);
    sum(path(qv, kv, vv, options)).backward();
  };
}

// Fused against composed attention: medians over `reps` rounds that each time one call of both
// back to back, so that a busy machine slows both alike; the ratio is the median of the rounds'.
void print_attention(int reps) {
  const std::function<void()> fused = attention_step(detail::fused_attention);
  const std::function<void()> composed = attention_step(detail::naive_attention);
  const auto none = [] {};
  seconds(fused, none);  // warm-up
  seconds(composed, none);
  std::vector<double> fused_ms, composed_ms, ratios;
  for (int round = 0; round < reps; ++round) {
    fused_ms.push_back(1e3 * seconds(fused, none));
    composed_ms.push_back(1e3 * seconds(composed, none));
    ratios.push_back(composed_ms.back() / fused_ms.back());
  }
  fmt::print(
      "attention forward+backward, q [16, 8, 256, 32], k/v [16, 2, 256, 32] f32, causal, padding: "
      "fused {:.1f} ms, composed {:.1f} ms (medians), composed / fused {:.2f}\n",
      median(fused_ms), median(composed_ms), median(ratios));
}

// One of the Llama block's fused ops at the benchmark's shapes, its forward and backward apart.
struct BlockOp {
  std::string name;
  std::function<void()> forward, backward;
};

// bench/llama_h256_l4.json at T256 B16, the operands laid out as the Llama makes them: q, k and v
// heads split from their projections' [B, T, H * D], the gradients of attention's output likewise.
std::vector<BlockOp> llama_block_ops() {
  const std::int64_t batch = 16, length = 256, heads = 8, kv_heads = 2, head_dim = 32, hidden = 256,
                     mlp = 1024;
  const auto heads_of = [&](std::int64_t count, std::uint64_t stream) {
    return uniform({batch, length, count * head_dim}, {19, stream}, -1, 1)
        .reshape({batch, length, count, head_dim})
        .transpose(1, 2);
  };
  const Tensor q = heads_of(heads, 1), k = heads_of(kv_heads, 2), v = heads_of(kv_heads, 3);
  const Tensor grad_out = heads_of(heads, 4);
  std::vector<std::int64_t> lengths;
  for (std::int64_t b = 0; b < batch; ++b) lengths.push_back(b % 2 == 0 ? length : length - 48);
  const AttentionParams params{
      .causal = true,
      .padding = ge(arange(length).unsqueeze(0), from_vector<std::int64_t>(lengths, {batch, 1}))};
  const AttentionResult attended = attention_forward(q, k, v, params);
  const Tensor gate = uniform({batch, length, mlp}, {19, 5}, -4, 4),
               up = uniform({batch, length, mlp}, {19, 6}, -1, 1);
  const Tensor grad_product = uniform({batch, length, mlp}, {19, 7}, -1, 1);
  const Tensor x = uniform({batch, length, hidden}, {19, 8}, -1, 1),
               weight = uniform({hidden}, {19, 9}, 0.5, 1.5);
  const Tensor grad_normed = uniform({batch, length, hidden}, {19, 10}, -1, 1);
  const RmsNormResult normed = rms_norm_forward(x, weight, 1e-5);
  return {
      {"attention q [16, 8, 256, 32] k/v [16, 2, 256, 32] causal padding",
       [=] { (void)attention_forward(q, k, v, params); },
       [=] { (void)attention_backward(grad_out, q, k, v, attended, params); }},
      {"swiglu [16, 256, 1024]", [=] { (void)swiglu(gate, up); },
       [=] { (void)swiglu_backward(grad_product, gate, up); }},
      {"rms_norm [16, 256, 256]", [=] { (void)rms_norm_forward(x, weight, 1e-5); },
       [=] { (void)rms_norm_backward(grad_normed, x, weight, normed.rstd); }},
  };
}

void print_block_ops(int reps) {
  const auto none = [] {};
  for (const BlockOp& op : llama_block_ops()) {
    fmt::print("block op {}: forward {:.3f} ms, backward {:.3f} ms\n", op.name,
               1e3 * measure(reps, op.forward, none), 1e3 * measure(reps, op.backward, none));
  }
}

// Flash attention in bf16 on the GPU at the shapes of bench/gpu_speed.py's Llamas (the seed: T 512,
// B 64, 12 heads over 3; 1b: T 2048, B 4, 32 over 4; heads of 64), causal, q, k, v and the output's
// gradient split from [B, T, H * D] projections as the Llama makes them. TFLOP/s by FlashAttention's
// count: 4 B H T^2 D / 2 forward (causal: half the pairs), 2.5 times that backward.
void print_gpu_attention(int reps) {
  struct Config {
    const char* name;
    std::int64_t batch, length, heads, kv_heads;
  };
  constexpr std::int64_t kHeadDim = 64;
  cuda::Stream& stream = cuda::current_stream(0);
  const auto sync = [&] { stream.synchronize(); };
  for (const Config& c : {Config{"seed", 64, 512, 12, 3}, Config{"1b", 4, 2048, 32, 4}}) {
    const auto heads_of = [&](std::int64_t count, std::uint64_t stream_id) {
      return uniform({c.batch, c.length, count * kHeadDim}, {23, stream_id}, -1, 1,
                     TensorOptions{DType::bf16, Device::cuda(0)})
          .reshape({c.batch, c.length, count, kHeadDim})
          .transpose(1, 2);
    };
    const Tensor q = heads_of(c.heads, 1), k = heads_of(c.kv_heads, 2), v = heads_of(c.kv_heads, 3);
    const Tensor grad_out = heads_of(c.heads, 4);
    const AttentionParams params{.causal = true};
    const AttentionResult attended = attention_forward(q, k, v, params);
    const double forward = measure(reps, [&] { (void)attention_forward(q, k, v, params); }, sync);
    const double backward =
        measure(reps, [&] { (void)attention_backward(grad_out, q, k, v, attended, params); }, sync);
    const double flops = 4.0 * static_cast<double>(c.batch * c.heads * c.length * c.length * kHeadDim) / 2;
    fmt::print(
        "gpu attention {} bf16 q [{}, {}, {}, {}] k/v [{}, {}, {}, {}] causal: forward {:.3f} ms ({:.1f} "
        "TFLOP/s), backward {:.3f} ms ({:.1f} TFLOP/s)\n",
        c.name, c.batch, c.heads, c.length, kHeadDim, c.batch, c.kv_heads, c.length, kHeadDim, 1e3 * forward,
        flops / forward / 1e12, 1e3 * backward, 2.5 * flops / backward / 1e12);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_ops: GEMM and conv2d GFLOP/s of shardlab next to OpenBLAS sgemm"};
  int reps = 10;
  int threads = 0;
  std::string device = "auto";
  app.add_option("--reps", reps, "timed rounds per row (medians reported)")->check(apps::integer_at_least(1));
  app.add_option("--threads", threads, "CPU threads (default: the cores this process has)")
      ->check(apps::integer_at_least(0));
  app.add_option("--device", device,
                 "the CUDA column: auto (where a GPU answers), cuda (required) or cpu (left out)")
      ->check(apps::one_of({"auto", "cpu", "cuda"}));
  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "bench_ops", true))
    return *status;
  try {
    if (threads > 0) set_num_threads(threads);
    const DeviceChoice choice = parse_device_choice(device);
    const bool with_cuda = device_for(choice).is_cuda();
    fmt::print("bench_ops: {} CPU threads; CUDA: {}\n", num_threads(),
               with_cuda                     ? "available"
               : choice == DeviceChoice::cpu ? "left out (--device cpu)"
                                             : cuda::unavailable_reason());
    fmt::print("{:<64} {:>12} {:>14} {:>8} {:>14}\n", "op (f32)", "ours GFLOP/s", "OpenBLAS GF/s", "ratio",
               "CUDA GFLOP/s");
    std::vector<Row> rows = {
        gemm_row(256, 256, 256),
        gemm_row(512, 512, 512),
        gemm_row(1024, 1024, 1024),
        gemm_row(2048, 512, 2048),
        gemm_row(64, 128, 9216),
        conv_row("mnist conv1", {64, 1, 28, 28}, {32, 1, 3, 3}, {}),
        conv_row("mnist conv2", {64, 32, 26, 26}, {64, 32, 3, 3}, {}),
        // A rank's share of the CNN's global batch of 64 at 2 ranks, all three passes.
        conv_row("mnist conv2", {32, 32, 26, 26}, {64, 32, 3, 3}, {}),
        conv_row("mnist conv2", {32, 32, 26, 26}, {64, 32, 3, 3}, {}, ConvPass::backward_input),
        conv_row("mnist conv2", {32, 32, 26, 26}, {64, 32, 3, 3}, {}, ConvPass::backward_weight),
        conv_row("resnet 3x3", {8, 64, 56, 56}, {64, 64, 3, 3}, {1, 1}),
        conv_row("stride 2", {8, 64, 56, 56}, {128, 64, 3, 3}, {2, 1}),
    };
    // bench/llama_h256_l4.json at --seq 256 --global-batch 16: 4096 tokens a step, hidden 256,
    // 8 query and 2 key/value heads of 32, MLP 1024, vocabulary 259.
    add_linear_rows(rows, "llama q/o", 4096, 256, 256);
    add_linear_rows(rows, "llama k/v", 4096, 256, 64);
    add_linear_rows(rows, "llama gate/up", 4096, 256, 1024);
    add_linear_rows(rows, "llama down", 4096, 1024, 256);
    add_linear_rows(rows, "llama head", 4096, 256, 259);
    std::vector<Timing> timings(rows.size());
    // OpenBLAS starts its threads when it loads, and they spin-wait (sched_yield) on the cores
    // shardlab's pool runs on: one thread until its own turn below.
    openblas_set_num_threads(1);
    for (std::size_t i = 0; i < rows.size(); ++i)
      timings[i].ours = measure(reps, rows[i].prepare(Device::cpu()), [] {});
    // Before OpenBLAS's threads wake: spinning after its calls, they would take the pool's cores.
    const PoolCost pool = measure_thread_pool(reps);
    if (with_cuda && supports<&Kernels::matmul>(Device::cuda(0)) &&
        supports<&Kernels::conv2d>(Device::cuda(0))) {
      cuda::Stream& stream = cuda::current_stream(0);
      for (std::size_t i = 0; i < rows.size(); ++i) {
        timings[i].cuda = measure(reps, rows[i].prepare(Device::cuda(0)), [&] { stream.synchronize(); });
      }
    }
    // The baseline last, with OpenBLAS's own threads: they spin after each call, which would slow
    // the other measurements if they were interleaved.
    openblas_set_num_threads(num_threads());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      timings[i].openblas =
          measure(reps, openblas_sgemm(rows[i].m, rows[i].n, rows[i].k, rows[i].transposes), [] {});
    }
    openblas_set_num_threads(1);
    for (std::size_t i = 0; i < rows.size(); ++i) print_row(rows[i], timings[i]);
    fmt::print(
        "ratio = OpenBLAS time / ours on the same GEMM shape (conv: O x C*KH*KW x N*OH*OW); "
        "1.00 means parity\n");
    print_thread_pool(pool);
    print_attention(reps);
    print_block_ops(reps);
    if (with_cuda) print_gpu_attention(reps);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_ops: {}\n", e.what());
    return 1;
  }
  return 0;
}
