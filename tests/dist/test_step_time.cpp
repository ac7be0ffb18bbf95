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

namespace {

// A root holding `outer` (16 x 4 + 4 parameters) around the unit `inner` (16 x 16 + 16).
class TwoLinearsImpl : public nn::Module {
 public:
  TwoLinearsImpl()
      : nn::Module("TwoLinears"), inner(nn::LinearOptions(16, 16)), outer(nn::LinearOptions(16, 4)) {
    register_module("inner", inner.ptr());
    register_module("outer", outer.ptr());
    nn::initialize(*this, 1);
  }
  nn::Linear inner, outer;
};
using TwoLinears = nn::Holder<TwoLinearsImpl>;

}  // namespace

TEST_CASE("predict_step_time: a what-if, the plan at 8 ranks over an assumed link and device, by hand",
          "[dist][step_time]") {
  // Sharded by each rank alone, planned for 8: `inner` 272 elements (34 a rank, 1088 B gathered), the root
  // 68 padded to 72 (9 a rank, 288 B); four parameters' gradient flags.
  const std::unique_ptr<dist::Communicator> alone = test::world().split(test::world().rank(), 0, "alone");
  TwoLinears model;
  dist::fully_shard(*model->inner, {.communicator = alone.get()});
  dist::fully_shard(*model, {.communicator = alone.get()});
  const dist::Plan plan = dist::explain(*model, 8, {.world_size = 8});
  REQUIRE(plan.units.size() == 2);
  CHECK(plan.units[1].shard_elements == 34);
  CHECK(plan.units[0].shard_elements == 9);
  // 2 GFLOP/s, 4 GB/s, 1 us a call; 1 GB/s sent per rank, 10 us a collective.
  const DeviceRates device = with_assumed_rates(
      unit_rates(), {.dense_flops_per_second = 2e9, .bytes_per_second = 4e9, .seconds_per_call = 1e-6});
  CHECK(device.device == "test device with assumed dense 0.002 TFLOP/s, memory 4 GB/s, 1 us a call");
  const dist::CollectiveRates link = dist::assumed_link(8, 1e9, 10e-6);
  // The root's first layer 101 us, inner 1001, the root's head 201, the loss 101; backward: the head 401,
  // inner 2001, the first layer 101 (each its flops or bytes and 1 us a call).
  const std::vector<KernelCost> dry = {dense("forward (root)", 2e5),  dense("forward inner", 2e6),
                                       dense("forward (root)", 4e5),  moving("step", 4e5),
                                       dense("backward (root)", 8e5), dense("backward inner", 4e6),
                                       dense("backward (root)", 2e5)};
  const dist::StepTimePrediction predicted = dist::predict_step_time(plan, dry, device, link);
  // A ring of 8 sends 7/8 of the buffer: inner's gather and reduce-scatter 10 + 0.952 us, the root's 10 +
  // 0.252 us; the flags' all-reduce (4 bytes, twice 7/8 of them) 10.007 us. The optimizer: 32 B an element
  // of 43 at 4 GB/s and two calls a unit, 4.344 us.
  const dist::UnitStepTime &root = predicted.units[0], &inner = predicted.units[1];
  CHECK(inner.gather == Approx(10.952e-6));
  CHECK(inner.reduce == Approx(10.952e-6));
  CHECK(root.gather == Approx(10.252e-6));
  CHECK(root.reduce == Approx(10.252e-6));
  CHECK(inner.forward == Approx(1001e-6));
  CHECK(inner.backward == Approx(2001e-6));
  CHECK(root.forward == Approx(302e-6));
  CHECK(root.backward == Approx(502e-6));
  CHECK(predicted.synchronisation == Approx(10.007e-6));
  CHECK(predicted.optimizer == Approx(4.344e-6));
  // The timeline (us): the root's gather 0-10.252 (waited; inner's hides behind the root's first layer),
  // forward to 1414.252, backward to 3917.252 (inner's reduce-scatter hidden behind the first layer's
  // backward), the root's reduce-scatter to 3927.504 and the flags to 3937.511 (waited), the optimizer
  // to 3941.855.
  CHECK(predicted.step() == Approx(3941.855e-6));
  CHECK(predicted.exposed() == Approx(30.511e-6));
  CHECK(predicted.link ==
        "8 ranks: all_gather 10 us + 1.00 GB/s; reduce_scatter 10 us + 1.00 GB/s; all_reduce 10 "
        "us + 1.00 GB/s; beside each other collectives 1.0x slower, compute 1.00x");
}

TEST_CASE("predict_step_time: CPU offload's copies and host update, by hand", "[dist][step_time]") {
  // The layer offloaded: its 1000-element f32 shard (4000 B) comes in at 100 MB/s before each gather
  // (40 us) and its gradient shard goes out at 50 MB/s after the reduction (80 us); its update runs on the
  // host at 10 ns an element, the root's on the device at 1 ns.
  dist::Plan plan = two_units();
  plan.units[1].offloaded = true;
  DeviceRates device = unit_rates();
  device.host_to_device_bytes_per_second = 1e8;
  device.device_to_host_bytes_per_second = 5e7;
  const std::vector<KernelCost> dry = {dense("forward (root)", 2e6), dense("forward layer", 4e6),
                                       dense("backward layer", 8e6), dense("backward (root)", 4e6)};
  const dist::StepTimePrediction predicted =
      dist::predict_step_time(plan, dry, device, unit_link(),
                              {.update_seconds_per_element = 1e-9, .host_update_seconds_per_element = 1e-8});
  const dist::UnitStepTime &root = predicted.units[0], &layer = predicted.units[1];
  CHECK(root.gather == Approx(1.5e-3));
  CHECK(root.reduce == Approx(1.5e-3));
  CHECK(layer.gather == Approx(3.04e-3));
  CHECK(layer.reduce == Approx(3.08e-3));
  // The norm reads 1250 gradient elements (5 us at 1 GB/s); the updates 250 x 1 ns + 1000 x 10 ns.
  CHECK(predicted.optimizer == Approx(15.25e-6));

  DeviceRates without = unit_rates();
  CHECK_THROWS_ERROR(
      dist::predict_step_time(plan, dry, without, unit_link()),
      "predict_step_time: unit 'layer' is offloaded to the host, and the rates of test device hold no "
      "copy rate between host and device");
}

TEST_CASE("assumed rates and links refuse values out of range by name", "[dist][step_time]") {
  CHECK_THROWS_ERROR(with_assumed_rates(unit_rates(), {.dense_flops_per_second = 0}),
                     "with_assumed_rates: the dense rate must be positive, got 0");
  CHECK_THROWS_ERROR(with_assumed_rates(unit_rates(), {.bytes_per_second = -1}),
                     "with_assumed_rates: the memory rate must be positive, got -1");
  CHECK_THROWS_ERROR(with_assumed_rates(unit_rates(), {.seconds_per_call = -1e-6}),
                     "with_assumed_rates: the time a call must not be negative, got -1e-06");
  CHECK_THROWS_ERROR(dist::assumed_link(8, 0, 1e-6),
                     "assumed_link: the bandwidth must be positive, got 0 B/s");
  CHECK_THROWS_ERROR(dist::assumed_link(8, 1e9, -1),
                     "assumed_link: the latency must not be negative, got -1 s");
  CHECK_THROWS_ERROR(dist::assumed_link(0, 1e9, 0), "assumed_link: 0 ranks");
  CHECK(with_assumed_rates(unit_rates(), {}).device == "test device");  // nothing assumed: the measured rates
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

TEST_CASE("predict_step_time: two micro-batches, each reducing, then their gradient sums, by hand",
          "[dist][step_time]") {
  // Each pass is the step above's forward and backward (27 ms, its reductions waited for), the second
  // from 27 ms; the small all-reduce 54-55.008, the optimizer 40 us and the second micro-batch's sums
  // into the gradient shards, 12 bytes an element of 1250 at 1 GB/s: 15 us.
  const std::vector<KernelCost> dry = {
      dense("forward (root)", 2e6),  dense("forward layer", 4e6),  moving("forward (root)", 1e6),
      moving("step", 1e6),           dense("backward (root)", 2e6), dense("backward layer", 8e6),
      dense("backward (root)", 4e6)};
  dist::Plan plan = two_units();
  plan.accumulation = {.micro_batches = 2, .sync = dist::MicroBatchSync::every};
  const dist::StepTimePrediction predicted =
      dist::predict_step_time(plan, dry, unit_rates(), unit_link(), {.small_all_reduces = 1});
  CHECK(predicted.micro_batches == 2);
  CHECK(predicted.accumulation == Approx(15e-6));
  CHECK(predicted.step() == Approx(55.063e-3));
  CHECK(predicted.exposed() == Approx(2 * 5e-3 + 1.008e-3));
  CHECK(predicted.bounds.dense == Approx(2 * 20e-3));
  CHECK_THAT(predicted.str(), Catch::Matchers::Contains("2 micro-batches a step"));

  // Without sync the first keeps its gradients: its passes as above without reductions (forward 0-10.5,
  // backward to 25.5, nothing waited for at the end), then the second as the one-pass step, 28.008 ms
  // to its small all-reduce's end; the optimizer and the sums, 3 x the unsharded bytes (5000) at 1 GB/s.
  plan.accumulation.sync = dist::MicroBatchSync::last;
  const dist::StepTimePrediction kept =
      dist::predict_step_time(plan, dry, unit_rates(), unit_link(), {.small_all_reduces = 1});
  CHECK(kept.accumulation == Approx(15e-6));
  CHECK(kept.step() == Approx(25.5e-3 + 28.008e-3 + 4e-5 + 15e-6));
  CHECK(kept.exposed() == Approx(3.5e-3 + 6.008e-3));
}
