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
  CHECK_THROWS_ERROR(
      dist::simulate_step(units),
      "simulate_step: unit a has a negative time (forward 3, backward 6, gather -1, reduce 2 s)");
  CHECK_THROWS_ERROR(dist::simulate_step(toy(), {.prefetch = -1}),
                     "simulate_step: prefetch must be at least 0 and reductions in flight at least 1, the "
                     "optimizer's time not negative; got -1, 2 and 0 s");
}
