//! `broker serve`: the host as a long-lived daemon, its HTTP/JSON API on a
//! unix socket in the data dir (mode 0600: only its owner can talk to it).
//!
//! One process owns the state database; the API is how everything else asks.
//! A swap through the API replaces a provider while the daemon serves, which is
//! what makes hot swap mean something.

mod api;
mod auth;
pub(crate) mod holder;
mod progress;
mod root;

pub use crate::listen::ServeLimits;
pub(crate) use auth::BearerToken;
pub(crate) use auth::check_loopback;
pub(crate) use root::DaemonOptions;
pub(crate) use root::run;

use anyhow::{Context, Result};
use broker_core::broker::Broker;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest request body accepted; anything bigger gets 413.
pub(crate) const MAX_BODY_BYTES: usize = 64 * 1024;

/// The default socket: `DATA_DIR/broker.sock`.
pub(crate) fn default_socket(data_dir: &Path) -> PathBuf {
    data_dir.join("broker.sock")
}

/// Where the API listens besides its unix socket: bound when made, before
/// the daemon does anything else, so a port another process holds stops the
/// start at once, naming that process.
pub(crate) struct TcpListen {
    /// A loopback address; any other is refused.
    pub(crate) addr: std::net::SocketAddr,
    /// What every request but `/healthz` must present as `Authorization: Bearer`.
    pub(crate) token: BearerToken,
    listener: std::net::TcpListener,
}

impl TcpListen {
    /// Bind `addr` (loopback only). An address another socket listens on is
    /// refused, saying by whom when this host can tell: clients would send
    /// that program the bearer token meant for the daemon.
    pub(crate) fn bind(addr: std::net::SocketAddr, token: BearerToken) -> Result<TcpListen> {
        check_loopback(addr)?;
        let listener = std::net::TcpListener::bind(addr).map_err(|error| match error.kind() {
            std::io::ErrorKind::AddrInUse => {
                let by = holder::find(addr).map_or_else(
                    || "another socket (its holder could not be found: another network namespace, or gone meanwhile)".to_owned(),
                    |holder| holder.to_string(),
                );
                anyhow::anyhow!(
                    "cannot listen on {addr}: it is held by {by}. The daemon does not start beside it: clients sending their bearer token to {addr} would hand it to that program. Stop it (or choose another --listen) and start again"
                )
            }
            _ => anyhow::Error::new(error).context(format!("cannot listen on {addr}")),
        })?;
        listener.set_nonblocking(true).with_context(|| format!("cannot listen on {addr}"))?;
        Ok(TcpListen { addr, token, listener })
    }
}

/// What `broker serve` serves besides its unix socket, and how its groups converge.
#[derive(Default)]
pub struct Serving {
    /// Also the API on loopback TCP.
    pub(crate) tcp: Option<TcpListen>,
    /// Also InfraKit's plugin sockets in this directory.
    pub(crate) infrakit_dir: Option<PathBuf>,
    /// The groups' convergence loops.
    pub(crate) groups: broker_core::groups::GroupSettings,
}

/// Serve the API on `socket` (and on loopback TCP behind a bearer token, and
/// InfraKit's sockets, if asked) until `shutdown` resolves; then stop
/// accepting and let the requests in flight finish, within `limits.drain`.
pub async fn serve(
    broker: Arc<Broker>,
    socket: &Path,
    serving: Serving,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let Serving { tcp, infrakit_dir, groups: group_settings } = serving;
    if socket.exists() {
        // A socket nobody answers on is left over from a crash; a live one is another daemon.
        if crate::client::DaemonClient::probe(socket).await.is_some() {
            anyhow::bail!("another broker daemon is serving on {}", socket.display());
        }
        std::fs::remove_file(socket).with_context(|| format!("cannot remove stale socket {}", socket.display()))?;
    }
    let listener =
        tokio::net::UnixListener::bind(socket).with_context(|| format!("cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", socket.display()))?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stopped_at = Arc::new(std::sync::OnceLock::new());
    let noting = stopped_at.clone();
    // A state file that cannot be opened again stops the daemon (non-zero)
    // for its supervisor: serving on refusing every write helps nobody.
    let fatal = Arc::new(std::sync::OnceLock::new());
    let (watched, noting_fatal) = (broker.clone(), fatal.clone());
    tokio::spawn(async move {
        let store_failed = async {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                if let Some(fault) = watched.store().health().fault.filter(|fault| fault.fatal) {
                    return fault;
                }
            }
        };
        tokio::select! {
            () = shutdown => {}
            fault = store_failed => {
                tracing::error!(cause = %fault.refusal(), "the state file cannot be reopened: stopping");
                let _ = noting_fatal.set(fault);
            }
        }
        let _ = noting.set(std::time::Instant::now());
        let _ = stop.send(true);
    });
    let detached = tokio_util::task::TaskTracker::new();
    // Groups converge while the daemon serves.
    let groups = broker_core::groups::Groups::new(broker.clone(), group_settings);
    groups.start_loops().context("cannot read the committed groups")?;
    let infrakit = match &infrakit_dir {
        None => None,
        Some(dir) => {
            let serving =
                crate::infrakit::serve(dir, broker.clone(), groups.clone(), detached.clone(), limits, stopped.clone());
            match serving.await {
                Ok(task) => Some(task),
                Err(error) => {
                    groups.stop_loops();
                    return Err(error.context("cannot serve InfraKit's plugin sockets"));
                }
            }
        }
    };
    let until_stopped = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let over_tcp = match tcp {
        None => None,
        Some(TcpListen { addr, token, listener }) => {
            let listener =
                tokio::net::TcpListener::from_std(listener).with_context(|| format!("cannot listen on {addr}"))?;
            let app = api::router_with(broker.clone(), groups.clone(), detached.clone(), limits.body_timeout)
                .layer(axum::middleware::from_fn_with_state(token, auth::require_bearer));
            tracing::info!(addr = %addr, "broker daemon serving on TCP (bearer token required)");
            Some(tokio::spawn(crate::listen::serve(listener, app, limits, until_stopped(stopped.clone()), "tcp")))
        }
    };
    tracing::info!(socket = %socket.display(), "broker daemon serving");
    let app = api::router_with(broker, groups.clone(), detached.clone(), limits.body_timeout);
    crate::listen::serve(listener, app, limits, until_stopped(stopped), "unix").await;
    let _ = std::fs::remove_file(socket);
    // Both listeners drained first: a request still on TCP may yet start work.
    if let Some(over_tcp) = over_tcp {
        over_tcp.await.context("the TCP API server panicked")?;
    }
    if let Some(infrakit) = infrakit {
        infrakit.await.context("InfraKit's plugin sockets panicked")?;
    }
    // Passes end where they stand: a start cut short is left pending for the next host.
    groups.stop_loops();
    // Work whose client went away (a start, a swap) runs to its end within the
    // same drain: cut short, a start could leave an instance with no record.
    detached.close();
    let since_stop = stopped_at.get().map_or(std::time::Duration::ZERO, std::time::Instant::elapsed);
    let left = limits.drain.saturating_sub(since_stop);
    if !detached.is_empty() && tokio::time::timeout(left, detached.wait()).await.is_err() {
        tracing::warn!(
            running = detached.len(),
            drain_seconds = limits.drain.as_secs(),
            "calls whose clients went away were still running when the drain ran out: they are cut short"
        );
    }
    match fatal.get() {
        Some(fault) => {
            Err(anyhow::Error::new(fault.refusal()).context("the daemon stopped: its state file cannot be reopened"))
        }
        None => Ok(()),
    }
}
