#!/usr/bin/env python3
"""tests/docs/run_docs_tests.py: scripts/run-docs follows README.md and docs/training.md as a reader
would (SHARDLAB_DOCS_QUICK=1: shortened training, the build reused) with no failure, and fails where
a page cannot be followed:
- small pages of its own: a clean one runs; a command that fails, a shown line the command does not
  print, a number changed where numbers must match, a refusal that does not come, an output block
  without a marker, an unknown clause and an unclosed block are each reported with the page's line;
  `times vary`, `numbers vary`, `command first`, `$ COMMAND`, `fails` and `quick` do what they say;
- tampered copies of README.md: its plan line changed (a changed output), and a bad flag added to
  its training command (a broken command).

Usage: run_docs_tests.py BUILD_DIR (a configured build with train_cnn and train_llama built). Needs
this repository as a git checkout (the runner clones it) and the data sets of scripts/setup; without
them the cases are skipped. Prints one line per check, then "run_docs: N passed, N failed, N skipped".
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(REPO, "scripts", "run-docs")
DATA = ["/usr/share/datasets/fashion-mnist", "/usr/share/games/fortunes"]
FENCE = "```"


def run_pages(pages, build, quick=True):
    env = dict(os.environ, SHARDLAB_DOCS_QUICK="1" if quick else "0")
    done = subprocess.run([sys.executable, RUNNER, "--reuse-build", build, *pages], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    return done.returncode, done.stdout.decode("utf-8", "replace")


def page(directory, name, text):
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def sh(*commands, marker=None):
    head = f"<!-- run: {marker} -->\n" if marker else ""
    return head + f"{FENCE}sh\n" + "\n".join(commands) + f"\n{FENCE}\n\n"


def shown(*lines, marker="output"):
    return f"<!-- run: {marker} -->\n{FENCE}\n" + "\n".join(lines) + f"\n{FENCE}\n\n"


# (name, page text, quick, expected exit status, words the runner's output must hold)
SMALL_PAGES = [
    ("a clean page runs to the end",
     "# t\n\n" + sh("echo hello 42", "echo 'took 0.51 s, 12 steps'") + shown("hello 42", "...", "took # s, 12 steps",
                                                                               marker="output; times vary")
     + f"{FENCE}cpp\nint main() {{}}\n{FENCE}\n",
     False, 0, ["run-docs: 2 run, 1 not run"]),
    ("a failing command stops the run, naming its line and status",
     "# t\n\n" + sh("echo one", "sh -c 'echo broken; exit 3'", "echo never"),
     False, 1, ["t.md:3: `sh -c 'echo broken; exit 3'` ended with exit status 3", "broken"]),
    ("a shown line the command did not print",
     "# t\n\n" + sh("echo hello 42") + shown("hello 43"),
     False, 1, ["the page shows a line the command did not print", "hello 43"]),
    ("times vary lets a time differ, not a count",
     "# t\n\n" + sh("echo 'took 0.51 s, 12 steps'") + shown("took 0.02 s, 13 steps", marker="output; times vary"),
     False, 1, ["took # s, 13 steps"]),
    ("numbers vary lets every number differ",
     "# t\n\n" + sh("echo 'took 0.51 s, 12 steps'") + shown("took 0.02 s, 13 steps", marker="output; numbers vary"),
     False, 0, ["run-docs: 2 run, 0 not run"]),
    ("$ COMMAND runs what the prose names, and fails wants a refusal",
     "# t\n\n" + shown("refused: too big", marker="fails; $ echo refused: too big; exit 1"),
     False, 0, ["$ echo refused: too big; exit 1", "run-docs: 1 run, 0 not run"]),
    ("a refusal that does not come",
     "# t\n\n" + shown("fine", marker="fails; $ echo fine"),
     False, 1, ["`echo fine` ended with exit status 0, the page expects a non-zero exit status"]),
    ("command first runs the block's first command and compares the rest",
     "# t\n\n" + shown("echo a \\", "  b", "a b", marker="command first"),
     False, 0, ["$ echo a b", "run-docs: 1 run, 0 not run"]),
    ("quick adds its flags to training commands only, and frees the numbers of their output",
     "# t\n\n" + sh("echo other --epochs 2", "sh -c 'echo trained 2 epochs' scripts/train-cnn", marker="quick: --epochs 1")
     + shown("trained 5 epochs"),
     True, 0, ["$ sh -c 'echo trained 2 epochs' scripts/train-cnn --epochs 1\n", "$ echo other --epochs 2\n"]),
    ("without SHARDLAB_DOCS_QUICK quick changes nothing",
     "# t\n\n" + sh("sh -c 'echo trained 2 epochs' scripts/train-cnn", marker="quick: --epochs 1")
     + shown("trained 5 epochs"),
     False, 1, ["$ sh -c 'echo trained 2 epochs' scripts/train-cnn\n", "trained 5 epochs"]),
    ("an output block without a marker",
     f"# t\n\n{FENCE}\nsome output\n{FENCE}\n",
     False, 1, ["t.md:3: a block without a language and without a run: marker"]),
    ("an unknown clause",
     "# t\n\n" + sh("echo x", marker="output; fast"),
     False, 1, ["unknown clause 'fast'"]),
    ("a block never closed",
     f"# t\n\n{FENCE}sh\necho x\n",
     False, 1, ["t.md:3: a fenced block that is never closed"]),
    ("a skipped block is listed with its reason, semicolons and all",
     "# t\n\n" + sh("false", marker="skip: needs a GPU; and a cluster"),
     False, 0, ["t.md:4: not run (needs a GPU; and a cluster)"]),
]


def tampered(directory, source, old, new):
    with open(os.path.join(REPO, source), encoding="utf-8") as f:
        text = f.read()
    assert old in text, f"{source} no longer holds {old!r}"
    return page(directory, os.path.basename(source), text.replace(old, new, 1))


def main():
    if len(sys.argv) != 2:
        print("usage: run_docs_tests.py BUILD_DIR", file=sys.stderr)
        return 2
    build = os.path.abspath(sys.argv[1])
    missing = [d for d in DATA if not os.path.isdir(d)]
    if not os.path.isdir(os.path.join(REPO, ".git")) or missing:
        print(f"skipped: {'no git checkout to clone' if not missing else 'missing ' + ', '.join(missing)}")
        print(f"run_docs: 0 passed, 0 failed, {len(SMALL_PAGES) + 3} skipped")
        return 0
    check = Checks()
    with tempfile.TemporaryDirectory() as directory:
        for name, text, quick, status, words in SMALL_PAGES:
            rc, output = run_pages([page(directory, "t.md", text)], build, quick)
            absent = [w for w in words if w not in output]
            check(name, rc == status and not absent,
                  f"exit status {rc} (expected {status}), missing {absent}:\n{output}")
        rc, output = run_pages([os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "training.md")], build)
        check("README.md and docs/training.md run as written (quick)", rc == 0 and "run-docs: " in output,
              output[-3000:])
        readme = tampered(directory, "README.md", "FSDP plan: sharding full,", "FSDP plan: sharding fully,")
        rc, output = run_pages([readme], build)
        check("a tampered README.md output line is caught", rc == 1 and "FSDP plan: sharding fully" in output
              and "did not print" in output, output[-3000:])
        broken = tampered(directory, "README.md", "scripts/train-cnn\n", "scripts/train-cnn --epochs -1\n")
        rc, output = run_pages([broken], build)
        check("a tampered README.md command (a bad flag) is caught", rc == 1 and "ended with exit status" in output
              and "--epochs" in output, output[-3000:])
    return check.summary("run_docs", 0)


if __name__ == "__main__":
    sys.exit(main())
