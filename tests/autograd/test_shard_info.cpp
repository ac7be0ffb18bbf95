// tests/autograd/test_shard_info.cpp: a Variable that is one rank's part of a larger parameter
// (ShardInfo): shape queries for the whole, ops refused, detach keeps it; and Variables marked
// not trainable.
#include <memory>
#include <string>

#include "autograd/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

// One rank alone: the sum over "the ranks" is the value itself.
class AloneRanks final : public ShardRanks {
 public:
  Tensor sum(const Tensor& value) const override { return value; }
};

// Elements [4, 7) of a [3, 4] parameter.
ShardInfo middle_of_3x4() {
  return ShardInfo{.full_shape = {3, 4},
                   .first = 4,
                   .count = 3,
                   .placement = "Shard(flat) elements [4, 7) of 12, rank 1 of 4",
                   .ranks = std::make_shared<AloneRanks>()};
}

}  // namespace

TEST_CASE("a shard answers shape queries for the whole parameter; data() is its elements",
          "[autograd][shard]") {
  const Variable part(from_vector<float>({1, 2, 3}), true, "fc.weight");
  CHECK(part.shard_info() == nullptr);
  CHECK(part.shape() == Shape{3});
  part.set_shard_info(middle_of_3x4());
  REQUIRE(part.shard_info() != nullptr);
  CHECK(part.shape() == Shape{3, 4});
  CHECK(part.dim() == 2);
  CHECK(part.numel() == 12);
  CHECK(part.size(-1) == 4);
  CHECK(part.size(0) == 3);
  CHECK(part.data().shape() == Shape{3});
  CHECK_THROWS_ERROR(part.size(2), "size: dimension 2 is out of range for a tensor of rank 2");
  CHECK(part.str().find("shard of a parameter of shape [3, 4]: Shard(flat) elements [4, 7) of 12") !=
        std::string::npos);
  const Variable detached = part.detach();
  REQUIRE(detached.shard_info() != nullptr);  // still a part of the same parameter
  CHECK(detached.shape() == Shape{3, 4});
}

TEST_CASE("set_shard_info refuses what cannot be a shard", "[autograd][shard][errors]") {
  const Variable part(from_vector<float>({1, 2, 3}), true, "w");
  ShardInfo too_many = middle_of_3x4();
  too_many.count = 4;
  CHECK_THROWS_ERROR(
      part.set_shard_info(too_many),
      "set_shard_info: 'w' holds 3 elements of shape [3], not elements [4, 8) of a parameter of "
      "shape [3, 4]");
  ShardInfo past_the_end = middle_of_3x4();
  past_the_end.first = 10;
  CHECK_THROWS_ERROR(part.set_shard_info(past_the_end), "not elements [10, 13) of a parameter");
  ShardInfo no_ranks = middle_of_3x4();
  no_ranks.ranks = nullptr;
  CHECK_THROWS_ERROR(part.set_shard_info(no_ranks),
                     "set_shard_info: 'w' needs the ranks that hold its parts");
  const Variable two_d(zeros({1, 3}), true, "m");
  CHECK_THROWS_ERROR(two_d.set_shard_info(middle_of_3x4()), "'m' holds 3 elements of shape [1, 3]");
  const Variable computed = mul(part, 2.0);
  CHECK_THROWS_ERROR(computed.set_shard_info(middle_of_3x4()), "set_shard_info: '' is not a leaf");
  CHECK(part.shard_info() == nullptr);  // nothing was set by the refusals
}

TEST_CASE("ops and gradient hooks refuse a shard, naming it and the fix", "[autograd][shard][errors]") {
  const Variable part(from_vector<float>({1, 2, 3}), true, "fc.weight");
  part.set_shard_info(middle_of_3x4());
  const Variable other(from_vector<float>({1, 1, 1}), true, "x");
  CHECK_THROWS_ERROR(
      add(other, part),
      "add: 'fc.weight' is this rank's shard of a parameter of shape [3, 4] (Shard(flat) elements "
      "[4, 7) of 12, rank 1 of 4), not the parameter");
  CHECK_THROWS_ERROR(sum(part), "gather the values (dist::gather_full_parameters)");
  {
    const NoGradGuard no_grad;  // in no-grad mode too: the values are not the parameter's
    CHECK_THROWS_ERROR(mul(part, 3.0), "mul: 'fc.weight' is this rank's shard");
  }
  CHECK_THROWS_ERROR(
      part.register_hook([](const Tensor& g) { return g; }),
      "register_hook: 'fc.weight' is this rank's shard of a parameter (Shard(flat) elements [4, 7) "
      "of 12, rank 1 of 4): no backward reaches it");
  CHECK_THROWS_ERROR(part.register_post_accumulate_grad_hook([](const Variable&) {}),
                     "register_post_accumulate_grad_hook: 'fc.weight' is this rank's shard");
  // Elementwise updates through data() are what a shard is for.
  add_(part.data(), from_vector<float>({1, 1, 1}));
  CHECK(part.data().to_vector<float>() == std::vector<float>{2, 3, 4});
}

TEST_CASE("a Variable marked not trainable says why, until the mark is cleared", "[autograd][shard]") {
  const Variable gathered(zeros({2}), true, "w");
  CHECK(gathered.not_trainable_reason() == nullptr);
  gathered.set_not_trainable("it is a gathered copy");
  REQUIRE(gathered.not_trainable_reason() != nullptr);
  CHECK(*gathered.not_trainable_reason() == "it is a gathered copy");
  CHECK(Variable().not_trainable_reason() == nullptr);
  CHECK_THROWS_ERROR(Variable().set_not_trainable("x"), "set_not_trainable");
  // It still computes: only optimizers and clipping refuse it.
  CHECK(sum(gathered).data().item<float>() == 0.0f);
  // A mark for a while (a shard whose gradient waits for a collective) is cleared again.
  gathered.clear_not_trainable();
  CHECK(gathered.not_trainable_reason() == nullptr);
  CHECK_THROWS_ERROR(Variable().clear_not_trainable(), "clear_not_trainable");
}
