//! Start-to-running of one VM: (a) `start-instance` of the KVM provider through
//! the host (overlay, seed ISO, qemu, QMP handshake, records) until the guest's
//! init prints its marker on the serial console, against (b) the very qemu
//! command the provider ran (taken from the host's child record), launched
//! directly on copies of the same disk and seed, until the same marker.
//!
//! The boot dominates and varies by a second or more under TCG, so two more
//! pairs isolate what the host adds: (c) the `start-instance` call alone (it
//! returns once QMP says the VM runs) against (d) launching that qemu command
//! until its QMP socket says the same.
//!
//! Needs the VM payload (scripts/vm-payload.sh).
//! cargo bench -p broker-tests --bench vm_start

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::constraints;
use broker_capabilities::contract::params_with;
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_tests::{VmPayload, qmp_commands, vm_payload};
use criterion::{Criterion, criterion_group};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MARKER: &str = "BROKER-VM-UP";

fn manifest(dir: &Path, payload: &VmPayload) -> PathBuf {
    let p = payload.dir.display();
    let text = format!(
        "name = \"kvm\"\ncomponent = \"{}\"\n[limits]\nmemory-mib = 64\nprogram-memory-mib = 16384\nprogram-pids = 4096\n[limits.deadlines]\ndefault = \"60s\"\n\
         [grants]\nkv = true\nlog = true\nlocal-sockets = true\n\
         process = [\"qemu-system-x86_64\", \"qemu-img\", \"genisoimage\"]\npaths = [\"{p}\"]\n\
         [config]\nnamespace = \"bench\"\nkernel = \"{p}/vmlinuz\"\ninitrd = \"{p}/initrd.gz\"\n\
         append = \"console=ttyS0 quiet panic=-1\"\naccel = \"{}\"\nstop-grace-ms = 0\n",
        broker_tests::wasm("kvm").display(),
        payload.accel
    );
    let path = dir.join("kvm.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn wait_for_marker(console: &Path) {
    let started = Instant::now();
    while !std::fs::read_to_string(console).unwrap_or_default().contains(MARKER) {
        assert!(started.elapsed() < Duration::from_secs(180), "no marker in {}", console.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Launch qemu and wait until QMP answers `query-status` with `running`.
fn qemu_until_qmp_running(program: &str, args: &[String], qmp: &Path) -> std::process::Child {
    let qemu = Command::new(program).args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let started = Instant::now();
    let stream = loop {
        match UnixStream::connect(qmp) {
            Ok(stream) => break stream,
            Err(_) if started.elapsed() < Duration::from_secs(10) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("no QMP socket at {}: {e}", qmp.display()),
        }
    };
    let line = qmp_commands(stream, &["query-status"]);
    assert!(line.contains("\"running\""), "{line}");
    qemu
}

fn bench(c: &mut Criterion) {
    let payload = vm_payload();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("host");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let broker = Broker::open(&data).unwrap();
    runtime.block_on(broker.registry().add(&manifest(dir.path(), &payload))).unwrap();
    let params = params_with(constraints::parse("mem=512M cores=1").unwrap());
    let vm_dir = |id: &str| data.join("data/kvm/vm").join(id);

    // One VM through the host, to learn the exact command and copy its disk and seed.
    let first = runtime.block_on(broker.start_instance("kvm", &params, &CallHooks::default())).unwrap();
    let child = broker.store().child_records().get("kvm", &first.id).unwrap().unwrap();
    let direct_dir = dir.path().join("direct");
    std::fs::create_dir_all(&direct_dir).unwrap();
    for file in ["root.qcow2", "seed.iso"] {
        std::fs::copy(vm_dir(&first.id).join(file), direct_dir.join(file)).unwrap();
    }
    let (from_dir, to_dir) = (vm_dir(&first.id).display().to_string(), direct_dir.display().to_string());
    let qmp_dir = data.join("data/kvm/run").display().to_string();
    let direct_args: Vec<String> =
        child.args.iter().map(|a| a.replace(&from_dir, &to_dir).replace(&qmp_dir, &to_dir)).collect();
    runtime.block_on(broker.stop_instances("kvm", std::slice::from_ref(&first.id))).unwrap();

    let mut group = c.benchmark_group("vm_start_to_running");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(20));
    group.bench_function("broker", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let started = Instant::now();
                let record = runtime.block_on(broker.start_instance("kvm", &params, &CallHooks::default())).unwrap();
                wait_for_marker(&vm_dir(&record.id).join("console.log"));
                total += started.elapsed();
                runtime.block_on(broker.stop_instances("kvm", &[record.id])).unwrap();
            }
            total
        })
    });
    group.bench_function("qemu_direct", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let console = direct_dir.join("console.log");
                let _ = std::fs::remove_file(&console);
                let started = Instant::now();
                let mut qemu = Command::new(&child.program)
                    .args(&direct_args)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap();
                wait_for_marker(&console);
                total += started.elapsed();
                qemu.kill().unwrap();
                qemu.wait().unwrap();
            }
            total
        })
    });
    group.finish();

    let mut group = c.benchmark_group("vm_start_call");
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(10));
    group.bench_function("broker_start_instance", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let started = Instant::now();
                let record = runtime.block_on(broker.start_instance("kvm", &params, &CallHooks::default())).unwrap();
                total += started.elapsed();
                runtime.block_on(broker.stop_instances("kvm", &[record.id])).unwrap();
            }
            total
        })
    });
    let qmp = direct_args
        .iter()
        .find_map(|a| a.strip_prefix("unix:").and_then(|rest| rest.split(',').next()))
        .map(PathBuf::from)
        .unwrap();
    group.bench_function("qemu_direct_until_qmp_running", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let _ = std::fs::remove_file(&qmp);
                let started = Instant::now();
                let mut qemu = qemu_until_qmp_running(&child.program, &direct_args, &qmp);
                total += started.elapsed();
                qemu.kill().unwrap();
                qemu.wait().unwrap();
            }
            total
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
