"""tests/apps/jobs.py: what the app tests share: starting a job under mpirun (or a plain command)
with a time limit, reading the JSON-lines metrics files the apps write, and reporting checks."""
import json
import os
import subprocess

LIMIT_S = 300


def run_job(mpirun, program, ranks, args):
    """(exit status or None when killed, output) of `program args` on `ranks` ranks."""
    # A collective that hangs fails the job in 2 minutes instead of the default 10.
    env = dict(os.environ, SHARDLAB_COLLECTIVE_TIMEOUT="120")
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), program] + args
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


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


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
