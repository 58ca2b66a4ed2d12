//! Hot swap: a provider's component replaced while clients call it, between
//! the fake (0.1.0) and the same source built as 0.2.0 (`guests/fake-next`).

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_core::providers::registry::RegistryError;
use broker_core::store::EventKind;
use broker_core::version::ProviderVersion;
use broker_tests::{bundled_manifest_text, wasm};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The bundled fake's manifest with `config_line` added to (or, for `prefix`, replaced in) its [config].
fn fake_manifest(dir: &Path, config_line: &str) -> std::path::PathBuf {
    let text = bundled_manifest_text("fake");
    let text = if config_line.starts_with("prefix") {
        text.replace("prefix = \"fake\"", config_line)
    } else {
        format!("{text}{config_line}\n")
    };
    let path = dir.join("fake.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn version_of(result: &broker_capabilities::bindings::StartInstanceResult) -> String {
    result.config.iter().find(|(k, _)| k == "provider-version").map(|(_, v)| v.clone()).unwrap()
}

async fn serving(broker: &Broker) -> Arc<ProviderVersion> {
    broker.registry().get("fake").await.unwrap().version().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
pub(crate) async fn swapping_under_load_loses_no_call_and_no_instance() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Arc::new(Broker::open(dir.path()).unwrap());
    broker.registry().add(&fake_manifest(dir.path(), "")).await.unwrap();
    let mut versions_loaded = vec![serving(&broker).await];
    let anchors: Vec<String> = {
        let mut ids = Vec::new();
        for _ in 0..5 {
            ids.push(broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap().id);
        }
        ids
    };

    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (broker, stop, calls) = (broker.clone(), stop.clone(), calls.clone());
        clients.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let mut answered_by = std::collections::BTreeSet::new();
            while !stop.load(Ordering::Relaxed) {
                // One round: start (through the slot, to see which version answered), list, stop.
                let provider = broker.registry().get("fake").await.unwrap();
                let started = provider.start_instance(&CallHooks::default(), &empty_params()).await;
                calls.fetch_add(1, Ordering::Relaxed);
                let id = match started {
                    Ok(result) => {
                        answered_by.insert(version_of(&result));
                        result.instance.id
                    }
                    Err(e) => {
                        failures.push(format!("start: {e}"));
                        continue;
                    }
                };
                drop(provider);
                calls.fetch_add(1, Ordering::Relaxed);
                match broker.list_instances(Some("fake")).await {
                    Ok(listed) if listed.iter().any(|r| r.id == id) => {}
                    Ok(_) => failures.push(format!("{id} missing from all-instances")),
                    Err(e) => failures.push(format!("list: {e}")),
                }
                calls.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = broker.stop_instances("fake", &[id]).await {
                    failures.push(format!("stop: {e}"));
                }
            }
            (failures, answered_by)
        }));
    }

    let mut swaps = 0;
    for round in 0..24 {
        tokio::time::sleep(Duration::from_millis(15)).await;
        let next = if round % 2 == 0 { "fake_next" } else { "fake" };
        let report = broker.registry().swap("fake", &wasm(next), None).await.unwrap();
        assert_ne!(report.old_version, report.new_version);
        versions_loaded.push(serving(&broker).await);
        swaps += 1;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.store(true, Ordering::Relaxed);
    let mut versions_seen = std::collections::BTreeSet::new();
    for client in clients {
        let (failures, answered_by) = client.await.unwrap();
        assert!(failures.is_empty(), "failed calls during swaps: {failures:?}");
        versions_seen.extend(answered_by);
    }
    assert_eq!(versions_seen.into_iter().collect::<Vec<_>>(), ["0.1.0", "0.2.0"]);

    // Every call was answered by exactly one loaded version: the counts add up,
    // besides each version's own validate-config and describe when it was loaded
    // and the five anchor starts.
    let answered: u64 = versions_loaded.iter().map(|v| v.stats().calls.load(Ordering::Relaxed)).sum();
    let client_calls = calls.load(Ordering::Relaxed);
    assert!(client_calls > 100, "the load was too light to mean anything: {client_calls} calls");
    assert_eq!(answered, client_calls + 2 * (swaps + 1) + 5);

    // The state lives in the host: every version saw every instance.
    let listed: Vec<String> = broker.list_instances(Some("fake")).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(listed.len(), anchors.len(), "{listed:?}");
    assert!(anchors.iter().all(|a| listed.contains(a)));
    let swapped = broker.store().events(0, 1000).unwrap().iter().filter(|e| e.kind == EventKind::Swapped).count();
    assert_eq!(swapped as u64, swaps);
    assert_eq!(broker.registry().swap_counts().swapped.load(Ordering::Relaxed), swaps);
    // Each swap pruned the copy it replaced: only the serving component is kept.
    let kept: Vec<_> = std::fs::read_dir(broker.store().data_dir().join("components")).unwrap().flatten().collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].path(), serving(&broker).await.manifest().component);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_flight_finishes_on_the_version_it_started_on() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Arc::new(Broker::open(dir.path()).unwrap());
    broker.registry().add(&fake_manifest(dir.path(), "start-delay-ms = 1500")).await.unwrap();
    let slow = {
        let provider = serving(&broker).await;
        tokio::spawn(async move { provider.start_instance(&CallHooks::default(), &empty_params()).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = broker.registry().swap("fake", &wasm("fake_next"), None).await.unwrap();
    assert_eq!((report.old_version.as_str(), report.new_version.as_str()), ("0.1.0", "0.2.0"));
    let fresh = serving(&broker).await.start_instance(&CallHooks::default(), &empty_params()).await.unwrap();
    assert_eq!(version_of(&fresh), "0.2.0");
    let finished = slow.await.unwrap().unwrap();
    assert_eq!(version_of(&finished), "0.1.0", "the slow start must complete on the old version");

    // The swap is what loads after a restart, too.
    drop(broker);
    let broker = Broker::open(dir.path()).unwrap();
    assert_eq!(serving(&broker).await.describe().await.unwrap().version, "0.2.0");
    assert_eq!(broker.registry().show("fake").unwrap().0.version, "0.2.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_candidates_leave_the_old_version_serving() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(dir.path()).unwrap();
    broker.registry().add(&fake_manifest(dir.path(), "")).await.unwrap();
    let original = serving(&broker).await.sha256().to_owned();

    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"this is not wasm").unwrap();
    let core_module = dir.path().join("core.wasm");
    std::fs::write(&core_module, b"\0asm\x01\0\0\0").unwrap();
    let hostile = wasm("test_hostile");
    let cases: Vec<(&Path, bool, &str)> = vec![
        (&garbage, false, "swap of \"fake\" refused; version 0.1.0 keeps serving"),
        (&core_module, false, "component"),
        (&hostile, true, "check failed"),
    ];
    for (candidate, check, needle) in &cases {
        let kit = broker_core::conformance::ConformanceCheck;
        let err = broker.registry().swap("fake", candidate, check.then_some(&kit as _)).await.unwrap_err();
        assert!(matches!(err, RegistryError::SwapRefused { .. }), "{err:?}");
        assert!(err.to_string().contains(needle), "{}: {err}", candidate.display());
        assert_eq!(serving(&broker).await.sha256(), original);
        let result = serving(&broker).await.start_instance(&CallHooks::default(), &empty_params()).await.unwrap();
        assert_eq!(version_of(&result), "0.1.0");
    }

    // A candidate that traps in validate-config on the live config: a prefix
    // the fake accepts and the hostile guest's validate-config traps on.
    let dir2 = tempfile::tempdir().unwrap();
    let broker2 = Broker::open(dir2.path()).unwrap();
    broker2.registry().add(&fake_manifest(dir2.path(), "prefix = \"trap-validate\"")).await.unwrap();
    let err = broker2.registry().swap("fake", &wasm("test_hostile"), None).await.unwrap_err();
    assert!(err.to_string().contains("validate-config"), "{err}");
    assert_eq!(broker2.registry().get("fake").await.unwrap().describe().await.unwrap().version, "0.1.0");

    let refused: Vec<_> =
        broker.store().events(0, 100).unwrap().into_iter().filter(|e| e.kind == EventKind::SwapRefused).collect();
    assert_eq!(refused.len(), cases.len());
    for event in &refused {
        assert_eq!(event.old_sha256.as_deref(), Some(original.as_str()));
        assert!(event.new_sha256.is_some() && !event.detail.is_empty(), "{event:?}");
    }
}
