// dist/fsdp/trace.h: tracing a distributed run: the recorder started on all ranks with aligned clocks,
// each rank's events as Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing) and the merged
// trace.json with one process per rank, and the figures derived from the spans per traced step.
//
// What the recorder holds during a step (categories): "step" (the app's whole step), "data"
// (loading the batch), "compute" (each FSDP unit's forward and backward, the optimizer step),
// "copy" (FSDP's copy and cast kernels: parameters to bf16, gradients to the reduce dtype and
// back, shards to and from the device when offloaded), "wait" (the compute thread blocked on an
// all-gather or a reduce-scatter), "communication" (each collective, from the ledger, on its
// communicator's track, named by its tag: "all_gather pre-forward fc1", "all_gather pre-backward
// fc1", "reduce_scatter fc1"), flows from an all-gather's issue to its wait, and the counters
// "gathered parameters" and "cpu memory".
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/trace.h"
#include "dist/comm/communicator.h"

namespace shardlab::dist {

// A barrier, then trace::start(): every rank's time 0 is the barrier's end.
void start_trace(Communicator& comm);

// `events` (this rank's, from trace::take()) as a trace-event document: {"traceEvents": [...]},
// timestamps in microseconds since trace::origin(), pid `rank`, with process and track names.
nlohmann::json trace_document(const std::vector<trace::Event>& events, int rank);

// Creates DIR on every rank (a collective), failing on all of them, naming DIR, if any cannot: what
// a run checks before step 1 so that an unwritable --trace does not cost it at the traced step.
void create_trace_directory(Communicator& comm, const std::string& dir);

// Writes DIR/trace-rank<R>.json on every rank, then rank 0 merges them into DIR/trace.json; a
// collective. Creates DIR.
void write_trace(Communicator& comm, const std::string& dir, const std::vector<trace::Event>& events);

// Per "step" span: the overlap of communication (the union of "communication" spans) with
// compute ("compute" and "copy" spans less "wait" spans), in seconds, and the time each unit waited for its
// all-gathers. The span's argument "step" numbers it.
struct StepFigures {
  std::int64_t step = 0;
  double seconds = 0;  // the step span's length
  trace::Overlap overlap;
  std::map<std::string, double> all_gather_wait;  // unit -> seconds
};
std::vector<StepFigures> step_figures(const std::vector<trace::Event>& events);

}  // namespace shardlab::dist
