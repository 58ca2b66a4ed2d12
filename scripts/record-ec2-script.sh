#!/usr/bin/env bash
# Record guests/ec2/provider.script.json: the conformance kit run against a real
# EC2-compatible server (moto, signatures checked), its exchanges written as the
# script the kit replays in CI. The host signs with a credential made in moto's
# IAM for this run only; the recording holds what the guest sent (unsigned) and
# the answers' bodies, never a signature or the secret.
# Usage: scripts/record-ec2-script.sh [OUT]   (needs target/moto-venv and a built host)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-guests/ec2/provider.script.json}
venv=target/moto-venv/bin
[ -x "$venv/moto_server" ] || { echo "no $venv/moto_server: run scripts/install-test-deps.sh" >&2; exit 1; }
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
INITIAL_NO_AUTH_ACTION_COUNT=3 "$venv/moto_server" -H 127.0.0.1 -p "$port" >/dev/null 2>&1 &
moto=$!
trap 'kill $moto 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
read -r key secret < <("$venv/python" scripts/moto-iam-setup.py "http://127.0.0.1:$port" recorder)
mkdir -p "$work/data/credentials"
(umask 077 && printf 'access-key-id = "%s"\nsecret-access-key = "%s"\n' "$key" "$secret" > "$work/data/credentials/moto.toml")
# The shipped manifest with the endpoint moved to moto (plain http: loopback only).
sed -e "s|^url = .*|url = \"http://127.0.0.1:$port\"|" -e 's|^credentials = .*|credentials = "moto"|' \
    guests/ec2/provider.toml > "$work/provider.toml"
cargo run --release -q --bin broker -- --data-dir "$work/data" provider test \
    guests/target/wasm32-wasip2/release/ec2.wasm --manifest "$work/provider.toml" --record "$out"
if grep -q -- "$secret" "$out"; then echo "the recording holds the secret: not kept" >&2; rm -f "$out"; exit 1; fi
