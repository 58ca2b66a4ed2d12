//! Calls the host was killed in: pending starts adopted or forgotten, marked
//! stops finished, unknown instances harvested per mode, and hostile claims.
//! A "kill" here is the call's future dropped with the broker, then the state
//! reopened: what the host wrote before the provider acted is all there is.

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::KvBackend;
use broker_core::broker::Broker;
use broker_core::broker::reconcile::{HarvestMode, Reconciled};
use broker_core::store::EventKind;
use broker_tests::write_manifest;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The fake, granted a local socket so that it counts as acting outside the
/// store (its starts are made pending, as a VM's or a container's are).
fn outside_fake(dir: &Path, config: &str) -> std::path::PathBuf {
    let extra = format!(
        "[limits]\nmemory-mib = 64\n[limits.deadlines]\ndefault = \"60s\"\n[grants]\nkv = true\nlocal-sockets = true\n[config]\n{config}\n"
    );
    write_manifest(dir, "fake", "fake", &extra)
}

async fn only(found: Vec<Reconciled>) -> Reconciled {
    assert_eq!(found.len(), 1, "{found:?}");
    found.into_iter().next().unwrap()
}

/// Wait until the provider reports an instance the host has no record of
/// (its start is in flight, past the point where it made the instance).
async fn an_unrecorded_instance(broker: &Broker) -> String {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let listed = broker.list_instances(Some("fake")).await.unwrap();
        if let Some(unrecorded) = listed.iter().find(|r| r.created.is_empty()) {
            return unrecorded.id.clone();
        }
        assert!(Instant::now() < until, "no start got as far as making its instance: {listed:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Start one instance and "kill" the host once `ready` says the call is far enough.
async fn killed_mid_start(data: &Path, manifest: &Path, wait_for_instance: bool) -> Option<String> {
    let broker = Arc::new(Broker::open(data).unwrap());
    broker.registry().add(manifest).await.unwrap();
    let starting = broker.clone();
    let mut params = empty_params();
    params.constraints.tags = Some(vec!["kept".into()]);
    let call = tokio::spawn(async move { starting.start_instance("fake", &params, &CallHooks::default()).await });
    let id = match wait_for_instance {
        true => Some(an_unrecorded_instance(&broker).await),
        false => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            None
        }
    };
    assert!(!call.is_finished(), "the start answered before the kill");
    call.abort();
    let _ = call.await;
    drop(broker);
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_killed_after_its_claim_is_adopted_with_its_params() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = outside_fake(dir.path(), "answer-delay-ms = 60000");
    let id = killed_mid_start(&data, &manifest, true).await.unwrap();

    let broker = Broker::open(&data).unwrap();
    assert_eq!(broker.store().interrupted_starts("fake").unwrap().len(), 1, "the start was pending, id claimed");
    let found = only(broker.reconcile_after_restart(HarvestMode::Destroyed).await).await;
    assert_eq!(found.adopted, [id.as_str()], "{found:?}");
    assert!(found.unknown_to_host.is_empty() && found.forgotten.is_empty(), "{found:?}");
    assert!(broker.store().interrupted_starts("fake").unwrap().is_empty());
    let record = broker.store().instance("fake", &id).unwrap().expect("recorded");
    assert_eq!(record.tags, ["kept"]);
    // What the provider lists of it (contract 0.3.0): not blank, as its start would have said.
    assert!(record.hardware.availability_zone.as_deref().is_some_and(|z| z.starts_with("zone-")), "{record:?}");
    assert_eq!((record.hardware.arch.as_deref(), record.display_name.as_str()), (Some("amd64"), id.as_str()));
    assert!(record.params.is_some_and(|p| p.constraints.tags == Some(vec!["kept".into()])));
    // It is an instance like any other now: maintained with its params, stopped by id.
    broker.maintain_instance("fake", &id).await.unwrap();
    broker.stop_instances("fake", std::slice::from_ref(&id)).await.unwrap();
    assert!(broker.list_instances(Some("fake")).await.unwrap().is_empty());
}

/// The reconcile after a restart runs while the API already serves: a start
/// of this process's that has made its instance but not yet recorded it is
/// none of the reconcile's business: not "unknown to the host", not adopted
/// or forgotten; once answered it is recorded as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_beside_this_processs_own_start_reports_no_phantom() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = outside_fake(dir.path(), "answer-delay-ms = 2000");
    let broker = Arc::new(Broker::open(&dir.path().join("data")).unwrap());
    broker.registry().add(&manifest).await.unwrap();
    let starting = broker.clone();
    let call =
        tokio::spawn(async move { starting.start_instance("fake", &empty_params(), &CallHooks::default()).await });
    let id = an_unrecorded_instance(&broker).await;
    let found = only(broker.reconcile_after_restart(HarvestMode::Destroyed).await).await;
    assert!(found.unknown_to_host.is_empty() && found.vanished.is_empty(), "a phantom: {found:?}");
    assert!(found.adopted.is_empty() && found.forgotten.is_empty() && found.harvested.is_empty(), "{found:?}");
    assert!(!call.is_finished(), "the start answered before the reconcile was done: the test proves nothing");
    assert_eq!(call.await.unwrap().unwrap().id, id);
    let found = only(broker.reconcile().await).await;
    assert_eq!(found.maintained, [id.as_str()], "{found:?}");
}

/// A reconcile reads the records a page at a time, each with its own start
/// params: every record is maintained once, past the first page too, with
/// the params it was started with (the fake refuses those carrying its
/// unhealthy tag), and nothing is reported vanished or unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_maintains_every_record_with_its_params_page_after_page() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = outside_fake(dir.path(), r#"unhealthy-tag = "fake.unhealthy""#);
    let data = dir.path().join("data");
    let broker = Arc::new(Broker::open(&data).unwrap());
    broker.registry().add(&manifest).await.unwrap();
    let (count, unhealthy_at) = (700, [0, 300, 699]);
    let mut unhealthy = Vec::new();
    for n in 0..count {
        let mut params = empty_params();
        if unhealthy_at.contains(&n) {
            let mut config = broker_capabilities::contract::empty_instance_config();
            config.tags = vec![("fake.unhealthy".into(), "yes".into())];
            params.instance_config = Some(config);
        }
        let id = broker.start_instance("fake", &params, &CallHooks::default()).await.unwrap().id;
        if unhealthy_at.contains(&n) {
            unhealthy.push(id);
        }
    }
    let found = only(broker.reconcile().await).await;
    let mut failed: Vec<&str> = found.maintain_failed.iter().map(|(id, _)| id.as_str()).collect();
    failed.sort_unstable();
    unhealthy.sort_unstable();
    assert_eq!(failed, unhealthy, "{:?}", found.maintain_failed);
    assert!(found.maintain_failed.iter().all(|(_, why)| why.contains("not healthy")), "{:?}", found.maintain_failed);
    assert_eq!(found.maintained.len(), count - unhealthy.len());
    let mut all: Vec<&str> = found.maintained.iter().map(String::as_str).chain(failed).collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), count, "each record maintained once");
    assert!(found.vanished.is_empty() && found.unknown_to_host.is_empty(), "{}", found.summary());

    // The first pages all stopping (a stop of the oldest, cut short by the
    // host's end): the pages after them are still maintained.
    let mut ids: Vec<String> = all.iter().map(|id| id.to_string()).collect();
    ids.sort_unstable();
    let (stopping, rest) = ids.split_at(600);
    broker.store().mark_stopping("fake", stopping).await.unwrap();
    drop(broker);
    let broker = Broker::open(&data).unwrap();
    let found = only(broker.reconcile().await).await;
    let mut seen: Vec<&str> =
        found.maintained.iter().chain(found.maintain_failed.iter().map(|(id, _)| id)).map(String::as_str).collect();
    seen.sort_unstable();
    assert!(seen == rest, "{} of {} maintained: {}", seen.len(), rest.len(), found.summary());
    assert!(found.error.is_none(), "{}", found.summary());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_killed_before_its_claim_is_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = outside_fake(dir.path(), "start-delay-ms = 60000");
    killed_mid_start(&data, &manifest, false).await;

    let broker = Broker::open(&data).unwrap();
    let found = only(broker.reconcile_after_restart(HarvestMode::Destroyed).await).await;
    assert_eq!(found.forgotten.len(), 1, "{found:?}");
    assert!(found.forgotten[0].contains("claimed no id"), "{found:?}");
    assert!(found.adopted.is_empty() && found.unknown_to_host.is_empty(), "{found:?}");
    assert!(broker.store().interrupted_starts("fake").unwrap().is_empty());
    // The event says it.
    let events = broker.store().events(0, 100).unwrap();
    let reconciled = events.iter().find(|e| e.kind == EventKind::Reconciled).unwrap();
    assert!(reconciled.detail.contains("forgot pending starts: a start"), "{}", reconciled.detail);
}

/// A kv-only provider's instance lives in its kv, committed with the record:
/// nothing is made pending before its call (a start costs no extra write).
/// A call dropped midway (a drain cut short) persists the kv changes it made,
/// so its drop leaves a pending start with the claimed id first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_only_start_dropped_midway_is_adopted_on_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let extra = "[limits]\nmemory-mib = 64\n[grants]\nkv = true\n[config]\nanswer-delay-ms = 60000\n";
    let manifest = write_manifest(dir.path(), "fake", "fake", extra);
    {
        let broker = Arc::new(Broker::open(&data).unwrap());
        broker.registry().add(&manifest).await.unwrap();
        let starting = broker.clone();
        let call =
            tokio::spawn(async move { starting.start_instance("fake", &empty_params(), &CallHooks::default()).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(broker.store().interrupted_starts("fake").unwrap().is_empty());
        call.abort();
        let _ = call.await;
    }
    let broker = Broker::open(&data).unwrap();
    assert_eq!(broker.store().interrupted_starts("fake").unwrap().len(), 1);
    let found = only(broker.reconcile_after_restart(HarvestMode::Destroyed).await).await;
    assert_eq!(found.adopted, ["fake-0"], "{found:?}");
    assert!(found.unknown_to_host.is_empty(), "{found:?}");
}

/// Two recorded instances; a stop of both marked, then the host "killed"
/// after the provider stopped only `stopped` of them (or none).
async fn killed_mid_stop(data: &Path, manifest: &Path, provider_stopped_first: bool) -> (String, String) {
    let broker = Broker::open(data).unwrap();
    broker.registry().add(manifest).await.unwrap();
    let hooks = CallHooks::default();
    let a = broker.start_instance("fake", &empty_params(), &hooks).await.unwrap().id;
    let b = broker.start_instance("fake", &empty_params(), &hooks).await.unwrap().id;
    broker.store().mark_stopping("fake", &[a.clone(), b.clone()]).await.unwrap();
    if provider_stopped_first {
        let wasm = broker.registry().get("fake").await.unwrap();
        wasm.stop_instances(&hooks, std::slice::from_ref(&a)).await.unwrap();
    }
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_killed_midway_is_finished_on_restart_per_harvest_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = outside_fake(dir.path(), "");
    let (a, b) = killed_mid_stop(&data, &manifest, true).await;

    // `none` stops nothing; the record whose instance is gone still goes.
    let broker = Broker::open(&data).unwrap();
    let found = only(broker.reconcile_after_restart(HarvestMode::None).await).await;
    assert_eq!(found.stops_finished, [a.as_str()], "{found:?}");
    assert!(found.vanished.is_empty(), "{found:?}");
    // What a stop is ending is not maintained: no "not found" for the one the provider already stopped.
    assert!(found.maintain_failed.is_empty() && found.maintained.is_empty(), "{found:?}");
    assert!(
        found.unresolved.iter().any(|u| u.contains("left stopping (harvest mode none)") && u.contains(&b)),
        "{found:?}"
    );
    let listed: Vec<String> = broker.list_instances(Some("fake")).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(listed, [b.as_str()]);
    drop(broker);

    // The default finishes it.
    let broker = Broker::open(&data).unwrap();
    let found = only(broker.reconcile_after_restart(HarvestMode::default()).await).await;
    assert_eq!(found.stops_finished, [b.as_str()], "{found:?}");
    assert!(found.unknown_to_host.is_empty(), "stopped now, so nobody's: {found:?}");
    assert!(broker.list_instances(Some("fake")).await.unwrap().is_empty());
    assert!(broker.store().interrupted_stops("fake").unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harvest_unknown_stops_unrecorded_instances_and_starts_wait_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let manifest = outside_fake(dir.path(), "");
    let stray = {
        let broker = Broker::open(&data).unwrap();
        broker.registry().add(&manifest).await.unwrap();
        // Made behind the host's back: no record claims it.
        let wasm = broker.registry().get("fake").await.unwrap();
        wasm.start_instance(&CallHooks::default(), &empty_params()).await.unwrap().instance.id
    };

    // The default reports it and leaves it running.
    let broker = Arc::new(Broker::open(&data).unwrap());
    let found = only(broker.reconcile_after_restart(HarvestMode::Destroyed).await).await;
    assert_eq!((found.unknown_to_host.clone(), found.harvested.clone()), (vec![stray.clone()], vec![]), "{found:?}");

    // `unknown` stops it, and a start asked meanwhile waits for the harvest.
    broker.hold_starts_for_harvest(HarvestMode::Unknown);
    let starting = broker.clone();
    let start =
        tokio::spawn(async move { starting.start_instance("fake", &empty_params(), &CallHooks::default()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!start.is_finished(), "a start ran before the harvest");
    let found = only(broker.reconcile_after_restart(HarvestMode::Unknown).await).await;
    assert_eq!(found.harvested, [stray.as_str()], "{found:?}");
    assert!(found.unknown_to_host.is_empty(), "{found:?}");
    let started = start.await.unwrap().unwrap();
    let listed: Vec<String> = broker.list_instances(Some("fake")).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(listed, [started.id], "the stray is stopped; the start that waited is not");
}

/// The hostile provider, acting outside the store, claiming `claims` in order
/// and returning `returned`.
async fn hostile_start(broker: &Broker, claims: &[&str], returned: &str) -> Result<String, String> {
    let kv = broker.store().kv();
    kv.set("hostile", "claims", claims.join("\0").as_bytes()).unwrap();
    kv.set("hostile", "start-id", returned.as_bytes()).unwrap();
    let started = broker.start_instance("hostile", &empty_params(), &CallHooks::default()).await;
    started.map(|r| r.id).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_claims_are_refused_and_leave_nothing_pending() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let broker = Broker::open(&data).unwrap();
    broker.registry().add(&outside_fake(dir.path(), "")).await.unwrap();
    let fakes = broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap().id;
    let extra = "[limits]\nmemory-mib = 32\n[grants]\nkv = true\nlocal-sockets = true\n";
    broker.registry().add(&write_manifest(dir.path(), "hostile", "test_hostile", extra)).await.unwrap();

    let long = "x".repeat(256);
    let refusals = [
        (vec!["a\nb"], "control character"),
        (vec![""], "it is empty"),
        (vec![long.as_str()], "256 bytes long"),
        (vec!["one", "two"], "already claimed \"one\""),
        (vec![fakes.as_str()], "recorded for provider fake"),
    ];
    for (claims, why) in refusals {
        let err = hostile_start(&broker, &claims, "h-0").await.expect_err("a bad claim fails the start");
        assert!(err.contains("claim-instance-id") && err.contains(why), "{claims:?}: {err}");
    }
    // The same id twice is one claim; another id returned than claimed is recorded as returned.
    assert_eq!(hostile_start(&broker, &["h-1", "h-1"], "h-1").await.unwrap(), "h-1");
    assert_eq!(hostile_start(&broker, &["h-2"], "h-3").await.unwrap(), "h-3");
    // A claim of its own recorded instance's id is refused as well, before the guest goes on.
    let err = hostile_start(&broker, &["h-1"], "h-4").await.expect_err("a recorded id is not claimed again");
    assert!(err.contains("claim-instance-id") && err.contains("already recorded as one of this provider's"), "{err}");
    drop(broker);
    let broker = Broker::open(&data).unwrap();
    assert!(broker.store().interrupted_starts("hostile").unwrap().is_empty(), "every refused start was forgotten");
    assert_eq!(broker.store().owner_of(&fakes).unwrap().as_deref(), Some("fake"));
}

/// A start cut off (here by its deadline) after claiming an id is stopped by
/// that id: its provider, kv-only or not, may have made something by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_cut_off_after_its_claim_is_stopped_by_the_claimed_id() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let extra = "[limits]\nmemory-mib = 32\n[limits.deadlines]\ndefault = \"1s\"\nstart-instance = \"1s\"\n[grants]\nkv = true\n";
    broker.registry().add(&write_manifest(dir.path(), "hostile", "test_hostile", extra)).await.unwrap();
    broker.store().kv().set("hostile", "after-claims", b"spin").unwrap();
    let err = hostile_start(&broker, &["h-cut"], "h-cut").await.expect_err("the deadline ends it");
    assert!(err.contains("deadline"), "{err}");
    let stopped = broker.store().kv().get("hostile", "stopped").unwrap().unwrap_or_default();
    assert_eq!(stopped, b"h-cut\0", "the claimed id was stopped");
}
