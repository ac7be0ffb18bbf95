// tests/dist/test_fault_injection.cpp: SHARDLAB_INJECT_FAULT's grammar and its refusals; a NaN
// injected into one rank's all-reduce reaches every rank (the kill and hang actions are run by
// tests/apps/fault_suite_tests.py on real training jobs).
#include <cmath>

#include "core/ops.h"
#include "dist/comm/fault_injection.h"
#include "dist/comm/init.h"
#include "tests/dist/world.h"

using namespace shardlab;
using dist::FaultInjection;
using dist::parse_fault_injection;

TEST_CASE("SHARDLAB_INJECT_FAULT: action, rank, call and tag", "[dist][fault]") {
  CHECK_FALSE(parse_fault_injection("").has_value());
  const FaultInjection kill = parse_fault_injection("kill:rank=1:call=3:tag=pre-backward fc1").value();
  CHECK(kill.action == FaultInjection::Action::kill);
  CHECK(kill.rank == 1);
  CHECK(kill.call == 3);
  CHECK(kill.tag == "pre-backward fc1");
  const FaultInjection hang = parse_fault_injection("hang:call=40:rank=0").value();
  CHECK(hang.action == FaultInjection::Action::hang);
  CHECK(hang.rank == 0);
  CHECK(hang.call == 40);
  CHECK(hang.tag.empty());
  CHECK(parse_fault_injection("nan:rank=2:call=1:tag=fc1")->action == FaultInjection::Action::nan);
}

TEST_CASE("SHARDLAB_INJECT_FAULT: a wrong field is refused by name", "[dist][fault]") {
  using Catch::Matchers::Equals;
  CHECK_THROWS_WITH(
      parse_fault_injection("explode:rank=1:call=2"),
      Equals("SHARDLAB_INJECT_FAULT='explode:rank=1:call=2': the action 'explode' is not one of kill, "
             "hang, nan"));
  CHECK_THROWS_WITH(
      parse_fault_injection("kill:rank=one:call=2"),
      Equals("SHARDLAB_INJECT_FAULT='kill:rank=one:call=2': rank must be a whole number, not 'one'"));
  CHECK_THROWS_WITH(parse_fault_injection("kill:rank=1:call=0"),
                    Equals("SHARDLAB_INJECT_FAULT='kill:rank=1:call=0': call counts from 1, not 0"));
  CHECK_THROWS_WITH(
      parse_fault_injection("kill:rank=1:call=-2"),
      Equals("SHARDLAB_INJECT_FAULT='kill:rank=1:call=-2': call must be a whole number, not '-2'"));
  CHECK_THROWS_WITH(parse_fault_injection("kill:rank=1"),
                    Equals("SHARDLAB_INJECT_FAULT='kill:rank=1': rank= and call= are required"));
  CHECK_THROWS_WITH(
      parse_fault_injection("kill:rank=1:call=2:when=now"),
      Equals("SHARDLAB_INJECT_FAULT='kill:rank=1:call=2:when=now': unknown key 'when' (keys rank, "
             "call, tag)"));
  CHECK_THROWS_WITH(
      parse_fault_injection("kill:rank=1:call"),
      Equals("SHARDLAB_INJECT_FAULT='kill:rank=1:call': 'call' is not KEY=VALUE (keys rank, call, "
             "tag)"));
}

TEST_CASE("an injected NaN in one rank's all-reduce reaches every rank; other collectives are untouched",
          "[dist][fault]") {
  dist::Communicator& world = test::world();
  const int last = world.size() - 1;
  dist::arm_fault_injection(parse_fault_injection(fmt::format("nan:rank={}:call=2:tag=injected", last)),
                            world.rank());
  const Tensor first = full({4}, 1.0f), second = full({4}, 1.0f), untagged = full({4}, 1.0f);
  world.all_reduce(first, dist::ReduceOp::sum, "injected").wait();
  world.all_reduce(untagged, dist::ReduceOp::sum, "other").wait();
  world.all_reduce(second, dist::ReduceOp::sum, "injected").wait();
  dist::arm_fault_injection(std::nullopt, world.rank());
  CHECK(first.data<float>()[0] == static_cast<float>(world.size()));
  CHECK(untagged.data<float>()[3] == static_cast<float>(world.size()));
  for (int i = 0; i < 4; ++i) CHECK(std::isnan(second.data<float>()[i]));

  // A NaN asked of a collective that does not reduce is refused, naming it.
  dist::arm_fault_injection(parse_fault_injection("nan:rank=0:call=1"), 0);
  const Tensor gathered = empty({4}), mine = full({4}, 1.0f);
  CHECK_THROWS_WITH(
      dist::before_collective({.op = dist::Collective::all_gather, .dtype = DType::f32, .count = 4}, mine),
      Catch::Matchers::StartsWith("SHARDLAB_INJECT_FAULT: nan needs a reduce_scatter or all_reduce, and "
                                  "call 1 is all_gather(f32, 4)"));
  dist::arm_fault_injection(std::nullopt, 0);
}
