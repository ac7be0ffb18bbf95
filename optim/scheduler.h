// optim/scheduler.h: learning-rate schedules with PyTorch's closed forms, applied to every
// parameter group from its own initial lr; step() once per epoch (or iteration) after
// optimizer.step().
//
//   optim::Adadelta opt(model->named_parameters(), {.lr = 1.0});
//   optim::StepLR scheduler(opt, /*step_size=*/1, /*gamma=*/0.7);
//   for (epoch ...) { train(opt); scheduler.step(); }
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "optim/optimizer.h"

namespace shardlab::optim {

// Every schedule scales each parameter group from its own base lr (PyTorch's): group g's lr after
// `epoch` steps is lr_at(epoch, base_lrs()[g]).
class LRScheduler {
 public:
  // Takes as base lrs the groups' lrs when the optimizer's first scheduler was created (PyTorch's
  // "initial_lr", recorded on the optimizer by that first scheduler), so a scheduler created after
  // another has moved the lrs (SequentialLR's parts) still starts from the original ones.
  // Subclass constructors end with apply(), which sets every group's lr for epoch 0.
  explicit LRScheduler(Optimizer& optimizer);
  virtual ~LRScheduler() = default;
  // Advances one epoch and sets every group's lr for it.
  void step();
  std::int64_t epoch() const { return epoch_; }
  // Jumps to `epoch` (>= 0) and sets every group's lr for it: a run resumed from a checkpoint.
  void set_epoch(std::int64_t epoch);
  double last_lr(std::size_t group = 0) const { return optimizer_.lr(group); }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // The lr after `epoch` steps of a group whose base lr is base_lr, in closed form.
  virtual double lr_at(std::int64_t epoch, double base_lr) const = 0;

 protected:
  void apply();  // group g's lr = lr_at(epoch_, base_lrs_[g])
  // The optimizer another scheduler drives (SequentialLR checks its parts share one).
  static const Optimizer& optimizer_of(const LRScheduler& scheduler) { return scheduler.optimizer_; }
  Optimizer& optimizer_;
  std::int64_t epoch_ = 0;

 private:
  std::vector<double> base_lrs_;
};

// lr = base * gamma^floor(epoch / step_size); step_size >= 1, gamma > 0.
class StepLR final : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, std::int64_t step_size, double gamma = 0.1);
  double lr_at(std::int64_t epoch, double base_lr) const override;
  const std::int64_t step_size;
  const double gamma;
};

// Linear warm-up: lr = base * (start + (end - start) * min(epoch, total_iters) / total_iters):
// the factor goes from start_factor to end_factor over total_iters, then stays.
// 0 < start_factor <= 1, 0 <= end_factor <= 1 (PyTorch's ranges), total_iters >= 1.
class LinearLR final : public LRScheduler {
 public:
  LinearLR(Optimizer& optimizer, double start_factor = 1.0 / 3, double end_factor = 1.0,
           std::int64_t total_iters = 5);
  double lr_at(std::int64_t epoch, double base_lr) const override;
  const double start_factor, end_factor;
  const std::int64_t total_iters;
};

// lr = eta_min + (base - eta_min) (1 + cos(pi epoch / t_max)) / 2 (the closed form PyTorch
// documents; past t_max it follows the cosine back up); t_max >= 1, eta_min >= 0.
class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, std::int64_t t_max, double eta_min = 0.0);
  double lr_at(std::int64_t epoch, double base_lr) const override;
  const std::int64_t t_max;
  const double eta_min;
};

// Runs schedulers[i] from milestones[i-1] on, each counting its epochs from its own start:
// lr_at(e, base) = schedulers[i]->lr_at(e - milestones[i-1], base) for milestones[i-1] <= e < milestones[i].
// Needs one milestone fewer than schedulers, milestones >= 1 and strictly increasing, and
// every scheduler on `optimizer`. Only the parts' closed forms are used, never their step().
//
//   std::vector<std::unique_ptr<optim::LRScheduler>> parts;
//   parts.push_back(std::make_unique<optim::LinearLR>(opt, 0.1, 1.0, 100));      // warm-up
//   parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, 900));     // then decay
//   optim::SequentialLR scheduler(opt, std::move(parts), {100});
class SequentialLR final : public LRScheduler {
 public:
  SequentialLR(Optimizer& optimizer, std::vector<std::unique_ptr<LRScheduler>> schedulers,
               std::vector<std::int64_t> milestones);
  double lr_at(std::int64_t epoch, double base_lr) const override;

 private:
  std::vector<std::unique_ptr<LRScheduler>> schedulers_;
  std::vector<std::int64_t> milestones_;
};

}  // namespace shardlab::optim
