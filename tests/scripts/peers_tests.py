#!/usr/bin/env python3
"""tests/scripts/peers_tests.py: scripts/peers' refusals, none of which downloads anything: a
directory inside the repository, too little disk, a directory that is no environment, --dir
without a value, and an unreachable package index (the half-made environment removed).
Usage: peers_tests.py SCRIPT"""
import os
import subprocess
import sys
import tempfile


def run(script, args, **extra_env):
    env = dict(os.environ, **extra_env)
    env.pop("SHARDLAB_PEERS", None)
    done = subprocess.run([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    return done.returncode, done.stdout


def main(script):
    results = []

    def check(what, ok, detail=""):
        print(f"{'ok' if ok else 'FAILED'}: {what}" + (f"\n{detail}" if not ok else ""))
        results.append(ok)

    repository = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    code, out = run(script, ["--help"])
    check("--help prints the usage", code == 0 and "scripts/peers [--dir DIR]" in out, out)
    inside = os.path.join(repository, "peers-env")
    code, out = run(script, ["--dir", inside])
    check("a directory inside the repository is refused, nothing made",
          code == 1 and "is inside the repository" in out and not os.path.exists(inside), out)
    code, out = run(script, ["--dir"])
    check("--dir without a directory is refused", code == 1 and "--dir needs a directory" in out, out)
    with tempfile.TemporaryDirectory() as scratch:
        target = os.path.join(scratch, "venv")
        code, out = run(script, ["--dir", target], SHARDLAB_PEERS_MIN_FREE_GB="1000000")
        check("too little disk is refused with the numbers, before anything is made",
              code == 1 and "GiB free under" in out and "needs 1e+06 GiB" in out and not os.path.exists(target), out)
        os.makedirs(os.path.join(scratch, "other"))
        code, out = run(script, ["--dir", os.path.join(scratch, "other")])
        check("an existing directory that is no such environment is refused and kept",
              code == 1 and "exists but is not an environment" in out and os.path.isdir(os.path.join(scratch, "other")),
              out)
        code, out = run(script, ["--dir", target], SHARDLAB_PEERS_MIN_FREE_GB="0",
                        PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="1",
                        PIP_CONFIG_FILE=os.devnull)
        check("an unreachable package index: one line saying so, the half-made environment removed",
              code == 1 and "is unreachable or lacks the pins" in out.splitlines()[-1] and "was removed" in out
              and not os.path.exists(target), out)
    failed = results.count(False)
    print(f"peers: {results.count(True)} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
