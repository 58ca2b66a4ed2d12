//! Reading LXD's answers: the response envelope (sync, async, error), an
//! operation's outcome, and an instance's state, hardware and NICs.

use crate::LxdError;
use crate::spec::{Nic, juju_arch};
use serde_json::Value;

/// LXD's response envelope.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Sync(Value),
    /// A background operation (`/1.0/operations/<id>`) to wait on.
    Async {
        operation: String,
    },
    Error {
        code: u16,
        message: String,
    },
}

pub fn parse_reply(status: u16, body: &[u8]) -> Result<Reply, LxdError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        LxdError::Provider(format!("LXD answered HTTP {status} with something that is not JSON ({e}): {text:?}"))
    })?;
    match value["type"].as_str() {
        Some("sync") if status < 400 => Ok(Reply::Sync(value["metadata"].clone())),
        Some("async") if status < 400 => match value["operation"].as_str() {
            Some(op) if op.starts_with("/1.0/operations/") => Ok(Reply::Async { operation: op.to_owned() }),
            _ => Err(LxdError::Provider(format!("LXD started an operation without a valid path: {value}"))),
        },
        _ => {
            let code = value["error_code"].as_u64().and_then(|c| u16::try_from(c).ok()).unwrap_or(status);
            let message = value["error"].as_str().filter(|m| !m.is_empty()).unwrap_or("no error message").to_owned();
            Ok(Reply::Error { code, message })
        }
    }
}

/// What `GET /1.0/operations/<id>/wait` says about a finished operation.
pub fn operation_outcome(metadata: &Value) -> Result<(), String> {
    match metadata["status"].as_str() {
        Some("Success") => Ok(()),
        Some(status @ ("Failure" | "Cancelled")) => {
            let err = metadata["err"].as_str().filter(|e| !e.is_empty()).unwrap_or(status);
            Err(err.to_owned())
        }
        other => Err(format!("operation still {}", other.unwrap_or("in an unknown state"))),
    }
}

/// An instance's state as the broker contract sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Running,
    Stopped,
    Pending,
    Error,
    Unknown,
}

/// State and a message (LXD's own status word when it is not plainly running or stopped).
pub fn instance_state(instance: &Value) -> (State, String) {
    let status = instance["status"].as_str().unwrap_or("");
    match status {
        "Running" => (State::Running, String::new()),
        "Stopped" => (State::Stopped, String::new()),
        "Frozen" | "Freezing" => (State::Stopped, "frozen".into()),
        "Starting" | "Thawed" | "Pending" | "Started" => (State::Pending, status.to_ascii_lowercase()),
        "Stopping" | "Aborting" => (State::Stopped, status.to_ascii_lowercase()),
        "Error" => (State::Error, "LXD reports the instance in error".into()),
        "" => (State::Unknown, "LXD reports no status".into()),
        other => (State::Unknown, format!("LXD status {other:?}")),
    }
}

/// Hardware as LXD reports it: architecture, and the limits in effect.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hardware {
    pub arch: Option<String>,
    pub cores: Option<u64>,
    pub mem: Option<u64>,
    pub root_disk: Option<u64>,
}

/// `256MiB`, `1GiB`, `512MB` … in MiB.
pub fn mebibytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    let bytes = match unit.trim() {
        "" | "B" => n,
        "kB" => n * 1000,
        "KiB" => n << 10,
        "MB" => n * 1000 * 1000,
        "MiB" => n << 20,
        "GB" => n * 1000 * 1000 * 1000,
        "GiB" => n << 30,
        "TB" => n * 1000 * 1000 * 1000 * 1000,
        "TiB" => n << 40,
        _ => return None,
    };
    Some(bytes >> 20)
}

pub fn hardware(instance: &Value) -> Hardware {
    let config = &instance["expanded_config"];
    let root = &instance["expanded_devices"]["root"];
    Hardware {
        arch: instance["architecture"].as_str().and_then(juju_arch).map(str::to_owned),
        // `limits.cpu` is a count or a CPU set (`0-1,3`); only a count is a core count.
        cores: config["limits.cpu"].as_str().and_then(|c| c.parse().ok()),
        mem: config["limits.memory"].as_str().and_then(mebibytes),
        root_disk: root["size"].as_str().and_then(mebibytes),
    }
}

/// The bridged NICs of an instance, with the MAC LXD gave each.
pub fn nics(instance: &Value) -> Vec<Nic> {
    let Some(devices) = instance["expanded_devices"].as_object() else { return Vec::new() };
    let config = &instance["expanded_config"];
    let mut out: Vec<Nic> = devices
        .iter()
        .filter(|(_, d)| d["type"] == "nic")
        .map(|(device, d)| {
            let hwaddr = d["hwaddr"]
                .as_str()
                .or_else(|| config[format!("volatile.{device}.hwaddr")].as_str())
                .unwrap_or_default()
                .to_owned();
            Nic {
                device: device.clone(),
                parent: d["parent"].as_str().or_else(|| d["network"].as_str()).unwrap_or_default().to_owned(),
                hwaddr,
                mtu: d["mtu"].as_str().and_then(|m| m.parse().ok()).unwrap_or(0),
            }
        })
        .collect();
    out.sort_by(|a, b| a.device.cmp(&b.device));
    out
}

/// How the instance's NICs differ from the ones asked for (empty: they match).
pub fn nic_differences(wanted: &[Nic], have: &[Nic]) -> Vec<String> {
    let mut out = Vec::new();
    for want in wanted {
        match have.iter().find(|h| h.device == want.device) {
            None => out.push(format!("NIC {} is missing", want.device)),
            Some(h) => {
                if h.parent != want.parent {
                    out.push(format!("NIC {} is on {:?}, not {:?}", want.device, h.parent, want.parent));
                }
                if !want.hwaddr.is_empty() && !h.hwaddr.eq_ignore_ascii_case(&want.hwaddr) {
                    out.push(format!("NIC {} has MAC {:?}, not {:?}", want.device, h.hwaddr, want.hwaddr));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelopes() {
        let sync = br#"{"type":"sync","status":"Success","status_code":200,"metadata":{"name":"c1"}}"#;
        assert_eq!(parse_reply(200, sync).unwrap(), Reply::Sync(json!({"name":"c1"})));
        let op = br#"{"type":"async","operation":"/1.0/operations/abc","metadata":{}}"#;
        assert_eq!(parse_reply(202, op).unwrap(), Reply::Async { operation: "/1.0/operations/abc".into() });
        let err = br#"{"type":"error","error":"Instance not found","error_code":404}"#;
        assert_eq!(parse_reply(404, err).unwrap(), Reply::Error { code: 404, message: "Instance not found".into() });
        assert!(parse_reply(500, b"<html>").unwrap_err().to_string().contains("not JSON"));
        assert!(parse_reply(202, br#"{"type":"async","operation":"/etc/passwd"}"#).is_err());
    }

    #[test]
    fn operations_and_states() {
        assert_eq!(operation_outcome(&json!({"status":"Success"})), Ok(()));
        assert_eq!(operation_outcome(&json!({"status":"Failure","err":"no space"})), Err("no space".into()));
        assert!(operation_outcome(&json!({"status":"Running"})).is_err());
        assert_eq!(instance_state(&json!({"status":"Running"})).0, State::Running);
        assert_eq!(instance_state(&json!({"status":"Frozen"})), (State::Stopped, "frozen".into()));
        assert_eq!(instance_state(&json!({})).0, State::Unknown);
    }

    #[test]
    fn hardware_and_nics_from_what_lxd_reports() {
        let instance = json!({
            "architecture": "x86_64",
            "expanded_config": {"limits.cpu": "2", "limits.memory": "1GiB", "volatile.eth1.hwaddr": "00:16:3e:9:9:9"},
            "expanded_devices": {
                "root": {"type": "disk", "path": "/", "pool": "default", "size": "2048MiB"},
                "eth0": {"type": "nic", "nictype": "bridged", "parent": "br0", "hwaddr": "00:16:3e:00:00:01", "mtu": "1400"},
                "eth1": {"type": "nic", "nictype": "bridged", "parent": "br1"},
            }
        });
        let hw = hardware(&instance);
        assert_eq!(hw, Hardware { arch: Some("amd64".into()), cores: Some(2), mem: Some(1024), root_disk: Some(2048) });
        assert_eq!(hardware(&json!({"expanded_config": {"limits.cpu": "0-1"}})).cores, None);
        let found = nics(&instance);
        assert_eq!(found.len(), 2);
        assert_eq!((found[0].parent.as_str(), found[0].mtu), ("br0", 1400));
        assert_eq!(found[1].hwaddr, "00:16:3e:9:9:9", "LXD-chosen MACs come from volatile config");
        let wanted = [Nic { device: "eth0".into(), parent: "br0".into(), hwaddr: "00:16:3E:00:00:01".into(), mtu: 0 }];
        assert!(nic_differences(&wanted, &found).is_empty());
        let moved = [Nic { device: "eth0".into(), parent: "br9".into(), ..Nic::default() }];
        assert_eq!(nic_differences(&moved, &found).len(), 1);
        let missing = [Nic { device: "eth5".into(), ..Nic::default() }];
        assert!(nic_differences(&missing, &found)[0].contains("missing"));
        assert_eq!(mebibytes("512MB"), Some(488));
        assert_eq!(mebibytes("lots"), None);
    }
}
