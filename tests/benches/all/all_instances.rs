//! One `all-instances` call of the fake provider with 0 and 100 instances:
//! (a) the same logic called natively, (b) through the host in `pooled` mode,
//! (c) in `per-call` mode, (d) out of process as JSON-RPC 2.0 over a unix socket.
//!
//! cargo bench -p broker-tests --bench all_instances

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use broker_capabilities::bindings::{Instance, InstanceStatus};
use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::kv::MemoryKv;
use broker_core::version::ProviderVersion;
use broker_tests::{fake_manifest_extra, load_provider, runtime};
use criterion::{BenchmarkId, Criterion, criterion_group};
use serde::Deserialize;
use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

const SIZES: [usize; 2] = [0, 100];

fn native_all(kv: &fake_logic::MemoryKv) -> Vec<Instance> {
    fake_logic::all(kv)
        .expect("native all")
        .into_iter()
        .map(|f| Instance { id: f.id, status: InstanceStatus::Running, message: String::new(), addresses: vec![] })
        .collect()
}

#[derive(Deserialize)]
#[allow(dead_code)]
struct RpcInstance {
    id: String,
    status: String,
    message: String,
    addresses: Vec<String>,
}

#[derive(Deserialize)]
struct RpcResponse<T> {
    result: T,
}

/// A client of the out-of-process server, one connection reused across calls.
struct RpcClient {
    server: Child,
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    line: String,
    next_id: u64,
    _dir: tempfile::TempDir,
}

impl RpcClient {
    fn spawn() -> RpcClient {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fake.sock");
        let server = Command::new(env!("CARGO_BIN_EXE_fake-jsonrpc")).arg(&socket).spawn().expect("spawn server");
        let stream = (0..500)
            .find_map(|_| {
                UnixStream::connect(&socket).ok().or_else(|| {
                    std::thread::sleep(Duration::from_millis(10));
                    None
                })
            })
            .expect("server socket");
        RpcClient {
            server,
            writer: stream.try_clone().unwrap(),
            reader: BufReader::new(stream),
            line: String::new(),
            next_id: 0,
            _dir: dir,
        }
    }

    fn call<T: for<'de> Deserialize<'de>>(&mut self, method: &str) -> T {
        self.next_id += 1;
        let request = serde_json::json!({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": null});
        let mut bytes = serde_json::to_vec(&request).unwrap();
        bytes.push(b'\n');
        self.writer.write_all(&bytes).unwrap();
        self.line.clear();
        self.reader.read_line(&mut self.line).unwrap();
        serde_json::from_str::<RpcResponse<T>>(&self.line).expect("response").result
    }
}

impl Drop for RpcClient {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

fn wasm_provider(
    isolation: &str,
    instances: usize,
    rt: &tokio::runtime::Runtime,
) -> (tempfile::TempDir, ProviderVersion) {
    let dir = tempfile::tempdir().unwrap();
    let provider = load_provider(
        &runtime(),
        Arc::new(MemoryKv::default()),
        dir.path(),
        "fake",
        "fake",
        &fake_manifest_extra(isolation),
    )
    .expect("load fake");
    rt.block_on(async {
        for _ in 0..instances {
            provider.start_instance(&CallHooks::default(), &empty_params()).await.unwrap();
        }
        assert_eq!(provider.all_instances(&CallHooks::default()).await.unwrap().len(), instances);
    });
    (dir, provider)
}

fn all_instances(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut group = c.benchmark_group("all_instances");
    for n in SIZES {
        let kv = fake_logic::MemoryKv::default();
        for _ in 0..n {
            fake_logic::start(&kv, &fake_logic::Config::default(), fake_logic::StartRequest::default()).unwrap();
        }
        group.bench_with_input(BenchmarkId::new("native", n), &n, |b, _| b.iter(|| black_box(native_all(&kv))));

        for isolation in ["pooled", "per-call"] {
            let (_dir, provider) = wasm_provider(isolation, n, &rt);
            let hooks = CallHooks::default();
            group.bench_with_input(BenchmarkId::new(isolation, n), &n, |b, _| {
                b.to_async(&rt).iter(|| async { black_box(provider.all_instances(&hooks).await.unwrap()) })
            });
        }

        let mut client = RpcClient::spawn();
        for _ in 0..n {
            let _: serde_json::Value = client.call("InstanceBroker.StartInstance");
        }
        assert_eq!(client.call::<Vec<RpcInstance>>("InstanceBroker.AllInstances").len(), n);
        group.bench_with_input(BenchmarkId::new("jsonrpc", n), &n, |b, _| {
            b.iter(|| black_box(client.call::<Vec<RpcInstance>>("InstanceBroker.AllInstances")))
        });
    }
    group.finish();
}

criterion_group!(benches, all_instances);
