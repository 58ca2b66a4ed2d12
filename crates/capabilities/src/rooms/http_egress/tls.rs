//! TLS for `https://` targets: rustls with the machine's roots (loaded once)
//! plus, per grant, the CAs of an optional `ca-file` (for private endpoints
//! and the tests' own CA). The name checked is the target's host, as the
//! grant writes it; the guest's authority is only ever a grant name.

use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::SystemTime;
use tokio::io::{AsyncRead, AsyncWrite};

/// Why a TLS connection could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The grant's `ca-file` could not be read or holds no certificate.
    #[error("the grant's ca-file {path}: {reason}")]
    CaFile {
        /// As the grant names it.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The target's host is not a name or address TLS can check.
    #[error("{0:?} is not a DNS name or IP address a certificate can be checked against")]
    BadName(String),
    /// The handshake failed: an unknown CA, a certificate for another name, …
    #[error("TLS handshake: {0}")]
    Handshake(std::io::Error),
}

impl TlsError {
    /// Whether the peer's certificate was what failed (not the transport).
    pub(crate) fn is_certificate(&self) -> bool {
        match self {
            TlsError::Handshake(e) => {
                e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).is_some_and(|e| {
                    matches!(e, rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented)
                })
            }
            _ => false,
        }
    }
}

/// The machine's trusted roots (`/etc/ssl/certs` and what `SSL_CERT_FILE`/`SSL_CERT_DIR` say), read once.
fn machine_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        if !found.errors.is_empty() {
            tracing::warn!(errors = found.errors.len(), "some of the machine's root certificates could not be read");
        }
        found.certs
    })
}

/// A client config per `ca-file` (and its modification time, so an
/// operator's new file is read on the next request), and one without.
type Configs = HashMap<Option<(PathBuf, Option<SystemTime>)>, Arc<rustls::ClientConfig>>;

fn configs() -> &'static Mutex<Configs> {
    static CONFIGS: OnceLock<Mutex<Configs>> = OnceLock::new();
    CONFIGS.get_or_init(Mutex::default)
}

fn ca_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let reason = |reason: String| TlsError::CaFile { path: path.to_owned(), reason };
    let pem = std::fs::read(path).map_err(|e| reason(e.to_string()))?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| reason(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(reason("holds no PEM certificate".into()));
    }
    Ok(certs)
}

/// The client config for a grant: the machine's roots and the `ca-file`'s.
pub(crate) fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let key = ca_file.map(|path| (path.to_owned(), std::fs::metadata(path).and_then(|m| m.modified()).ok()));
    if let Some(config) = configs().lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(config.clone());
    }
    let mut roots = rustls::RootCertStore::empty();
    let (_, ignored) = roots.add_parsable_certificates(machine_roots().iter().cloned());
    if ignored > 0 {
        tracing::debug!(ignored, "machine root certificates rustls cannot use");
    }
    if let Some(path) = ca_file {
        for cert in ca_certificates(path)? {
            roots.add(cert).map_err(|e| TlsError::CaFile { path: path.to_owned(), reason: e.to_string() })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Handshake(std::io::Error::other(e)))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let config = Arc::new(config);
    let mut cached = configs().lock().unwrap_or_else(|p| p.into_inner());
    // An old modification time of the same file is dropped: nothing grows without bound.
    cached.retain(|k, _| k.as_ref().map(|(p, _)| Some(p.as_path())) != Some(ca_file));
    cached.insert(key, config.clone());
    Ok(config)
}

/// TLS over `stream` to `host`, its certificate checked against `config`'s roots.
pub async fn connect<S>(
    stream: S,
    host: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<tokio_rustls::client::TlsStream<S>, TlsError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(bare.to_owned()).map_err(|_| TlsError::BadName(host.to_owned()))?;
    tokio_rustls::TlsConnector::from(config).connect(name, stream).await.map_err(TlsError::Handshake)
}
