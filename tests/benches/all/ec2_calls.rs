//! What each EC2 call of a start costs against a real EC2-compatible server:
//! moto (signatures checked) behind a TLS front, reached through the host's
//! egress over a fresh TLS connection per request, signed by the host. Each
//! call on its own, and the EC2 provider's start and stop through the real
//! host (DescribeAvailabilityZones, RunInstances, DescribeInstances until
//! running; DescribeInstances, TerminateInstances), measured first: moto lists
//! every instance it ever made, so what runs after many RunInstances is slower.
//!
//! cargo bench -p broker-tests --bench ec2_calls   (needs target/moto-venv: scripts/install-test-deps.sh)

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::rooms::http_egress::signing::AwsSigning;
use broker_capabilities::rooms::http_egress::{EgressBackend, EgressTarget, HostEgress, HttpGrant, Route};
use broker_core::broker::Broker;
use broker_tests::moto::{Moto, TlsFront};
use criterion::{Criterion, criterion_group};
use http_body_util::BodyExt;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

const ZONES: &str = "Action=DescribeAvailabilityZones&Version=2016-11-15";
/// Filtered as a start looks for its own instance: an answer of none or one.
const DESCRIBE: &str = "Action=DescribeInstances&Version=2016-11-15&Filter.1.Name=tag%3Abroker-namespace\
                        &Filter.1.Value.1=calls&MaxResults=1000";
const RUN: &str = "Action=RunInstances&Version=2016-11-15&ImageId=ami-12c6146b&InstanceType=t3.micro\
                   &MinCount=1&MaxCount=1&TagSpecification.1.ResourceType=instance\
                   &TagSpecification.1.Tag.1.Key=other&TagSpecification.1.Tag.1.Value=bench";

fn request(form: &'static str) -> http::Request<wasmtime_wasi_http::WasiBody> {
    let body = http_body_util::Full::new(bytes::Bytes::from_static(form.as_bytes()))
        .map_err(|never| match never {})
        .boxed_unsync();
    http::Request::post("http://ec2/")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("content-length", form.len())
        .body(body)
        .unwrap()
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let moto = Moto::start();
    let front = runtime.block_on(TlsFront::start(moto.port));
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let credentials = data.join("credentials");
    std::fs::create_dir_all(&credentials).unwrap();
    let file = credentials.join("moto.toml");
    let key = format!(
        "access-key-id = \"{}\"\nsecret-access-key = \"{}\"\n",
        moto.key.access_key_id, moto.key.secret_access_key
    );
    std::fs::write(&file, key).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &front.ca_pem).unwrap();

    // The host's own egress, as it sends for the provider.
    let route = Route {
        ca_file: Some(ca_file.clone()),
        signing: Some(AwsSigning { service: "ec2".into(), region: "us-east-1".into(), credentials: "moto".into() }),
        ..Route::to(EgressTarget::Https { host: "localhost".into(), port: front.port })
    };
    let grant = Arc::new(HttpGrant::routes([("ec2".to_owned(), route)]).unwrap());
    let egress = Arc::new(HostEgress::with_credentials(credentials.clone()));
    let send = |form: &'static str| {
        let sent = egress.clone().send(grant.clone(), request(form), None);
        runtime.block_on(async {
            let (response, io) = sent.await.unwrap().unwrap();
            assert_eq!(response.status(), 200);
            response.into_body().collect().await.unwrap();
            let _ = Box::into_pin(io).await;
        })
    };
    // The provider's whole start and stop through the real host.
    let broker = Broker::open(&data).unwrap();
    let manifest = format!(
        "[grants]\nkv = true\nlog = true\n[grants.http.ec2]\nurl = \"https://localhost:{}\"\nca-file = \"{}\"\n\
         sign = \"aws-sigv4\"\nservice = \"ec2\"\nregion = \"us-east-1\"\ncredentials = \"moto\"\n\
         actions = [\"DescribeAvailabilityZones\", \"DescribeInstances\", \"RunInstances\", \"TerminateInstances\"]\n\
         max-count = 1\nrequire-tag = \"broker-namespace=bench\"\n\
         [config]\nnamespace = \"bench\"\nregion = \"us-east-1\"\nzones = [\"us-east-1a\", \"us-east-1b\"]\n\
         images = {{ amd64 = \"ami-12c6146b\" }}\n",
        front.port,
        ca_file.display()
    );
    let manifest = broker_tests::write_manifest(dir.path(), "ec2", "ec2", &manifest);
    runtime.block_on(broker.registry().add(&manifest)).unwrap();
    let mut group = c.benchmark_group("ec2 provider through the host (moto, TLS)");
    group.sample_size(10).measurement_time(Duration::from_secs(10));
    // Measured apart: each iteration starts one and stops it, timing one side.
    let timed = |start_side: bool, iters: u64| {
        let mut spent = Duration::ZERO;
        for _ in 0..iters {
            runtime.block_on(async {
                let began = std::time::Instant::now();
                let record = broker.start_instance("ec2", &empty_params(), &CallHooks::default()).await.unwrap();
                let started = began.elapsed();
                let began = std::time::Instant::now();
                broker.stop_instances("ec2", &[record.id]).await.unwrap();
                spent += if start_side { started } else { began.elapsed() };
            })
        }
        spent
    };
    group.bench_function("start-instance", |b| b.iter_custom(|iters| timed(true, iters)));
    group.bench_function("stop-instances", |b| b.iter_custom(|iters| timed(false, iters)));
    group.finish();

    // Each call alone, after the starts above (moto lists every instance it made: RunInstances fills it).
    let mut group = c.benchmark_group("ec2 call (moto, TLS, signed by the host)");
    group.sample_size(20).measurement_time(Duration::from_secs(8));
    group.bench_function("DescribeAvailabilityZones", |b| b.iter(|| send(ZONES)));
    group.bench_function("DescribeInstances", |b| b.iter(|| send(DESCRIBE)));
    group.bench_function("RunInstances", |b| b.iter(|| send(RUN)));
    group.finish();
}

criterion_group!(benches, bench);
