// tests/dist/test_host_step.cpp (mpirun): dist::overlap_host_step on the CPU: training with the
// optimizer's updates on the host step thread equals the optimizer in line bit for bit (clipping,
// a skipped step and an lr changed while the updates run included); the step comes in one part per
// unit, in the forward's order, each applied before that unit's next forward; a failed part is
// named by the gather that waits for it; what cannot be overlapped is refused.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "core/error.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/fsdp_parity.h"
#include "tests/dist/world.h"
#include "tests/thread_bindings.h"

using namespace shardlab;
using namespace shardlab::test;  // Nested, its batches, and the parity runs

namespace {

constexpr int kSteps = 4;
const std::int64_t kVocab = 11;

Nested offloaded_model() {
  Nested model(kVocab, kSeed);
  const dist::FsdpOptions options{.cpu_offload = true};
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
  return model;
}

// What a training loop does: the forward and backward of step k, then step k-1 settled, then the
// gradients clipped and the update gated (step 2's gate false), the lr changed right after while
// the updates may still run.
Run train(bool overlap, nn::StateDict& optimizer_state) {
  Nested model = offloaded_model();
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  if (overlap) dist::overlap_host_step(optimizer, *model);
  Run run;
  std::optional<bool> unsettled;
  for (int step = 0; step < kSteps; ++step) {
    const auto batch = token_batch(step, kGlobalBatch, kVocab, world().rank(), world().size());
    Variable loss = cross_entropy(model(batch.tokens), batch.targets);
    optimizer.zero_grad();
    loss.backward();
    if (unsettled) optimizer.settle_step(*unsettled);
    (void)optim::clip_grad_norm_(model->parameters(), 0.05);
    unsettled = step != 2;
    optimizer.step_if(scalar_tensor(*unsettled, dtype(DType::boolean)));
    optimizer.set_lr(1e-2 / (step + 2));
    run.losses.push_back(mean_over_ranks(loss.data().item<float>()));
  }
  optimizer.settle_step(*unsettled);
  run.parameters = dist::gather_full_parameters(*model);
  for (const auto& [key, value] : optimizer.state_dict()) optimizer_state.emplace_back(key, value.clone());
  return run;
}

}  // namespace

TEST_CASE("overlap_host_step trains as the optimizer in line, bit for bit", "[dist][fsdp][host_step]") {
  nn::StateDict in_line_state, overlapped_state;
  const Run in_line = train(false, in_line_state);
  const Run overlapped = train(true, overlapped_state);
  CHECK(mismatches_on_any_rank(overlapped, in_line, 0.0, 0.0) == 0);
  REQUIRE(overlapped_state.size() == in_line_state.size());
  for (std::size_t i = 0; i < in_line_state.size(); ++i) {
    INFO(in_line_state[i].first);
    CHECK(overlapped_state[i].first == in_line_state[i].first);
    CHECK(overlapped_state[i].second.to_vector<double>() == in_line_state[i].second.to_vector<double>());
  }
}

namespace {

// Which unit holds each of the model's shards, by the shard's Variable.
std::map<const void*, std::string> units_of_shards(Nested& model) {
  std::map<const void*, std::string> unit_of;
  for (const auto& [name, shard] : model->named_parameters()) {
    const auto dot = name.find('.', std::string("blocks.").size());
    unit_of[shard.impl().get()] = name.starts_with("blocks.") ? name.substr(0, dot) : "(root)";
  }
  return unit_of;
}

// What happened, in order, from both threads: "update <unit>" when the host step thread applied a
// part, "forward <unit>" when a unit's forward began (after FSDP gathered it).
struct Log {
  std::mutex mutex;
  std::vector<std::string> events;
  void add(std::string event) {
    const std::lock_guard lock(mutex);
    events.push_back(std::move(event));
  }
};

// p -= lr * g, logging the unit of each part it is given; it fails on `failing` unit's part.
class LoggingSgd final : public optim::OptimizerWith<optim::SGDOptions> {
 public:
  LoggingSgd(Nested& model, Log& log, std::string failing = "")
      : OptimizerWith(model->named_parameters(), {.lr = 0.1}),
        log_(&log),
        unit_of_(units_of_shards(model)),
        failing_(std::move(failing)) {}

 protected:
  optim::UpdateRule update_rule() const override {
    return [log = log_, unit_of = unit_of_, failing = failing_](std::span<const optim::ParamUpdate> updates) {
      std::set<std::string> units;
      for (const optim::ParamUpdate& update : updates) units.insert(unit_of.at(update.variable.impl().get()));
      const std::string unit = fmt::format("{}", fmt::join(units, "+"));
      if (unit == failing) throw Error("injected failure of " + unit);
      for (const optim::ParamUpdate& update : updates)
        update.param.copy_(sub(update.param, mul(update.grad, 0.1)));
      log->add("update " + unit);
    };
  }
  std::vector<std::string> slot_names(std::span<const double>) const override { return {}; }

 private:
  Log* log_;
  std::map<const void*, std::string> unit_of_;
  std::string failing_;
};

void log_forwards(Nested& model, Log& log) {
  const auto hook = [&log](const std::string& unit) {
    return [&log, unit](nn::Module&, nn::ForwardInputs&) { log.add("forward " + unit); };
  };
  model->register_forward_pre_hook(hook("(root)"));  // after FSDP's: it runs once the unit is gathered
  for (std::size_t i = 0; i < model->blocks->size(); ++i)
    (*model->blocks)[i].register_forward_pre_hook(hook(fmt::format("blocks.{}", i)));
}

void step(Nested& model, optim::Optimizer& optimizer, int k) {
  const auto batch = token_batch(k, kGlobalBatch, kVocab, world().rank(), world().size());
  Variable loss = cross_entropy(model(batch.tokens), batch.targets);
  optimizer.zero_grad();
  loss.backward();
  optimizer.step();
}

}  // namespace

TEST_CASE("overlap_host_step: one part per unit in the forward's order, each before the unit's next forward",
          "[dist][fsdp][host_step]") {
  Nested model = offloaded_model();
  Log log;
  LoggingSgd optimizer(model, log);
  dist::overlap_host_step(optimizer, *model);
  log_forwards(model, log);
  for (int k = 0; k < 3; ++k) step(model, optimizer, k);
  optimizer.wait_for_updates();

  const std::vector<std::string> order = {"(root)", "blocks.0", "blocks.1", "blocks.2"};
  std::vector<std::string> expected;
  for (int k = 0; k < 3; ++k) {
    for (const std::string& unit : order) expected.push_back("forward " + unit);
  }
  // Each step's parts come after its forwards and before the next step's forward of their unit;
  // how they interleave with the forwards before that is the threads' timing.
  std::vector<std::string> forwards, updates;
  std::map<std::string, int> pending;  // per unit: updates logged since its last forward
  for (const std::string& event : log.events) {
    const std::string unit = event.substr(event.find(' ') + 1);
    if (event.starts_with("forward ")) {
      forwards.push_back(event);
      INFO("at " << event);
      CHECK(pending[unit] == (forwards.size() > order.size() ? 1 : 0));
      pending[unit] = 0;
    } else {
      updates.push_back(unit);
      ++pending[unit];
    }
  }
  CHECK(forwards == expected);
  std::vector<std::string> three_steps;
  for (int k = 0; k < 3; ++k) three_steps.insert(three_steps.end(), order.begin(), order.end());
  CHECK(updates == three_steps);
}

TEST_CASE(
    "overlap_host_step: a part that fails is named by the gather that waits for it, and by the optimizer",
    "[dist][fsdp][host_step]") {
  Nested model = offloaded_model();
  Log log;
  LoggingSgd optimizer(model, log, "blocks.1");
  dist::overlap_host_step(optimizer, *model);
  step(model, optimizer, 0);  // its parts run after it returns
  const auto batch = token_batch(1, kGlobalBatch, kVocab, world().rank(), world().size());
  CHECK_THROWS_ERROR(
      model(batch.tokens),
      "FSDP: the optimizer step of unit blocks.1 failed on the host step thread: injected failure of "
      "blocks.1");
  CHECK_THROWS_ERROR(optimizer.wait_for_updates(), "injected failure of blocks.1");
  CHECK_NOTHROW(optimizer.wait_for_updates());  // told once
  // The parts before it were applied, the ones after it were not.
  CHECK(std::vector<std::string>(log.events.begin(), log.events.end()) ==
        std::vector<std::string>{"update (root)", "update blocks.0"});
}

TEST_CASE("overlap_host_step refuses a module that is no FSDP root", "[dist][fsdp][host_step]") {
  nn::Linear plain(nn::LinearOptions(3, 2));
  optim::SGD optimizer(plain->named_parameters(), {.lr = 0.1});
  CHECK_THROWS_ERROR(dist::overlap_host_step(optimizer, *plain),
                     "FSDP: the root Linear is not sharded; call dist::fully_shard on it last");
}

TEST_CASE("the host step thread makes the units' device current first", "[dist][fsdp][host_step]") {
  const test::ThreadBindings bindings;
  {
    Nested model = offloaded_model();
    optim::SGD optimizer(model->named_parameters(), {.lr = 0.1});
    dist::overlap_host_step(optimizer, *model);
  }
  // The host step thread (and any communication thread sharding started) bound the units' device.
  const std::vector<Device> bound = bindings.by_other_threads();
  CHECK_FALSE(bound.empty());
  CHECK(std::count(bound.begin(), bound.end(), Device::cpu()) == static_cast<std::ptrdiff_t>(bound.size()));
}
