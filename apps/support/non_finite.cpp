// apps/support/non_finite.cpp: the skip decision, its log lines and the error that stops a run.
#include "apps/support/non_finite.h"

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/comm/log.h"

namespace shardlab::apps {

namespace {

// A NaN whatever its sign bit (fmt prints "-nan" for some).
std::string number_text(double value) { return std::isnan(value) ? "nan" : fmt::format("{}", value); }

std::string resume_advice(const CheckpointDir& checkpoints) {
  if (checkpoints.dir().empty()) return "there is no checkpoint to resume from (no --checkpoint-dir)";
  const std::vector<std::int64_t> saved = checkpoints.steps();
  if (saved.empty()) return fmt::format("there is no complete checkpoint in '{}'", checkpoints.dir());
  return fmt::format("the newest checkpoint is {}: resume from it with --resume, perhaps with a lower --lr",
                     checkpoints.path(saved.back()));
}

}  // namespace

bool NonFiniteSteps::skip(std::int64_t step, bool finite, double loss, double grad_norm,
                          const CheckpointDir& checkpoints) {
  if (finite) {
    in_a_row_ = 0;
    return false;
  }
  ++in_a_row_;
  const std::string values =
      fmt::format("the loss ({}) or the gradient norm ({})", number_text(loss), number_text(grad_norm));
  if (in_a_row_ > limit_) {
    const std::int64_t first = step - in_a_row_ + 1;
    fail(
        "stopped at step {}: {} was not finite for {} steps in a row (steps {} to {}), more than "
        "--max-skipped-steps {}; the model is as after step {} (a skipped step changes nothing), and {}",
        step, values, in_a_row_, first, step, limit_, first - 1, resume_advice(checkpoints));
  }
  ++skipped_;
  dist::log(
      "{}: step {} skipped: {} is not finite ({} in a row, {} in all; more than {} in a row stop the run)",
      program_, step, values, in_a_row_, skipped_, limit_);
  return true;
}

void NonFiniteSteps::report() const {
  if (skipped_ > 0)
    dist::log("{}: {} steps skipped for a non-finite loss or gradient norm", program_, skipped_);
}

}  // namespace shardlab::apps
