// tests/autograd/test_attention.cpp: scaled_dot_product_attention's fused and composed paths:
// finite-difference gradients, the two paths against each other, padding, documents (each as if
// alone), queries that see no key, a closed form, which path runs, and the errors.
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd/functional.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"
#include "core/parallel.h"
#include "tests/check.h"
#include "tests/cuda_compare.h"

using namespace shardlab;
using test::check_close;
using test::check_equal;
using test::values;

namespace {

using AttentionPath = Variable (*)(const Variable&, const Variable&, const Variable&,
                                   const AttentionOptions&);

// bool [B, S]: sequence b has lengths[b] tokens followed by padding.
Tensor padding_after(const std::vector<std::int64_t>& lengths, std::int64_t keys) {
  const Tensor positions = arange(keys).unsqueeze(0);
  return ge(positions, from_vector<std::int64_t>(lengths).unsqueeze(1));
}

Variable leaf(const Shape& shape, std::uint64_t seed) {
  return Variable(test::random_tensor(shape, seed, DType::f64), true);
}

void check_gradients(const std::string& what, AttentionPath path, const AttentionOptions& options,
                     const std::vector<Variable>& qkv) {
  const GradcheckResult result =
      gradcheck([&](const std::vector<Variable>& x) { return path(x[0], x[1], x[2], options); }, qkv);
  INFO(what << ": " << result.report);
  CHECK(result.ok);
}

// The output and the gradients of sum(out * weights) with respect to q, k and v.
struct Run {
  Tensor out, grad_q, grad_k, grad_v;
};

Run run(AttentionPath path, const Tensor& q, const Tensor& k, const Tensor& v,
        const AttentionOptions& options, const Tensor& weights) {
  const Variable qv(q, true), kv(k, true), vv(v, true);
  const Variable out = path(qv, kv, vv, options);
  sum(mul(out, constant(weights))).backward();
  return {out.data(), qv.grad(), kv.grad(), vv.grad()};
}

// bool [B, S] from 0/1 flags in row-major order.
Tensor padding_of(const std::vector<std::int64_t>& flags, Shape shape) {
  return ne(from_vector<std::int64_t>(flags, std::move(shape)), 0);
}

void check_zero(const Tensor& t) {
  check_equal(t, std::vector<double>(static_cast<std::size_t>(t.numel()), 0.0));
}

void check_finite(const Tensor& t) {
  std::int64_t bad = 0;
  for (const double x : values(t)) bad += std::isfinite(x) ? 0 : 1;
  CHECK(bad == 0);
}

// Fused against composed on f32 inputs: output and the three gradients within atol + rtol * |ref|
// (a NaN fails, on either side).
void check_paths_agree(const Shape& q_shape, const Shape& kv_shape, const AttentionOptions& options,
                       std::uint64_t seed) {
  const Tensor q = test::random_tensor(q_shape, seed, DType::f32, -2, 2);
  const Tensor k = test::random_tensor(kv_shape, seed + 1, DType::f32, -2, 2);
  const Tensor v = test::random_tensor(kv_shape, seed + 2);
  const Tensor weights = test::random_tensor(q_shape, seed + 3);
  const Run fused = run(detail::fused_attention, q, k, v, options, weights);
  const Run naive = run(detail::naive_attention, q, k, v, options, weights);
  const test::Tolerance tol{2e-5, 1e-4};
  for (const auto& [actual, expected, what] :
       {std::tuple{fused.out, naive.out, "out"}, std::tuple{fused.grad_q, naive.grad_q, "grad q"},
        std::tuple{fused.grad_k, naive.grad_k, "grad k"}, std::tuple{fused.grad_v, naive.grad_v, "grad v"}}) {
    INFO(what << " of q " << shape_str(q_shape) << ", k " << shape_str(kv_shape) << ", causal "
              << options.causal);
    check_finite(expected);
    check_close(actual, expected, tol);
  }
}

// Sets the CPU thread count for a scope.
class ThreadCount {
 public:
  explicit ThreadCount(int threads) : saved_(num_threads()) { set_num_threads(threads); }
  ~ThreadCount() { set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

}  // namespace

TEST_CASE("fused attention gradients: causal, padding, GQA, partial tiles", "[attention][gradcheck]") {
  const AttentionOptions options{.causal = true, .padding = padding_after({5, 3}, 5)};
  check_gradients("T = S = 5", detail::fused_attention, options,
                  {leaf({2, 4, 5, 3}, 1), leaf({2, 2, 5, 3}, 2), leaf({2, 2, 5, 3}, 3)});
  // 70 = a full 64-tile and a partial one, in queries and keys.
  check_gradients("T = S = 70", detail::fused_attention,
                  {.causal = true, .padding = padding_after({70, 61}, 70)},
                  {leaf({2, 4, 70, 2}, 4), leaf({2, 2, 70, 2}, 5), leaf({2, 2, 70, 2}, 6)});
  check_gradients("T = 5 < S = 70, padding keys, Dv = 3 != D, not causal", detail::fused_attention,
                  {.padding = padding_after({66}, 70), .scale = 0.7},
                  {leaf({1, 4, 5, 2}, 7), leaf({1, 2, 70, 2}, 8), leaf({1, 2, 70, 3}, 9)});
  // One batch row and one key/value head: backward deals the key tiles to several tasks, each
  // with its own dq.
  check_gradients("MQA, B = 1, key tiles split", detail::fused_attention,
                  {.causal = true, .padding = padding_after({67}, 70)},
                  {leaf({1, 2, 70, 2}, 10), leaf({1, 1, 70, 2}, 11), leaf({1, 1, 70, 2}, 12)});
}

TEST_CASE("composed attention gradients with padding", "[attention][gradcheck]") {
  check_gradients("T = S, causal, padding, GQA", detail::naive_attention,
                  {.causal = true, .padding = padding_after({5, 2}, 5)},
                  {leaf({2, 4, 5, 3}, 20), leaf({2, 2, 5, 3}, 21), leaf({2, 2, 5, 3}, 22)});
  check_gradients("T < S, padding keys", detail::naive_attention, {.padding = padding_after({4}, 6)},
                  {leaf({1, 2, 3, 2}, 23), leaf({1, 2, 6, 2}, 24), leaf({1, 2, 6, 2}, 25)});
  check_gradients("padding and an additive mask", detail::naive_attention,
                  {.padding = padding_after({3, 4}, 4), .mask = test::random_tensor({4, 4}, 26, DType::f64)},
                  {leaf({2, 2, 4, 2}, 27), leaf({2, 1, 4, 2}, 28), leaf({2, 1, 4, 2}, 29)});
}

TEST_CASE("fused attention equals the composed one", "[attention]") {
  // Sequence 0 has no padding, 1 some at the end, 2 is all padding.
  const Tensor padding = padding_after({130, 93, 0}, 130);
  std::uint64_t seed = 100;
  for (const std::int64_t d : {16, 32}) {
    for (const std::int64_t kv_heads : {4, 2, 1}) {  // MHA, GQA, MQA
      for (const bool causal : {false, true}) {
        check_paths_agree({3, 4, 130, d}, {3, kv_heads, 130, d}, {.causal = causal, .padding = padding},
                          seed);
        seed += 10;
      }
    }
  }
  // Fewer queries than keys (queries are not padding then).
  check_paths_agree({3, 4, 37, 16}, {3, 2, 130, 16}, {.causal = true, .padding = padding}, 300);
  // One sequence and one key/value head: backward deals the key tiles to several tasks.
  check_paths_agree({1, 4, 130, 32}, {1, 1, 130, 32}, {.causal = true, .padding = padding_after({120}, 130)},
                    310);
}

// i64 [B, T] documents: row b is documents of the given lengths, numbered 0, 1, ... in order.
Tensor documents_of(const std::vector<std::vector<std::int64_t>>& lengths) {
  std::vector<std::int64_t> ids;
  for (const std::vector<std::int64_t>& row : lengths) {
    for (std::size_t d = 0; d < row.size(); ++d)
      ids.insert(ids.end(), static_cast<std::size_t>(row[d]), std::int64_t(d));
  }
  const auto rows = static_cast<std::int64_t>(lengths.size());
  return from_vector<std::int64_t>(ids, {rows, static_cast<std::int64_t>(ids.size()) / rows});
}

TEST_CASE("attention with documents: each document of a packed row attends as it would alone, on both paths",
          "[attention]") {
  // Row 0: documents of 20, 45 and 5 tokens; row 1: 64 and 6 (a boundary on the 64-tile edge), its
  // last 2 tokens padding. GQA, f64: the packed row's output and gradients, slice by slice, against
  // causal attention on each document's tokens alone.
  const std::vector<std::vector<std::int64_t>> lengths{{20, 45, 5}, {64, 6}};
  const Tensor documents = documents_of(lengths);
  const Tensor padding = padding_after({70, 68}, 70);
  const Tensor q = test::random_tensor({2, 4, 70, 8}, 500, DType::f64, -2, 2);
  const Tensor k = test::random_tensor({2, 2, 70, 8}, 501, DType::f64, -2, 2);
  const Tensor v = test::random_tensor({2, 2, 70, 5}, 502, DType::f64);
  const Tensor weights = test::random_tensor({2, 4, 70, 5}, 503, DType::f64);
  for (const AttentionPath path : {detail::fused_attention, detail::naive_attention}) {
    const Run packed =
        run(path, q, k, v, {.causal = true, .padding = padding, .documents = documents}, weights);
    for (std::int64_t b = 0; b < 2; ++b) {
      std::int64_t start = 0;
      for (const std::int64_t length : lengths[static_cast<std::size_t>(b)]) {
        const auto alone = [&](const Tensor& t) {
          return t.narrow(0, b, 1).narrow(2, start, length).contiguous();
        };
        const Run own =
            run(path, alone(q), alone(k), alone(v),
                {.causal = true, .padding = padding.narrow(0, b, 1).narrow(1, start, length).contiguous()},
                alone(weights));
        INFO("row " << b << ", tokens [" << start << ", " << start + length << ")");
        check_close(alone(packed.out), own.out, {1e-12, 1e-10});
        check_close(alone(packed.grad_q), own.grad_q, {1e-12, 1e-10});
        check_close(alone(packed.grad_k), own.grad_k, {1e-12, 1e-10});
        check_close(alone(packed.grad_v), own.grad_v, {1e-12, 1e-10});
        start += length;
      }
    }
  }
}

TEST_CASE("attention with documents: finite-difference gradients, and the two paths agree in f32",
          "[attention][gradcheck]") {
  // Documents that are not contiguous (0 1 0 ... in row 1) are documents too.
  std::vector<std::int64_t> interleaved(70);
  for (std::size_t t = 0; t < interleaved.size(); ++t) interleaved[t] = std::int64_t(t % 2);
  const Tensor contiguous_then_interleaved =
      cat({documents_of({{30, 40}}), from_vector<std::int64_t>(interleaved, {1, 70})}, 0);
  check_gradients("T = S = 70, causal, GQA", detail::fused_attention,
                  {.causal = true, .documents = contiguous_then_interleaved},
                  {leaf({2, 4, 70, 2}, 510), leaf({2, 2, 70, 2}, 511), leaf({2, 2, 70, 2}, 512)});
  check_gradients("T = S = 70, not causal, padding", detail::fused_attention,
                  {.padding = padding_after({70, 65}, 70), .documents = contiguous_then_interleaved},
                  {leaf({2, 4, 70, 2}, 513), leaf({2, 2, 70, 2}, 514), leaf({2, 2, 70, 2}, 515)});
  for (const bool causal : {false, true}) {
    check_paths_agree({2, 4, 130, 16}, {2, 2, 130, 16},
                      {.causal = causal,
                       .padding = padding_after({130, 100}, 130),
                       .documents = documents_of({{10, 60, 60}, {64, 64, 2}})},
                      520 + (causal ? 10 : 0));
  }
}

TEST_CASE("fused attention gives the same bits on any number of threads", "[attention][threads]") {
  // One sequence and one key/value head (dq summed from copies, one per task of key tiles), and
  // six (b, j) pairs (one task each, fewer than the tasks backward wants: copies again).
  const Tensor weights_1 = test::random_tensor({1, 4, 130, 32}, 402);
  const Tensor weights_2 = test::random_tensor({3, 4, 100, 16}, 403);
  for (const auto& [q_shape, kv_shape, weights] :
       {std::tuple{Shape{1, 4, 130, 32}, Shape{1, 1, 130, 32}, weights_1},
        std::tuple{Shape{3, 4, 100, 16}, Shape{3, 2, 100, 16}, weights_2}}) {
    INFO("q " << shape_str(q_shape) << ", k " << shape_str(kv_shape));
    const Tensor q = test::random_tensor(q_shape, 400, DType::f32, -2, 2);
    const Tensor k = test::random_tensor(kv_shape, 401, DType::f32, -2, 2);
    const Tensor v = test::random_tensor(kv_shape, 404);
    std::vector<Run> runs;
    for (const int threads : {1, 2, 3, 5}) {
      const ThreadCount count(threads);
      runs.push_back(run(detail::fused_attention, q, k, v, {.causal = true}, weights));
    }
    for (std::size_t i = 1; i < runs.size(); ++i) {
      CHECK(values(runs[i].out) == values(runs[0].out));
      CHECK(values(runs[i].grad_q) == values(runs[0].grad_q));
      CHECK(values(runs[i].grad_k) == values(runs[0].grad_k));
      CHECK(values(runs[i].grad_v) == values(runs[0].grad_v));
    }
  }
}

TEST_CASE(
    "fused attention reads heads split from [B, T, H * D] where they lie; out and gradients in their layout",
    "[attention]") {
  // One sequence and one key/value head (dq summed from per-task copies), and three sequences with
  // two key/value heads; the heads are transposed views of [B, T, heads * D] as a Llama splits them.
  for (const DType type : {DType::f32, DType::f64}) {
    for (const auto& [batch, heads, kv_heads, length] : {std::tuple{1, 4, 1, 130}, std::tuple{3, 4, 2, 37}}) {
      INFO(dtype_name(type) << ", B " << batch << ", heads " << heads << "/" << kv_heads << ", T " << length);
      const Shape rows{batch, length};  // a lambda may not capture the structured bindings (clang 14)
      const auto split = [&](std::int64_t count, std::uint64_t seed) {
        return test::random_tensor({rows[0], rows[1], count * 16}, seed, type, -2, 2)
            .reshape({rows[0], rows[1], count, 16})
            .transpose(1, 2);
      };
      const Tensor q = split(heads, 410), k = split(kv_heads, 411), v = split(kv_heads, 412);
      const Tensor grad_out = split(heads, 413);
      const AttentionParams params{
          .causal = true, .padding = padding_after(std::vector<std::int64_t>(batch, length - 3), length)};
      const AttentionResult strided = attention_forward(q, k, v, params);
      const AttentionResult packed =
          attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), params);
      CHECK(values(strided.out) == values(packed.out));
      CHECK(values(strided.logsumexp) == values(packed.logsumexp));
      CHECK(strided.out.transpose(1, 2).is_contiguous());  // merging the heads back is a view
      const AttentionGrads grads = attention_backward(grad_out, q, k, v, strided, params);
      const AttentionGrads expected = attention_backward(grad_out.contiguous(), q.contiguous(),
                                                         k.contiguous(), v.contiguous(), packed, params);
      CHECK(values(grads.q) == values(expected.q));
      CHECK(values(grads.k) == values(expected.k));
      CHECK(values(grads.v) == values(expected.v));
      CHECK(grads.q.transpose(1, 2).is_contiguous());  // as are the gradients'
      CHECK(grads.k.transpose(1, 2).is_contiguous());
      CHECK(grads.v.transpose(1, 2).is_contiguous());
    }
  }
}

TEST_CASE("a query that sees no key outputs zeros and passes no gradient, on both paths", "[attention]") {
  for (const DType type : {DType::f64, DType::f32}) {
    const Tensor q = test::random_tensor({2, 2, 4, 3}, 40, type),
                 k = test::random_tensor({2, 1, 4, 3}, 41, type),
                 v = test::random_tensor({2, 1, 4, 3}, 42, type);
    for (const AttentionPath path : {detail::fused_attention, detail::naive_attention}) {
      INFO(dtype_name(type) << (path == detail::fused_attention ? " fused" : " composed"));
      // T == S: tokens 2 and 3 of sequence 0 are padding, and all of sequence 1.
      const Run padded = run(path, q, k, v, {.causal = true, .padding = padding_after({2, 0}, 4)},
                             ones(q.shape(), dtype(type)));
      for (const Tensor& t : {padded.out, padded.grad_q, padded.grad_k, padded.grad_v}) {
        check_finite(t);
        check_zero(t.narrow(0, 0, 1).narrow(2, 2, 2));
        check_zero(t.narrow(0, 1, 1));
      }
      // T < S, causal: query 0 sees only key 0, which is padding (query 0 itself is not).
      const Tensor q2 = q.narrow(2, 0, 2);
      const Run blind = run(path, q2, k.narrow(2, 0, 3), v.narrow(2, 0, 3),
                            {.causal = true, .padding = padding_of({1, 0, 0, 0, 0, 0}, {2, 3})},
                            ones(q2.shape(), dtype(type)));
      for (const Tensor& t : {blind.out, blind.grad_q}) {
        check_finite(t);
        check_zero(t.narrow(0, 0, 1).narrow(2, 0, 1));
      }
      check_finite(blind.grad_k);
      check_finite(blind.grad_v);
    }
    // An additive mask of -inf over a whole row (composed path) hides every key too.
    const Tensor mask = where(eq(arange(4).view({4, 1}), 1),
                              full({4, 4}, -std::numeric_limits<double>::infinity()), zeros({4, 4}));
    const Run masked =
        run(scaled_dot_product_attention, q, k, v, {.mask = mask}, ones(q.shape(), dtype(type)));
    for (const Tensor& t : {masked.out, masked.grad_q}) {
      check_finite(t);
      check_zero(t.narrow(2, 1, 1));
    }
    check_finite(masked.grad_k);
    check_finite(masked.grad_v);
  }
}

TEST_CASE("attention of two one-dimensional tokens against its closed form", "[attention]") {
  // q = (a, b), k = (c, d), v = (e, f), D = 1 so the scale is 1. Causal: query 0 sees key 0 alone,
  // query 1 puts weight s = sigmoid(b (d - c)) on key 1: out = (e, e + (f - e) s).
  const double a = 0.5, b = -1.5, c = 0.3, d = 1.1, e = 2.0, f = -1.0;
  const double s = 1 / (1 + std::exp(-b * (d - c))), ds = s * (1 - s);
  const Tensor q = from_vector<double>({a, b}, {1, 1, 2, 1}), k = from_vector<double>({c, d}, {1, 1, 2, 1}),
               v = from_vector<double>({e, f}, {1, 1, 2, 1}), weights = ones({1, 1, 2, 1}, dtype(DType::f64));
  for (const AttentionPath path :
       {scaled_dot_product_attention, detail::fused_attention, detail::naive_attention}) {
    const Run causal = run(path, q, k, v, {.causal = true}, weights);
    check_close(causal.out, {e, e + (f - e) * s});
    check_close(causal.grad_q, {0.0, (f - e) * ds * (d - c)});
    check_close(causal.grad_k, {-(f - e) * ds * b, (f - e) * ds * b});
    check_close(causal.grad_v, {2 - s, s});
    // Token 1 is padding: query 0 sees key 0, query 1 sees nothing.
    const Run padded = run(path, q, k, v, {.padding = padding_of({0, 1}, {1, 2})}, weights);
    check_close(padded.out, {e, 0.0});
    check_close(padded.grad_q, {0.0, 0.0});
    check_close(padded.grad_k, {0.0, 0.0});
    check_close(padded.grad_v, {1.0, 0.0});
    // Not causal, no padding: query 0 puts weight sigmoid(a (d - c)) on key 1.
    const double s0 = 1 / (1 + std::exp(-a * (d - c)));
    check_close(run(path, q, k, v, {}, weights).out, {e + (f - e) * s0, e + (f - e) * s});
  }
}

TEST_CASE("scaled_dot_product_attention runs fused for f32/f64 without an additive mask", "[attention]") {
  const Tensor q = test::random_tensor({1, 2, 3, 4}, 60), k = test::random_tensor({1, 1, 3, 4}, 61),
               v = test::random_tensor({1, 1, 3, 4}, 62);
  const Variable qv(q, true), kv(k, true), vv(v, true);
  const auto node = [](const Variable& y) { return y.grad_fn()->name(); };
  const AttentionOptions options{.causal = true, .padding = padding_of({0, 0, 1}, {1, 3})};
  CHECK(node(scaled_dot_product_attention(qv, kv, vv, options)) == "attention_backward");
  CHECK(node(scaled_dot_product_attention(qv, kv, vv, {.mask = zeros({3, 3})})) != "attention_backward");
  // bf16 runs composed, and agrees with f32 to bf16 precision.
  const auto bf16 = [](const Tensor& t) { return Variable(t.to(DType::bf16), true); };
  const Variable out16 = scaled_dot_product_attention(bf16(q), bf16(k), bf16(v), options);
  CHECK(node(out16) != "attention_backward");
  check_close(out16.data().to(DType::f32), scaled_dot_product_attention(qv, kv, vv, options).data(),
              test::Tolerance{2e-2, 2e-2});
}

TEST_CASE("attention ops in bf16 and f16 on the CPU: the f32 kernel's values, rounded; logsumexp in f32",
          "[attention]") {
  const Tensor q = test::random_tensor({2, 4, 9, 8}, 63), k = test::random_tensor({2, 2, 11, 8}, 64),
               v = test::random_tensor({2, 2, 11, 8}, 65), grad = test::random_tensor({2, 4, 9, 8}, 66);
  const AttentionParams params{
      .causal = true,
      .padding = padding_of({0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {2, 11})};
  for (const DType half : {DType::bf16, DType::f16}) {
    INFO(dtype_name(half));
    CHECK(attention_kernel(half, Device::cpu(), 8, 8) == AttentionKernel::in_f32);
    const auto narrow = [&](const Tensor& t) { return t.to(half); };
    const auto wide = [](const Tensor& t) { return t.to(DType::f32); };
    const AttentionResult mine = attention_forward(narrow(q), narrow(k), narrow(v), params);
    const AttentionResult f32 = attention_forward(wide(narrow(q)), wide(narrow(k)), wide(narrow(v)), params);
    CHECK(mine.out.dtype() == half);
    CHECK(mine.logsumexp.dtype() == DType::f32);
    CHECK(test::same_bits(mine.out, f32.out.to(half)));
    CHECK(test::same_bits(mine.logsumexp, f32.logsumexp));
    const AttentionGrads grads =
        attention_backward(narrow(grad), narrow(q), narrow(k), narrow(v), mine, params);
    const AttentionGrads expected =
        attention_backward(wide(narrow(grad)), wide(narrow(q)), wide(narrow(k)), wide(narrow(v)),
                           {wide(mine.out), mine.logsumexp}, params);
    CHECK(test::same_bits(grads.q, expected.q.to(half)));
    CHECK(test::same_bits(grads.k, expected.k.to(half)));
    CHECK(test::same_bits(grads.v, expected.v.to(half)));
  }
}

TEST_CASE("attention rejects bad padding or documents, and inputs the fused path cannot take",
          "[attention][errors]") {
  const auto var = [](const Shape& shape, DType type = DType::f32) {
    return constant(zeros(shape, dtype(type)));
  };
  const Variable q = var({2, 4, 3, 8}), k = var({2, 2, 5, 8}), v = var({2, 2, 5, 8});
  const std::string shapes = "(q [2, 4, 3, 8], k [2, 2, 5, 8], v [2, 2, 5, 8])";
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, v, {.padding = zeros({2, 5})}),
      "scaled_dot_product_attention: padding must be bool (true marks a padding token), got f32");
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, v, {.padding = zeros({2, 4}, dtype(DType::boolean))}),
      "scaled_dot_product_attention: padding of shape [2, 4] is not [B, S] = [2, 5] " + shapes);
  CHECK_THROWS_ERROR(detail::naive_attention(q, k, v, {.padding = zeros({5}, dtype(DType::boolean))}),
                     "scaled_dot_product_attention: padding of shape [5] is not [B, S] = [2, 5] " + shapes);
  CHECK_THROWS_ERROR(
      attention_forward(q.data(), k.data(), v.data(), {.padding = zeros({1, 5}, dtype(DType::i64))}),
      "attention_forward: padding must be bool (true marks a padding token), got i64");
  const Tensor documents = zeros({2, 3}, dtype(DType::i64));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, v, {.documents = documents}),
      "scaled_dot_product_attention: documents need queries and keys of the same tokens (T == S), "
      "got T 3 and S 5 " +
          shapes);
  const Variable k3 = var({2, 2, 3, 8}), v3 = var({2, 2, 3, 8});
  const std::string same = "(q [2, 4, 3, 8], k [2, 2, 3, 8], v [2, 2, 3, 8])";
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, k3, v3, {.documents = zeros({2, 3}, dtype(DType::i32))}),
                     "scaled_dot_product_attention: documents must be i64 (a document per token), got i32");
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k3, v3, {.documents = zeros({2, 4}, dtype(DType::i64))}),
      "scaled_dot_product_attention: documents of shape [2, 4] are not [B, T] = [2, 3] " + same);
  CHECK_THROWS_ERROR(
      attention_forward(q.data(), k3.data(), v3.data(), {.documents = zeros({3}, dtype(DType::i64))}),
      "attention_forward: documents of shape [3] are not [B, T] = [2, 3] " + same);
  CHECK_THROWS_ERROR(
      detail::fused_attention(q, k, v, {.mask = zeros({3, 5})}),
      "scaled_dot_product_attention: the fused path takes no additive mask (got one of shape [3, 5])");
  CHECK_THROWS_ERROR(
      attention_forward(q.data().to(DType::i64), k.data().to(DType::i64), v.data().to(DType::i64)),
      "attention_forward: needs a floating dtype, got i64");
  const AttentionResult forward = attention_forward(q.data(), k.data(), v.data());
  CHECK_THROWS_ERROR(attention_backward(zeros({2, 4, 3, 7}), q.data(), k.data(), v.data(), forward),
                     "attention_backward: grad_out must be [2, 4, 3, 8] f32, got [2, 4, 3, 7] f32");
  CHECK_THROWS_ERROR(attention_backward(zeros({2, 4, 3, 8}), q.data(), k.data(), v.data(),
                                        {forward.out, forward.logsumexp.to(DType::f64)}),
                     "attention_backward: logsumexp must be [2, 4, 3] f32, got [2, 4, 3] f64");
}

// CUDA has no attention kernel yet: there the composed path runs, and must give what the CPU's
// fused kernels give.
SHARDLAB_CUDA_VS_CPU(
    "attention, causal, padding, GQA: output and gradients",
    {test::random_tensor({2, 4, 70, 16}, 80), test::random_tensor({2, 2, 70, 16}, 81),
     test::random_tensor({2, 2, 70, 16}, 82), padding_after({70, 50}, 70)},
    [](const test::Inputs& x) {
      const Variable q(x[0], true), k(x[1], true), v(x[2], true);
      const Variable out = scaled_dot_product_attention(q, k, v, {.causal = true, .padding = x[3]});
      sum(mul(out, out)).backward();
      return cat(
          {out.data().reshape({-1}), q.grad().reshape({-1}), k.grad().reshape({-1}), v.grad().reshape({-1})},
          0);
    },
    test::Tolerance{2e-5, 1e-4})
