#!/usr/bin/env python3
"""tests/scripts/cpu_paths_tests.py: scripts/test-cpu-paths where it cannot run a path. On a
processor without the instructions a path needs (SHARDLAB_TEST_CPU_FLAGS stands for
/proc/cpuinfo's flags, SHARDLAB_TEST_CPU_ARCH for `uname -m`) the path is not run: it says why on one line and writes a log in which
every unit test case counts as skipped, which scripts/summarize_tests.py adds up as skipped, not
passed or failed. An unknown path exits 2 naming it. The paths that run are run by scripts/test.

Usage: cpu_paths_tests.py <scripts/test-cpu-paths> <scripts/summarize_tests.py> <build dir>. The
build's own testlog-cpu-*.json files are put back afterwards. Prints one line per check, then
"cpu_paths: N passed, N failed, N skipped".
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

PATHS = ("avx2", "baseline")


def run(script, args, flags, build_dir, arch="x86_64"):
    env = dict(os.environ, SHARDLAB_TEST_CPU_FLAGS=flags, SHARDLAB_TEST_CPU_ARCH=arch, SHARDLAB_BUILD_DIR=build_dir)
    done = subprocess.run([script] + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    return done.returncode, done.stdout


def check_skips(check, script, summarize, build_dir):
    log_dir = os.path.join(build_dir, "meson-logs")
    logs = [os.path.join(log_dir, f"testlog-cpu-{path}.json") for path in PATHS]
    status, out = run(script, list(PATHS), "avx2 fma", build_dir, arch="aarch64")
    check("a processor that is not x86-64 runs no path and exits 0", status == 0, out)
    check("both paths say so", all(f"cpu-{path}: skipped: the processor is aarch64, not x86-64" in out
                                   for path in PATHS), out)
    records = [json.loads(open(log, encoding="utf-8").read()) for log in logs if os.path.exists(log)]
    check("each skipped path leaves a log", len(records) == 2, str(records))
    skipped = [int(r["stdout"].rsplit(", ", 1)[-1].split()[0]) for r in records]
    check("every unit test case counts as skipped", len(skipped) == 2 and skipped[0] > 100 and
          skipped[0] == skipped[1], str(skipped))
    done = subprocess.run([sys.executable, summarize] + logs, stdout=subprocess.PIPE, text=True)
    check("the summary counts them as skipped, and exits 0",
          done.returncode == 0 and done.stdout.strip().endswith(f"0 passed, 0 failed, {sum(skipped)} skipped"),
          done.stdout)
    status, out = run(script, ["avx2"], "fpu sse sse2", build_dir)
    check("the avx2 path says which instructions are missing",
          status == 0 and
          "cpu-avx2: skipped: the processor lacks AVX2 FMA (shardlab's AVX2 kernels need AVX2 and FMA)" in out, out)
    status, out = run(script, ["avx2"], "fpu sse sse2 pni avx2", build_dir)
    check("AVX2 without FMA is not enough for the avx2 path",
          status == 0 and "cpu-avx2: skipped: the processor lacks FMA (" in out, out)


def main(script, summarize, build_dir):
    check = Checks()
    log_dir = os.path.join(build_dir, "meson-logs")
    with tempfile.TemporaryDirectory() as saved:
        kept = [name for name in (f"testlog-cpu-{path}.json" for path in PATHS)
                if os.path.exists(os.path.join(log_dir, name))]
        for name in kept:
            shutil.copy2(os.path.join(log_dir, name), saved)
        try:
            check_skips(check, script, summarize, build_dir)
        finally:
            for path in PATHS:
                name = f"testlog-cpu-{path}.json"
                if name in kept:
                    shutil.copy2(os.path.join(saved, name), log_dir)
                elif os.path.exists(os.path.join(log_dir, name)):
                    os.remove(os.path.join(log_dir, name))
    status, out = run(script, ["sse4"], "", build_dir)
    check("an unknown path exits 2 naming it",
          status == 2 and "scripts/test-cpu-paths: unknown path 'sse4' (avx2 or baseline)" in out, out)
    return check.summary("cpu_paths", 0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: cpu_paths_tests.py <test-cpu-paths> <summarize_tests.py> <build dir>")
    sys.exit(main(*sys.argv[1:]))
