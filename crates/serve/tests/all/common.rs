//! What the daemon's tests share: the real binary as a daemon, and plain
//! HTTP/1.1 on its unix socket.

use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `broker --data-dir DATA_DIR ARGS…`, run to its end (talking to a daemon if one serves there).
pub(crate) fn broker(data_dir: &Path, args: &[&str]) -> Output {
    broker_command(data_dir, args).output().expect("run broker")
}

/// `broker --data-dir DATA_DIR ARGS…`, to run as the caller wants (no
/// inherited log level or socket).
pub(crate) fn broker_command(data_dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_broker"));
    command.arg("--data-dir").arg(data_dir).args(args).env_remove("RUST_LOG").env_remove("BROKER_SOCKET");
    command
}

pub(crate) struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    data_dir: PathBuf,
}

impl Daemon {
    pub(crate) fn start(data_dir: &Path) -> Daemon {
        Daemon::start_with(data_dir, &[])
    }

    pub(crate) fn start_with(data_dir: &Path, serve_args: &[&str]) -> Daemon {
        Daemon::spawn(data_dir, serve_args, Stdio::null())
    }

    /// A daemon logging at `info` to `log`.
    pub(crate) fn start_logging(data_dir: &Path, log: &Path) -> Daemon {
        Daemon::spawn(data_dir, &["-v"], std::fs::File::create(log).unwrap().into())
    }

    fn spawn(data_dir: &Path, serve_args: &[&str], stderr: Stdio) -> Daemon {
        let child = Command::new(env!("CARGO_BIN_EXE_broker"))
            .arg("--data-dir")
            .arg(data_dir)
            .arg("serve")
            .args(serve_args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let socket = data_dir.join("broker.sock");
        let started = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(started.elapsed() < Duration::from_secs(30), "the daemon never listened on {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon { child, socket, data_dir: data_dir.to_owned() }
    }

    pub(crate) fn request(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
        request(&self.socket, method, path, body)
    }

    /// SIGTERM, then its exit status once it has drained.
    pub(crate) fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::SIGTERM).unwrap();
        self.child.wait().unwrap()
    }

    pub(crate) fn json(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let (status, text) = self.request(method, path, body.map(str::as_bytes));
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        detach_mounts_under(&self.data_dir);
    }
}

/// Detach what a killed daemon left mounted under `dir` (its providers' data
/// filesystems: a daemon that is killed leaves them, on purpose, for the next
/// one to use), so the test's directory can go.
pub(crate) fn detach_mounts_under(dir: &Path) {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    for line in table.lines() {
        let Some(point) = line.split(' ').nth(4) else { continue };
        if Path::new(point).starts_with(dir) {
            let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// One request on the unix socket; returns the status and the (de-chunked) body.
pub(crate) fn request(socket: &Path, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
    exchange(UnixStream::connect(socket).unwrap(), method, path, body, "")
}

/// One request on `stream`, with `headers` (each ending in CRLF) added.
pub(crate) fn exchange(
    mut stream: impl Read + Write,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &str,
) -> (u16, String) {
    let body = body.unwrap_or_default();
    write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
    let _ = stream.write_all(body); // an oversized body may be refused before it is all read
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    (status, if chunked { dechunk(rest) } else { rest.to_owned() })
}

/// A GET of a listing page on the unix socket: its status, body, and the
/// `X-Next-After` cursor it names, if any.
pub(crate) fn list_page(socket: &Path, path: &str) -> (u16, String, Option<String>) {
    let mut stream = UnixStream::connect(socket).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let next = head.lines().find_map(|l| l.strip_prefix("x-next-after: ")).map(str::to_owned);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    (status, if chunked { dechunk(rest) } else { rest.to_owned() }, next)
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    out
}

/// The bundled fake's manifest, with `line` added to its [config].
pub(crate) fn fake_manifest(dir: &Path, line: &str) -> String {
    let text = guest_artifacts::manifest_text("fake");
    let path = dir.join("fake.toml");
    std::fs::write(&path, format!("{text}{line}\n")).unwrap();
    path.display().to_string()
}
