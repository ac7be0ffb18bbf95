#!/usr/bin/env python3
"""bench/gpu_speed.py: shardlab against PyTorch on the same GPU, in the same run, side by side.

  python3 bench/gpu_speed.py --build-dir DIR --out OUT [--configs seed,1b,cnn] [--modes eager,compile]
                             [--steps N] [--limit-s S] [--python PYTHON] [--cnn-data DIR]

Per config, shardlab's side runs once (DIR/apps/train_llama or train_cnn with --device cuda,
--profile and --explain: its "ok" line gives the step time predicted before step 1 beside the
measured median) and PyTorch's once per mode (bench/pytorch_gpu_llama.py or bench/pytorch_gpu_cnn.py,
eager or torch.compile, with PYTHON: default the Python running this script). The Llamas: seed
(bench/llama_seed.json, 179.4M parameters, T 512, B 64) and 1b (train_llama's preset, T 2048,
B 4), both in bf16 on uniform random token ids; cnn: the tutorial CNN at batch 64 in f32 (shardlab
on Fashion-MNIST from --cnn-data, PyTorch on random images). Each run is killed after --limit-s
seconds; its raw output is kept in OUT/<side>-<config>[-<mode>].txt, shardlab's metrics in
OUT/shardlab-<config>.jsonl.

Prints a line per run: "ok: ..." (it completed and printed its figures), "FAILED: ..." (it
crashed, hung, or its figures are missing or wrong), or "skipped: ..." (no GPU answers: shardlab
ended at once with exit 1 and one line naming why, PyTorch's peer with exit 3 and its one line;
or PyTorch is not importable by PYTHON). Then the table (tokens/s or images/s of each side, their
ratio, MFU by bench/speed_math.py against the GPU's dense bf16 peak, peak memory of each side),
written with shardlab's --profile tables below it to OUT/speed.md, and the closing line
"speed: N passed, N failed, N skipped". Exit status 1 when a run failed, 2 for bad arguments.
"""
import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import speed_math

BENCH = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("seed", "1b", "cnn")
MODES = ("eager", "compile")
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
REFUSAL = "device cuda was requested but "  # what a shardlab app says when no GPU answers
PEER_REFUSALS = ("no CUDA GPU: ", "no PyTorch: ")  # what a PyTorch peer says, with exit status 3


@dataclasses.dataclass
class Run:
    """One side's run of one config (and, for PyTorch, one mode), and what came of it."""
    side: str  # "shardlab" or "pytorch"
    config: str
    mode: str = ""  # PyTorch's; shardlab has none
    outcome: str = "skipped"  # "ok", "failed" or "skipped"
    detail: str = ""  # the figures when ok, the reason otherwise
    per_s: float = None  # tokens/s for a Llama, images/s for the CNN
    peak_bytes: int = None
    device: str = ""  # the GPU's name, as a PyTorch peer printed it
    profile: list = dataclasses.field(default_factory=list)  # shardlab's --profile lines

    @property
    def name(self):
        return " ".join(filter(None, (self.side, self.config, self.mode)))

    @property
    def stem(self):
        return "-".join(filter(None, (self.side, self.config, self.mode)))


# --- arguments -------------------------------------------------------------------------------------

def choices(allowed):
    """An argparse type: a comma-separated list of some of `allowed`, each once."""
    def parse(text):
        items = text.split(",")
        unknown = [item for item in items if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"'{unknown[0]}' is not one of {', '.join(allowed)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"'{text}' names one twice")
        return items
    return parse


def at_least(least):
    """An argparse type: an integer of at least `least`."""
    def integer(text):  # argparse names the type in its message: "invalid integer value"
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text} is less than {least}")
        return value
    return integer


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="gpu_speed.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", required=True, help="a shardlab build (its apps/train_llama, train_cnn)")
    parser.add_argument("--out", required=True, help="where the raw outputs, metrics and speed.md go")
    parser.add_argument("--configs", type=choices(CONFIGS), default=list(CONFIGS),
                        help="comma-separated, of seed, 1b, cnn (default: all)")
    parser.add_argument("--modes", type=choices(MODES), default=list(MODES),
                        help="PyTorch's, comma-separated: eager, compile (default: both)")
    # shardlab's median leaves out its first step: at least one more is timed.
    parser.add_argument("--steps", type=at_least(2), default=20, help="steps of each run (default 20)")
    parser.add_argument("--limit-s", type=at_least(1), default=300, help="seconds before a run is killed (default 300)")
    parser.add_argument("--python", default=sys.executable, help="the Python that has PyTorch (default: this one)")
    parser.add_argument("--cnn-data", default=FASHION_MNIST,
                        help=f"train_cnn's Fashion-MNIST directory (default {FASHION_MNIST})")
    args = parser.parse_args(argv)
    for program in sorted({shardlab_program(config) for config in args.configs}):
        path = os.path.join(args.build_dir, "apps", program)
        if not os.access(path, os.X_OK):
            parser.error(f"--build-dir {args.build_dir}: no program {path}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is not a directory")
    return args


# --- the commands ------------------------------------------------------------------------------------

def shardlab_program(config):
    return "train_cnn" if config == "cnn" else "train_llama"


def shardlab_command(config, args):
    program = os.path.join(args.build_dir, "apps", shardlab_program(config))
    metrics = os.path.join(args.out, f"shardlab-{config}.jsonl")
    if config == "cnn":
        return [program, "--device", "cuda", "--global-batch", str(speed_math.CNN_BATCH), "--steps", str(args.steps),
                "--data", args.cnn_data, "--metrics", metrics, "--profile", "--explain"]
    shape = speed_math.LLAMA_RUNS[config]
    model = speed_math.SEED_CONFIG if config == "seed" else config
    return [program, "--device", "cuda", "--config", model, "--mixed-precision", "bf16", "--seq", str(shape["seq"]),
            "--global-batch", str(shape["batch"]), "--steps", str(args.steps), "--random-tokens", "--metrics", metrics,
            "--profile", "--explain"]


def pytorch_command(config, mode, args):
    if config == "cnn":
        return [args.python, os.path.join(BENCH, "pytorch_gpu_cnn.py"), "--mode", mode, "--steps", str(args.steps)]
    return [args.python, os.path.join(BENCH, "pytorch_gpu_llama.py"), "--config", config, "--mode", mode,
            "--steps", str(args.steps)]


def run_command(command, limit_s, path):
    """(exit status, or None when killed at limit_s; output), the output also written to `path`
    after the command line. The command runs in a process group of its own, so that what it started
    (torch.compile's workers) is killed with it."""
    began = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=limit_s)
        code = job.returncode
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        code, output = None, output + f"\n(killed after {limit_s} s)\n"
    with open(path, "w", encoding="utf-8") as file:
        file.write(f"$ {' '.join(command)}\n{output}(exit {code}, {time.monotonic() - began:.1f} s)\n")
    return code, output


# --- judging the runs --------------------------------------------------------------------------------

def lines_of(output):
    return [line for line in output.splitlines() if line.strip()]


def one_line(code, output, status, program):
    """What `program` said after its name when it ended with `status` and that one line (None
    otherwise): how a program without a GPU must end."""
    lines = lines_of(output)
    if code != status or len(lines) != 1 or not lines[0].startswith(f"{program}: "):
        return None
    return lines[0][len(program) + 2:]


def failed(run, code, output, path):
    tail = "\n".join(lines_of(output)[-3:])
    run.outcome, run.detail = "failed", f"exit {code}, see {path}:\n{tail}"


def json_records(lines):
    """The JSON objects among `lines`; a line cut short by a killed run is passed over."""
    records = []
    for line in lines:
        try:
            record = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
    return records


def read_records(path):
    """The records of a metrics file (none when the run wrote none)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as file:
        return json_records(file.read().splitlines())


def profile_lines(output):
    """The lines of --profile's tables in a run's output: each heading about a step (it ends with
    ':') and the indented lines under it."""
    found, inside = [], False
    for line in output.splitlines():
        if "per step" in line and line.rstrip().endswith(":"):
            inside = True
            found.append(line)
        elif inside and line.startswith((" ", "\t")):
            found.append(line)
        else:
            inside = False
    return found


def judge_shardlab(run, code, output, path, metrics):
    program = shardlab_program(run.config)
    why = one_line(code, output, 1, program)
    if why is not None and REFUSAL in why:
        run.outcome, run.detail = "skipped", "no GPU: " + why.split(REFUSAL, 1)[1]
        return
    records = [r for r in read_records(metrics) if r.get("rank", 0) == 0]
    peaks = [r["train_peak_memory_bytes"] for r in records if "train_peak_memory_bytes" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    step = re.findall(r"median step ([\d.]+) ms", output)
    if code != 0 or not step or float(step[-1]) <= 0 or not peaks:
        failed(run, code, output, path)
        return
    run.peak_bytes, step_ms = peaks[-1], float(step[-1])
    if run.config == "cnn":
        run.per_s = speed_math.CNN_BATCH * 1e3 / step_ms
    else:
        speed = re.findall(r"median step [\d.]+ ms, (\d+) tokens/s", output)
        trained = re.findall(r"with (\d+) parameters", output)
        expected = speed_math.llama_parameters(speed_math.llama_config(run.config))
        if not speed or not trained or int(trained[-1]) != expected:
            run.outcome = "failed"
            run.detail = (f"trained {trained[-1] if trained else '?'} parameters where {expected} were expected, "
                          f"tokens/s {speed[-1] if speed else '?'}; see {path}")
            return
        run.per_s = float(speed[-1])
    run.profile = profile_lines(output)
    loss = f", last loss {losses[-1]:.4f}" if losses else ""
    # --explain's prediction, made before step 1, beside the measured median.
    predicted = re.findall(r"step time: measured [\d.]+ ms, (predicted [\d.]+ ms \([-+][\d.]+%\))", output)
    prediction = f", {predicted[-1]}" if predicted else ""
    run.outcome, run.detail = "ok", f"median step {step_ms:.1f} ms{prediction}, peak {gib(run.peak_bytes)}{loss}"


def judge_pytorch(run, code, output, path):
    program = "pytorch_gpu_cnn" if run.config == "cnn" else "pytorch_gpu_llama"
    why = one_line(code, output, 3, program)
    if why is not None and why.startswith(PEER_REFUSALS):
        run.outcome, run.detail = "skipped", why
        return
    key = "images_per_s" if run.config == "cnn" else "tokens_per_s"
    records = [r for r in json_records(output.splitlines()) if r.get("side") == "pytorch"]
    figures = records[-1] if records else {}
    if code != 0 or any(field not in figures for field in (key, "step_ms", "loss", "params")):
        failed(run, code, output, path)
        return
    if run.config != "cnn":
        expected = speed_math.llama_parameters(speed_math.llama_config(run.config))
        if figures.get("params") != expected:
            run.outcome = "failed"
            run.detail = f"trained {figures.get('params')} parameters where {expected} were expected; see {path}"
            return
    run.per_s, run.peak_bytes = figures[key], figures.get("peak_memory_bytes")
    run.device, run.outcome = figures.get("device_name", ""), "ok"
    run.detail = (f"median step {figures['step_ms']:.1f} ms, peak {gib(run.peak_bytes)}, "
                  f"last loss {figures['loss']:.4f}, torch {figures.get('torch')} on {figures.get('device_name')}")


def torch_missing(python):
    """Why `python` cannot import torch ("" when it can)."""
    try:
        done = subprocess.run([python, "-c", "import torch"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    lines = lines_of(done.stdout)
    return "" if done.returncode == 0 else (lines[-1] if lines else f"exit {done.returncode}")


def gpu_name(runs):
    """The GPU's name: nvidia-smi's, else what a PyTorch peer printed, else "an unknown GPU"."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return next((run.device for run in runs if run.device), "an unknown GPU")


# --- the report ----------------------------------------------------------------------------------------

def gib(value):
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def throughput(run):
    if run is None or run.outcome != "ok":
        return "-"
    return f"{run.per_s:.0f} {'img/s' if run.config == 'cnn' else 'tok/s'}"


def utilization(run, peak):
    """MFU of a Llama run, "?" for a GPU of unknown peak, "-" for the CNN or a run without figures."""
    if run is None or run.outcome != "ok" or run.config == "cnn":
        return "-"
    shape = speed_math.LLAMA_RUNS[run.config]
    per_token = speed_math.flops_per_token(speed_math.llama_config(run.config), shape["seq"])
    return speed_math.percent(speed_math.mfu(run.per_s, per_token, peak))


def table(runs, peak):
    """The side-by-side table, a row per config and PyTorch mode (shardlab's one run in each)."""
    rows = ["| config | mode | shardlab | PyTorch | shardlab / PyTorch | MFU shardlab | MFU PyTorch | "
            "peak memory shardlab | peak memory PyTorch |", "|---|---|---|---|---|---|---|---|---|"]
    ours = {run.config: run for run in runs if run.side == "shardlab"}
    for theirs in (run for run in runs if run.side == "pytorch"):
        mine = ours.get(theirs.config)
        both = mine is not None and mine.outcome == theirs.outcome == "ok"
        quotient = f"{speed_math.ratio(mine.per_s, theirs.per_s):.3f}" if both else "-"
        rows.append(f"| {theirs.config} | {theirs.mode} | {throughput(mine)} | {throughput(theirs)} | {quotient} | "
                    f"{utilization(mine, peak)} | {utilization(theirs, peak)} | "
                    f"{gib(mine.peak_bytes if mine else None)} | {gib(theirs.peak_bytes)} |")
    return rows


def outcome_line(run):
    if run.outcome == "ok":
        return f"ok: {run.name}: {throughput(run)}, {run.detail}"
    if run.outcome == "failed":
        return f"FAILED: {run.name}: {run.detail}"
    return f"skipped: {run.name} ({run.detail})"


def write_report(path, device, args, runs, rows, closing):
    profiles = [run for run in runs if run.side == "shardlab" and run.outcome == "ok"]
    lines = [f"# shardlab and PyTorch on {device}", "",
             f"{time.strftime('%Y-%m-%d')}, {args.steps} steps a run, configs {','.join(args.configs)}, PyTorch modes "
             f"{','.join(args.modes)}. shardlab runs once per config (it has no compile mode); its figures stand "
             "beside each of PyTorch's modes. MFU: (6 N + 12 L H T) FLOPs per token against the GPU's dense bf16 "
             "peak (bench/speed_math.py); \"?\" where the GPU is not in its table.", "", *rows, "",
             "## Where a shardlab step goes (--profile)"]
    for run in profiles:
        lines += ["", f"### {run.config}", "", "```text", *(run.profile or ["(no --profile table in the output)"]),
                  "```"]
    if not profiles:
        lines += ["", "(no shardlab run completed)"]
    lines += ["", "## Runs", "", "```text", *(outcome_line(run) for run in runs), closing, "```"]
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")


# --- the run ---------------------------------------------------------------------------------------------

def run_shardlab(config, args):
    run = Run("shardlab", config)
    if config == "cnn" and not os.path.isdir(args.cnn_data):
        run.detail = f"{args.cnn_data} is missing (Debian's dataset-fashion-mnist, or --cnn-data)"
        return run
    metrics = os.path.join(args.out, f"shardlab-{config}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # a previous run's records must not stand in for this one's
    path = os.path.join(args.out, f"{run.stem}.txt")
    code, output = run_command(shardlab_command(config, args), args.limit_s, path)
    judge_shardlab(run, code, output, path, metrics)
    return run


def run_pytorch(config, mode, args, no_torch):
    run = Run("pytorch", config, mode)
    if no_torch:
        run.detail = f"torch is not importable by {args.python}: {no_torch}"
        return run
    path = os.path.join(args.out, f"{run.stem}.txt")
    code, output = run_command(pytorch_command(config, mode, args), args.limit_s, path)
    judge_pytorch(run, code, output, path)
    return run


def main(argv):
    args = parse_arguments(argv)
    os.makedirs(args.out, exist_ok=True)
    no_torch = torch_missing(args.python)
    runs = []
    for config in args.configs:
        runs.append(run_shardlab(config, args))
        print(outcome_line(runs[-1]), flush=True)
        for mode in args.modes:
            runs.append(run_pytorch(config, mode, args, no_torch))
            print(outcome_line(runs[-1]), flush=True)
    device = gpu_name(runs)
    rows = table(runs, speed_math.peak_flops(device))
    counts = [sum(run.outcome == outcome for run in runs) for outcome in ("ok", "failed", "skipped")]
    closing = f"speed: {counts[0]} passed, {counts[1]} failed, {counts[2]} skipped"
    write_report(os.path.join(args.out, "speed.md"), device, args, runs, rows, closing)
    print(f"\n{device}\n" + "\n".join(rows) + f"\n\n(also in {os.path.join(args.out, 'speed.md')})\n{closing}")
    return 1 if counts[1] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
