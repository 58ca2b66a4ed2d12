//! Egress through plain `wasi:http`: a provider reaches exactly the
//! authorities its manifest grants, each mapped by the host to a unix socket
//! (the LXD/Incus API), a TCP address or an `https://` endpoint. The guest
//! never names a socket path or an address; it asks for `http://lxd/1.0/…`
//! and the host decides where `lxd` is. Everything else is denied.
//!
//! ```toml
//! [grants.http]
//! lxd = "unix:/var/lib/incus/unix.socket"
//! [grants.http.ec2]
//! url = "https://ec2.eu-west-1.amazonaws.com"
//! sign = "aws-sigv4"           # signed by the host (see signing)
//! service = "ec2"
//! region = "eu-west-1"
//! credentials = "prod"         # DATA_DIR/credentials/prod.toml
//! actions = ["RunInstances", "DescribeInstances"]
//! max-count = 10
//! require-tag = "broker-namespace=host0"
//! ```
//!
//! TLS is [`tls`]'s (rustls, the machine's roots and a grant's `ca-file`),
//! signing [`signing`]'s, and what a signed request may ask [`rules`]'.
//!
//! The room is [`HttpEgress`]: `wasi:http` is linked for every provider, and
//! each request goes through the store's [`EgressHooks`] (`send_request`),
//! which check the grant and hand the request to an [`EgressBackend`]: the
//! granted targets ([`HostEgress`]), or in the conformance kit a script or a
//! recording.

use crate::rooms::BoxError;
use crate::rooms::HasRooms;
use crate::rooms::{GrantLine, GrantValue, Linking, LoadSetup, Room, StoreSetup};
use bytes::Bytes;
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
use wasmtime_wasi_http::{
    Error as HttpError, RequestOptions, WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView,
};

pub mod kit;
pub mod rules;
pub mod script;
pub mod signing;
pub mod tls;
pub use script::{Exchange, RecordedEgress, Script, Tape};

/// How long to wait for a connection and for the first response byte when the
/// guest does not say; the call's own deadline bounds everything anyway.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(120);
/// The request bodies one provider version's signed requests may hold at
/// once while the host reads, checks and signs them (KiB): four of the
/// largest, however many requests the guest opens.
pub(crate) const SIGNED_BODIES_IN_FLIGHT_KIB: u32 = 4 * (rules::MAX_SIGNED_BODY as u32 / 1024);

/// What a provider version's signed requests may buffer at once: a request
/// waits for room (its call's deadline bounds the wait), so the host's memory
/// does not grow with the number of requests a guest opens.
#[derive(Clone, Debug)]
pub struct SignedBodies(Arc<tokio::sync::Semaphore>);

impl Default for SignedBodies {
    fn default() -> Self {
        SignedBodies(Arc::new(tokio::sync::Semaphore::new(SIGNED_BODIES_IN_FLIGHT_KIB as usize)))
    }
}

impl SignedBodies {
    /// The room `request`'s body takes (KiB): its declared length when it has
    /// a plain one no larger than the most the host signs, else that most (the
    /// guest cannot write past a declared length: wasi:http holds it to it).
    fn kib_for(request: &http::Request<WasiBody>) -> u32 {
        let mut lengths = request.headers().get_all(http::header::CONTENT_LENGTH).iter();
        let declared = match (lengths.next(), lengths.next()) {
            (Some(one), None) => one.to_str().ok().and_then(|v| v.parse::<usize>().ok()),
            _ => None,
        }
        .filter(|&n| n <= rules::MAX_SIGNED_BODY);
        declared.unwrap_or(rules::MAX_SIGNED_BODY).div_ceil(1024).max(1) as u32
    }

    /// Wait for `kib` of room; held until the permit is dropped.
    async fn room(&self, kib: u32) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.clone().acquire_many_owned(kib).await.ok()
    }

    /// KiB free now.
    #[cfg(test)]
    fn available_kib(&self) -> usize {
        self.0.available_permits()
    }
}

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
    /// `https://host[:port]`: HTTP over TLS, the certificate checked for `host`.
    Https {
        /// A name or an IP address, as the grant writes it.
        host: String,
        /// 443 unless the grant gives one.
        port: u16,
    },
}

impl EgressTarget {
    /// What the upstream is told it is (`Host`): `host`, with `:port` unless the scheme's own.
    fn host_header(&self) -> Option<String> {
        match self {
            EgressTarget::Unix(_) => None,
            EgressTarget::Tcp { host, port: 80 } | EgressTarget::Https { host, port: 443 } => Some(host.clone()),
            EgressTarget::Tcp { host, port } | EgressTarget::Https { host, port } => Some(format!("{host}:{port}")),
        }
    }
}

impl std::str::FromStr for EgressTarget {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let wrong = || {
            format!(
                "http grant target {text:?} must be `unix:/absolute/path`, `http://host[:port]` or `https://host[:port]`"
            )
        };
        if let Some(path) = text.strip_prefix("unix:") {
            let path = PathBuf::from(path);
            let clean = path.is_absolute() && path.components().all(|c| !matches!(c, Component::ParentDir));
            return if clean { Ok(EgressTarget::Unix(path)) } else { Err(wrong()) };
        }
        let (tls, rest) = match (text.strip_prefix("http://"), text.strip_prefix("https://")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) => (true, rest),
            _ => return Err(wrong()),
        };
        let rest = rest.trim_end_matches('/');
        if rest.is_empty() || rest.contains('/') || rest.contains('@') {
            return Err(wrong());
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => {
                (host.to_owned(), port.parse::<u16>().map_err(|_| wrong())?)
            }
            _ => (rest.to_owned(), if tls { 443 } else { 80 }),
        };
        if host.is_empty() || port == 0 {
            return Err(wrong());
        }
        Ok(if tls { EgressTarget::Https { host, port } } else { EgressTarget::Tcp { host, port } })
    }
}

impl fmt::Display for EgressTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressTarget::Unix(path) => write!(f, "unix:{}", path.display()),
            EgressTarget::Tcp { host, port } => write!(f, "http://{host}:{port}"),
            EgressTarget::Https { host, port } => write!(f, "https://{host}:{port}"),
        }
    }
}

/// One granted authority: where it goes and, for a signed one, how the host
/// signs it and what it may ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Where the host sends it.
    pub target: EgressTarget,
    /// PEM CAs an `https` target's certificate may chain to, besides the machine's.
    pub ca_file: Option<PathBuf>,
    /// Signed by the host with a credential the guest never sees.
    pub signing: Option<signing::AwsSigning>,
    /// What a signed request may ask, checked before it is sent.
    pub rules: rules::Rules,
}

impl Route {
    /// A plain route: the target, nothing else.
    pub fn to(target: EgressTarget) -> Route {
        Route { target, ca_file: None, signing: None, rules: rules::Rules::default() }
    }

    fn is_plain(&self) -> bool {
        self.ca_file.is_none() && self.signing.is_none() && !self.rules.any()
    }
}

/// `[grants.http.NAME]` as a table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RouteTable {
    url: String,
    ca_file: Option<PathBuf>,
    sign: Option<String>,
    service: Option<String>,
    region: Option<String>,
    credentials: Option<String>,
    #[serde(default)]
    actions: Vec<String>,
    max_count: Option<u32>,
    require_tag: Option<String>,
}

/// Where a signature may travel: over TLS, or in plain text only to this machine.
fn signs_safely(target: &EgressTarget) -> bool {
    match target {
        EgressTarget::Https { .. } => true,
        EgressTarget::Tcp { host, .. } => {
            host == "localhost"
                || host
                    .trim_matches(|c| c == '[' || c == ']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }
        EgressTarget::Unix(_) => false,
    }
}

/// An AWS service or region name: lowercase letters, digits and '-'.
fn aws_name(what: &str, name: &str) -> Result<String, String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok { Ok(name.to_owned()) } else { Err(format!("{what} {name:?} must be lowercase letters, digits and '-'")) }
}

impl RouteTable {
    fn route(self, authority: &str) -> Result<Route, String> {
        let at = |message: String| format!("[grants.http.{authority}]: {message}");
        let target: EgressTarget = self.url.parse().map_err(at)?;
        if let Some(ca_file) = &self.ca_file
            && (!ca_file.is_absolute() || !matches!(target, EgressTarget::Https { .. }))
        {
            return Err(at(format!("ca-file {} needs an absolute path and an https:// url", ca_file.display())));
        }
        let signing = match self.sign.as_deref() {
            Some("aws-sigv4") => {
                let need = |key: &str, value: Option<String>| {
                    value.ok_or_else(|| at(format!("sign = \"aws-sigv4\" needs {key}")))
                };
                let credentials = need("credentials", self.credentials)?;
                signing::check_name(&credentials).map_err(at)?;
                Some(signing::AwsSigning {
                    service: aws_name("service", &need("service", self.service)?).map_err(at)?,
                    region: aws_name("region", &need("region", self.region)?).map_err(at)?,
                    credentials,
                })
            }
            Some(other) => return Err(at(format!("sign = {other:?}: the host signs only \"aws-sigv4\""))),
            None if self.service.is_some() || self.region.is_some() || self.credentials.is_some() => {
                return Err(at("service, region and credentials go with sign = \"aws-sigv4\"".into()));
            }
            None => None,
        };
        if signing.is_some() && !signs_safely(&target) {
            return Err(at(format!(
                "sign sends a signature and perhaps a session token: the url must be https:// (plain http only to loopback), not {target}"
            )));
        }
        let rules = rules::Rules {
            actions: self.actions,
            max_count: self.max_count,
            require_tag: self.require_tag.as_deref().map(rules::parse_tag).transpose().map_err(at)?,
        };
        if rules.any() && signing.is_none() {
            return Err(at("actions, max-count and require-tag limit what a credential may do: they need sign".into()));
        }
        let ec2_only = rules.max_count.is_some() || rules.require_tag.is_some();
        if ec2_only && rules.actions.is_empty() {
            return Err(at("max-count and require-tag bound RunInstances only: list the allowed actions too".into()));
        }
        if ec2_only && signing.as_ref().is_some_and(|s| s.service != "ec2") {
            return Err(at(
                "max-count and require-tag are EC2's RunInstances rules: they need service = \"ec2\"".into()
            ));
        }
        if let Some(action) =
            rules.actions.iter().find(|a| a.is_empty() || !a.chars().all(|c| c.is_ascii_alphanumeric()))
        {
            return Err(at(format!("action {action:?} is not an AWS action name")));
        }
        Ok(Route { target, ca_file: self.ca_file, signing, rules })
    }
}

/// The `[grants.http]` table: authority (as the guest writes it in its URLs) → route.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpGrant {
    authorities: BTreeMap<String, Route>,
}

impl HttpGrant {
    /// Plain routes. Fails on an authority that is not lowercase letters, digits, `-`, `.` and an optional `:port`.
    pub fn new(authorities: impl IntoIterator<Item = (String, EgressTarget)>) -> Result<Self, String> {
        HttpGrant::routes(authorities.into_iter().map(|(name, target)| (name, Route::to(target))))
    }

    /// Routes of any kind; the authorities checked as [`HttpGrant::new`] does.
    pub fn routes(authorities: impl IntoIterator<Item = (String, Route)>) -> Result<Self, String> {
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

    pub(crate) fn route(&self, authority: &str) -> Option<&Route> {
        self.authorities.get(authority)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.authorities.is_empty()
    }

    /// Authorities and their routes, in authority order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Route)> {
        self.authorities.iter()
    }

    /// An authority this grant has, or routes, signs or limits otherwise, that `approved` does not.
    pub fn widening(&self, approved: &HttpGrant) -> Option<String> {
        self.authorities
            .iter()
            .find(|(name, route)| approved.authorities.get(*name) != Some(*route))
            .map(|(name, _)| format!("http authority {name:?}"))
    }
}

/// As the manifest writes it: authority -> target, or a table.
impl Serialize for HttpGrant {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.authorities.iter().map(|(name, route)| (name, route_value(route))))
    }
}

fn route_value(route: &Route) -> Value {
    if route.is_plain() {
        return Value::from(route.target.to_string());
    }
    let mut table = Map::new();
    table.insert("url".into(), Value::from(route.target.to_string()));
    if let Some(ca_file) = &route.ca_file {
        table.insert("ca-file".into(), Value::from(ca_file.display().to_string()));
    }
    if let Some(signing) = &route.signing {
        table.insert("sign".into(), Value::from("aws-sigv4"));
        table.insert("service".into(), Value::from(signing.service.clone()));
        table.insert("region".into(), Value::from(signing.region.clone()));
        table.insert("credentials".into(), Value::from(signing.credentials.clone()));
    }
    if !route.rules.actions.is_empty() {
        table.insert("actions".into(), Value::from(route.rules.actions.clone()));
    }
    if let Some(max) = route.rules.max_count {
        table.insert("max-count".into(), Value::from(max));
    }
    if let Some((key, value)) = &route.rules.require_tag {
        table.insert("require-tag".into(), Value::from(format!("{key}={value}")));
    }
    Value::Object(table)
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
    /// `authority -> target (how)`, as `provider show` and the API list them:
    /// a credential by its name, never its content.
    fn listed(&self) -> Vec<String> {
        self.authorities
            .iter()
            .map(|(authority, route)| {
                let mut how = Vec::new();
                if let Some(ca_file) = &route.ca_file {
                    how.push(format!("ca-file {}", ca_file.display()));
                }
                if let Some(signing) = &route.signing {
                    how.push(format!(
                        "signed aws-sigv4 for {}/{} with credentials {}",
                        signing.service, signing.region, signing.credentials
                    ));
                }
                if !route.rules.actions.is_empty() {
                    how.push(format!("actions {}", route.rules.actions.join(" ")));
                }
                if let Some(max) = route.rules.max_count {
                    how.push(format!("max-count {max}"));
                }
                if let Some((key, value)) = &route.rules.require_tag {
                    how.push(format!("require-tag {key}={value}"));
                }
                match how.is_empty() {
                    true => format!("{authority} -> {}", route.target),
                    false => format!("{authority} -> {} ({})", route.target, how.join("; ")),
                }
            })
            .collect()
    }
}

fn shown_list(items: Vec<String>) -> String {
    if items.is_empty() { "denied".to_owned() } else { items.join(", ") }
}

impl<'de> Deserialize<'de> for HttpGrant {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = BTreeMap::<String, Value>::deserialize(d)?;
        let mut authorities = Vec::with_capacity(raw.len());
        for (name, value) in raw {
            let route = match value {
                Value::String(target) => Route::to(target.parse().map_err(serde::de::Error::custom)?),
                table @ Value::Object(_) => RouteTable::deserialize(table)
                    .map_err(|e| serde::de::Error::custom(format!("[grants.http.{name}]: {e}")))?
                    .route(&name)
                    .map_err(serde::de::Error::custom)?,
                other => {
                    return Err(serde::de::Error::custom(format!(
                        "[grants.http] {name}: a target string or a table with url, not {other}"
                    )));
                }
            };
            authorities.push((name, route));
        }
        HttpGrant::routes(authorities).map_err(serde::de::Error::custom)
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
    /// Refused: the guest names `http` or `https`; the grant decides what is spoken.
    #[error("{scheme} is not supported: name a granted authority as http://NAME/ (the grant decides TLS)")]
    Scheme {
        /// The scheme the request asked for.
        scheme: String,
    },
    /// The target could not be reached.
    #[error("cannot connect to {target} for authority `{authority}`: {}", crate::error_text::cause_text(.cause))]
    Connect {
        /// The granted authority.
        authority: String,
        /// Where the grant sends it.
        target: String,
        /// The connect's or the handshake's error.
        cause: std::io::Error,
    },
    /// Connecting (or the HTTP handshake) took longer than the connect timeout.
    #[error("connecting to {target} for authority `{authority}` timed out")]
    ConnectTimeout {
        /// The granted authority.
        authority: String,
        /// Where the grant sends it.
        target: String,
    },
    /// TLS to an `https` target failed: an unknown CA, a certificate for another name, …
    #[error("TLS to {target} for authority `{authority}` failed: {}", crate::error_text::cause_text(.cause))]
    Tls {
        /// The granted authority.
        authority: String,
        /// Where the grant sends it.
        target: String,
        /// What failed.
        cause: tls::TlsError,
    },
    /// The host could not sign: its credentials are missing or unusable. Nothing was sent.
    #[error("cannot sign the request for authority `{authority}`: {}", crate::error_text::cause_text(.cause))]
    Signing {
        /// The granted authority.
        authority: String,
        /// What failed (never the secret).
        cause: signing::SigningError,
    },
    /// The grant's rules refuse the request. Nothing was sent.
    #[error("request for authority `{authority}` {refused}")]
    Refused {
        /// The granted authority.
        authority: String,
        /// The rule and why.
        refused: rules::Refused,
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
            EgressError::NotGranted { .. } | EgressError::NoBackend | EgressError::Refused { .. } => {
                HttpError::HttpRequestDenied
            }
            EgressError::Tls { cause: source, .. } if source.is_certificate() => HttpError::TlsCertificateError,
            EgressError::Tls { .. } => HttpError::TlsProtocolError,
            EgressError::Signing { authority, .. } => HttpError::InternalError(Some(format!(
                "the host cannot sign requests for `{authority}` now: its log says why"
            ))),
            EgressError::NoAuthority => HttpError::HttpRequestUriInvalid,
            EgressError::Scheme { .. } => HttpError::HttpProtocolError,
            EgressError::Connect { cause: source, .. } => match source.kind() {
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

/// The granted targets, over a fresh connection per request; signed
/// routes with the credentials in its dir (none: signed routes fail).
#[derive(Clone, Debug, Default)]
pub struct HostEgress {
    credentials: Option<Arc<signing::CredentialsDir>>,
}

impl HostEgress {
    /// Signing with the credentials in `dir` (`DATA_DIR/credentials`).
    pub fn with_credentials(dir: PathBuf) -> HostEgress {
        HostEgress { credentials: Some(Arc::new(signing::CredentialsDir::new(dir))) }
    }
}

impl EgressBackend for HostEgress {
    fn send(
        self: Arc<Self>,
        grant: Arc<HttpGrant>,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> BoxFuture<'static, Result<SendResult, EgressError>> {
        Box::pin(async move { send_with(&grant, self.credentials.as_deref(), request, options).await })
    }
}

/// The `wasi:http` hooks of one provider's stores: its grant and its egress
/// backend, nothing else. The default grants nothing and reaches nothing.
#[derive(Clone, Default)]
pub(crate) struct EgressHooks {
    provider: Arc<str>,
    grant: Arc<HttpGrant>,
    /// `None` without the grant, or in a sandbox that gives no backend.
    backend: Option<Arc<dyn EgressBackend>>,
    denials: crate::rooms::denials::Denials,
    /// Shared by every store of the provider version.
    signed_bodies: SignedBodies,
    /// Hides the provider's secrets in what is logged of a request (its path).
    redactor: Arc<crate::secrets::Redactor>,
}

impl EgressHooks {
    pub(crate) fn new(
        provider: Arc<str>,
        grant: Arc<HttpGrant>,
        backend: Option<Arc<dyn EgressBackend>>,
        denials: crate::rooms::denials::Denials,
        signed_bodies: SignedBodies,
    ) -> Self {
        EgressHooks { provider, grant, backend, denials, signed_bodies, redactor: Arc::default() }
    }

    /// The same, hiding `redactor`'s secrets in what is logged of a request.
    pub(crate) fn redacting(mut self, redactor: Arc<crate::secrets::Redactor>) -> Self {
        self.redactor = redactor;
        self
    }

    /// Where `request` goes: the backend, once the grant lets it out.
    /// With it, whether the route signs (then the body counts against the version's budget).
    fn backend(&self, request: &http::Request<WasiBody>) -> Result<(Arc<dyn EgressBackend>, bool), EgressError> {
        let (_, route) = granted(&self.grant, request)?;
        let backend = self.backend.clone().ok_or(EgressError::NoBackend)?;
        Ok((backend, route.signing.is_some()))
    }
}

type IoFuture = Box<dyn Future<Output = Result<(), HttpError>> + Send>;
type SendResult = Result<(http::Response<WasiBody>, IoFuture), HttpError>;

impl WasiHttpHooks for EgressHooks {
    fn is_supported_scheme(&mut self, scheme: &Scheme) -> bool {
        *scheme == Scheme::HTTP || *scheme == Scheme::HTTPS
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
            authority = request.uri().authority().map(|a| without_userinfo(a.as_str())).unwrap_or_default(),
            // A webhook's path can be its secret.
            path = %self.redactor.redact(request.uri().path()),
        );
        let (provider, denials) = (self.provider.clone(), self.denials.clone());
        let sending: BoxFuture<'static, Result<SendResult, EgressError>> = match self.backend(&request) {
            Ok((backend, true)) => {
                let (grant, bodies) = (self.grant.clone(), self.signed_bodies.clone());
                let kib = SignedBodies::kib_for(&request);
                Box::pin(async move {
                    // Held until the answer's head: the body is read, signed and sent by then.
                    let _room = bodies.room(kib).await;
                    backend.send(grant, request, options).await
                })
            }
            Ok((backend, false)) => backend.send(self.grant.clone(), request, options),
            Err(refused) => Box::pin(std::future::ready(Err(refused))),
        };
        Box::new(
            async move {
                match sending.await {
                    Ok(sent) => sent,
                    Err(err) => {
                        if let EgressError::NotGranted { .. } | EgressError::NoBackend | EgressError::Refused { .. } =
                            &err
                        {
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

/// Why a connection could not be made: the transport's error, or TLS's.
enum ConnectFailure {
    Io(std::io::Error),
    Tls(tls::TlsError),
}

async fn connect(route: &Route) -> Result<Box<dyn Stream>, ConnectFailure> {
    Ok(match &route.target {
        EgressTarget::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await.map_err(ConnectFailure::Io)?),
        EgressTarget::Tcp { host, port } => {
            Box::new(tokio::net::TcpStream::connect((host.as_str(), *port)).await.map_err(ConnectFailure::Io)?)
        }
        EgressTarget::Https { host, port } => {
            let config = tls::client_config(route.ca_file.as_deref()).map_err(ConnectFailure::Tls)?;
            let tcp = tokio::net::TcpStream::connect((host.as_str(), *port)).await.map_err(ConnectFailure::Io)?;
            Box::new(tls::connect(tcp, host, config).await.map_err(ConnectFailure::Tls)?)
        }
    })
}

/// `authority` without a `user:password@` in front: what may be logged of it.
fn without_userinfo(authority: &str) -> &str {
    authority.rsplit_once('@').map_or(authority, |(_, host)| host)
}

/// The request's authority and its granted route, or why it may not go out.
fn granted<'g>(grant: &'g HttpGrant, request: &http::Request<WasiBody>) -> Result<(String, &'g Route), EgressError> {
    let authority = request.uri().authority().map(|a| a.as_str().to_owned()).ok_or(EgressError::NoAuthority)?;
    // No grant names a user: a `user:password@` is refused, and never quoted.
    let route = grant
        .route(&authority)
        .ok_or_else(|| EgressError::NotGranted { authority: without_userinfo(&authority).to_owned() })?;
    if let Some(scheme) = request.uri().scheme()
        && *scheme != Scheme::HTTP
        && *scheme != Scheme::HTTPS
    {
        return Err(EgressError::Scheme { scheme: scheme.to_string() });
    }
    Ok((authority, route))
}

/// How long a guest has to write a body the host signs: its room in the
/// version's budget is held meanwhile, so a body never finished gives it back.
const SIGNED_BODY_PATIENCE: Duration = Duration::from_secs(30);

/// Read a body the host must see whole (to check and sign it), at most `limit` bytes.
async fn whole_body(body: WasiBody, limit: usize) -> Result<Bytes, EgressError> {
    let collected =
        tokio::time::timeout(SIGNED_BODY_PATIENCE, http_body_util::Limited::new(body, limit).collect()).await.map_err(
            |_| EgressError::Body(format!("the body was not written whole within {}s", SIGNED_BODY_PATIENCE.as_secs())),
        )?;
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(EgressError::Body(format!("a request the host signs is at most {limit} bytes")))
        }
        Err(e) => Err(EgressError::Body(e.to_string())),
    }
}

/// For a signed route: check the rules, then sign with the grant's
/// credential. The guest's own signing headers are dropped first.
async fn signed(
    authority: &str,
    route: &Route,
    signing: &signing::AwsSigning,
    credentials: Option<&signing::CredentialsDir>,
    request: http::Request<WasiBody>,
) -> Result<http::Request<WasiBody>, EgressError> {
    let (mut parts, body) = request.into_parts();
    let body = whole_body(body, rules::MAX_SIGNED_BODY).await?;
    route
        .rules
        .check_request(&parts.headers, parts.uri.query(), &body)
        .map_err(|refused| EgressError::Refused { authority: authority.to_owned(), refused })?;
    let failed = |source| EgressError::Signing { authority: authority.to_owned(), cause: source };
    let credentials = credentials
        .ok_or_else(|| failed(signing::SigningError::NoCredentialsDir { name: signing.credentials.clone() }))?
        .get(&signing.credentials)
        .await
        .map_err(failed)?;
    for name in signing::SIGNING_HEADERS {
        parts.headers.remove(name);
    }
    // Signed as the upstream will see it: its own scheme, host and port.
    let scheme = if matches!(route.target, EgressTarget::Https { .. }) { "https" } else { "http" };
    let host = route.target.host_header().unwrap_or_else(|| authority.to_owned());
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let absolute: http::Uri = format!("{scheme}://{host}{path}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| failed(signing::SigningError::Sign(e.to_string())))?;
    let mut to_sign = http::Request::builder()
        .method(parts.method.clone())
        .uri(absolute)
        .body(())
        .map_err(|e| failed(signing::SigningError::Sign(e.to_string())))?;
    *to_sign.headers_mut() = parts.headers.clone();
    let host_value =
        http::HeaderValue::from_str(&host).map_err(|e| failed(signing::SigningError::Sign(e.to_string())))?;
    to_sign.headers_mut().insert(http::header::HOST, host_value);
    signing::sign(&mut to_sign, &body, signing, credentials).map_err(failed)?;
    parts.headers = to_sign.headers().clone();
    let body = http_body_util::Full::new(body).map_err(|never| match never {}).boxed_unsync();
    Ok(http::Request::from_parts(parts, body))
}

/// Send one request to the target its authority is granted, over a fresh
/// connection: signed first where the grant says so (`credentials`: the
/// host's credentials dir; `None` where the host keeps none).
pub async fn send(
    grant: &HttpGrant,
    request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
) -> Result<SendResult, EgressError> {
    send_with(grant, None, request, options).await
}

async fn send_with(
    grant: &HttpGrant,
    credentials: Option<&signing::CredentialsDir>,
    request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
) -> Result<SendResult, EgressError> {
    let (authority, route) = granted(grant, &request)?;
    let target = &route.target;
    let mut request = match &route.signing {
        Some(signing) => signed(&authority, route, signing, credentials, request).await?,
        None => request,
    };
    // An https upstream is told its own name (virtual hosts, certificates);
    // a plain one still hears the grant's name, as it always has.
    if let (EgressTarget::Https { .. }, Some(host)) = (target, target.host_header())
        && let Ok(value) = http::HeaderValue::from_str(&host)
    {
        request.headers_mut().insert(http::header::HOST, value);
    }
    let options = options.unwrap_or_default();
    let connect_timeout = options.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let first_byte_timeout = options.first_byte_timeout.unwrap_or(DEFAULT_FIRST_BYTE_TIMEOUT);
    let connect_error =
        |source| EgressError::Connect { authority: authority.clone(), target: target.to_string(), cause: source };
    let timed_out = || EgressError::ConnectTimeout { authority: authority.clone(), target: target.to_string() };

    let stream = match tokio::time::timeout(connect_timeout, connect(route)).await.map_err(|_| timed_out())? {
        Ok(stream) => stream,
        Err(ConnectFailure::Io(source)) => return Err(connect_error(source)),
        Err(ConnectFailure::Tls(source)) => {
            return Err(EgressError::Tls { authority: authority.clone(), target: target.to_string(), cause: source });
        }
    };
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
    let signed = route.signing.is_some();

    Ok(async move {
        let mut response = tokio::time::timeout(first_byte_timeout, sender.send_request(request))
            .await
            .map_err(|_| HttpError::ConnectionReadTimeout)??;
        if signed {
            // Whatever an upstream echoes of a signature stays with the host.
            for name in signing::SIGNING_HEADERS {
                response.headers_mut().remove(name);
            }
        }
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

/// The store's `wasi:http` view: this room's part of it (what a store's
/// `WasiHttpView` lends wasmtime-wasi-http).
pub fn http_view<T: HasRooms>(state: &mut T) -> WasiHttpCtxView<'_> {
    let (egress, table) = state.room::<HttpEgress>();
    WasiHttpCtxView { ctx: &mut egress.http, table, hooks: &mut egress.hooks }
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
    const KIT: Option<&'static dyn crate::rooms::kit::KitPart> = Some(&kit::HttpKit);
    type Grant = HttpGrant;
    type Backend = dyn EgressBackend;
    type Ctx = EgressCtx;
    type Prepared = SignedBodies;

    fn host_backend() -> Option<Arc<dyn EgressBackend>> {
        Some(Arc::new(HostEgress::default()))
    }

    /// One budget for the version's signed request bodies, shared by its stores.
    fn prepare(_grant: &HttpGrant, _load: &LoadSetup<'_>) -> Result<SignedBodies, BoxError> {
        Ok(SignedBodies::default())
    }

    fn ctx(grant: &HttpGrant, backend: Option<Arc<dyn EgressBackend>>, store: &StoreSetup<'_>) -> EgressCtx {
        let bodies = store.prepared.of::<HttpEgress>();
        let hooks =
            EgressHooks::new(store.provider.clone(), Arc::new(grant.clone()), backend, store.denials.clone(), bodies)
                .redacting(store.redactor.clone());
        EgressCtx { http: WasiHttpCtx::new(), hooks }
    }

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
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
        use crate::rooms::denials::Denials;
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
            redactor: &Default::default(),
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
        assert_eq!("https://x".parse(), Ok(EgressTarget::Https { host: "x".into(), port: 443 }));
        assert_eq!("https://x:8443/".parse(), Ok(EgressTarget::Https { host: "x".into(), port: 8443 }));
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
        let ftp = refused(send(&grant, request("ftp://lxd/1.0", ""), None).await);
        assert!(matches!(ftp, EgressError::Scheme { .. }), "{ftp}");
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

    /// A backend that takes requests and never answers, counting them.
    struct Parked(std::sync::atomic::AtomicUsize);

    impl EgressBackend for Parked {
        fn send(
            self: Arc<Self>,
            _grant: Arc<HttpGrant>,
            _request: http::Request<WasiBody>,
            _options: Option<RequestOptions>,
        ) -> BoxFuture<'static, Result<SendResult, EgressError>> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(std::future::pending())
        }
    }

    /// However many signed requests a guest opens, the bodies the host holds
    /// for them stay within the version's budget: a request past it waits for
    /// room; one that declares a small length takes only that; unsigned
    /// routes are not counted.
    #[tokio::test]
    async fn signed_bodies_in_flight_stay_within_the_budget() {
        use std::sync::atomic::Ordering;
        let grant = Arc::new(
            grant_from(
                "[http]\nplain = \"http://127.0.0.1:9\"\n[http.ec2]\nurl = \"https://127.0.0.1:9\"\nsign = \"aws-sigv4\"\n\
                 service = \"ec2\"\nregion = \"us-east-1\"\ncredentials = \"prod\"\n",
            )
            .unwrap(),
        );
        let parked = Arc::new(Parked(Default::default()));
        let bodies = SignedBodies::default();
        let mut hooks = EgressHooks::new(
            "p".into(),
            grant,
            Some(parked.clone() as Arc<dyn EgressBackend>),
            Default::default(),
            bodies.clone(),
        );
        let unsized_request = |uri: &str| {
            let body = Full::new(bytes::Bytes::from_static(b"Action=RunInstances"))
                .map_err(|never| match never {})
                .boxed_unsync();
            http::Request::builder().method("POST").uri(uri).body(body).unwrap()
        };
        let mut open = |request| {
            let io: IoFuture = Box::new(async { Ok(()) });
            tokio::spawn(Box::into_pin(hooks.send_request(request, None, io)))
        };
        let mut waiting: Vec<_> = (0..5).map(|_| open(unsized_request("http://ec2/"))).collect();
        let small = open(request("http://ec2/", "Action=DescribeInstances"));
        let plain = open(unsized_request("http://plain/"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Four of the largest fill it; the fifth and the small one wait; the plain one does not.
        assert_eq!(bodies.available_kib(), 0);
        assert_eq!(parked.0.load(Ordering::SeqCst), 5, "4 signed + 1 plain sent on");
        // Two of the first leave: the fifth goes, then the small one (in turn: no overtaking).
        waiting.remove(0).abort();
        waiting.remove(0).abort();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(parked.0.load(Ordering::SeqCst), 7, "room freed: the fifth and the small one go");
        assert_eq!(bodies.available_kib(), 4096 - 1);
        for task in waiting.into_iter().chain([small, plain]) {
            task.abort();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(bodies.available_kib(), SIGNED_BODIES_IN_FLIGHT_KIB as usize);
    }

    fn grant_from(toml_text: &str) -> Result<HttpGrant, String> {
        #[derive(Deserialize)]
        struct Grants {
            http: HttpGrant,
        }
        toml::from_str::<Grants>(toml_text).map(|g| g.http).map_err(|e| e.to_string())
    }

    /// A `user:password@` in a request's authority matches no grant, and the
    /// refusal names the host alone.
    #[test]
    fn a_password_in_an_authority_is_refused_and_never_quoted() {
        let grant = grant_from("[http]\napi = \"http://127.0.0.1:9\"\n").unwrap();
        let body = || Full::new(bytes::Bytes::new()).map_err(|never| match never {}).boxed_unsync();
        let request = |uri: &str| http::Request::get(uri).body(body()).unwrap();
        let refused = granted(&grant, &request("http://user:pw-s3cr3t@api/x")).unwrap_err().to_string();
        assert!(refused.contains("api") && !refused.contains("s3cr3t"), "{refused}");
        assert!(granted(&grant, &request("http://api/x")).is_ok());
    }

    /// A table grant parses, lists its credential by name only, round-trips,
    /// and each wrong key is refused with what is wrong.
    #[test]
    fn a_signed_grant_parses_strictly_and_lists_its_credential_by_name() {
        let grant = grant_from(
            "[http]\nlxd = \"unix:/run/lxd.sock\"\n[http.ec2]\nurl = \"https://ec2.eu-west-1.amazonaws.com\"\n\
             sign = \"aws-sigv4\"\nservice = \"ec2\"\nregion = \"eu-west-1\"\ncredentials = \"prod\"\n\
             actions = [\"RunInstances\"]\nmax-count = 4\nrequire-tag = \"broker-namespace=ns1\"\n",
        )
        .unwrap();
        let route = grant.route("ec2").unwrap();
        assert_eq!(route.target, EgressTarget::Https { host: "ec2.eu-west-1.amazonaws.com".into(), port: 443 });
        assert_eq!(route.rules.require_tag, Some(("broker-namespace".into(), "ns1".into())));
        let listed = grant.listed().join("; ");
        assert!(listed.contains("signed aws-sigv4 for ec2/eu-west-1 with credentials prod"), "{listed}");
        let again: HttpGrant = serde_json::from_value(serde_json::to_value(&grant).unwrap()).unwrap();
        assert_eq!(again, grant, "what is stored reads back the same");
        let mut narrower = grant.clone();
        narrower.authorities.get_mut("ec2").unwrap().rules.max_count = Some(40);
        assert!(narrower.widening(&grant).is_some(), "a raised cap needs approval");

        let wrong =
            |extra: &str| grant_from(&format!("[http.ec2]\nurl = \"https://ec2.example\"\n{extra}")).unwrap_err();
        assert!(wrong("sign = \"aws-sigv4\"\nservice = \"ec2\"\nregion = \"r1\"\n").contains("needs credentials"));
        assert!(wrong("sign = \"hmac\"\n").contains("only \"aws-sigv4\""));
        assert!(wrong("credentials = \"prod\"\n").contains("go with sign"));
        assert!(wrong("max-count = 3\n").contains("need sign"));
        assert!(wrong("secret = \"x\"\n").contains("unknown field"));
        assert!(wrong("ca-file = \"relative.pem\"\n").contains("absolute"));
        let signed = "sign = \"aws-sigv4\"\nregion = \"r1\"\ncredentials = \"c\"\n";
        let s3 = format!("{signed}service = \"s3\"\nactions = [\"PutObject\"]\nmax-count = 1\n");
        assert!(wrong(&s3).contains("service = \"ec2\""));
        let unlisted = format!("{signed}service = \"ec2\"\nmax-count = 1\n");
        assert!(wrong(&unlisted).contains("list the allowed actions"), "{}", wrong(&unlisted));
        let plain = grant_from(&format!("[http.ec2]\nurl = \"http://ec2.example\"\n{signed}service = \"ec2\"\n"));
        assert!(plain.unwrap_err().contains("must be https://"));
        assert!(grant_from(&format!("[http.ec2]\nurl = \"http://127.0.0.1:9\"\n{signed}service = \"ec2\"\n")).is_ok());
        let walk = "sign = \"aws-sigv4\"\nservice = \"ec2\"\nregion = \"r1\"\ncredentials = \"../c\"\n";
        assert!(wrong(walk).contains("credentials name"));
    }

    /// The tests' own CA and a certificate for `localhost` from it (PEM, and the server's config).
    fn test_ca() -> (String, Arc<rustls::ServerConfig>) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap().signed_by(&key, &issuer).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
            )
            .unwrap();
        (ca_cert.pem(), Arc::new(config))
    }

    /// Serve TLS on a free port: each request answered 200 with its own head
    /// (every header line) and body, and headers an upstream might echo.
    async fn tls_server(config: Arc<rustls::ServerConfig>) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = served.clone();
        tokio::spawn(async move {
            let acceptor = tokio_rustls::TlsAcceptor::from(config);
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let Ok(tls) = acceptor.accept(tcp).await else { continue };
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut reader = BufReader::new(tls);
                let mut head = String::new();
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).await.unwrap();
                    if line.trim_end().is_empty() {
                        break;
                    }
                    if let Some(n) = line.to_ascii_lowercase().strip_prefix("content-length: ") {
                        length = n.trim().parse().unwrap();
                    }
                    head.push_str(&line);
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).await.unwrap();
                let reply = format!("{head}\n{}", String::from_utf8_lossy(&body));
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-amz-security-token: echoed\r\nx-upstream: yes\r\n\
                     connection: close\r\n\r\n{reply}",
                    reply.len()
                );
                let mut stream = reader.into_inner();
                stream.write_all(answer.as_bytes()).await.unwrap();
                stream.shutdown().await.ok();
            }
        });
        (port, served)
    }

    /// Through real TLS: a target whose certificate chains to the grant's
    /// `ca-file` is reached and told its own name; without the CA, or under
    /// another name, the error is a certificate error naming the target.
    #[tokio::test]
    async fn https_targets_check_the_certificate_against_the_grants_ca() {
        let (ca_pem, server) = test_ca();
        let (port, served) = tls_server(server).await;
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca_pem).unwrap();
        let route = |host: &str, ca: bool| Route {
            ca_file: ca.then(|| ca_file.clone()),
            ..Route::to(EgressTarget::Https { host: host.into(), port })
        };
        let grant = HttpGrant::routes([
            ("api".to_owned(), route("localhost", true)),
            ("untrusted".to_owned(), route("localhost", false)),
            ("misnamed".to_owned(), route("127.0.0.1", true)),
        ])
        .unwrap();
        let (status, body) = body_text(send(&grant, request("http://api/v1?x=1", "hi"), None).await.unwrap()).await;
        assert_eq!(status, 200);
        assert!(body.starts_with("POST /v1?x=1 HTTP/1.1"), "{body}");
        assert!(body.to_ascii_lowercase().contains(&format!("host: localhost:{port}")), "told its own name: {body}");
        assert!(body.ends_with("\nhi"), "{body}");
        for (authority, says) in [("untrusted", "UnknownIssuer"), ("misnamed", "not valid for name")] {
            let failed = refused(send(&grant, request(&format!("http://{authority}/"), ""), None).await);
            assert!(matches!(failed.code(), HttpError::TlsCertificateError), "{failed}");
            let text = failed.to_string();
            assert!(text.contains(&format!(":{port}")) && text.contains(says), "names the target and why: {text}");
        }
        assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 1, "only the trusted handshake completed");
    }

    /// A signed grant: the host drops the guest's own signature headers,
    /// signs with the credentials file, keeps what the upstream echoes of a
    /// signature from the guest; a request the rules refuse, or one the host
    /// has no credentials for, never reaches the upstream.
    #[tokio::test]
    async fn a_signed_grant_is_signed_by_the_host_and_its_rules_hold_before_sending() {
        use std::os::unix::fs::PermissionsExt;
        let (ca_pem, server) = test_ca();
        let (port, served) = tls_server(server).await;
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca_pem).unwrap();
        let credentials = dir.path().join("credentials");
        std::fs::create_dir(&credentials).unwrap();
        let file = credentials.join("prod.toml");
        std::fs::write(&file, "access-key-id = \"AKIATEST\"\nsecret-access-key = \"very-secret-key\"\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let grant = HttpGrant::routes([(
            "ec2".to_owned(),
            Route {
                ca_file: Some(ca_file),
                signing: Some(signing::AwsSigning {
                    service: "ec2".into(),
                    region: "eu-west-1".into(),
                    credentials: "prod".into(),
                }),
                rules: rules::Rules { actions: vec!["DescribeRegions".into()], ..Default::default() },
                ..Route::to(EgressTarget::Https { host: "localhost".into(), port })
            },
        )])
        .unwrap();
        let form = |body: &'static str| {
            let mut request = request("http://ec2/", body);
            request.headers_mut().insert("content-type", "application/x-www-form-urlencoded".parse().unwrap());
            request.headers_mut().insert("authorization", "AWS4-HMAC-SHA256 Credential=FORGED/x".parse().unwrap());
            request
        };
        let host = HostEgress::with_credentials(credentials.clone());
        let signed = Arc::new(host.clone()).send(Arc::new(grant.clone()), form("Action=DescribeRegions"), None);
        let (response, io) = signed.await.unwrap().unwrap();
        assert!(!response.headers().contains_key("x-amz-security-token"), "an echoed signature header is dropped");
        assert_eq!(response.headers()["x-upstream"], "yes");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Box::into_pin(io).await.unwrap();
        let seen = String::from_utf8_lossy(&body).to_ascii_lowercase();
        assert!(seen.contains("authorization: aws4-hmac-sha256 credential=akiatest/"), "{seen}");
        assert!(!seen.contains("forged") && !seen.contains("very-secret-key"), "{seen}");
        assert!(seen.contains(&format!("host: localhost:{port}")) && seen.contains("x-amz-date: "), "{seen}");
        assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 1);

        let refused_by_rule = Arc::new(host.clone()).send(Arc::new(grant.clone()), form("Action=RunInstances"), None);
        let refused_by_rule = refused(refused_by_rule.await);
        assert!(matches!(&refused_by_rule, EgressError::Refused { refused, .. } if refused.rule == "actions"));
        assert!(matches!(refused_by_rule.code(), HttpError::HttpRequestDenied));
        // The kit holds the rules too, with nothing sent.
        let script = Arc::new(Script::new(Vec::new()));
        let in_kit = refused(script.send(Arc::new(grant.clone()), form("Action=RunInstances"), None).await);
        assert!(matches!(in_kit, EgressError::Refused { .. }), "{in_kit}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let exposed = refused(Arc::new(host).send(Arc::new(grant.clone()), form("Action=DescribeRegions"), None).await);
        assert!(
            matches!(exposed, EgressError::Signing { .. }) && exposed.to_string().contains("chmod 600"),
            "{exposed}"
        );
        let nowhere =
            refused(Arc::new(HostEgress::default()).send(Arc::new(grant), form("Action=DescribeRegions"), None).await);
        assert!(nowhere.to_string().contains("keeps no credentials"), "{nowhere}");
        assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 1, "nothing refused reached the upstream");
    }
}
