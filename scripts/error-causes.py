#!/usr/bin/env python3
"""Refuse a host error that names its cause twice: in its message and as its
`source()` (a chain printer such as anyhow's `{:#}` would say it again).

A thiserror variant's cause is its `source()` when the field is named
`source` or marked `#[source]` / `#[from]`; such a field must not be in the
variant's `#[error("…")]` text or its arguments. A cause a message names is a
field of another name, said with `error_text::cause_text`.

Usage: scripts/error-causes.py [ROOT...]   (default: crates)
Exit 1 with one line per offence (file:line, variant, field).
"""

import re
import sys
from pathlib import Path


def balanced(text: str, at: int) -> int:
    """Index just past the bracket group opening at `at` (strings skipped)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    i = at
    while i < len(text):
        c = text[i]
        if c == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return len(text)


def split_top(text: str) -> list[str]:
    """`text` split on commas outside brackets, angle brackets and strings."""
    parts, depth, current, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            end = i + 1
            while end < len(text) and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            current.append(text[i : end + 1])
            i = end + 1
            continue
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
        i += 1
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


ATTR = re.compile(r"#\[error\(")
VARIANT = re.compile(r"\s*(?:(?:///[^\n]*|//[^\n]*|#\[[^\]]*\])\s*)*([A-Z]\w*)\s*([({]?)")


def offences(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    for attr in ATTR.finditer(text):
        args_end = balanced(text, attr.end() - 1)
        args = text[attr.end() : args_end - 1]
        if args.strip() == "transparent":
            continue
        literal = re.match(r'\s*"((?:[^"\\]|\\.)*)"', args)
        fmt, rest = (literal.group(1), args[literal.end() :]) if literal else ("", args)
        variant = VARIANT.match(text, balanced(text, attr.start() + 1))
        if not variant or not variant.group(2):
            continue
        body_end = balanced(text, variant.end() - 1)
        body = text[variant.end() : body_end - 1]
        for index, field in enumerate(split_top(body)):
            field = re.sub(r"///[^\n]*|//[^\n]*", "", field).strip()
            if variant.group(2) == "{":
                named = re.search(r"(\w+)\s*:", re.sub(r"#\[[^\]]*\]", "", field))
                if not named:
                    continue
                name = named.group(1)
            else:
                name = str(index)
            is_source = name == "source" or re.search(r"#\[(source|from)\]", field)
            if not is_source:
                continue
            said = re.search(r"\{" + re.escape(name) + r"[}:]", fmt) or re.search(
                r"(?<![\w])\.?" + re.escape(name) + r"\b" if name.isidentifier() else r"\." + name + r"\b", rest
            )
            if said:
                line = text.count("\n", 0, attr.start()) + 1
                found.append(f"{path}:{line}: {variant.group(1)}: its cause `{name}` is in its message and its source()")
    return found


def main() -> int:
    roots = [Path(a) for a in sys.argv[1:]] or [Path("crates")]
    found = [o for root in roots for f in sorted(root.rglob("*.rs")) for o in offences(f)]
    for offence in found:
        print(offence)
    if found:
        print(
            f"{len(found)} error(s) name a cause twice: drop it from the message, or make it a field "
            "of another name said with error_text::cause_text (scripts/error-causes.py)"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
