//! Contract versions: every published version is served at once. The fake's
//! own source built against 0.1.0 and 0.2.0 as published (`guests/fake-v0-1`,
//! `guests/fake-v0-2`: components of before 0.2.0 and 0.3.0) loads and runs
//! beside the current build, through the host and the kit; the published WIT
//! never changes.

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_core::conformance;
use broker_core::manifest::Manifest;
use broker_tests::{fake_manifest_extra, wasm, write_manifest};
use sha2::{Digest, Sha256};
use std::path::Path;

/// Each published version's WIT, as published: its files' text, in name
/// order (0.1.0 as of commit 9ca255a, 0.2.0 as of 59cf747).
const PUBLISHED: &[(&str, &str)] = &[
    ("0.1.0", "20fe9292efbfc718b32a3a0c59ced692c8e48ac76c7e47b2fa56844f264391e3"),
    ("0.2.0", "6b9a2954ad0c640175a11e440bbeaf50bb25ddef0a549748a3318047e89940c0"),
];

#[test]
fn a_published_wit_never_changes() {
    for (version, published) in PUBLISHED {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../wit").join(version);
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().path()).collect();
        files.sort();
        let mut hasher = Sha256::new();
        for file in &files {
            hasher.update(std::fs::read(file).unwrap());
        }
        assert_eq!(
            hex::encode(hasher.finalize()),
            *published,
            "wit/{version} is contract {version} as published: a change goes in a new version"
        );
    }
    // Every version served is kept, and the newest is what wit/ is.
    let served = broker_capabilities::bindings::SERVED_VERSIONS;
    assert_eq!(served[0], broker_capabilities::bindings::CONTRACT_VERSION);
    assert_eq!(&served[1..], PUBLISHED.iter().rev().map(|(version, _)| *version).collect::<Vec<_>>());
}

/// Past the host's page of 1000 instances, a 0.3.0 provider answers in pages
/// (the fake from its kv, a page at a time) and a 0.2.0 one at once: the host
/// lists both whole, and pages through both alike, each instance once; the
/// 0.3.0 listing says what each instance got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_past_one_page_is_whole_and_paged_alike_for_every_version() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let hooks = CallHooks::default();
    for (name, guest) in [("fake", "fake"), ("older", "fake_v0_2")] {
        let extra = format!("{}prefix = \"{name}\"\n", fake_manifest_extra("pooled"));
        broker.registry().add(&write_manifest(dir.path(), name, guest, &extra)).await.unwrap();
        let params = empty_params();
        let starts = (0..1100).map(|_| broker.start_instance(name, &params, &hooks));
        let mut started: Vec<String> =
            futures_util::future::try_join_all(starts).await.unwrap().into_iter().map(|record| record.id).collect();
        started.sort();

        let wasm = broker.registry().get(name).await.unwrap();
        let whole = wasm.listed_instances(&hooks).await.unwrap();
        let mut ids: Vec<String> = whole.iter().map(|listed| listed.instance.id.clone()).collect();
        ids.sort();
        assert_eq!(ids, started, "{name}: every instance once");
        let described = whole.iter().filter(|listed| listed.hardware.is_some()).count();
        assert_eq!(described, if name == "fake" { 1100 } else { 0 }, "{name}: 0.2.0 lists no hardware");

        let (mut paged, mut cursor, mut pages) = (Vec::new(), None, 0);
        loop {
            let page = wasm.instances_page(&hooks, cursor, 400).await.unwrap();
            assert!(page.instances.len() <= 400, "{name}");
            paged.extend(page.instances.into_iter().map(|listed| listed.instance.id));
            pages += 1;
            match page.next {
                None => break,
                next => cursor = next,
            }
        }
        paged.sort();
        assert_eq!((paged, pages), (started, 3), "{name}: 400 + 400 + 300");
    }
}

/// A build imports and exports its version only: it is what it stands for.
fn contract_names(engine: &wasmtime::Engine, path: &Path) -> Vec<String> {
    let component = wasmtime::component::Component::from_file(engine, path).unwrap();
    let ty = component.component_type();
    let imports = ty.imports(engine).map(|(name, _)| name.to_owned());
    let exports = ty.exports(engine).map(|(name, _)| name.to_owned());
    imports.chain(exports).filter(|name| name.starts_with("broker:provider/")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn components_built_against_0_1_0_and_0_2_0_run_beside_a_0_3_0_build() {
    let engine = wasmtime::Engine::default();
    for (guest, version) in [("fake_v0_1", "0.1.0"), ("fake_v0_2", "0.2.0"), ("fake", "0.3.0")] {
        let names = contract_names(&engine, &wasm(guest));
        assert!(names.iter().any(|n| *n == format!("broker:provider/kv@{version}")), "{names:?}");
        assert!(names.iter().any(|n| *n == format!("broker:provider/instance-broker@{version}")), "{names:?}");
        assert!(names.iter().all(|n| n.ends_with(&format!("@{version}"))), "{guest}: {names:?}");
    }

    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(&dir.path().join("data")).unwrap();
    let extra = fake_manifest_extra("pooled");
    let builds = [("fake", "fake"), ("older", "fake_v0_2"), ("oldest", "fake_v0_1")];
    for (name, guest) in builds {
        broker.registry().add(&write_manifest(dir.path(), name, guest, &extra)).await.unwrap();
    }
    let hooks = CallHooks::default();
    for (name, _) in builds {
        let started = broker.start_instance(name, &empty_params(), &hooks).await.unwrap();
        let listed = broker.list_instances(Some(name)).await.unwrap();
        assert!(listed.iter().any(|r| r.id == started.id && r.status == "running"), "{name}: {listed:?}");
        let wasm = broker.registry().get(name).await.unwrap();
        let first = wasm.instances_page(&hooks, None, 1).await.unwrap();
        assert_eq!(first.instances.len(), 1, "{name}");
        assert!(first.next.is_none(), "{name}: one instance, one page");
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
