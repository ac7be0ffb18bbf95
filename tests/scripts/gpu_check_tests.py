#!/usr/bin/env python3
"""tests/scripts/gpu_check_tests.py: scripts/gpu-check's budget, summary and refusals, without a GPU
or a build, in a few seconds. SHARDLAB_GPU_CHECK_FAKE_STEPS adds steps that sleep and pass or fail:
- with --budget, a step expected to take longer than the budget left is not run (named, counted
  apart: never passed or skipped), the steps after it that fit run, and a run still going when the
  budget ends is stopped and not run too; the exit status stays 0, the last line names them, and
  the --log record makes scripts/summarize_tests.py count them as one failure;
- a failed step gives exit status 1;
- a command killed during a step leaves the finished steps' logs and a summary.txt naming them and
  the step that was running;
- --budget without a number of seconds above 0, an unknown step, group or option, --log without a
  file and a malformed fake step are refused in one line, before anything runs;
- --help shows the two commands and each step's expected time, the sum of the script's table.

Usage: gpu_check_tests.py <scripts/gpu-check> <scripts/summarize_tests.py>. Prints one line per
check, then "gpu_check: N passed, N failed, N skipped".
"""
import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

BUDGET_S = 6  # room for the script's start on a busy machine, before the first fake step


def environment(scratch, fakes):
    """The script's environment: fake steps, a build directory it never uses, temporary files in scratch."""
    build_dir = os.path.join(scratch, "build")
    os.makedirs(build_dir, exist_ok=True)
    return dict(os.environ, SHARDLAB_GPU_CHECK_FAKE_STEPS=fakes, SHARDLAB_BUILD_DIR=build_dir, TMPDIR=scratch)


def run(script, args, scratch, fakes=""):
    """(exit status, stdout, stderr, seconds) of the script."""
    began = time.monotonic()
    done = subprocess.run([script, *args], env=environment(scratch, fakes), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def read(path):
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as file:
        return file.read()


def summarize(summarize_script, record):
    done = subprocess.run([sys.executable, summarize_script, record], stdout=subprocess.PIPE, text=True)
    return done.returncode, done.stdout


def check_budget(check, script, summarize_script, scratch):
    out, record = os.path.join(scratch, "budget"), os.path.join(scratch, "budget.json")
    fakes = "quick:0.2:pass,slow:60:pass,after:0.1:pass,overrun:30:pass:1,late:0.5:pass"
    code, stdout, stderr, seconds = run(script, [out, "quick", "slow", "after", "overrun", "late", "--budget",
                                                 str(BUDGET_S), "--log", record], scratch, fakes)
    detail = f"exit {code}\n{stdout}{stderr}"
    check("--budget: the steps that fit run", "quick: 1 passed, 0 failed, 0 skipped\n" in stdout
          and "after: 1 passed, 0 failed, 0 skipped\n" in stdout, detail)
    check("--budget: a step expected to take longer than the budget left is not run, counted apart",
          "slow: not run: sleep 60 s, then pass (budget: expected 60 s, " in stdout
          and "slow: 0 passed, 0 failed, 0 skipped, 1 not run\n" in stdout, detail)
    check(f"--budget: a run still going when the budget ends is stopped and not run (the command took "
          f"{seconds:.1f} s of {BUDGET_S})", "overrun: not run: sleep 30 s, then pass (budget: it ended " in stdout
          and "overrun: 0 passed, 0 failed, 0 skipped, 1 not run\n" in stdout and seconds < BUDGET_S + 5, detail)
    check("--budget: nothing runs once the budget is spent",
          "late: not run: sleep 0.5 s, then pass (budget: expected 0.5 s, 0 s left)" in stdout, detail)
    closing = "2 passed, 0 failed, 0 skipped, 3 not run (budget)\n"
    check("checks not run leave exit status 0, and the last line and summary.txt name them",
          code == 0 and stdout.endswith(closing) and read(os.path.join(out, "summary.txt")).endswith(closing), detail)
    with open(record, encoding="utf-8") as file:
        result = json.loads(file.read())["result"]
    status, text = summarize(summarize_script, record)
    check("the --log record is INCOMPLETE, which scripts/summarize_tests.py counts as one failure",
          result == "INCOMPLETE" and status == 1 and "summarize_tests: gpu-check ended with INCOMPLETE" in text
          and text.endswith("2 passed, 1 failed, 0 skipped\n"), f"{result}\n{text}")


def check_failure(check, script, summarize_script, scratch):
    out, record = os.path.join(scratch, "failure"), os.path.join(scratch, "failure.json")
    code, stdout, stderr, _ = run(script, [out, "good", "bad", "--log", record], scratch, "good:0.1:pass,bad:0.1:fail")
    status, text = summarize(summarize_script, record)
    check("a failed step: exit status 1, counted as failed in the last line and by scripts/summarize_tests.py",
          code == 1 and "bad: FAILED: sleep 0.1 s, then fail\n" in stdout
          and stdout.endswith("1 passed, 1 failed, 0 skipped\n") and status == 1
          and text.endswith("1 passed, 1 failed, 0 skipped\n"), f"exit {code}\n{stdout}{stderr}\n{text}")


def check_killed(check, script, scratch):
    out = os.path.join(scratch, "killed")
    summary = os.path.join(out, "summary.txt")
    running = "not finished: slow (running)\n"
    with subprocess.Popen([script, out, "one", "two", "slow"], env=environment(scratch, "one:0.1:pass,two:0.1:fail,"
                                                                                "slow:60:pass"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True) as process:
        deadline = time.monotonic() + 30
        while not read(summary).endswith(running) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGKILL)  # the script and its sleep, as a command's time limit ends them
        process.wait()
    logs = {name: read(os.path.join(out, f"{name}.log")) for name in ("one", "two")}
    check("killed during a step: the finished steps' logs end with their summary lines",
          logs["one"].endswith("one: 1 passed, 0 failed, 0 skipped\n")
          and logs["two"].endswith("two: 0 passed, 1 failed, 0 skipped\n"), str(logs))
    check("killed during a step: summary.txt names the finished steps and the step that was running",
          read(summary) == "one: 1 passed, 0 failed, 0 skipped\ntwo: 0 passed, 1 failed, 0 skipped\n" + running,
          read(summary))


REFUSALS = (  # (arguments, fake steps, the line on stderr)
    (["--budget"], "", "--budget needs a number of seconds"),
    (["--budget", "soon"], "", "--budget needs a number of seconds above 0 (got 'soon')"),
    (["--budget", "0"], "", "--budget needs a number of seconds above 0 (got '0')"),
    (["--budget", "-30"], "", "--budget needs a number of seconds above 0 (got '-30')"),
    (["--budget", "inf"], "", "--budget needs a number of seconds above 0 (got 'inf')"),
    (["unit", "bogus"], "", "unknown step or group 'bogus' (the steps: build, unit, parity, apps, sanitize, speed; "
                            "the groups: first, second)"),
    (["first", "--fast"], "", "unknown option '--fast' (the options: --budget SECONDS, --log FILE, --help)"),
    (["unit", "--log"], "", "--log needs a file"),
    (["nap"], "nap:soon:pass", "SHARDLAB_GPU_CHECK_FAKE_STEPS: 'nap:soon:pass' is not name:seconds:pass|fail"
                               "[:expected seconds] (a name that is not a step's or a group's)"),
    (["unit"], "unit:1:pass", "SHARDLAB_GPU_CHECK_FAKE_STEPS: 'unit:1:pass' is not name:seconds:pass|fail"),
)


def check_refusals(check, script, scratch):
    out = os.path.join(scratch, "refused")
    for args, fakes, message in REFUSALS:
        code, stdout, stderr, _ = run(script, [out, *args], scratch, fakes)
        check(f"{' '.join(args)}{f' with fake steps {fakes}' if fakes else ''}: refused in one line before "
              "anything runs", code == 1 and stdout == "" and stderr.startswith(f"scripts/gpu-check: {message}")
              and stderr.count("\n") == 1 and not os.path.exists(out), f"exit {code}\n{stdout}{stderr}")


def load(script):
    loader = importlib.machinery.SourceFileLoader("gpu_check", script)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def check_help(check, script, scratch):
    code, stdout, _, _ = run(script, ["--help"], scratch)
    check("--help shows the two commands of a visit", code == 0 and all(
        f"scripts/gpu-check OUT_DIR {group} --budget 540" in stdout for group in ("first", "second")), stdout)
    shown = {name: int(seconds) for name, seconds in re.findall(r"^  (\w+) +(\d+) s  ", stdout, re.M)}
    gpu_check = load(script)
    expected = {name: round(sum(runs.values())) for name, runs in gpu_check.EXPECTED_S.items()}
    check("--help shows each step's expected time, the sum of its runs' in the script's table",
          shown == expected and list(shown) == list(gpu_check.STEPS), f"help {shown}\ntable {expected}")
    grouped = [item for group in gpu_check.GROUPS.values() for item in group]
    check("the groups first and second hold every step once, and speed's two modes",
          sorted(item.split(":")[0] for item in grouped if item != "speed:eager") == sorted(gpu_check.STEPS)
          and "speed:eager" in grouped and "speed:compile" in grouped, str(gpu_check.GROUPS))


def main(script, summarize_script):
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="gpu_check_tests.") as scratch:
        check_budget(check, script, summarize_script, scratch)
        check_failure(check, script, summarize_script, scratch)
        check_killed(check, script, scratch)
        check_refusals(check, script, scratch)
        check_help(check, script, scratch)
    return check.summary("gpu_check", 0)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gpu_check_tests.py <scripts/gpu-check> <scripts/summarize_tests.py>")
    sys.exit(main(sys.argv[1], sys.argv[2]))
