#!/usr/bin/env python3
"""tests/tools/make_unicode_tables.py > data/unicode_tables.cpp: writes the code point ranges of
\\p{L} (categories Lu Ll Lt Lm Lo) and \\p{N} (Nd Nl No) that the GPT-2 pre-tokenizer regex needs,
from Python's unicodedata (its Unicode version is written into the file). Run by hand when the
Unicode version should move; never run by the build or CI.
"""
import sys
import unicodedata

LETTER = {"Lu", "Ll", "Lt", "Lm", "Lo"}
NUMBER = {"Nd", "Nl", "No"}


def ranges(categories):
    out, start = [], None
    for cp in range(0x110000 + 1):
        inside = cp <= 0x10FFFF and unicodedata.category(chr(cp)) in categories
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def table(name, rows):
    lines = [f"const CodePointRange {name}[] = {{"]
    for i in range(0, len(rows), 4):
        lines.append("    " + " ".join(f"{{0x{a:X}, 0x{b:X}}}," for a, b in rows[i:i + 4]))
    lines.append("};")
    return "\n".join(lines)


def main():
    out = [
        "// data/unicode_tables.cpp: the code point ranges of \\p{L} and \\p{N} (Unicode "
        f"{unicodedata.unidata_version}), generated",
        "// by tests/tools/make_unicode_tables.py: edit that script, not this file.",
        '#include "data/byte_level.h"',
        "",
        "#include <algorithm>",
        "#include <iterator>",
        "",
        "namespace shardlab::data {",
        "namespace {",
        "",
        "struct CodePointRange {",
        "  char32_t first, last;",
        "};",
        "",
        table("kLetters", ranges(LETTER)),
        "",
        table("kNumbers", ranges(NUMBER)),
        "",
        "// Binary search for the range at or before cp: the ranges are sorted and disjoint.",
        "template <std::size_t N>",
        "bool in_ranges(const CodePointRange (&table)[N], char32_t cp) {",
        "  const auto after = std::upper_bound(std::begin(table), std::end(table), cp,",
        "                                      [](char32_t c, const CodePointRange& r) { return c < r.first; });",
        "  return after != std::begin(table) && cp <= std::prev(after)->last;",
        "}",
        "",
        "}  // namespace",
        "",
        "bool is_unicode_letter(char32_t cp) { return in_ranges(kLetters, cp); }",
        "bool is_unicode_number(char32_t cp) { return in_ranges(kNumbers, cp); }",
        "",
        "}  // namespace shardlab::data",
    ]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
