#!/usr/bin/env bash
# The attacks of RELIABILITY.md against a real `broker serve`: hostile
# providers (guests/test-hostile, told what to do by their [config]) flood the
# daemon one bound at a time while the fake answers beside them. Prints, per
# attack, what the hostile caller got, the daemon's RSS and state file size
# before and after, and the bystander's list latency (p50/p99 of 50 requests)
# while the attack runs.
#
# Needs the release build and the guests: `cargo build --release` (which
# builds them). Usage: bash scripts/reliability.sh [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

broker=target/release/broker
hostile=guests/target/wasm32-wasip2/release/test_hostile.wasm
[ -x "$broker" ] && [ -f "$hostile" ] || { echo "build first: cargo build --release" >&2; exit 2; }
data=${1:-$(mktemp -d)}
socket=$data/broker.sock
"$broker" --data-dir "$data" serve 2>"$data/serve.log" &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done

api() { curl -sS --unix-socket "$socket" -H 'Content-Type: application/json' "$@"; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$daemon/status"; }
state_size() { du -k "$data/state.redb" | cut -f1; }
add() {
    local name=$1 deadline=$2 config=$3
    printf 'name = "%s"\ncomponent = "%s"\n[limits]\nmemory-mib = 64\n[limits.deadlines]\ndefault = "%s"\n[grants]\nkv = true\n[config]\n%b\n' \
        "$name" "$PWD/$hostile" "$deadline" "$config" >"$data/$name.toml"
    api -o /dev/null -X POST http://b/v1/providers -d "{\"manifest\":\"$data/$name.toml\"}"
}
# p50 and p99 of 50 sequential bystander listings, in ms.
bystander() {
    for _ in $(seq 50); do
        api -o /dev/null -w '%{time_total}\n' 'http://b/v1/instances?provider=fake'
    done | sort -n | awk '{t[NR]=$1*1000} END {printf "p50 %.1f ms, p99 %.1f ms", t[int(NR*0.5)], t[int(NR*0.99)]}'
}
attack() {
    local title=$1; shift
    local before_rss before_disk
    before_rss=$(rss); before_disk=$(state_size)
    "$@" >"$data/answer" 2>&1 &
    local caller=$!
    local latency; latency=$(bystander)
    wait $caller || true
    printf '%s\n  got: %s\n  RSS %s -> %s KiB, state.redb %s -> %s KiB; bystander during: %s\n' \
        "$title" "$(tail -c 300 "$data/answer" | tr '\n' ' ')" "$before_rss" "$(rss)" "$before_disk" "$(state_size)" "$latency"
}

printf 'name = "fake"\ncomponent = "%s"\n[grants]\nkv = true\nlog = true\n[config]\nzones = ["a"]\n' \
    "$PWD/guests/target/wasm32-wasip2/release/fake.wasm" >"$data/fake.toml"
api -o /dev/null -X POST http://b/v1/providers -d "{\"manifest\":\"$data/fake.toml\"}"
api -o /dev/null -X POST http://b/v1/instances -d '{"provider":"fake"}'
echo "idle bystander: $(bystander); daemon RSS $(rss) KiB"

add flood 120s 'mode = "status-flood"\nflood-bytes = 102400\nflood-entries = 64\nflood-calls = 2000'
attack "1a. 2000 statuses, each 64 entries naming one 100 KiB string" \
    api -X POST http://b/v1/instances -d '{"provider":"flood"}'
add big 120s 'mode = "status-flood"\nflood-bytes = 20971520\nflood-entries = 6\nflood-calls = 40'
attack "1b. 40 statuses, each 6 entries naming one 20 MiB string" \
    api -X POST http://b/v1/instances -d '{"provider":"big"}'
add records 120s 'mode = "records"\nflood-entries = 1000000'
attack "1c. all-instances answering 10^6 records" api 'http://b/v1/instances?provider=records'
add hoard 120s 'mode = "kv-flood"\nflood-bytes = 1048576'
attack "2. kv: 1 MiB values until refused" api 'http://b/v1/instances?provider=hoard'
add chatty 120s 'mode = "log-flood"\nflood-entries = 1000000'
attack "3. 10^6 stderr lines from one call" api 'http://b/v1/instances?provider=chatty'
add filler 120s 'mode = "fill"'
attack "4. 1 MiB writes (each synced) to /data until refused (default data-mib 1024)" \
    api 'http://b/v1/instances?provider=filler'
echo "  the filler's image takes $(du -k "$data/data-images/filler.ext4" | cut -f1) KiB on disk; its data dir: $(df -k --output=used,size "$data/data/filler" | tail -1) KiB used/size"
add spinner 10s 'mode = "loop"'
spin() {
    for _ in $(seq 64); do api -o /dev/null -w '%{http_code} ' 'http://b/v1/instances?provider=spinner' & done
    wait
}
attack "5. 64 concurrent spinning calls (deadline 10 s; max-concurrent-calls 32, queue-wait 2 s)" spin
echo
api http://b/metrics | grep -E '^broker_quota_refusals_total.* [1-9]'
