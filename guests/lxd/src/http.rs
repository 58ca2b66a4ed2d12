//! A small blocking HTTP client over plain `wasi:http`: the host routes the
//! authority to whatever the manifest grants (LXD's unix socket).

use wasip2::http::outgoing_handler;
use wasip2::http::types::{ErrorCode, Fields, Method, OutgoingBody, OutgoingRequest, Scheme};
use wasip2::io::streams::StreamError;

/// Largest response body kept; LXD's answers are small JSON documents.
const MAX_BODY: usize = 8 << 20;
/// Largest write the host's outgoing-body stream takes at once.
const WRITE_CHUNK: usize = 4096;

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
    let headers = Fields::new();
    let io = |what: &str| Failure::Io(what.to_owned());
    if let Some(body) = body {
        headers.set("content-type", &[b"application/json".to_vec()]).map_err(|_| io("content-type header"))?;
        headers
            .set("content-length", &[body.len().to_string().into_bytes()])
            .map_err(|_| io("content-length header"))?;
    }
    let request = OutgoingRequest::new(headers);
    request.set_method(&method).map_err(|_| io("method"))?;
    request.set_scheme(Some(&Scheme::Http)).map_err(|_| io("scheme"))?;
    request.set_authority(Some(authority)).map_err(|_| io("authority"))?;
    request.set_path_with_query(Some(path)).map_err(|_| io("path"))?;
    let outgoing = request.body().map_err(|_| io("request body"))?;
    // Send first: the host consumes the body while the request is in flight.
    let pending = outgoing_handler::handle(request, None).map_err(Failure::Http)?;
    if let Some(body) = body {
        let stream = outgoing.write().map_err(|_| io("request body stream"))?;
        for chunk in body.chunks(WRITE_CHUNK) {
            stream
                .blocking_write_and_flush(chunk)
                .map_err(|e| Failure::Io(format!("writing the request body: {e:?}")))?;
        }
        drop(stream);
    }
    OutgoingBody::finish(outgoing, None).map_err(Failure::Http)?;

    let response = loop {
        match pending.get() {
            Some(result) => break result.map_err(|()| io("response taken twice"))?.map_err(Failure::Http)?,
            None => pending.subscribe().block(),
        }
    };
    let status = response.status();
    let incoming = response.consume().map_err(|()| io("response body"))?;
    let stream = incoming.stream().map_err(|()| io("response body stream"))?;
    let mut body = Vec::new();
    loop {
        match stream.blocking_read(64 << 10) {
            Ok(bytes) => {
                body.extend_from_slice(&bytes);
                if body.len() > MAX_BODY {
                    return Err(Failure::Io(format!("response larger than {MAX_BODY} bytes")));
                }
            }
            Err(StreamError::Closed) => break,
            Err(StreamError::LastOperationFailed(e)) => {
                return Err(Failure::Io(format!("reading the response: {}", e.to_debug_string())));
            }
        }
    }
    drop(stream);
    Ok(Response { status, body })
}
