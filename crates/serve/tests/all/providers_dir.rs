//! The providers directory a daemon watches, rescanned by hand on a real
//! broker: drop-in, swap, reload, pin, garbage, removal and its drain.

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::KvBackend;
use broker_capabilities::rooms::process::Process;
use broker_core::broker::Broker;
use broker_core::providers::watch::{Change, ProvidersDir};
use broker_core::store::EventKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A provider as someone would drop it in: `DIR/fake/provider.toml` beside `fake.wasm`.
struct DropIn {
    dir: PathBuf,
}

impl DropIn {
    fn new(providers: &Path) -> DropIn {
        let dir = providers.join("fake");
        std::fs::create_dir_all(&dir).unwrap();
        DropIn { dir }
    }

    fn manifest(&self) -> PathBuf {
        self.dir.join("provider.toml")
    }

    fn write_manifest(&self, extra_top: &str, extra_config: &str) {
        let text = format!(
            "name = \"fake\"\ncomponent = \"fake.wasm\"\n{extra_top}\n[limits]\nmemory-mib = 64\n\
             [grants]\nkv = true\nlog = true\n[config]\nzones = [\"zone-a\"]\n{extra_config}\n"
        );
        replace_file(&self.manifest(), text.as_bytes());
    }

    fn write_component(&self, crate_name: &str) {
        replace_file(&self.dir.join("fake.wasm"), &std::fs::read(guest_artifacts::wasm(crate_name)).unwrap());
    }
}

/// Write beside, then rename into place, as a careful deployer does.
fn replace_file(path: &Path, bytes: &[u8]) {
    let staging = path.with_file_name(format!(".{}.tmp", path.file_name().unwrap().to_string_lossy()));
    std::fs::write(&staging, bytes).unwrap();
    std::fs::rename(&staging, path).unwrap();
}

async fn version(broker: &Broker) -> String {
    broker.registry().get("fake").await.unwrap().describe().await.unwrap().version
}

fn event_kinds(broker: &Broker) -> Vec<String> {
    broker.store().events(0, 100).unwrap().into_iter().map(|e| e.kind.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn drop_in_swap_reload_and_removal_follow_the_directory() {
    let data = tempfile::tempdir().unwrap();
    let broker = Broker::open(data.path()).unwrap();
    let mut watched = ProvidersDir::new(&data.path().join("providers")).unwrap();
    let fake = DropIn::new(watched.dir());
    assert_eq!(watched.rescan(broker.registry()).await, []);

    // The component first: a manifest without it is refused once, then added when it lands.
    fake.write_manifest("", "");
    let changes = watched.rescan(broker.registry()).await;
    assert!(
        matches!(&changes[..], [Change::Refused(name, why)] if name == "fake" && why.contains("fake.wasm")),
        "{changes:?}"
    );
    assert_eq!(watched.rescan(broker.registry()).await, [], "an unchanged refusal is not repeated");
    fake.write_component("fake");
    assert_eq!(watched.rescan(broker.registry()).await, [Change::Added("fake".into())]);
    assert_eq!(watched.rescan(broker.registry()).await, []);
    let started = broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();

    // A new component: swapped in, and it sees the instance the old one started.
    fake.write_component("fake_next");
    assert_eq!(watched.rescan(broker.registry()).await, [Change::Swapped("fake".into())]);
    assert_eq!(version(&broker).await, "0.2.0");
    let listed = broker.list_instances(Some("fake")).await.unwrap();
    assert_eq!(listed.iter().map(|r| &r.id).collect::<Vec<_>>(), [&started.id]);

    // A changed manifest (its config) is reloaded from the manifest.
    fake.write_manifest("", "prefix = \"other\"");
    assert_eq!(watched.rescan(broker.registry()).await, [Change::Reloaded("fake".into())]);
    let next = broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
    assert!(next.id.starts_with("other-"), "the reloaded config is the one used: {}", next.id);

    // A pin the component does not match: refused, the serving version stays.
    fake.write_manifest(&format!("sha256 = \"{}\"", "0".repeat(64)), "prefix = \"other\"");
    let changes = watched.rescan(broker.registry()).await;
    assert!(
        matches!(&changes[..], [Change::Refused(_, why)] if why.contains("does not match the manifest's sha256 pin")),
        "{changes:?}"
    );
    assert_eq!(version(&broker).await, "0.2.0");

    // Garbage beside it: refused by path, the rest untouched.
    std::fs::write(watched.dir().join("broken.toml"), "name = [").unwrap();
    let changes = watched.rescan(broker.registry()).await;
    assert!(matches!(&changes[..], [Change::Refused(path, _)] if path.ends_with("broken.toml")), "{changes:?}");

    // The manifest removed while instances are recorded: refused once, retried, done once they are stopped.
    std::fs::remove_file(fake.manifest()).unwrap();
    let changes = watched.rescan(broker.registry()).await;
    assert!(matches!(&changes[..], [Change::Refused(_, why)] if why.contains("2 recorded instance(s)")), "{changes:?}");
    assert_eq!(watched.rescan(broker.registry()).await, []);
    broker.stop_instances("fake", &[started.id.clone(), next.id.clone()]).await.unwrap();
    assert_eq!(watched.rescan(broker.registry()).await, [Change::Removed("fake".into())]);
    assert!(broker.registry().list().unwrap().is_empty());

    let kinds = event_kinds(&broker);
    let expected = ["watch-refused", "added", "swapped", "reloaded", "watch-refused", "watch-refused"];
    assert_eq!(kinds[..6], expected, "{kinds:?}");
    assert_eq!(kinds[6..], ["remove-refused", "removed"], "{kinds:?}");
}

/// A broker whose fake (starts take 1.5 s) was added from its providers directory.
async fn slow_fake_from_a_directory() -> (tempfile::TempDir, std::sync::Arc<Broker>, ProvidersDir, DropIn) {
    let data = tempfile::tempdir().unwrap();
    let broker = std::sync::Arc::new(Broker::open(data.path()).unwrap());
    let mut watched = ProvidersDir::new(&data.path().join("providers")).unwrap();
    let fake = DropIn::new(watched.dir());
    fake.write_component("fake");
    fake.write_manifest("", "start-delay-ms = 1500");
    assert_eq!(watched.rescan(broker.registry()).await, [Change::Added("fake".into())]);
    (data, broker, watched, fake)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_removal_waits_for_calls_in_flight_and_refuses_new_ones() {
    let (_data, broker, mut watched, fake) = slow_fake_from_a_directory().await;

    // A slow start in flight when the manifest goes.
    let starting = broker.clone();
    let slow =
        tokio::spawn(async move { starting.start_instance("fake", &empty_params(), &CallHooks::default()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::remove_file(fake.manifest()).unwrap();
    let removing = tokio::spawn({
        let broker = broker.clone();
        async move { watched.rescan(broker.registry()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile the provider takes no new call.
    let refused = broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap_err();
    assert!(refused.to_string().contains("is being removed"), "{refused}");
    let record = slow.await.unwrap().expect("the start in flight completes");
    let changes = removing.await.unwrap();
    // It recorded an instance as it finished, so the provider stays: nothing is orphaned.
    assert!(matches!(&changes[..], [Change::Refused(_, why)] if why.contains("1 recorded instance(s)")), "{changes:?}");
    assert_eq!(broker.registry().list().unwrap().len(), 1);
    let listed = broker.list_instances(Some("fake")).await.unwrap();
    assert_eq!(listed.iter().map(|r| &r.id).collect::<Vec<_>>(), [&record.id]);
}

#[tokio::test(flavor = "multi_thread")]
async fn while_a_removal_drains_new_calls_are_refused_and_then_it_is_gone() {
    let (_data, broker, mut watched, fake) = slow_fake_from_a_directory().await;
    // A call holds its version for its whole length; hold it the same way, then let go.
    let held = broker.registry().get("fake").await.unwrap();
    let manifest = std::fs::read(fake.manifest()).unwrap();
    std::fs::remove_file(fake.manifest()).unwrap();
    let removing = tokio::spawn({
        let broker = broker.clone();
        async move { watched.rescan(broker.registry()).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = broker.list_instances(Some("fake")).await.unwrap_err().to_string();
    assert!(refused.contains("is being removed"), "{refused}");
    assert!(broker.list_instances(None).await.unwrap().is_empty(), "listing all skips a provider being removed");
    assert!(!removing.is_finished(), "the removal waits while the version is in use");
    // Put back meanwhile, it is not added again under the removal's feet.
    std::fs::write(fake.manifest(), &manifest).unwrap();
    let re_added = broker.registry().add(&fake.manifest()).await.unwrap_err().to_string();
    assert!(re_added.contains("is being removed"), "{re_added}");
    std::fs::remove_file(fake.manifest()).unwrap();
    drop(held);
    assert_eq!(removing.await.unwrap(), [Change::Removed("fake".into())]);
    let removed = broker.store().events(0, 100).unwrap().into_iter().find(|e| e.kind == EventKind::Removed).unwrap();
    assert_eq!(removed.detail, "after 1 call(s) in flight finished");
}

/// Attack 1 of the sandbox issue: a provider with no grants writes a manifest
/// granting `sh` (and a component) into its data dir, and one deployed as
/// `providers/NAME/provider.toml` tries to rewrite its own manifest. Neither
/// is loaded: data dirs live apart from the providers directory, nothing under
/// them is loadable, and the watcher never applies a widened grant.
#[tokio::test(flavor = "multi_thread")]
async fn a_provider_cannot_register_or_widen_itself_through_its_data_dir() {
    let data = tempfile::tempdir().unwrap();
    let broker = Broker::open(data.path()).unwrap();
    let providers = data.path().join("providers");
    let deployed = providers.join("hostile");
    std::fs::create_dir_all(&deployed).unwrap();
    let manifest = deployed.join("provider.toml");
    let text = format!(
        "name = \"hostile\"\ncomponent = \"{}\"\n[grants]\nkv = true\n",
        guest_artifacts::wasm("test_hostile").display()
    );
    std::fs::write(&manifest, &text).unwrap();
    let mut watched = ProvidersDir::new(&providers).unwrap();
    assert_eq!(watched.rescan(broker.registry()).await, vec![Change::Added("hostile".into())]);

    broker.store().kv().set("hostile", "mode", b"drop-in").unwrap();
    let hooks = CallHooks::default();
    let hostile = broker.registry().get("hostile").await.unwrap();
    assert_eq!(hostile.all_instances(&hooks).await.unwrap()[0].id, "dropped");
    let data_dir = hostile.data_dir().to_owned();
    assert_eq!(data_dir, data.path().join("data/hostile"));
    assert!(data_dir.join("provider.toml").exists(), "the guest wrote its data dir");
    assert_eq!(std::fs::read_to_string(&manifest).unwrap(), text, "its deployed manifest is untouched");

    // The watcher sees nothing new; asked directly, the host refuses to load from a data dir.
    assert_eq!(watched.rescan(broker.registry()).await, vec![]);
    assert_eq!(broker.registry().list().unwrap().len(), 1);
    for planted in [data_dir.join("provider.toml"), data_dir.join("evil/provider.toml")] {
        let err = broker.registry().add(&planted).await.unwrap_err().to_string();
        assert!(err.contains("data dirs"), "{err}");
    }
    let err = broker.registry().swap("hostile", &data_dir.join("evil.wasm"), None).await.unwrap_err().to_string();
    assert!(err.contains("data dirs"), "{err}");

    // Widening the deployed manifest (as anyone but the operator's `provider add`
    // might) is refused by the watcher and by a restart; narrowing applies.
    std::fs::write(&manifest, format!("{text}process = [\"sh\"]\n")).unwrap();
    let changes = watched.rescan(broker.registry()).await;
    assert!(
        matches!(&changes[..], [Change::Refused(name, reason)] if name == "hostile" && reason.contains("process \"sh\"")),
        "{changes:?}"
    );
    assert!(broker.registry().get("hostile").await.unwrap().manifest().grants.rooms.of::<Process>().process.is_empty());
    drop(hostile);
    drop(broker);
    let broker = Broker::open(data.path()).unwrap();
    let err = broker.registry().get("hostile").await.err().unwrap().to_string();
    assert!(err.contains("not approved") && err.contains("process \"sh\""), "{err}");
    // The operator approves it explicitly.
    broker.registry().add(&manifest).await.unwrap();
    assert_eq!(
        broker.registry().get("hostile").await.unwrap().manifest().grants.rooms.of::<Process>().process,
        vec!["sh".to_string()]
    );
    // Loosening a bound is the operator's to approve too: data-mib 0 lifts the data dir's.
    std::fs::write(&manifest, format!("{text}process = [\"sh\"]\n[limits]\ndata-mib = 0\n")).unwrap();
    let changes = watched.rescan(broker.registry()).await;
    assert!(
        matches!(&changes[..], [Change::Refused(_, reason)] if reason.contains("limits.data-mib = 0 (unbounded) (approved 1024)")),
        "{changes:?}"
    );
}

/// Data dirs of a host from before: `providers/NAME` held both the manifest
/// and the provider's files. On open, the files move to `data/NAME`; the
/// manifest and component stay.
#[tokio::test(flavor = "multi_thread")]
async fn old_data_dirs_move_out_of_the_providers_directory() {
    let data = tempfile::tempdir().unwrap();
    let old = data.path().join("providers/fake");
    let drop_in = DropIn::new(&data.path().join("providers"));
    drop_in.write_manifest("", "");
    drop_in.write_component("fake");
    {
        let broker = Broker::open(data.path()).unwrap();
        broker.registry().add(&drop_in.manifest()).await.unwrap();
        // A record from before grants were pinned.
        let mut record = broker.store().provider("fake").unwrap().unwrap();
        record.approved_manifest = None;
        let downgraded = broker_core::store::Event::new(EventKind::Other("downgraded-by-the-test".into()), "fake");
        broker.store().put_provider(&record, &downgraded).await.unwrap();
    }
    // As a host from before left it: no data/fake, the files beside the manifest.
    std::fs::remove_dir_all(data.path().join("data/fake")).unwrap();
    std::fs::create_dir_all(old.join("vm/x")).unwrap();
    std::fs::write(old.join("vm/x/disk"), "disk").unwrap();
    let broker = Broker::open(data.path()).unwrap();
    assert_eq!(std::fs::read_to_string(data.path().join("data/fake/vm/x/disk")).unwrap(), "disk");
    assert!(!old.join("vm").exists());
    assert!(drop_in.manifest().exists() && old.join("fake.wasm").exists());
    assert!(event_kinds(&broker).contains(&"data-dir-moved".to_string()));
    assert_eq!(version(&broker).await, "0.1.0");
    // The manifest as the upgraded host first found it is what a widening is measured against.
    let pinned = broker.store().provider("fake").unwrap().unwrap().approved_manifest;
    assert_eq!(pinned.as_deref(), Some(std::fs::read_to_string(drop_in.manifest()).unwrap().as_str()));
    let events = broker.store().events(0, 100).unwrap();
    let note = events.iter().find(|e| e.kind == EventKind::ApprovedManifestPinned).expect("the operator is told");
    assert!(note.detail.contains("review its [grants]"), "{}", note.detail);
}

/// Holding a version without using it (a `/metrics` scrape, a retired
/// version's counters) is not a call in flight: a removal does not wait for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_version_held_but_not_in_use_does_not_delay_a_removal() {
    let (_data, broker, mut watched, fake) = slow_fake_from_a_directory().await;
    let held = broker.registry().get("fake").await.unwrap().version().clone();
    assert_eq!(held.in_flight(), 0, "the use ended with the call");
    std::fs::remove_file(fake.manifest()).unwrap();
    assert_eq!(watched.rescan(broker.registry()).await, [Change::Removed("fake".into())]);
    let removed = broker.store().events(0, 100).unwrap().into_iter().find(|e| e.kind == EventKind::Removed).unwrap();
    assert_eq!(removed.detail, "", "no call was in flight");
    drop(held);
}

/// A reload racing the first loads of a freshly opened host, round after
/// round. With the loaded map and the draining set locked in opposite orders
/// by `add` and `get` (and a store commit under one of them), two workers
/// could each wait for the other for ever; a watchdog thread tells.
#[test]
fn a_reload_racing_first_loads_never_deadlocks() {
    const ROUNDS: usize = 25;
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
        runtime.block_on(async {
            let data = tempfile::tempdir().unwrap();
            let drop_in = DropIn::new(&data.path().join("providers"));
            drop_in.write_manifest("", "");
            drop_in.write_component("fake");
            Broker::open(data.path()).unwrap().registry().add(&drop_in.manifest()).await.unwrap();
            for round in 0..ROUNDS {
                // Nothing loaded yet: every get below loads, and the add reloads.
                let broker = std::sync::Arc::new(Broker::open(data.path()).unwrap());
                let mut calls = Vec::new();
                for n in 0..4 {
                    let broker = broker.clone();
                    calls.push(tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(n * 3)).await;
                        broker.registry().get("fake").await.map(drop).map_err(|e| e.to_string())
                    }));
                }
                let reload = broker.clone();
                let manifest = drop_in.manifest();
                calls.push(tokio::spawn(async move {
                    reload.registry().add(&manifest).await.map(drop).map_err(|e| e.to_string())
                }));
                for call in calls {
                    call.await.unwrap().unwrap_or_else(|e| panic!("round {round}: {e}"));
                }
            }
        });
        let _ = done.send(());
    });
    let outcome = finished.recv_timeout(Duration::from_secs(300));
    assert!(outcome.is_ok(), "a reload and first loads deadlocked (or a round panicked: see above)");
}
