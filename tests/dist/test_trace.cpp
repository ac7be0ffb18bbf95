// tests/dist/test_trace.cpp (mpirun): the trace holds each collective of the ledger once, with the
// ledger's own times, and step_figures derives overlap and all-gather waits from spans as computed
// by hand on a synthetic timeline.
#include <algorithm>

#include "core/ops.h"
#include "dist/comm/communicator.h"
#include "dist/fsdp/trace.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::world;

namespace {

std::int64_t int_arg(const trace::Event& event, const std::string& key) {
  for (const trace::Arg& arg : event.args) {
    if (arg.key == key) return std::get<std::int64_t>(arg.value);
  }
  return -1;
}

// A complete span from `begin` to `end` seconds after an arbitrary origin.
trace::Event span(std::string name, std::string category, double begin, double end, trace::Args args = {}) {
  const trace::Clock::time_point origin{};
  const auto at = [&](double seconds) {
    return origin +
           std::chrono::duration_cast<trace::Clock::duration>(std::chrono::duration<double>(seconds));
  };
  return {.phase = trace::Phase::complete,
          .name = std::move(name),
          .category = std::move(category),
          .begin = at(begin),
          .end = at(end),
          .args = std::move(args)};
}

}  // namespace

TEST_CASE("every collective of the ledger appears once in the trace, timed as the ledger timed it",
          "[dist][trace]") {
  auto& comm = world();
  const int w = comm.size();
  dist::start_trace(comm);
  const auto before = comm.monitor().tail(1);
  const std::uint64_t first_id = before.empty() ? 0 : before.back().id + 1;
  Tensor gathered = zeros({4 * w}), piece = ones({4}), reduced = zeros({4}), summed = ones({8});
  std::vector<dist::Work> works;
  works.push_back(comm.all_gather_into(gathered, piece, "gather"));
  works.push_back(comm.reduce_scatter(reduced, gathered, dist::ReduceOp::sum, "scatter"));
  works.push_back(comm.all_reduce(summed));  // untagged
  works.push_back(comm.broadcast(summed, 0, "broadcast"));
  for (const dist::Work& work : works) work.wait();
  trace::stop();
  const std::vector<trace::Event> events = trace::take();

  std::vector<dist::LedgerEntry> entries;
  for (const dist::LedgerEntry& entry : comm.monitor().tail(64)) {
    if (entry.id >= first_id) entries.push_back(entry);
  }
  REQUIRE(entries.size() == works.size());
  std::vector<const trace::Event*> collectives;
  for (const trace::Event& event : events) {
    if (event.category == "communication") collectives.push_back(&event);
  }
  CHECK(collectives.size() == entries.size());
  const std::vector<std::string> names{"all_gather gather", "reduce_scatter scatter", "all_reduce",
                                       "broadcast broadcast"};
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const dist::LedgerEntry& entry = entries[i];
    INFO("ledger id " << entry.id);
    const auto count = std::count_if(collectives.begin(), collectives.end(), [&](const trace::Event* e) {
      return int_arg(*e, "ledger_id") == static_cast<std::int64_t>(entry.id);
    });
    REQUIRE(count == 1);
    const trace::Event& event =
        **std::find_if(collectives.begin(), collectives.end(), [&](const trace::Event* e) {
          return int_arg(*e, "ledger_id") == static_cast<std::int64_t>(entry.id);
        });
    CHECK(event.name == names[i]);
    CHECK(event.phase == trace::Phase::complete);
    CHECK(int_arg(event, "sequence") == static_cast<std::int64_t>(entry.sequence));
    CHECK(event.begin == entry.started);
    CHECK(event.end == entry.finished);
    CHECK(event.track == trace::named_track("communication: " + comm.name()));
  }
}

TEST_CASE("step_figures: overlap and all-gather waits per step, from a synthetic timeline", "[dist][trace]") {
  // Step 1 [0, 50]: communication [0,10] and [20,40]; compute [5,22] (forward, holding the wait
  // [15,18]) and a cast [35,50]: compute [5,15] + [18,22] + [35,50] = 29; exposed [0,5] + [22,35]
  // = 18 of 30: overlap 40%. Step 2 [100, 110]: one all-gather [100,104] during a wait, no compute
  // but the optimizer [106,110]: exposed 4 of 4, overlap 0%. Spans outside both steps count nowhere.
  const std::vector<trace::Event> events{
      span("step 1", "step", 0, 50, {{"step", std::int64_t{1}}}),
      span("all_gather pre-forward a", "communication", 0, 10),
      span("all_gather pre-backward a", "communication", 20, 30),
      span("reduce_scatter a", "communication", 25, 40),
      span("forward a", "compute", 5, 22),
      span("wait all_gather pre-backward a", "wait", 15, 18, {{"unit", std::string("a")}}),
      span("cast gradient to f32 a", "copy", 35, 50),
      span("step 2", "step", 100, 110, {{"step", std::int64_t{2}}}),
      span("all_gather pre-forward b", "communication", 100, 104),
      span("wait all_gather pre-forward b", "wait", 100, 104, {{"unit", std::string("b")}}),
      span("wait all_gather pre-backward b", "wait", 104, 105, {{"unit", std::string("b")}}),
      span("optimizer step", "compute", 106, 110),
      span("all_gather pre-forward c", "communication", 60, 70),
      span("forward c", "compute", 60, 70),
  };
  const std::vector<dist::StepFigures> figures = dist::step_figures(events);
  REQUIRE(figures.size() == 2);
  CHECK(figures[0].step == 1);
  CHECK(figures[0].overlap.communication == Approx(30));
  CHECK(figures[0].overlap.compute == Approx(29));
  CHECK(figures[0].overlap.exposed == Approx(18));
  CHECK(figures[0].overlap.percent() == Approx(40));
  REQUIRE(figures[0].all_gather_wait.size() == 1);
  CHECK(figures[0].all_gather_wait.at("a") == Approx(3));
  CHECK(figures[1].step == 2);
  CHECK(figures[1].overlap.communication == Approx(4));
  CHECK(figures[1].overlap.compute == Approx(4));
  CHECK(figures[1].overlap.percent() == Approx(0).margin(1e-9));
  REQUIRE(figures[1].all_gather_wait.size() == 1);
  CHECK(figures[1].all_gather_wait.at("b") == Approx(5));
}
