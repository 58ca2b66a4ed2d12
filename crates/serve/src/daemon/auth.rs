//! `--listen ADDR`: the API over loopback TCP, only with a bearer token. The
//! unix socket's 0600 mode is its access control; TCP has none, so every
//! request but `/healthz` must carry `Authorization: Bearer <token>`.

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

/// Shortest token accepted: guessing must not be an option.
const MIN_TOKEN_CHARS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub(crate) enum AuthError {
    #[error("--listen {0}: plain HTTP with a bearer token is only offered on a loopback address (127.0.0.1, ::1)")]
    NotLoopback(SocketAddr),
    #[error("cannot read token file {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Read { path: String, cause: std::io::Error },
    #[error("token file {path} is readable by group or others (mode {mode:o}); chmod 600 it")]
    Exposed { path: String, mode: u32 },
    #[error("token file {path} holds fewer than {MIN_TOKEN_CHARS} characters")]
    TooShort { path: String },
}

/// The token every TCP request must present.
#[derive(Clone)]
pub(crate) struct BearerToken(Arc<str>);

impl BearerToken {
    /// Read the token file: private to its owner, at least 16 characters (surrounding whitespace ignored).
    pub(crate) fn load(path: &Path) -> Result<BearerToken, AuthError> {
        let shown = path.display().to_string();
        let read = |source| AuthError::Read { path: shown.clone(), cause: source };
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(AuthError::Exposed { path: shown, mode: mode & 0o777 });
        }
        let bytes = broker_core::manifest::read_regular_file(path, 64 << 10).map_err(read)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| read(std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text")))?;
        let token = text.trim();
        if token.chars().count() < MIN_TOKEN_CHARS {
            return Err(AuthError::TooShort { path: shown });
        }
        Ok(BearerToken(token.into()))
    }

    /// Compare without an early exit, so timing does not tell how much of a guess was right.
    fn matches(&self, presented: &str) -> bool {
        let (ours, theirs) = (self.0.as_bytes(), presented.as_bytes());
        let differing = ours.iter().zip(theirs).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        differing == 0 && ours.len() == theirs.len()
    }
}

pub(crate) fn check_loopback(addr: SocketAddr) -> Result<(), AuthError> {
    if addr.ip().is_loopback() { Ok(()) } else { Err(AuthError::NotLoopback(addr)) }
}

/// Middleware: 401 unless the request carries the token (`/healthz` excepted).
pub(crate) async fn require_bearer(State(token): State<BearerToken>, request: Request, next: Next) -> Response {
    if request.uri().path() == "/healthz" {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(presented) if token.matches(presented.trim()) => next.run(request).await,
        _ => {
            let reason =
                if presented.is_some() { "wrong bearer token" } else { "missing Authorization: Bearer <token>" };
            tracing::warn!(path = request.uri().path(), reason, "API request refused");
            let mut answer = crate::listen::error(StatusCode::UNAUTHORIZED, reason.to_owned());
            answer.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            answer
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token_file(mode: u32, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        (dir, path)
    }

    #[test]
    fn tokens_must_be_private_long_and_exact() {
        let (_dir, good) = token_file(0o600, "0123456789abcdef-secret\n");
        let token = BearerToken::load(&good).unwrap();
        assert!(token.matches("0123456789abcdef-secret"));
        assert!(!token.matches("0123456789abcdef-secreT"));
        assert!(!token.matches("0123456789abcdef-secret-and-more"));
        assert!(!token.matches(""));
        let (_dir, exposed) = token_file(0o644, "0123456789abcdef-secret");
        assert!(matches!(BearerToken::load(&exposed), Err(AuthError::Exposed { mode: 0o644, .. })));
        let (_dir, short) = token_file(0o600, "short\n");
        assert!(matches!(BearerToken::load(&short), Err(AuthError::TooShort { .. })));
        assert!(check_loopback("127.0.0.1:8080".parse().unwrap()).is_ok());
        assert!(check_loopback("[::1]:8080".parse().unwrap()).is_ok());
        assert!(check_loopback("0.0.0.0:8080".parse().unwrap()).is_err());
    }
}
