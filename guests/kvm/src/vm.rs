//! One VM's life: make its files and taps, run qemu, and take it all down again.

use crate::qmp::Qmp;
use broker_guest::process::{self, Child, ChildStatus};
use broker_guest::types::{BrokerError, InstanceStatus};
use broker_guest::{host_kv, network_bridge};
use kvm_logic::qemu;
use kvm_logic::spec::{self, Boot, Nic, Size, VmPaths, VmRecord};
use kvm_logic::{Config, qmp};
use std::time::Duration;

/// How long qemu may take to open its QMP socket.
const QMP_WAIT: Duration = Duration::from_secs(10);
/// After `quit` (or SIGTERM), how long before SIGKILL.
const QUIT_GRACE_MS: u64 = 3_000;
const SIGKILL: i32 = 9;

fn provider(message: String) -> BrokerError {
    BrokerError::Provider(message)
}

/// Run a granted program to completion; a non-zero exit is an error with its stderr.
pub fn run(program: &str, args: &[String]) -> Result<(), BrokerError> {
    let output = process::run(program, args, &[], &[], 0)?;
    if output.exit_code == Some(0) {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    Err(provider(format!(
        "{program} failed ({}): {}",
        match (output.exit_code, output.signal, output.timed_out) {
            (_, _, true) => "timed out".to_owned(),
            (Some(code), _, _) => format!("exit {code}"),
            (None, signal, _) => format!("signal {signal:?}"),
        },
        stderr.trim()
    )))
}

/// The last lines qemu wrote to its log, for an error message.
fn log_tail(name: &str) -> String {
    let text = std::fs::read_to_string(format!("/data/logs/{name}.log")).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(5).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

pub struct Plan<'a> {
    pub config: &'a Config,
    pub name: String,
    pub seq: u64,
    pub size: Size,
    pub boot: Boot,
    pub nics: Vec<Nic>,
    /// The netplan network-config of the seed.
    pub seed_network: serde_json::Value,
    pub user_data: Option<Vec<u8>>,
}

impl Plan<'_> {
    pub fn paths(&self) -> VmPaths {
        spec::paths(&self.name, self.seq)
    }

    pub fn record(&self, virt_type: &str) -> VmRecord {
        VmRecord {
            name: self.name.clone(),
            seq: self.seq,
            mem: self.size.mem,
            cores: self.size.cores,
            root_disk: self.size.root_disk,
            virt_type: virt_type.to_owned(),
            nics: self.nics.clone(),
        }
    }
}

pub fn save(record: &VmRecord) -> Result<(), BrokerError> {
    let bytes = serde_json::to_vec(record).map_err(|e| provider(e.to_string()))?;
    Ok(host_kv::set(&spec::record_key(&record.name), &bytes)?)
}

pub fn load(name: &str) -> Result<Option<VmRecord>, BrokerError> {
    host_kv::get(&spec::record_key(name))?.map(|bytes| decode(name, &bytes)).transpose()
}

pub fn decode(name: &str, bytes: &[u8]) -> Result<VmRecord, BrokerError> {
    serde_json::from_slice(bytes).map_err(|e| provider(format!("VM record {name} is unreadable: {e}")))
}

/// Make the disk, the seed and the taps, start qemu, and wait until QMP says
/// it runs. Returns the virt type qemu really uses. Everything made is in the
/// record saved first, so a failure (or a crash) can be undone by [`teardown`].
pub fn create(plan: &Plan, on_starting: impl FnOnce() -> Result<(), BrokerError>) -> Result<String, BrokerError> {
    let config = plan.config;
    let paths = plan.paths();
    save(&plan.record(""))?;
    let io = |what: &str, e: std::io::Error| provider(format!("{what}: {e}"));
    std::fs::create_dir_all(&paths.seed_dir).map_err(|e| io(&paths.seed_dir, e))?;
    std::fs::create_dir_all("/data/run").map_err(|e| io("/data/run", e))?;

    run(&config.qemu_img, &qemu::root_disk_args(config, &plan.boot, &plan.size, &paths))?;
    let seed = qemu::seed(&plan.name, plan.user_data.as_deref(), &plan.seed_network);
    for (file, content) in &seed.files {
        let path = format!("{}/{file}", paths.seed_dir);
        std::fs::write(&path, content).map_err(|e| io(&path, e))?;
    }
    run(&config.iso_builder, &qemu::seed_iso_args(&paths, &seed))?;
    for nic in &plan.nics {
        network_bridge::create_tap(&nic.tap, &nic.bridge, &spec::tap_mac(&nic.mac))?;
    }

    on_starting()?;
    let args = qemu::qemu_args(config, &plan.name, &plan.boot, &plan.size, &paths, &plan.nics);
    let child = process::spawn(&plan.name, &config.qemu, &args, &[])?;
    let mut monitor = Qmp::connect(&paths.qmp, &child, QMP_WAIT)
        .map_err(|e| provider(format!("{}; qemu said: {}", e.message(), log_tail(&plan.name))))?;
    let virt_type = qmp::virt_type(&monitor.execute("query-kvm", None)?);
    let state = qmp::run_state(&monitor.execute("query-status", None)?);
    if state != "running" {
        return Err(provider(format!("qemu is {state}, not running; qemu said: {}", log_tail(&plan.name))));
    }
    save(&plan.record(virt_type))?;
    Ok(virt_type.to_owned())
}

/// Stop qemu (ACPI powerdown, then `quit`, then SIGKILL) and remove every
/// trace of the VM: its record, files, QMP socket, taps and child record.
/// Steps that find nothing to do are not errors; the first real failure is.
pub fn teardown(name: &str, seq: u64, nics: &[Nic], powerdown_grace_ms: u64) -> Result<(), BrokerError> {
    let paths = spec::paths(name, seq);
    match process::adopt(name) {
        Ok(Some(child)) => {
            stop_child(&child, &paths.qmp, powerdown_grace_ms);
            if matches!(child.status(), ChildStatus::Running) {
                return Err(provider(format!("qemu of {name} (pid {}) would not die", child.pid())));
            }
            child.forget();
        }
        // Without the process grant nothing was ever spawned; the files still go.
        Ok(None) | Err(BrokerError::AccessDenied(_)) => {}
        Err(err) => return Err(err),
    }
    let mut first_error = None;
    for nic in nics {
        if let Err(err) = network_bridge::delete_link(&nic.tap)
            && !matches!(err, BrokerError::NotFound(_))
        {
            first_error.get_or_insert(err);
        }
    }
    for result in [std::fs::remove_dir_all(&paths.dir), std::fs::remove_file(&paths.qmp)] {
        if let Err(e) = result
            && e.kind() != std::io::ErrorKind::NotFound
        {
            first_error.get_or_insert(provider(format!("removing files of {name}: {e}")));
        }
    }
    host_kv::delete(&spec::record_key(name))?;
    first_error.map_or(Ok(()), Err)
}

fn stop_child(child: &Child, qmp_path: &str, powerdown_grace_ms: u64) {
    if !matches!(child.status(), ChildStatus::Running) {
        return;
    }
    let mut monitor = Qmp::connect(qmp_path, child, Duration::from_millis(200)).ok();
    if powerdown_grace_ms > 0
        && let Some(m) = monitor.as_mut()
        && m.execute("system_powerdown", None).is_ok()
        && !matches!(child.wait(powerdown_grace_ms), ChildStatus::Running)
    {
        return;
    }
    let quit = monitor.as_mut().is_some_and(|m| m.execute("quit", None).is_ok());
    if !quit {
        let _ = child.signal(15);
    }
    if matches!(child.wait(QUIT_GRACE_MS), ChildStatus::Running) {
        let _ = child.signal(SIGKILL);
        child.wait(QUIT_GRACE_MS);
    }
}

/// The live state of a recorded VM: from QMP if its qemu runs, `unknown` if it is gone.
pub fn observe(record: &VmRecord) -> (InstanceStatus, String) {
    let child = match process::adopt(&record.name) {
        Ok(Some(child)) => child,
        Ok(None) => return (InstanceStatus::Unknown, "qemu process is gone".into()),
        Err(err) => return (InstanceStatus::Unknown, err.message().to_owned()),
    };
    match child.status() {
        ChildStatus::Running => {}
        ChildStatus::Exited(code) => return (InstanceStatus::Unknown, format!("qemu exited with code {code}")),
        ChildStatus::Signalled(signal) => {
            return (InstanceStatus::Unknown, format!("qemu was killed by signal {signal}"));
        }
        ChildStatus::Gone => return (InstanceStatus::Unknown, "qemu process is gone".into()),
    }
    let paths = spec::paths(&record.name, record.seq);
    let state =
        Qmp::connect(&paths.qmp, &child, Duration::from_millis(500)).and_then(|mut m| m.execute("query-status", None));
    match state.map(|ret| qmp::run_state(&ret)) {
        Ok(s) if s == "running" => (InstanceStatus::Running, String::new()),
        Ok(s) if s == "paused" || s == "suspended" => (InstanceStatus::Stopped, "paused".into()),
        Ok(s) if s == "shutdown" => (InstanceStatus::Stopped, "shutoff".into()),
        Ok(other) => (InstanceStatus::Unknown, format!("qemu reports {other}")),
        Err(err) => (InstanceStatus::Unknown, format!("QMP: {}", err.message())),
    }
}
