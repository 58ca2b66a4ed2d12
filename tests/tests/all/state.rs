//! Manifest refusals and the persistent state, through the broker service.

use broker_host::broker::Broker;
use broker_host::broker::service::empty_params;
use broker_host::capabilities::context::CallHooks;
use broker_host::providers::Manifest;
use broker_tests::{bundled_manifest, fake_manifest_extra, wasm, write_manifest};
use sha2::{Digest, Sha256};

async fn add_error(extra: &str, guest: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let manifest = write_manifest(dir.path(), "candidate", guest, extra);
    let err = broker.registry().add(&manifest).await.expect_err("the manifest must be refused");
    assert!(broker.registry().list().unwrap().is_empty(), "nothing is registered after a refusal");
    format!("{:#}", anyhow::Error::from(err))
}

#[tokio::test]
async fn unknown_manifest_key_is_refused_with_its_line() {
    let err = add_error("[grants]\nkv = true\nnetwork = true\n", "fake").await;
    assert!(err.contains("unknown field `network`") && err.contains("line 5"), "{err}");
}

#[tokio::test]
async fn sha256_pin_mismatch_is_refused() {
    let err = add_error(&format!("sha256 = \"{}\"\n", "0".repeat(64)), "fake").await;
    assert!(err.contains("does not match the manifest's sha256 pin"), "{err}");

    let actual = hex::encode(Sha256::digest(std::fs::read(wasm("fake")).unwrap()));
    let dir = tempfile::tempdir().unwrap();
    let pinned = format!("sha256 = \"{actual}\"\n{}", fake_manifest_extra("pooled"));
    let manifest = write_manifest(dir.path(), "fake", "fake", &pinned);
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    broker.registry().add(&manifest).await.expect("a matching pin is accepted");
}

#[tokio::test]
async fn ungranted_import_is_named() {
    // The fake imports kv and log; this manifest grants neither.
    let err = add_error("", "fake").await;
    assert!(err.contains("broker:provider/kv@0.1.0") && err.contains("does not grant"), "{err}");
}

#[tokio::test]
async fn a_component_that_is_not_a_provider_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let not_wasm = dir.path().join("junk.wasm");
    std::fs::write(&not_wasm, b"\0asm garbage").unwrap();
    let manifest = dir.path().join("junk.toml");
    std::fs::write(&manifest, format!("name = \"junk\"\ncomponent = \"{}\"\n", not_wasm.display())).unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let err = broker.registry().add(&manifest).await.unwrap_err().to_string();
    assert!(err.contains("cannot compile component"), "{err}");
}

#[tokio::test]
async fn bundled_manifest_loads() {
    let manifest = Manifest::load(&bundled_manifest("fake")).unwrap();
    assert!(manifest.component.exists(), "guests/fake/provider.toml points at the built component");
}

#[tokio::test]
async fn state_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let started = {
        let broker = Broker::open(&data).unwrap();
        broker.registry().add(&bundled_manifest("fake")).await.unwrap();
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap().id);
        }
        broker.stop_instances("fake", &ids[..1]).await.unwrap();
        ids
    };
    // A new host on the same data dir sees the providers, the records and the provider's kv.
    let broker = Broker::open(&data).unwrap();
    assert_eq!(broker.registry().list().unwrap()[0].name, "fake");
    let listed = broker.list_instances(None).await.unwrap();
    let ids: Vec<_> = listed.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, [started[1].as_str(), started[2].as_str()]);
    assert!(listed.iter().all(|r| r.status == "running" && !r.created.is_empty()));
    let next = broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
    assert_eq!(next.id, "fake-3", "the provider's id sequence lives in kv, so it continues");
}
