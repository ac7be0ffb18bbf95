#!/usr/bin/env python3
"""tests/sanitizers/canary_tests.py: proves the sanitizer build's sanitizers are live. Runs each
deliberate bug of tests/sanitizers/canaries.cpp and passes only when the process fails with the
sanitizer's own report naming it; the clean run must exit 0 with no report, so a canary cannot pass
by crashing for some other reason.

Usage: canary_tests.py <canaries>. Prints one line per check, then
"sanitizer_canaries: N passed, N failed, 0 skipped".
"""
import subprocess
import sys

# canary argument: the line its sanitizer must print
EXPECTED = {
    "heap-buffer-overflow": "ERROR: AddressSanitizer: heap-buffer-overflow",
    "use-after-free": "ERROR: AddressSanitizer: heap-use-after-free",
    "signed-integer-overflow": "runtime error: signed integer overflow: 2147483647 + 1",
}
REPORT_MARKERS = ("AddressSanitizer", "runtime error:", "LeakSanitizer")


def run(program, canary):
    done = subprocess.run([program, canary], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=60, text=True, errors="replace")
    return done.returncode, done.stdout


def main(program):
    results = []
    for canary, report in EXPECTED.items():
        code, output = run(program, canary)
        ok = code != 0 and report in output
        print(f"{'ok' if ok else 'FAILED'}: {canary} fails with '{report}' (exit {code})"
              + ("" if ok else "\n" + output))
        results.append(ok)
    code, output = run(program, "clean")
    ok = code == 0 and not any(marker in output for marker in REPORT_MARKERS)
    print(f"{'ok' if ok else 'FAILED'}: the in-bounds run exits 0 without a report (exit {code})"
          + ("" if ok else "\n" + output))
    results.append(ok)
    passed = sum(results)
    print(f"sanitizer_canaries: {passed} passed, {len(results) - passed} failed, 0 skipped")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
