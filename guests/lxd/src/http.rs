//! LXD's requests through the SDK's HTTP client: the host routes the
//! authority to whatever the manifest grants (LXD's unix socket).

use broker_guest::http::{Error, Request};
use wasip2::http::types::{ErrorCode, Method};

/// Largest response body kept; LXD's answers are small JSON documents.
const MAX_BODY: usize = 8 << 20;

pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

#[derive(Debug)]
pub enum Failure {
    /// The host refused or failed the request (`wasi:http` error code).
    Http(ErrorCode),
    /// The exchange itself went wrong (streams, sizes).
    Io(String),
}

pub fn request(method: Method, authority: &str, path: &str, body: Option<&[u8]>) -> Result<Response, Failure> {
    let mut request = Request::new(method, authority, path).max_response(MAX_BODY);
    if let Some(body) = body {
        request = request.json(body);
    }
    match request.send() {
        Ok(response) => Ok(Response { status: response.status, body: response.body }),
        Err(Error::Http(code)) => Err(Failure::Http(code)),
        Err(Error::Io(message)) => Err(Failure::Io(message)),
    }
}
