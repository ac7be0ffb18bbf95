#!/usr/bin/env python3
"""tests/apps/hosts_tests.py: train_cnn across two hosts, each a network namespace with its own
network stack and address (scripts/netns-hosts), mpirun started on the first and reaching the
second through the namespaces' launcher agent, with docs/multinode.md's flags:

- 2 hosts x 1 rank and 2 hosts x 2 ranks give every rank's step losses of the shared-memory run at
  the same world size bit for bit;
- the second host's link cut mid-run (ip link set eth0 down), and the second host's ranks killed
  mid-run: the job ends within the collective timeout (10 s) plus 10 s, naming the lost host (and
  the killed rank: Open MPI's report) and the surviving rank, its host and the collective it was in
  (ours); with the link back, the newest checkpoint resumes the uninterrupted run's losses bit for
  bit.

Usage: hosts_tests.py <mpirun> <train_cnn> <netns-hosts>. Needs root for the namespaces and the
dataset from scripts/setup; without either every case is skipped, saying why. Ends with
"hosts: N passed, N failed, N skipped".
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

from jobs import Checks, complete_steps, finish, read_metrics, read_metrics_so_far, start

DATA_DIR = "/usr/share/datasets/fashion-mnist"
PREFIX = "slhosts"
CASES = 8
STEPS = 20
ARGS = ["--limit-train", "640", "--limit-test", "200", "--global-batch", "64", "--epochs", "2", "--threads", "1",
        "--steps", str(STEPS)]
TIMEOUT_S = 10  # SHARDLAB_COLLECTIVE_TIMEOUT of the fault cases
FAULT_AFTER = 5  # the fault comes once this step's record is written


def process_name(pid):
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:  # ended since it was listed
        return None


def step_losses(path):
    return sorted((r["rank"], r["step"], r["loss"]) for r in read_metrics(path) if "loss" in r and "step" in r)


class Hosts:
    """Two namespaced hosts, made at start (stale ones of an earlier run removed) and removed at the end."""

    def __init__(self, netns, scratch):
        self.netns = netns
        made = subprocess.run([netns, "up", "2", "--prefix", PREFIX], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        self.status, self.output = made.returncode, made.stdout
        self.names, self.addresses = [], []
        if self.status == 0:
            for line in made.stdout.split("\n"):
                if line.strip():
                    name, address = line.split()
                    self.names.append(name)
                    self.addresses.append(address)
            self.network = self.addresses[0].rsplit(".", 1)[0] + ".0/24"
        self.scratch = scratch

    def __enter__(self):
        return self

    def __exit__(self, *_):
        subprocess.run([self.netns, "down", "--prefix", PREFIX], check=False)

    def mpirun_args(self, slots):
        """mpirun's flags for `slots` ranks per host, as docs/multinode.md gives them."""
        hostfile = os.path.join(self.scratch, f"hostfile-{slots}")
        with open(hostfile, "w", encoding="utf-8") as f:
            f.writelines(f"{address} slots={slots}\n" for address in self.addresses)
        return ["--hostfile", hostfile, "--map-by", "slot", "--mca", "plm_rsh_agent", f"{self.netns} agent",
                "--mca", "btl_tcp_if_include", self.network, "--mca", "oob_tcp_if_include", self.network,
                "--mca", "oob_tcp_keepalive_time", "1", "--mca", "oob_tcp_keepalive_intvl", "1",
                "--mca", "oob_tcp_keepalive_probes", "3", "-x", "SHARDLAB_COLLECTIVE_TIMEOUT"]

    def launcher(self, mpirun):
        """mpirun started on the first host, as on a cluster's first node."""
        return [self.netns, "exec", self.names[0], mpirun]


def equal_runs(check, mpirun, program, hosts, scratch):
    for slots in (1, 2):
        ranks = 2 * slots
        runs = {}
        for name, launcher, mpirun_args in (("shared memory", mpirun, []),
                                            ("hosts", hosts.launcher(mpirun), hosts.mpirun_args(slots))):
            metrics = os.path.join(scratch, f"np{ranks}-{name.replace(' ', '-')}.jsonl")
            job = start(launcher, program, ARGS + ["--metrics", metrics], ranks=ranks, mpirun_args=mpirun_args)
            code, _, output = finish(job, time.monotonic(), 120)
            runs[name] = (code, step_losses(metrics), output)
        (shm_code, shm, _), (code, on_hosts, output) = runs["shared memory"], runs["hosts"]
        check(f"2 hosts x {slots} rank{'s' if slots > 1 else ''}: every rank's step losses equal the shared-memory "
              f"np {ranks} run's bit for bit", shm_code == 0 and code == 0 and len(shm) == ranks * STEPS
              and on_hosts == shm, f"exit {shm_code}, {code}\nshared memory {shm}\nhosts {on_hosts}\n{output}")


def fault(check, mpirun, program, hosts, scratch, name, strike, messages):
    """A 2 x 1 run with checkpoints every 2 steps hit by strike() after step FAULT_AFTER; then the link is
    mended and the newest checkpoint resumed on the two hosts."""
    directory, metrics = os.path.join(scratch, f"{name}-dir"), os.path.join(scratch, f"{name}.jsonl")
    env = {"SHARDLAB_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)}
    began = time.monotonic()
    job = start(hosts.launcher(mpirun), program, ARGS + ["--checkpoint-dir", directory, "--checkpoint-every", "2",
                                                         "--metrics", metrics], env, 2, hosts.mpirun_args(1))
    struck = None
    while job.poll() is None and time.monotonic() - began < 120:
        if any(r.get("step", 0) >= FAULT_AFTER for r in read_metrics_so_far(metrics)):
            strike()
            struck = time.monotonic()
            break
        time.sleep(0.002)
    code, _, output = finish(job, began, 120)
    seconds = time.monotonic() - struck if struck else None
    subprocess.run([hosts.netns, "mend", hosts.names[1]], check=False)
    missing = [m for m in messages if m not in output]
    ended = struck is not None and code not in (0, None) and seconds <= TIMEOUT_S + 10 and not missing
    check(f"{name}: the job ends {seconds and round(seconds, 1)} s after (limit {TIMEOUT_S + 10} s), exit {code}, "
          f"naming the lost host and the surviving rank's host and collective", ended,
          f"missing {missing}\n{output}")
    found = complete_steps(directory)
    if not (ended and found):
        check(f"{name}: the newest checkpoint resumes bit for bit", False, f"complete checkpoints {found}")
        return
    resumed_metrics = os.path.join(scratch, f"{name}-resumed.jsonl")
    job = start(hosts.launcher(mpirun), program, ARGS + ["--checkpoint-dir", directory, "--resume", "--metrics",
                                                         resumed_metrics], env, 2, hosts.mpirun_args(1))
    code, _, output = finish(job, time.monotonic(), 120)
    reference = {(rank, step): loss for rank, step, loss in step_losses(os.path.join(scratch,
                                                                                     "np2-shared-memory.jsonl"))}
    resumed = step_losses(resumed_metrics)
    newest = found[-1]
    check(f"{name}: step {newest}'s checkpoint, resumed on the two hosts, gives the uninterrupted run's losses "
          "bit for bit",
          code == 0 and sorted({s for _, s, _ in resumed}) == list(range(newest + 1, STEPS + 1))
          and all(reference.get((rank, step)) == loss for rank, step, loss in resumed),
          f"exit {code}: {resumed}\n{output}")


def check_refusals(check, netns):
    """The script's own errors, which need neither root nor the data."""
    for args, status, message in ((["up", "0"], 2, "up: between 1 and 200 hosts, got 0"),
                                  (["exec", "no-such-host", "true"], 1,
                                   "netns-hosts: no network namespace is, or has the address, no-such-host")):
        done = subprocess.run([netns, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        check(f"netns-hosts {' '.join(args)}: refused, exit {status}, saying why",
              done.returncode == status and message in done.stdout, f"exit {done.returncode}\n{done.stdout}")


def main(mpirun, program, netns):
    check = Checks()
    check_refusals(check, netns)
    if not os.path.isdir(DATA_DIR):
        print(f"skipped: {CASES - 2} cases, {DATA_DIR} is missing (scripts/setup installs it)")
        return check.summary("hosts", CASES - 2)
    with tempfile.TemporaryDirectory(prefix="hosts_tests.") as scratch, Hosts(netns, scratch) as hosts:
        if hosts.status != 0:
            print(f"skipped: {CASES - 2} cases, the hosts could not be made here: {hosts.output.strip()}")
            return check.summary("hosts", CASES - 2)
        equal_runs(check, mpirun, program, hosts, scratch)
        lost, host1 = hosts.addresses[1], hosts.names[0]
        # Ours: the surviving rank 0, its host and the collective it waited in when mpirun ended it.
        ours = f"[rank 0] train_cnn: SIGTERM on host {host1} while in #"
        fault(check, mpirun, program, hosts, scratch, "cut link",
              lambda: subprocess.run([netns, "cut", hosts.names[1]], check=True),
              ["ORTE has lost communication with a remote daemon", f"on node {lost}", ours])

        def kill_ranks():
            # The ranks only: with Open MPI's daemon on that host killed too, which report comes first is a
            # race, and one of them ("ORTE was unable to reliably start one or more daemons") names no host.
            pids = subprocess.run(["ip", "netns", "pids", hosts.names[1]], stdout=subprocess.PIPE, text=True).stdout
            for pid in pids.split():
                if process_name(pid) == os.path.basename(program):
                    os.kill(int(pid), signal.SIGKILL)

        fault(check, mpirun, program, hosts, scratch, "killed ranks", kill_ranks,
              ["process rank 1 with PID", f"on node {lost} exited on signal 9", ours])
    return check.summary("hosts", 0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: hosts_tests.py <mpirun> <train_cnn> <netns-hosts>")
    sys.exit(main(*sys.argv[1:]))
