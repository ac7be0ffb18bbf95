#!/usr/bin/env python3
"""tests/dist/fault_tests.py: runs tests/dist/fault_program under mpirun and checks that faults
end the job with a non-zero exit and an explanation, within bounded time, instead of hanging:

- a hung rank: every other rank's watchdog fires after the (short) collective timeout, prints
  its ledger tail and aborts; the job must end within timeout + 10 s;
- a killed rank (SIGKILL mid-collective): the job must end, not hang (well before the default
  10-minute watchdog);
- a mismatched program in debug mode (SHARDLAB_DIST_DEBUG=1): every rank reports both sides;
- bad environment settings, or a device or backend the machine lacks: a clear error.

Usage: fault_tests.py <mpirun> <fault_program>. Prints one line per check with the observed
exit status and time, then "dist_faults: N passed, N failed, 0 skipped".
"""
import os
import socket
import subprocess
import sys
import time

HANG_TIMEOUT_S = 2.0


def run_job(mpirun, program, ranks, scenario, env_extra, limit_s):
    env = dict(os.environ, **env_extra)
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), program, scenario]
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=limit_s + 60, text=True)
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        code, output = None, expired.stdout or ""
        if isinstance(output, bytes):  # TimeoutExpired keeps bytes even when text=True
            output = output.decode(errors="replace")
    return code, time.monotonic() - start, output


def main(mpirun, program):
    results = []

    def check(name, ok, code, seconds, limit_s, output):
        verdict = "ok" if ok else "FAILED"
        print(f"{verdict}: {name}: exit {code} after {seconds:.1f} s (limit {limit_s:.0f} s)")
        if not ok:
            print("---- job output ----\n" + output + "---- end ----")
        results.append(ok)

    for ranks in (2, 3, 4):
        limit = HANG_TIMEOUT_S + 10
        code, seconds, output = run_job(mpirun, program, ranks, "hang",
                                        {"SHARDLAB_COLLECTIVE_TIMEOUT": str(HANG_TIMEOUT_S)}, limit)
        # Every waiting rank's watchdog fires; the first to abort has mpirun kill the rest, so
        # at least one report (with its ledger tail) must be there.
        reports = [f"[rank {r}] collective watchdog on host {socket.gethostname()}: #4 world all_reduce(f32, 1024, "
                   f"sum) 'never matched' running for" for r in range(ranks) if r != 1]
        ok = (code not in (0, None) and seconds <= limit and any(line in output for line in reports)
              and "#3 world all_reduce(f32, 16, sum) 'warm-up' completed in" in output)
        check(f"hung rank at np {ranks} ends the job via the watchdog", ok, code, seconds, limit, output)

    for ranks in (2, 4):
        limit = 30.0
        code, seconds, output = run_job(mpirun, program, ranks, "kill", {}, limit)
        ok = code not in (0, None) and seconds <= limit and "[rank 1] killing myself with SIGKILL" in output
        check(f"rank killed by SIGKILL at np {ranks} ends the job", ok, code, seconds, limit, output)

    for ranks in (2, 4):
        limit = 30.0
        code, seconds, output = run_job(mpirun, program, ranks, "mismatch", {"SHARDLAB_DIST_DEBUG": "1"}, limit)
        message = ("collective mismatch on communicator 'world': rank 1 called reduce_scatter(f32, 1024) #17 "
                   "while rank 0 called all_gather(f32, 2048) #17")
        # dist::log prints once, on rank 0; dist::log_all on every rank with its prefix.
        ok = (code == 1 and all(f"[rank {r}] error: {message}" in output for r in range(ranks))
              and output.count(f"scenario mismatch on {ranks} ranks") == 1)
        check(f"mismatch at np {ranks} is reported on every rank", ok, code, seconds, limit, output)

    for variable, value, message in (
            ("SHARDLAB_COLLECTIVE_TIMEOUT", "soon",
             "dist::init: SHARDLAB_COLLECTIVE_TIMEOUT must be a positive number of seconds, not 'soon'"),
            ("SHARDLAB_COLLECTIVE_TIMEOUT", "-3",
             "dist::init: SHARDLAB_COLLECTIVE_TIMEOUT must be a positive number of seconds, not '-3'"),
            ("SHARDLAB_DIST_DEBUG", "maybe",
             "dist::init: SHARDLAB_DIST_DEBUG must be 1, true, 0 or false, not 'maybe'")):
        limit = 30.0
        code, seconds, output = run_job(mpirun, program, 2, "mismatch", {variable: value}, limit)
        # dist::init failed on every rank; the first rank to exit ends the job, so at least one
        # (with the default rank prefix: no rank is known) prints before mpirun stops the rest.
        ok = code == 1 and f"[rank 0] error: {message}" in output
        check(f"{variable}={value} is refused by name", ok, code, seconds, limit, output)

    # Asking for what a machine does not have. A machine with a GPU grants the first request.
    limit = 30.0
    code, seconds, output = run_job(mpirun, program, 2, "want-cuda", {}, limit)
    refused = code == 1 and "[rank 0] error: dist::init: device cuda was requested but " in output
    granted = code == 0 and "[rank 1] running on cuda:" in output
    check("device cuda without a GPU is refused with the reason", refused or granted, code, seconds, limit, output)
    code, seconds, output = run_job(mpirun, program, 2, "want-nccl", {}, limit)
    ok = code == 1 and ("[rank 0] error: dist::init: the NCCL backend needs a CUDA device, but this rank runs "
                        "on cpu") in output
    check("the NCCL backend on a CPU device is refused", ok, code, seconds, limit, output)

    failed = results.count(False)
    print(f"dist_faults: {len(results) - failed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
