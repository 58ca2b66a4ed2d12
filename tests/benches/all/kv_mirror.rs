//! The kv mirror against no mirror: one `get` answered from a namespace held
//! in memory, the same `get` read from the state file (a read transaction per
//! get, what every read would cost without a mirror), and the price of a miss
//! when the mirror has let the namespace go: reading all of it again (and a
//! namespace of one key, whose use lets it go). The namespace holds 10,000
//! keys of 1 KiB (10 MiB).
//!
//! cargo bench -p broker-tests --bench kv_mirror

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::rooms::kv::KvBackend;
use broker_core::store::Store;
use criterion::{Criterion, criterion_group};

const KEYS: usize = 10_000;

fn kv_mirror(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let kv = store.kv();
    for n in 0..KEYS {
        kv.set("p", &format!("instance/{n:05}"), &[n as u8; 1024]).unwrap();
    }
    let key = format!("instance/{:05}", KEYS / 2);

    let mut group = c.benchmark_group("kv_get");
    group.bench_function("mirror", |b| b.iter(|| kv.get("p", &key).unwrap().unwrap()));
    group.bench_function("file", |b| b.iter(|| kv.committed("p", &key).unwrap().unwrap()));
    group.finish();

    let mut group = c.benchmark_group("kv_load");
    group.sample_size(20);
    kv.set("other", "k", b"v").unwrap();
    group.bench_function("10k_keys_1KiB", |b| {
        b.iter(|| {
            // Nothing waits to be persisted: a budget of 0 lets the namespace
            // go once another (of one key, read again at once) was used since.
            kv.get("other", "k").unwrap().unwrap();
            kv.set_mirror_budget(0);
            assert_eq!(kv.mirror_stats().namespaces, 1);
            kv.get("p", &key).unwrap().unwrap()
        })
    });
    group.finish();
    let stats = kv.mirror_stats();
    eprintln!("mirror after the runs: {stats:?}");
}

criterion_group!(benches, kv_mirror);
