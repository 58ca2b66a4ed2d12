//! QMP, the qemu monitor protocol: one JSON object per line each way.

use serde_json::{Value, json};

/// One line qemu sent.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Greeting,
    Return(Value),
    Error {
        class: String,
        desc: String,
    },
    /// Asynchronous; not an answer.
    Event(String),
}

pub fn parse(line: &str) -> Result<Reply, String> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| format!("QMP sent a line that is not JSON ({e}): {line:.200}"))?;
    if value.get("QMP").is_some() {
        return Ok(Reply::Greeting);
    }
    if let Some(ret) = value.get("return") {
        return Ok(Reply::Return(ret.clone()));
    }
    if let Some(err) = value.get("error") {
        let text = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or_default().to_owned();
        return Ok(Reply::Error { class: text("class"), desc: text("desc") });
    }
    if let Some(event) = value.get("event").and_then(Value::as_str) {
        return Ok(Reply::Event(event.to_owned()));
    }
    Err(format!("QMP sent an unexpected message: {line:.200}"))
}

/// A command line to send (with its newline).
pub fn command(name: &str, arguments: Option<Value>) -> Vec<u8> {
    let mut message = json!({ "execute": name });
    if let Some(arguments) = arguments {
        message["arguments"] = arguments;
    }
    let mut line = message.to_string().into_bytes();
    line.push(b'\n');
    line
}

/// The VM's state from `query-status` (`running`, `paused`, `shutdown`, …).
pub fn run_state(ret: &Value) -> String {
    ret.get("status").and_then(Value::as_str).unwrap_or("unknown").to_owned()
}

/// `kvm` when `query-kvm` says KVM is in use, else `qemu` (TCG), as libvirt names them.
pub fn virt_type(ret: &Value) -> &'static str {
    if ret.get("enabled").and_then(Value::as_bool) == Some(true) { "kvm" } else { "qemu" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_told_apart() {
        assert_eq!(parse(r#"{"QMP": {"version": {}, "capabilities": []}}"#), Ok(Reply::Greeting));
        assert_eq!(parse(r#"{"return": {}}"#), Ok(Reply::Return(json!({}))));
        assert_eq!(
            parse(r#"{"error": {"class": "GenericError", "desc": "no"}}"#),
            Ok(Reply::Error { class: "GenericError".into(), desc: "no".into() })
        );
        assert_eq!(parse(r#"{"event": "POWERDOWN", "timestamp": {}}"#), Ok(Reply::Event("POWERDOWN".into())));
        assert!(parse("garbage").is_err());
        assert!(parse("{}").is_err());
        assert_eq!(command("quit", None), b"{\"execute\":\"quit\"}\n");
        assert_eq!(run_state(&json!({"status": "paused", "running": false})), "paused");
        assert_eq!(virt_type(&json!({"enabled": true, "present": true})), "kvm");
        assert_eq!(virt_type(&json!({"enabled": false, "present": true})), "qemu");
    }
}
