//! Manifest refusals and the persistent state, through the broker service.

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::KvBackend;
use broker_core::broker::Broker;
use broker_core::manifest::Manifest;
use broker_core::store::Store;
use broker_core::version::CallError;
use broker_tests::{bundled_manifest, fake_manifest_extra, load_provider, wasm, write_manifest};
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
    let kv = format!("broker:provider/kv@{}", broker_capabilities::bindings::CONTRACT_VERSION);
    assert!(err.contains(&kv) && err.contains("does not grant"), "{err}");
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

/// When a kv change reaches the state file: for a provider granted only kv, at
/// the end of the call that made it, even one stopped at its deadline; for one
/// granted a program (an effect outside the store), before the host function
/// returns to the guest. Seen from outside while the guest still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_changes_are_durable_at_the_call_end_or_at_once_for_providers_that_act_outside_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("state")).unwrap();
    let runtime = broker_tests::runtime();
    let deadline = "[limits.deadlines]\ndefault = \"3s\"\n[grants]\nkv = true\n";
    let granted = [("", false), ("process = [\"echo\"]\n", true), ("local-sockets = true\n", true)];
    for (grants, durable_during_the_call) in granted {
        let kv = store.kv();
        let extra = format!("{deadline}{grants}");
        let provider = load_provider(&runtime, kv.clone(), dir.path(), "hostile", "test-hostile", &extra).unwrap();
        kv.delete("hostile", "written").unwrap();
        kv.delete("hostile", "written-next").unwrap();
        kv.set("hostile", "mode", b"write-loop").unwrap();
        let call = tokio::spawn(async move { provider.all_instances(&CallHooks::default()).await });
        let waiting = std::time::Instant::now();
        // The second write is seen: the guest's `set` of the first has returned.
        while kv.get("hostile", "written-next").unwrap().is_none() {
            assert!(waiting.elapsed() < std::time::Duration::from_secs(5), "the guest never wrote");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // The guest spins now, until its deadline.
        let on_disk = kv.committed("hostile", "written").unwrap();
        assert_eq!(on_disk.is_some(), durable_during_the_call, "grants {grants:?}: in the file during the call");
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(err, CallError::Deadline { .. }), "{err}");
        let on_disk = kv.committed("hostile", "written").unwrap();
        assert_eq!(on_disk.as_deref(), Some(&b"yes"[..]), "grants {grants:?}: in the file once the call ended");
    }
}

/// A start of a kv-only provider commits its kv changes with the host's record:
/// after the start returns, both are in the file. (Each change was durable on
/// its own before kv changes were left to the call's end, so this passed then
/// too: it guards the joined commit, whose atomicity `store::writer`'s tests show.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_only_start_is_in_the_file_with_its_record() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let manifest = write_manifest(dir.path(), "fake", "fake", &fake_manifest_extra("pooled"));
    broker.registry().add(&manifest).await.unwrap();
    let record = broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
    let kv = broker.store().kv();
    let packed = kv.scan_packed("fake", "").unwrap();
    assert!(!packed.is_empty(), "the fake keeps its instances in kv");
    let mut offset = 0;
    let mut keys = 0;
    while offset < packed.len() {
        let key_len = u32::from_le_bytes(packed[offset..offset + 4].try_into().unwrap()) as usize;
        let key = std::str::from_utf8(&packed[offset + 4..offset + 4 + key_len]).unwrap().to_owned();
        offset += 4 + key_len;
        let value_len = u32::from_le_bytes(packed[offset..offset + 4].try_into().unwrap()) as usize;
        let value = packed[offset + 4..offset + 4 + value_len].to_vec();
        offset += 4 + value_len;
        assert_eq!(kv.committed("fake", &key).unwrap(), Some(value), "kv {key:?} is in the file");
        keys += 1;
    }
    assert!(keys >= 2, "the sequence and the instance: {keys}");
    assert_eq!(broker.store().instance("fake", &record.id).unwrap().map(|r| r.id), Some(record.id));
}
