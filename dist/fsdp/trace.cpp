// dist/fsdp/trace.cpp: trace-event JSON per rank, the merged trace.json, and the per-step figures.
#include "dist/fsdp/trace.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "core/error.h"

namespace shardlab::dist {

void start_trace(Communicator& comm) {
  comm.barrier("trace start").wait();
  trace::start();
}

namespace {

double microseconds(trace::Clock::time_point t, trace::Clock::time_point origin) {
  return std::chrono::duration<double, std::micro>(t - origin).count();
}

nlohmann::json args_json(const trace::Args& args) {
  nlohmann::json out = nlohmann::json::object();
  for (const trace::Arg& arg : args) std::visit([&](const auto& value) { out[arg.key] = value; }, arg.value);
  return out;
}

nlohmann::json metadata(const char* name, int pid, int tid, const nlohmann::json& args) {
  return {{"ph", "M"}, {"name", name}, {"pid", pid}, {"tid", tid}, {"args", args}};
}

void write_json(const std::string& path, const nlohmann::json& document) {
  std::ofstream out(path);
  out << document.dump() << '\n';
  out.close();
  SHARDLAB_CHECK(out.good(), "trace: cannot write '{}'", path);
}

// Runs `work` (on the ranks `runs` says), then fails on every rank if it failed on any, so that no
// rank waits for a file another could not write.
void agreed(Communicator& comm, bool runs, const std::function<void()>& work) {
  std::string error;
  if (runs) {
    try {
      work();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const Tensor failed = from_vector(std::vector<std::int32_t>{error.empty() ? 0 : 1});
  comm.all_reduce(failed, ReduceOp::max, "trace").wait();
  if (!error.empty()) throw Error(error);
  SHARDLAB_CHECK(failed.item<std::int32_t>() == 0, "trace: writing the trace failed on another rank");
}

}  // namespace

nlohmann::json trace_document(const std::vector<trace::Event>& events, int rank) {
  const trace::Clock::time_point origin = trace::origin();
  nlohmann::json list = nlohmann::json::array();
  list.push_back(metadata("process_name", rank, 0, {{"name", fmt::format("rank {}", rank)}}));
  list.push_back(metadata("process_sort_index", rank, 0, {{"sort_index", rank}}));
  std::set<int> used;
  for (const trace::Event& event : events) {
    used.insert(event.track);
    nlohmann::json item = {{"ph", std::string(1, static_cast<char>(event.phase))},
                           {"name", event.name},
                           {"cat", event.category},
                           {"pid", rank},
                           {"tid", event.track},
                           {"ts", microseconds(event.begin, origin)}};
    switch (event.phase) {
      case trace::Phase::complete:
        item["dur"] = microseconds(event.end, event.begin);
        break;
      case trace::Phase::instant:
        item["s"] = "t";  // scoped to its thread
        break;
      case trace::Phase::flow_start:
        item["id"] = event.flow;
        break;
      case trace::Phase::flow_end:
        item["id"] = event.flow;
        item["bp"] = "e";  // binds to the span that encloses it, the wait
        break;
      case trace::Phase::counter:
        break;
    }
    item["args"] = args_json(event.args);
    list.push_back(std::move(item));
  }
  for (const trace::Track& track : trace::tracks()) {
    if (!used.contains(track.id)) continue;
    list.push_back(metadata("thread_name", rank, track.id, {{"name", track.name}}));
    list.push_back(metadata("thread_sort_index", rank, track.id, {{"sort_index", track.id}}));
  }
  return {{"traceEvents", std::move(list)}, {"displayTimeUnit", "ms"}};
}

namespace {

void create_directory(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  SHARDLAB_CHECK(!error, "trace: cannot create the directory '{}': {}", dir, error.message());
}

}  // namespace

void create_trace_directory(Communicator& comm, const std::string& dir) {
  agreed(comm, true, [&] { create_directory(dir); });
}

void write_trace(Communicator& comm, const std::string& dir, const std::vector<trace::Event>& events) {
  const auto rank_file = [&](int rank) { return fmt::format("{}/trace-rank{}.json", dir, rank); };
  agreed(comm, true, [&] {
    create_directory(dir);  // again: it may have gone since the start
    write_json(rank_file(comm.rank()), trace_document(events, comm.rank()));
  });
  agreed(comm, comm.rank() == 0, [&] {
    nlohmann::json merged = nlohmann::json::array();
    for (int rank = 0; rank < comm.size(); ++rank) {
      std::ifstream in(rank_file(rank));
      SHARDLAB_CHECK(in.good(), "trace: cannot read '{}'", rank_file(rank));
      nlohmann::json document = nlohmann::json::parse(in);
      for (auto& event : document.at("traceEvents")) merged.push_back(std::move(event));
    }
    write_json(dir + "/trace.json", {{"traceEvents", std::move(merged)}, {"displayTimeUnit", "ms"}});
  });
}

std::vector<StepFigures> step_figures(const std::vector<trace::Event>& events) {
  std::vector<trace::Interval> communication, busy, waits;
  const auto interval = [](const trace::Event& e) {
    return trace::Interval{std::chrono::duration<double>(e.begin.time_since_epoch()).count(),
                           std::chrono::duration<double>(e.end.time_since_epoch()).count()};
  };
  for (const trace::Event& e : events) {
    if (e.phase != trace::Phase::complete) continue;
    if (e.category == "communication") communication.push_back(interval(e));
    if (e.category == "compute" || e.category == "copy") busy.push_back(interval(e));
    if (e.category == "wait") waits.push_back(interval(e));
  }
  const std::vector<trace::Interval> compute = trace::subtract(busy, waits);
  std::vector<StepFigures> figures;
  for (const trace::Event& step : events) {
    if (step.phase != trace::Phase::complete || step.category != "step") continue;
    const trace::Interval window = interval(step);
    StepFigures figure{.seconds = window.end - window.begin};
    for (const trace::Arg& arg : step.args) {
      if (arg.key == "step") figure.step = std::get<std::int64_t>(arg.value);
    }
    figure.overlap = trace::overlap(trace::clip(communication, window), trace::clip(compute, window));
    for (const trace::Event& e : events) {
      if (e.phase != trace::Phase::complete || e.category != "wait" || !e.name.starts_with("wait all_gather"))
        continue;
      const trace::Interval wait = interval(e);
      if (wait.begin < window.begin || wait.end > window.end) continue;
      for (const trace::Arg& arg : e.args) {
        if (arg.key == "unit")
          figure.all_gather_wait[std::get<std::string>(arg.value)] += wait.end - wait.begin;
      }
    }
    figures.push_back(std::move(figure));
  }
  return figures;
}

}  // namespace shardlab::dist
