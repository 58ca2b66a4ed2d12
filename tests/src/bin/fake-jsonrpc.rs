//! Bench-only: the fake provider's logic served out of process as JSON-RPC 2.0
//! over a unix socket (InfraKit's plugin transport), one request per line.
//!
//! Usage: fake-jsonrpc SOCKET_PATH
//! Methods: `InstanceBroker.StartInstance`, `InstanceBroker.StopInstances`
//! (params: [ids]), `InstanceBroker.AllInstances`.

use fake_logic::{Config, FakeInstance, MemoryKv, StartRequest};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};

fn instance_json(instance: &FakeInstance) -> Value {
    json!({
        "id": instance.id,
        "status": "running",
        "message": "",
        "addresses": instance.addresses,
    })
}

fn handle(kv: &MemoryKv, config: &Config, request: &Value) -> Result<Value, String> {
    let params = request.get("params").cloned().unwrap_or(Value::Null);
    match request.get("method").and_then(Value::as_str) {
        Some("InstanceBroker.StartInstance") => {
            let instance = fake_logic::start(kv, config, StartRequest::default()).map_err(|e| e.to_string())?;
            Ok(instance_json(&instance))
        }
        Some("InstanceBroker.StopInstances") => {
            let ids: Vec<String> = serde_json::from_value(params).map_err(|e| e.to_string())?;
            fake_logic::stop(kv, &ids).map_err(|e| e.to_string())?;
            Ok(Value::Null)
        }
        Some("InstanceBroker.AllInstances") => {
            let all = fake_logic::all(kv).map_err(|e| e.to_string())?;
            Ok(Value::Array(all.iter().map(instance_json).collect()))
        }
        other => Err(format!("unknown method {other:?}")),
    }
}

fn serve(stream: UnixStream, kv: &MemoryKv, config: &Config) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let response = match serde_json::from_str::<Value>(&line) {
            Ok(request) => {
                let id = request.get("id").cloned().unwrap_or(Value::Null);
                match handle(kv, config, &request) {
                    Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
                    Err(message) => json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": message}}),
                }
            }
            Err(e) => json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": e.to_string()}}),
        };
        let mut bytes = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        writer.write_all(&bytes)?;
    }
}

fn main() -> std::io::Result<()> {
    let path = std::env::args().nth(1).ok_or_else(|| std::io::Error::other("usage: fake-jsonrpc SOCKET_PATH"))?;
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    let kv = MemoryKv::default();
    let config = Config::default();
    for stream in listener.incoming() {
        serve(stream?, &kv, &config)?;
    }
    Ok(())
}
