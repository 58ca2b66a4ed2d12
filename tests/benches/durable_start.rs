//! Durable `start-instance` through the host: the fake provider (three kv
//! writes per start) and the host's instance record, every write committed to
//! the real state file before the start returns. `durable_start/N` runs a batch
//! of starts spread over N concurrent callers; criterion's time per element is
//! the cost of one start at that concurrency, so 1 / time is starts per second.
//!
//! The store grows as the benchmark runs (every start is kept), as a host's does.
//!
//! cargo bench -p broker-tests --bench durable_start

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_host::broker::Broker;
use broker_host::capabilities::context::CallHooks;
use broker_host::contract::empty_params;
use broker_tests::bundled_manifest_text;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn open(dir: &std::path::Path, runtime: &tokio::runtime::Runtime) -> Arc<Broker> {
    let manifest = dir.join("fake.toml");
    std::fs::write(&manifest, bundled_manifest_text("fake")).unwrap();
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

criterion_group!(benches, bench);
criterion_main!(benches);
