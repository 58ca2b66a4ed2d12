//! A provider that misbehaves on demand, to test the host's containment.
//! `all-instances` reads the kv key `mode`:
//! - `count` (or absent): returns one instance whose id is the number of calls
//!   this wasm instance has served — it tells a reused instance from a fresh one;
//! - `trap`: panics (a wasm trap);
//! - `loop`: spins forever (only the deadline stops it);
//! - `memhog`: allocates until memory runs out;
//! - `print`: writes a line to stdout and one to stderr;
//! - `lock`: takes the machine lock and releases it, returning instance `locked`;
//! - `lock-leak`: takes the machine lock and forgets the guard;
//! - `run`: runs `echo hello` through the process capability, returning its output as the id;
//! - `fs`: writes `/data/hello.txt` and reads it back, returning its text as the id;
//! - `bridge:<dev>`: bridges `<dev>` into its Juju bridge and returns the visible devices, comma-separated.
//!
//! The other methods behave.

use broker_guest::types::{
    BrokerError, Instance, InstanceStatus, ProviderInfo, StartInstanceParams, StartInstanceResult,
};
use broker_guest::{CallContext, Guest, host_kv, machine_lock, network_bridge, process};
use std::sync::atomic::{AtomicU64, Ordering};

static CALLS_SERVED: AtomicU64 = AtomicU64::new(0);

struct Hostile;

fn mode() -> String {
    match host_kv::get("mode") {
        Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
        _ => "count".into(),
    }
}

impl Guest for Hostile {
    fn describe() -> ProviderInfo {
        ProviderInfo { name: "hostile".into(), version: env!("CARGO_PKG_VERSION").into(), features: vec![] }
    }

    /// Traps on a config that mentions `trap-validate` (hot-swap refusal tests).
    fn validate_config(config: String) -> Result<(), BrokerError> {
        if config.contains("trap-validate") {
            panic!("validate-config was told to trap");
        }
        Ok(())
    }

    fn start_instance(_ctx: &CallContext, _params: StartInstanceParams) -> Result<StartInstanceResult, BrokerError> {
        Err(BrokerError::NotSupported("the hostile provider starts nothing".into()))
    }

    fn stop_instances(_ctx: &CallContext, _ids: Vec<String>) -> Result<(), BrokerError> {
        Ok(())
    }

    fn all_instances(_ctx: &CallContext) -> Result<Vec<Instance>, BrokerError> {
        let served = CALLS_SERVED.fetch_add(1, Ordering::SeqCst) + 1;
        match mode().as_str() {
            "trap" => panic!("hostile guest traps on purpose"),
            "loop" => {
                let mut spins: u64 = 0;
                loop {
                    spins = std::hint::black_box(spins.wrapping_add(1));
                }
            }
            "memhog" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            mode @ ("lock" | "lock-leak") => {
                let guard = machine_lock::acquire("hostile", mode, 1000)?;
                if mode == "lock-leak" {
                    std::mem::forget(guard);
                } else {
                    guard.release();
                }
                Ok(vec![Instance {
                    id: "locked".into(),
                    status: InstanceStatus::Running,
                    message: String::new(),
                    addresses: vec![],
                }])
            }
            "run" => {
                let out = process::run("echo", &["hello".to_string()], &[], &[], 5000)?;
                Ok(vec![instance(String::from_utf8_lossy(&out.stdout).trim())])
            }
            "fs" => {
                let written = std::fs::write("/data/hello.txt", "written by the guest")
                    .and_then(|_| std::fs::read_to_string("/data/hello.txt"));
                let outside = std::fs::read_to_string("/etc/passwd").is_ok();
                match written {
                    Ok(text) if !outside => Ok(vec![instance(&text)]),
                    Ok(_) => Err(BrokerError::Provider("could read /etc/passwd".into())),
                    Err(e) => Err(BrokerError::Provider(format!("data dir: {e}"))),
                }
            }
            mode if mode.starts_with("bridge:") => {
                let device = &mode["bridge:".len()..];
                let change = network_bridge::DeviceToBridge {
                    device: device.into(),
                    bridge: network_bridge::bridge_name(device),
                    mac: String::new(),
                };
                network_bridge::bridge(&[change])?;
                let names: Vec<String> = network_bridge::devices()?.into_iter().map(|d| d.name).collect();
                Ok(vec![instance(&names.join(","))])
            }
            "print" => {
                println!("hello from the hostile guest's stdout");
                eprintln!("hello from the hostile guest's stderr");
                Ok(vec![])
            }
            _ => Ok(vec![Instance {
                id: served.to_string(),
                status: InstanceStatus::Running,
                message: String::new(),
                addresses: vec![],
            }]),
        }
    }

    fn maintain_instance(_ctx: &CallContext, _id: String, _params: StartInstanceParams) -> Result<(), BrokerError> {
        Ok(())
    }
}

fn instance(id: &str) -> Instance {
    Instance { id: id.to_owned(), status: InstanceStatus::Running, message: String::new(), addresses: vec![] }
}

broker_guest::export_provider!(Hostile);
