#!/usr/bin/env python3
"""scripts/summarize_tests.py: adds up the test binaries' results from meson's testlog.json files.

Every test binary (tests/main.cpp) prints "<name>: N passed, N failed, N skipped" for its
test cases. A binary that crashed, timed out or printed no such line counts as one failure,
so a broken run can never look green; so does a log that is missing or empty (a build that
failed before its tests ran). A log scripts/test-cpu-paths writes for a path this processor
cannot run holds one SKIP record whose summary line counts the test cases skipped. Given
several logs (scripts/test passes the normal build's, its CPU paths' and the sanitizer build's),
prints one closing line for all of them and exits 1 on any failure.
"""
import json
import os
import re
import sys

SUMMARY = re.compile(r"^\S+: (\d+) passed, (\d+) failed, (\d+) skipped$", re.MULTILINE)


def count(log_path):
    """(passed, failed, skipped) of one testlog.json, printing why each failure counted."""
    if not os.path.exists(log_path):
        print(f"summarize_tests: no test ran ({log_path} does not exist)")
        return 0, 1, 0
    passed = failed = skipped = 0
    with open(log_path, encoding="utf-8") as log:
        runs = [json.loads(line) for line in log if line.strip()]
    if not runs:
        print(f"summarize_tests: no test ran ({log_path} is empty)")
        failed += 1
    for run in runs:
        lines = SUMMARY.findall(run.get("stdout") or "")
        counts = [sum(int(line[i]) for line in lines) for i in range(3)]
        binary_ok = run["result"] in ("OK", "SKIP")  # SKIP: a summary line says what was skipped
        if not lines or (not binary_ok and counts[1] == 0):
            print(f"summarize_tests: {run['name']} ended with {run['result']} "
                  f"({'no summary line' if not lines else 'after its summary'})")
            counts[1] += 1
        passed, failed, skipped = passed + counts[0], failed + counts[1], skipped + counts[2]
    return passed, failed, skipped


def main(log_paths):
    passed, failed, skipped = (sum(column) for column in zip(*(count(path) for path in log_paths)))
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: summarize_tests.py testlog.json...")
    sys.exit(main(sys.argv[1:]))
