// optim/scheduler.cpp: the LRScheduler base and the closed forms of StepLR, LinearLR,
// CosineAnnealingLR and SequentialLR, with their argument checks.
#include "optim/scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace shardlab::optim {

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer), base_lrs_(optimizer.initial_lrs()) {}

void LRScheduler::step() {
  ++epoch_;
  apply();
}

void LRScheduler::set_epoch(std::int64_t epoch) {
  SHARDLAB_CHECK(epoch >= 0, "LRScheduler: set_epoch needs an epoch >= 0, got {}", epoch);
  epoch_ = epoch;
  apply();
}

void LRScheduler::apply() {
  for (std::size_t g = 0; g < base_lrs_.size(); ++g) optimizer_.set_lr(g, lr_at(epoch_, base_lrs_[g]));
}

// --- StepLR ----------------------------------------------------------------------------------

namespace {
std::int64_t checked_step_size(std::int64_t step_size) {
  SHARDLAB_CHECK(step_size >= 1, "StepLR: step_size must be >= 1, got {}", step_size);
  return step_size;
}
double checked_gamma(double gamma) {
  SHARDLAB_CHECK(gamma > 0, "StepLR: gamma must be > 0, got {}", gamma);
  return gamma;
}
}  // namespace

StepLR::StepLR(Optimizer& optimizer, std::int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size(checked_step_size(step_size)), gamma(checked_gamma(gamma)) {
  apply();
}

double StepLR::lr_at(std::int64_t epoch, double base_lr) const {
  return base_lr * std::pow(gamma, static_cast<double>(epoch / step_size));
}

// --- LinearLR --------------------------------------------------------------------------------

namespace {
double checked_start(double start_factor) {
  // A zero start would make the first lr 0 and, in PyTorch's recursive form, divide by it.
  SHARDLAB_CHECK(start_factor > 0 && start_factor <= 1, "LinearLR: start_factor must be in (0, 1], got {}",
                 start_factor);
  return start_factor;
}
double checked_end(double end_factor) {
  SHARDLAB_CHECK(end_factor >= 0 && end_factor <= 1, "LinearLR: end_factor must be in [0, 1], got {}",
                 end_factor);
  return end_factor;
}
std::int64_t checked_total_iters(std::int64_t total_iters) {
  SHARDLAB_CHECK(total_iters >= 1, "LinearLR: total_iters must be >= 1, got {}", total_iters);
  return total_iters;
}
}  // namespace

LinearLR::LinearLR(Optimizer& optimizer, double start_factor, double end_factor, std::int64_t total_iters)
    : LRScheduler(optimizer),
      start_factor(checked_start(start_factor)),
      end_factor(checked_end(end_factor)),
      total_iters(checked_total_iters(total_iters)) {
  apply();
}

double LinearLR::lr_at(std::int64_t epoch, double base_lr) const {
  const double progress =
      static_cast<double>(std::min(epoch, total_iters)) / static_cast<double>(total_iters);
  return base_lr * (start_factor + (end_factor - start_factor) * progress);
}

// --- CosineAnnealingLR -----------------------------------------------------------------------

namespace {
std::int64_t checked_t_max(std::int64_t t_max) {
  SHARDLAB_CHECK(t_max >= 1, "CosineAnnealingLR: t_max must be >= 1, got {}", t_max);
  return t_max;
}
double checked_eta_min(double eta_min) {
  SHARDLAB_CHECK(eta_min >= 0, "CosineAnnealingLR: eta_min must be >= 0, got {}", eta_min);
  return eta_min;
}
}  // namespace

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, std::int64_t t_max, double eta_min)
    : LRScheduler(optimizer), t_max(checked_t_max(t_max)), eta_min(checked_eta_min(eta_min)) {
  apply();
}

double CosineAnnealingLR::lr_at(std::int64_t epoch, double base_lr) const {
  const double angle = std::numbers::pi * static_cast<double>(epoch) / static_cast<double>(t_max);
  return eta_min + (base_lr - eta_min) * (1.0 + std::cos(angle)) / 2.0;
}

// --- SequentialLR ----------------------------------------------------------------------------

SequentialLR::SequentialLR(Optimizer& optimizer, std::vector<std::unique_ptr<LRScheduler>> schedulers,
                           std::vector<std::int64_t> milestones)
    : LRScheduler(optimizer), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  SHARDLAB_CHECK(!schedulers_.empty(), "SequentialLR: needs at least one scheduler");
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    SHARDLAB_CHECK(schedulers_[i] != nullptr, "SequentialLR: scheduler {} is null", i);
    SHARDLAB_CHECK(&optimizer_of(*schedulers_[i]) == &optimizer_,
                   "SequentialLR: scheduler {} drives another optimizer than the SequentialLR", i);
  }
  SHARDLAB_CHECK(milestones_.size() + 1 == schedulers_.size(),
                 "SequentialLR: {} schedulers need {} milestones, got {}", schedulers_.size(),
                 schedulers_.size() - 1, milestones_.size());
  // A milestone at 0 (or a repeated one) would give a part no epoch at all.
  if (!milestones_.empty()) {
    SHARDLAB_CHECK(milestones_[0] >= 1, "SequentialLR: milestones must be >= 1, got {}", milestones_[0]);
  }
  for (std::size_t i = 1; i < milestones_.size(); ++i) {
    SHARDLAB_CHECK(milestones_[i] > milestones_[i - 1],
                   "SequentialLR: milestones must be strictly increasing, got {} after {}", milestones_[i],
                   milestones_[i - 1]);
  }
  // The parts' constructors each set the lr to their own start; this one wins.
  apply();
}

double SequentialLR::lr_at(std::int64_t epoch, double base_lr) const {
  // The part whose range holds `epoch`: the number of milestones at or before it.
  const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), epoch) - milestones_.begin();
  const std::int64_t start = passed == 0 ? 0 : milestones_[static_cast<std::size_t>(passed - 1)];
  return schedulers_[static_cast<std::size_t>(passed)]->lr_at(epoch - start, base_lr);
}

}  // namespace shardlab::optim
