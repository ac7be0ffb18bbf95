#!/usr/bin/env python3
"""tests/docs/repository_text_tests.py: the repository's text speaks of shardlab only and its links
lead somewhere. Every tracked text file (but the raw logs under bench/results/, whose README.md
index is scanned) is scanned:

- a Markdown link or image (`[text](target)`, `[name]: target`) must name a file or folder that
  exists inside the repository (web links and `#anchors` are not followed);
- no file may point outside the repository (a folder beside the checkout, an absolute path in a
  link);
- no file may speak of how shardlab is being developed rather than of shardlab: ticket numbers,
  machines on loan, the commands and folders of a development workplace, the copying of the
  checkout elsewhere and a per-command time limit;
- no file, the raw logs included, may hold the absolute path of a checkout or a home folder: logs
  are committed with paths relative to the checkout.

The checker is then run on a scratch tree holding one of each problem, which it must report.

Usage: repository_text_tests.py. Prints one line per check, then
"repository_text: N passed, N failed, N skipped".
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps"))
from jobs import Checks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAW_LOGS = "bench/results/"
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
# The words, spelled in pieces so that this file passes its own scan.
OUTSIDE = "../" + "shared"
TICKET, LOAN = "iss" + "ue", "le" + "nt"
DEVELOPMENT_WORDS = [
    (re.compile(re.escape(OUTSIDE)), "a path outside the repository"),
    (re.compile(r"\b" + TICKET + r" \d+", re.IGNORECASE), "a ticket number"),
    (re.compile(r"\bwork[- ]" + "orders?" + r"\b", re.IGNORECASE), "a ticket"),
    (re.compile(r"\b" + LOAN + r"\b", re.IGNORECASE), "a machine on loan"),
    (re.compile(r"\bdevice" + r" tool\b", re.IGNORECASE), "a development tool"),
    (re.compile("car" + r"ry: ?\["), "a development tool's argument"),
    (re.compile(r"\$" + r"OUT\b"), "a development tool's folder"),
    (re.compile(r"\brun\(" + "command:"), "a development tool's call"),
    (re.compile(r"\bclosing" + r" note\b", re.IGNORECASE), "a development report"),
    (re.compile(r"\b(?:what|it|never) " + r"tra[v]els\b"), "how the checkout is copied elsewhere"),
    (re.compile(r"\b(?:limited to|of at most) " + r"10 minutes\b"), "a per-command time limit"),
]
# Checked in the raw logs too: a checkout's or a home folder's absolute path.
MACHINE_PATH = (re.compile(r"(?<![\w.~$-])/(?:wo" + r"rk|ro" + r"ot)/"), "an absolute path of a checkout or home")


def tracked_files(root):
    """The repository's files, relative to root: git's list, or a walk where there is no git."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, check=True).stdout
        return [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if d != ".git" and not d.startswith("build")]
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names]
        return files


def read_text(path):
    """The file's text, or None for a binary file."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


CODE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1|`+[^`\n]+`+", re.MULTILINE | re.DOTALL)


def without_code(text):
    """The Markdown text with its code blocks and spans blanked (line numbers kept): a link inside
    code is an example, not a link."""
    return CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def link_problem(root, name, target):
    """Why a Markdown link from file `name` to `target` is wrong, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
        return None  # a web or mail link, or an anchor in the same page
    path = target.split("#", 1)[0]
    if path.startswith("/"):
        return f"links to {target}, an absolute path outside the repository"
    resolved = os.path.normpath(os.path.join(root, os.path.dirname(name), path))
    if os.path.relpath(resolved, root).startswith(".."):
        return f"links to {target}, outside the repository"
    if not os.path.exists(resolved):
        return f"links to {target}, which does not exist"
    return None


def problems(root, names):
    """Every problem in the named files, as "file:line: what" lines."""
    found = []
    for name in names:
        raw_log = name.startswith(RAW_LOGS) and name != RAW_LOGS + "README.md"  # the index is not one
        if not os.path.isfile(os.path.join(root, name)):
            continue
        text = read_text(os.path.join(root, name))
        if text is None:
            continue
        line_of = lambda offset: text.count("\n", 0, offset) + 1  # noqa: E731
        if name.endswith(".md") and not raw_log:
            prose = without_code(text)
            for pattern in (INLINE_LINK, REFERENCE_LINK):
                for match in pattern.finditer(prose):
                    why = link_problem(root, name, match.group(1))
                    if why:
                        found.append(f"{name}:{line_of(match.start())}: {why}")
        for pattern, what in [MACHINE_PATH] if raw_log else DEVELOPMENT_WORDS + [MACHINE_PATH]:
            for match in pattern.finditer(text):
                found.append(f"{name}:{line_of(match.start())}: {what}: '{match.group(0)}'")
    return found


def write(root, name, text):
    os.makedirs(os.path.dirname(os.path.join(root, name)) or root, exist_ok=True)
    with open(os.path.join(root, name), "w", encoding="utf-8") as f:
        f.write(text)


def check_tampered(check):
    """One problem per file in a scratch tree: each must be reported, and a clean file must not."""
    cases = {
        "docs/dangling.md": ("See [the design](missing.md).\n", "links to missing.md, which does not exist"),
        "docs/outside.md": ("![plot](../../elsewhere/plot.png)\n", "outside the repository"),
        "docs/absolute.md": ("[data](/usr/share/datasets/x)\n", "an absolute path outside the repository"),
        "docs/reference.md": ("[design]: nothere.md\n", "links to nothere.md, which does not exist"),
        "scripts/tool": (f"# see {OUTSIDE}/DESIGN.md\n", "a path outside the repository"),
        "bench/run.sh": (f"# the benchmark of {TICKET} 17\n", "a ticket number"),
        "README.txt": (f"On a {LOAN} GPU machine\n", "a machine on loan"),
        "scripts/gpu": ("# copies the logs to $" + "OUT\n", "a development tool's folder"),
        "scripts/kit": ("# the archive is what " + "tra" + "vels\n", "how the checkout is copied elsewhere"),
        "docs/limit.md": ("Two commands, each limited to " + "10 minutes.\n", "a per-command time limit"),
        RAW_LOGS + "run/configure.log": ("Source dir: /wo" + "rk/main\n", "an absolute path of a checkout or home"),
        RAW_LOGS + "README.md": ("[a run](2026-01-01-gone/)\n", "links to 2026-01-01-gone/, which does not exist"),
    }
    with tempfile.TemporaryDirectory() as root:
        for name, (text, _) in cases.items():
            write(root, name, text)
        write(root, "docs/clean.md", "[ok](dangling.md), [web](https://example.org/x.md), [here](#top)\n"
              "`a[i](j)` in code\n```cpp\nf(x[0](y));\n```\n")
        write(root, RAW_LOGS + "run/log.txt", f"{TICKET} 3 of the {LOAN} machine, ~/.cache and ./build\n")
        found = problems(root, tracked_files(root))
        for name, (_, expected) in cases.items():
            check(f"a tampered {name} is reported ({expected})",
                  any(p.startswith(name + ":1: ") and expected in p for p in found), "\n".join(found))
        check("a clean page and the raw logs are not reported",
              not any(p.startswith(("docs/clean.md", RAW_LOGS + "run/log.txt")) for p in found), "\n".join(found))


def main():
    check = Checks()
    found = problems(REPO, tracked_files(REPO))
    check("every link leads to a file inside the repository, and no file speaks of how shardlab "
          "is developed", not found, "\n".join(found))
    check_tampered(check)
    return check.summary("repository_text", 0)


if __name__ == "__main__":
    sys.exit(main())
