// tests/dist/test_schedule.cpp: simulate_step on a 3-unit toy against timelines drawn by hand, with
// prefetch and without it: every span's lane, name, start and end, the step time and the exposed
// communication; and its refusals.
#include <string>
#include <tuple>
#include <vector>

#include "dist/fsdp/schedule.h"
#include "tests/dist/world.h"

using namespace shardlab;
using dist::ScheduleSpan;

namespace {

// The root (not resharded after forward) and two layers, in forward order; times in seconds.
std::vector<dist::UnitTimes> toy() {
  return {{.name = "root",
           .forward = 2,
           .backward = 4,
           .gather = 1,
           .reduce = 1,
           .reshards_after_forward = false},
          {.name = "a", .forward = 3, .backward = 6, .gather = 2, .reduce = 2},
          {.name = "b", .forward = 3, .backward = 6, .gather = 2, .reduce = 2}};
}

using Drawn = std::tuple<char, std::string, double, double>;  // lane ('c' or 'n'), what, start, end

std::vector<Drawn> drawn(const dist::Schedule& schedule) {
  std::vector<Drawn> out;
  for (const ScheduleSpan& span : schedule.spans)
    out.emplace_back(span.lane == ScheduleSpan::Lane::compute ? 'c' : 'n', span.what, span.start, span.end);
  return out;
}

}  // namespace

TEST_CASE("simulate_step: a 3-unit step with prefetch, as drawn by hand", "[dist][schedule]") {
  // Forward: the root's gather 0-1, its forward 1-3 with a's gather prefetched 1-3; a 3-6 with b's
  // gather 3-5; b 6-9. Backward: b gathers again 9-11 (exposed), runs 11-17 with a's gather prefetched
  // 11-13, reduces 17-19; a 17-23, reduces 23-25; the root (kept whole) 23-27, reduces 27-28 (exposed);
  // the optimizer 28-29. Waits: 1 + 2 + 1.
  const dist::Schedule schedule = dist::simulate_step(toy(), {.prefetch = 1, .optimizer = 1});
  const std::vector<Drawn> expected = {{'n', "all-gather root", 0, 1},
                                       {'n', "all-gather a", 1, 3},
                                       {'c', "forward root", 1, 3},
                                       {'n', "all-gather b", 3, 5},
                                       {'c', "forward a", 3, 6},
                                       {'c', "forward b", 6, 9},
                                       {'n', "all-gather (backward) b", 9, 11},
                                       {'n', "all-gather (backward) a", 11, 13},
                                       {'c', "backward b", 11, 17},
                                       {'n', "reduce b", 17, 19},
                                       {'c', "backward a", 17, 23},
                                       {'n', "reduce a", 23, 25},
                                       {'c', "backward root", 23, 27},
                                       {'n', "reduce root", 27, 28},
                                       {'c', "optimizer", 28, 29}};
  CHECK(drawn(schedule) == expected);
  CHECK(schedule.step == 29);
  CHECK(schedule.exposed_communication == 4);
}

TEST_CASE("simulate_step: the same step without prefetch, as drawn by hand", "[dist][schedule]") {
  // Each gather issued when its unit is reached: forward 0-1 | 1-3, 3-5 | 5-8, 8-10 | 10-13; backward
  // b 13-15 | 15-21, reduce 21-23; a's gather waits for that reduce on the lane: 23-25 | 25-31, reduce
  // 31-33; the root 31-35, reduce 35-36; optimizer 36-37. Waits: 1 + 2 + 2 + 2 + 4 + 1.
  const dist::Schedule schedule = dist::simulate_step(toy(), {.prefetch = 0, .optimizer = 1});
  const std::vector<Drawn> expected = {{'n', "all-gather root", 0, 1},
                                       {'c', "forward root", 1, 3},
                                       {'n', "all-gather a", 3, 5},
                                       {'c', "forward a", 5, 8},
                                       {'n', "all-gather b", 8, 10},
                                       {'c', "forward b", 10, 13},
                                       {'n', "all-gather (backward) b", 13, 15},
                                       {'c', "backward b", 15, 21},
                                       {'n', "reduce b", 21, 23},
                                       {'n', "all-gather (backward) a", 23, 25},
                                       {'c', "backward a", 25, 31},
                                       {'n', "reduce a", 31, 33},
                                       {'c', "backward root", 31, 35},
                                       {'n', "reduce root", 35, 36},
                                       {'c', "optimizer", 36, 37}};
  CHECK(drawn(schedule) == expected);
  CHECK(schedule.step == 37);
  CHECK(schedule.exposed_communication == 12);
}

TEST_CASE("simulate_step: one reduction in flight makes each backward wait for the one before",
          "[dist][schedule]") {
  // With prefetch 1 as in the first drawing, but a's reduction issued at 23 first waits for b's (done
  // at 19: no wait) and the root's at 27 for a's (done at 25: no wait): the same step. Slower
  // reductions (5 s) do wait: b's 17-22, a's backward 17-23 then its reduction 23-28; the root's
  // backward 23-27, then it waits for a's until 28 and reduces 28-33; the optimizer 33-34.
  std::vector<dist::UnitTimes> units = toy();
  CHECK(dist::simulate_step(units, {.prefetch = 1, .reductions_in_flight = 1, .optimizer = 1}).step == 29);
  for (dist::UnitTimes& unit : units) unit.reduce = 5;
  const dist::Schedule slow =
      dist::simulate_step(units, {.prefetch = 1, .reductions_in_flight = 1, .optimizer = 1});
  CHECK(slow.step == 34);
  CHECK(slow.exposed_communication == 1 + 2 + 1 + 5);
}

TEST_CASE("simulate_step: negative times and counts are refused by name", "[dist][schedule]") {
  std::vector<dist::UnitTimes> units = toy();
  units[1].gather = -1;
  CHECK_THROWS_ERROR(dist::simulate_step(units),
                     "simulate_step: unit a has a negative time (forward 3, backward 6, gather -1, reduce 2, "
                     "replica reduce 0 s)");
  CHECK_THROWS_ERROR(dist::simulate_step(toy(), {.prefetch = -1}),
                     "simulate_step: prefetch must be at least 0 and reductions in flight at least 1, the "
                     "optimizer's and the synchronisation's times not negative; got -1, 2, 0 and 0 s");
}

TEST_CASE(
    "simulate_step: compute as segments, the root's around its children and the loss outside units, "
    "as drawn by hand",
    "[dist][schedule]") {
  // Forward: the root's gather 0-1 (waited), its embedding 1-2 with a's gather prefetched 1-3 (waited
  // 1), a 3-6 with b's gather 3-5, b 6-9, the root's head 9-10, the loss 10-10.5. Backward: the loss's
  // gradient 10.5-11; the root (kept whole) 11-13 prefetching b 11-13; b 13-19 prefetching a 13-15,
  // reduces 19-21; a 19-25, reduces 25-27; the root's embedding 25-27, reduces 27-28 (waited 1); the
  // optimizer 28-29.
  using dist::ComputeSegment;
  const std::vector<ComputeSegment> forward = {{0, 1}, {1, 3}, {2, 3}, {0, 1}, {-1, 0.5}};
  const std::vector<ComputeSegment> backward = {{-1, 0.5}, {0, 2}, {2, 6}, {1, 6}, {0, 2}};
  const dist::Schedule schedule =
      dist::simulate_step(toy(), forward, backward, {.prefetch = 1, .optimizer = 1});
  const std::vector<Drawn> expected = {{'n', "all-gather root", 0, 1},
                                       {'n', "all-gather a", 1, 3},
                                       {'c', "forward root", 1, 2},
                                       {'n', "all-gather b", 3, 5},
                                       {'c', "forward a", 3, 6},
                                       {'c', "forward b", 6, 9},
                                       {'c', "forward root", 9, 10},
                                       {'c', "forward, outside units", 10, 10.5},
                                       {'c', "backward, outside units", 10.5, 11},
                                       {'n', "all-gather (backward) b", 11, 13},
                                       {'c', "backward root", 11, 13},
                                       {'n', "all-gather (backward) a", 13, 15},
                                       {'c', "backward b", 13, 19},
                                       {'n', "reduce b", 19, 21},
                                       {'c', "backward a", 19, 25},
                                       {'n', "reduce a", 25, 27},
                                       {'c', "backward root", 25, 27},
                                       {'n', "reduce root", 27, 28},
                                       {'c', "optimizer", 28, 29}};
  CHECK(drawn(schedule) == expected);
  CHECK(schedule.step == 29);
  CHECK(schedule.exposed_communication == 3);
  std::vector<double> waited;
  for (const ScheduleSpan& span : schedule.spans)
    if (span.lane == ScheduleSpan::Lane::compute && span.waited > 0) waited.push_back(span.waited);
  CHECK(waited == std::vector<double>{1, 1, 1});  // the root's first forward, a's, the optimizer
}

TEST_CASE("simulate_step: the step's small all-reduces, then each unit's replica all-reduce in turn",
          "[dist][schedule]") {
  // The first drawing to the root's backward's end at 27 (its reduction 27-28); then the small
  // all-reduces 28-28.5, the replicas' all-reduces in unit order root 28.5-29.5, a 29.5-30.5, b
  // 30.5-31.5, each waited for; the optimizer 31.5-32.5. Waits: 1 + 2 before, 4.5 at the end.
  std::vector<dist::UnitTimes> units = toy();
  for (dist::UnitTimes& unit : units) unit.replica_reduce = 1;
  const dist::Schedule schedule =
      dist::simulate_step(units, {.prefetch = 1, .optimizer = 1, .synchronisation = 0.5});
  const std::vector<Drawn> all = drawn(schedule);
  const std::vector<Drawn> tail(all.end() - 5, all.end());
  const std::vector<Drawn> expected = {{'n', "synchronisation", 28, 28.5},
                                       {'n', "all-reduce (replicas) root", 28.5, 29.5},
                                       {'n', "all-reduce (replicas) a", 29.5, 30.5},
                                       {'n', "all-reduce (replicas) b", 30.5, 31.5},
                                       {'c', "optimizer", 31.5, 32.5}};
  CHECK(tail == expected);
  CHECK(schedule.step == 32.5);
  CHECK(schedule.exposed_communication == 7.5);
}

TEST_CASE("simulate_step: segments that miss a unit, reach units out of order or name no unit are refused",
          "[dist][schedule]") {
  using dist::ComputeSegment;
  const std::vector<ComputeSegment> forward = {{0, 1}, {1, 1}, {2, 1}}, backward = {{2, 1}, {1, 1}, {0, 1}};
  CHECK_THROWS_ERROR(dist::simulate_step(toy(), forward, {{2, 1}, {0, 1}}),
                     "simulate_step: unit a has no backward segment");
  CHECK_THROWS_ERROR(dist::simulate_step(toy(), {{0, 1}, {2, 1}, {1, 1}}, backward),
                     "simulate_step: the forward segments reach unit b before unit a, the units' order");
  CHECK_THROWS_ERROR(dist::simulate_step(toy(), forward, {{3, 1}, {2, 1}, {1, 1}, {0, 1}}),
                     "simulate_step: a backward segment names unit 3 of 3 with 1 s");
  CHECK_THROWS_ERROR(dist::simulate_step(toy(), {{0, -1}, {1, 1}, {2, 1}}, backward),
                     "simulate_step: a forward segment names unit 0 of 3 with -1 s");
}

TEST_CASE(
    "simulate_step: compute and collectives that share the cores each run at half speed beside the other",
    "[dist][schedule]") {
  // The root and a, both slowdowns 2. Forward: the root's gather alone 0-1 (waited); its forward (2 s
  // alone) beside a's gather (2 s alone) from 1: both take 4, to 5; a 5-8. Backward: a gathers again alone
  // 8-10 (waited), runs 10-16 alone, reduces from 16 beside the root's backward (4 s alone): the reduction
  // takes 4 (to 20), by which the root did 2 s of work, the other 2 alone to 22; the root's reduction alone
  // 22-23 (waited); the optimizer 23-24. Without sharing the same step ends at 20.
  const std::vector<dist::UnitTimes> units = {
      {.name = "root",
       .forward = 2,
       .backward = 4,
       .gather = 1,
       .reduce = 1,
       .reshards_after_forward = false},
      {.name = "a", .forward = 3, .backward = 6, .gather = 2, .reduce = 2}};
  const dist::Schedule shared = dist::simulate_step(
      units, {.prefetch = 1, .optimizer = 1, .compute_slowdown = 2, .communication_slowdown = 2});
  const std::vector<Drawn> expected = {{'n', "all-gather root", 0, 1},
                                       {'n', "all-gather a", 1, 5},
                                       {'c', "forward root", 1, 5},
                                       {'c', "forward a", 5, 8},
                                       {'n', "all-gather (backward) a", 8, 10},
                                       {'c', "backward a", 10, 16},
                                       {'n', "reduce a", 16, 20},
                                       {'c', "backward root", 16, 22},
                                       {'n', "reduce root", 22, 23},
                                       {'c', "optimizer", 23, 24}};
  CHECK(drawn(shared) == expected);
  CHECK(shared.step == 24);
  CHECK(shared.exposed_communication == 4);
  CHECK(dist::simulate_step(units, {.prefetch = 1, .optimizer = 1}).step == 20);
  CHECK_THROWS_ERROR(dist::simulate_step(units, {.compute_slowdown = 0.5}),
                     "simulate_step: the slowdowns of compute and communication beside each other must be at "
                     "least 1, got 0.5 and 1");
}

TEST_CASE("simulate_step: two micro-batches, the first keeping its gradients, as drawn by hand",
          "[dist][schedule]") {
  // The first micro-batch is the step above without its reductions: forward 0-9, backward b 11-17, a
  // 17-23, the root 23-27. The second gathers every unit again from 27 (the root's 27-28 exposed) and
  // runs 27 later than the first step, reducing: b 44-46, a 50-52, the root 54-55 (exposed); the
  // optimizer 55-56. Waits: 1 + 2, then 1 + 2 + 1.
  const dist::Schedule schedule = dist::simulate_step(
      toy(), {.prefetch = 1, .optimizer = 1, .micro_batches = 2, .reduce_every_micro_batch = false});
  const std::vector<Drawn> expected = {{'n', "all-gather root", 0, 1},
                                       {'n', "all-gather a", 1, 3},
                                       {'c', "forward root", 1, 3},
                                       {'n', "all-gather b", 3, 5},
                                       {'c', "forward a", 3, 6},
                                       {'c', "forward b", 6, 9},
                                       {'n', "all-gather (backward) b", 9, 11},
                                       {'n', "all-gather (backward) a", 11, 13},
                                       {'c', "backward b", 11, 17},
                                       {'c', "backward a", 17, 23},
                                       {'c', "backward root", 23, 27},
                                       {'n', "all-gather root", 27, 28},
                                       {'n', "all-gather a", 28, 30},
                                       {'c', "forward root", 28, 30},
                                       {'n', "all-gather b", 30, 32},
                                       {'c', "forward a", 30, 33},
                                       {'c', "forward b", 33, 36},
                                       {'n', "all-gather (backward) b", 36, 38},
                                       {'n', "all-gather (backward) a", 38, 40},
                                       {'c', "backward b", 38, 44},
                                       {'n', "reduce b", 44, 46},
                                       {'c', "backward a", 44, 50},
                                       {'n', "reduce a", 50, 52},
                                       {'c', "backward root", 50, 54},
                                       {'n', "reduce root", 54, 55},
                                       {'c', "optimizer", 55, 56}};
  CHECK(drawn(schedule) == expected);
  CHECK(schedule.step == 56);
  CHECK(schedule.exposed_communication == 7);
}

TEST_CASE("simulate_step: micro-batches that each reduce repeat the step's passes, waiting for their reductions",
          "[dist][schedule]") {
  // Each micro-batch is the first step's 0-28 (its root's reduction waited for at 28), the second 28
  // later; the optimizer 56-57. Waits: 4 a micro-batch.
  const dist::Schedule one = dist::simulate_step(toy(), {.prefetch = 1});
  const dist::Schedule two = dist::simulate_step(toy(), {.prefetch = 1, .optimizer = 1, .micro_batches = 2});
  std::vector<Drawn> expected = drawn(one);
  expected.pop_back();  // one's optimizer, of 0 s
  const std::size_t pass = expected.size();
  for (std::size_t i = 0; i < pass; ++i) {
    auto [lane, what, start, end] = expected[i];
    expected.emplace_back(lane, what, start + 28, end + 28);
  }
  expected.emplace_back('c', "optimizer", 56, 57);
  CHECK(one.step == 28);
  CHECK(drawn(two) == expected);
  CHECK(two.step == 57);
  CHECK(two.exposed_communication == 8);
}

TEST_CASE("simulate_step: replica all-reduces left to the last micro-batch run once, after its backward",
          "[dist][schedule]") {
  // Two units, a's replica all-reduce 3 s. Every micro-batch reduce-scatters; only the last
  // all-reduces: micro-batch 1: gather 0-1, forward 1-3, backward 3-7 (kept gathered), reduce 7-8
  // (waited); micro-batch 2: gather 8-9 ... reduce 15-16, the all-reduce 16-19; the optimizer 19-20.
  const std::vector<dist::UnitTimes> units = {
      {.name = "a", .forward = 2, .backward = 4, .gather = 1, .reduce = 1, .replica_reduce = 3,
       .reshards_after_forward = false}};
  const dist::Schedule schedule = dist::simulate_step(
      units, {.prefetch = 1, .optimizer = 1, .micro_batches = 2, .all_reduce_every_micro_batch = false});
  const std::vector<Drawn> expected = {{'n', "all-gather a", 0, 1},   {'c', "forward a", 1, 3},
                                       {'c', "backward a", 3, 7},     {'n', "reduce a", 7, 8},
                                       {'n', "all-gather a", 8, 9},   {'c', "forward a", 9, 11},
                                       {'c', "backward a", 11, 15},   {'n', "reduce a", 15, 16},
                                       {'n', "all-reduce (replicas) a", 16, 19}, {'c', "optimizer", 19, 20}};
  CHECK(drawn(schedule) == expected);
  CHECK(schedule.step == 20);
  CHECK(schedule.exposed_communication == 1 + 1 + 1 + 1 + 3);
  CHECK_THROWS_ERROR(dist::simulate_step(units, {.micro_batches = 0}),
                     "simulate_step: a step runs at least 1 micro-batch, got 0");
}
