"""tests/apps/trace_checks.py: what the app tests check in a --trace directory: trace-event schema,
each collective once per rank, spans nested per track, flows paired, counters against the
allocator's peak and the plan, and the per-step figures in the metrics."""
import json
import os
import re

from jobs import read_metrics, run_job

# Fields every event of a phase must have (Chrome trace-event format), besides ph, name, pid, tid.
REQUIRED = {"X": ["ts", "dur"], "C": ["ts", "args"], "i": ["ts", "s"], "s": ["ts", "id"],
            "f": ["ts", "id", "bp"], "M": ["args"]}
EPSILON_US = 1e-3  # timestamps are ns-exact microseconds written as doubles


def schema_errors(events):
    errors = []
    for event in events:
        phase = event.get("ph")
        fields = ["name", "pid", "tid"] + REQUIRED.get(phase, [])
        if phase not in REQUIRED or any(field not in event for field in fields):
            errors.append(event)
        elif phase == "X" and not event["dur"] >= 0:
            errors.append(event)
        elif phase == "C" and not all(isinstance(v, (int, float)) for v in event["args"].values()):
            errors.append(event)
    return errors


def nesting_errors(events):
    """Spans on one (pid, tid) that overlap without one holding the other."""
    errors = []
    tracks = {}
    for event in events:
        if event["ph"] == "X":
            tracks.setdefault((event["pid"], event["tid"]), []).append(event)
    for spans in tracks.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends = []
        for span in spans:
            while open_ends and open_ends[-1][0] <= span["ts"] + EPSILON_US:
                open_ends.pop()
            end = span["ts"] + span["dur"]
            if open_ends and end > open_ends[-1][0] + EPSILON_US:
                errors.append((open_ends[-1][1], span["name"]))
            open_ends.append((end, span["name"]))
    return errors


def check_trace(directory, ranks, steps, metrics, output, check, label):
    """`steps`: the traced steps; `metrics`: the run's metrics records; `output`: its log."""
    path = os.path.join(directory, "trace.json")
    try:
        with open(path, encoding="utf-8") as file:
            events = json.load(file)["traceEvents"]
        per_rank = []
        for rank in range(ranks):
            with open(os.path.join(directory, f"trace-rank{rank}.json"), encoding="utf-8") as file:
                per_rank.append(json.load(file)["traceEvents"])
    except (OSError, ValueError, KeyError) as error:
        check(f"{label}: trace.json and trace-rank<R>.json load as trace-event JSON", False, str(error))
        return
    check(f"{label}: trace.json merges the {ranks} ranks' files", len(events) == sum(map(len, per_rank)) and
          all(e["pid"] == rank for rank, rank_events in enumerate(per_rank) for e in rank_events))
    bad = schema_errors(events)
    check(f"{label}: every event has its phase's required fields", not bad, str(bad[:3]))
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    check(f"{label}: one process per rank, named", names == {r: f"rank {r}" for r in range(ranks)}, str(names))
    nesting = nesting_errors(events)
    check(f"{label}: spans nest on every track", not nesting, str(nesting[:5]))

    calls = [[(e["args"]["communicator"], e["args"]["sequence"], e["args"]["op"], e["args"]["count"])
              for e in sorted(rank_events, key=lambda e: (e["args"].get("communicator", ""), e["args"].get("sequence", 0)))
              if e["ph"] == "X" and e.get("cat") == "communication"] for rank_events in per_rank]
    once = all(len(set(c)) == len(c) for c in calls)
    contiguous = all(
        [s for (name, s, _, _) in c if name == communicator] ==
        list(range(min(s for (name, s, _, _) in c if name == communicator),
                   max(s for (name, s, _, _) in c if name == communicator) + 1))
        for c in calls for communicator in {name for (name, _, _, _) in c})
    check(f"{label}: each collective appears once per rank, with no sequence number missing, the same on every rank",
          calls[0] and once and contiguous and all(c == calls[0] for c in calls), str(calls[:2])[:2000])
    for op in ["all_gather", "reduce_scatter"]:
        check(f"{label}: the traced steps hold {op}s", any(call[2] == op for call in calls[0]))

    for rank, rank_events in enumerate(per_rank):
        spans = {e["name"] for e in rank_events if e["ph"] == "X"}
        wanted = {f"step {s}" for s in steps} | {"optimizer step", "load batch", "forward (root)", "backward (root)"}
        check(f"{label}: rank {rank} has every traced step, the loading, optimizer and the root's forward and backward",
              wanted <= spans, str(wanted - spans))
        forwards = {n[len("forward "):] for n in spans if n.startswith("forward ")}
        backwards = {n[len("backward "):] for n in spans if n.startswith("backward ")}
        check(f"{label}: rank {rank}: every unit has a forward and a backward span", forwards == backwards and
              len(forwards) > 1, f"{forwards} {backwards}")
        gathers = {e["name"] for e in rank_events
                   if e["ph"] == "X" and e.get("cat") == "communication" and e["args"]["op"] == "all_gather"}
        # The root stays gathered for backward; train_llama gathers it early with dist::unshard.
        root = {"all_gather unshard (root)"} if "all_gather unshard (root)" in gathers else \
               {"all_gather pre-forward (root)"}
        named = root | {f"all_gather pre-{p} {unit}" for unit in forwards - {"(root)"} for p in ["forward", "backward"]}
        check(f"{label}: rank {rank}: each unit's all-gathers are named for the pass they serve",
              gathers == named, f"{sorted(gathers)} vs {sorted(named)}")
        starts = sorted(e["id"] for e in rank_events if e["ph"] == "s")
        ends = sorted(e["id"] for e in rank_events if e["ph"] == "f")
        check(f"{label}: rank {rank}: every all-gather issue has one arrow to its wait", starts and starts == ends)
        memory = [e["args"] for e in rank_events if e["ph"] == "C" and e["name"] == "cpu memory"]
        check(f"{label}: rank {rank}: the memory counter's bytes in use never exceed its peak",
              memory and all(0 <= m["in_use"] <= m["peak"] for m in memory))
        final = [m for m in metrics if m.get("rank") == rank and "peak_memory_bytes" in m and "steps" in m]
        if final:
            check(f"{label}: rank {rank}: the memory counter's peak stays within the run's peak",
                  max(m["peak"] for m in memory) <= final[-1]["peak_memory_bytes"])
        gathered = [e["args"]["bytes"] for e in rank_events if e["ph"] == "C" and e["name"] == "gathered parameters"]
        planned = re.search(r"peak of gathered parameters: measured (\d+) B, planned (\d+) B", output)
        check(f"{label}: rank {rank}: the gathered-parameters counter peaks at the plan's peak",
              planned and gathered and max(gathered) == int(planned.group(2)) and min(gathered) >= 0,
              f"{max(gathered or [0])} vs {planned and planned.group(2)}")
        figures = [m for m in metrics if m.get("rank") == rank and "traced_step" in m]
        check(f"{label}: rank {rank}: the metrics hold the overlap figures of each traced step",
              [m["traced_step"] for m in figures] == list(steps) and
              all(0 <= m["exposed_communication_seconds"] <= m["communication_seconds"] + 1e-9 and
                  0 <= m["overlap_percent"] <= 100 and m["compute_seconds"] > 0 and m["all_gather_wait_seconds"]
                  for m in figures), str(figures))
    check(f"{label}: the overlap is printed", re.search(r"traced step \d+: communication .* overlap [\d.]+%", output))


def check_trace_run(mpirun, program, name, args, scratch, check):
    """--trace at np 2 (steps 2 and 3): the trace files and figures; bad --trace-steps are refused."""
    directory = os.path.join(scratch, "trace")
    metrics = os.path.join(scratch, "trace.jsonl")
    code, output = run_job(mpirun, program, 2, args + ["--trace", directory, "--trace-steps", "2:3",
                                                       "--metrics", metrics])
    check("np 2 --trace --trace-steps 2:3 trains", code == 0, f"exit {code}\n{output}")
    check_trace(directory, 2, [2, 3], read_metrics(metrics), output, check, f"{name} np 2 --trace")
    check_copy_spans(mpirun, program, name, args, scratch, check)
    for steps, message in [
            ("3:2", f"{name}: --trace-steps '3:2': expected FIRST:LAST with 1 <= FIRST <= LAST (steps count from 1, "
                    "both included), e.g. 2:3"),
            ("2:999", f"{name}: --trace-steps 2:999 asks for steps the run of")]:
        code, output = run_job(mpirun, program, 2, args + ["--trace", directory, "--trace-steps", steps])
        check(f"--trace-steps {steps} exits 1, explained once", code == 1 and output.count(message) == 1,
              f"exit {code}\n{output}")


def check_copy_spans(mpirun, program, name, args, scratch, check):
    """With --mixed-precision bf16, each gather's cast of the shard to bf16 and each reduction's cast of
    the gradient to f32 are "copy" spans of their unit, inside the step, counted as compute."""
    directory = os.path.join(scratch, "trace-bf16")
    metrics = os.path.join(scratch, "trace-bf16.jsonl")
    code, output = run_job(mpirun, program, 2, args + ["--mixed-precision", "bf16", "--trace", directory,
                                                       "--trace-steps", "2:2", "--metrics", metrics])
    check(f"{name} np 2 --mixed-precision bf16 --trace trains", code == 0, f"exit {code}\n{output}")
    if code != 0:
        return
    with open(os.path.join(directory, "trace.json"), encoding="utf-8") as file:
        events = [e for e in json.load(file)["traceEvents"] if e["ph"] == "X"]
    for rank in range(2):
        spans = [e for e in events if e["pid"] == rank]
        units = {e["name"][len("forward "):] for e in spans if e.get("cat") == "compute" and
                 e["name"].startswith("forward ")}
        copies = [e for e in spans if e.get("cat") == "copy"]
        casts = {e["name"] for e in copies}
        wanted = {f"cast parameters to bf16 {unit}" for unit in units} | \
                 {f"cast gradient to f32 {unit}" for unit in units}
        step = next(e for e in spans if e.get("cat") == "step")
        inside = all(step["ts"] - EPSILON_US <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + EPSILON_US
                     for e in copies)
        check(f"{name} bf16 trace: rank {rank}: every unit's parameter and gradient casts are copy spans in the step",
              units and wanted <= casts and inside, f"missing {sorted(wanted - casts)}")
