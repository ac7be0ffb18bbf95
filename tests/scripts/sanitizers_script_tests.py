#!/usr/bin/env python3
"""tests/scripts/sanitizers_script_tests.py: scripts/test-sanitizers' refusals: an unknown argument
and more than one are refused in one line with exit status 2, before anything is installed or built
(the build directory it names is never made). The build and the tests themselves are what
scripts/test runs.

Usage: sanitizers_script_tests.py <scripts/test-sanitizers>. Prints one line per check, then
"sanitizers_script: N passed, N failed, N skipped".
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

REFUSALS = [
    (["--build"], "scripts/test-sanitizers: unknown argument '--build' (--build-only or none)"),
    (["--build-only", "extra"], "scripts/test-sanitizers: one argument at most (--build-only)"),
]


def main(script):
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="sanitizers_script_tests.") as scratch:
        build_dir = os.path.join(scratch, "build-san")
        environment = dict(os.environ, SHARDLAB_SANITIZE_BUILD_DIR=build_dir)
        for args, expected in REFUSALS:
            done = subprocess.run([script] + args, env=environment, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=60)
            check(f"test-sanitizers {' '.join(args)}: refused in one line, exit 2, nothing built",
                  done.returncode == 2 and done.stdout == expected + "\n" and not os.path.exists(build_dir),
                  f"exit {done.returncode}, output:\n{done.stdout}")
    return check.summary("sanitizers_script", 0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: sanitizers_script_tests.py <scripts/test-sanitizers>")
    sys.exit(main(sys.argv[1]))
