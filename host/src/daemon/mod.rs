//! `broker serve`: the host as a long-lived daemon, its HTTP/JSON API on a
//! unix socket in the data dir (mode 0600: only its owner can talk to it).
//!
//! One process owns the state database; the API is how everything else asks.
//! A swap through the API replaces a provider while the daemon serves, which is
//! what makes hot swap mean something.

mod api;

pub use api::router;

use crate::broker::Broker;
use anyhow::{Context, Result};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest request body accepted; anything bigger gets 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The default socket: `DATA_DIR/broker.sock`.
pub fn default_socket(data_dir: &Path) -> PathBuf {
    data_dir.join("broker.sock")
}

/// Serve the API on `socket` until `shutdown` resolves; then stop accepting
/// and let the requests in flight finish.
pub async fn serve(
    broker: Arc<Broker>,
    socket: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    if socket.exists() {
        // A socket nobody answers on is left over from a crash; a live one is another daemon.
        if tokio::net::UnixStream::connect(socket).await.is_ok() {
            anyhow::bail!("another broker daemon is serving on {}", socket.display());
        }
        std::fs::remove_file(socket).with_context(|| format!("cannot remove stale socket {}", socket.display()))?;
    }
    let listener =
        tokio::net::UnixListener::bind(socket).with_context(|| format!("cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", socket.display()))?;
    tracing::info!(socket = %socket.display(), "broker daemon serving");
    let served = axum::serve(listener, router(broker)).with_graceful_shutdown(shutdown).await;
    let _ = std::fs::remove_file(socket);
    served.context("the API server failed")
}
