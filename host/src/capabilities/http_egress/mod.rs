//! Egress through plain `wasi:http`: a provider reaches exactly the
//! authorities its manifest grants, each mapped by the host to a unix socket
//! (the LXD/Incus API) or a TCP address. The guest never names a socket path
//! or an address; it asks for `http://lxd/1.0/…` and the host decides where
//! `lxd` is. Everything else is denied.
//!
//! ```toml
//! [grants.http]
//! lxd = "unix:/var/lib/incus/unix.socket"
//! ec2 = "http://127.0.0.1:5000"
//! ```
//!
//! The room is [`HttpEgress`]: `wasi:http` is linked for every provider, and
//! each request goes through the store's [`EgressHooks`] (`send_request`),
//! which check the grant and hand the request to an [`EgressBackend`]: the
//! granted targets ([`HostEgress`]), or in the conformance kit a script or a
//! recording.

use crate::runtime::HostState;
use crate::runtime::rooms::{GrantLine, GrantValue, Linking, Room, StoreSetup};
use futures_util::future::BoxFuture;
use http::uri::Scheme;
use http_body_util::BodyExt;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::Instrument;
use wasmtime::component::Linker;
use wasmtime_wasi_http::io::TokioIo;
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody, WasiHttpCtx, WasiHttpHooks, WasiHttpView};

pub mod script;
pub use script::{Exchange, RecordedEgress, Script, Tape};

/// How long to wait for a connection and for the first response byte when the
/// guest does not say; the call's own deadline bounds everything anyway.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(120);

/// Where the host sends a granted authority's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressTarget {
    /// `unix:/absolute/path`: an HTTP server on a unix socket.
    Unix(PathBuf),
    /// `http://host[:port]`: plain HTTP over TCP.
    Tcp {
        /// A name or an IP address, as the grant writes it.
        host: String,
        /// 80 unless the grant gives one.
        port: u16,
    },
}

impl std::str::FromStr for EgressTarget {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let wrong = || format!("http grant target {text:?} must be `unix:/absolute/path` or `http://host[:port]`");
        if let Some(path) = text.strip_prefix("unix:") {
            let path = PathBuf::from(path);
            let clean = path.is_absolute() && path.components().all(|c| !matches!(c, Component::ParentDir));
            return if clean { Ok(EgressTarget::Unix(path)) } else { Err(wrong()) };
        }
        if text.starts_with("https://") {
            return Err(format!(
                "http grant target {text:?}: https is not supported yet; grant a plain http:// target"
            ));
        }
        let rest = text.strip_prefix("http://").ok_or_else(wrong)?.trim_end_matches('/');
        if rest.is_empty() || rest.contains('/') || rest.contains('@') {
            return Err(wrong());
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => {
                (host.to_owned(), port.parse::<u16>().map_err(|_| wrong())?)
            }
            _ => (rest.to_owned(), 80),
        };
        if host.is_empty() || port == 0 {
            return Err(wrong());
        }
        Ok(EgressTarget::Tcp { host, port })
    }
}

impl fmt::Display for EgressTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressTarget::Unix(path) => write!(f, "unix:{}", path.display()),
            EgressTarget::Tcp { host, port } => write!(f, "http://{host}:{port}"),
        }
    }
}

/// The `[grants.http]` table: authority (as the guest writes it in its URLs) → target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpGrant {
    authorities: BTreeMap<String, EgressTarget>,
}

impl HttpGrant {
    /// Fails on an authority that is not lowercase letters, digits, `-`, `.` and an optional `:port`.
    pub fn new(authorities: impl IntoIterator<Item = (String, EgressTarget)>) -> Result<Self, String> {
        let authorities: BTreeMap<_, _> = authorities.into_iter().collect();
        for name in authorities.keys() {
            let ok = !name.is_empty()
                && name.len() <= 253
                && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | ':'));
            if !ok {
                return Err(format!(
                    "http grant authority {name:?} must be lowercase letters, digits, '-', '.' and an optional :port"
                ));
            }
        }
        Ok(HttpGrant { authorities })
    }

    pub(crate) fn target(&self, authority: &str) -> Option<&EgressTarget> {
        self.authorities.get(authority)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.authorities.is_empty()
    }

    /// Authorities and their targets, in authority order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &EgressTarget)> {
        self.authorities.iter()
    }

    /// An authority this grant has, or routes elsewhere, that `approved` does not.
    pub fn widening(&self, approved: &HttpGrant) -> Option<String> {
        self.authorities
            .iter()
            .find(|(name, target)| approved.authorities.get(*name) != Some(*target))
            .map(|(name, _)| format!("http authority {name:?}"))
    }
}

/// As the manifest writes it: authority -> target.
impl Serialize for HttpGrant {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.authorities.iter().map(|(name, target)| (name, target.to_string())))
    }
}

impl GrantValue for HttpGrant {
    fn granted(&self) -> bool {
        !self.is_empty()
    }

    fn widening(&self, approved: &Self, _key: &str) -> Option<String> {
        HttpGrant::widening(self, approved)
    }

    fn shown(&self) -> String {
        shown_list(self.listed())
    }
}

impl HttpGrant {
    /// `authority -> target`, as `provider show` and the API list them.
    fn listed(&self) -> Vec<String> {
        self.authorities.iter().map(|(authority, target)| format!("{authority} -> {target}")).collect()
    }
}

fn shown_list(items: Vec<String>) -> String {
    if items.is_empty() { "denied".to_owned() } else { items.join(", ") }
}

impl<'de> Deserialize<'de> for HttpGrant {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = BTreeMap::<String, String>::deserialize(d)?;
        let mut authorities = Vec::with_capacity(raw.len());
        for (name, target) in raw {
            let target = target.parse().map_err(serde::de::Error::custom)?;
            authorities.push((name, target));
        }
        HttpGrant::new(authorities).map_err(serde::de::Error::custom)
    }
}

/// Why a request did not go out; logged with the provider, while the guest
/// gets the matching `wasi:http` error code.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// Refused: not in `[grants.http]`.
    #[error(
        "no http grant for authority `{authority}` (grant it under [grants.http], e.g. `{authority} = \"unix:/path/to/socket\"`)"
    )]
    NotGranted {
        /// As the request named it, port included.
        authority: String,
    },
    /// Refused: the URI has no authority to look up.
    #[error("the request names no authority")]
    NoAuthority,
    /// Refused: only plain `http` goes out.
    #[error("{scheme} is not supported: granted authorities are reached over plain http")]
    Scheme {
        /// The scheme the request asked for.
        scheme: String,
    },
    /// The target could not be reached.
    #[error("cannot connect to {target} for authority `{authority}`: {source}")]
    Connect {
        /// The granted authority.
        authority: String,
        /// Where the grant sends it.
        target: String,
        /// The connect's or the handshake's error.
        source: std::io::Error,
    },
    /// Connecting (or the HTTP handshake) took longer than the connect timeout.
    #[error("connecting to {target} for authority `{authority}` timed out")]
    ConnectTimeout {
        /// The granted authority.
        authority: String,
        /// Where the grant sends it.
        target: String,
    },
    /// A script had no answer for the request (conformance kit).
    #[error("{0}")]
    Unscripted(String),
    /// The guest's request body could not be read.
    #[error("reading the request body: {0}")]
    Body(String),
    /// Refused: the sandbox gives no egress backend.
    #[error("wasi:http has no backend here: this sandbox sends no requests")]
    NoBackend,
}

impl EgressError {
    fn code(&self) -> HttpError {
        match self {
            EgressError::NotGranted { .. } | EgressError::NoBackend => HttpError::HttpRequestDenied,
            EgressError::NoAuthority => HttpError::HttpRequestUriInvalid,
            EgressError::Scheme { .. } => HttpError::HttpProtocolError,
            EgressError::Connect { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => HttpError::DestinationNotFound,
                std::io::ErrorKind::PermissionDenied => HttpError::HttpRequestDenied,
                _ => HttpError::ConnectionRefused,
            },
            EgressError::ConnectTimeout { .. } => HttpError::ConnectionTimeout,
            EgressError::Unscripted(message) => HttpError::InternalError(Some(message.clone())),
            EgressError::Body(_) => HttpError::HttpRequestBodySize(None),
        }
    }
}

/// Where granted requests go. The grant is checked the same by every
/// backend; only what answers differs: the granted targets ([`HostEgress`]),
/// a script ([`Script`], nothing leaves the host), or any backend with every
/// exchange written to a tape ([`RecordedEgress`]).
pub trait EgressBackend: Send + Sync + 'static {
    /// Send one granted request. The outer `Err` is a refusal or a failure to
    /// connect; the inner one is the `wasi:http` error the guest sees.
    fn send(
        self: Arc<Self>,
        grant: Arc<HttpGrant>,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> BoxFuture<'static, Result<SendResult, EgressError>>;
}

/// The granted targets, over a fresh connection per request.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostEgress;

impl EgressBackend for HostEgress {
    fn send(
        self: Arc<Self>,
        grant: Arc<HttpGrant>,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> BoxFuture<'static, Result<SendResult, EgressError>> {
        Box::pin(async move { send(&grant, request, options).await })
    }
}

/// The `wasi:http` hooks of one provider's stores: its grant and its egress
/// backend, nothing else. The default grants nothing and reaches nothing.
#[derive(Clone, Default)]
pub struct EgressHooks {
    provider: Arc<str>,
    grant: Arc<HttpGrant>,
    /// `None` without the grant, or in a sandbox that gives no backend.
    backend: Option<Arc<dyn EgressBackend>>,
    denials: crate::capabilities::denials::Denials,
}

impl EgressHooks {
    pub(crate) fn new(
        provider: Arc<str>,
        grant: Arc<HttpGrant>,
        backend: Option<Arc<dyn EgressBackend>>,
        denials: crate::capabilities::denials::Denials,
    ) -> Self {
        EgressHooks { provider, grant, backend, denials }
    }

    /// Where `request` goes: the backend, once the grant lets it out.
    fn backend(&self, request: &http::Request<WasiBody>) -> Result<Arc<dyn EgressBackend>, EgressError> {
        granted(&self.grant, request)?;
        self.backend.clone().ok_or(EgressError::NoBackend)
    }
}

type IoFuture = Box<dyn Future<Output = Result<(), HttpError>> + Send>;
type SendResult = Result<(http::Response<WasiBody>, IoFuture), HttpError>;

impl WasiHttpHooks for EgressHooks {
    fn is_supported_scheme(&mut self, scheme: &Scheme) -> bool {
        *scheme == Scheme::HTTP
    }

    fn default_scheme(&mut self) -> Option<Scheme> {
        Some(Scheme::HTTP)
    }

    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        _response_errors: IoFuture,
    ) -> Box<dyn Future<Output = SendResult> + Send> {
        // A root span: wasi:http runs this future in a task of its own, where it is
        // dropped under whatever dispatcher that task has, and closing a span there
        // would release its parent through the wrong one (the kit listens under its own).
        let span = tracing::info_span!(
            parent: None,
            "http_egress",
            provider = &*self.provider,
            method = %request.method(),
            authority = request.uri().authority().map(|a| a.as_str()).unwrap_or_default(),
            path = request.uri().path(),
        );
        let (provider, denials) = (self.provider.clone(), self.denials.clone());
        let sending = match self.backend(&request) {
            Ok(backend) => backend.send(self.grant.clone(), request, options),
            Err(refused) => Box::pin(std::future::ready(Err(refused))),
        };
        Box::new(
            async move {
                match sending.await {
                    Ok(sent) => sent,
                    Err(err) => {
                        if let EgressError::NotGranted { .. } | EgressError::NoBackend = &err {
                            denials.note("wasi:http", &err.to_string());
                        } else if denials.log_allowed() {
                            tracing::warn!(provider = &*provider, error = %err, "http egress failed");
                        }
                        Err(err.code())
                    }
                }
            }
            .instrument(span),
        )
    }
}

trait Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Stream for T {}

async fn connect(target: &EgressTarget) -> std::io::Result<Box<dyn Stream>> {
    Ok(match target {
        EgressTarget::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
        EgressTarget::Tcp { host, port } => Box::new(tokio::net::TcpStream::connect((host.as_str(), *port)).await?),
    })
}

/// The request's authority and its granted target, or why it may not go out.
fn granted<'g>(
    grant: &'g HttpGrant,
    request: &http::Request<WasiBody>,
) -> Result<(String, &'g EgressTarget), EgressError> {
    let authority = request.uri().authority().map(|a| a.as_str().to_owned()).ok_or(EgressError::NoAuthority)?;
    let target = grant.target(&authority).ok_or_else(|| EgressError::NotGranted { authority: authority.clone() })?;
    if let Some(scheme) = request.uri().scheme()
        && *scheme != Scheme::HTTP
    {
        return Err(EgressError::Scheme { scheme: scheme.to_string() });
    }
    Ok((authority, target))
}

/// Send one request to the target its authority is granted, over a fresh connection.
pub async fn send(
    grant: &HttpGrant,
    mut request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
) -> Result<SendResult, EgressError> {
    let (authority, target) = granted(grant, &request)?;
    let options = options.unwrap_or_default();
    let connect_timeout = options.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let first_byte_timeout = options.first_byte_timeout.unwrap_or(DEFAULT_FIRST_BYTE_TIMEOUT);
    let connect_error =
        |source| EgressError::Connect { authority: authority.clone(), target: target.to_string(), source };
    let timed_out = || EgressError::ConnectTimeout { authority: authority.clone(), target: target.to_string() };

    let stream = tokio::time::timeout(connect_timeout, connect(target))
        .await
        .map_err(|_| timed_out())?
        .map_err(connect_error)?;
    let handshake = hyper::client::conn::http1::handshake::<_, WasiBody>(TokioIo::new(stream));
    let (mut sender, connection) = match tokio::time::timeout(connect_timeout, handshake).await {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => return Err(connect_error(std::io::Error::other(e))),
        Ok(Ok(parts)) => parts,
    };
    // The connection is driven by its own task; its end is the I/O future wasi:http awaits.
    let connection = tokio::spawn(connection);
    // Origin-form on the wire: the authority was only ever a name for the grant.
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    *request.uri_mut() =
        http::Uri::builder().path_and_query(path).build().map_err(|e| connect_error(std::io::Error::other(e)))?;

    Ok(async move {
        let response = tokio::time::timeout(first_byte_timeout, sender.send_request(request))
            .await
            .map_err(|_| HttpError::ConnectionReadTimeout)??;
        let response = response.map(|body| body.map_err(HttpError::from).boxed_unsync());
        let io: IoFuture = Box::new(async move {
            match connection.await {
                Ok(result) => result.map_err(HttpError::from),
                Err(join) => Err(HttpError::InternalError(Some(join.to_string()))),
            }
        });
        Ok((response, io))
    }
    .await)
}

/// Link `wasi:http/types` and `outgoing-handler`. Always linked: a provider
/// without a grant for an authority gets `http-request-denied` for it.
pub fn add_to_linker<T: WasiHttpView + 'static>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wasmtime_wasi_http::p2::add_only_http_to_linker_async(linker)
}

/// A store's part of `wasi:http`: wasi-http's own context and the hooks
/// every request goes through.
#[derive(Default)]
pub struct EgressCtx {
    pub(crate) http: WasiHttpCtx,
    pub(crate) hooks: EgressHooks,
}

/// The room: `[grants.http]` (authority -> target), over plain `wasi:http`.
pub struct HttpEgress;

impl Room for HttpEgress {
    const INTERFACE: &'static str = "wasi:http";
    const GRANT: &'static str = "http";
    const LINKING: Linking = Linking::Always;
    type Grant = HttpGrant;
    type Backend = dyn EgressBackend;
    type Ctx = EgressCtx;
    type Prepared = ();

    fn host_backend() -> Option<Arc<dyn EgressBackend>> {
        Some(Arc::new(HostEgress))
    }

    fn ctx(grant: &HttpGrant, backend: Option<Arc<dyn EgressBackend>>, store: &StoreSetup<'_>) -> EgressCtx {
        let hooks = EgressHooks::new(store.provider.clone(), Arc::new(grant.clone()), backend, store.denials.clone());
        EgressCtx { http: WasiHttpCtx::new(), hooks }
    }

    fn add_to_linker(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
        add_to_linker(linker)
    }

    /// Listed as `authority -> target`, as before rooms.
    fn view(grant: &HttpGrant) -> Map<String, Value> {
        Map::from_iter([(Self::GRANT.to_owned(), Value::from(grant.listed()))])
    }

    fn shown_view(view: &Map<String, Value>) -> Vec<GrantLine> {
        let Some(listed) = view.get(Self::GRANT).and_then(|v| Vec::<String>::deserialize(v).ok()) else {
            return Vec::new();
        };
        vec![GrantLine::new(Self::GRANT, Self::GRANT, shown_list(listed))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Empty, Full};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    fn request(uri: &str, text: &'static str) -> http::Request<WasiBody> {
        let body = if text.is_empty() {
            Empty::new().map_err(|never| match never {}).boxed_unsync()
        } else {
            Full::new(bytes::Bytes::from_static(text.as_bytes())).map_err(|never| match never {}).boxed_unsync()
        };
        http::Request::builder().method("POST").uri(uri).header("content-length", text.len()).body(body).unwrap()
    }

    /// The room: an authority not granted is refused and noted; a granted one
    /// in a sandbox that gives no backend is refused too (never the host's);
    /// the grant is reported and shown as `authority -> target`.
    #[tokio::test]
    async fn the_room_refuses_what_is_not_granted_or_not_backed() {
        use crate::capabilities::denials::Denials;
        let provider: Arc<str> = "p".into();
        let (denials, denied) = Denials::collecting();
        let store = StoreSetup {
            provider: &provider,
            data_dir: std::path::Path::new("/nonexistent"),
            denials: &denials.for_provider(provider.clone(), Default::default()),
            sandbox_user: None,
            acts_outside_the_store: true,
            prepared: &Default::default(),
            quotas: &Default::default(),
        };
        let grant = HttpGrant::new([("lxd".to_owned(), EgressTarget::Unix("/nonexistent.sock".into()))]).unwrap();
        let mut sealed = HttpEgress::ctx(&grant, None, &store);
        for (uri, refusal) in
            [("http://other/1.0", "no http grant for authority `other`"), ("http://lxd/1.0", "no backend")]
        {
            let io: IoFuture = Box::new(async { Ok(()) });
            let sent = Box::into_pin(sealed.hooks.send_request(request(uri, ""), None, io)).await;
            assert!(matches!(sent, Err(HttpError::HttpRequestDenied)), "{uri}");
            let noted = denied.lock().unwrap().pop().unwrap_or_default();
            assert!(noted.contains(refusal), "{uri}: {noted}");
        }

        let view = HttpEgress::view(&grant);
        assert_eq!(view["http"], serde_json::json!(["lxd -> unix:/nonexistent.sock"]));
        assert_eq!(
            HttpEgress::shown_view(&view),
            [GrantLine::new("http", "http", "lxd -> unix:/nonexistent.sock".into())]
        );
        let none = HttpEgress::view(&HttpGrant::default());
        assert_eq!(HttpEgress::shown_view(&none), [GrantLine::new("http", "http", "denied".into())]);
        let back: HttpGrant = serde_json::from_value(serde_json::to_value(&grant).unwrap()).unwrap();
        assert_eq!(back, grant, "the grant round-trips as the manifest writes it");
    }

    /// A one-request HTTP server on `listener` that echoes the request line,
    /// the Host header and the body back as the response body.
    async fn echo_once<S: AsyncRead + AsyncWrite + Unpin>(stream: S) {
        let mut reader = BufReader::new(stream);
        let mut request_line = String::new();
        reader.read_line(&mut request_line).await.unwrap();
        let (mut host, mut length) = (String::new(), 0usize);
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).await.unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(": ").unwrap();
            match name.to_ascii_lowercase().as_str() {
                "host" => host = value.to_owned(),
                "content-length" => length = value.parse().unwrap(),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).await.unwrap();
        let reply = format!("{}|{host}|{}", request_line.trim_end(), String::from_utf8(body).unwrap());
        let head = format!("HTTP/1.1 201 Created\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", reply.len());
        let mut stream = reader.into_inner();
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(reply.as_bytes()).await.unwrap();
        stream.shutdown().await.unwrap();
    }

    fn refused(result: Result<SendResult, EgressError>) -> EgressError {
        match result {
            Err(err) => err,
            Ok(_) => panic!("the request went out"),
        }
    }

    async fn body_text(result: SendResult) -> (u16, String) {
        let (response, io) = result.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Box::into_pin(io).await.unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[test]
    fn targets_parse_strictly() {
        assert_eq!("unix:/run/x.sock".parse(), Ok(EgressTarget::Unix("/run/x.sock".into())));
        assert_eq!("http://127.0.0.1:5000".parse(), Ok(EgressTarget::Tcp { host: "127.0.0.1".into(), port: 5000 }));
        assert_eq!("http://ec2.local".parse(), Ok(EgressTarget::Tcp { host: "ec2.local".into(), port: 80 }));
        for bad in ["unix:relative.sock", "unix:/a/../b", "ftp://x", "http://", "http://h:99999", "http://h/p", "x"] {
            assert!(bad.parse::<EgressTarget>().is_err(), "{bad} should be refused");
        }
        let https = "https://x".parse::<EgressTarget>().unwrap_err();
        assert!(https.contains("https is not supported"), "{https}");
        assert!(HttpGrant::new([("LXD".to_owned(), EgressTarget::Unix("/x".into()))]).is_err());
    }

    #[tokio::test]
    async fn a_granted_unix_authority_reaches_its_socket_and_nothing_else_does() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.socket");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let server = tokio::spawn(async move { echo_once(listener.accept().await.unwrap().0).await });
        let grant = HttpGrant::new([("lxd".to_owned(), EgressTarget::Unix(socket.clone()))]).unwrap();

        let sent = send(&grant, request("http://lxd/1.0/instances?project=p", "{\"a\":1}"), None).await.unwrap();
        let (status, body) = body_text(sent).await;
        assert_eq!(status, 201);
        assert_eq!(body, "POST /1.0/instances?project=p HTTP/1.1||{\"a\":1}", "origin-form path, body intact");
        server.await.unwrap();

        let denied = refused(send(&grant, request("http://docker/containers/json", ""), None).await);
        assert!(matches!(&denied, EgressError::NotGranted { authority } if authority == "docker"), "{denied}");
        assert!(denied.to_string().contains("[grants.http]"), "names the grant: {denied}");
        assert!(matches!(denied.code(), HttpError::HttpRequestDenied));
        // The same authority with a port is a different authority.
        let other_port = refused(send(&grant, request("http://lxd:8443/1.0", ""), None).await);
        assert!(matches!(other_port, EgressError::NotGranted { .. }));
        let https = refused(send(&grant, request("https://lxd/1.0", ""), None).await);
        assert!(matches!(https, EgressError::Scheme { .. }), "{https}");
    }

    #[tokio::test]
    async fn a_granted_tcp_authority_gets_a_host_header_and_a_missing_socket_is_typed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move { echo_once(listener.accept().await.unwrap().0).await });
        let grant = HttpGrant::new([
            ("ec2".to_owned(), EgressTarget::Tcp { host: "127.0.0.1".into(), port }),
            ("gone".to_owned(), EgressTarget::Unix("/nonexistent/broker-test.socket".into())),
        ])
        .unwrap();
        let mut req = request("http://ec2/?Action=DescribeInstances", "");
        req.headers_mut().insert("host", "ec2".parse().unwrap());
        let (status, body) = body_text(send(&grant, req, None).await.unwrap()).await;
        assert_eq!((status, body.as_str()), (201, "POST /?Action=DescribeInstances HTTP/1.1|ec2|"));
        server.await.unwrap();

        let missing = refused(send(&grant, request("http://gone/x", ""), None).await);
        assert!(matches!(missing.code(), HttpError::DestinationNotFound), "{missing}");
        assert!(missing.to_string().contains("/nonexistent/broker-test.socket"), "{missing}");
    }
}
