//! `broker:provider/local-socket`: stream connections to unix sockets in the
//! provider's own data dir (a VM's QMP monitor), with no way out of it.
//!
//! The path is resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`
//! from the data dir to an `O_PATH` handle, checked to be a socket, and
//! connected through `/proc/self/fd/N`. So a symlink planted in the data dir
//! cannot lead to the host's sockets (e.g. Docker's or Incus's), a rename
//! between check and connect changes nothing, and the 108-byte limit of
//! socket paths does not apply to deep data dirs.
//!
//! What a checked connect reaches is a [`SocketBackend`]: the host's sockets
//! ([`HostSockets`], `backend.rs`), or in the conformance kit those of
//! simulated children (`process::SimProcesses`), or either recorded
//! (`process::tape`). The WIT implementation is in `host.rs`; the room (grant,
//! backend, store part, linker) is [`LocalSocket`].

mod backend;
mod host;

pub use backend::HostSockets;

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::local_socket as wit;
use crate::rooms::HasRooms;
use crate::rooms::denials::Denials;
use crate::rooms::view::{View, ViewOf};
use crate::rooms::{Linking, Room, StoreSetup};
use futures_util::future::BoxFuture;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::Linker;

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "local-socket";

/// A line longer than this is refused rather than buffered without end.
pub(crate) const MAX_LINE_BYTES: usize = 1 << 20;
/// Open connections one store may hold at once.
pub const MAX_CONNECTIONS: usize = 32;
const GUEST_DATA_PREFIX: &str = "/data/";

/// Why a connect, send or read failed; the guest gets the matching [`BrokerError`].
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Refused: no grant.
    #[error("local-sockets is not granted: add `local-sockets = true` under [grants]")]
    NotGranted,
    /// Refused: the sandbox gives no backend.
    #[error("local-socket has no backend here: this sandbox gives the provider no sockets")]
    NoBackend,
    /// Refused: not a plain path below `/data`.
    #[error("socket path {0:?} is not inside /data (the provider's data dir) or is not a clean path")]
    OutsideDataDir(String),
    /// Refused: resolving it met a symlink or left the data dir.
    #[error("socket path {0:?} leads through a symlink or out of /data")]
    Escapes(String),
    /// Nothing at the path.
    #[error("no socket at {0:?}")]
    Missing(String),
    /// Something other than a socket at the path.
    #[error("{0:?} is not a socket")]
    NotASocket(String),
    /// The socket exists but nobody listens yet (bound, not listening) or any more.
    #[error("nobody is listening on {0:?}")]
    NotListening(String),
    /// The data dir itself could not be opened.
    #[error("cannot connect to {path:?}: data dir: {}", crate::error_text::cause_text(.cause))]
    DataDir {
        /// As the guest wrote it.
        path: String,
        /// From opening the data dir.
        cause: nix::errno::Errno,
    },
    /// Opening or checking the socket's path beneath the data dir failed.
    #[error("cannot connect to {path:?}: {}", crate::error_text::cause_text(.cause))]
    Open {
        /// As the guest wrote it.
        path: String,
        /// From `openat2` or `fstat`.
        cause: nix::errno::Errno,
    },
    /// Connecting failed for another reason than nobody listening.
    #[error("cannot connect to {path:?}: {}", crate::error_text::cause_text(.cause))]
    Connect {
        /// As the guest wrote it.
        path: String,
        /// From `connect`.
        cause: std::io::Error,
    },
    /// The store already holds [`MAX_CONNECTIONS`].
    #[error("too many open connections (at most {MAX_CONNECTIONS})")]
    TooMany,
    /// No full line within the timeout, in milliseconds.
    #[error("timed out after {0} ms waiting for a line")]
    Timeout(u64),
    /// A line past [`MAX_LINE_BYTES`].
    #[error("line longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong,
    /// A line that is not UTF-8.
    #[error("line is not UTF-8")]
    NotUtf8,
    /// Reading or writing the stream failed.
    #[error("socket i/o: {}", crate::error_text::cause_text(.0))]
    Io(std::io::Error),
}

impl From<SocketError> for BrokerError {
    fn from(err: SocketError) -> Self {
        let message = err.to_string();
        match err {
            SocketError::NotGranted
            | SocketError::NoBackend
            | SocketError::OutsideDataDir(_)
            | SocketError::Escapes(_) => BrokerError::AccessDenied(message),
            SocketError::Missing(_) | SocketError::NotListening(_) => BrokerError::NotFound(message),
            SocketError::NotASocket(_) | SocketError::TooMany => BrokerError::InvalidParams(message),
            SocketError::Timeout(_) => BrokerError::Timeout(message),
            SocketError::DataDir { .. }
            | SocketError::Open { .. }
            | SocketError::Connect { .. }
            | SocketError::LineTooLong
            | SocketError::NotUtf8
            | SocketError::Io(_) => BrokerError::Provider(message),
        }
    }
}

/// A socket a provider asked for, checked to be a plain path below its data dir.
#[derive(Clone, Copy)]
pub struct SocketAt<'a> {
    /// The provider asking.
    pub provider: &'a str,
    /// As the provider wrote it (`/data/run/vm.qmp`).
    pub(crate) guest_path: &'a str,
    /// The provider's data dir on the host, and the path below it.
    pub data_dir: &'a Path,
    /// `guest_path` without its `/data/`: plain components only.
    pub relative: &'a Path,
}

/// Where checked connections go.
pub trait SocketBackend: Send + Sync + 'static {
    /// Connect to the socket at `at`.
    fn connect<'a>(self: Arc<Self>, at: SocketAt<'a>) -> BoxFuture<'a, Result<Box<dyn Connection>, SocketError>>;
}

/// One open stream connection, read by lines.
pub trait Connection: Send {
    /// Write all of `data`.
    fn send<'a>(&'a mut self, data: &'a [u8]) -> BoxFuture<'a, Result<(), SocketError>>;
    /// The next line, or `None` at the end of the stream.
    fn receive_line(&mut self, timeout: Duration) -> BoxFuture<'_, Result<Option<String>, SocketError>>;
}

/// The host object behind a guest's `connection` handle.
pub struct HeldConnection(Box<dyn Connection>);

impl HeldConnection {
    pub(crate) async fn send(&mut self, data: &[u8]) -> Result<(), SocketError> {
        self.0.send(data).await
    }

    /// The next line, or `None` at the end of the stream.
    pub(crate) async fn receive_line(&mut self, timeout: Duration) -> Result<Option<String>, SocketError> {
        self.0.receive_line(timeout).await
    }
}

/// Per-store context: the data dir if granted, the backend, and how many
/// connections are open. The default refuses every connect.
pub struct LocalSocketCtx {
    provider: Arc<str>,
    /// `None` unless `local-sockets` is granted.
    data_dir: Option<PathBuf>,
    /// `None` in a sandbox that gives the room no backend.
    backend: Option<Arc<dyn SocketBackend>>,
    open: usize,
    denials: Denials,
}

impl Default for LocalSocketCtx {
    /// Refuses every connect, and reaches nothing.
    fn default() -> Self {
        LocalSocketCtx { provider: "".into(), data_dir: None, backend: None, open: 0, denials: Denials::default() }
    }
}

impl LocalSocketCtx {
    /// Whether connects are let through to a backend.
    pub fn granted(&self) -> bool {
        self.data_dir.is_some() && self.backend.is_some()
    }

    /// `data_dir` is `None` when `local-sockets` is not granted.
    pub fn new(
        provider: Arc<str>,
        data_dir: Option<PathBuf>,
        backend: Arc<dyn SocketBackend>,
        denials: Denials,
    ) -> Self {
        LocalSocketCtx { provider, data_dir, backend: Some(backend), open: 0, denials }
    }

    pub(crate) async fn connect(&mut self, guest_path: &str) -> Result<HeldConnection, SocketError> {
        let data_dir = self.data_dir.as_deref().ok_or(SocketError::NotGranted)?;
        let backend = self.backend.clone().ok_or(SocketError::NoBackend)?;
        if self.open >= MAX_CONNECTIONS {
            return Err(SocketError::TooMany);
        }
        let relative = inside_data_dir(guest_path)?;
        let at = SocketAt { provider: &self.provider, guest_path, data_dir, relative };
        let connection = backend.connect(at).await?;
        self.open += 1;
        tracing::debug!(provider = %self.provider, path = guest_path, "local socket connected");
        Ok(HeldConnection(connection))
    }

    fn closed_one(&mut self) {
        self.open = self.open.saturating_sub(1);
    }
}

/// `/data/a/b.sock` -> `a/b.sock`, refusing anything that is not a plain path below `/data`.
fn inside_data_dir(guest_path: &str) -> Result<&Path, SocketError> {
    let outside = || SocketError::OutsideDataDir(guest_path.to_owned());
    let relative = Path::new(guest_path.strip_prefix(GUEST_DATA_PREFIX).ok_or_else(outside)?);
    let plain = relative.components().all(|c| matches!(c, Component::Normal(_)));
    if relative.as_os_str().is_empty() || !plain {
        return Err(outside());
    }
    Ok(relative)
}

pub(crate) type LocalSocketView<'a> = View<'a, LocalSocketCtx>;

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> LocalSocketView<'_>,
) -> wasmtime::Result<()> {
    // The same in every contract version served: linked under each one's name.
    for instance in crate::bindings::served_instances(INTERFACE) {
        wit::add_to_linker_instance::<T, ViewOf<LocalSocketCtx>>(&mut linker.instance(&instance)?, getter)?;
    }
    Ok(())
}

/// The room: `local-sockets = true` under `[grants]`.
pub struct LocalSocket;

impl Room for LocalSocket {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "local-sockets";
    const LINKING: Linking = Linking::Always;
    type Grant = bool;
    type Backend = dyn SocketBackend;
    type Ctx = LocalSocketCtx;
    type Prepared = ();

    fn host_backend() -> Option<Arc<dyn SocketBackend>> {
        Some(Arc::new(HostSockets))
    }

    fn ctx(grant: &bool, backend: Option<Arc<dyn SocketBackend>>, store: &StoreSetup<'_>) -> LocalSocketCtx {
        let data_dir = grant.then(|| store.data_dir.to_owned());
        let (provider, denials) = (store.provider.clone(), store.denials.clone());
        LocalSocketCtx { provider, data_dir, backend, open: 0, denials }
    }

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state: &mut T| {
            let (ctx, table) = state.room::<LocalSocket>();
            LocalSocketView { ctx, table }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncBufReadExt;
    use tokio::io::AsyncWriteExt;
    use tokio::net::UnixListener;

    fn granted(dir: &Path) -> LocalSocketCtx {
        LocalSocketCtx::new("kvm".into(), Some(dir.to_owned()), Arc::new(HostSockets), Denials::default())
    }

    /// A line-echo server on `path` that greets first, as QMP does.
    fn echo_server(path: &Path) -> tokio::task::JoinHandle<()> {
        let listener = UnixListener::bind(path).unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (read, mut write) = stream.into_split();
                    write.write_all(b"{\"hello\":1}\r\n").await.unwrap();
                    let mut lines = tokio::io::BufReader::new(read).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        write.write_all(format!("echo {line}\n").as_bytes()).await.unwrap();
                    }
                });
            }
        })
    }

    #[tokio::test]
    async fn talks_lines_to_a_socket_in_the_data_dir_even_past_the_path_length_limit() {
        let dir = tempfile::tempdir().unwrap();
        // Deeper than the 108 bytes a sockaddr_un can hold, from the host's side.
        let deep = dir.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        // Bound at a short path, then moved deep: connecting finds the inode.
        let short = tempfile::tempdir().unwrap();
        let _server = echo_server(&short.path().join("q.sock"));
        std::fs::rename(short.path().join("q.sock"), deep.join("q.sock")).unwrap();

        let mut ctx = granted(dir.path());
        let guest_path = format!("/data/{}/{}/q.sock", "d".repeat(60), "e".repeat(60));
        let mut conn = ctx.connect(&guest_path).await.unwrap();
        let greeting = conn.receive_line(Duration::from_secs(5)).await.unwrap();
        assert_eq!(greeting.as_deref(), Some("{\"hello\":1}"), "CR LF is trimmed");
        conn.send(b"one\ntwo\n").await.unwrap();
        assert_eq!(conn.receive_line(Duration::from_secs(5)).await.unwrap().as_deref(), Some("echo one"));
        assert_eq!(conn.receive_line(Duration::from_secs(5)).await.unwrap().as_deref(), Some("echo two"));
        assert!(
            matches!(conn.receive_line(Duration::from_millis(50)).await, Err(SocketError::Timeout(50))),
            "nothing more was sent"
        );
    }

    #[tokio::test]
    async fn refuses_ungranted_outside_symlinked_and_non_socket_paths() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let outside_socket = elsewhere.path().join("host.sock");
        let _server = echo_server(&outside_socket);
        std::os::unix::fs::symlink(&outside_socket, dir.path().join("evil.sock")).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join("sub/up")).unwrap();
        std::fs::write(dir.path().join("file"), b"x").unwrap();
        // Bound and then closed: the file stays, nobody listens (as between a server's bind and listen).
        drop(std::os::unix::net::UnixListener::bind(dir.path().join("dead.sock")).unwrap());

        let mut ungranted = LocalSocketCtx::new("kvm".into(), None, Arc::new(HostSockets), Denials::default());
        assert!(matches!(ungranted.connect("/data/evil.sock").await.err(), Some(SocketError::NotGranted)));

        let mut ctx = granted(dir.path());
        let host_path = outside_socket.display().to_string();
        for (path, expected) in [
            (host_path.as_str(), SocketError::OutsideDataDir(host_path.clone())),
            ("/data/../x.sock", SocketError::OutsideDataDir("/data/../x.sock".into())),
            ("/data/", SocketError::OutsideDataDir("/data/".into())),
            ("/data/evil.sock", SocketError::Escapes("/data/evil.sock".into())),
            ("/data/sub/up/host.sock", SocketError::Escapes("/data/sub/up/host.sock".into())),
            ("/data/nothing.sock", SocketError::Missing("/data/nothing.sock".into())),
            ("/data/file", SocketError::NotASocket("/data/file".into())),
            ("/data/dead.sock", SocketError::NotListening("/data/dead.sock".into())),
        ] {
            let refused = ctx.connect(path).await.err().map(|e| e.to_string());
            assert_eq!(refused, Some(expected.to_string()), "{path}");
        }
        assert!(matches!(BrokerError::from(SocketError::Escapes("x".into())), BrokerError::AccessDenied(_)));
        assert_eq!(ctx.open, 0, "refusals hold nothing");
    }

    #[tokio::test]
    async fn end_of_stream_and_oversized_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut a, _) = listener.accept().await.unwrap();
            a.write_all(b"last words").await.unwrap();
            drop(a);
            let (mut b, _) = listener.accept().await.unwrap();
            let _ = b.write_all(&vec![b'x'; MAX_LINE_BYTES + 10]).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        });
        let mut ctx = granted(dir.path());
        let mut first = ctx.connect("/data/s.sock").await.unwrap();
        assert_eq!(first.receive_line(Duration::from_secs(5)).await.unwrap().as_deref(), Some("last words"));
        assert_eq!(first.receive_line(Duration::from_secs(5)).await.unwrap(), None);
        let mut second = ctx.connect("/data/s.sock").await.unwrap();
        assert!(matches!(second.receive_line(Duration::from_secs(5)).await, Err(SocketError::LineTooLong)));
        server.abort();
    }
}
