//! Helpers for the end-to-end tests and benchmarks: providers loaded from the
//! built guests with manifests written on the fly.

use broker_capabilities::rooms::kv::KvBackend;
use broker_capabilities::rooms::process::MemoryChildRecords;
use broker_core::manifest::Manifest;
use broker_core::runtime::{HostCapabilities, Runtime};
use broker_core::version::ProviderVersion;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use guest_artifacts::{manifest as bundled_manifest, manifest_text as bundled_manifest_text, wasm};

pub mod incus;
pub mod moto;
pub mod netns;

/// Write `provider.toml` for a built guest into `dir`; `extra` is appended
/// TOML (isolation, limits, grants, config).
pub fn write_manifest(dir: &Path, name: &str, guest_crate: &str, extra: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!("name = \"{name}\"\ncomponent = \"{}\"\n{extra}\n", wasm(guest_crate).display());
    std::fs::write(&path, text).expect("write manifest");
    path
}

/// Load a provider from manifest text written for a built guest.
pub fn load_provider(
    runtime: &Arc<Runtime>,
    kv: Arc<dyn KvBackend>,
    dir: &Path,
    name: &str,
    guest_crate: &str,
    extra: &str,
) -> Result<ProviderVersion, broker_core::version::LoadError> {
    load_provider_with(runtime, host_capabilities(dir, kv), dir, name, guest_crate, extra)
}

/// Host capabilities for tests: the given kv, no machine lock, data dirs under `dir/data`.
/// The network is the host's kernel (in a test's own namespace), its owners recorded in memory.
pub fn host_capabilities(dir: &Path, kv: Arc<dyn KvBackend>) -> HostCapabilities {
    host_capabilities_with_owners(dir, kv, Arc::new(broker_capabilities::network::owners::MemoryOwners::default()))
}

/// As [`host_capabilities`], with the record of device owners given (shared
/// by providers loaded apart, as one host's store is).
pub fn host_capabilities_with_owners(
    dir: &Path,
    kv: Arc<dyn KvBackend>,
    owners: Arc<dyn broker_capabilities::network::owners::DeviceOwners>,
) -> HostCapabilities {
    use broker_capabilities::network::owners::OwnedNetwork;
    let mut caps =
        HostCapabilities::on_host(kv, dir.join("data"), Default::default(), Arc::new(MemoryChildRecords::default()));
    let network = OwnedNetwork::new(Arc::new(broker_capabilities::network::backend::HostNetwork), owners);
    caps.backends = caps.backends.with::<broker_capabilities::rooms::network_bridge::NetworkBridge>(Arc::new(network));
    caps
}

/// As [`load_provider`], with every host capability given.
pub fn load_provider_with(
    runtime: &Arc<Runtime>,
    capabilities: HostCapabilities,
    dir: &Path,
    name: &str,
    guest_crate: &str,
    extra: &str,
) -> Result<ProviderVersion, broker_core::version::LoadError> {
    let manifest = Manifest::load(&write_manifest(dir, name, guest_crate, extra))?;
    ProviderVersion::load(runtime.clone(), manifest, capabilities)
}

/// Grants and config of the bundled fake, with a chosen isolation.
pub fn fake_manifest_extra(isolation: &str) -> String {
    format!(
        "isolation = \"{isolation}\"\n[limits]\nmemory-mib = 64\n[grants]\nkv = true\nlog = true\n\
         [config]\nzones = [\"zone-a\", \"zone-b\", \"zone-c\"]\n"
    )
}

/// The resident set of process `pid`, in KiB (0 if it cannot be read).
pub fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap_or_default();
    line.trim().trim_end_matches("kB").trim().parse().unwrap_or(0)
}

/// One runtime for a test binary: the engine and its epoch thread are shared.
pub fn runtime() -> Arc<Runtime> {
    Runtime::new(None).expect("engine")
}

/// The bootable payload the KVM tests and benchmark boot (scripts/vm-payload.sh).
pub struct VmPayload {
    /// Holds `vmlinuz`, `initrd.gz` and `accel`.
    pub dir: PathBuf,
    /// `kvm` if a VM really boots under KVM on this machine, else `tcg`.
    pub accel: String,
}

/// `$BROKER_VM_PAYLOAD`, or `target/vm-payload` of this workspace.
pub fn vm_payload() -> VmPayload {
    let dir = std::env::var_os("BROKER_VM_PAYLOAD")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/vm-payload"));
    let accel = std::fs::read_to_string(dir.join("accel")).unwrap_or_else(|_| {
        panic!("no VM payload in {}: run scripts/vm-payload.sh (scripts/test.sh does)", dir.display())
    });
    let dir = dir.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    VmPayload { dir, accel: accel.trim().to_owned() }
}

/// Speak QMP to a qemu monitor on `stream`: read the greeting, leave
/// negotiation, run `commands` in order; each must answer `return` (events in
/// between, e.g. STOP, are skipped). Returns the last answer line.
pub fn qmp_commands(stream: std::os::unix::net::UnixStream, commands: &[&str]) -> String {
    use std::io::{BufRead, BufReader, Write};
    let mut reader = BufReader::new(stream.try_clone().expect("clone the QMP stream"));
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).expect("QMP greeting");
    for command in std::iter::once(&"qmp_capabilities").chain(commands) {
        writeln!(writer, "{{\"execute\":\"{command}\"}}").expect("write to QMP");
        loop {
            line.clear();
            reader.read_line(&mut line).expect("read from QMP");
            if !line.contains("\"event\"") {
                break;
            }
        }
        assert!(line.contains("\"return\""), "QMP {command}: {line}");
    }
    line
}

/// The status updates one call reported, in order.
pub type StatusLog = Arc<std::sync::Mutex<Vec<(broker_capabilities::bindings::InstanceStatus, String)>>>;

/// Call hooks that record every status update (status, info).
pub fn recording_hooks() -> (broker_capabilities::rooms::context::CallHooks, StatusLog) {
    use broker_capabilities::rooms::context::{CallEvent, CallHooks};
    let seen = StatusLog::default();
    let sink = seen.clone();
    let hooks = CallHooks::with_events(move |event| {
        if let CallEvent::Status { status, info, .. } = event {
            sink.lock().expect("status log").push((status, info));
        }
    });
    (hooks, seen)
}

/// The `p` percentile (0.0–1.0) of `sorted` timings, nearest rank; `ZERO`
/// when nothing ran (a filter left the benchmark out).
pub fn percentile(sorted: &[std::time::Duration], p: f64) -> std::time::Duration {
    let last = sorted.len().saturating_sub(1);
    sorted.get((last as f64 * p).round() as usize).copied().unwrap_or_default()
}
