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
    let listing = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("guests.rs");
    std::fs::write(&listing, guest_listing(&components(&guests))).expect("cannot write the guest listing");
}

/// The crate names of the guest workspace's members that build a component (a `cdylib`).
fn components(guests: &Path) -> Vec<String> {
    let read = |path: &Path| -> toml::Table {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        text.parse().unwrap_or_else(|e| panic!("{} is not TOML: {e}", path.display()))
    };
    let workspace = read(&guests.join("Cargo.toml"));
    let members = workspace["workspace"]["members"].as_array().expect("guests/Cargo.toml lists its members");
    let mut names = Vec::new();
    for member in members.iter().filter_map(|m| m.as_str()) {
        let manifest = read(&guests.join(member).join("Cargo.toml"));
        let crate_types = manifest.get("lib").and_then(|lib| lib.get("crate-type")).and_then(|t| t.as_array());
        if crate_types.is_some_and(|types| types.iter().any(|t| t.as_str() == Some("cdylib"))) {
            let name = manifest["package"]["name"].as_str().expect("a member has a package name");
            names.push(name.to_owned());
        }
    }
    names
}

/// `GUESTS`, and the macro that makes a guest without a test a compile error.
fn guest_listing(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    let checks: String =
        names.iter().map(|n| format!("            let _: fn() = $tests::{};\n", n.replace('-', "_"))).collect();
    format!(
        "/// Every guest component the guest build makes, by crate name.\n\
         pub const GUESTS: &[&str] = &[{}];\n\n\
         /// `every_guest_is_tested!(module)`: `module` names one test for each guest in\n\
         /// [`GUESTS`] (its crate name with `_`), so a guest added without a test fails to compile.\n\
         #[macro_export]\n\
         macro_rules! every_guest_is_tested {{\n\
         \x20   ($tests:ident) => {{\n\
         \x20       const _: () = {{\n{}\
         \x20       }};\n\
         \x20   }};\n\
         }}\n",
        quoted.join(", "),
        checks
    )
}
