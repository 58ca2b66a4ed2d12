#!/usr/bin/env bash
# The daemon's memory and start with one provider, as BENCHMARKS.md quotes them:
#   bash scripts/daemon-memory.sh [BROKER] [MANIFEST]
# (defaults: target/release/broker, the bundled fake). A daemon on a new data
# dir: its RSS idle, after `provider add` (the component compiled), and after a
# restart that maps the component kept compiled; RSS split into anonymous
# memory (the daemon's own) and file pages (the executable's code, the mapped
# component: clean, shared, reclaimable), from /proc/PID/smaps_rollup.
set -euo pipefail
cd "$(dirname "$0")/.."
broker=$(realpath "${1:-target/release/broker}")
manifest=$(realpath "${2:-guests/fake/provider.toml}")
dir=$(mktemp -d)
data=$dir/data
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$dir"' EXIT

rss() {
    awk '/^Rss:/{r=$2} /^Pss_Anon:/{a=$2} /^Pss_File:/{f=$2}
         END{printf "RSS %.1f MiB (anonymous %.1f, file pages %.1f)", r/1024, a/1024, f/1024}' "/proc/$1/smaps_rollup"
}
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
serve() {
    local began
    began=$(date +%s%N)
    "$broker" --data-dir "$data" serve >/dev/null 2>&1 &
    pid=$!
    until curl -sf --unix-socket "$data/broker.sock" http://broker/v1/providers >/dev/null 2>&1; do
        kill -0 "$pid" 2>/dev/null || { echo "the daemon exited" >&2; exit 1; }
        sleep 0.005
    done
    echo "  answering /v1/providers $(ms_since "$began") ms after its start"
    sleep 1
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }

echo "a new data dir:"
serve
echo "  idle: $(rss "$pid")"
began=$(date +%s%N)
"$broker" --data-dir "$data" provider add "$manifest" >/dev/null
echo "  provider add: $(ms_since "$began") ms"
sleep 1
echo "  after the add (the component compiled): $(rss "$pid")"
stop
echo "a restart (the provider loaded from what was kept compiled):"
serve
echo "  $(rss "$pid")"
stop
