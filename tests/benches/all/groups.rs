//! Groups on the fake provider, through the real host (issue 18's figures):
//!
//! - `converge_from_0/100/parallel-N`: commit a group of 100 and run passes
//!   until one changes nothing (every member started, recorded and listed
//!   running), with N starts in flight at once (4 is `broker serve`'s default);
//! - `rolling_update/20`: a template change on a converged group of 20, until
//!   every member is of the new spec (one at a time: destroy, start the
//!   replacement, see it running and answer `maintain-instance`, next).
//!
//! The passes are run back to back, as the loop does after a pass that
//! changed something: the figures are the host's and provider's work, no
//! poll interval in them. Each iteration starts from the same state (the
//! group shrunk back to 0, or the template flipped back) outside the timing.
//!
//! cargo bench -p broker-tests --bench groups

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_core::broker::Broker;
use broker_core::groups::{GroupSettings, Groups, Pass};
use broker_tests::bundled_manifest_text;
use criterion::{BenchmarkId, Criterion, criterion_group};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spec(size: u32, mem: &str) -> String {
    format!(
        r#"{{"ID": "workers", "Properties": {{"Allocation": {{"Size": {size}}},
            "Instance": {{"Plugin": "fake", "Properties": {{"Constraints": "mem={mem}"}}}}}}}}"#
    )
}

fn host(dir: &std::path::Path, runtime: &tokio::runtime::Runtime, max_parallel: usize) -> Arc<Groups> {
    let manifest = dir.join("fake.toml");
    std::fs::write(&manifest, bundled_manifest_text("fake")).unwrap();
    let broker = Arc::new(Broker::open(&dir.join("host")).unwrap());
    runtime.block_on(broker.registry().add(&manifest)).unwrap();
    Groups::new(broker, GroupSettings { max_parallel, ..GroupSettings::default() })
}

/// Passes until one changes nothing.
async fn converge(groups: &Groups) {
    for _ in 0..1000 {
        if groups.converge_once("workers").await.unwrap() == Pass::Steady {
            return;
        }
    }
    panic!("the group did not settle in 1000 passes");
}

async fn members(groups: &Groups) -> usize {
    groups.describe("workers").await.unwrap().instances.len()
}

fn bench_groups(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut group = c.benchmark_group("groups");
    group.sample_size(10).measurement_time(Duration::from_secs(20));

    for max_parallel in [4, 16] {
        let dir = tempfile::tempdir().unwrap();
        let groups = host(dir.path(), &runtime, max_parallel);
        let id = BenchmarkId::new("converge_from_0/100", format!("parallel-{max_parallel}"));
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        groups.commit_text(&spec(100, "1G"), false).await.unwrap();
                        let started = Instant::now();
                        converge(&groups).await;
                        spent += started.elapsed();
                        assert_eq!(members(&groups).await, 100);
                        assert!(groups.describe("workers").await.unwrap().converged);
                        groups.set_size("workers", 0).await.unwrap();
                        converge(&groups).await;
                    }
                    spent
                })
            })
        });
    }

    let dir = tempfile::tempdir().unwrap();
    let groups = host(dir.path(), &runtime, 4);
    runtime.block_on(async {
        groups.commit_text(&spec(20, "1G"), false).await.unwrap();
        converge(&groups).await;
    });
    let mut flip = false;
    group.bench_function("rolling_update/20", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    flip = !flip;
                    let mem = if flip { "2G" } else { "1G" };
                    let plan = groups.commit_text(&spec(20, mem), false).await.unwrap();
                    assert_eq!(plan, "Performing a rolling update on 20 instances");
                    let started = Instant::now();
                    converge(&groups).await;
                    spent += started.elapsed();
                    let described = groups.describe("workers").await.unwrap();
                    assert!(described.converged && described.instances.len() == 20, "{described:?}");
                }
                spent
            })
        })
    });
    group.finish();
}

criterion_group!(benches, bench_groups);
