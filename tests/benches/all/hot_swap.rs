//! Hot swap under full load, on the fake provider (0.1.0 <-> 0.2.0):
//! - `hot_swap/swap`: one `Registry::swap` (load from wasmtime's cache, link,
//!   type-check, validate-config, describe, record, event);
//! - `call_latency/{steady,during_swaps}`: one `all-instances` call through the
//!   registry slot, with 4 other clients calling, without and with a swap every 20 ms.
//!
//! Criterion gives medians; the tail is printed first from every call of two
//! 5-second runs, steady and with a swap every 20 ms (p50, p99, max, failed
//! calls), since p99 is what a swap hurts.
//!
//! cargo bench -p broker-tests --bench hot_swap

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_tests::{bundled_manifest_text, wasm};
use criterion::{Criterion, criterion_group};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const CLIENTS: usize = 4;

fn open(dir: &std::path::Path, runtime: &tokio::runtime::Runtime) -> Arc<Broker> {
    let text = bundled_manifest_text("fake");
    let manifest = dir.join("fake.toml");
    std::fs::write(&manifest, text).unwrap();
    let broker = Arc::new(Broker::open(&dir.join("host")).unwrap());
    runtime.block_on(async {
        broker.registry().add(&manifest).await.unwrap();
        for _ in 0..20 {
            broker.start_instance("fake", &empty_params(), &CallHooks::default()).await.unwrap();
        }
        // Both versions compiled once, so swaps measure the swap, not cranelift.
        broker.registry().swap("fake", &wasm("fake_next"), None).await.unwrap();
        broker.registry().swap("fake", &wasm("fake"), None).await.unwrap();
    });
    broker
}

async fn one_call(broker: &Broker) -> Result<(), String> {
    let provider = broker.registry().get("fake").await.map_err(|e| e.to_string())?;
    let listed = provider.all_instances(&CallHooks::default()).await.map_err(|e| e.to_string())?;
    if listed.len() == 20 { Ok(()) } else { Err(format!("{} instances listed, not 20", listed.len())) }
}

/// Swap back and forth every `every` until `stop`; returns each swap's duration.
async fn swapper(broker: Arc<Broker>, stop: Arc<AtomicBool>, every: Duration) -> Vec<Duration> {
    let mut durations = Vec::new();
    let mut next = ["fake_next", "fake"].iter().cycle();
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(every).await;
        let started = Instant::now();
        broker.registry().swap("fake", &wasm(next.next().unwrap()), None).await.unwrap();
        durations.push(started.elapsed());
    }
    durations
}

/// CLIENTS clients calling back to back for `length`; every latency, and the failures.
async fn load(broker: &Arc<Broker>, length: Duration) -> (Vec<Duration>, Vec<String>) {
    let until = Instant::now() + length;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let broker = broker.clone();
        clients.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut failures = Vec::new();
            while Instant::now() < until {
                let started = Instant::now();
                if let Err(e) = one_call(&broker).await {
                    failures.push(e);
                }
                latencies.push(started.elapsed());
                // Each call is its own request: let others (the swapper) run between them,
                // as a server's tasks would. A warm call completes without ever yielding.
                tokio::task::yield_now().await;
            }
            (latencies, failures)
        }));
    }
    let mut all = (Vec::new(), Vec::new());
    for client in clients {
        let (latencies, failures) = client.await.unwrap();
        all.0.extend(latencies);
        all.1.extend(failures);
    }
    all.0.sort();
    all
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn tail_report(runtime: &tokio::runtime::Runtime, broker: &Arc<Broker>, length: Duration) {
    let (steady, steady_failed) = runtime.block_on(load(broker, length));
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = runtime.spawn(swapper(broker.clone(), stop.clone(), Duration::from_millis(20)));
    let (during, during_failed) = runtime.block_on(load(broker, length));
    stop.store(true, Ordering::Relaxed);
    let mut swap_times = runtime.block_on(swaps).unwrap();
    swap_times.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("hot swap tail ({CLIENTS} clients calling all-instances for {length:?} each way, 20 instances):");
    for (name, lat, failed) in [("steady", &steady, &steady_failed), ("during_swaps", &during, &during_failed)] {
        println!(
            "  {name:<13} calls {:>7}  p50 {:>8.1} us  p99 {:>8.1} us  max {:>9.1} us  failed {}",
            lat.len(),
            us(percentile(lat, 0.5)),
            us(percentile(lat, 0.99)),
            us(*lat.last().unwrap()),
            failed.len()
        );
    }
    if !swap_times.is_empty() {
        println!(
            "  swaps: {}  median {:.2} ms  max {:.2} ms",
            swap_times.len(),
            percentile(&swap_times, 0.5).as_secs_f64() * 1e3,
            swap_times.last().unwrap().as_secs_f64() * 1e3
        );
    }
    assert!(steady_failed.is_empty() && during_failed.is_empty(), "failed calls: {during_failed:?}");
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path(), &runtime);
    let test_mode = std::env::args().any(|a| a == "--test");
    tail_report(&runtime, &broker, Duration::from_millis(if test_mode { 300 } else { 5_000 }));

    let mut group = c.benchmark_group("hot_swap");
    let mut next = ["fake_next", "fake"].iter().cycle();
    group.bench_function("swap", |b| {
        b.iter(|| runtime.block_on(broker.registry().swap("fake", &wasm(next.next().unwrap()), None)).unwrap())
    });
    group.finish();

    let mut group = c.benchmark_group("call_latency");
    let others = |stop: Arc<AtomicBool>| {
        (0..CLIENTS)
            .map(|_| {
                let (broker, stop) = (broker.clone(), stop.clone());
                runtime.spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        one_call(&broker).await.unwrap();
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect::<Vec<_>>()
    };
    for swapping in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let load = others(stop.clone());
        let swaps = swapping.then(|| runtime.spawn(swapper(broker.clone(), stop.clone(), Duration::from_millis(20))));
        let name = if swapping { "during_swaps" } else { "steady" };
        group.bench_function(name, |b| b.iter(|| runtime.block_on(one_call(&broker)).unwrap()));
        stop.store(true, Ordering::Relaxed);
        for task in load {
            runtime.block_on(task).unwrap();
        }
        if let Some(swaps) = swaps {
            runtime.block_on(swaps).unwrap();
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
