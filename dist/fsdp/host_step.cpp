// dist/fsdp/host_step.cpp: the optimizer step on the host, unit by unit on a thread of its own
// (dist/fsdp/host_step.h), and dist::overlap_host_step, which installs it.
#include "dist/fsdp/host_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <map>
#include <utility>

#include "core/device.h"
#include "core/error.h"
#include "core/pending_read.h"
#include "core/trace.h"

namespace shardlab::dist {

namespace detail {

std::vector<StepPart> split_by_unit(std::vector<optim::ParamUpdate> updates,
                                    const std::vector<Unit*>& units) {
  std::map<const void*, std::size_t> part_of;  // a shard view's Variable -> its unit's part
  std::vector<StepPart> parts(units.size() + 1);
  for (std::size_t u = 0; u < units.size(); ++u) {
    parts[u + 1].unit = units[u];
    for (const Variable& view : units[u]->sharded_parameters()) part_of.emplace(view.impl().get(), u + 1);
  }
  for (optim::ParamUpdate& update : updates) {
    const auto it = part_of.find(update.variable.impl().get());
    parts[it == part_of.end() ? 0 : it->second].updates.push_back(std::move(update));
  }
  std::erase_if(parts, [](const StepPart& part) { return part.updates.empty(); });
  return parts;
}

namespace {

// The units in the order their parameters are first needed: the recorded forward order, then any
// unit the forward has not reached (its parameters are needed by nothing sooner).
std::vector<Unit*> update_order(const RootState& root) {
  std::vector<Unit*> order = root.forward_order;
  for (Unit* unit : root.units) {
    if (std::find(order.begin(), order.end(), unit) == order.end()) order.push_back(unit);
  }
  return order;
}

}  // namespace

HostStepRunner::HostStepRunner(std::weak_ptr<RootState> root, Device device)
    : root_(std::move(root)), device_(device), thread_([this] { work(); }) {}

HostStepRunner::~HostStepRunner() {
  {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return jobs_.empty() && !busy_; });
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void HostStepRunner::run(std::vector<optim::ParamUpdate> updates, optim::UpdateRule rule) {
  const std::shared_ptr<RootState> root = root_.lock();
  SHARDLAB_CHECK(root != nullptr,
                 "dist::overlap_host_step: the model whose shards the optimizer steps is gone");
  // The gate of step_if, read on the host: its copy is queued now behind the work that computes it
  // (the GPU's backward), and the thread waits for it, not this one.
  const Tensor gate = updates.empty() ? Tensor() : updates.front().apply;
  auto pending_gate = std::make_shared<PendingRead>();
  if (gate.defined() && gate.device().is_cuda()) *pending_gate = PendingRead({gate});

  auto parts =
      std::make_shared<std::vector<StepPart>>(split_by_unit(std::move(updates), update_order(*root)));
  auto done = std::make_shared<std::vector<std::promise<void>>>(parts->size());
  for (std::size_t i = 0; i < parts->size(); ++i) {
    if ((*parts)[i].unit != nullptr) (*parts)[i].unit->set_host_update((*done)[i].get_future().share());
  }
  enqueue([parts, done, pending_gate, gate, rule = std::move(rule)] {
    std::size_t finished = 0;
    try {
      const Tensor on_host =
          pending_gate->empty() ? gate : scalar_tensor(pending_gate->take()[0] != 0, dtype(DType::boolean));
      for (StepPart& part : *parts) {
        const trace::Span span(
            trace::on() ? "host step " + (part.unit ? display_name(part.unit->name()) : "(no unit)")
                        : std::string(),
            "compute");
        // Every parameter is in host memory (overlap_host_step refuses the others): one gate for all.
        for (optim::ParamUpdate& update : part.updates) update.apply = on_host;
        rule(part.updates);
        part.updates.clear();  // the gradients go as soon as they are used
        (*done)[finished++].set_value();
      }
    } catch (...) {
      for (std::size_t i = finished; i < done->size(); ++i)
        (*done)[i].set_exception(std::current_exception());
      throw;
    }
  });
}

void HostStepRunner::wait() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return jobs_.empty() && !busy_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void HostStepRunner::enqueue(std::function<void()> job) {
  {
    const std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  changed_.notify_all();
}

void HostStepRunner::work() {
  trace::name_this_thread("host step");
  bind_thread_to_device(device_);
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, with nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    busy_ = false;
    changed_.notify_all();
  }
}

}  // namespace detail

void overlap_host_step(optim::Optimizer& optimizer, nn::Module& root) {
  const std::shared_ptr<detail::RootState> state = detail::ensure_root(root);
  for (const detail::Unit* unit : state->units) {
    SHARDLAB_CHECK(unit->shard().device().is_cpu(),
                   "dist::overlap_host_step: unit {} keeps its shard on {}; the host steps shards in host "
                   "memory only (FsdpOptions::cpu_offload, or training on the CPU)",
                   detail::display_name(unit->name()), unit->shard().device().str());
  }
  for (std::size_t g = 0; g < optimizer.num_groups(); ++g) {
    for (const auto& [name, variable] : optimizer.group_parameters(g)) {
      SHARDLAB_CHECK(variable.data().device().is_cpu(),
                     "dist::overlap_host_step: parameter '{}' of the optimizer is on {}; the host steps "
                     "parameters in host memory only",
                     name, variable.data().device().str());
    }
  }
  const Device device = state->units.front()->device();
  optimizer.set_update_runner(std::make_shared<detail::HostStepRunner>(state, device));
}

}  // namespace shardlab::dist
