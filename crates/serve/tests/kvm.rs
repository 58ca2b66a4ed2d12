//! The KVM provider against real qemu: the real host (`Broker`), the real
//! component, real taps on a real bridge in a network namespace the test makes.
//! The VMs boot Debian's kernel with a busybox initramfs (scripts/vm-payload.sh)
//! whose init prints `BROKER-VM-UP mem_kb=… cpus=… mac=…` on the serial console.
//! In `broker-serve`'s tests, not `broker-core`'s: its restart test SIGKILLs
//! `broker serve` (this package's binary) with VMs running.

// A test binary of its own, as core's lxd.rs: real VMs and containers share no process
// and no test threads with the rest of the suite (in one binary with it, a VM
// here twice failed to boot within its deadline; cause not yet found).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use broker_capabilities::bindings::InstanceStatus;
use broker_capabilities::contract::constraints;
use broker_capabilities::contract::{interface_on, params_with};
use broker_capabilities::network::netlink::Netlink;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::process::proc_stat;
use broker_core::broker::{Broker, BrokerServiceError};
use broker_tests::netns::{in_netns, make_nic};
use broker_tests::{VmPayload, qmp_commands, recording_hooks, vm_payload, wasm};
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

/// How long a VM may take to print its marker (TCG on a busy machine is slow).
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// The KVM provider's manifest, its grants exactly what it needs: the payload
/// and `dir/images` (base images) are the host paths its programs may read.
fn kvm_manifest(dir: &Path, payload: &VmPayload, namespace: &str, grant_process: bool) -> PathBuf {
    let p = payload.dir.display();
    let process = if grant_process { r#"process = ["qemu-system-x86_64", "qemu-img", "genisoimage"]"# } else { "" };
    let text = format!(
        r#"name = "kvm"
component = "{component}"
[limits]
memory-mib = 64
program-memory-mib = 16384
program-pids = 4096
[limits.deadlines]
default = "60s"
start-instance = "120s"
[grants]
kv = true
log = true
local-sockets = true
{process}
paths = ["{p}", "{images}"]
devices = ["/dev/kvm", "/dev/net/tun"]
[grants.bridge]
devices = ["kt*"]
bridges = ["br-*"]
attach-to = ["br-*"]
[config]
namespace = "{namespace}"
kernel = "{p}/vmlinuz"
initrd = "{p}/initrd.gz"
append = "console=ttyS0 quiet panic=-1"
accel = "{accel}"
max-cores = 4
stop-grace-ms = 300
"#,
        component = wasm("kvm").display(),
        accel = payload.accel,
        images = dir.join("images").display(),
    );
    let path = dir.join("kvm.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Image metadata for a kvm image with the given `extra` keys.
fn image_with(extra: &[(&str, &str)]) -> broker_capabilities::bindings::ImageMetadata {
    broker_capabilities::bindings::ImageMetadata {
        id: "test-image".into(),
        arch: "amd64".into(),
        base: String::new(),
        region: String::new(),
        endpoint: String::new(),
        stream: String::new(),
        virt_type: Some("kvm".into()),
        storage: None,
        extra: extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
    }
}

fn vm_dir(data_dir: &Path, id: &str) -> PathBuf {
    data_dir.join("data/kvm/vm").join(id)
}

/// Wait for the marker on the VM's serial console; returns the marker line,
/// once it is whole (the serial port writes it a few bytes at a time).
fn await_boot(data_dir: &Path, id: &str) -> String {
    let console = vm_dir(data_dir, id).join("console.log");
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&console).unwrap_or_default();
        if let Some(line) = text.split_inclusive('\n').find(|l| l.starts_with("BROKER-VM-UP") && l.ends_with('\n')) {
            return line.trim_end().to_owned();
        }
        assert!(started.elapsed() < BOOT_TIMEOUT, "{id} did not boot; console:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn marker_field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)).unwrap_or_else(|| panic!("{key} in {line}"))
}

/// The pid of the VM's qemu, from the host's child records.
fn qemu_pid(broker: &Broker, id: &str) -> u32 {
    broker.store().child_records().get("kvm", id).unwrap().unwrap_or_else(|| panic!("no child record for {id}")).pid
}

fn alive(pid: u32) -> bool {
    proc_stat(pid).is_some_and(|(_, state)| state != 'Z')
}

/// Kills any qemu left behind by a failing test (they would outlive it).
struct KillQemusUnder(PathBuf);

impl Drop for KillQemusUnder {
    fn drop(&mut self) {
        let needle = self.0.display().to_string();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.starts_with("/usr/bin/qemu-system")
                && cmdline.contains(&needle)
                && let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>()
            {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            }
        }
    }
}

#[test]
fn three_vms_boot_with_their_hardware_stop_cleanly_and_survive_a_host_restart() {
    let payload = vm_payload();
    in_netns(move || async move {
        make_nic("ethk", [0x00, 0x16, 0x3e, 0x10, 0x20, 0x30], "10.60.0.2/24").await;
        let dir = tempfile::tempdir().unwrap();
        let _reaper = KillQemusUnder(dir.path().to_owned());
        let data = &dir.path().join("state");
        // A base image for the third VM's overlay, where the grant names it (a
        // granted path is resolved when the provider loads: it must be there).
        let base = dir.path().join("images/base.qcow2");
        std::fs::create_dir_all(base.parent().unwrap()).unwrap();
        let made =
            std::process::Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&base).arg("1G").status();
        let broker = Broker::open(data).unwrap();
        broker.registry().add(&kvm_manifest(dir.path(), &payload, "t1", true)).await.unwrap();
        assert!(made.unwrap().success());

        let asked = [
            ("mem=512M cores=1", 512, 1, 8192),
            ("mem=768M cores=2", 768, 2, 8192),
            ("mem=640M root-disk=3G", 640, 1, 3072),
        ];
        let mut ids = Vec::new();
        for (i, (text, ..)) in asked.iter().enumerate() {
            let mut params = params_with(constraints::parse(text).unwrap());
            if i == 0 {
                params.network_info = vec![interface_on("br-ethk", "52:54:00:aa:bb:01")];
            }
            if i == 2 {
                params.image_metadata = vec![image_with(&[("base-image", &base.display().to_string())])];
            }
            let (hooks, seen) = recording_hooks();
            let record = broker.start_instance("kvm", &params, &hooks).await.unwrap();
            let infos: Vec<String> = seen.lock().unwrap().iter().map(|(_, info)| info.clone()).collect();
            assert_eq!(infos, ["Creating instance", "Starting instance", "Instance started"]);
            assert_eq!(seen.lock().unwrap().last().unwrap().0, InstanceStatus::Running);
            assert!(record.id.starts_with("juju-t1-vm"), "{}", record.id);
            ids.push(record.id);
        }

        for (id, (_, mem, cores, disk)) in ids.iter().zip(asked) {
            let marker = await_boot(data, id);
            let mem_kb: u64 = marker_field(&marker, "mem_kb=").parse().unwrap();
            // The kernel keeps some for itself; what it sees must be most of what was asked, never more.
            assert!(mem_kb <= mem * 1024 && mem_kb > mem * 1024 * 3 / 4, "{id}: {marker} for mem={mem}M");
            assert_eq!(marker_field(&marker, "cpus="), cores.to_string(), "{id}: {marker}");
            let overlay = vm_dir(data, id).join("root.qcow2");
            let info = std::process::Command::new("qemu-img").args(["info", "-U"]).arg(&overlay).output().unwrap();
            let info = String::from_utf8_lossy(&info.stdout);
            assert!(info.contains(&format!("virtual size: {} GiB", disk / 1024)), "{id}: {info}");
            let backed = info.contains(&format!("backing file: {}", base.display()));
            assert_eq!(backed, *id == ids[2], "{id}: only the third VM is an overlay on the base image: {info}");
        }
        // The NoCloud seed: volume `cidata`, meta-data naming the instance.
        let seed = vm_dir(data, &ids[0]).join("seed.iso");
        let volume = std::process::Command::new("isoinfo").arg("-d").arg("-i").arg(&seed).output().unwrap();
        assert!(String::from_utf8_lossy(&volume.stdout).contains("Volume id: cidata"));
        let meta =
            std::process::Command::new("isoinfo").args(["-R", "-x", "/meta-data", "-i"]).arg(&seed).output().unwrap();
        let meta: serde_json::Value = serde_json::from_slice(&meta.stdout).unwrap();
        assert_eq!(meta["instance-id"], ids[0].as_str());
        // The first VM's NIC: the MAC asked for inside, a tap on the bridge HostPreparer made outside.
        let first_marker = await_boot(data, &ids[0]);
        assert_eq!(marker_field(&first_marker, "mac="), "52:54:00:aa:bb:01");
        let nl = Netlink::connect().unwrap();
        let tap = nl.devices().await.unwrap().into_iter().find(|d| d.name.starts_with("kt")).expect("a tap");
        assert_eq!(tap.controller.as_deref(), Some("br-ethk"));
        assert_eq!(tap.mac, "fe:54:00:aa:bb:01");

        let listed = broker.list_instances(Some("kvm")).await.unwrap();
        assert_eq!(listed.len(), 3);
        for (record, (_, mem, cores, disk)) in listed.iter().zip(asked) {
            assert_eq!(record.status, "running", "{record:?}");
            assert_eq!(
                (record.hardware.mem, record.hardware.cpu_cores, record.hardware.root_disk),
                (Some(mem), Some(cores), Some(disk))
            );
            let virt = if payload.accel == "kvm" { "kvm" } else { "qemu" };
            assert_eq!(record.hardware.virt_type.as_deref(), Some(virt));
        }

        // Stop the first: process, files and tap go; stopping it again is fine.
        let pid = qemu_pid(&broker, &ids[0]);
        broker.stop_instances("kvm", std::slice::from_ref(&ids[0])).await.unwrap();
        assert!(!alive(pid), "qemu {pid} still runs");
        assert!(!vm_dir(data, &ids[0]).exists());
        assert!(nl.device(&tap.name).await.unwrap().is_none(), "tap {} remains", tap.name);
        assert_eq!(broker.list_instances(Some("kvm")).await.unwrap().len(), 2);
        broker.stop_instances("kvm", std::slice::from_ref(&ids[0])).await.unwrap();
        broker.stop_instances("kvm", &["juju-t1-nonesuch".to_owned(), "someone-elses".to_owned()]).await.unwrap();

        // Restart the host with two VMs running: the new host re-adopts them.
        let survivor = qemu_pid(&broker, &ids[1]);
        drop(broker);
        let broker = Broker::open(data).unwrap();
        for id in &ids[1..] {
            broker.maintain_instance("kvm", id).await.unwrap();
        }
        let listed = broker.list_instances(Some("kvm")).await.unwrap();
        assert_eq!(listed.iter().map(|r| r.status.as_str()).collect::<Vec<_>>(), ["running", "running"]);
        assert!(alive(survivor));

        broker.stop_instances("kvm", &ids[1..]).await.unwrap();
        assert!(!alive(survivor));
        assert!(broker.list_instances(Some("kvm")).await.unwrap().is_empty());
        let left: Vec<_> = std::fs::read_dir(data.join("data/kvm/vm")).unwrap().collect();
        assert!(left.is_empty(), "VM dirs left: {left:?}");
    });
}

/// Send QMP commands straight to a VM's monitor (while the provider is not connected).
fn qmp(socket: &Path, commands: &[&str]) {
    qmp_commands(std::os::unix::net::UnixStream::connect(socket).unwrap(), commands);
}

#[test]
fn state_comes_from_qmp_and_maintain_recreates_a_missing_tap() {
    let payload = vm_payload();
    in_netns(move || async move {
        make_nic("ethm", [0x00, 0x16, 0x3e, 0x10, 0x20, 0x40], "10.61.0.2/24").await;
        let dir = tempfile::tempdir().unwrap();
        let _reaper = KillQemusUnder(dir.path().to_owned());
        let broker = Broker::open(&dir.path().join("state")).unwrap();
        broker.registry().add(&kvm_manifest(dir.path(), &payload, "t2", true)).await.unwrap();
        let mut params = params_with(constraints::parse("mem=512M").unwrap());
        params.network_info = vec![interface_on("br-ethm", "52:54:00:aa:bb:02")];
        let record = broker.start_instance("kvm", &params, &CallHooks::default()).await.unwrap();

        let nl = Netlink::connect().unwrap();
        let tap = nl.devices().await.unwrap().into_iter().find(|d| d.name.starts_with("kt")).expect("a tap");
        nl.delete(&tap.name).await.unwrap();
        broker.maintain_instance("kvm", &record.id).await.unwrap();
        let back = nl.device(&tap.name).await.unwrap().expect("tap recreated");
        assert_eq!((back.controller.as_deref(), back.mac.as_str()), (Some("br-ethm"), "fe:54:00:aa:bb:02"));

        let err = broker.maintain_instance("kvm", "juju-t2-nonesuch").await.unwrap_err();
        assert!(err.to_string().contains("no VM juju-t2-nonesuch"), "{err}");

        // Paused through its monitor: all-instances says so; then it runs again.
        let run_dir = dir.path().join("state/data/kvm/run");
        let socket = std::fs::read_dir(&run_dir).unwrap().flatten().next().unwrap().path();
        let state = async || {
            let listed = broker.list_instances(Some("kvm")).await.unwrap();
            (listed[0].status.clone(), listed[0].message.clone())
        };
        qmp(&socket, &["stop"]);
        assert_eq!(state().await, ("stopped".to_owned(), "paused".to_owned()));
        qmp(&socket, &["cont"]);
        assert_eq!(state().await.0, "running");

        // Killed behind the host's back — its whole sandbox: qemu lives as long as
        // bubblewrap's first process in it does, whatever becomes of the process the
        // host started — unknown, and maintain says it cannot re-adopt it.
        let pid = qemu_pid(&broker, &record.id);
        let child = broker.store().child_records().get("kvm", &record.id).unwrap().unwrap();
        let (init, _) = child.sandbox.expect("the sandbox's first process is recorded");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(init as i32), nix::sys::signal::SIGKILL).unwrap();
        // A multi-threaded process shows as a zombie before it can be reaped:
        // until then the host may still see it running (and QMP fail). bubblewrap
        // reports a program killed by signal N as exit code 128 + N.
        let killed = ("unknown".to_owned(), "qemu exited with code 137".to_owned());
        let since = Instant::now();
        while state().await != killed {
            assert!(since.elapsed() < Duration::from_secs(10), "never reported killed: {:?}", state().await);
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(pid));
        let err = broker.maintain_instance("kvm", &record.id).await.unwrap_err();
        assert!(err.to_string().contains("cannot be re-adopted: qemu exited with code 137"), "{err}");
        // Stopping it still cleans up what it left.
        broker.stop_instances("kvm", &[record.id]).await.unwrap();
        assert!(nl.device(&tap.name).await.unwrap().is_none());
        assert!(broker.list_instances(Some("kvm")).await.unwrap().is_empty());
    });
}

/// Nothing of the VM may remain: no record, no files, no child, no process.
fn assert_nothing_left(broker: &Broker, data: &Path) {
    let vms = data.join("data/kvm/vm");
    let dirs: Vec<_> = std::fs::read_dir(&vms).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(dirs.is_empty(), "left behind: {dirs:?}");
    assert!(broker.store().child_records().list("kvm").unwrap().is_empty(), "child records left");
    assert!(broker.store().instances(Some("kvm")).unwrap().is_empty(), "instance records left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmeetable_constraints_and_failed_boots_leave_nothing_behind() {
    let payload = vm_payload();
    let dir = tempfile::tempdir().unwrap();
    let _reaper = KillQemusUnder(dir.path().to_owned());
    let data = &dir.path().join("state");
    let broker = Broker::open(data).unwrap();
    broker.registry().add(&kvm_manifest(dir.path(), &payload, "t3", true)).await.unwrap();

    for (text, needle) in [
        ("cores=64", "cores=64 cannot be met: this host gives a VM at most 4 (provider config max-cores)"),
        ("arch=arm64", "arch=arm64 cannot be met"),
    ] {
        let err = broker
            .start_instance("kvm", &params_with(constraints::parse(text).unwrap()), &CallHooks::default())
            .await
            .unwrap_err();
        assert!(matches!(err, BrokerServiceError::Call(_)), "{err:?}");
        assert!(err.to_string().contains(needle), "{text}: {err}");
        assert_nothing_left(&broker, data);
    }

    // qemu starts and dies at once (the image names a kernel that is not there):
    // the cause comes back, and the overlay, seed and records are gone.
    let mut params = params_with(constraints::empty());
    let missing = format!("{}/no-such-kernel", payload.dir.display());
    params.image_metadata = vec![image_with(&[("kernel", &missing)])];
    let (hooks, seen) = recording_hooks();
    let err = broker.start_instance("kvm", &params, &hooks).await.unwrap_err();
    assert!(err.to_string().contains("no-such-kernel"), "qemu's own words should say why: {err}");
    let last = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.0, InstanceStatus::ProvisioningError);
    assert_nothing_left(&broker, data);
    assert!(broker.list_instances(Some("kvm")).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_process_grant_the_provider_gets_access_denied() {
    let payload = vm_payload();
    let dir = tempfile::tempdir().unwrap();
    let data = &dir.path().join("state");
    let broker = Broker::open(data).unwrap();
    broker.registry().add(&kvm_manifest(dir.path(), &payload, "t4", false)).await.unwrap();
    let err =
        broker.start_instance("kvm", &params_with(constraints::empty()), &CallHooks::default()).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("access-denied") || text.contains("access denied"), "{text}");
    assert!(text.contains("process is not granted"), "{text}");
    assert_nothing_left(&broker, data);
    // The host is fine: the provider still answers.
    assert!(broker.list_instances(Some("kvm")).await.unwrap().is_empty());
}

/// Whether any qemu runs with `needle` on its command line.
fn qemu_running_with(needle: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        cmdline.starts_with("/usr/bin/qemu-system") && cmdline.contains(needle)
    })
}

#[test]
fn the_conformance_kit_records_a_real_vm_run_and_replays_it_without_qemu() {
    use broker_capabilities::network::Device;
    use broker_capabilities::network::DeviceToBridge;
    use broker_capabilities::rooms::process::simulated::{ScriptedChild, ScriptedRun};
    use broker_core::conformance::{self, Answers, KitOptions, Recording, Scripted};
    use broker_core::manifest::Manifest;
    use std::sync::Arc;

    let payload = vm_payload();
    in_netns(move || async move {
        // A bridge the grant (`br-*`) lets the provider see: the recording notes it.
        make_nic("ethk", [0x00, 0x16, 0x3e, 0x10, 0x20, 0x31], "10.61.0.2/24").await;
        let change = DeviceToBridge { device: "ethk".into(), bridge: "br-ethk".into(), mac: String::new() };
        Netlink::connect().unwrap().bridge(&change).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let manifest = Manifest::load(&kvm_manifest(dir.path(), &payload, "kit", true)).unwrap();

        // Real qemu-img, genisoimage and qemu, every call and QMP line on tape.
        let recording = Arc::new(Recording::default());
        let options = KitOptions {
            answers: Answers::Record(recording.clone()),
            strict: false,
            sandbox: Default::default(),
            credentials: None,
            secrets: None,
        };
        let recorded = conformance::run_with(&manifest, options).await.unwrap();
        assert!(recorded.passed(), "{}", recorded.text());
        let script = recording.script();
        let section = |key: &str| script.get(key).cloned().unwrap_or_else(|| serde_json::json!([]));
        let runs: Vec<ScriptedRun> = serde_json::from_value(section("runs")).unwrap();
        let children: Vec<ScriptedChild> = serde_json::from_value(section("children")).unwrap();
        let found: Vec<Device> = serde_json::from_value(section("devices")).unwrap();
        let programs: Vec<&str> = runs.iter().map(|r| r.program.as_str()).collect();
        assert_eq!(programs, ["qemu-img", "genisoimage"]);
        assert_eq!(children.len(), 1, "one VM");
        let qemu = &children[0];
        assert!(qemu.greeting[0].contains("\"QMP\""), "{:?}", qemu.greeting);
        let quit = qemu.answers.iter().find(|a| a.line.contains("\"quit\"")).unwrap();
        assert_eq!(quit.exit, Some(0), "qemu ended after quit");
        let devices: Vec<&str> = found.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(devices, ["br-ethk"], "only what the grant covers");
        let start = recorded.cases.iter().find(|c| c.name == "start-instance succeeds").unwrap();
        assert_eq!(start.detail, "started juju-kit-vm1");
        assert!(!qemu_running_with("juju-kit-vm1"), "the kit stopped its VM");

        // The same run on the script alone: the same outcomes, strictly, and no qemu.
        let replay = Arc::new(Scripted::parse(&recording.to_script_json()).unwrap());
        let options = KitOptions {
            answers: Answers::Script(replay.clone()),
            strict: true,
            sandbox: Default::default(),
            credentials: None,
            secrets: None,
        };
        let replayed = conformance::run_with(&manifest, options).await.unwrap();
        let outcome =
            |r: &conformance::Report| r.cases.iter().map(|c| (c.name.to_string(), c.passed)).collect::<Vec<_>>();
        assert_eq!(outcome(&replayed), outcome(&recorded), "{}", replayed.text());
        assert_eq!(replay.remaining(), 0, "every run and the child were asked for");
    });
}

/// One HTTP/1.0 request on the daemon's socket (HTTP/1.0: the body ends
/// with the connection, never chunked); `None` once the daemon is gone.
fn daemon_request(socket: &Path, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
    // A VM's start takes seconds; a socket that never answers must not hang the test.
    stream.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let head =
        format!("{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    stream.write_all(head.as_bytes()).ok()?;
    stream.write_all(body.as_bytes()).ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    Some((head.split_whitespace().nth(1)?.parse().ok()?, body.to_owned()))
}

fn daemon_json(socket: &Path, path: &str) -> serde_json::Value {
    let (status, body) = daemon_request(socket, "GET", path, "").unwrap_or_else(|| panic!("GET {path}: no answer"));
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// `broker serve` on `data`, its log in `log`; returns once it listens.
fn serve(data: &Path, harvest: &str, log_path: &Path) -> std::process::Child {
    let log = std::fs::File::create(log_path).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_broker"))
        .arg("--data-dir")
        .arg(data)
        .args(["-v", "serve", "--harvest", harvest])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let socket = data.join("broker.sock");
    let started = Instant::now();
    while daemon_request(&socket, "GET", "/healthz", "").is_none_or(|(status, _)| status != 200) {
        let exited = child.try_wait().unwrap();
        if exited.is_some() || started.elapsed() > Duration::from_secs(60) {
            // What the failure's reader needs: the daemon's word, and who else holds its socket.
            let output = |program: &str, args: &[&str]| {
                let ran = std::process::Command::new(program).args(args).output();
                ran.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
            };
            let log = std::fs::read_to_string(log_path).unwrap_or_default();
            let ss = output("ss", &["-xlpn"]);
            let holders: Vec<&str> = ss.lines().filter(|l| l.contains(&*socket.to_string_lossy())).collect();
            let stacks = match exited {
                Some(_) => String::new(),
                None => output("gdb", &["-batch", "-ex", "thread apply all bt 12", "-p", &child.id().to_string()]),
            };
            panic!("the daemon did not serve ({exited:?}); its socket held by {holders:?}; its log:\n{log}\n{stacks}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

/// A daemon a failing test must not leave running.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A client of the crash test: start VMs one after another, stopping each
/// one's predecessor, until the daemon stops answering.
fn start_and_stop_until_killed(socket: &Path) -> (usize, usize) {
    let (mut started, mut stopped, mut mine) = (0, 0, Vec::<String>::new());
    let start = r#"{"provider":"kvm","constraints":"cores=1 mem=256M"}"#;
    while let Some((status, stream)) = daemon_request(socket, "POST", "/v1/instances", start) {
        let last = stream.lines().last().and_then(|line| serde_json::from_str::<serde_json::Value>(line).ok());
        match last {
            Some(line) if status == 200 && line["event"] == "started" => {
                mine.push(line["instance"]["id"].as_str().unwrap().to_owned());
                started += 1;
            }
            // The daemon died mid-answer (or refused while going down).
            _ => break,
        }
        if mine.len() > 1 {
            let oldest = mine.remove(0);
            match daemon_request(socket, "DELETE", &format!("/v1/instances/{oldest}"), "") {
                Some((200, _)) => stopped += 1,
                _ => break,
            }
        }
    }
    (started, stopped)
}

/// The reconcile's event after the `n`th start of the daemon, once it is there.
fn nth_reconcile(socket: &Path, n: usize) -> String {
    let started = Instant::now();
    loop {
        let events = daemon_json(socket, "/v1/events?limit=1000");
        let reconciled: Vec<&serde_json::Value> =
            events.as_array().unwrap().iter().filter(|e| e["kind"] == "reconciled").collect();
        if reconciled.len() >= n {
            return reconciled[n - 1]["detail"].as_str().unwrap_or_default().to_owned();
        }
        assert!(started.elapsed() < Duration::from_secs(180), "no reconcile after restart {n}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Issue 17's crash test: the daemon SIGKILLed at staggered points while
/// three clients start and stop real VMs, then restarted with each harvest
/// mode. After every restart's reconcile the provider reports no instance
/// the host has no record of (an orphan: a running qemu nobody would stop)
/// and the host holds no record of an instance the provider no longer
/// reports (a vanished record).
#[test]
fn the_daemon_killed_under_concurrent_starts_and_stops_leaves_no_orphan_and_no_vanished_record() {
    let payload = vm_payload();
    let dir = tempfile::tempdir().unwrap();
    let _reaper = KillQemusUnder(dir.path().to_owned());
    let data = dir.path().join("data");
    let socket = data.join("broker.sock");
    let manifest = kvm_manifest(dir.path(), &payload, "crash", true);

    // Kill points (ms after the clients begin): across qemu-img, the seed,
    // qemu's start and QMP, and the stops between.
    let kills = [900, 2300, 1500, 3100, 600, 1900];
    let modes = ["destroyed", "unknown"];
    let (mut started, mut stopped) = (0, 0);
    let mut details = Vec::new();
    let mut daemon = KilledOnDrop(serve(&data, modes[0], &dir.path().join("daemon-0.log")));
    let body = format!("{{\"manifest\":\"{}\"}}", manifest.display());
    let added = daemon_request(&socket, "POST", "/v1/providers", &body);
    assert_eq!(added.as_ref().map(|(s, _)| *s), Some(201), "{added:?}");
    for (round, kill_after) in kills.into_iter().enumerate() {
        let clients: Vec<_> = (0..3)
            .map(|_| {
                let socket = socket.clone();
                std::thread::spawn(move || start_and_stop_until_killed(&socket))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(kill_after));
        daemon.0.kill().unwrap();
        daemon.0.wait().unwrap();
        for client in clients {
            let (s, t) = client.join().unwrap();
            (started, stopped) = (started + s, stopped + t);
        }

        let mode = modes[round % modes.len()];
        daemon = KilledOnDrop(serve(&data, mode, &dir.path().join(format!("daemon-{}.log", round + 1))));
        let detail = nth_reconcile(&socket, round + 1);
        let listed = daemon_json(&socket, "/v1/instances?provider=kvm");
        let listed = listed.as_array().unwrap();
        let orphans: Vec<&serde_json::Value> = listed.iter().filter(|r| r["created"] == "").collect();
        let vanished: Vec<&serde_json::Value> =
            listed.iter().filter(|r| r["message"] == "not reported by the provider").collect();
        assert!(orphans.is_empty(), "restart {} ({mode}): orphans {orphans:?}; reconcile: {detail}", round + 1);
        assert!(vanished.is_empty(), "restart {} ({mode}): vanished {vanished:?}; reconcile: {detail}", round + 1);
        let log = std::fs::read_to_string(dir.path().join(format!("daemon-{}.log", round + 1))).unwrap_or_default();
        let reaped = log.lines().filter(|l| l.contains("killed a process a killed host left")).count();
        details.push(format!(
            "restart {} ({mode}, killed at {kill_after} ms, {} listed, {reaped} unrecorded processes killed): {detail}",
            round + 1,
            listed.len()
        ));
    }
    // For RELIABILITY.md: what the kills interrupted, and how each restart finished it.
    eprintln!("{started} starts and {stopped} stops answered across {} kills", kills.len());
    for detail in &details {
        eprintln!("{detail}");
    }
    assert!(started > 0, "no start was ever answered: the test exercised nothing");

    // Everything left is the host's to stop, and stopping leaves nothing behind.
    let listed = daemon_json(&socket, "/v1/instances?provider=kvm");
    for record in listed.as_array().unwrap() {
        let id = record["id"].as_str().unwrap();
        let stopped = daemon_request(&socket, "DELETE", &format!("/v1/instances/{id}"), "");
        assert_eq!(stopped.as_ref().map(|(s, _)| *s), Some(200), "{id}: {stopped:?}");
    }
    assert_eq!(daemon_json(&socket, "/v1/instances?provider=kvm"), serde_json::json!([]));
    assert!(!qemu_running_with(&dir.path().display().to_string()), "a qemu outlived its instance");
    let pid = nix::unistd::Pid::from_raw(daemon.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::SIGTERM).unwrap();
    assert!(daemon.0.wait().unwrap().success());
}
