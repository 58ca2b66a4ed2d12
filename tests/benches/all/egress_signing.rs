//! What host-side signing costs one request: a RunInstances form sent
//! through the host's egress to a local HTTP server over a fresh TCP
//! connection, (a) on a plain grant and (b) on a signed grant (rules checked,
//! the credentials file checked for a change, SigV4 computed), side by side.
//!
//! cargo bench -p broker-tests --bench egress_signing

#![allow(clippy::unwrap_used)] // benchmarks: a panic is the failure report

use broker_capabilities::rooms::http_egress::rules::Rules;
use broker_capabilities::rooms::http_egress::signing::AwsSigning;
use broker_capabilities::rooms::http_egress::{EgressBackend, EgressTarget, HostEgress, HttpGrant, Route};
use criterion::{Criterion, criterion_group};
use http_body_util::BodyExt;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const FORM: &str = "Action=RunInstances&Version=2016-11-15&ImageId=ami-12c6146b&InstanceType=t2.micro\
                    &MinCount=1&MaxCount=1&ClientToken=bench-1&TagSpecification.1.ResourceType=instance\
                    &TagSpecification.1.Tag.1.Key=broker-namespace&TagSpecification.1.Tag.1.Value=ns1";

/// Answer every connection's one request with a small 200.
async fn server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 16 << 10];
                let mut read = 0;
                // Headers, then the body the content-length announces (the form's, known here).
                while let Ok(n) = stream.read(&mut buffer[read..]).await {
                    if n == 0 {
                        return;
                    }
                    read += n;
                    if let Some(end) = buffer[..read].windows(4).position(|w| w == b"\r\n\r\n")
                        && read >= end + 4 + FORM.len()
                    {
                        break;
                    }
                }
                let answer = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    port
}

fn request() -> http::Request<wasmtime_wasi_http::WasiBody> {
    let body = http_body_util::Full::new(bytes::Bytes::from_static(FORM.as_bytes()))
        .map_err(|never| match never {})
        .boxed_unsync();
    http::Request::post("http://ec2/")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("content-length", FORM.len())
        .body(body)
        .unwrap()
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let port = runtime.block_on(server());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bench.toml");
    std::fs::write(&file, "access-key-id = \"AKIABENCH\"\nsecret-access-key = \"bench-secret\"\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let target = EgressTarget::Tcp { host: "127.0.0.1".into(), port };
    let signed = Route {
        signing: Some(AwsSigning { service: "ec2".into(), region: "us-east-1".into(), credentials: "bench".into() }),
        rules: Rules {
            actions: vec!["RunInstances".into()],
            max_count: Some(10),
            require_tag: Some(("broker-namespace".into(), "ns1".into())),
        },
        ..Route::to(target.clone())
    };
    let plain = Arc::new(HttpGrant::routes([("ec2".to_owned(), Route::to(target))]).unwrap());
    let signed = Arc::new(HttpGrant::routes([("ec2".to_owned(), signed)]).unwrap());
    let egress = Arc::new(HostEgress::with_credentials(dir.path().to_owned()));
    let send = |grant: &Arc<HttpGrant>| {
        let sent = egress.clone().send(grant.clone(), request(), None);
        runtime.block_on(async {
            let (response, io) = sent.await.unwrap().unwrap();
            assert_eq!(response.status(), 200);
            response.into_body().collect().await.unwrap();
            let _ = Box::into_pin(io).await;
        })
    };
    let mut group = c.benchmark_group("egress request");
    group.bench_function("plain grant", |b| b.iter(|| send(&plain)));
    group.bench_function("signed grant", |b| b.iter(|| send(&signed)));
    group.finish();
}

criterion_group!(benches, bench);
