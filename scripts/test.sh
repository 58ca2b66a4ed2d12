#!/usr/bin/env bash
# Every check CI runs: formatting, clippy, unit and end-to-end tests (which
# build the guests), and the benchmarks in test mode. Needs rustup and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step's start, in seconds since the run began, on stderr: where CI's time goes.
trap 'echo "[test.sh +${SECONDS}s] ${BASH_COMMAND}" >&2' DEBUG

rustup target add wasm32-wasip2
rustup component add rustfmt clippy
# qemu, incus, genisoimage, busybox-static (Debian; needs root), then the VM
# payload the KVM tests boot and the container image the LXD tests import.
# The tests start their own incusd (scripts/incus-netns.sh) and stop it by pid.
bash scripts/install-test-deps.sh
bash scripts/vm-payload.sh target/vm-payload
bash scripts/incus-image.sh target/incus-image

cargo fmt --all --check
# A cycle between crates does not compile; one between a crate's modules is refused here.
python3 scripts/module-cycles.py
# An error names its cause once: in its message or as its source(), not both.
python3 scripts/error-causes.py
(cd guests && cargo fmt --all --check)

# Host workspace; the guest build runs inside it (tests/artifacts/build.rs).
cargo clippy --release --workspace --all-targets -- -D warnings
(cd guests && cargo clippy --release --workspace -- -D warnings)

# The providers' logic, natively (guests/.cargo/config.toml only applies inside guests/).
cargo test --release --manifest-path guests/fake-logic/Cargo.toml
cargo test --release --manifest-path guests/kvm-logic/Cargo.toml
cargo test --release --manifest-path guests/lxd-logic/Cargo.toml
cargo test --release --manifest-path guests/ec2-logic/Cargo.toml
cargo test --release --manifest-path guests/sdk/Cargo.toml

cargo test --release --workspace
# The conformance kit on the bundled providers, strictly, on their own scripts (no
# daemon, no qemu, no cloud: every granted capability is simulated).
# The binary the workspace's tests built (`cargo run --bin broker` would build the
# host crates again with broker-serve's features alone: 206 s of a fresh run).
for provider in fake kvm lxd ec2; do
    target/release/broker provider test \
        "guests/target/wasm32-wasip2/release/$provider.wasm" --manifest "guests/$provider/provider.toml" --strict
done
# Every benchmark once, as a test (criterion's test mode under `cargo test`):
# they must keep working. One binary (tests/benches/all), on the release build
# above: `--workspace`, not `-p broker-tests`, or the workspace's dev-dependencies
# unify other features and the host crates are built again (3 min).
cargo test --release --workspace --bench all
