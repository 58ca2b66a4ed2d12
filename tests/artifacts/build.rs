//! The one build step for guests: `cargo build --release` of the guests/
//! workspace for wasm32-wasip2, into guests/target (where the bundled
//! manifests point). Runs whenever a guest source or the WIT changes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest_dir.parent().and_then(Path::parent).expect("tests/artifacts sits two levels below the root");
    let guests = root.join("guests");
    let wit = root.join("wit");

    // Watch sources, not guests/target (which this build writes).
    println!("cargo:rerun-if-changed={}", wit.display());
    for name in ["Cargo.toml", "Cargo.lock", ".cargo/config.toml"] {
        println!("cargo:rerun-if-changed={}", guests.join(name).display());
    }
    for entry in std::fs::read_dir(&guests).expect("guests/ exists").flatten() {
        let path = entry.path();
        if path.is_dir() && path.file_name().is_some_and(|n| n != "target" && n != ".cargo") {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(&guests).args(["build", "--release", "--target", "wasm32-wasip2"]);
    // The outer build's settings must not leak into the guest build.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        let leaks =
            key.starts_with("CARGO_") && key != "CARGO_HOME" && key != "CARGO_MAKEFLAGS" && key != "CARGO_NET_OFFLINE"
                || matches!(key.as_str(), "RUSTFLAGS" | "RUSTC_WRAPPER" | "RUSTC_WORKSPACE_WRAPPER" | "RUSTDOCFLAGS");
        if leaks {
            command.env_remove(&key);
        }
    }
    let status = command.status().expect("cannot run cargo to build the guests");
    if !status.success() {
        panic!("building the guests failed ({status}); is the target installed? run `rustup target add wasm32-wasip2`");
    }
    let out = guests.join("target/wasm32-wasip2/release");
    println!("cargo:rustc-env=GUEST_WASM_DIR={}", out.display());
    println!("cargo:rustc-env=GUESTS_DIR={}", guests.display());
}
