//! What confinement costs one granted program: `qemu-img --version` (one of the
//! three programs a kvm start runs before qemu itself) started (a) directly, as
//! the host ran programs before the sandbox, and (b) confined under bubblewrap as
//! the provider's user, as the host runs every granted program now. A kvm start
//! runs three programs, so its added cost is about three times (b) - (a).
//!
//! cargo bench -p broker-tests --bench confinement

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::sandbox::{Grants, Lifetime, Sandbox};
use criterion::{Criterion, criterion_group};
use std::path::Path;
use std::process::Stdio;

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data/kvm");
    std::fs::create_dir_all(&data).unwrap();
    let qemu_img = Path::new("/usr/bin/qemu-img");
    let confinement = Sandbox::default()
        .confine(
            "kvm",
            &Grants {
                data_dir: &data,
                paths: &[],
                paths_rw: &[],
                devices: &[],
                programs: &[],
                limits: Default::default(),
            },
        )
        .unwrap();
    let version = ["--version".to_string()];
    let mut group = c.benchmark_group("granted program");
    group.sample_size(20);
    group.bench_function("direct", |b| {
        b.iter(|| {
            let status = std::process::Command::new(qemu_img)
                .args(&version)
                .current_dir(&data)
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(status.success());
        })
    });
    group.bench_function("confined", |b| {
        b.iter(|| {
            let status =
                confinement.command(qemu_img, &version, &[], Lifetime::Call).stdout(Stdio::null()).status().unwrap();
            assert!(status.success());
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
