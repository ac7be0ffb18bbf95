#!/usr/bin/env python3
"""tests/build/system_includes_tests.py COMPILE_COMMANDS SOURCE_ROOT BUILD_ROOT: every include
directory of a dependency (fmt, OpenBLAS, MPI, CUDA, nlohmann_json, CLI11, Catch2, zlib) reaches
the compilers as a system directory (-isystem), never with -I: a warning inside a dependency's
headers then stays theirs, and cannot fail shardlab's -Werror build (g++ 13 raises some inside
Debian's fmt 9). Only the source and build trees may come in with -I."""
import json
import os
import shlex
import sys


def include_dirs(command, directory):
    """The -I directories of one compile command, made absolute against its directory."""
    words = shlex.split(command)
    found = []
    for i, word in enumerate(words):
        if word == "-I" and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith("-I") and len(word) > 2:
            found.append(word[2:])
    return [os.path.realpath(os.path.join(directory, d)) for d in found]


def main():
    commands_path, source_root, build_root = sys.argv[1:4]
    roots = [os.path.realpath(source_root), os.path.realpath(build_root)]
    with open(commands_path, encoding="utf-8") as f:
        commands = json.load(f)
    outside = {}
    for entry in commands:
        command = entry.get("command") or shlex.join(entry["arguments"])
        for d in include_dirs(command, entry["directory"]):
            if not any(d == root or d.startswith(root + os.sep) for root in roots):
                outside.setdefault(d, entry["file"])
    checked = len(commands) > 0
    print(f"{'ok' if checked else 'FAILED'}: {len(commands)} compile commands read")
    for d, example in sorted(outside.items()):
        print(f"FAILED: -I{d} (a dependency's directory; e.g. compiling {example}): it must be -isystem")
    if not outside and checked:
        print("ok: every -I directory is in the source or build tree")
    failed = int(not checked) + len(outside)
    print(f"system_includes: {int(checked) + int(not outside and checked)} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
