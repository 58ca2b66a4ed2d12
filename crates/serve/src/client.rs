//! A client of a running `broker serve`, over its unix socket. The CLI speaks
//! through it when a daemon owns the data dir: the state database admits one
//! process, and a swap means something only where the calls are served.
//!
//! It speaks only over that unix socket (0600, in the data dir, made by the
//! daemon): it never connects over TCP and holds no bearer token, so it can
//! send a token to no listener at all. `--listen` (TCP and a bearer token)
//! is for other clients; the daemon refuses to start where another process
//! holds that address ([`crate::daemon::holder`]).

use crate::wire::StartLine;
use broker_capabilities::rooms::context::CallEvent;
use broker_core::error_report::{ErrorKind, ErrorReport};
use broker_core::store::InstanceRecord;
use bytes::Bytes;
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Full};
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};
use wasmtime_wasi_http::io::TokioIo;

#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("cannot reach the broker daemon on {socket}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Connect { socket: String, cause: std::io::Error },
    #[error("the broker daemon on {socket} broke off: {}", broker_capabilities::error_text::cause_text(&**.cause))]
    Http { socket: String, cause: broker_core::runtime::BoxError },
    /// The daemon refused the request; its `error`, as it reported it.
    #[error("{}", .report.message)]
    Refused { status: u16, report: ErrorReport },
    /// A streamed call ran and failed, as the daemon reported it.
    #[error("{}", .0.message)]
    Failed(ErrorReport),
    #[error("the broker daemon's answer to {path} does not parse: {}", broker_capabilities::error_text::cause_text(.cause))]
    Decode { path: String, cause: serde_json::Error },
}

impl ClientError {
    /// This error as the host reports it: the daemon's own report, or one of
    /// the client's making when the exchange itself failed.
    pub(crate) fn report(&self) -> ErrorReport {
        match self {
            ClientError::Refused { report, .. } | ClientError::Failed(report) => report.clone(),
            ClientError::Connect { .. } | ClientError::Http { .. } => {
                ErrorReport::new(ErrorKind::Unreachable, broker_capabilities::error_text::error_text(self))
            }
            ClientError::Decode { .. } => {
                ErrorReport::new(ErrorKind::Other, broker_capabilities::error_text::error_text(self))
            }
        }
    }
}

/// Where `broker serve` listens, known to answer.
#[derive(Debug, Clone)]
pub(crate) struct DaemonClient {
    socket: PathBuf,
}

/// How long a daemon has to answer `/healthz` to count as serving: it
/// answers from its accept loop, in well under a millisecond when idle.
const PROBE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

impl DaemonClient {
    /// A client if a daemon answers on `socket`; `None` if nothing does there
    /// (no socket, or one left by a daemon that died). Answering, not just
    /// accepting a connection: a dead daemon's listening socket can outlive
    /// it for a while in a process that inherited it, and takes connections
    /// nobody will ever answer.
    pub(crate) async fn probe(socket: &Path) -> Option<DaemonClient> {
        let client = DaemonClient { socket: socket.to_owned() };
        let asked = tokio::time::timeout(PROBE_PATIENCE, client.send(Method::GET, "/healthz", None));
        // A 503 is a daemon too (its state file faulted): it answers.
        match asked.await {
            Ok(Ok(_answered)) => Some(client),
            _ => None,
        }
    }

    /// One request; the answer's JSON body as `T`, or the daemon's refusal.
    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<T, ClientError> {
        let response = self.send(method, path, body).await?;
        let status = response.status();
        let bytes = response.into_body().collect().await.map_err(|e| self.broke_off(e))?.to_bytes();
        if !status.is_success() {
            return Err(refusal(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode { path: path.to_owned(), cause: e })
    }

    /// `POST /v1/instances`: each status update to `on_event` as it arrives,
    /// then the record of the started instance.
    pub(crate) async fn start_instance(
        &self,
        request: serde_json::Value,
        on_event: impl Fn(CallEvent),
    ) -> Result<InstanceRecord, ClientError> {
        const PATH: &str = "/v1/instances";
        let response = self.send(Method::POST, PATH, Some(request)).await?;
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let bytes = body.collect().await.map_err(|e| self.broke_off(e))?.to_bytes();
            return Err(refusal(status, &bytes));
        }
        let mut pending: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.map_err(|e| self.broke_off(e))?.into_data() else { continue };
            pending.extend_from_slice(&data);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let decoded: StartLine =
                    serde_json::from_slice(&line).map_err(|e| ClientError::Decode { path: PATH.into(), cause: e })?;
                match decoded {
                    StartLine::Started { instance } => return Ok(*instance),
                    StartLine::Failed { error } => return Err(ClientError::Failed(error)),
                    other => other.call_event().into_iter().for_each(&on_event),
                }
            }
        }
        Err(self.broke_off("the status stream ended before the start finished"))
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<http::Response<hyper::body::Incoming>, ClientError> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        send_unix(&self.socket, method, path, body).await.map_err(|failed| match failed {
            SendError::Connect(source) => {
                ClientError::Connect { socket: self.socket.display().to_string(), cause: source }
            }
            SendError::Http(source) => self.broke_off(source),
        })
    }

    fn broke_off(&self, source: impl Into<broker_core::runtime::BoxError>) -> ClientError {
        ClientError::Http { socket: self.socket.display().to_string(), cause: source.into() }
    }
}

/// Why [`send_unix`] failed.
#[derive(Debug)]
pub(crate) enum SendError {
    /// Nothing listens there (or it refused).
    Connect(std::io::Error),
    /// The exchange broke off.
    Http(broker_core::runtime::BoxError),
}

/// One HTTP/1.1 request with a JSON body over a new connection to `socket`;
/// the answer, its body still to read.
pub(crate) async fn send_unix(
    socket: &Path,
    method: Method,
    path: &str,
    body: String,
) -> Result<http::Response<hyper::body::Incoming>, SendError> {
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(SendError::Connect)?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|e| SendError::Http(e.into()))?;
    // The connection drives the socket; it ends when the response body is read.
    tokio::spawn(connection);
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, "broker")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| SendError::Http(e.into()))?;
    sender.send_request(request).await.map_err(|e| SendError::Http(e.into()))
}

/// The daemon's `{"error": …}`, or the status and body as they came.
fn refusal(status: StatusCode, body: &[u8]) -> ClientError {
    let report = crate::wire::error_in_body(body).unwrap_or_else(|| {
        let message = format!("the daemon answered {status}: {}", String::from_utf8_lossy(body).trim());
        ErrorReport::new(ErrorKind::Other, message)
    });
    ClientError::Refused { status: status.as_u16(), report }
}

/// `text` as one path segment or query value: unreserved characters as they
/// are, every other byte percent-encoded.
pub(crate) fn encode_component(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_are_percent_encoded_where_they_must_be() {
        assert_eq!(encode_component("fake-0"), "fake-0");
        assert_eq!(encode_component("a/b c?d&e"), "a%2Fb%20c%3Fd%26e");
        assert_eq!(encode_component("é"), "%C3%A9");
    }

    #[test]
    fn a_refusal_carries_the_daemons_message_or_what_it_sent() {
        let err = refusal(StatusCode::NOT_FOUND, br#"{"error":"unknown provider \"x\""}"#);
        assert_eq!(err.to_string(), "unknown provider \"x\"");
        let body = br#"{"error":{"kind":"unknown-provider","message":"unknown provider \"x\"","provider":"x"}}"#;
        let err = refusal(StatusCode::NOT_FOUND, body);
        assert_eq!(err.to_string(), "unknown provider \"x\"");
        assert_eq!((err.report().kind, err.report().provider), (ErrorKind::UnknownProvider, Some("x".to_owned())));
        let err = refusal(StatusCode::BAD_GATEWAY, b"upstream gone\n");
        assert_eq!(err.to_string(), "the daemon answered 502 Bad Gateway: upstream gone");
    }
}
