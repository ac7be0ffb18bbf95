// tests/autograd/test_batch_chunks.cpp: BatchChunking (autograd/batch_chunks.h): the gradients of linear,
// conv2d, embedding and rms_norm weights, delivered as chunk parts into BinnedSums, and those reaching them
// through attention, have the same bits however the batch is split over simulated ranks (and equal plain
// autograd's gradients to rounding), while plain gradients summed over the same splits do not; hooks fire
// once per backward; every misuse is refused by name.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/batch_chunks.h"
#include "autograd/functional.h"
#include "autograd/ops.h"
#include "autograd/record.h"
#include "core/binned_sum.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

constexpr std::int64_t kSamples = 12, kChunk = 3;

// A model's parameters and the loss of samples [first, first + count) of its batch of kSamples.
struct Net {
  std::vector<Tensor> weights;
  std::function<Variable(const std::vector<Variable>& p, std::int64_t first, std::int64_t count)> loss;
};

Variable sum_of_squares(const Variable& y) { return sum(mul(y, y)); }

// linear(tanh(linear(x, w1, b1)), w2), x [samples, 3, 5].
Net linear_net() {
  const Tensor x = test::random_tensor({kSamples, 3, 5}, 4);
  return {{test::random_tensor({4, 5}, 1), test::random_tensor({4}, 2), test::random_tensor({3, 4}, 3)},
          [x](const std::vector<Variable>& p, std::int64_t first, std::int64_t count) {
            const Variable in = constant(x.narrow(0, first, count));
            return sum_of_squares(linear(tanh(linear(in, p[0], p[1])), p[2]));
          }};
}

// linear(relu(conv2d(x, w, b)) flattened, w2), x [samples, 2, 6, 6].
Net conv_net() {
  const Tensor x = test::random_tensor({kSamples, 2, 6, 6}, 7);
  return {
      {test::random_tensor({3, 2, 3, 3}, 8), test::random_tensor({3}, 9), test::random_tensor({4, 48}, 10)},
      [x](const std::vector<Variable>& p, std::int64_t first, std::int64_t count) {
        const Variable image = conv2d(constant(x.narrow(0, first, count)), p[0], p[1], {.padding = 0});
        return sum_of_squares(linear(flatten(relu(image), 1, -1), p[2]));
      }};
}

// A causal attention block over tokens [samples, 130]: embedding, rms_norm, q/k/v projections (2 query
// heads, 1 key/value head, of 4), fused attention, out projection. 130 tokens make 3 key tiles, so the
// CPU kernel deals a head's dQ over a number of tasks that depends on the batch it is given.
Net attention_net() {
  constexpr std::int64_t kTokens = 130, kVocab = 11;
  const Tensor tokens = test::random_tensor({kSamples, kTokens}, 11, DType::f32, 0.0, kVocab).to(DType::i64);
  return {
      {test::random_tensor({kVocab, 8}, 12), test::random_tensor({8}, 13), test::random_tensor({8, 8}, 14),
       test::random_tensor({4, 8}, 15), test::random_tensor({4, 8}, 16), test::random_tensor({8, 8}, 17)},
      [tokens](const std::vector<Variable>& p, std::int64_t first, std::int64_t count) {
        const Variable h = rms_norm(embedding(p[0], tokens.narrow(0, first, count)), p[1], 1e-6);
        const auto heads = [&](const Variable& y, std::int64_t n) {
          return transpose(reshape(y, {count, kTokens, n, 4}), 1, 2);
        };
        const Variable out =
            scaled_dot_product_attention(heads(linear(h, p[2]), 2), heads(linear(h, p[3]), 1),
                                         heads(linear(h, p[4]), 1), {.causal = true});
        return sum_of_squares(linear(reshape(transpose(out, 1, 2), {count, kTokens, 8}), p[5]));
      }};
}

std::vector<Variable> leaves(const Net& net) {
  std::vector<Variable> p;
  for (std::size_t i = 0; i < net.weights.size(); ++i)
    p.emplace_back(net.weights[i], true, "p" + std::to_string(i));
  return p;
}

// One simulated rank: samples [first, first + count) under BatchChunking, each parameter's parts in a
// BinnedSum of its own. `hooks` counts the post-accumulate hooks.
std::vector<std::shared_ptr<BinnedSum>> rank_sums(const Net& net, std::int64_t first, std::int64_t count,
                                                  int* hooks = nullptr) {
  std::vector<Variable> p = leaves(net);
  std::vector<std::shared_ptr<BinnedSum>> sums;
  for (const Variable& v : p) {
    sums.push_back(std::make_shared<BinnedSum>(v.numel()));
    v.set_binned_grad(sums.back());
    if (hooks != nullptr) v.register_post_accumulate_grad_hook([hooks](const Variable&) { ++*hooks; });
  }
  const autograd::BatchChunking chunking({.samples = count, .chunk = kChunk});
  net.loss(p, first, count).backward();
  return sums;
}

// The ranks' sums combined as ranks do: tops all-reduced with max, windows with sum, rounded once.
std::vector<std::vector<float>> over_ranks(const Net& net, const std::vector<std::int64_t>& counts) {
  std::vector<std::vector<std::shared_ptr<BinnedSum>>> ranks;
  std::int64_t first = 0;
  for (const std::int64_t count : counts) {
    ranks.push_back(rank_sums(net, first, count));
    first += count;
  }
  std::vector<std::vector<float>> grads;
  for (std::size_t p = 0; p < ranks.front().size(); ++p) {
    Tensor tops = ranks.front()[p]->tops().clone();
    for (const auto& rank : ranks) tops = maximum(tops, rank[p]->tops());
    Tensor windows = zeros({ranks.front()[p]->numel()}, dtype(DType::i64));
    for (const auto& rank : ranks) windows = add(windows, rank[p]->window(tops));
    grads.push_back(round_binned(windows, tops).to_vector<float>());
  }
  return grads;
}

// Every split gives the reference's bits; the reference is plain autograd's gradient to rounding; plain
// gradients of the parts, added, differ from the whole batch's in some bit (so the check can fail).
void check_split_free(const Net& net, double tolerance) {
  const std::vector<std::vector<float>> reference = over_ranks(net, {kSamples});
  for (const std::vector<std::int64_t>& counts :
       std::vector<std::vector<std::int64_t>>{{6, 6}, {3, 9}, {9, 3}, {3, 3, 3, 3}, {3, 6, 3}}) {
    INFO("split " << counts.size() << " ways, the first rank holding " << counts.front());
    CHECK(over_ranks(net, counts) == reference);
  }
  const std::vector<Variable> plain = leaves(net);
  net.loss(plain, 0, kSamples).backward();
  for (std::size_t p = 0; p < plain.size(); ++p) {
    INFO("parameter " << p);
    std::vector<double> expected(reference[p].begin(), reference[p].end());
    test::check_close(plain[p].grad(), expected, {tolerance, tolerance});
  }
  bool differs = false;
  for (const std::vector<std::int64_t>& counts : std::vector<std::vector<std::int64_t>>{{6, 6}, {3, 9}}) {
    const std::vector<Variable> a = leaves(net), b = leaves(net);
    net.loss(a, 0, counts[0]).backward();
    net.loss(b, counts[0], counts[1]).backward();
    for (std::size_t p = 0; p < a.size(); ++p)
      differs |= add(a[p].grad(), b[p].grad()).to_vector<float>() != plain[p].grad().to_vector<float>();
  }
  CHECK(differs);
}

}  // namespace

TEST_CASE("BatchChunking: linear's weight and bias gradients have the same bits however the batch is split",
          "[batch_chunks]") {
  check_split_free(linear_net(), 1e-5);
}

TEST_CASE("BatchChunking: conv2d's weight and bias gradients have the same bits however the batch is split",
          "[batch_chunks]") {
  check_split_free(conv_net(), 1e-5);
}

TEST_CASE(
    "BatchChunking: embedding, rms_norm and the projections around attention have the same bits "
    "however the batch is split",
    "[batch_chunks]") {
  check_split_free(attention_net(), 1e-4);
}

TEST_CASE("BatchChunking: an embedding's parts go in by the rows each chunk looked up, the whole parts' bits",
          "[batch_chunks]") {
  // loss = sum(embedding(w, ids) * c): each chunk's part of w's gradient is embedding_backward(c's rows).
  const Tensor ids = from_vector<std::int64_t>({3, 1, 3, 0, 1, 1, 6, 3}, {4, 2});
  const Tensor c = test::random_tensor({4, 2, 5}, 21);
  Variable w(test::random_tensor({7, 5}, 22), true, "w");
  auto by_rows = std::make_shared<BinnedSum>(35);
  w.set_binned_grad(by_rows);
  {
    const autograd::BatchChunking chunking({.samples = 4, .chunk = 2});
    sum(mul(embedding(w, ids), constant(c))).backward();
  }
  BinnedSum whole_parts(35);
  for (std::int64_t first : {0, 2}) {
    whole_parts.add(
        embedding_backward(c.narrow(0, first, 2).reshape({4, 5}), ids.narrow(0, first, 2).reshape({4}), 7)
            .reshape({35}));
  }
  CHECK(by_rows->result().to_vector<float>() == whole_parts.result().to_vector<float>());
  CHECK(by_rows->window(by_rows->tops()).to_vector<std::int64_t>() ==
        whole_parts.window(whole_parts.tops()).to_vector<std::int64_t>());
}

TEST_CASE("BatchChunking: rows of a part that repeat or do not fit are refused by name", "[batch_chunks]") {
  Variable w(zeros({3, 2}), true, "w");
  w.set_binned_grad(std::make_shared<BinnedSum>(6));
  const auto deliver = [&](const Tensor& rows, const Tensor& values) {
    return autograd::record("rows_op", {w}, zeros({1}), [rows, values](const Tensor&) -> autograd::Grads {
      autograd::deliver_gradient_rows(0, rows, values);
      return {Tensor()};
    });
  };
  CHECK_THROWS_ERROR(
      sum(deliver(from_vector<std::int64_t>({1, 1}, {2}), ones({2, 2}))).backward(),
      "backward: the rows of a gradient part for leaf 'w' of shape [3, 2] must be distinct rows of it");
  CHECK_THROWS_ERROR(sum(deliver(from_vector<std::int64_t>({3}, {1}), ones({1, 2}))).backward(),
                     "must be distinct rows of it");
  CHECK_THROWS_ERROR(sum(deliver(from_vector<std::int64_t>({0}, {1}), ones({1, 3}))).backward(),
                     "backward: 1 rows of a gradient part of shape [1, 3] for leaf 'w' of shape [3, 2]");
}

TEST_CASE("BatchChunking: post-accumulate hooks run once per parameter and backward", "[batch_chunks]") {
  int hooks = 0;
  const auto sums = rank_sums(linear_net(), 0, kSamples, &hooks);
  CHECK(hooks == 3);
  CHECK(sums[0]->terms() == kSamples / kChunk);  // one part per chunk
}

TEST_CASE("BatchChunking: misuses are refused by name", "[batch_chunks]") {
  const Tensor w1_values = linear_net().weights[0];
  const Tensor x = test::random_tensor({4, 5}, 5);
  CHECK_THROWS_ERROR(autograd::BatchChunking({.samples = 5, .chunk = 2}),
                     "BatchChunking: a batch of 5 samples does not cut into chunks of 2");
  CHECK_THROWS_ERROR(autograd::deliver_gradient_part(0, x),
                     "deliver_gradient_part: called outside an op's backward function");
  {
    // A parameter with a BinnedSum that gets a whole gradient (mul's broadcast sum does not chunk).
    Variable scale(ones({5}), true, "scale");
    scale.set_binned_grad(std::make_shared<BinnedSum>(5));
    const autograd::BatchChunking chunking({.samples = 4, .chunk = 2});
    CHECK_THROWS_ERROR(
        sum(mul(constant(x), scale)).backward(),
        "backward: leaf 'scale' gathers its gradient by chunks (set_binned_grad), but got a whole one");
  }
  {
    const autograd::BatchChunking chunking({.samples = 4, .chunk = 2});
    Variable w1(w1_values, true, "w1");
    CHECK_THROWS_ERROR(sum(linear(constant(x), mul(w1, 2.0))).backward(),
                       "linear_backward: its input 1 comes from mul_backward, not from a parameter");
    CHECK_THROWS_ERROR(
        sum(linear(constant(x), w1)).backward(),
        "backward: an op cut its batch into chunks (BatchChunking) but leaf 'w1' has no BinnedSum");
    w1.set_binned_grad(std::make_shared<BinnedSum>(20));
    CHECK_THROWS_ERROR(sum(linear(constant(test::random_tensor({6, 5}, 6)), w1)).backward(),
                       "linear: its 6 rows are not a whole number per sample of the batch of 4");
    Variable kernel(test::random_tensor({1, 1, 2, 2}, 7), true, "kernel");
    kernel.set_binned_grad(std::make_shared<BinnedSum>(4));
    CHECK_THROWS_ERROR(sum(conv2d(constant(test::random_tensor({6, 1, 3, 3}, 8)), kernel)).backward(),
                       "conv2d: its 6 rows are not a whole number per sample of the batch of 4");
  }
  Variable w1(w1_values, true, "w1");
  CHECK_THROWS_ERROR(w1.set_binned_grad(std::make_shared<BinnedSum>(19)),
                     "set_binned_grad: 'w1' (20 elements from 0) does not fit a sum of 19");
  CHECK_THROWS_ERROR(mul(w1, 2.0).set_binned_grad(std::make_shared<BinnedSum>(20)),
                     "set_binned_grad: '' is not a leaf that requires grad");
  // Outside a scope, nothing is chunked: a plain gradient.
  sum(linear(constant(x), w1)).backward();
  CHECK(w1.grad().defined());
}
