//! What a provider's author does, as the README's "Writing a provider" walks
//! it: `provider new` writes a crate outside the repository, which builds as
//! written and passes `provider test --strict`; `provider call` answers one
//! method of the component file, then of the registered provider, with and
//! without a daemon.

use crate::common::{Daemon, broker};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn stdout(out: &std::process::Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// `cargo build --release` in `crate_dir`, as its author would run it; into
/// the guests' target dir, with their lockfile, so the crates the guests
/// built already are not fetched or built again.
fn cargo_build(crate_dir: &Path, target_dir: &Path) {
    std::fs::copy(guest_artifacts::wasm_dir().join("../../../Cargo.lock"), crate_dir.join("Cargo.lock")).unwrap();
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build.current_dir(crate_dir).args(["build", "--release", "--offline"]);
    // The test's own cargo settings are not the author's.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("CARGO_") && key != "CARGO_HOME" || matches!(key.as_str(), "RUSTFLAGS" | "RUSTC_WRAPPER") {
            build.env_remove(&key);
        }
    }
    let built = build.env("CARGO_TARGET_DIR", target_dir).output().expect("run cargo");
    assert!(built.status.success(), "cargo build: {}", String::from_utf8_lossy(&built.stderr));
}

#[test]
fn a_new_provider_builds_passes_the_kit_strictly_and_answers_calls() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    let crate_dir = dir.path().join("static-pool");
    let crate_path = crate_dir.display().to_string();
    let wrote = stdout(&broker(&data, &["provider", "new", "static-pool", "--dir", &crate_path]));
    assert!(wrote.contains("wrote ") && wrote.contains("next: cd "), "{wrote}");
    let refused = broker(&data, &["provider", "new", "static-pool", "--dir", &crate_path]);
    assert_eq!(refused.status.code(), Some(2), "a crate is never written over");

    let guests_target = guest_artifacts::wasm_dir().join("../..");
    cargo_build(&crate_dir, &guests_target);
    let built = guest_artifacts::wasm_dir().join("static_pool.wasm");
    // Where its manifest expects it, as its own `cargo build` would leave it.
    let component = crate_dir.join("target/wasm32-wasip2/release/static_pool.wasm");
    std::fs::create_dir_all(component.parent().unwrap()).unwrap();
    std::fs::copy(&built, &component).unwrap();
    let (component, manifest) = (component.display().to_string(), crate_dir.join("provider.toml"));
    let manifest = manifest.display().to_string();

    let tested = stdout(&broker(&data, &["provider", "test", &component, "--manifest", &manifest, "--strict"]));
    assert!(tested.contains(" passed, 0 failed"), "{tested}");

    // One method of the file, in a fresh sandbox each call.
    let call = |args: &[&str]| -> Value {
        let head: [&str; 3] = ["provider", "call", &component];
        let all = [&head[..], args, &["--manifest", manifest.as_str()]].concat();
        serde_json::from_str(&stdout(&broker(&data, &all))).unwrap()
    };
    assert_eq!(call(&["describe"])["name"], "static-pool");
    let started = call(&["start-instance", "--params", r#"{"constraints": {"mem": 2048, "cores": 2}}"#]);
    assert_eq!(started["instance"]["id"], "static-pool-1", "{started}");
    assert_eq!((&started["hardware"]["mem"], &started["hardware"]["cpu_cores"]), (&2048.into(), &2.into()));
    assert_eq!(call(&["all-instances"]), serde_json::json!([]), "nothing carries over between calls");
    let misused = broker(&data, &["provider", "call", &component, "stop-instances", "--manifest", &manifest]);
    assert_eq!(
        misused.status.code(),
        Some(3),
        "stop-instances needs its ids: a bad request, as for a registered provider"
    );
    let error: Value = serde_json::from_slice(&misused.stdout).unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("a list of ids"), "{error}");

    // Registered: what changes nothing the host records, the same with a daemon as without.
    stdout(&broker(&data, &["provider", "add", &manifest]));
    stdout(&broker(&data, &["instance", "start", "--provider", "static-pool", "--constraints", "mem=4G"]));
    let listed = stdout(&broker(&data, &["provider", "call", "static-pool", "all-instances"]));
    let page = r#"{"cursor": null, "size": 1}"#;
    let paged = stdout(&broker(&data, &["provider", "call", "static-pool", "all-instances", "--params", page]));
    let recorded = broker(&data, &["provider", "call", "static-pool", "start-instance"]);
    let mixed = broker(&data, &["provider", "call", "static-pool", "describe", "--manifest", &manifest]);
    assert_eq!(mixed.status.code(), Some(2), "--manifest is for a component file");
    let daemon = Daemon::start(&data);
    let through = stdout(&broker(&data, &["provider", "call", "static-pool", "all-instances"]));
    assert_eq!(through, listed);
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed[0]["instance"]["id"], "static-pool-1");
    assert_eq!(listed[0]["hardware"]["mem"], 4096, "listed with its hardware");
    let paged: Value = serde_json::from_str(&paged).unwrap();
    assert_eq!((paged["instances"].as_array().unwrap().len(), &paged["next"]), (1, &Value::Null));
    let recorded_through = broker(&data, &["provider", "call", "static-pool", "start-instance"]);
    for refused in [&recorded, &recorded_through] {
        assert_eq!(refused.status.code(), Some(3), "a bad request");
        let error: Value = serde_json::from_slice(&refused.stdout).unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains("changes what the host records"), "{error}");
    }
    drop(daemon);
}
