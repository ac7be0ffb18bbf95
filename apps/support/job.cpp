// apps/support/job.cpp: the session of a training program and its failure report.
#include "apps/support/job.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <thread>

#include "dist/comm/monitor.h"

namespace shardlab::apps {

int report_failure(const char* program, dist::Session& session, const std::string& message,
                   bool same_everywhere) {
  // Long enough for ranks that fail alike to get there (they fail at the same step, but one may
  // be finishing a save); short next to any collective timeout.
  constexpr std::chrono::seconds kWaitForOthers{3};
  const bool alone = session.world_size() > 1 && !session.every_rank_failed(kWaitForOthers);
  const std::string prefix = session.world_size() > 1 ? fmt::format("[rank {}] ", session.rank()) : "";
  if (alone) {
    std::fputs(fmt::format("{}{}: {}\n{}{}: the other ranks did not fail alike: ending the job\n", prefix,
                           program, message, prefix, program)
                   .c_str(),
               stderr);
    session.abort_job(1);
  }
  if (same_everywhere) {
    if (session.rank() == 0) std::fputs(fmt::format("{}: {}\n", program, message).c_str(), stderr);
  } else {
    std::fputs(fmt::format("{}{}: {}\n", prefix, program, message).c_str(), stderr);  // one write per line
  }
  return 1;
}

void report_waiting_collective(const char* program, const dist::Session& session, int signal) {
  // A collective of a healthy step takes milliseconds; mpirun kills a job it ends a second after its SIGTERM.
  constexpr std::chrono::milliseconds kLongWait{250};
  const std::optional<dist::LedgerEntry> waiting = session.monitor().longest_in_flight();
  const auto now = dist::Clock::now();
  if (!waiting || now - waiting->started < kLongWait) return;
  std::fputs(fmt::format("[rank {}] {}: {} on host {} while in {}\n", session.rank(), program,
                         signal_name(signal), dist::host_name(), dist::format_entry(*waiting, now))
                 .c_str(),
             stderr);
}

std::unique_ptr<dist::Session> start_session(int& argc, char**& argv, const char* program,
                                             const dist::InitOptions& options) {
  try {
    return dist::init(argc, argv, options);
  } catch (const std::exception& e) {
    // Every rank fails alike (the device is agreed on before any rank goes on), and rank 0 says why.
    // mpirun ends the job when the first rank exits: the others give rank 0 the time to print first,
    // or its line could be lost with it.
    if (dist::launcher_rank() == 0) {
      std::fprintf(stderr, "%s: %s\n", program, e.what());
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return nullptr;
  }
}

}  // namespace shardlab::apps
