//! The daemon's accept loop, in place of `axum::serve` (which sets no timer,
//! so a client that never finishes its request holds a connection, and a
//! drain, forever): HTTP/1 from hyper with a header-read timeout, at most
//! [`ServeLimits::max_connections`] connections at once, and a drain that
//! ends when the requests in flight do or after [`ServeLimits::drain`].
//!
//! A request's body is read whole, within [`ServeLimits::body_timeout`], by
//! [`bounded_request_up_to`] (a layer of the router): every body the API takes is
//! small JSON, and a handler then never waits on a slow client.

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Semaphore;

/// How long and how many: what bounds one listener's clients.
#[derive(Clone, Copy, Debug)]
pub struct ServeLimits {
    /// A request's head (line and headers) must arrive within this, and so
    /// must the next request's on a kept-alive connection: an idle one closes.
    pub(crate) header_timeout: Duration,
    /// A request's body must arrive whole within this (408 otherwise).
    pub(crate) body_timeout: Duration,
    /// Connections open at once; the next waits in the kernel's backlog.
    pub(crate) max_connections: usize,
    /// After the stop, how long the requests in flight have to finish before
    /// their connections are closed.
    pub(crate) drain: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            max_connections: 512,
            drain: Duration::from_secs(60),
        }
    }
}

/// A listener the loop accepts from: the unix socket or loopback TCP.
pub(crate) trait Accept: Send + 'static {
    /// A connection.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection.
    fn accept(&mut self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        tokio::net::UnixListener::accept(self).await.map(|(io, _)| io)
    }
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        let (io, _) = tokio::net::TcpListener::accept(self).await?;
        // Small JSON answers and NDJSON status lines: each goes at once.
        let _ = io.set_nodelay(true);
        Ok(io)
    }
}

/// Serve `app` on `listener` until `stop` resolves, then drain: the listener
/// closes, idle connections close, and requests in flight have
/// `limits.drain` to finish. Returns once drained (or the drain timed out).
pub(crate) async fn serve(
    mut listener: impl Accept,
    app: Router,
    limits: ServeLimits,
    stop: impl Future<Output = ()> + Send,
    name: &'static str,
) {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    let mut stop = std::pin::pin!(stop);
    // Said once each time the limit is reached, not at every accept while it holds.
    let mut said_full = false;
    loop {
        // A permit before the accept: past the limit, clients wait in the backlog.
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => permit,
            () = &mut stop => break,
        };
        let Ok(permit) = permit else { break };
        let full = permits.available_permits() == 0;
        if full && !said_full {
            tracing::warn!(listener = name, max = limits.max_connections, "connection limit reached: new clients wait");
        }
        said_full = full;
        let io = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let io = match io {
            Ok(io) => io,
            Err(error) => {
                // Out of descriptors, or a client gone before its accept: not the daemon's end.
                tracing::warn!(listener = name, %error, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(io), service));
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(listener = name, %error, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    let open = graceful.count();
    if tokio::time::timeout(limits.drain, graceful.shutdown()).await.is_err() {
        tracing::warn!(
            listener = name,
            open,
            drain_seconds = limits.drain.as_secs(),
            "requests still in flight when the drain ran out: their connections are closed"
        );
    }
}

/// Longest request target the API takes (414 past it).
pub(crate) const MAX_URI_BYTES: usize = 8 << 10;
/// Most bytes of headers the API takes (431 past it). Beyond hyper's own
/// buffer (~400 KiB) hyper answers 431 itself, with no body.
pub(crate) const MAX_HEADER_BYTES: usize = 32 << 10;

/// Every request passes here, inside the routes' layers: its target and
/// headers are bounded, its body read whole within `timeout` and at most
/// `max_body` bytes (408, 413), and every error answer, axum's own
/// rejections of a path or a query included, is `{"error": {"kind", "message"}}` JSON.
pub(crate) async fn bounded_request_up_to(
    timeout: Duration,
    max_body: usize,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let target = parts.uri.path_and_query().map_or(0, |p| p.as_str().len());
    if target > MAX_URI_BYTES {
        return error(StatusCode::URI_TOO_LONG, format!("the request target is longer than {MAX_URI_BYTES} bytes"));
    }
    let headers: usize = parts.headers.iter().map(|(name, value)| name.as_str().len() + value.len() + 4).sum();
    if headers > MAX_HEADER_BYTES {
        return error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!("the request headers are larger than {MAX_HEADER_BYTES} bytes"),
        );
    }
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(body, max_body)).await;
    let bytes = match read {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(failed)) => {
            // Too large, or the client broke off mid-body.
            let too_large = std::error::Error::source(&failed)
                .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
            return if too_large {
                error(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than {max_body} bytes"))
            } else {
                error(StatusCode::BAD_REQUEST, format!("cannot read the request body: {failed}"))
            };
        }
        Err(_) => {
            let seconds = timeout.as_secs_f64();
            return error(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {seconds} s"));
        }
    };
    as_json_error(next.run(Request::from_parts(parts, Body::from(bytes))).await).await
}

/// An error answer that is not JSON (axum's rejections of a path or a query,
/// its 404 and 405) as `{"error": {…}}`: its text, or the status's reason.
async fn as_json_error(response: Response) -> Response {
    let status = response.status();
    let json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|kind| kind.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_owned();
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_owned() } else { text };
    let mut answer = error(status, message);
    // Allow (405) and the like stay.
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_TYPE && name != axum::http::header::CONTENT_LENGTH {
            answer.headers_mut().insert(name.clone(), value.clone());
        }
    }
    answer
}

/// An answer of the HTTP layer's own (a request the routes never saw, or
/// could not read): the client's mistake, or a failure inside the host.
pub(crate) fn error(status: StatusCode, message: String) -> Response {
    use broker_core::error_report::{ErrorKind, ErrorReport};
    let kind = if status.is_client_error() { ErrorKind::BadRequest } else { ErrorKind::Other };
    (status, axum::Json(crate::wire::error_body(&ErrorReport::new(kind, message)))).into_response()
}
