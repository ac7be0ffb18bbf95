"""tests/apps/jobs.py: what the app tests share: starting a job under mpirun (or a plain command)
with a time limit, reading the JSON-lines metrics files the apps write, reporting checks, and the
checks of the predicted training peak and --memory-limit."""
import filecmp
import json
import os
import signal
import subprocess
import time

LIMIT_S = 300


def run_job(mpirun, program, ranks, args, mpirun_args=()):
    """(exit status or None when killed, output) of `program args` on `ranks` ranks; mpirun_args
    go to mpirun (a hostfile, MCA parameters)."""
    # A collective that hangs fails the job in 2 minutes instead of the default 10.
    env = dict(os.environ, SHARDLAB_COLLECTIVE_TIMEOUT="120")
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", *mpirun_args, "-np", str(ranks), program] + args
    return run_command(command, env)


def run_command(command, env=None):
    try:
        # errors="replace": generated text may hold any bytes.
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=LIMIT_S, text=True, errors="replace")
        return done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        return None, (output or "") + f"\n(killed after {LIMIT_S} s)\n"


def start(mpirun, program, args, env_extra=None, ranks=2, mpirun_args=()):
    """The job `program args` under mpirun, started, its output piped. `mpirun` is its path, or a
    command line that ends with it (["scripts/netns-hosts", "exec", "slh-1", "mpirun"])."""
    env = dict(os.environ, SHARDLAB_COLLECTIVE_TIMEOUT="120")
    env.update(env_extra or {})
    launcher = mpirun if isinstance(mpirun, list) else [mpirun]
    command = [*launcher, "--allow-run-as-root", "--oversubscribe", *mpirun_args, "-np", str(ranks), program] + args
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")


def finish(job, began, limit_s):
    """(exit status or None when it outlived limit_s + 60, seconds, output)."""
    try:
        output, _ = job.communicate(timeout=max(1.0, limit_s + 60 - (time.monotonic() - began)))
        code = job.returncode
    except subprocess.TimeoutExpired:
        for pid in ranks_of(job.pid).values():
            os.kill(pid, signal.SIGKILL)
        job.kill()
        output, _ = job.communicate()
        code = None
    return code, time.monotonic() - began, output


def run_timed(mpirun, program, args, env_extra=None, limit_s=120, ranks=2):
    """(exit status, seconds, output) of the job, killed after limit_s + 60 s."""
    began = time.monotonic()
    return finish(start(mpirun, program, args, env_extra, ranks), began, limit_s)


def ranks_of(pid):
    """{rank: pid} of mpirun `pid`'s children (Open MPI's ranks are not in its process group)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                for item in environ.read().split(b"\0"):
                    if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                        found[int(item.split(b"=")[1])] = int(entry)
        except (OSError, ValueError):
            continue
    return found


def complete_steps(directory):
    """The steps of `directory`'s complete checkpoints (step-N with its metadata.json), oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n[5:]) for n in os.listdir(directory)
                  if ".tmp-" not in n and os.path.exists(os.path.join(directory, n, "metadata.json")))


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def read_metrics_so_far(path):
    """The records of a metrics file a running job is still writing: a line being written is left out."""
    if not os.path.exists(path):
        return []
    found = []
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def same_bytes(a, b):
    """Two saved models (a file, or a directory of files) hold the same bytes."""
    if os.path.isfile(a):
        return os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)
    names = sorted(os.listdir(a))
    return (os.path.isdir(b) and names == sorted(os.listdir(b))
            and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names))


def rank0_losses(path):
    """{step: loss} of rank 0's per-step records."""
    return {r["step"]: r["loss"] for r in read_metrics(path) if r.get("rank") == 0 and "loss" in r}


class Checks:
    """check(name, ok, detail): one line per check ("ok: ..." or "FAILED: ..." and the detail);
    summary(suite, skipped) prints "suite: N passed, N failed, N skipped" and returns the exit status."""

    def __init__(self):
        self.results = []

    def __call__(self, name, ok, detail=""):
        print(f"{'ok' if ok else 'FAILED'}: {name}{'' if ok or not detail else chr(10) + detail}")
        self.results.append(bool(ok))

    def summary(self, suite, skipped):
        passed = sum(self.results)
        failed = len(self.results) - passed
        print(f"{suite}: {passed} passed, {failed} failed, {skipped} skipped")
        return 1 if failed else 0


PEAK_TOLERANCE = 0.10  # predicted training peak above the loaded data, relative to the measured one


def peak_errors(records):
    """Every rank's (rank, predicted, measured) training peak above its loaded data, from the end
    records of a run with --explain, and whether each is within PEAK_TOLERANCE."""
    out = []
    for r in records:
        if r.get("predicted_peak") is None or "train_peak_memory_bytes" not in r:
            continue
        data = r["predicted_peak"]["data"]
        predicted = r["predicted_peak"]["total"] - data
        measured = r["train_peak_memory_bytes"] - data
        out.append((r["rank"], predicted, measured, abs(predicted - measured) <= PEAK_TOLERANCE * measured))
    return out


def check_peak(check, name, records, ranks):
    errors = peak_errors(records)
    check(f"{name}: predicted training peak within {PEAK_TOLERANCE:.0%} of the measured one on every rank",
          len(errors) == ranks and all(ok for *_, ok in errors),
          "\n".join(f"rank {rank}: predicted {p} B, measured {m} B above the data" for rank, p, m, _ in errors)
          or "no end records with a prediction")


def mib(n):
    return f"{n} B ({n / 1048576:.1f} MiB)"


def check_dry_runs_change_nothing(check, mpirun, program, ranks, args, scratch, saved_weights):
    """--explain's dry forward/backwards leave no trace: the same step losses and saved model, bit for
    bit, as without them. saved_weights(path) is the weights file --save-model path writes."""
    runs = []
    for explain in (False, True):
        metrics = os.path.join(scratch, f"dry-{explain}.jsonl")
        model = os.path.join(scratch, f"dry-{explain}")
        code, output = run_job(mpirun, program, ranks, args + ["--metrics", metrics, "--save-model", model]
                               + (["--explain"] if explain else []))
        losses = [r["loss"] for r in read_metrics(metrics) if r.get("rank") == 0 and "loss" in r]
        runs.append((code, losses, saved_weights(model), output))
    (code0, losses0, model0, _), (code1, losses1, model1, output) = runs
    check(f"{os.path.basename(program)} np {ranks}: the dry forward/backwards of --explain change nothing "
          "(step losses and saved model bit for bit)",
          code0 == 0 and code1 == 0 and len(losses0) > 1 and losses0 == losses1
          and filecmp.cmp(model0, model1, shallow=False),
          f"exit {code0}, {code1}; losses {losses0} vs {losses1}\n{output}")


def check_memory_limit(check, mpirun, program, ranks, args, scratch):
    """--memory-limit at the predicted peak runs; one byte below it is refused before step 1 with one
    message naming the peak and the limit; a suffixed limit is read in powers of 1024."""
    name = os.path.basename(program)
    metrics = os.path.join(scratch, f"{name}-fit.jsonl")
    code, output = run_job(mpirun, program, ranks, args + ["--explain", "--metrics", metrics])
    records = [r for r in read_metrics(metrics) if r.get("predicted_peak")]
    if code != 0 or len(records) != ranks:
        check(f"{name} np {ranks} --explain records a predicted peak per rank", False, f"exit {code}\n{output}")
        return
    worst = max(records, key=lambda r: (r["predicted_peak"]["total"], -r["rank"]))
    peak = worst["predicted_peak"]["total"]
    code, output = run_job(mpirun, program, ranks, args + ["--memory-limit", str(peak)])
    check(f"{name} np {ranks} --memory-limit at the predicted peak ({peak} B) trains", code == 0,
          f"exit {code}\n{output}")
    code, output = run_job(mpirun, program, ranks, args + ["--memory-limit", str(peak - 1)])
    message = (f"{name}: will not fit: the predicted training peak of rank {worst['rank']} is {mib(peak)}, "
               f"over --memory-limit {mib(peak - 1)} by {mib(1)}\nlargest terms: ")
    check(f"{name} np {ranks} --memory-limit one byte under the peak is refused, explained once",
          code == 1 and output.count(message) == 1 and output.count("what would lower it:") == 1,
          f"exit {code}, expected once: {message}\n{output}")
    code, output = run_job(mpirun, program, ranks, args + ["--memory-limit", "1K"])
    check(f"{name} np {ranks} --memory-limit 1K is 1024 bytes, refused",
          code == 1 and output.count("over --memory-limit 1024 B (0.0 MiB)") == 1, f"exit {code}\n{output}")
    code, output = run_job(mpirun, program, ranks, args + ["--memory-limit", "2X"])
    message = f"{name}: --memory-limit: got '2X', expected a number of bytes (digits with an optional K, M, G or T: 512M, 2G)"
    check(f"{name} np {ranks} --memory-limit 2X is refused, explained once",
          code == 1 and output.count(message) == 1, f"exit {code}\n{output}")
