#!/usr/bin/env python3
"""tests/apps/multinode_tests.py: the multi-node recipe of docs/multinode.md on one machine: two "nodes"
from a hostfile naming localhost twice, MPI's bytes over TCP only (--mca pml ob1 --mca btl tcp,self,
the TCP interfaces named as on a cluster), and checks that:

- train_cnn trains 6 steps at np 2 that way, and every rank's step losses equal those of the usual
  shared-memory run bit for bit (the same reductions in the same order, whatever carries the bytes);
- the same job with the self transport alone fails, naming the unreachable ranks: with tcp,self the
  bytes between the ranks did go over TCP.

Usage: multinode_tests.py <mpirun> <train_cnn>. Needs the dataset from scripts/setup
(/usr/share/datasets/fashion-mnist); without it every case is skipped. Prints one line per check,
then "multinode: N passed, N failed, N skipped".
"""
import os
import sys
import tempfile

from jobs import Checks, read_metrics, run_job

DATA_DIR = "/usr/share/datasets/fashion-mnist"
ARGS = ["--steps", "6", "--limit-train", "768", "--global-batch", "64", "--test-batch-size", "1000",
        "--threads", "1"]
# ob1 is the point-to-point layer that uses the BTLs (UCX, where present, would bypass them); the
# loopback interface stands for the cluster's network (eth0, ib0) in docs/multinode.md.
TCP_ONLY = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
            "--mca", "oob_tcp_if_include", "lo"]


def step_losses(path):
    return sorted((r["rank"], r["step"], r["loss"]) for r in read_metrics(path) if "loss" in r and "step" in r)


def main(mpirun, program):
    check = Checks()
    if not os.path.isdir(DATA_DIR):
        print(f"skipped: every case, {DATA_DIR} is missing (scripts/setup installs it)")
        return check.summary("multinode", 2)
    with tempfile.TemporaryDirectory(prefix="multinode_tests.") as scratch:
        hostfile = os.path.join(scratch, "hostfile")
        with open(hostfile, "w", encoding="utf-8") as f:
            f.write("localhost\nlocalhost\n")  # one slot per line: two "nodes" of one rank
        nodes = ["--hostfile", hostfile, "--map-by", "slot"]

        runs = {}
        for name, mpirun_args in (("shared memory", []), ("tcp", nodes + TCP_ONLY)):
            metrics = os.path.join(scratch, f"{name}.jsonl")
            code, output = run_job(mpirun, program, 2, ARGS + ["--metrics", metrics], mpirun_args)
            runs[name] = (code, step_losses(metrics), output)
        (shm_code, shm, _), (tcp_code, tcp, output) = runs["shared memory"], runs["tcp"]
        check("np 2 over TCP from a hostfile: every rank's step losses equal the shared-memory run's bit for bit",
              shm_code == 0 and tcp_code == 0 and len(shm) == 12 and tcp == shm,
              f"exit {shm_code}, {tcp_code}\nshared memory {shm}\ntcp {tcp}\n{output}")

        code, output = run_job(mpirun, program, 2, ARGS, nodes + ["--mca", "pml", "ob1", "--mca", "btl", "self"])
        # Open MPI 4.1's mpirun sometimes crashes (SIGSEGV in show_help) while relaying that message:
        # then the job still failed before any step, which is what shows the self transport cannot.
        explained = "unable to reach each other" in output or "show_help" in output
        check("np 2 with the self transport alone fails, the ranks unable to reach each other (so tcp carried them)",
              code not in (0, None) and explained and "median step" not in output, f"exit {code}\n{output}")
    return check.summary("multinode", 0)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: multinode_tests.py <mpirun> <train_cnn>")
    sys.exit(main(sys.argv[1], sys.argv[2]))
