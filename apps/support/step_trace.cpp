// apps/support/step_trace.cpp: recording the chosen steps and reporting their figures.
#include "apps/support/step_trace.h"

#include <fmt/format.h>

#include "core/error.h"
#include "dist/comm/log.h"

namespace shardlab::apps {

TraceSteps parse_trace_steps(const std::string& text, std::int64_t total_steps) {
  TraceSteps steps;
  const auto colon = text.find(':');
  std::size_t first_end = 0, last_end = 0;
  bool parsed = colon != std::string::npos;
  try {
    if (parsed) {
      steps.first = std::stoll(text.substr(0, colon), &first_end);
      steps.last = std::stoll(text.substr(colon + 1), &last_end);
    }
  } catch (const std::exception&) {
    parsed = false;
  }
  SHARDLAB_CHECK(parsed && first_end == colon && last_end == text.size() - colon - 1 && steps.first >= 1 &&
                     steps.first <= steps.last,
                 "--trace-steps '{}': expected FIRST:LAST with 1 <= FIRST <= LAST (steps count from 1, both "
                 "included), e.g. 2:3",
                 text);
  SHARDLAB_CHECK(steps.last <= total_steps,
                 "--trace-steps {}:{} asks for steps the run of {} steps does not have", steps.first,
                 steps.last, total_steps);
  return steps;
}

void StepTrace::begin_step(std::int64_t step) {
  if (dir_.empty() || step < steps_.first || step > steps_.last) return;
  if (!trace::on()) {
    trace::name_this_thread("compute");
    dist::start_trace(*comm_);
  }
  step_ = step;
  step_began_ = trace::Clock::now();
}

StepTrace::StepTrace(std::string dir, TraceSteps steps, dist::Communicator& comm)
    : dir_(std::move(dir)), steps_(steps), comm_(&comm) {
  if (!dir_.empty()) dist::create_trace_directory(comm, dir_);
}

void StepTrace::end_step() {
  if (step_ == 0) return;
  trace::memory_counter();
  trace::complete(fmt::format("step {}", step_), "step", trace::this_thread_track(), step_began_,
                  trace::Clock::now(), {{"step", step_}});
  if (step_ == steps_.last) {
    trace::stop();
    const std::vector<trace::Event> events = trace::take();
    std::vector<dist::StepFigures> figures = dist::step_figures(events);
    figures_.insert(figures_.end(), figures.begin(), figures.end());
    dist::write_trace(*comm_, dir_, events);
    dist::log("trace: wrote {}/trace.json and one trace-rank<R>.json per rank", dir_);
  }
  step_ = 0;
}

void StepTrace::report(const char* program, const MetricsFile* metrics) const {
  for (const dist::StepFigures& figure : figures_) {
    const trace::Overlap& o = figure.overlap;
    std::string waits;
    nlohmann::json wait_json = nlohmann::json::object();
    for (const auto& [unit, seconds] : figure.all_gather_wait) {
      waits += fmt::format(" {}={:.2f}", unit.empty() ? "(root)" : unit, 1e3 * seconds);
      wait_json[unit] = seconds;
    }
    dist::log(
        "{}: rank 0 traced step {}: communication {:.2f} ms, compute {:.2f} ms, exposed communication {:.2f} "
        "ms, "
        "overlap {:.1f}%; all-gather waits (ms):{}",
        program, figure.step, 1e3 * o.communication, 1e3 * o.compute, 1e3 * o.exposed, o.percent(), waits);
    if (metrics) {
      metrics->write({{"rank", comm_->rank()},
                      {"traced_step", figure.step},
                      {"step_seconds", figure.seconds},
                      {"communication_seconds", o.communication},
                      {"compute_seconds", o.compute},
                      {"exposed_communication_seconds", o.exposed},
                      {"overlap_percent", o.percent()},
                      {"all_gather_wait_seconds", wait_json}});
    }
  }
}

}  // namespace shardlab::apps
