//! A bystander's latency while another provider spins: the fake's
//! `all-instances` (through the host: registry, call, records) timed alone and
//! while 4 and 64 calls of a hostile provider spin in the same host (each
//! until its deadline, then again), on two tokio workers as a host has.
//! A spinning guest yields its worker at every epoch tick (10 ms); what this
//! measures is how far that alone keeps a bystander's calls from waiting.
//! Each call is timed on its own too, and p50 / p99 of every run are printed.
//!
//! cargo bench -p broker-tests --bench bystander

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::rooms::kv::KvBackend;
use broker_core::broker::Broker;
use broker_tests::{bundled_manifest_text, percentile, write_manifest};
use criterion::{Criterion, criterion_group};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = Arc::new(Broker::open(&dir.path().join("host")).unwrap());
    let fake = dir.path().join("fake.toml");
    std::fs::write(&fake, bundled_manifest_text("fake")).unwrap();
    let spinner = write_manifest(
        dir.path(),
        "spinner",
        "test-hostile",
        "[limits]\nmax-concurrent-calls = 64\n[limits.deadlines]\ndefault = \"2s\"\n[grants]\nkv = true\n",
    );
    runtime.block_on(async {
        broker.registry().add(&fake).await.unwrap();
        broker.registry().add(&spinner).await.unwrap();
    });
    broker.store().kv().set("spinner", "mode", b"loop").unwrap();

    let mut group = c.benchmark_group("bystander");
    group.sample_size(20).measurement_time(Duration::from_secs(5));
    for spinners in [0, 4, 64] {
        let spinning = Arc::new(AtomicBool::new(true));
        let spun = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..spinners)
            .map(|_| {
                let (broker, spinning, spun) = (broker.clone(), spinning.clone(), spun.clone());
                runtime.spawn(async move {
                    while spinning.load(Ordering::Relaxed) {
                        // Stopped at its deadline: that is the point.
                        let _ = broker.list_instances(Some("spinner")).await;
                        spun.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let each = Mutex::new(Vec::new());
        group.bench_function(format!("spinners_{spinners}"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        // A task of its own on the workers, beside the spinners, as
                        // each request to a daemon is; timed from its spawn.
                        let broker = broker.clone();
                        let began = Instant::now();
                        runtime.spawn(async move { broker.list_instances(Some("fake")).await.unwrap() }).await.unwrap();
                        let took = began.elapsed();
                        each.lock().unwrap().push(took);
                        total += took;
                    }
                    total
                })
            })
        });
        spinning.store(false, Ordering::Relaxed);
        for task in tasks {
            runtime.block_on(task).unwrap();
        }
        let mut each = each.into_inner().unwrap();
        each.sort();
        println!(
            "bystander/spinners_{spinners}: {} calls, p50 {:?}, p99 {:?}, max {:?}; {} spinning calls stopped meanwhile",
            each.len(),
            percentile(&each, 0.50),
            percentile(&each, 0.99),
            each.last().copied().unwrap_or_default(),
            spun.load(Ordering::Relaxed),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
