#!/usr/bin/env python3
"""tests/docs/docs_figures_tests.py: checks that docs/fsdp-from-the-inside.md quotes what the real runs
print: scripts/docs-figures runs the commands once, then its --check mode must find, in the document,
- every marked number equal to the script's figure of that name,
- every marked output block equal to the regenerated output, line for line,
- no unmarked figure and no unmarked fenced block,
- every cited file:function location present (the file exists and holds `function(`),
- every linked image and named script present (they come from the plots branch: this check fails
  until it is merged);
and must fail on tampered copies: a changed number, an unmarked number, a changed output line, a
cited function that does not exist.

Usage: docs_figures_tests.py <mpirun> <train_cnn> <train_llama>. Needs the data sets from scripts/setup
(Fashion-MNIST and fortunes); without them every case is skipped. Prints one line per check, then
"docs_figures: N passed, N failed, N skipped".
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "docs-figures")
DOC = os.path.join(REPO, "docs", "fsdp-from-the-inside.md")
DATA = ["/usr/share/datasets/fashion-mnist", "/usr/share/games/fortunes"]
# The categories of --check's problem lines, with what each check promises.
CATEGORIES = [("figure", "every marked number equals the script's figure"),
              ("block", "every marked output block equals the regenerated output"),
              ("unmarked", "no unmarked figure"),
              ("location", "every cited file:function exists"),
              ("missing", "every linked image and named script exists")]
CHECKS = 1 + len(CATEGORIES) + 4


def check_doc(doc_path, figures_path):
    """(exit status, problem lines) of --check on doc_path against saved figures."""
    done = subprocess.run([sys.executable, SCRIPT, "--check", doc_path, "--from", figures_path],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout.splitlines()[:-1]


def tampered(check, figures_path, name, change, category):
    """--check fails, with a problem of `category`, on a copy of the document that `change` edited."""
    with open(DOC, encoding="utf-8") as text:
        doc = text.read()
    edited = change(doc)
    path = os.path.join(os.path.dirname(DOC), f".tampered-{category}.md")  # beside the page: same image paths
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(edited)
        code, lines = check_doc(path, figures_path)
    finally:
        os.remove(path)
    check(f"the check fails on a copy with {name}",
          edited != doc and code == 1 and any(line.startswith(category + ":") for line in lines),
          f"exit {code}\n" + "\n".join(lines))


def main(mpirun, train_cnn, train_llama):
    check = Checks()
    if not all(os.path.isdir(path) for path in DATA):
        return check.summary("docs_figures", CHECKS)
    with tempfile.TemporaryDirectory() as scratch:
        figures_path = os.path.join(scratch, "figures.txt")
        with open(figures_path, "w", encoding="utf-8") as out:
            done = subprocess.run([sys.executable, SCRIPT, "--mpirun", mpirun, "--train-cnn", train_cnn,
                                   "--train-llama", train_llama], stdout=out, stderr=subprocess.PIPE, text=True)
        check("scripts/docs-figures runs the commands and prints the figures", done.returncode == 0,
              done.stderr)
        if done.returncode != 0:
            return check.summary("docs_figures", CHECKS - 1)
        code, lines = check_doc(DOC, figures_path)
        for category, promise in CATEGORIES:
            mine = [line for line in lines if line.startswith(category + ":")]
            check(f"{os.path.relpath(DOC, REPO)}: {promise}", not mine, "\n".join(mine))

        def first_marked_number(doc):
            at = doc.index("<!--cnn.full.np2.persistent_bytes-->")
            start = doc.rindex(" ", 0, at) + 1
            return doc[:start] + str(int(doc[start:at]) + 1) + doc[at:]

        tampered(check, figures_path, "a marked number changed", first_marked_number, "figure")
        tampered(check, figures_path, "an unmarked number",
                 lambda doc: doc.replace("## 1. Flat shards and padding\n",
                                         "## 1. Flat shards and padding\n\nThe shard holds 4096 elements.\n"),
                 "unmarked")
        tampered(check, figures_path, "an output line changed",
                 lambda doc: doc.replace("shard groups of 2, prefetch 1\n", "shard groups of 2, prefetch 2\n", 1),
                 "block")
        tampered(check, figures_path, "a cited function that does not exist",
                 lambda doc: doc.replace("`dist/fsdp/fsdp.cpp:Unit::unshard`", "`dist/fsdp/fsdp.cpp:Unit::unshard_all`", 1),
                 "location")
    return check.summary("docs_figures", 0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: docs_figures_tests.py <mpirun> <train_cnn> <train_llama>")
    sys.exit(main(*sys.argv[1:]))
