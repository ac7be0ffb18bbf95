#!/usr/bin/env python3
"""tests/apps/plot_tests.py: runs scripts/plot on the metrics and trace of small train_cnn runs on
Fashion-MNIST (np 1 to 3, full, grad_op and none, a few steps) and checks what it drew, from the
.dat files --keep-data keeps:

- every chart is a PNG of 900 x 500;
- loss: each run's points are its rank-0 step losses; a step logged twice (a job resumed after its run
  went past its last checkpoint) is drawn with its later record; validation losses are a series of their own;
- memory: the formula line equals the plan's persistent_bytes of rank 0 at every world size measured,
  and the points equal the measured_persistent_bytes;
- traffic: each bar and plan mark equals the run's step_bytes_received and planned_step_bytes;
- timeline: the rows of each rank are exactly the trace's spans of that step on that rank, clipped to
  it, in ms from its start, and the overlap printed is the one the app recorded in the metrics; with
  --predicted, the predicted rows are the spans of the step --explain predicted (rank 0's summary);
- a missing file, metrics without loss records or without a plan, a step not traced, --predicted
  metrics without a prediction and gnuplot missing each exit 1 with one message.

Usage: plot_tests.py <mpirun> <train_cnn> <scripts/plot>. Needs the data set and gnuplot from
scripts/setup (/usr/share/datasets/fashion-mnist, gnuplot-nox); without either every case is
skipped. Prints one line per check, then "plot: N passed, N failed, N skipped".
"""
import glob
import json
import os
import re
import shutil
import struct
import sys
import tempfile

from jobs import Checks, read_metrics, run_command, run_job

DATA_DIR = "/usr/share/datasets/fashion-mnist"
ARGS = ["--steps", "3", "--limit-train", "480", "--limit-test", "96", "--global-batch", "48", "--threads", "1"]
# (2, "full") is traced; at np 3 every unit is padded, and the memory formula must pad as the plan does.
RUNS = [(1, "full"), (2, "full"), (3, "full"), (2, "grad_op"), (1, "none"), (2, "none")]
TRACED_STEP = 2
CHECKS = 7 + 4 + 4 + 2 + 4 + 6  # PNGs, loss, memory, traffic, timeline, errors
TIME_TOLERANCE_MS = 1e-9


def png_size(path):
    """(width, height) from the IHDR chunk of a PNG file, or None if it is not one."""
    try:
        with open(path, "rb") as file:
            head = file.read(24)
    except OSError:
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def rows(path):
    """The rows of a kept .dat file, split on whitespace (tabs for the timeline's)."""
    with open(path, encoding="utf-8") as file:
        return [line.rstrip("\n").split("\t" if "\t" in line else None) for line in file if not line.startswith("#")]


def summary(records):
    return next(r for r in records if r.get("rank") == 0 and "plan" in r)


def trace_rows(trace_path, step):
    """Independently of scripts/plot: every span of each rank overlapping `step`, clipped to it,
    as (rank, row, name, begin ms, end ms) from the rank's step start."""
    with open(trace_path, encoding="utf-8") as file:
        events = json.load(file)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    out = []
    for window in (e for e in spans if e["cat"] == "step" and e["args"]["step"] == step):
        begin, end = window["ts"], window["ts"] + window["dur"]
        for e in spans:
            b, f = max(e["ts"], begin), min(e["ts"] + e["dur"], end)
            if e["pid"] == window["pid"] and e["cat"] != "step" and f > b:
                row = e["cat"] if e["cat"] in ("communication", "wait") else "compute"
                out.append((e["pid"], row, e["name"], (b - begin) / 1e3, (f - begin) / 1e3))
    return sorted(out)


def same_rows(drawn, expected):
    return len(drawn) == len(expected) and all(
        d[:3] == e[:3] and abs(d[3] - e[3]) <= TIME_TOLERANCE_MS and abs(d[4] - e[4]) <= TIME_TOLERANCE_MS
        for d, e in zip(drawn, expected))


def main(mpirun, program, plot):
    check = Checks()
    if not os.path.isdir(DATA_DIR):
        print(f"plot: {DATA_DIR} not found (scripts/setup installs dataset-fashion-mnist): skipped")
        return check.summary("plot", CHECKS)
    if shutil.which("gnuplot") is None:
        print("plot: gnuplot not found on PATH (scripts/setup installs gnuplot-nox): skipped")
        return check.summary("plot", CHECKS)
    scratch = tempfile.mkdtemp(prefix="plot-tests-")
    try:
        return check_plots(mpirun, program, plot, scratch, check)
    finally:
        shutil.rmtree(scratch)


def check_plots(mpirun, program, plot, scratch, check):
    trace_dir = os.path.join(scratch, "trace")
    metrics = {}
    for ranks, sharding in RUNS:
        path = os.path.join(scratch, f"{sharding}-np{ranks}.jsonl")
        extra = ["--trace", trace_dir, "--trace-steps", f"{TRACED_STEP}:{TRACED_STEP + 1}", "--explain"] \
            if (ranks, sharding) == (2, "full") else []
        code, output = run_job(mpirun, program, ranks, ARGS + ["--sharding", sharding, "--metrics", path] + extra)
        if code != 0:
            check(f"np {ranks} {sharding} trains", False, f"exit {code}\n{output}")
            return check.summary("plot", 0)
        metrics[(ranks, sharding)] = read_metrics(path)

    def draw(command, *args):
        keep = os.path.join(scratch, command)
        out = os.path.join(scratch, f"{command}.png")
        code, output = run_command([sys.executable, plot, command, "--keep-data", keep, out] + list(args))
        check(f"plot {command} writes a 900 x 500 PNG", code == 0 and png_size(out) == (900, 500),
              f"exit {code}, size {png_size(out)}\n{output}")
        return keep, output

    paths = {run: os.path.join(scratch, f"{run[1]}-np{run[0]}.jsonl") for run in RUNS}
    keep, _ = draw("loss", f"np 1={paths[(1, 'full')]}", f"np 2={paths[(2, 'full')]}")
    for index, run in enumerate([(1, "full"), (2, "full")]):
        expected = [[str(r["step"]), repr(r["loss"])] for r in metrics[run] if r.get("rank") == 0 and "loss" in r]
        drawn = rows(os.path.join(keep, f"loss-{index}.dat"))
        check(f"loss: the np {run[0]} curve is its rank-0 step losses", drawn == expected and len(drawn) == 3,
              f"{drawn} vs {expected}")

    # A job that restarted from step 1's checkpoint: steps 2 and 3 logged again, by the run that went on.
    restarted = os.path.join(scratch, "restarted.jsonl")
    first_run = [r for r in metrics[(1, "full")] if r.get("rank") == 0 and "loss" in r]
    again = [dict(r, loss=r["loss"] + 1.0) for r in first_run if r["step"] > 1]
    with open(restarted, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(r) + "\n" for r in first_run + [{"restart": 1}] + again)
    keep, _ = draw("loss", f"restarted={restarted}")
    expected = [[str(r["step"]), repr(r["loss"])] for r in first_run[:1] + again]
    drawn = rows(os.path.join(keep, "loss-0.dat"))
    check("loss: a step logged twice is drawn once, with the later record", drawn == expected and len(drawn) == 3,
          f"{drawn} vs {expected}")

    # train_llama's validation records (--eval-every): their own series, by the step after which each was taken.
    validated = os.path.join(scratch, "validated.jsonl")
    checks = [{"rank": 0, "step": s, "validation_loss": 2.0 / s, "validation_tokens": 100} for s in (2, 3)]
    with open(validated, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(r) + "\n" for r in first_run + checks + [dict(checks[0], rank=1)])
    keep, _ = draw("loss", f"validated={validated}")
    drawn = rows(os.path.join(keep, "validation-0.dat"))
    check("loss: a run's validation losses are a series of their own (rank 0's, by step)",
          drawn == [["2", repr(1.0)], ["3", repr(2.0 / 3)]] and len(rows(os.path.join(keep, "loss-0.dat"))) == 3,
          str(drawn))

    keep, _ = draw("memory", *paths.values())
    for strategy in ("full", "grad_op", "none"):
        runs = {ranks: summary(records) for (ranks, sharding), records in metrics.items() if sharding == strategy}
        formula = {int(n): int(b) for n, b in rows(os.path.join(keep, f"memory-{strategy}-formula.dat"))}
        measured = {int(n): int(b) for n, b in rows(os.path.join(keep, f"memory-{strategy}-measured.dat"))}
        ok = all(formula.get(n) == s["persistent_bytes"] for n, s in runs.items())
        if strategy == "full":  # the chart's point: the formula falls with the world size
            ok = ok and formula[2] < formula[1]
        check(f"memory: the {strategy} formula line is the plan's persistent bytes at np {sorted(runs)}", ok,
              f"{formula} vs {({n: s['persistent_bytes'] for n, s in runs.items()})}")
    check("memory: the points are the measured persistent bytes of every run",
          all(int(b) == summary(metrics[(int(n), strategy)])["measured_persistent_bytes"]
              for strategy in ("full", "grad_op", "none")
              for n, b in rows(os.path.join(keep, f"memory-{strategy}-measured.dat"))))

    keep, _ = draw("traffic", *paths.values())
    for strategy in ("full", "none"):
        drawn = [(int(n), int(m), int(p)) for n, _, m, p in rows(os.path.join(keep, f"traffic-{strategy}.dat"))]
        expected = sorted((ranks, summary(r)["step_bytes_received"], summary(r)["planned_step_bytes"])
                          for (ranks, sharding), r in metrics.items() if sharding == strategy)
        check(f"traffic: {strategy}'s bars and plan marks are the runs' received and planned bytes per step",
              drawn == expected and drawn[-1][1] > 0, f"{drawn} vs {expected}")

    keep, output = draw("timeline", trace_dir, "--step", str(TRACED_STEP))
    drawn = sorted((int(r[0]), r[1], r[6], float(r[2]), float(r[3]))
                   for path in glob.glob(os.path.join(keep, "timeline-*.dat")) if not path.endswith("labels.dat")
                   for r in rows(path))
    expected = trace_rows(os.path.join(trace_dir, "trace.json"), TRACED_STEP)
    check(f"timeline: the rows are every rank's spans of step {TRACED_STEP}, in ms from its start",
          same_rows(drawn, expected) and {r[0] for r in drawn} == {0, 1},
          f"drawn {len(drawn)} spans, the trace {len(expected)}:\n{drawn[:5]}\n{expected[:5]}")
    recorded = {r["rank"]: r["overlap_percent"] for r in metrics[(2, "full")] if r.get("traced_step") == TRACED_STEP}
    printed = {int(rank): float(p) for rank, p in re.findall(r"rank (\d+) ([\d.]+)%", output)}
    check("timeline: each rank's overlap is the one the app recorded",
          printed.keys() == recorded.keys() == {0, 1} and
          all(abs(printed[r] - recorded[r]) <= 0.05 + 1e-9 for r in printed), f"{printed} vs {recorded}")
    with open(os.path.join(keep, "timeline.gp"), encoding="utf-8") as gp:
        check("timeline: the title gives both ranks' overlap", re.search(r"rank 0 [\d.]+%, rank 1 [\d.]+%", gp.read()))

    keep, output = draw("timeline", trace_dir, "--step", str(TRACED_STEP), "--predicted", paths[(2, "full")])
    predicted = summary(metrics[(2, "full")])["predicted_step"]
    drawn = sorted((r[1], r[6], float(r[2]), float(r[3]))
                   for path in glob.glob(os.path.join(keep, "timeline-*.dat")) if not path.endswith("labels.dat")
                   for r in rows(path) if r[0] == "predicted")
    expected = sorted((span["lane"], span["what"], 1e3 * span["start"], 1e3 * span["end"])
                      for span in predicted["spans"])
    check("timeline --predicted: the predicted rows are the spans of the step --explain predicted, in ms",
          len(drawn) == len(expected) > 0 and
          all(d[:2] == e[:2] and abs(d[2] - e[2]) < 1e-9 and abs(d[3] - e[3]) < 1e-9
              for d, e in zip(drawn, expected)) and
          f"predicted {1e3 * predicted['step_seconds']:.1f} ms" in output, f"{drawn[:3]} vs {expected[:3]}\n{output}")

    def refused(name, args, message, env=None):
        code, output = run_command([sys.executable, plot] + args, env)
        check(f"{name} exits 1, explained once", code == 1 and output.count(message) == 1 and
              output.count("plot: ") == 1, f"exit {code}, expected once: {message}\n{output}")

    out = os.path.join(scratch, "refused.png")
    missing = os.path.join(scratch, "missing.jsonl")
    refused("a missing metrics file", ["loss", out, f"x={missing}"], f"plot: {missing}: no such file")
    summary_only = os.path.join(scratch, "summary-only.jsonl")
    with open(summary_only, "w", encoding="utf-8") as file:
        file.write(json.dumps(summary(metrics[(1, "full")])) + "\n")
    refused("metrics without loss records", ["loss", out, summary_only],
            f"plot: {summary_only}: no per-step loss records of rank 0 (run with --steps N and --metrics)")
    losses_only = os.path.join(scratch, "losses-only.jsonl")
    with open(losses_only, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(r) + "\n" for r in metrics[(1, "full")] if "loss" in r)
    refused("metrics without a plan", ["memory", out, losses_only],
            f"plot: {losses_only}: no summary record of rank 0 with a \"plan\" (the run must end, with --metrics)")
    refused("a step not traced", ["timeline", out, trace_dir, "--step", "7"],
            f"plot: {trace_dir}/trace.json: no step 7 traced (traced steps: {TRACED_STEP}, {TRACED_STEP + 1})")
    refused("--predicted metrics without a prediction",
            ["timeline", out, trace_dir, "--predicted", paths[(1, "full")]],
            f"plot: {paths[(1, 'full')]}: no predicted step in rank 0's summary (run with --explain and --metrics)")
    empty = os.path.join(scratch, "empty-path")
    os.makedirs(empty)
    refused("gnuplot missing", ["loss", out, paths[(1, "full")]],
            "plot: gnuplot not found on PATH (Debian package gnuplot-nox; scripts/setup installs it)",
            dict(os.environ, PATH=empty))
    return check.summary("plot", 0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: plot_tests.py <mpirun> <train_cnn> <scripts/plot>")
    sys.exit(main(*sys.argv[1:]))
