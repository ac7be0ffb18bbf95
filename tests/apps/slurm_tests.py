#!/usr/bin/env python3
"""tests/apps/slurm_tests.py: shardlab under a real Slurm as clusters run it: scripts/slurm-cluster starts
two nodes (network namespaces of this machine, Debian's slurm-wlm and munge) and the suite checks that

- sbatch + mpirun: examples/slurm/train.sbatch trains the CNN on 2 nodes x 1 task, mpirun inside the
  allocation puts a rank on each node, and every rank's step losses equal those of mpirun -np 2 on this
  machine bit for bit;
- srun --mpi=pmix (Slurm starts the ranks itself, PMIx v4): the same losses;
- preemption: `scancel --batch --signal=USR1` during the sbatch job: the ranks stop after the step in
  flight with its checkpoint and exit 75, Slurm queues the job again (RequeueExit=75), it resumes from
  that checkpoint and its losses continue the uninterrupted run's bit for bit; the time from scancel to
  the first run's end is printed;
- a node lost mid-job (its link cut): the job ends within the collective watchdog's time plus the cluster's
  node timeout, its output naming the node;
- afterwards no slurmctld, slurmd or munged of the suite runs and no namespace of it is left.

Each job has a time bound. Usage: slurm_tests.py <mpirun> <train_cnn> <slurm-cluster>. Needs root, the
packages (scripts/setup) and the data set; without them every case is skipped. Prints one line per
check, then "slurm: N passed, N failed, N skipped".
"""
import os
import subprocess
import sys
import tempfile
import time

from jobs import Checks, read_metrics, run_job

DATA_DIR = "/usr/share/datasets/fashion-mnist"
PREFIX = "slm"
SBATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "slurm", "train.sbatch")
ARGS = ["--limit-train", "2000", "--limit-test", "64", "--global-batch", "64", "--threads", "1"]
STEPS = 6
PREEMPT_STEPS = 40      # long enough to be stopped in the middle
WATCHDOG_S = 10         # SHARDLAB_COLLECTIVE_TIMEOUT of the lost-node job
NODE_TIMEOUT_S = 5      # SlurmdTimeout of scripts/slurm-cluster
JOB_LIMIT_S = 120
CASES = 9  # the checks, skipped together where no cluster can be made
# Root may run mpirun when these say so; sbatch passes them on to the job.
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def step_losses(path):
    return sorted((r["rank"], r["step"], r["loss"]) for r in read_metrics(path) if "loss" in r and "step" in r)


class Cluster:
    def __init__(self, script, directory):
        self.script, self.directory = script, directory
        up = subprocess.run([script, "--prefix", PREFIX, "up", directory], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=120)
        self.status, self.output = up.returncode, up.stdout

    def __enter__(self):
        return self

    def __exit__(self, *_):
        subprocess.run([self.script, "--prefix", PREFIX, "down", self.directory], check=False, timeout=120)

    def run(self, command, env=None, timeout=JOB_LIMIT_S):
        """(exit status or None when it outlived `timeout`, output) of `command` on the submit node."""
        try:
            done = subprocess.run([self.script, "--prefix", PREFIX, "exec", self.directory] + command,
                                  env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout)
            return done.returncode, done.stdout
        except subprocess.TimeoutExpired as expired:
            return None, f"{expired.stdout or ''}\n(killed after {timeout} s)"

    def job_field(self, job, field):
        _, output = self.run(["scontrol", "show", "job", job], timeout=30)
        for word in output.split():
            if word.startswith(field + "="):
                return word.split("=", 1)[1]
        return None

    def wait_for_state(self, job, states, limit_s):
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            state = self.job_field(job, "JobState")
            if state in states:
                return state
            time.sleep(0.5)
        return self.job_field(job, "JobState")


def submit(cluster, scratch, name, program, args, env=None, sbatch_args=()):
    """(job id, output path) of examples/slurm/train.sbatch submitted on 2 nodes x 1 task."""
    out = os.path.join(scratch, f"{name}.out")
    code, output = cluster.run(["sbatch", "--parsable", "--nodes", "2", "--ntasks-per-node", "1",
                                "--chdir", scratch, "--output", out, *sbatch_args, SBATCH, program, *args],
                               env=dict(AS_ROOT, CHECKPOINT_DIR=f"{name}-checkpoints", **(env or {})))
    return (output.strip().split(";")[0] if code == 0 else None), out, output


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def check_launches(check, cluster, mpirun, program, scratch):
    reference = os.path.join(scratch, "reference.jsonl")
    code, output = run_job(mpirun, program, 2, ARGS + ["--steps", str(STEPS), "--metrics", reference])
    expected = step_losses(reference) if code == 0 else None
    check("the reference: mpirun -np 2 on this machine trains", code == 0 and len(expected) == 2 * STEPS,
          f"exit {code}\n{output}")

    code, output = cluster.run(["sbatch", "--wait", "--nodes", "2", "--ntasks-per-node", "1", "--chdir", scratch,
                                "--output", os.path.join(scratch, "hosts.out"), "--wrap", "mpirun hostname"],
                               env=AS_ROOT)
    hosts = sorted(read(os.path.join(scratch, "hosts.out")).split())
    check("sbatch: mpirun inside the allocation starts a rank on each node", code == 0 and
          hosts == [f"{PREFIX}-1", f"{PREFIX}-2"], f"exit {code}, hosts {hosts}\n{output}")

    metrics = os.path.join(scratch, "sbatch.jsonl")
    job, out, output = submit(cluster, scratch, "sbatch", program, ARGS + ["--steps", str(STEPS), "--metrics", metrics])
    state = cluster.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_LIMIT_S) if job else None
    check("sbatch examples/slurm/train.sbatch on 2 nodes: every rank's step losses equal mpirun -np 2's bit for bit",
          state == "COMPLETED" and step_losses(metrics) == expected, f"job {job} {state}\n{output}\n{read(out)}")

    metrics = os.path.join(scratch, "srun.jsonl")
    code, output = cluster.run(["srun", "--nodes", "2", "--ntasks", "2", "--mpi=pmix", "--chdir", scratch, program,
                                *ARGS, "--steps", str(STEPS), "--metrics", metrics])
    check("srun --mpi=pmix on 2 nodes: every rank's step losses equal mpirun -np 2's bit for bit",
          code == 0 and step_losses(metrics) == expected, f"exit {code}\n{output}")


def check_preemption(check, cluster, mpirun, program, scratch):
    """scancel --batch --signal=USR1 in the middle of the example's job: stopped, requeued, resumed."""
    args = ARGS + ["--steps", str(PREEMPT_STEPS), "--checkpoint-every", "5"]
    reference = os.path.join(scratch, "uninterrupted.jsonl")
    code, _ = run_job(mpirun, program, 2, args + ["--metrics", reference, "--checkpoint-dir",
                                                  os.path.join(scratch, "uninterrupted-checkpoints")])
    metrics = os.path.join(scratch, "preempted.jsonl")
    job, out, output = submit(cluster, scratch, "preempted", program, args + ["--metrics", metrics])
    deadline = time.monotonic() + JOB_LIMIT_S
    while job and time.monotonic() < deadline and len(step_losses(metrics)) < 2 * 8:
        time.sleep(0.1)
    signalled = time.monotonic()
    cluster.run(["scancel", "--batch", "--signal=USR1", job], timeout=30)
    while time.monotonic() < deadline and "stopped by SIGUSR1" not in read(out):
        time.sleep(0.1)
    stopped = time.monotonic() - signalled
    # The first run's end: the job queued again, its restart count up, its exit code the first run's.
    restarts = first_exit = None
    while time.monotonic() < deadline and restarts != "1":
        restarts, first_exit = cluster.job_field(job, "Restarts"), cluster.job_field(job, "ExitCode")
        time.sleep(0.2)
    ended = time.monotonic() - signalled
    state = cluster.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_LIMIT_S)
    text = read(out)
    print(f"slurm: scancel --signal=USR1 to the stop line {stopped:.1f} s, to the job queued again {ended:.1f} s")
    check("scancel --batch --signal=USR1: the ranks stop after a step with its checkpoint and exit 75, the job is "
          "queued again (RequeueExit=75)", "stopped by SIGUSR1 after step" in text and restarts == "1"
          and first_exit == "75:0", f"job {job}, restarts {restarts}, exit code {first_exit}\n{output}\n{text}")
    check("the requeued job resumes from that checkpoint and its losses continue the uninterrupted run's bit for bit",
          code == 0 and state == "COMPLETED" and "resumed from preempted-checkpoints/step-" in text
          and step_losses(metrics) == step_losses(reference), f"job {job} {state}, reference exit {code}\n{text}")


def check_lost_node(check, cluster, netns, program, scratch):
    """A node's link cut while the job runs: the job ends, naming the node, in the watchdog's time plus the
    node timeout."""
    metrics = os.path.join(scratch, "lost.jsonl")
    job, out, output = submit(cluster, scratch, "lost", program, ARGS + ["--steps", "2000", "--metrics", metrics],
                              env={"SHARDLAB_COLLECTIVE_TIMEOUT": str(WATCHDOG_S)}, sbatch_args=["--no-requeue"])
    deadline = time.monotonic() + JOB_LIMIT_S
    while job and time.monotonic() < deadline and len(step_losses(metrics)) < 2 * 5:
        time.sleep(0.1)
    cut = time.monotonic()
    subprocess.run([netns, "cut", f"{PREFIX}-2"], check=False)
    state = cluster.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "COMPLETING"},
                                   WATCHDOG_S + NODE_TIMEOUT_S + 30)
    seconds = time.monotonic() - cut
    subprocess.run([netns, "mend", f"{PREFIX}-2"], check=False)
    text = read(out)
    print(f"slurm: a node's link cut to the job's end {seconds:.1f} s ({state})")
    check(f"a node lost mid-job: the job ends within the watchdog's {WATCHDOG_S} s and the node timeout's "
          f"{NODE_TIMEOUT_S} s, its output naming the node",
          state is not None and state != "RUNNING" and seconds <= WATCHDOG_S + NODE_TIMEOUT_S
          and f"on node {PREFIX}-2" in text, f"job {job} {state} after {seconds:.1f} s\n{output}\n{text}")


def nothing_left(check, directory):
    running = subprocess.run(["ps", "-eo", "comm,args"], stdout=subprocess.PIPE, text=True).stdout.splitlines()
    left = [line for line in running if line.split()[0] == "slurmstepd"
            or (line.split()[0] in ("slurmctld", "slurmd", "munged") and directory in line)]
    namespaces = [line for line in subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE,
                                                  text=True).stdout.splitlines() if line.startswith(PREFIX + "-")]
    check("afterwards no daemon of the cluster runs and no namespace of it is left", not left and not namespaces,
          f"{left}\n{namespaces}")


def main(mpirun, program, slurm_cluster):
    check = Checks()
    program = os.path.abspath(program)
    if not os.path.isdir(DATA_DIR):
        print(f"skipped: every case, {DATA_DIR} is missing (scripts/setup installs it)")
        return check.summary("slurm", CASES)
    netns = os.path.join(os.path.dirname(os.path.abspath(slurm_cluster)), "netns-hosts")
    with tempfile.TemporaryDirectory(prefix="slurm_tests.") as scratch:
        directory = os.path.join(scratch, "cluster")
        with Cluster(slurm_cluster, directory) as cluster:
            if cluster.status == 77:
                print(f"skipped: every case, no cluster here: {cluster.output.strip()}")
                return check.summary("slurm", CASES)
            check("scripts/slurm-cluster up: both nodes idle", cluster.status == 0, cluster.output)
            if cluster.status == 0:
                check_launches(check, cluster, mpirun, program, scratch)
                check_preemption(check, cluster, mpirun, program, scratch)
                check_lost_node(check, cluster, netns, program, scratch)
        nothing_left(check, directory)
    return check.summary("slurm", 0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
