#!/usr/bin/env python3
"""Fails when the top-level modules of a crate depend on each other in a cycle.

A cycle across crates does not compile; one inside a crate does, so CI checks it
here: module A depends on B when a file of A names `crate::B` (or `super::B`
from A's root file), in code: comments, strings and `#[cfg(test)]` items are
left out. Usage:
scripts/module-cycles.py CRATE_SRC_DIR...
"""
import os
import re
import sys

# The one cycle by design: the generated bindings name the rooms' resource
# types (bindgen's `with`), and the rooms implement the bindings' traits.
ALLOWED = {("bindings", "rooms")}

STRING = re.compile(r'r(#*)"(?:.|\n)*?"\1|b?"(?:\\.|[^"\\])*"|' + r"b?'(?:\\.|[^'\\])'")
COMMENT = re.compile(r"//[^\n]*|/\*(?:.|\n)*?\*/")
PATH = re.compile(r"\b(crate|super)::")


def modules(src):
    """Top-level module name -> the files that make it."""
    found = {}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry in ("lib.rs", "main.rs"):
            continue
        if os.path.isdir(path):
            found[entry] = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".rs")]
        elif entry.endswith(".rs"):
            found[entry[:-3]] = [path]
    return found


def code_of(text):
    """The text without comments, string literals and `#[cfg(test)]` items."""
    out, i = [], 0
    while i < len(text):
        comment, string = COMMENT.match(text, i), STRING.match(text, i)
        if comment:
            i = comment.end()
        elif string and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            out.append('""')
            i = string.end()
        else:
            out.append(text[i])
            i += 1
    code = "".join(out)
    # A `#[cfg(test)]` item ends at its first `;` or at the brace closing its first `{`.
    while (at := code.find("#[cfg(test)]")) >= 0:
        j = at + len("#[cfg(test)]")
        semi, brace = code.find(";", j), code.find("{", j)
        if brace < 0 or (0 <= semi < brace):
            end = semi + 1 if semi >= 0 else len(code)
        else:
            depth, end = 0, brace
            while end < len(code):
                depth += {"{": 1, "}": -1}.get(code[end], 0)
                end += 1
                if depth == 0:
                    break
        code = code[:at] + code[end:]
    return code


def first_segments(tree):
    """The first segment of each path in a `use` tree's braces: `a::{b, c}, d` -> a, d."""
    depth, item, out = 0, "", []
    for ch in tree + ",":
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            name = re.split(r"::|\s|\{", item.strip(), maxsplit=1)[0]
            if name:
                out.append(name)
            item = ""
        else:
            item += ch
    return out


def names(code, root_file):
    """Modules named from `crate::` (anywhere) or `super::` (from a module's root file)."""
    for found in PATH.finditer(code):
        if found.group(1) == "super" and not root_file:
            continue
        rest = code[found.end():]
        if rest.startswith("{"):
            depth, end = 0, 0
            for end, ch in enumerate(rest):
                depth += {"{": 1, "}": -1}.get(ch, 0)
                if depth == 0:
                    break
            yield from first_segments(rest[1:end])
        elif (word := re.match(r"\w+", rest)):
            yield word.group(0)


def graph(src):
    mods = modules(src)
    edges = {m: set() for m in mods}
    for mod, files in mods.items():
        for path in files:
            with open(path, encoding="utf-8") as f:
                code = code_of(f.read())
            # `super::` in a module's root file (mod.rs, or the module's own file) is the crate root.
            root_file = os.path.basename(path) == "mod.rs" and os.path.dirname(path) == os.path.join(src, mod) or path == os.path.join(src, mod + ".rs")
            for name in names(code, root_file):
                if name in mods and name != mod and (mod, name) not in ALLOWED:
                    edges[mod].add(name)
    return edges


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main(dirs):
    failed = False
    for src in dirs:
        edges = graph(src)
        for component in cycles(edges):
            failed = True
            inner = [f"{a} -> {b}" for a in component for b in sorted(edges[a]) if b in component]
            print(f"{src}: modules in a cycle: {', '.join(component)} ({'; '.join(inner)})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["crates/capabilities/src", "crates/core/src", "crates/serve/src"]))
