// apps/bench_trace: what one trace site costs, recording off and on, in the forms FSDP's hot path
// uses (a span whose name is built only when recording, with an argument; a guarded counter); with
// the events a real step records (bench/trace_overhead.sh counts them) it bounds tracing's cost per
// step without timing noisy whole runs.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <string>

#include "apps/cli.h"
#include "core/trace.h"

using namespace shardlab;

namespace {

// One site as dist/fsdp/fsdp.cpp writes them: a wait span named after a tag, with the unit as argument,
// and the gathered-bytes counter.
void traced_site(const std::string& tag, std::int64_t bytes) {
  trace::Span span(trace::on() ? "wait all_gather " + tag : std::string(), "wait");
  span.arg("unit", tag);
  if (trace::on()) trace::counter("gathered parameters", {{"bytes", bytes}});
}

// The dearest event a step records: a collective's span as dist/comm/monitor.cpp writes it from the
// ledger, on its communicator's track, with its ten arguments.
void collective_event(const std::string& tag, std::int64_t sequence) {
  if (!trace::on()) return;
  const trace::Clock::time_point now = trace::Clock::now();
  trace::complete(fmt::format("all_gather {}", tag), "communication",
                  trace::named_track("communication: world"), now, now,
                  {{"communicator", std::string("world")},
                   {"sequence", sequence},
                   {"ledger_id", sequence},
                   {"op", std::string("all_gather")},
                   {"dtype", std::string("f32")},
                   {"count", std::int64_t{2048}},
                   {"tag", tag},
                   {"state", std::string("completed")},
                   {"queued_us", 1.5}});
}

// Nanoseconds per site over `sites` calls; the recorder is emptied every `batch` sites, as a traced
// step's events are bounded (the events are taken, not freed, inside the timing: a run keeps them).
template <typename Site>
double ns_per_site(std::int64_t sites, bool recording, int events_per_site, Site site) {
  const std::string tag = "pre-forward model.layers.0";
  constexpr std::int64_t batch = 4096;
  double seconds = 0;
  for (std::int64_t done = 0; done < sites; done += batch) {
    if (recording) trace::start();
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < batch; ++i) site(tag, i);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (recording) {
      trace::stop();
      (void)trace::take();
    }
  }
  // Per event when on: the unit the trace files count.
  return 1e9 * seconds / static_cast<double>(sites) / (recording ? events_per_site : 1);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("bench_trace: the cost of one trace event, recording off and on");
  std::int64_t sites = 4'000'000;
  app.add_option("--sites", sites, "trace sites to time per mode")->check(apps::integer_at_least(1));
  if (const std::optional<int> status = apps::parse_command_line(app, argc, argv, "bench_trace", true))
    return *status;
  ns_per_site(sites / 10, true, 2, traced_site);  // warm up the allocator and the track table
  const double off = ns_per_site(sites, false, 2, traced_site);
  const double on = ns_per_site(sites, true, 2, traced_site);
  const double collective = ns_per_site(sites, true, 1, collective_event);
  fmt::print("trace site, recording off: {:.2f} ns per site\n", off);
  fmt::print("trace event, recording on: {:.1f} ns per event (FSDP's spans and counters)\n", on);
  fmt::print("collective event, recording on: {:.1f} ns per event (the ledger's spans)\n", collective);
  return 0;
}
