//! InfraKit's wire protocol, so that InfraKit's own tools drive this host
//! (`broker serve --infrakit-dir DIR`). One unix socket per plugin in DIR,
//! as InfraKit's plugin discovery expects: `group` (Group/0.1.1, over this
//! host's groups) and one per registered provider, named after it
//! (Instance/0.6.1, over that provider). Each speaks JSON-RPC 2.0 over
//! HTTP/1.1 `POST /` ([`rpc`]), answers `Handshake.Hello` and
//! `Handshake.Implements`, and lists its methods at `GET /info/api.json`.
//!
//! The directory must be the daemon user's and writable by nobody else. The
//! sockets are mode 0600 (bound in a fresh private directory, restricted,
//! then moved into place, never over an existing file: never reachable by
//! others), follow the registry while the daemon serves, and are removed when
//! it stops. A socket left by a dead process (it refuses connections) is
//! replaced; a live one, or anything that is not a socket, is not.
//!
//! Bounds: at most [`MAX_CALLS`] calls in flight over all the sockets (more
//! are answered "busy"), and [`MAX_CONNECTIONS`] connections per socket.

pub mod client;
pub(crate) mod group;
pub(crate) mod instance;
pub mod rpc;

use crate::listen::ServeLimits;
use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::routing::{get, post};
use broker_core::broker::Broker;
use broker_core::groups::Groups;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The group plugin's socket name.
pub(crate) const GROUP_SOCKET: &str = "group";
/// How often the provider sockets are matched to the registry.
const FOLLOW_REGISTRY: Duration = Duration::from_secs(1);
/// Largest request body a plugin socket takes (a group spec is at most 64 KiB).
const MAX_RPC_BODY_BYTES: usize = 128 * 1024;
/// Calls in flight at once over all the plugin sockets. A call runs to its
/// end even if its client goes, so without this a client that sends and
/// hangs up could pile up work without limit.
pub(crate) const MAX_CALLS: usize = 64;
/// Connections open at once per plugin socket.
pub(crate) const MAX_CONNECTIONS: usize = 64;

/// InfraKit's own default: `~/.infrakit/plugins`.
pub(crate) fn default_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".infrakit").join("plugins"))
}

/// What one socket serves.
#[derive(Clone)]
enum Plugin {
    Group(Arc<Groups>),
    Instance { broker: Arc<Broker>, provider: String },
}

impl Plugin {
    fn api(&self) -> (&'static str, &'static str) {
        match self {
            Plugin::Group(_) => group::GROUP_API,
            Plugin::Instance { .. } => instance::INSTANCE_API,
        }
    }

    fn name(&self) -> &str {
        match self {
            Plugin::Group(_) => GROUP_SOCKET,
            Plugin::Instance { provider, .. } => provider,
        }
    }

    /// The answer to a handshake method: what the plugin is, known without work.
    fn handshake(&self, method: &str) -> Option<Value> {
        let (name, version) = self.api();
        match method {
            // The objects this plugin serves: one, the plugin itself (".").
            "Handshake.Hello" => {
                Some(json!({"Objects": {format!("{name}/{version}"): [{"Name": ".", "ProxyFor": ""}]}}))
            }
            // Older clients ask this instead.
            "Handshake.Implements" | "Plugin.Implements" => Some(json!({"APIs": [{"Name": name, "Version": version}]})),
            _ => None,
        }
    }

    async fn call(&self, method: &str, params: Value) -> Result<Value, rpc::RpcError> {
        let (name, version) = self.api();
        let outcome = match self {
            Plugin::Group(groups) => group::call(groups, method, params).await,
            Plugin::Instance { broker, provider } => instance::call(broker, provider, method, params).await,
        };
        outcome.unwrap_or_else(|| {
            Err(rpc::RpcError {
                code: rpc::METHOD_NOT_FOUND,
                message: format!(
                    "no method {method:?} on this {name}/{version} plugin (GET /info/api.json lists them)"
                ),
            })
        })
    }

    fn info(&self) -> Value {
        let (name, version) = self.api();
        let methods = match self {
            Plugin::Group(_) => group::methods(),
            Plugin::Instance { .. } => instance::methods(),
        };
        let methods: Vec<Value> = methods
            .into_iter()
            .map(
                |(method, params)| json!({"Request": {"jsonrpc": "2.0", "method": method, "params": params, "id": ""}}),
            )
            .collect();
        json!({
            "Vendor": {"Name": "wasm-broker", "Version": env!("CARGO_PKG_VERSION")},
            "Implements": [{"Name": name, "Version": version}],
            "Interfaces": [{"Name": name, "Version": version, "Methods": methods}],
        })
    }
}

#[derive(Clone)]
struct SocketState {
    plugin: Plugin,
    /// Calls run to their end even if their client goes (a start cut short could leave an instance unrecorded).
    detached: tokio_util::task::TaskTracker,
    /// [`MAX_CALLS`], shared by every plugin socket.
    calls: Arc<tokio::sync::Semaphore>,
}

fn router(state: SocketState, body_timeout: Duration) -> Router {
    Router::new()
        .route("/", post(rpc_call))
        .route("/info/api.json", get(api_info))
        .layer(DefaultBodyLimit::max(MAX_RPC_BODY_BYTES))
        .layer(axum::middleware::from_fn(move |request, next| {
            crate::listen::bounded_request_up_to(body_timeout, MAX_RPC_BODY_BYTES, request, next)
        }))
        .with_state(state)
}

async fn rpc_call(State(state): State<SocketState>, body: Bytes) -> axum::Json<rpc::Response> {
    let request = match rpc::read_request(&body) {
        Ok(request) => request,
        Err(answer) => return axum::Json(answer),
    };
    // Answered at once, outside the bound: a client busy calls still finds out what the plugin is.
    if let Some(answer) = state.plugin.handshake(&request.method) {
        return axum::Json(rpc::Response::of(request.id, Ok(answer)));
    }
    let span = tracing::info_span!("infrakit call", plugin = %state.plugin.name(), method = %request.method);
    let Ok(permit) = state.calls.clone().try_acquire_owned() else {
        let busy = rpc::RpcError {
            code: rpc::SERVER_ERROR,
            message: format!("busy: {MAX_CALLS} calls are in flight on this host's InfraKit sockets; try again"),
        };
        return axum::Json(rpc::Response::of(request.id, Err(busy)));
    };
    let plugin = state.plugin.clone();
    let (method, params) = (request.method, request.params);
    let work = async move {
        let outcome = plugin.call(&method, params).await;
        drop(permit);
        outcome
    };
    let call = state.detached.spawn(tracing::Instrument::instrument(work, span));
    let outcome = call.await.unwrap_or_else(|_| {
        Err(rpc::RpcError { code: rpc::SERVER_ERROR, message: "the call failed inside the host (see its log)".into() })
    });
    axum::Json(rpc::Response::of(request.id, outcome))
}

async fn api_info(State(state): State<SocketState>) -> axum::Json<Value> {
    axum::Json(state.plugin.info())
}

/// A socket this daemon made: removed at the end only if it is still the same file.
struct Served {
    path: PathBuf,
    identity: (u64, u64),
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn end(self) {
        self.stop.cancel();
        let _ = self.task.await;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|meta| (meta.dev(), meta.ino()) == self.identity) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The sockets' shared parts.
#[derive(Clone)]
struct Sockets {
    dir: PathBuf,
    limits: ServeLimits,
    detached: tokio_util::task::TaskTracker,
    calls: Arc<tokio::sync::Semaphore>,
}

impl Sockets {
    async fn serve(&self, name: &str, plugin: Plugin) -> Result<Served> {
        let (listener, path, identity) = bind(&self.dir, name).await?;
        let stop = CancellationToken::new();
        let state = SocketState { plugin, detached: self.detached.clone(), calls: self.calls.clone() };
        let app = router(state, self.limits.body_timeout);
        let stopped = stop.clone().cancelled_owned();
        let task = tokio::spawn(crate::listen::serve(listener, app, self.limits, stopped, "infrakit"));
        tracing::info!(socket = %path.display(), "InfraKit plugin serving");
        Ok(Served { path, identity, stop, task })
    }
}

/// Serve the `group` socket and one per provider in `dir` until `stop`
/// turns true; the returned task ends once they are drained and removed.
/// An error (the directory, or the `group` socket) is returned before
/// anything serves.
pub(crate) async fn serve(
    dir: &Path,
    broker: Arc<Broker>,
    groups: Arc<Groups>,
    detached: tokio_util::task::TaskTracker,
    limits: ServeLimits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>> {
    if !dir.exists() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the InfraKit plugin dir {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot restrict {}", dir.display()))?;
    }
    // Absolute: the length of every socket path is checked as it is bound.
    let dir = &std::path::absolute(dir).with_context(|| format!("cannot resolve {}", dir.display()))?;
    check_dir(dir)?;
    let limits = ServeLimits { max_connections: limits.max_connections.min(MAX_CONNECTIONS), ..limits };
    let calls = Arc::new(tokio::sync::Semaphore::new(MAX_CALLS));
    let sockets = Sockets { dir: dir.to_owned(), limits, detached, calls };
    let group = sockets.serve(GROUP_SOCKET, Plugin::Group(groups)).await?;
    Ok(tokio::spawn(async move {
        let mut providers: HashMap<String, Served> = HashMap::new();
        // Names that could not be served, and when to try each again.
        let mut refused: HashMap<String, Retry> = HashMap::new();
        // Sockets of removed providers draining, each on its own.
        let mut ending = tokio::task::JoinSet::new();
        loop {
            follow_registry(&sockets, &broker, &mut providers, &mut refused, &mut ending).await;
            while ending.try_join_next().is_some() {}
            tokio::select! {
                _ = stop.wait_for(|stop| *stop) => break,
                () = tokio::time::sleep(FOLLOW_REGISTRY) => {}
            }
        }
        for served in providers.into_values().chain(std::iter::once(group)) {
            ending.spawn(served.end());
        }
        while ending.join_next().await.is_some() {}
    }))
}

/// One socket per registered provider: new ones served, removed ones ended.
async fn follow_registry(
    sockets: &Sockets,
    broker: &Arc<Broker>,
    providers: &mut HashMap<String, Served>,
    refused: &mut HashMap<String, Retry>,
    ending: &mut tokio::task::JoinSet<()>,
) {
    let registered: Vec<String> = match broker.registry().list() {
        Ok(list) => list.into_iter().map(|p| p.name).collect(),
        Err(error) => {
            tracing::warn!(error = %broker_capabilities::error_text::error_text(&error), "cannot list providers for their InfraKit sockets");
            return;
        }
    };
    let gone: Vec<String> = providers.keys().filter(|name| !registered.contains(name)).cloned().collect();
    for name in gone {
        if let Some(served) = providers.remove(&name) {
            ending.spawn(served.end());
        }
    }
    refused.retain(|name, _| registered.contains(name));
    let now = tokio::time::Instant::now();
    for name in registered {
        if providers.contains_key(&name) || refused.get(&name).is_some_and(|retry| retry.at.is_none_or(|at| at > now)) {
            continue;
        }
        if name == GROUP_SOCKET {
            if refused.insert(name.clone(), Retry::never()).is_none() {
                tracing::warn!(provider = %name, "a provider named like the group plugin gets no InfraKit socket");
            }
            continue;
        }
        if let Some(problem) = path_problem(&sockets.dir, &name) {
            // Never fits while the dir is this one: said once, not tried again.
            tracing::warn!(provider = %name, %problem, "no InfraKit socket for this provider");
            refused.insert(name, Retry::never());
            continue;
        }
        let plugin = Plugin::Instance { broker: broker.clone(), provider: name.clone() };
        match sockets.serve(&name, plugin).await {
            Ok(served) => {
                refused.remove(&name);
                providers.insert(name, served);
            }
            Err(error) => {
                // Tried again later (the path may be freed), ever less often.
                let retry = refused.get(&name).map_or_else(|| Retry::first(now), |retry| retry.next(now));
                tracing::warn!(provider = %name, error = %format!("{error:#}"), retry_in = ?retry.wait, "no InfraKit socket for this provider");
                refused.insert(name, retry);
            }
        }
    }
}

/// When a provider's socket that could not be served is tried again.
struct Retry {
    /// None: not while the name stays registered.
    at: Option<tokio::time::Instant>,
    wait: Duration,
}

impl Retry {
    /// The longest wait between tries.
    const MAX_WAIT: Duration = Duration::from_secs(300);

    fn first(now: tokio::time::Instant) -> Retry {
        Retry { at: Some(now + FOLLOW_REGISTRY * 2), wait: FOLLOW_REGISTRY * 2 }
    }

    fn next(&self, now: tokio::time::Instant) -> Retry {
        let wait = (self.wait * 2).min(Self::MAX_WAIT);
        Retry { at: Some(now + wait), wait }
    }

    /// Not tried while the name stays registered.
    fn never() -> Retry {
        Retry { at: None, wait: Self::MAX_WAIT }
    }
}

/// The plugin dir must be the daemon user's and writable by nobody else:
/// another user able to write there could swap the sockets for their own.
fn check_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).with_context(|| format!("cannot look at {}", dir.display()))?;
    anyhow::ensure!(meta.is_dir(), "the InfraKit plugin dir {} is not a directory", dir.display());
    let me = rustix::process::geteuid().as_raw();
    anyhow::ensure!(
        meta.uid() == me && meta.mode() & 0o022 == 0,
        "the InfraKit plugin dir {} must be owned by uid {me} and writable by it alone (it is uid {}, mode {:o})",
        dir.display(),
        meta.uid(),
        meta.mode() & 0o7777
    );
    Ok(())
}

/// Room for a path in `sockaddr_un`, its NUL included.
const SUN_PATH_BYTES: usize = 108;
/// What [`bind`] adds to the dir for the path it binds first: `/.b-XXXXXX/s`.
const BIND_SUFFIX_BYTES: usize = 12;

/// Why `dir/name` cannot be a socket's path, if it cannot: sun_path holds
/// 108 bytes with its NUL, and [`bind`] first binds in the dir plus 12.
/// `dir` is absolute (a relative one is made so before any bind).
fn path_problem(dir: &Path, name: &str) -> Option<String> {
    let path = dir.join(name);
    let longest = path.as_os_str().len().max(dir.as_os_str().len() + BIND_SUFFIX_BYTES);
    (longest >= SUN_PATH_BYTES).then(|| {
        format!(
            "the socket path {} would be {longest} bytes long; a Unix socket's path must be under \
             {SUN_PATH_BYTES} bytes: choose a shorter --infrakit-dir",
            path.display()
        )
    })
}

/// Bind `dir/name` at mode 0600, replacing a socket that refuses connections
/// (its process is gone).
async fn bind(dir: &Path, name: &str) -> Result<(tokio::net::UnixListener, PathBuf, (u64, u64))> {
    let path = dir.join(name);
    if let Some(problem) = path_problem(dir, name) {
        anyhow::bail!(problem);
    }
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.file_type().is_socket() => {
            let probe = tokio::time::timeout(Duration::from_secs(1), tokio::net::UnixStream::connect(&path)).await;
            match probe {
                Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Ok(Ok(_)) => anyhow::bail!(
                    "{} is served by another process (an InfraKit plugin, or another broker): not replaced",
                    path.display()
                ),
                Ok(Err(error)) => {
                    return Err(error)
                        .with_context(|| format!("cannot tell whether {} is served: not replaced", path.display()));
                }
                Err(_) => anyhow::bail!("{} does not take a connection within 1 s: not replaced", path.display()),
            }
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
        }
        Ok(_) => anyhow::bail!("{} exists and is not a socket: not replaced", path.display()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("cannot look at {}", path.display())),
    }
    // Bound in a fresh directory only this user can enter, restricted, then
    // moved into place, never over a file that appeared meanwhile.
    let private = tempfile::Builder::new()
        .prefix(".b-")
        .rand_bytes(6)
        .tempdir_in(dir)
        .with_context(|| format!("cannot make a private directory in {}", dir.display()))?;
    let bound = private.path().join("s");
    let listener =
        tokio::net::UnixListener::bind(&bound).with_context(|| format!("cannot listen on {}", bound.display()))?;
    std::fs::set_permissions(&bound, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", bound.display()))?;
    let cwd = rustix::fs::CWD;
    let placed = match rustix::fs::renameat_with(cwd, &bound, cwd, &path, rustix::fs::RenameFlags::NOREPLACE) {
        // A filesystem without RENAME_NOREPLACE (NFS, some FUSE): a hard link
        // also never replaces what is there; the private dir's name goes with it.
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {
            rustix::fs::linkat(cwd, &bound, cwd, &path, rustix::fs::AtFlags::empty())
        }
        placed => placed,
    };
    placed.with_context(|| {
        format!("cannot put the socket in place at {} (not replacing what is there)", path.display())
    })?;
    let meta = std::fs::symlink_metadata(&path).with_context(|| format!("cannot look at {}", path.display()))?;
    Ok((listener, path, (meta.dev(), meta.ino())))
}
