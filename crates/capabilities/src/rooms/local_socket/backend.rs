//! The host's unix sockets: a connect resolved beneath the data dir, and the
//! connection read by lines.

use super::{Connection, MAX_LINE_BYTES, SocketAt, SocketBackend, SocketError};
use futures_util::future::BoxFuture;
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{Mode, SFlag, fstat};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// The host's unix sockets, reached beneath the data dir only.
#[derive(Clone, Copy, Default)]
pub struct HostSockets;

impl SocketBackend for HostSockets {
    fn connect<'a>(self: Arc<Self>, at: SocketAt<'a>) -> BoxFuture<'a, Result<Box<dyn Connection>, SocketError>> {
        Box::pin(async move {
            let stream = connect_beneath(at.data_dir, at.relative, at.guest_path).await?;
            Ok(Box::new(StreamConnection { stream, pending: Vec::new(), closed: false }) as Box<dyn Connection>)
        })
    }
}

/// A real connection to a unix socket.
struct StreamConnection {
    stream: UnixStream,
    /// Bytes read past the last line handed out; kept across timeouts.
    pending: Vec<u8>,
    closed: bool,
}

async fn connect_beneath(data_dir: &Path, relative: &Path, guest_path: &str) -> Result<UnixStream, SocketError> {
    let dir = nix::fcntl::open(data_dir, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|source| SocketError::DataDir { path: guest_path.to_owned(), cause: source })?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let socket = nix::fcntl::openat2(&dir, relative, how).map_err(|errno| match errno {
        Errno::ENOENT | Errno::ENOTDIR => SocketError::Missing(guest_path.to_owned()),
        Errno::ELOOP | Errno::EXDEV => SocketError::Escapes(guest_path.to_owned()),
        other => SocketError::Open { path: guest_path.to_owned(), cause: other },
    })?;
    let stat = fstat(&socket).map_err(|source| SocketError::Open { path: guest_path.to_owned(), cause: source })?;
    match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFSOCK => {}
        // O_PATH | O_NOFOLLOW opens a final symlink itself rather than failing.
        SFlag::S_IFLNK => return Err(SocketError::Escapes(guest_path.to_owned())),
        _ => return Err(SocketError::NotASocket(guest_path.to_owned())),
    }
    // Connecting through the handle's magic link reaches exactly the inode checked above.
    let by_handle = format!("/proc/self/fd/{}", socket.as_raw_fd());
    let stream = UnixStream::connect(&by_handle).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => SocketError::NotListening(guest_path.to_owned()),
        _ => SocketError::Connect { path: guest_path.to_owned(), cause: e },
    })?;
    drop(socket);
    Ok(stream)
}

impl Connection for StreamConnection {
    fn send<'a>(&'a mut self, data: &'a [u8]) -> BoxFuture<'a, Result<(), SocketError>> {
        Box::pin(StreamConnection::send(self, data))
    }

    fn receive_line(&mut self, timeout: Duration) -> BoxFuture<'_, Result<Option<String>, SocketError>> {
        Box::pin(StreamConnection::receive_line(self, timeout))
    }
}

impl StreamConnection {
    async fn send(&mut self, data: &[u8]) -> Result<(), SocketError> {
        self.stream.write_all(data).await.map_err(SocketError::Io)
    }

    /// The next line, or `None` at the end of the stream. A timeout keeps what
    /// was read so far for the next call.
    async fn receive_line(&mut self, timeout: Duration) -> Result<Option<String>, SocketError> {
        let read = async {
            let mut buf = [0u8; 8192];
            loop {
                if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                    let mut line: Vec<u8> = self.pending.drain(..=end).collect();
                    line.pop();
                    return line_text(line).map(Some);
                }
                if self.pending.len() > MAX_LINE_BYTES {
                    return Err(SocketError::LineTooLong);
                }
                if self.closed {
                    return if self.pending.is_empty() {
                        Ok(None)
                    } else {
                        line_text(std::mem::take(&mut self.pending)).map(Some)
                    };
                }
                match self.stream.read(&mut buf).await {
                    Ok(0) => self.closed = true,
                    Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                    Err(e) => return Err(SocketError::Io(e)),
                }
            }
        };
        tokio::time::timeout(timeout, read).await.unwrap_or(Err(SocketError::Timeout(timeout.as_millis() as u64)))
    }
}

fn line_text(mut line: Vec<u8>) -> Result<String, SocketError> {
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| SocketError::NotUtf8)
}
