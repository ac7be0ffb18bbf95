#!/usr/bin/env python3
"""tests/apps/preemption_tests.py: a job stopped the way a cluster preempts one. SIGTERM to every
rank (what Slurm's scancel and a preemption do) mid-run, for train_cnn and train_llama at np 2 and
4: the step in flight finishes, every rank stops after the same step, the checkpoint of that step is
written, one line names the step and the checkpoint, the job exits 75, and --resume continues the
uninterrupted run's losses bit for bit. SIGUSR1 to mpirun (which forwards it at once) stops the
same way; SIGTERM to mpirun itself reaches the ranks after Open MPI's odls_base_sigkill_timeout,
and with that raised the checkpoint is written (mpirun then exits 1, its own status); a second
SIGTERM ends the ranks at once, without the line. With --async-checkpoint, SIGTERM to every rank as
a background save begins: that save is committed at the stop before the program exits, and
--resume continues bit for bit.

Usage: preemption_tests.py <mpirun> <train_cnn> <train_llama>. Needs Fashion-MNIST and Debian's
fortunes (scripts/setup); without them their cases are skipped. Ends with "preemption: N passed,
N failed, N skipped".
"""
import os
import signal
import sys
import tempfile
import time

from jobs import Checks, complete_steps, finish, rank0_losses, ranks_of, read_metrics_so_far, run_timed, start

STOPPED = 75  # apps/support/stop_signals.h: kExitStoppedBySignal
STEPS = 12
SIGNAL_AFTER = 3  # the signal goes once this step's record is in the metrics file
CNN_DATA = "/usr/share/datasets/fashion-mnist"
LLAMA_DATA = "/usr/share/games/fortunes"
CNN_BASE = ["--limit-train", "640", "--limit-test", "200", "--global-batch", "64", "--threads", "1"]
CNN_ARGS = CNN_BASE + ["--epochs", "2", "--steps", str(STEPS)]
LLAMA_ARGS = ["--config", "tiny", "--seq", "48", "--global-batch", "12", "--limit-documents", "240",
              "--lr", "3e-3", "--threads", "1", "--steps", str(STEPS)]
RANKS = (2, 4)
CASES_PER_APP = 2 * len(RANKS)  # per world size: the stop, and the resume
CNN_ONLY_CASES = 5  # SIGUSR1 to mpirun, SIGTERM to mpirun, a second SIGTERM, during a background save (2)


class Suite:
    def __init__(self, mpirun, scratch, check):
        self.mpirun, self.scratch, self.check = mpirun, scratch, check
        self.references = {}

    def path(self, name):
        return os.path.join(self.scratch, name)

    def reference(self, name, program, args, ranks):
        """The uninterrupted run's losses, step by step."""
        key = (program, ranks)
        if key not in self.references:
            metrics = self.path(f"{name}-np{ranks}-reference.jsonl")
            code, _, output = run_timed(self.mpirun, program, args + ["--metrics", metrics], ranks=ranks)
            if code != 0:
                raise RuntimeError(f"the uninterrupted {name} run at np {ranks} failed: exit {code}\n{output}")
            self.references[key] = rank0_losses(metrics)
        return self.references[key]

    def interrupt(self, name, program, args, ranks, send, mpirun_args=(), after=SIGNAL_AFTER, limit_s=120):
        """Starts the job with a checkpoint directory, calls send(job) once step `after` is done;
        (exit status, seconds from the signal to the end, output, directory, the stop record)."""
        directory, metrics = self.path(f"{name}-dir"), self.path(f"{name}.jsonl")
        began = time.monotonic()
        job = start(self.mpirun, program, args + ["--checkpoint-dir", directory, "--checkpoint-every", "100000",
                                                  "--metrics", metrics], ranks=ranks, mpirun_args=mpirun_args)
        sent = None
        while job.poll() is None and time.monotonic() - began < limit_s:
            if any(r.get("step", 0) >= after for r in read_metrics_so_far(metrics) if "loss" in r):
                send(job)
                sent = time.monotonic()
                break
            time.sleep(0.005)
        code, _, output = finish(job, began, limit_s)
        stops = [r for r in read_metrics_so_far(metrics) if r.get("rank") == 0 and "stopped_by" in r]
        seconds = time.monotonic() - sent if sent else None
        return code, seconds, output, directory, stops[0] if stops else None

    def resumes_bit_for_bit(self, case, program, args, ranks, directory, step, expected):
        """Whether --resume from `directory` (newest: `step`) continues the run's losses bit for bit;
        (ok, detail)."""
        metrics = self.path(f"{case}-resumed.jsonl")
        code, _, output = run_timed(self.mpirun, program, args + ["--checkpoint-dir", directory, "--resume",
                                                                  "--metrics", metrics], ranks=ranks)
        resumed = rank0_losses(metrics)
        ok = code == 0 and sorted(resumed) == list(range(step + 1, STEPS + 1)) and all(
            resumed[s] == expected[s] for s in resumed)
        return ok, f"exit {code}: {resumed}\nreference {expected}\n{output}"

    def stop_during_background_save(self, cnn, attempts=4):
        """SIGTERM to every rank once a save's temporary directory appears (--async-checkpoint, a save
        every 2 steps): while the save is in flight, so the stop commits it (the log says so), and the
        newest checkpoint resumes bit for bit. A poll may commit the save before the signal lands:
        then another attempt."""
        expected = self.reference("cnn", cnn, CNN_ARGS, 2)
        for attempt in range(attempts):
            directory, metrics = self.path(f"async-stop-{attempt}-dir"), self.path(f"async-stop-{attempt}.jsonl")
            began = time.monotonic()
            job = start(self.mpirun, cnn, CNN_ARGS + ["--checkpoint-dir", directory, "--checkpoint-every", "2",
                                                      "--async-checkpoint", "--metrics", metrics], ranks=2)
            under_way = None
            while job.poll() is None and time.monotonic() - began < 120:
                names = os.listdir(directory) if os.path.isdir(directory) else []
                steps = [int(n[5:13]) for n in names if ".tmp-" in n and int(n[5:13]) >= 4]
                if steps:
                    under_way = steps[0]
                    for pid in ranks_of(job.pid).values():
                        os.kill(pid, signal.SIGTERM)
                    break
                time.sleep(0.0005)
            code, _, output = finish(job, began, 120)
            line = f"train_cnn: saved checkpoint {directory}/step-{under_way:08d} in the background (committed at the stop)"
            if under_way is None or line not in output:
                continue
            stops = [r for r in read_metrics_so_far(metrics) if r.get("rank") == 0 and "stopped_by" in r]
            step = stops[0]["step"] if stops else None
            # The stop comes at the first boundary after the signal: step under_way's, or the next one's
            # when a rank was past it (then the stop's own checkpoint follows the committed one).
            complete = complete_steps(directory)
            self.check(f"train_cnn np 2 --async-checkpoint: SIGTERM as step {under_way}'s save begins: the save is "
                       f"committed at the stop, exit {code}, stopped after step {step}",
                       code == STOPPED and step is not None and step >= under_way and under_way in complete
                       and complete[-1] == step, f"complete {complete}\n{output}")
            ok, detail = self.resumes_bit_for_bit(f"async-stop-{attempt}", cnn, CNN_ARGS, 2, directory, step, expected)
            self.check(f"train_cnn np 2 --async-checkpoint: --resume from step {step} continues bit for bit", ok, detail)
            return
        self.check("train_cnn np 2 --async-checkpoint: SIGTERM reached the ranks while a save was in flight", False,
                   f"in {attempts} attempts")
        self.check("train_cnn np 2 --async-checkpoint: --resume continues bit for bit", False, "nothing to resume")

    def stops_and_resumes(self, name, program, args, ranks, program_name):
        expected = self.reference(name, program, args, ranks)

        def to_every_rank(job):
            for pid in ranks_of(job.pid).values():
                os.kill(pid, signal.SIGTERM)

        case = f"{name}-np{ranks}"
        code, seconds, output, directory, stop = self.interrupt(case, program, args, ranks, to_every_rank)
        step = stop["step"] if stop else None
        line = (f"{program_name}: stopped by SIGTERM after step {step}: checkpoint {stop['checkpoint']} saved, "
                f"continue with --resume") if stop else None
        stopped = (code == STOPPED and stop is not None and SIGNAL_AFTER <= step < STEPS and line in output
                   and complete_steps(directory) == [step])
        self.check(f"{program_name} np {ranks}: SIGTERM to every rank after step {SIGNAL_AFTER} stops after step "
                   f"{step}, its checkpoint written and named, exit {code} ({seconds and round(seconds, 1)} s)",
                   stopped, f"complete {complete_steps(directory)}, stop record {stop}\n{output}")
        if not stopped:
            self.check(f"{program_name} np {ranks}: --resume continues bit for bit", False, "nothing to resume")
            return
        ok, detail = self.resumes_bit_for_bit(case, program, args, ranks, directory, step, expected)
        self.check(f"{program_name} np {ranks}: --resume from step {step} gives the uninterrupted run's losses "
                   f"bit for bit", ok, detail)

    def other_ways(self, cnn):
        code, _, output, directory, stop = self.interrupt("usr1", cnn, CNN_ARGS, 2,
                                                          lambda job: os.kill(job.pid, signal.SIGUSR1))
        self.check("train_cnn np 2: SIGUSR1 to mpirun (forwarded at once) stops with its checkpoint, exit 75",
                   code == STOPPED and stop is not None and stop["stopped_by"] == "SIGUSR1"
                   and f"train_cnn: stopped by SIGUSR1 after step {stop['step']}" in output
                   and complete_steps(directory) == [stop["step"]], f"exit {code}, stop {stop}\n{output}")

        # Open MPI passes SIGTERM on to the ranks odls_base_sigkill_timeout after it got it and kills
        # them as long after: a run of 400 steps (about 30 s), the timeout raised to 3 s.
        long_run = CNN_BASE + ["--epochs", "40", "--steps", "400"]
        code, seconds, output, directory, stop = self.interrupt(
            "mpirun-term", cnn, long_run, 2, lambda job: os.kill(job.pid, signal.SIGTERM),
            mpirun_args=("--mca", "odls_base_sigkill_timeout", "3"))
        self.check(f"train_cnn np 2: SIGTERM to mpirun with odls_base_sigkill_timeout 3 stops with its checkpoint "
                   f"({seconds and round(seconds, 1)} s; mpirun's own exit {code})",
                   code not in (0, None) and stop is not None and stop["stopped_by"] == "SIGTERM"
                   and complete_steps(directory) == [stop["step"]] and stop["step"] < 400,
                   f"exit {code}, stop {stop}\n{output}")

        def twice(job):
            victims = ranks_of(job.pid).values()
            for pid in victims:
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.005)
            for pid in victims:
                os.kill(pid, signal.SIGTERM)

        code, seconds, output, directory, stop = self.interrupt("twice", cnn, CNN_ARGS, 2, twice)
        self.check(f"train_cnn np 2: a second SIGTERM ends the ranks at once ({seconds and round(seconds, 1)} s, "
                   f"exit {code}), no stop line, no checkpoint",
                   code not in (0, STOPPED, None) and stop is None and "stopped by" not in output
                   and complete_steps(directory) == [] and seconds is not None and seconds < 10,
                   f"stop {stop}\n{output}")


def main(mpirun, cnn, llama):
    check = Checks()
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="preemption.") as scratch:
        suite = Suite(mpirun, scratch, check)
        if os.path.isdir(CNN_DATA):
            for ranks in RANKS:
                suite.stops_and_resumes("cnn", cnn, CNN_ARGS, ranks, "train_cnn")
            suite.other_ways(cnn)
            suite.stop_during_background_save(cnn)
        else:
            print(f"skipped: {CASES_PER_APP + CNN_ONLY_CASES} train_cnn cases, {CNN_DATA} is missing "
                  f"(scripts/setup installs dataset-fashion-mnist)")
            skipped += CASES_PER_APP + CNN_ONLY_CASES
        if os.path.isdir(LLAMA_DATA):
            for ranks in RANKS:
                suite.stops_and_resumes("llama", llama, LLAMA_ARGS, ranks, "train_llama")
        else:
            print(f"skipped: {CASES_PER_APP} train_llama cases, {LLAMA_DATA} is missing (scripts/setup installs "
                  f"fortunes)")
            skipped += CASES_PER_APP
    return check.summary("preemption", skipped)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: preemption_tests.py <mpirun> <train_cnn> <train_llama>")
    sys.exit(main(*sys.argv[1:]))
