//! How listing, lookup and the start-up reconcile scale with the records a
//! host keeps (issues 17 and 40): the fake provider through the host with
//! 0, 10,000 and 100,000 recorded instances (`STATE_SCALE=0,10000,1000000`
//! picks others; criterion's test mode, as CI runs it, takes 0 and 1,000).
//!
//! - `page/N`: one page of 100 of the listing of all (`GET
//!   /v1/instances?limit=100`), the first and one from the middle;
//! - `full_listing/N`: the whole listing read a page of 1,000 at a time, as
//!   the API streams it;
//! - `list/N`: `Broker::list_instances`, the whole listing in one answer (the
//!   CLI's, the groups'), at up to 100,000;
//! - `provider_of/N`: the owner of one id (what stop and maintain look up);
//! - `reconcile/N` at the largest N: `maintain-instance` of every record, then
//!   the provider's answer compared with the records;
//! - and, printed: the host's RSS grown per record by the starts (the records,
//!   the fake's kv and its mirror), and after a full listing.
//!
//! cargo bench -p broker-tests --bench all -- state_scale

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::listing::ProviderAt;
use broker_core::broker::{Broker, ListCursor};
use broker_tests::bundled_manifest_text;
use criterion::{BenchmarkId, Criterion, criterion_group};
use std::sync::Arc;

/// A host with the fake provider loaded, none of its instances started.
fn host(dir: &std::path::Path, runtime: &tokio::runtime::Runtime) -> Arc<Broker> {
    let manifest = dir.join("fake.toml");
    let limits = "[limits]\nmax-records = 2000000\nkv-keys = 3000000\nkv-mib = 1024\n";
    let text = bundled_manifest_text("fake").replace("[limits]\n", limits);
    std::fs::write(&manifest, text).unwrap();
    let broker = Arc::new(Broker::open(&dir.join("host")).unwrap());
    runtime.block_on(broker.registry().add(&manifest)).unwrap();
    // Warm: the first call's instance is not a record's cost.
    runtime.block_on(broker.instances_page(None, None, 1)).unwrap();
    broker
}

/// `instances` of the fake's started as a client starts them (16 at once,
/// each durable before its answer).
fn start(broker: &Arc<Broker>, runtime: &tokio::runtime::Runtime, instances: usize) {
    runtime.block_on(async {
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
}

/// The sizes to measure: `STATE_SCALE`, or by mode.
fn sizes() -> Vec<usize> {
    if let Ok(sizes) = std::env::var("STATE_SCALE") {
        return sizes.split(',').map(|n| n.trim().parse().expect("STATE_SCALE: numbers, comma-separated")).collect();
    }
    // Criterion runs a benchmark only with `--bench`; without it (`cargo test --benches`) once each.
    if std::env::args().any(|arg| arg == "--bench") { vec![0, 10_000, 100_000] } else { vec![0, 1_000] }
}

/// This process's resident set, in bytes.
fn rss_bytes() -> usize {
    broker_tests::rss_kib(std::process::id() as i32) as usize * 1024
}

/// The whole listing, a page of 1,000 at a time (as `GET /v1/instances` streams it): how many.
async fn full_listing(broker: &Broker) -> usize {
    let (mut count, mut from) = (0, None);
    loop {
        let page = broker.instances_page(None, from, 1000).await.unwrap();
        count += page.records.len();
        match page.next {
            None => return count,
            next => from = next,
        }
    }
}

fn list_scale(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut group = c.benchmark_group("state_scale");
    group.sample_size(20);
    let mut largest = None;
    for instances in sizes() {
        let dir = tempfile::tempdir().unwrap();
        let broker = host(dir.path(), &runtime);
        let before = rss_bytes();
        let seeding = std::time::Instant::now();
        start(&broker, &runtime, instances);
        let seeded = seeding.elapsed();
        let grown = rss_bytes().saturating_sub(before);
        assert_eq!(runtime.block_on(full_listing(&broker)), instances);
        let after_listing = rss_bytes().saturating_sub(before);
        if instances > 0 {
            eprintln!(
                "state_scale {instances}: seeded in {seeded:.1?} ({:.0}/s); RSS grown {} KiB ({} B per record), {} KiB after a full listing",
                instances as f64 / seeded.as_secs_f64(),
                grown >> 10,
                grown / instances,
                after_listing >> 10,
            );
        }
        group.bench_with_input(BenchmarkId::new("page/first", instances), &instances, |b, _| {
            b.iter(|| runtime.block_on(broker.instances_page(None, None, 100)).unwrap())
        });
        if instances > 0 {
            // From the middle: the cursor a page ending at the middle id hands out.
            let id = format!("fake-{}", instances / 2);
            let at = ProviderAt::Next { cursor: format!("instance/{id}"), above: Some(id.clone()) };
            let middle = ListCursor { provider: "fake".into(), after: Some(id.clone()), at, pages: 1 };
            let page = runtime.block_on(broker.instances_page(None, Some(middle.clone()), 100)).unwrap();
            assert!(page.records.len() == 100 && page.records[0].id > id, "{:?}", page.next);
            group.bench_with_input(BenchmarkId::new("page/middle", instances), &instances, |b, _| {
                b.iter(|| runtime.block_on(broker.instances_page(None, Some(middle.clone()), 100)).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("provider_of", instances), &instances, |b, _| {
                b.iter(|| broker.provider_of(&id).unwrap())
            });
        }
        group.sample_size(if instances >= 100_000 { 10 } else { 20 });
        group.bench_with_input(BenchmarkId::new("full_listing", instances), &instances, |b, _| {
            b.iter(|| runtime.block_on(full_listing(&broker)))
        });
        if instances <= 100_000 {
            group.bench_with_input(BenchmarkId::new("list", instances), &instances, |b, _| {
                b.iter(|| runtime.block_on(broker.list_instances(None)).unwrap())
            });
        }
        group.sample_size(20);
        largest = Some((dir, broker, instances));
    }
    group.finish();

    let (_dir, broker, instances) = largest.unwrap();
    if instances >= 1_000_000 {
        // Ten runs of a minute are more than a bench run should take: one, timed.
        let started = std::time::Instant::now();
        let found = runtime.block_on(broker.reconcile());
        eprintln!("state_scale reconcile/{instances}: one run {:.1?} ({})", started.elapsed(), found[0].summary());
        return;
    }
    let mut group = c.benchmark_group("state_scale");
    group.sample_size(10);
    group.bench_function(BenchmarkId::new("reconcile", instances), |b| {
        b.iter(|| {
            let found = runtime.block_on(broker.reconcile());
            let summary = found[0].summary();
            assert!(found[0].maintain_failed.is_empty(), "{summary}");
        })
    });
    group.finish();
}

criterion_group!(benches, list_scale);
