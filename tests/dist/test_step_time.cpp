// tests/dist/test_step_time.cpp: the predicted step time of a fixed plan, dry step and rates against
// a timeline drawn by hand; the units' cost labels on a sharded model's real step (also after a
// forward that threw); and the refusals.
#include <set>
#include <string>
#include <vector>

#include "autograd/functional.h"
#include "dist/fsdp/step_time.h"
#include "tests/check.h"
#include "tests/dist/save_helpers.h"
#include "tests/dist/world.h"

using namespace shardlab;

namespace {

// Two units over 2 ranks: the root (kept whole for backward) and "layer" (gathered again).
dist::Plan two_units() {
  dist::Plan plan{
      .world_size = 2, .shard_group_size = 2, .prefetch = 1, .optimizer_state_bytes_per_element = 8};
  plan.units = {{.name = "",
                 .shard_group_size = 2,
                 .parameters = 500,
                 .shard_elements = 250,
                 .unsharded_bytes = 1000,
                 .reduce_scatter_input_bytes = 1000},
                {.name = "layer",
                 .shard_group_size = 2,
                 .parameters = 2000,
                 .shard_elements = 1000,
                 .unsharded_bytes = 4000,
                 .backward_gathers = 1,
                 .reduce_scatter_input_bytes = 4000}};
  return plan;
}

KernelCost dense(std::string label, double flops) {
  return {.op = "matmul", .label = std::move(label), .dtype = DType::f32, .dense = true, .flops = flops};
}
KernelCost moving(std::string label, double bytes) {
  return {.op = "add", .label = std::move(label), .dtype = DType::f32, .bytes = bytes};
}

// 1 GFLOP/s, 1 GB/s, no per-call time; every collective 1 ms + 1 us per byte sent.
DeviceRates unit_rates() {
  return {.device = "test device", .dense = {{DType::f32, {{1e3, 1e9}}}}, .bytes_per_second = 1e9};
}
dist::CollectiveRates unit_link() {
  const dist::LinkFit fit{.latency_seconds = 1e-3, .seconds_per_byte = 1e-6};
  return {.ranks = 2,
          .fits = {{dist::Collective::all_gather, fit},
                   {dist::Collective::reduce_scatter, fit},
                   {dist::Collective::all_reduce, fit}}};
}

}  // namespace

TEST_CASE("predict_step_time: a two-unit step, its units' times and its timeline, by hand",
          "[dist][step_time]") {
  // The dry step: the root's embedding 2 ms, the layer 4 ms, the root's head 1 ms (bytes), the loss
  // and its gradient 1 ms (bytes, before any backward label: the forward's end); the root's head's
  // backward 2 ms, the layer's 8 ms, the root's embedding's 4 ms; a call of another thread (no label)
  // left out.
  const std::vector<KernelCost> dry = {
      dense("forward (root)", 2e6), dense("forward layer", 4e6),   moving("forward (root)", 1e6),
      moving("step", 5e5),          moving("step", 5e5),           dense("backward (root)", 2e6),
      dense("backward layer", 8e6), dense("backward (root)", 4e6), moving("", 1e9)};
  const dist::StepTimePrediction predicted =
      dist::predict_step_time(two_units(), dry, unit_rates(), unit_link(), {.small_all_reduces = 1});

  // Collectives: 1 ms + 1 us x half the buffer (a ring of 2): the root's 1.5 ms, the layer's 3 ms; the
  // small all-reduce 1 ms + 8 us. The optimizer: 32 bytes an element of 1250 (4 read, 4 written, 4 of
  // gradient, 16 of state both ways, 4 read again by the norm): 40 us.
  REQUIRE(predicted.units.size() == 2);
  const dist::UnitStepTime &root = predicted.units[0], &layer = predicted.units[1];
  CHECK(root.name == "(root)");
  CHECK(root.forward == Approx(3e-3));
  CHECK(root.backward == Approx(6e-3));
  CHECK(root.gather == Approx(1.5e-3));
  CHECK(root.reduce == Approx(1.5e-3));
  CHECK(layer.name == "layer");
  CHECK(layer.forward == Approx(4e-3));
  CHECK(layer.backward == Approx(8e-3));
  CHECK(layer.gather == Approx(3e-3));
  CHECK(layer.reduce == Approx(3e-3));
  CHECK(predicted.outside_units == Approx(1e-3));
  CHECK(predicted.optimizer == Approx(4e-5));
  CHECK(predicted.synchronisation == Approx(1.008e-3));

  // The timeline (ms): the root's gather 0-1.5 (waited), its embedding 1.5-3.5 with the layer's gather
  // 1.5-4.5 (waited 1), the layer 4.5-8.5, the root's head 8.5-9.5, the loss 9.5-10.5; backward: the
  // root 10.5-12.5 prefetching the layer's gather 10.5-13.5 (waited 1), the layer 13.5-21.5, its
  // reduction 21.5-24.5, the root 21.5-25.5, its reduction 25.5-27, the small all-reduce 27-28.008
  // (waited 2.508), the optimizer to 28.048.
  CHECK(predicted.step() == Approx(28.048e-3));
  CHECK(predicted.exposed() == Approx(6.008e-3));
  CHECK(root.bounds.communication == Approx(1.5e-3));
  CHECK(layer.bounds.communication == Approx(2e-3));
  CHECK(root.bounds.dense == Approx(8e-3));
  CHECK(root.bounds.memory == Approx(1e-3));
  CHECK(std::string(root.bounds.limited_by()) == "compute");
  CHECK(predicted.bounds.communication == Approx(6.008e-3));
  CHECK(predicted.bounds.memory == Approx(2.04e-3));
  CHECK(std::string(predicted.bounds.limited_by()) == "compute");
  CHECK(predicted.by_op.at("matmul") == Approx(20e-3));
  CHECK(predicted.by_op.at("add") == Approx(2e-3));

  // Slower links: the same step limited by communication.
  dist::CollectiveRates slow = unit_link();
  for (auto& [op, fit] : slow.fits) fit.seconds_per_byte = 1e-4;
  const dist::StepTimePrediction waiting = dist::predict_step_time(two_units(), dry, unit_rates(), slow);
  CHECK(std::string(waiting.bounds.limited_by()) == "communication");
  CHECK(waiting.step() > predicted.step());

  const std::string report = dist::step_time_report(predicted, 28.048e-3 * 1.1, 0.25);
  CHECK(report ==
        "step time: measured 30.9 ms, predicted 28.0 ms (-9.1%); exposed communication: measured 25.0%, "
        "predicted 21.4% of the step (-3.6 points)");
}

TEST_CASE("predict_step_time: refusals name the label, the mode and the rates", "[dist][step_time]") {
  CHECK_THROWS_ERROR(
      dist::predict_step_time(two_units(), {dense("forward nowhere", 1e6)}, unit_rates(), unit_link()),
      "predict_step_time: a call of the dry step (matmul) is labelled 'forward nowhere', which "
      "names no unit of the plan");
  dist::Plan bitwise = two_units();
  bitwise.bitwise = true;
  CHECK_THROWS_ERROR(dist::predict_step_time(bitwise, {}, unit_rates(), unit_link()),
                     "predict_step_time: bitwise training's exact sums are not modelled");
  CHECK_THROWS_ERROR(dist::predict_step_time(two_units(), {dense("step", 1e6)}, unit_rates(), {.ranks = 2}),
                     "collective_seconds: no fit for all_gather over 2 ranks");
}

TEST_CASE("FSDP's hooks label each unit's forward and backward calls, also after a forward that threw",
          "[dist][step_time]") {
  test::Nested model = test::make_model(test::world(), {dist::Sharding::full});
  const std::int64_t vocab = test::kVocab;
  const auto step = [&](const Tensor& tokens) {
    const test::TokenBatch batch = test::token_batch(0, 4, vocab);
    return kernel_costs([&] {
      const dist::StepCostLabel label;
      cross_entropy(model(tokens), batch.targets).backward();
    });
  };
  const auto check_labels = [&](const std::vector<KernelCost>& costs) {
    std::set<std::string> labels;
    for (const KernelCost& cost : costs) labels.insert(cost.label);
    labels.erase("");  // the communication thread's calls
    const std::set<std::string> expected = {"step",
                                            "forward (root)",
                                            "forward blocks.0",
                                            "forward blocks.1",
                                            "forward blocks.2",
                                            "backward (root)",
                                            "backward blocks.0",
                                            "backward blocks.1",
                                            "backward blocks.2"};
    CHECK(labels == expected);
    CHECK(costs.front().label == "forward (root)");
    CHECK(innermost_cost_label() == "");
    const dist::StepTimePrediction predicted =
        dist::predict_step_time(dist::explain(*model), costs, unit_rates(), unit_link());
    for (const dist::UnitStepTime& unit : predicted.units) {
      INFO(unit.name);
      CHECK(unit.forward > 0);
      CHECK(unit.backward > 0);
    }
  };
  const Tensor tokens = test::token_batch(0, 4, vocab).tokens;
  check_labels(step(tokens));

  // Tokens beyond the vocabulary: the root's embedding throws inside its forward, its label left open.
  const Tensor beyond = from_vector(std::vector<std::int64_t>{vocab + 5, 0, 1, 2}, {4});
  CHECK_THROWS_ERROR(step(beyond), "index");
  CHECK(innermost_cost_label() == "forward (root)");
  check_labels(step(tokens));  // the next step's forward closed it
}
