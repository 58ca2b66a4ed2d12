//! A whole `broker provider test` suite on each bundled provider, on the
//! script it ships (strictly, nothing real touched): the time a CI step or a
//! provider author waits for a verdict. Loading the component is included,
//! as the kit loads it into a fresh sandbox every run.
//!
//! cargo bench -p broker-tests --bench conformance

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_core::conformance::{self, KitOptions};
use broker_core::manifest::Manifest;
use broker_tests::bundled_manifest;
use criterion::{Criterion, criterion_group};
use std::time::Duration;

fn suites(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let mut group = c.benchmark_group("provider_test");
    group.sample_size(10).measurement_time(Duration::from_secs(10));
    for provider in ["fake", "kvm", "lxd"] {
        let manifest = Manifest::load(&bundled_manifest(provider)).unwrap();
        group.bench_function(provider, |b| {
            b.iter(|| {
                // A fresh script each run: a script is consumed as it answers.
                let mut options = KitOptions::beside(&manifest).unwrap();
                options.strict = true;
                let report = runtime.block_on(conformance::run_with(&manifest, options)).unwrap();
                assert!(report.passed(), "{}", report.text());
            })
        });
    }
    group.finish();
}

criterion_group!(benches, suites);
