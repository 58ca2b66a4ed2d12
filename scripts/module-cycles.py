#!/usr/bin/env python3
"""Fails when the top-level modules of a crate depend on each other in a cycle.

A cycle across crates does not compile; one inside a crate does, so CI checks it
here: module A depends on B when a file of A names `crate::B` (or `super::B`
from A's root file). Test code is left out (`#[cfg(test)]` onwards in a file:
tests sit at the end of each file by this project's convention). Usage:
scripts/module-cycles.py CRATE_SRC_DIR...
"""
import os
import re
import sys

# The one cycle by design: the generated bindings name the rooms' resource
# types (bindgen's `with`), and the rooms implement the bindings' traits.
ALLOWED = {("bindings", "rooms")}

USE = re.compile(r"\bcrate::(?:\{([^}]*)\}|(\w+))")


def modules(src):
    """Top-level module name -> the files that make it."""
    found = {}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry in ("lib.rs", "main.rs"):
            continue
        if os.path.isdir(path):
            files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".rs")]
            found[entry] = files
        elif entry.endswith(".rs"):
            found[entry[:-3]] = [path]
    return found


def names(text):
    for group, single in USE.findall(text):
        if single:
            yield single
        else:
            for item in group.split(","):
                item = item.strip()
                if item:
                    yield re.split(r"::|\s", item)[0]


def graph(src):
    mods = modules(src)
    edges = {m: set() for m in mods}
    for mod, files in mods.items():
        for path in files:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            text = text.split("#[cfg(test)]", 1)[0]
            text = re.sub(r"//.*", "", text)
            for name in names(text):
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
