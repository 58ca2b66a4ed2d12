//! How listing, lookup and the start-up reconcile scale with the records a
//! host keeps (issue 17, "Scale of the state"): the fake provider through the
//! host with 0, 1,000 and 10,000 recorded instances.
//!
//! - `list/N`: `Broker::list_instances` of all providers (the provider's
//!   `all-instances`, joined with the records), what `GET /v1/instances` answers;
//! - `provider_of/N`: the owner of one id (what stop and maintain look up);
//! - `all_instances_call/10000`, `records_read/10000`: the two halves of a
//!   listing, the provider's answer and the host's records;
//! - `reconcile/10000`: `maintain-instance` of every record, then the
//!   provider's answer compared with the records.
//!
//! cargo bench -p broker-tests --bench list_scale

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_tests::bundled_manifest_text;
use criterion::{BenchmarkId, Criterion, criterion_group};
use std::sync::Arc;

/// A host with the fake provider and `instances` of its instances recorded.
fn host(dir: &std::path::Path, runtime: &tokio::runtime::Runtime, instances: usize) -> Arc<Broker> {
    let manifest = dir.join("fake.toml");
    let text =
        bundled_manifest_text("fake").replace("[limits]\n", "[limits]\nmax-records = 20000\nkv-keys = 1000000\n");
    std::fs::write(&manifest, text).unwrap();
    let broker = Arc::new(Broker::open(&dir.join("host")).unwrap());
    runtime.block_on(async {
        broker.registry().add(&manifest).await.unwrap();
        let callers: Vec<_> = (0..16)
            .map(|caller| {
                let broker = broker.clone();
                tokio::spawn(async move {
                    for _ in (caller..instances).step_by(16) {
                        broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.await.unwrap();
        }
    });
    broker
}

fn list_scale(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut group = c.benchmark_group("state_scale");
    group.sample_size(20);
    let mut largest = None;
    for instances in [0, 1_000, 10_000] {
        let dir = tempfile::tempdir().unwrap();
        let broker = host(dir.path(), &runtime, instances);
        let listed = runtime.block_on(broker.list_instances(None)).unwrap();
        assert_eq!(listed.len(), instances);
        group.bench_with_input(BenchmarkId::new("list", instances), &instances, |b, _| {
            b.iter(|| runtime.block_on(broker.list_instances(None)).unwrap())
        });
        if instances == 10_000 {
            // Where a listing's time goes: the provider's answer, and the records read.
            let fake = runtime.block_on(broker.registry().get("fake")).unwrap();
            group.bench_function("all_instances_call/10000", |b| {
                b.iter(|| runtime.block_on(fake.all_instances(&CallHooks::default())).unwrap())
            });
            group.bench_function("records_read/10000", |b| b.iter(|| broker.store().instances(Some("fake")).unwrap()));
            // One record's JSON decoded whole, and without its start params
            // (what a listing reads since they are skipped: 'records_read').
            let mut record = broker.store().instance("fake", "fake-0").unwrap().unwrap();
            let with = serde_json::to_vec(&record).unwrap();
            record.params = None;
            let without = serde_json::to_vec(&record).unwrap();
            eprintln!("one record: {} bytes of JSON with its params, {} without", with.len(), without.len());
            for (name, bytes) in [("record_decode/with_params", with), ("record_decode/without_params", without)] {
                group.bench_function(name, |b| {
                    b.iter(|| serde_json::from_slice::<broker_core::store::InstanceRecord>(&bytes).unwrap())
                });
            }
        }
        if instances > 0 {
            let id = format!("fake-{}", instances / 2);
            group.bench_with_input(BenchmarkId::new("provider_of", instances), &instances, |b, _| {
                b.iter(|| broker.provider_of(&id).unwrap())
            });
        }
        largest = Some((dir, broker));
    }
    group.finish();

    let (_dir, broker) = largest.unwrap();
    let mut group = c.benchmark_group("state_scale");
    group.sample_size(10);
    group.bench_function("reconcile/10000", |b| {
        b.iter(|| {
            let found = runtime.block_on(broker.reconcile());
            let summary = found[0].summary();
            assert!(summary.starts_with("maintained 10000") && found[0].maintain_failed.is_empty(), "{summary}");
        })
    });
    group.finish();
}

criterion_group!(benches, list_scale);
