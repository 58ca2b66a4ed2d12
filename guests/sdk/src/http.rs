//! A small blocking HTTP client over plain `wasi:http`, for providers that
//! talk to an API: LXD's, a cloud's.
//!
//! The guest names a **grant**, not a server: `Request::get("lxd", "/1.0")`
//! goes to whatever `[grants.http] lxd = …` says (a unix socket, a TCP
//! address, an `https://` endpoint). The host decides TLS, and for a grant
//! with `sign = "aws-sigv4"` it signs the request with a credential the guest
//! never sees: send it unsigned. What the upstream sees as `Host` is the
//! grant's name for a plain `http://` or unix target, and the target's own
//! host (and port) for an `https://` one, or a signed one.
//!
//! ```ignore
//! use broker_guest::http::Request;
//! let answer = Request::post("ec2", "/")
//!     .form(&[("Action", "DescribeAvailabilityZones"), ("Version", "2016-11-15")])
//!     .timeout(std::time::Duration::from_secs(30))
//!     .send()?;
//! if answer.status == 200 { let xml = answer.text()?; }
//! ```

use std::time::Duration;
use wasip2::http::outgoing_handler;
use wasip2::http::types::{Fields, OutgoingBody, OutgoingRequest, RequestOptions, Scheme};
use wasip2::io::streams::StreamError;

pub use wasip2::http::types::{ErrorCode, Method};

/// The largest response body kept unless [`Request::max_response`] says otherwise.
pub const DEFAULT_MAX_RESPONSE: usize = 8 << 20;
/// Largest write the host's outgoing-body stream takes at once.
const WRITE_CHUNK: usize = 4096;

/// Why a request got no answer.
#[derive(Debug)]
pub enum Error {
    /// The host refused or failed it (`http-request-denied` for an authority
    /// not granted or a request the grant's rules refuse; connection and TLS
    /// errors name what failed in the host's log).
    Http(ErrorCode),
    /// The exchange itself went wrong (a header the host refused, a body too large).
    Io(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Http(ErrorCode::HttpRequestDenied) => {
                write!(f, "the host denied the request (not granted, or refused by the grant's rules)")
            }
            Error::Http(ErrorCode::InternalError(Some(message))) => write!(f, "the host: {message}"),
            Error::Http(code) => write!(f, "http: {code:?}"),
            Error::Io(message) => write!(f, "{message}"),
        }
    }
}

impl std::error::Error for Error {}

/// One request, built then sent.
#[derive(Debug, Clone)]
pub struct Request {
    method: Method,
    authority: String,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Option<Vec<u8>>,
    connect_timeout: Option<Duration>,
    first_byte_timeout: Option<Duration>,
    between_bytes_timeout: Option<Duration>,
    max_response: usize,
}

/// An answer: any status (a 4xx is an answer, not an [`Error`]).
#[derive(Debug, Clone)]
pub struct Response {
    /// The HTTP status.
    pub status: u16,
    /// Every header, names lowercase, in the order given.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The whole body.
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of header `name` (any case), if it is text.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(n, _)| *n == name).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// The body as UTF-8 text.
    pub fn text(&self) -> Result<&str, Error> {
        std::str::from_utf8(&self.body).map_err(|e| Error::Io(format!("the response body is not UTF-8: {e}")))
    }

    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// `application/x-www-form-urlencoded` as AWS's Query APIs read it: every
/// byte but RFC 3986's unreserved ones percent-encoded.
pub fn form_encode(pairs: &[(&str, &str)]) -> String {
    fn encode(text: &str, out: &mut String) {
        for byte in text.bytes() {
            match byte {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(byte as char),
                _ => out.push_str(&format!("%{byte:02X}")),
            }
        }
    }
    let mut out = String::new();
    for (i, (key, value)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        encode(key, &mut out);
        out.push('=');
        encode(value, &mut out);
    }
    out
}

impl Request {
    /// A request of `method` to `path` (with its query) on the granted `authority`.
    pub fn new(method: Method, authority: &str, path: &str) -> Request {
        Request {
            method,
            authority: authority.to_owned(),
            path: path.to_owned(),
            headers: Vec::new(),
            body: None,
            connect_timeout: None,
            first_byte_timeout: None,
            between_bytes_timeout: None,
            max_response: DEFAULT_MAX_RESPONSE,
        }
    }

    /// A GET.
    pub fn get(authority: &str, path: &str) -> Request {
        Request::new(Method::Get, authority, path)
    }

    /// A POST.
    pub fn post(authority: &str, path: &str) -> Request {
        Request::new(Method::Post, authority, path)
    }

    /// Add a header (`content-length` is set from the body).
    pub fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Request {
        self.headers.push((name.to_ascii_lowercase(), value.into()));
        self
    }

    /// The body, as given.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Request {
        self.body = Some(body.into());
        self
    }

    /// A JSON body (its `content-type` set).
    pub fn json(self, body: impl Into<Vec<u8>>) -> Request {
        self.header("content-type", "application/json").body(body)
    }

    /// A form body, as AWS's Query APIs take it (its `content-type` set).
    pub fn form(self, pairs: &[(&str, &str)]) -> Request {
        self.header("content-type", "application/x-www-form-urlencoded; charset=utf-8").body(form_encode(pairs))
    }

    /// How long to wait for the connection and for the answer's first byte
    /// (the call's own deadline bounds everything anyway).
    pub fn timeout(mut self, timeout: Duration) -> Request {
        self.connect_timeout = Some(timeout);
        self.first_byte_timeout = Some(timeout);
        self
    }

    /// How long to wait between two bytes of the answer.
    pub fn between_bytes_timeout(mut self, timeout: Duration) -> Request {
        self.between_bytes_timeout = Some(timeout);
        self
    }

    /// The largest answer body taken (default [`DEFAULT_MAX_RESPONSE`]).
    pub fn max_response(mut self, bytes: usize) -> Request {
        self.max_response = bytes;
        self
    }

    /// Send it and read the whole answer.
    pub fn send(self) -> Result<Response, Error> {
        let io = |what: &str| Error::Io(what.to_owned());
        let headers = Fields::new();
        for (name, value) in &self.headers {
            headers.append(name, value).map_err(|e| Error::Io(format!("header {name}: {e:?}")))?;
        }
        if let Some(body) = &self.body {
            headers
                .set("content-length", &[body.len().to_string().into_bytes()])
                .map_err(|_| io("content-length header"))?;
        }
        let request = OutgoingRequest::new(headers);
        request.set_method(&self.method).map_err(|_| io("method"))?;
        request.set_scheme(Some(&Scheme::Http)).map_err(|_| io("scheme"))?;
        request.set_authority(Some(&self.authority)).map_err(|_| io("authority"))?;
        request.set_path_with_query(Some(&self.path)).map_err(|_| io("path"))?;
        let options = RequestOptions::new();
        let nanos = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        if let Some(d) = self.connect_timeout {
            options.set_connect_timeout(Some(nanos(d))).map_err(|_| io("connect timeout"))?;
        }
        if let Some(d) = self.first_byte_timeout {
            options.set_first_byte_timeout(Some(nanos(d))).map_err(|_| io("first-byte timeout"))?;
        }
        if let Some(d) = self.between_bytes_timeout {
            options.set_between_bytes_timeout(Some(nanos(d))).map_err(|_| io("between-bytes timeout"))?;
        }
        let outgoing = request.body().map_err(|_| io("request body"))?;
        // Send first: the host consumes the body while the request is in flight.
        let pending = outgoing_handler::handle(request, Some(options)).map_err(Error::Http)?;
        if let Some(body) = &self.body {
            let stream = outgoing.write().map_err(|_| io("request body stream"))?;
            for chunk in body.chunks(WRITE_CHUNK) {
                stream
                    .blocking_write_and_flush(chunk)
                    .map_err(|e| Error::Io(format!("writing the request body: {e:?}")))?;
            }
            drop(stream);
        }
        OutgoingBody::finish(outgoing, None).map_err(Error::Http)?;

        let response = loop {
            match pending.get() {
                Some(result) => break result.map_err(|()| io("response taken twice"))?.map_err(Error::Http)?,
                None => pending.subscribe().block(),
            }
        };
        let status = response.status();
        let headers = response.headers().entries();
        let incoming = response.consume().map_err(|()| io("response body"))?;
        let stream = incoming.stream().map_err(|()| io("response body stream"))?;
        let mut body = Vec::new();
        loop {
            match stream.blocking_read(64 << 10) {
                Ok(bytes) => {
                    body.extend_from_slice(&bytes);
                    if body.len() > self.max_response {
                        return Err(Error::Io(format!("response larger than {} bytes", self.max_response)));
                    }
                }
                Err(StreamError::Closed) => break,
                Err(StreamError::LastOperationFailed(e)) => {
                    return Err(Error::Io(format!("reading the response: {}", e.to_debug_string())));
                }
            }
        }
        drop(stream);
        Ok(Response { status, headers, body })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn forms_encode_as_aws_reads_them() {
        let form = super::form_encode(&[("Action", "RunInstances"), ("UserData", "a b+c/=~")]);
        assert_eq!(form, "Action=RunInstances&UserData=a%20b%2Bc%2F%3D~");
    }
}
