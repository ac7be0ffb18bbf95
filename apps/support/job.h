// apps/support/job.h: starting a training program's processes, and ending them when building
// or training fails on some ranks or all.
#pragma once

#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "apps/support/stop_signals.h"
#include "autograd/anomaly.h"
#include "dist/comm/init.h"

namespace shardlab::apps {

// dist::init for `program`; null, after printing why on stderr once per job (by the launcher's
// rank 0: "train_cnn: dist::init: device cuda was requested but ..."), when it cannot start.
std::unique_ptr<dist::Session> start_session(int& argc, char**& argv, const char* program,
                                             const dist::InitOptions& options);

// After a rank's error: when every rank failed (within a few seconds), prints it (on rank 0 only
// when `same_everywhere`, errors while building being the same on all ranks, else on each rank
// with its prefix) and returns 1. When only some ranks failed, the others would wait for them in
// a collective until the watchdog fires: the rank prints its error, saying so, and ends the job.
int report_failure(const char* program, dist::Session& session, const std::string& message,
                   bool same_everywhere);

// For a stop signal that finds this rank inside a collective for 0.25 s or more (where it cannot
// stop: mpirun ending a job whose host or link was lost, say): prints on stderr the rank, its host
// and the collective, "[rank 0] train_cnn: SIGTERM on host node1 while in #72 world all_gather(f32,
// 1179776) 'pre-forward fc1' running for 5.20 s", before the signal's sender kills the process.
void report_waiting_collective(const char* program, const dist::Session& session, int signal);

// Builds Training(options, session) on every rank, then runs it; returns the exit status: 0, 1 after
// an error, kExitStoppedBySignal when a stop signal ended it between two steps.
template <typename Training, typename Options>
int build_and_run(const char* program, dist::Session& session, const Options& options) {
  // Noted from here on, acted on between two steps.
  const StopSignals stop_signals([&](int signal) { report_waiting_collective(program, session, signal); });
  std::optional<Training> training;
  try {
    training.emplace(options, session);
  } catch (const std::exception& e) {
    return report_failure(program, session, e.what(), true);
  }
  try {
    // Only around training: the dry runs of the plan need no checks.
    const autograd::DetectAnomaly detect(options.detect_anomaly);
    if (training->run() == Training::End::stopped_by_signal) return kExitStoppedBySignal;
  } catch (const std::exception& e) {
    return report_failure(program, session, e.what(), false);
  }
  return 0;
}

}  // namespace shardlab::apps
