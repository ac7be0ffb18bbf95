// tests/autograd/test_batch_chunks.cpp: BatchChunking (autograd/batch_chunks.h): a linear's weight and
// bias gradients, delivered as chunk parts into BinnedSums, have the same bits however the batch is split
// over simulated ranks (and equal plain autograd's gradient to rounding), while plain gradients summed over
// the same splits do not; hooks fire once per backward; every misuse is refused by name.
#include <memory>
#include <vector>

#include "autograd/batch_chunks.h"
#include "autograd/ops.h"
#include "core/binned_sum.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

constexpr std::int64_t kSamples = 12, kChunk = 3;

struct Weights {
  Tensor w1 = test::random_tensor({4, 5}, 1), b1 = test::random_tensor({4}, 2),
         w2 = test::random_tensor({3, 4}, 3);
};

// A batch's loss: the sum of squares of linear(tanh(linear(x, w1, b1)), w2), x [samples, 3, 5].
Variable loss_of(const Variable& x, const std::vector<Variable>& p) {
  const Variable y = linear(tanh(linear(x, p[0], p[1])), p[2]);
  return sum(mul(y, y));
}

std::vector<Variable> leaves(const Weights& w) {
  return {Variable(w.w1, true, "w1"), Variable(w.b1, true, "b1"), Variable(w.w2, true, "w2")};
}

// One simulated rank: samples [first, first + count) under BatchChunking, each parameter's parts in a
// BinnedSum of its own. `hooks` counts the post-accumulate hooks.
std::vector<std::shared_ptr<BinnedSum>> rank_sums(const Weights& w, const Tensor& x, std::int64_t first,
                                                  std::int64_t count, int* hooks = nullptr) {
  std::vector<Variable> p = leaves(w);
  std::vector<std::shared_ptr<BinnedSum>> sums;
  for (const Variable& v : p) {
    sums.push_back(std::make_shared<BinnedSum>(v.numel()));
    v.set_binned_grad(sums.back());
    if (hooks != nullptr) v.register_post_accumulate_grad_hook([hooks](const Variable&) { ++*hooks; });
  }
  const autograd::BatchChunking chunking({.samples = count, .chunk = kChunk});
  loss_of(constant(x.narrow(0, first, count)), p).backward();
  return sums;
}

// The ranks' sums combined as ranks do: tops all-reduced with max, windows with sum, rounded once.
std::vector<std::vector<float>> over_ranks(const Weights& w, const Tensor& x,
                                           const std::vector<std::int64_t>& counts) {
  std::vector<std::vector<std::shared_ptr<BinnedSum>>> ranks;
  std::int64_t first = 0;
  for (const std::int64_t count : counts) {
    ranks.push_back(rank_sums(w, x, first, count));
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

}  // namespace

TEST_CASE("BatchChunking: linear's weight and bias gradients have the same bits however the batch is split",
          "[batch_chunks]") {
  const Weights w;
  const Tensor x = test::random_tensor({kSamples, 3, 5}, 4);
  const std::vector<std::vector<float>> reference = over_ranks(w, x, {kSamples});
  for (const std::vector<std::int64_t>& counts :
       std::vector<std::vector<std::int64_t>>{{6, 6}, {3, 9}, {9, 3}, {3, 3, 3, 3}, {3, 6, 3}}) {
    INFO("split " << counts.size() << " ways, the first rank holding " << counts.front());
    CHECK(over_ranks(w, x, counts) == reference);
  }
  // The same gradient as plain autograd's over the whole batch, to rounding.
  const std::vector<Variable> plain = leaves(w);
  loss_of(constant(x), plain).backward();
  for (std::size_t p = 0; p < plain.size(); ++p) {
    std::vector<double> expected;
    for (const float v : reference[p]) expected.push_back(v);
    test::check_close(plain[p].grad(), expected, {1e-5, 1e-5});
  }
  // Plain gradients of the halves, added, differ from the whole batch's in some bit: the test can fail.
  bool differs = false;
  for (const std::vector<std::int64_t>& counts : std::vector<std::vector<std::int64_t>>{{6, 6}, {3, 9}}) {
    const std::vector<Variable> a = leaves(w), b = leaves(w);
    loss_of(constant(x.narrow(0, 0, counts[0])), a).backward();
    loss_of(constant(x.narrow(0, counts[0], counts[1])), b).backward();
    for (std::size_t p = 0; p < a.size(); ++p)
      differs |= add(a[p].grad(), b[p].grad()).to_vector<float>() != plain[p].grad().to_vector<float>();
  }
  CHECK(differs);
}

TEST_CASE("BatchChunking: post-accumulate hooks run once per parameter and backward", "[batch_chunks]") {
  const Weights w;
  int hooks = 0;
  const auto sums = rank_sums(w, test::random_tensor({kSamples, 3, 5}, 4), 0, kSamples, &hooks);
  CHECK(hooks == 3);
  CHECK(sums[0]->terms() == kSamples / kChunk);  // one part per chunk
}

TEST_CASE("BatchChunking: misuses are refused by name", "[batch_chunks]") {
  const Weights w;
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
    Variable w1(w.w1, true, "w1");
    CHECK_THROWS_ERROR(sum(linear(constant(x), mul(w1, 2.0))).backward(),
                       "linear_backward: its input 1 comes from mul_backward, not from a parameter");
    CHECK_THROWS_ERROR(
        sum(linear(constant(x), w1)).backward(),
        "backward: an op cut its batch into chunks (BatchChunking) but leaf 'w1' has no BinnedSum");
    w1.set_binned_grad(std::make_shared<BinnedSum>(20));
    CHECK_THROWS_ERROR(sum(linear(constant(test::random_tensor({6, 5}, 6)), w1)).backward(),
                       "linear: its 6 rows are not a whole number per sample of the batch of 4");
  }
  Variable w1(w.w1, true, "w1");
  CHECK_THROWS_ERROR(w1.set_binned_grad(std::make_shared<BinnedSum>(19)),
                     "set_binned_grad: 'w1' (20 elements from 0) does not fit a sum of 19");
  CHECK_THROWS_ERROR(mul(w1, 2.0).set_binned_grad(std::make_shared<BinnedSum>(20)),
                     "set_binned_grad: '' is not a leaf that requires grad");
  // Outside a scope, nothing is chunked: a plain gradient.
  sum(linear(constant(x), w1)).backward();
  CHECK(w1.grad().defined());
}
