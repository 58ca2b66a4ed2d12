#!/usr/bin/env python3
"""Where a daemon's CPU went, by thread and by part, from a `perf record` file:

    python3 scripts/perf-categories.py FILE

(`broker-load --perf FILE` records the daemon during its starts.) Each sample's own
function (no call chains: a release build has no frame pointers) is put in the first
part whose pattern matches its library and the path that owns it (the leading path of
its name: `<hyper::Conn as Future>::poll` is hyper's, whatever its generic arguments
name); the kernel's and glibc's are shown as theirs, whoever called them. Prints each
thread group's share of the samples and its parts' shares, largest first, counted from
the samples themselves (perf's rounded percentages add up to over 100).
"""
import collections
import re
import subprocess
import sys

PARTS = [
    ("the store: redb", r"redb::"),
    ("the store: its write-ahead log and writer", r"broker_core::store::(wal|writer)|::wal::"),
    ("HTTP (hyper, axum, the daemon's routing)",
     r"hyper|httparse|http::|axum|matchit|tower|broker_serve::(daemon|listen)|TryStream"),
    ("JSON (serde)", r"serde|ryu|itoa|zmij"),
    ("kv (the room, its mirror)", r"rooms::kv|kv_mirror|::kv::"),
    ("the guest: wasmtime", r"wasmtime|cranelift"),
    ("the guest: its own code", r"\[JIT\]|\.cwasm|^[0-9a-f]{12}|^memfd:"),
    ("the host's own code", r"broker_core|broker_capabilities|broker_serve"),
    ("tokio", r"tokio|mio::"),
    ("glibc (malloc, free, memmove, ...)", r"libc\.so|libm\.so"),
    ("tracing", r"tracing"),
]


def owner(symbol: str) -> str:
    """The path a symbol belongs to: `a::b::f<c::D>` is `a::b::f`; `<a::B as c::D>::f` is
    `a::B`, or `c::D` when `a::B` is a generic parameter or the standard library's; a drop
    is the dropped type's."""
    std = ("core::", "alloc::", "std::")
    if symbol.startswith("core::ptr::drop_in_place<"):
        return owner(symbol[len("core::ptr::drop_in_place<"):])
    if symbol.startswith("<"):
        implementer = re.split(r" as |[<>]", symbol[1:], maxsplit=1)[0]
        if "::" in implementer and not implementer.startswith(std) or " as " not in symbol:
            return implementer
        return re.split(r"[<>]", symbol.split(" as ", 1)[1], maxsplit=1)[0]
    return re.split(r"[<(>]", symbol, maxsplit=1)[0]


def thread_group(comm: str) -> str:
    if "store-wr" in comm:
        return "the store's writer thread"
    if "tokio" in comm:
        return "the tokio workers"
    return "other threads"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    perf = subprocess.run(
        ["perf", "report", "-i", sys.argv[1], "--no-children", "--sort", "comm,dso,sym", "-F", "sample,comm,dso,sym",
         "--stdio", "-g", "none", "--field-separator=\t"],
        capture_output=True, text=True,
    )
    if perf.returncode != 0:
        print(f"perf report failed: {perf.stderr.strip()}", file=sys.stderr)
        return 1
    samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unread = 0
    for line in perf.stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = [field.strip() for field in line.split("\t")]
        if len(fields) != 4 or not fields[0].isdigit() or not re.match(r"\[.\] ", fields[3]):
            unread += 1
            continue
        count, comm, dso, (kind, symbol) = int(fields[0]), fields[1], fields[2], (fields[3][1], fields[3][4:])
        if kind == "k" or "kernel" in dso:
            part = "the kernel (syscalls, wake-ups, I/O)"
        else:
            part = next((name for name, pattern in PARTS if re.search(pattern, f"{dso} {owner(symbol)}")), "other")
        samples[thread_group(comm)][part] += count
    total = sum(sum(parts.values()) for parts in samples.values())
    if total == 0:
        print("no samples read", file=sys.stderr)
        return 1
    print(f"{total} samples" + (f" ({unread} lines of perf's report not understood, left out)" if unread else ""))
    shares = {group: collections.Counter({part: 100 * n / total for part, n in parts.items()})
              for group, parts in samples.items()}
    for group, parts in sorted(shares.items(), key=lambda item: -sum(item[1].values())):
        print(f"{sum(parts.values()):5.1f} %  {group}")
        for part, share in parts.most_common():
            print(f"    {share:5.1f} %  {part}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
