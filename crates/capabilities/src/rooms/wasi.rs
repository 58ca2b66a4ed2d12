//! The WASI a provider gets: nothing ambient. No env, args, preopened
//! directories, sockets or name lookups; stdout and stderr become `tracing`
//! events tagged with the provider.

use crate::quotas::Quotas;
use crate::secrets::Redactor;
use std::collections::VecDeque;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder};

/// Longest line kept from guest output; longer lines are split.
const MAX_LINE_BYTES: usize = 4096;

/// Most stderr lines a [`StderrTail`] keeps, and the most bytes of each it quotes.
const TAIL_LINES: usize = 8;
const TAIL_LINE_BYTES: usize = 512;

/// The last lines a guest wrote to stderr in its current call: what its
/// error quotes when it traps, as a Rust panic writes its message, file and
/// line there just before it aborts. Kept as written (at most 8 lines of
/// 4 KiB), whatever the log rate; redacted and cut only when quoted, so a
/// flood costs the host no more than its log lines do.
#[derive(Clone)]
pub struct StderrTail {
    lines: Arc<Mutex<VecDeque<Vec<u8>>>>,
    redactor: Arc<Redactor>,
}

impl StderrTail {
    /// An empty tail whose lines are quoted with `redactor`'s secrets hidden.
    pub fn new(redactor: Arc<Redactor>) -> Self {
        StderrTail { lines: Arc::default(), redactor }
    }

    /// Forget what earlier calls wrote (a pooled instance serves many calls).
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// The lines kept, oldest first: redacted (whole lines, before any cut), then cut.
    pub fn lines(&self) -> Vec<String> {
        let lines = self.lock();
        lines
            .iter()
            .map(|line| {
                let text = String::from_utf8_lossy(line);
                let text = self.redactor.redact(&text);
                crate::rooms::log::truncate(text.trim_end(), TAIL_LINE_BYTES).to_owned()
            })
            .collect()
    }

    fn push(&self, line: &[u8]) {
        let trimmed = line.trim_ascii();
        // Rust's hint about backtraces says nothing of the failure.
        if trimmed.is_empty() || trimmed.starts_with(b"note: run with `RUST_BACKTRACE=1`") {
            return;
        }
        let mut lines = self.lock();
        if lines.len() == TAIL_LINES {
            lines.pop_front();
        }
        lines.push_back(line.to_vec());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Vec<u8>>> {
        self.lines.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `data_dir` is preopened as `/data`, the guest's only filesystem; output
/// lines count against the provider's log rate in `quotas`, and the last
/// stderr lines are kept in `stderr_tail` whatever the rate.
pub fn sandboxed_ctx(
    provider: &Arc<str>,
    data_dir: &Path,
    quotas: &Arc<Quotas>,
    redactor: &Arc<Redactor>,
    stderr_tail: &StderrTail,
) -> WasiCtx {
    let mut builder = WasiCtxBuilder::new();
    let output = |stream, tail| TracingOutput {
        provider: provider.clone(),
        stream,
        quotas: quotas.clone(),
        redactor: redactor.clone(),
        tail,
    };
    builder
        .stdout(output("stdout", None))
        .stderr(output("stderr", Some(stderr_tail.clone())))
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
    if let Err(e) = builder.preopened_dir(data_dir, crate::rooms::process::GUEST_DATA_DIR, FsPerms::ReadWrite) {
        // The data dir is made when the provider loads; a guest without it simply has no filesystem.
        tracing::warn!(provider = &**provider, error = %e, "cannot preopen the provider's data dir");
    }
    builder.build()
}

/// A guest output stream that turns lines into `tracing` events.
#[derive(Clone)]
struct TracingOutput {
    provider: Arc<str>,
    stream: &'static str,
    quotas: Arc<Quotas>,
    redactor: Arc<Redactor>,
    /// Where stderr's last lines are kept (none for stdout).
    tail: Option<StderrTail>,
}

impl IsTerminal for TracingOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for TracingOutput {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(LineWriter { out: self.clone(), pending: Vec::new() })
    }
}

struct LineWriter {
    out: TracingOutput,
    pending: Vec<u8>,
}

impl LineWriter {
    fn emit(&self, line: &[u8]) {
        if let Some(tail) = &self.out.tail {
            tail.push(line);
        }
        if !self.out.quotas.log_line_allowed(&self.out.provider) {
            return;
        }
        let line = String::from_utf8_lossy(line);
        let line = self.out.redactor.redact(&line);
        tracing::info!(provider = &*self.out.provider, stream = self.out.stream, line = %line.trim_end(), "guest output");
    }

    fn absorb(&mut self, buf: &[u8]) {
        for &byte in buf {
            if byte == b'\n' {
                let line = std::mem::take(&mut self.pending);
                self.emit(&line);
            } else {
                self.pending.push(byte);
                if self.pending.len() >= MAX_LINE_BYTES {
                    let line = std::mem::take(&mut self.pending);
                    self.emit(&line);
                }
            }
        }
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.emit(&line);
        }
    }
}

impl AsyncWrite for LineWriter {
    fn poll_write(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.absorb(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The `wasi:filesystem` interface as wasmtime-wasi links it.
const FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// Refuse `symlink-at` (`not-permitted`): a guest cannot follow a link out of
/// `/data` itself, but its granted programs and anything else reading its
/// data dir could; a provider has no need to make links. Replaces
/// wasmtime-wasi's implementation, which `add_to_linker_async` installed.
pub fn refuse_symlinks<T: Send + 'static>(
    linker: &mut wasmtime::component::Linker<T>,
    denied: fn(&mut T, &str),
) -> wasmtime::Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::filesystem::Descriptor;
    use wasmtime_wasi::p2::bindings::filesystem::types::ErrorCode;
    linker.allow_shadowing(true);
    let mut types = linker.instance(FILESYSTEM_TYPES)?;
    types.func_wrap(
        "[method]descriptor.symlink-at",
        move |mut store, (_dir, _target, path): (Resource<Descriptor>, String, String)| {
            denied(store.data_mut(), &path);
            Ok((Err::<(), ErrorCode>(ErrorCode::NotPermitted),))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stderr_tail_keeps_the_last_lines_and_quotes_them_redacted_whole_then_cut() {
        let redactor = Arc::new(Redactor::default());
        redactor.set(vec![("hunter2-secret".into(), "<token>".into())]);
        let tail = StderrTail::new(redactor);
        for i in 0..20 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        tail.push(b"note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n");
        tail.push(b"   \n");
        let lines = tail.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!((lines[0].as_str(), lines[7].as_str()), ("line 12", "line 19"));
        // A secret past the quoted length is hidden before the line is cut.
        let long = format!("{}hunter2-secret", "x".repeat(TAIL_LINE_BYTES - 4));
        tail.push(long.as_bytes());
        let quoted = tail.lines().pop().unwrap();
        assert!(!quoted.contains("hunt") && quoted.len() == TAIL_LINE_BYTES, "{quoted}");
        tail.clear();
        assert!(tail.lines().is_empty());
    }
}
