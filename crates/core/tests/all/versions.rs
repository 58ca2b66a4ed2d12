//! Contract versions: every published version is served at once. The fake's
//! own source built against 0.1.0 as published (`guests/fake-v0-1`, a
//! component of before 0.2.0) loads and runs beside the current build,
//! through the host and the kit; the published WIT never changes.

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_core::conformance;
use broker_core::manifest::Manifest;
use broker_tests::{fake_manifest_extra, wasm, write_manifest};
use sha2::{Digest, Sha256};
use std::path::Path;

/// 0.1.0 as published (the WIT of commit 9ca255a): its files, in name order.
const PUBLISHED_0_1_0_SHA256: &str = "20fe9292efbfc718b32a3a0c59ced692c8e48ac76c7e47b2fa56844f264391e3";

#[test]
fn the_published_0_1_0_wit_never_changes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../wit/0.1.0");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().path()).collect();
    files.sort();
    let mut hasher = Sha256::new();
    for file in &files {
        hasher.update(std::fs::read(file).unwrap());
    }
    assert_eq!(
        hex::encode(hasher.finalize()),
        PUBLISHED_0_1_0_SHA256,
        "wit/0.1.0 is contract 0.1.0 as published: a change goes in a new version"
    );
}

/// The 0.1.0 build imports and exports 0.1.0 only: it is what it stands for.
fn contract_names(engine: &wasmtime::Engine, path: &Path) -> Vec<String> {
    let component = wasmtime::component::Component::from_file(engine, path).unwrap();
    let ty = component.component_type();
    let imports = ty.imports(engine).map(|(name, _)| name.to_owned());
    let exports = ty.exports(engine).map(|(name, _)| name.to_owned());
    imports.chain(exports).filter(|name| name.starts_with("broker:provider/")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_component_built_against_0_1_0_runs_beside_a_0_2_0_build() {
    let engine = wasmtime::Engine::default();
    let old = contract_names(&engine, &wasm("fake_v0_1"));
    assert!(old.iter().any(|n| n == "broker:provider/kv@0.1.0"), "{old:?}");
    assert!(old.iter().any(|n| n == "broker:provider/instance-broker@0.1.0"), "{old:?}");
    assert!(old.iter().all(|n| n.ends_with("@0.1.0")), "{old:?}");
    let current = contract_names(&engine, &wasm("fake"));
    assert!(current.iter().all(|n| n.ends_with("@0.2.0")), "{current:?}");

    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let extra = fake_manifest_extra("pooled");
    broker.registry().add(&write_manifest(dir.path(), "fake", "fake", &extra)).await.unwrap();
    broker.registry().add(&write_manifest(dir.path(), "old", "fake_v0_1", &extra)).await.unwrap();
    let hooks = CallHooks::default();
    for name in ["fake", "old"] {
        let started = broker.start_instance(name, &empty_params(), &hooks).await.unwrap();
        let listed = broker.list_instances(Some(name)).await.unwrap();
        assert!(listed.iter().any(|r| r.id == started.id && r.status == "running"), "{name}: {listed:?}");
        broker.stop_instances(name, std::slice::from_ref(&started.id)).await.unwrap();
        assert!(broker.list_instances(Some(name)).await.unwrap().is_empty(), "{name}: stopped");
    }
}

/// The kit runs the 0.1.0 build as any other, strictly, and every case
/// passes; a kv quota refusal, which 0.1.0's `kv-error` has no case for,
/// reaches it as `too-large` naming the quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_0_component_passes_the_kit_and_sees_a_quota_refusal_as_too_large() {
    let dir = tempfile::tempdir().unwrap();
    let manifest =
        Manifest::load(&write_manifest(dir.path(), "old", "fake_v0_1", &fake_manifest_extra("per-call"))).unwrap();
    let report = conformance::run(&manifest).await.unwrap();
    assert!(report.passed(), "{}", report.text());

    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let tight = fake_manifest_extra("pooled").replace("[limits]\n", "[limits]\nkv-keys = 3\n");
    broker.registry().add(&write_manifest(dir.path(), "tight", "fake_v0_1", &tight)).await.unwrap();
    let hooks = CallHooks::default();
    let mut refused = None;
    for _ in 0..5 {
        if let Err(e) = broker.start_instance("tight", &empty_params(), &hooks).await {
            refused = Some(broker_capabilities::error_text::error_text(&e));
            break;
        }
    }
    let refused = refused.expect("a start past kv-keys = 3 is refused");
    assert!(refused.contains("kv: too large: quota exceeded: ") && refused.contains("kv-keys"), "{refused}");
}
