//! Start latency of an LXD container through the broker (host + wasm
//! provider + wasi:http egress) against the same REST calls made natively
//! with the host's own egress client, side by side, on a real incusd this
//! benchmark starts (and stops) itself. Each sample is one start to Running;
//! the container is deleted afterwards, untimed.
//!
//! `cargo bench -p broker-tests --bench lxd_start`

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::constraints;
use broker_capabilities::contract::params_with;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::http_egress::{self, EgressTarget, HttpGrant};
use broker_core::broker::Broker;
use broker_tests::incus::{IncusDaemon, lxd_manifest_text};
use criterion::{Criterion, criterion_group};
use http_body_util::{BodyExt, Empty, Full};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use wasmtime_wasi_http::WasiBody;

/// One REST call through the host's egress client, as the provider's would go.
async fn rest(grant: &HttpGrant, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let body: WasiBody = match &body {
        Some(v) => Full::new(bytes::Bytes::from(v.to_string())).map_err(|never| match never {}).boxed_unsync(),
        None => Empty::new().map_err(|never| match never {}).boxed_unsync(),
    };
    // wasi:http sets Host to the authority; Go's server refuses HTTP/1.1 without one.
    let request = http::Request::builder()
        .method(method)
        .uri(format!("http://lxd{path}"))
        .header("host", "lxd")
        .body(body)
        .unwrap();
    let (response, _io) = http_egress::send(grant, request, None).await.unwrap().unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

async fn wait(grant: &HttpGrant, reply: &Value) {
    let operation = reply["operation"].as_str().unwrap();
    let (_, done) = rest(grant, "GET", &format!("{operation}/wait?timeout=120&project=default"), None).await;
    assert_eq!(done["metadata"]["status"], "Success", "{done}");
}

/// The provider's calls for a start, natively: alias, look, create, wait, start, wait, look.
async fn native_start(grant: &HttpGrant, name: &str) {
    let q = "project=default";
    assert_eq!(rest(grant, "GET", &format!("/1.0/images/aliases/busybox?{q}"), None).await.0, 200);
    assert_eq!(rest(grant, "GET", &format!("/1.0/instances/{name}?{q}"), None).await.0, 404);
    let spec = json!({
        "name": name, "type": "container", "source": {"type": "image", "alias": "busybox"},
        "profiles": ["default"], "devices": {}, "config": {"boot.autostart": "true", "limits.memory": "128MiB"},
    });
    let (_, created) = rest(grant, "POST", &format!("/1.0/instances?{q}"), Some(spec)).await;
    wait(grant, &created).await;
    let start = json!({"action": "start", "timeout": 30, "force": false});
    let (_, started) = rest(grant, "PUT", &format!("/1.0/instances/{name}/state?{q}"), Some(start)).await;
    wait(grant, &started).await;
    let (_, instance) = rest(grant, "GET", &format!("/1.0/instances/{name}?{q}"), None).await;
    assert_eq!(instance["metadata"]["status"], "Running");
}

fn bench(c: &mut Criterion) {
    let daemon = IncusDaemon::start("br-lxdbench");
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let broker = Broker::open(&dir.path().join("host")).unwrap();
    let manifest = dir.path().join("lxd.toml");
    std::fs::write(&manifest, lxd_manifest_text(&daemon.socket(), "lxd", "bench", true)).unwrap();
    runtime.block_on(broker.registry().add(&manifest)).unwrap();
    let params = params_with(constraints::parse("mem=128M").unwrap());
    let grant = HttpGrant::new([("lxd".to_owned(), EgressTarget::Unix(daemon.socket()))]).unwrap();

    let mut group = c.benchmark_group("lxd_start_to_running");
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(15));
    group.bench_function("broker", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let started = Instant::now();
                let record = runtime.block_on(broker.start_instance("lxd", &params, &CallHooks::default())).unwrap();
                total += started.elapsed();
                runtime.block_on(broker.stop_instances("lxd", &[record.id])).unwrap();
            }
            total
        })
    });
    let mut seq = 0;
    group.bench_function("native_rest", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                seq += 1;
                let name = format!("native-{seq}");
                let started = Instant::now();
                runtime.block_on(native_start(&grant, &name));
                total += started.elapsed();
                daemon.incus_ok(&["delete", "--force", &name]);
            }
            total
        })
    });
    group.finish();
    drop(daemon);
}

criterion_group!(benches, bench);
