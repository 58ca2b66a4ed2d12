//! Scripted HTTP answers, for testing providers without their real endpoints:
//! a [`Tape`] records what a real run exchanged; a [`Script`] answers a run
//! from such a recording, in order, and notes each request it has no answer
//! for. Bodies are kept as text (the APIs providers speak are JSON or XML).
//! The script file around them is the conformance kit's (`conformance::script`).

use super::{EgressBackend, EgressError, SendResult, granted};
use crate::rooms::http_egress::HttpGrant;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use wasmtime_wasi_http::{RequestOptions, WasiBody};

/// One request and the answer it got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Exchange {
    /// As the guest wrote it in the URL (`lxd`).
    pub authority: String,
    /// `GET`, `POST`, …
    pub method: String,
    /// Path and query, as sent.
    pub path: String,
    /// As text; empty when there was none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_body: String,
    /// The answer's HTTP status code.
    pub status: u16,
    /// As text.
    #[serde(default)]
    pub response_body: String,
}

impl Exchange {
    fn call(&self) -> String {
        format!("{} {}{}", self.method, self.authority, self.path)
    }
}

/// What a recorded run exchanged, in order.
#[derive(Debug, Default)]
pub struct Tape {
    exchanges: Mutex<Vec<Exchange>>,
    /// Exchanges made while set are not written (the kit's own look before a recording).
    paused: std::sync::atomic::AtomicBool,
}

impl Tape {
    /// A copy of what was recorded so far.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.exchanges.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stop (or resume) writing exchanges down.
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Scripted answers, consumed in order.
#[derive(Debug, Default)]
pub struct Script {
    pending: Mutex<VecDeque<Exchange>>,
    unexpected: Mutex<Vec<String>>,
    /// Why there are no answers at all, when there is no script (`no script at PATH`).
    missing: Option<String>,
}

impl Script {
    /// Answers `exchanges`, in this order.
    pub fn new(exchanges: Vec<Exchange>) -> Script {
        Script { pending: Mutex::new(exchanges.into()), unexpected: Mutex::default(), missing: None }
    }

    /// No answers, because there is no script: every request says so.
    pub fn missing(why: String) -> Script {
        Script { missing: Some(why), ..Script::default() }
    }

    /// Requests the script had no answer for since the last call.
    pub fn take_unexpected(&self) -> Vec<String> {
        std::mem::take(&mut *self.unexpected.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Scripted answers nobody asked for (yet).
    pub fn remaining(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The next answer, if the request is the next one scripted.
    fn answer(&self, authority: &str, method: &str, path: &str) -> Result<Exchange, EgressError> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let matches = pending.front().is_some_and(|e| e.authority == authority && e.method == method && e.path == path);
        if matches && let Some(next) = pending.pop_front() {
            return Ok(next);
        }
        let expected = match (pending.front(), &self.missing) {
            (Some(next), _) => format!("the script's next is {}", next.call()),
            (None, Some(missing)) => missing.clone(),
            (None, None) => "the script is exhausted".to_owned(),
        };
        let message = format!("unscripted http request {method} {authority}{path} ({expected})");
        self.unexpected.lock().unwrap_or_else(|p| p.into_inner()).push(message.clone());
        Err(EgressError::Unscripted(message))
    }
}

fn full(bytes: Bytes) -> WasiBody {
    Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

fn path_of(request: &http::Request<WasiBody>) -> String {
    request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned()
}

async fn body_text(body: WasiBody) -> Result<Bytes, EgressError> {
    Ok(body.collect().await.map_err(|e| EgressError::Body(e.to_string()))?.to_bytes())
}

fn answered(response: http::Response<WasiBody>) -> SendResult {
    Ok((response, Box::new(async { Ok(()) })))
}

/// Any egress backend, with every exchange written to a tape (a real run becomes a script).
pub struct RecordedEgress {
    inner: Arc<dyn EgressBackend>,
    tape: Arc<Tape>,
}

impl RecordedEgress {
    /// Send through `inner`, writing each exchange to `tape`.
    pub fn new(inner: Arc<dyn EgressBackend>, tape: Arc<Tape>) -> Self {
        RecordedEgress { inner, tape }
    }
}

impl EgressBackend for RecordedEgress {
    fn send(
        self: Arc<Self>,
        grant: Arc<HttpGrant>,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> BoxFuture<'static, Result<SendResult, EgressError>> {
        Box::pin(async move { record(self.inner.clone(), &self.tape, &grant, request, options).await })
    }
}

/// Answer from the script; nothing leaves the host.
impl EgressBackend for Script {
    fn send(
        self: Arc<Self>,
        grant: Arc<HttpGrant>,
        request: http::Request<WasiBody>,
        _options: Option<RequestOptions>,
    ) -> BoxFuture<'static, Result<SendResult, EgressError>> {
        Box::pin(async move { replay(&self, &grant, request).await })
    }
}

/// Send through `inner`, and write the exchange to the tape.
async fn record(
    inner: Arc<dyn EgressBackend>,
    tape: &Tape,
    grant: &Arc<HttpGrant>,
    request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
) -> Result<SendResult, EgressError> {
    let (authority, _) = granted(grant, &request)?;
    let (method, path) = (request.method().to_string(), path_of(&request));
    let (parts, body) = request.into_parts();
    let request_body = body_text(body).await?;
    let forwarded = http::Request::from_parts(parts, full(request_body.clone()));
    let sent = inner.send(grant.clone(), forwarded, options).await?;
    let (response, io) = match sent {
        Ok(sent) => sent,
        Err(code) => return Ok(Err(code)),
    };
    let (parts, body) = response.into_parts();
    let response_body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(code) => return Ok(Err(code)),
    };
    let _ = Box::into_pin(io).await;
    if tape.paused.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(answered(http::Response::from_parts(parts, full(response_body))));
    }
    tape.exchanges.lock().unwrap_or_else(|p| p.into_inner()).push(Exchange {
        authority,
        method,
        path,
        request_body: String::from_utf8_lossy(&request_body).into_owned(),
        status: parts.status.as_u16(),
        response_body: String::from_utf8_lossy(&response_body).into_owned(),
    });
    Ok(answered(http::Response::from_parts(parts, full(response_body))))
}

/// Answer from the script; nothing leaves the host.
pub(super) async fn replay(
    script: &Script,
    grant: &HttpGrant,
    request: http::Request<WasiBody>,
) -> Result<SendResult, EgressError> {
    let (authority, route) = granted(grant, &request)?;
    let (method, path) = (request.method().to_string(), path_of(&request));
    let (parts, body) = request.into_parts();
    // Read the body even so: the guest writes it after sending and would wait forever.
    let body = body_text(body).await?;
    // A signed grant's rules hold in the kit as on the host.
    route
        .rules
        .check_request(&parts.headers, parts.uri.query(), &body)
        .map_err(|refused| EgressError::Refused { authority: authority.clone(), refused })?;
    let next = script.answer(&authority, &method, &path)?;
    let response = http::Response::builder()
        .status(next.status)
        .header("content-type", "application/json")
        .body(full(Bytes::from(next.response_body)))
        .map_err(|e| EgressError::Unscripted(format!("scripted answer to {method} {authority}{path}: {e}")))?;
    Ok(answered(response))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rooms::http_egress::EgressTarget;
    use http_body_util::Empty;

    fn get(uri: &str) -> http::Request<WasiBody> {
        let body = Empty::new().map_err(|never| match never {}).boxed_unsync();
        http::Request::builder().method("GET").uri(uri).header("host", "lxd").body(body).unwrap()
    }

    async fn text(sent: Result<SendResult, EgressError>) -> (u16, String) {
        let (response, _) = sent.unwrap().unwrap();
        let status = response.status().as_u16();
        (status, String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_recorded_run_replays_and_anything_else_is_unscripted() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.socket");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let server = tokio::spawn(async move {
            for reply in ["{\"n\":1}", "{\"n\":2}"] {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut buf).await.unwrap();
                let head =
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}", reply.len());
                tokio::io::AsyncWriteExt::write_all(&mut stream, head.as_bytes()).await.unwrap();
            }
        });
        let grant = Arc::new(HttpGrant::new([("lxd".to_owned(), EgressTarget::Unix(socket))]).unwrap());
        let tape = Arc::new(Tape::default());
        let recorded = Arc::new(RecordedEgress::new(Arc::new(super::super::HostEgress::default()), tape.clone()));
        let record = |request| recorded.clone().send(grant.clone(), request, None);
        assert_eq!(text(record(get("http://lxd/1.0")).await).await, (200, "{\"n\":1}".into()));
        assert_eq!(text(record(get("http://lxd/1.0/x?p=1")).await).await, (200, "{\"n\":2}".into()));
        server.await.unwrap();

        // The daemon is gone; the script answers the same run alone.
        let script = Arc::new(Script::new(tape.exchanges()));
        let replay = |_: &Arc<Script>, _: &Arc<HttpGrant>, request| script.clone().send(grant.clone(), request, None);
        assert_eq!(script.remaining(), 2);
        assert_eq!(text(replay(&script, &grant, get("http://lxd/1.0")).await).await, (200, "{\"n\":1}".into()));
        let wrong = replay(&script, &grant, get("http://lxd/1.0/y")).await;
        assert!(matches!(&wrong, Err(EgressError::Unscripted(m)) if m.contains("next is GET lxd/1.0/x?p=1")));
        assert_eq!(text(replay(&script, &grant, get("http://lxd/1.0/x?p=1")).await).await, (200, "{\"n\":2}".into()));
        assert!(
            matches!(replay(&script, &grant, get("http://lxd/1.0")).await, Err(EgressError::Unscripted(m)) if m.contains("exhausted"))
        );
        assert_eq!(script.take_unexpected().len(), 2);
        assert!(script.take_unexpected().is_empty());
        // The grant still decides: a script cannot open an authority the manifest does not grant.
        assert!(matches!(replay(&script, &grant, get("http://docker/x")).await, Err(EgressError::NotGranted { .. })));
    }
}
