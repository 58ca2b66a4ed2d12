//! Durable `start-instance` through the host: the fake provider (three kv
//! writes per start) and the host's instance record, every write committed to
//! the real state file before the start returns. `durable_start/N` runs a batch
//! of starts spread over N concurrent callers; criterion's time per element is
//! the cost of one start at that concurrency, so 1 / time is starts per second.
//!
//! The store grows as the benchmark runs (every start is kept), as a host's does.
//!
//! `healthz/idle` and `healthz/kv_load` time `GET /healthz` on the daemon's
//! API (its router on a unix socket, in this process, on the same two tokio
//! workers as the providers), alone and while 16 callers start instances
//! without pause (each start three durable kv writes and a record): whether
//! durable writes ever hold the executor. Each request is timed on its own
//! too, and the p50 / p99 of every run are printed.
//!
//! cargo bench -p broker-tests --bench durable_start

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_tests::{bundled_manifest_text, percentile};
use criterion::{Criterion, Throughput, criterion_group};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn open(dir: &std::path::Path, runtime: &tokio::runtime::Runtime) -> Arc<Broker> {
    let manifest = dir.join("fake.toml");
    // Every start is kept, so the fake's namespace outgrows the default
    // kv-keys (100000), and its records the default max-records (10000),
    // within a run: this host grants it more.
    let text = bundled_manifest_text("fake")
        .replace("[limits]\n", "[limits]\nkv-keys = 100000000\nkv-mib = 1024\nmax-records = 100000000\n");
    assert!(text.contains("kv-keys"), "the fake's manifest has a [limits] table");
    std::fs::write(&manifest, text).unwrap();
    let broker = Arc::new(Broker::open(&dir.join("host")).unwrap());
    runtime.block_on(broker.registry().add(&manifest)).unwrap();
    broker
}

/// `starts` starts over `callers` tasks; how long they all took.
async fn starts(broker: &Arc<Broker>, callers: u64, starts: u64) -> Duration {
    let began = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let broker = broker.clone();
            // The first `starts % callers` callers take one more.
            let share = starts / callers + u64::from(caller < starts % callers);
            tokio::spawn(async move {
                for _ in 0..share {
                    broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    began.elapsed()
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path(), &runtime);
    let mut group = c.benchmark_group("durable_start");
    group.sample_size(10).measurement_time(Duration::from_secs(8)).throughput(Throughput::Elements(1));
    for callers in [1u64, 4, 16] {
        group.bench_function(format!("{callers}"), |b| {
            b.iter_custom(|iters| runtime.block_on(starts(&broker, callers, iters)))
        });
    }
    group.finish();
    let recorded = broker.store().instances(Some("fake")).unwrap().len();
    println!("durable_start: {recorded} instances recorded in the state file");
}

/// One `GET /healthz` on a connection of its own, as a probe makes it.
async fn healthz(socket: &std::path::Path) -> Duration {
    let began = Instant::now();
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let took = began.elapsed();
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer));
    took
}

fn bench_healthz(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path(), &runtime);
    let socket = dir.path().join("broker.sock");
    let (stop_serving, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = runtime.spawn({
        let (broker, socket) = (broker.clone(), socket.clone());
        async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            broker_serve::daemon::serve(broker, &socket, Default::default(), Default::default(), shutdown).await
        }
    });
    runtime.block_on(async {
        while tokio::net::UnixStream::connect(&socket).await.is_err() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let mut group = c.benchmark_group("healthz");
    group.sample_size(20).measurement_time(Duration::from_secs(5));
    for load in ["idle", "kv_load"] {
        let loading = Arc::new(AtomicBool::new(load == "kv_load"));
        let started = Arc::new(AtomicU64::new(0));
        let loaders: Vec<_> = (0..16)
            .map(|_| {
                let (broker, loading, started) = (broker.clone(), loading.clone(), started.clone());
                runtime.spawn(async move {
                    while loading.load(Ordering::Relaxed) {
                        broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
                        started.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let each = Mutex::new(Vec::new());
        group.bench_function(load, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let took = healthz(&socket).await;
                        each.lock().unwrap().push(took);
                        total += took;
                    }
                    total
                })
            })
        });
        loading.store(false, Ordering::Relaxed);
        for loader in loaders {
            runtime.block_on(loader).unwrap();
        }
        let mut each = each.into_inner().unwrap();
        each.sort();
        println!(
            "healthz/{load}: {} requests, p50 {:?}, p99 {:?}, max {:?}; {} durable starts meanwhile",
            each.len(),
            percentile(&each, 0.50),
            percentile(&each, 0.99),
            each.last().copied().unwrap_or_default(),
            started.load(Ordering::Relaxed),
        );
    }
    group.finish();
    let _ = stop_serving.send(());
    runtime.block_on(served).unwrap().unwrap();
}

criterion_group!(benches, bench, bench_healthz);
