#!/usr/bin/env bash
# The main job, from a fresh clone: build the guests and the host, add the fake
# provider, start, list and stop instances. Needs only rustup.
set -euo pipefail
cd "$(dirname "$0")/.."

rustup target add wasm32-wasip2
# Builds the host (`broker`) and, through tests/artifacts/build.rs, every guest.
cargo build --release --workspace

data_dir=$(mktemp -d)
trap 'rm -rf "$data_dir"' EXIT
broker() { ./target/release/broker --data-dir "$data_dir" "$@"; }

broker provider add guests/fake/provider.toml
broker provider list
broker instance start --provider fake --constraints "mem=2G cores=2 arch=amd64 tags=web zones=zone-b,zone-c"
broker instance start --provider fake --placement zone=zone-a --json
broker instance list
broker instance stop fake-0
broker instance list --json
echo "quickstart: ok (state was in $data_dir)"
