//! The machine lock itself, native: Juju's `juju/mutex` semantics.
//!
//! - One named lock per machine: `flock(LOCK_EX)` on `<data dir>/<name>` (mode
//!   0600, close-on-exec), so other processes serialise with us and a dead
//!   holder's lock is released by the kernel.
//! - Inside one host, waiters are served first come, first served; one that
//!   gives up (timeout, abort, or its future dropped) passes its turn on.
//! - On release a history line is appended while the lock is still held.
//! - Holder and waiters are mirrored to small files beside the lock so that
//!   `broker lock` in another process can report them.

use super::history::{History, go_duration};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fs::{File, OpenOptions, TryLockError};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;

/// How often a waiter at the head of the queue retries the flock another
/// process holds, and re-checks its abort flag.
const POLL: Duration = Duration::from_millis(10);

/// Why the lock could not be made or taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The spec's timeout passed first.
    #[error("timeout acquiring mutex")]
    Timeout,
    /// The spec's abort flag was set.
    #[error("cancelled acquiring mutex")]
    Cancelled,
    /// The lock file or its directory failed.
    #[error("machine lock {path}: {}", crate::error_text::cause_text(.cause))]
    Io {
        /// The lock file's path.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A bad lock name, worker or comment.
    #[error("invalid lock spec: {0}")]
    InvalidSpec(String),
}

/// The longest `worker` an acquirer may give, in bytes.
pub(crate) const MAX_WORKER_BYTES: usize = 64;
/// The longest `comment` an acquirer may give, in bytes.
pub const MAX_COMMENT_BYTES: usize = 256;

/// What an acquirer asks for (Juju's `mutex.Spec` plus the holder's identity).
/// `worker` and `comment` end up in the history log and in reports, so they are
/// checked at the boundary ([`Spec::check`]): printable, and of bounded length.
#[derive(Debug, Clone, Default)]
pub struct Spec {
    /// Required: who holds the lock, e.g. `uniter` or `broker`.
    pub worker: String,
    /// Why it is held, shown beside the worker; may be empty.
    pub comment: String,
    /// `None` (or zero) waits forever.
    pub timeout: Option<Duration>,
    /// Set to give up waiting ("cancelled acquiring mutex").
    pub abort: Option<Arc<AtomicBool>>,
}

impl Spec {
    /// Refuse (never truncate) a worker or comment that is too long or holds a
    /// character a log line or terminal would act on (a newline forges a history
    /// line, ESC a terminal sequence).
    pub fn check(&self) -> Result<(), LockError> {
        if self.worker.is_empty() {
            return Err(LockError::InvalidSpec("worker is required".into()));
        }
        check_field("worker", &self.worker, MAX_WORKER_BYTES)?;
        check_field("comment", &self.comment, MAX_COMMENT_BYTES)
    }
}

fn check_field(field: &str, value: &str, max: usize) -> Result<(), LockError> {
    if value.len() > max {
        return Err(LockError::InvalidSpec(format!(
            "{field} is {} bytes long; at most {max} are allowed",
            value.len()
        )));
    }
    if let Some((at, c)) = value.char_indices().find(|(_, c)| crate::error_text::is_unprintable(*c)) {
        return Err(LockError::InvalidSpec(format!(
            "{field} must be printable: it has the control character U+{:04X} at byte {at}",
            c as u32
        )));
    }
    Ok(())
}

/// One holder or waiter, as the report shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Party {
    /// The agent of the process (as in history lines).
    pub agent: String,
    /// Its process; a party whose process is gone is left out of reports.
    pub pid: u32,
    /// As in [`Spec::worker`].
    pub worker: String,
    /// As in [`Spec::comment`].
    pub comment: String,
    /// Unix seconds when it started holding or waiting.
    pub since: u64,
}

impl Party {
    /// `worker (comment)`, as Juju prints it.
    pub fn label(&self) -> String {
        if self.comment.is_empty() { self.worker.clone() } else { format!("{} ({})", self.worker, self.comment) }
    }

    fn for_here(agent: &str, spec: &Spec) -> Party {
        Party {
            agent: agent.to_owned(),
            pid: std::process::id(),
            worker: spec.worker.clone(),
            comment: spec.comment.clone(),
            since: unix_now(),
        }
    }
}

/// The lock's state as `broker lock` reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// `machine-lock` or `machine-lock-<group>`.
    pub name: String,
    /// `None` when free, or when its holder's process is gone.
    pub holder: Option<Party>,
    /// Of every process on the machine, longest waiting first.
    pub waiting: Vec<Party>,
    /// The last history lines, oldest first.
    pub history: Vec<String>,
}

impl Report {
    /// Juju-style text: `holder: none` or `holder: worker (comment), holding 2m0s`.
    /// What other processes wrote (holder and waiter files, history lines) is shown
    /// with control characters escaped.
    pub fn text(&self) -> String {
        use crate::error_text::escape_unprintable as esc;
        let now = unix_now();
        let age = |p: &Party| go_duration(Duration::from_secs(now.saturating_sub(p.since)));
        let mut out = format!("{}:\n", self.name);
        match &self.holder {
            None => out.push_str("  holder: none\n"),
            Some(h) => {
                let (label, agent) = (esc(&h.label()).into_owned(), esc(&h.agent).into_owned());
                out.push_str(&format!("  holder: {label}, holding {} ({agent} pid {})\n", age(h), h.pid))
            }
        }
        if !self.waiting.is_empty() {
            out.push_str("  waiting:\n");
            for w in &self.waiting {
                let (label, agent) = (esc(&w.label()).into_owned(), esc(&w.agent).into_owned());
                out.push_str(&format!("  - {label}, waiting {} ({agent} pid {})\n", age(w), w.pid));
            }
        }
        if !self.history.is_empty() {
            out.push_str("  history:\n");
            for line in &self.history {
                out.push_str(&format!("  - {}\n", esc(line)));
            }
        }
        out
    }
}

struct Waiter {
    id: u64,
    party: Party,
}

#[derive(Default)]
struct State {
    holder: Option<Party>,
    queue: VecDeque<Waiter>,
    next_id: u64,
}

struct Inner {
    name: String,
    path: PathBuf,
    agent: String,
    history: History,
    state: Mutex<State>,
    changed: Notify,
}

/// A handle on the machine lock; cheap to clone. Holders in this process and
/// in others exclude each other.
#[derive(Clone)]
pub struct MachineLock {
    inner: Arc<Inner>,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

impl MachineLock {
    /// The lock named `name` (`machine-lock` or `machine-lock-<group>`) in `dir`;
    /// `agent` names this process in history lines.
    pub fn new(dir: &Path, name: &str, agent: &str) -> Result<MachineLock, LockError> {
        let valid = name == "machine-lock"
            || name
                .strip_prefix("machine-lock-")
                .is_some_and(|group| !group.is_empty() && group.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
        if !valid {
            return Err(LockError::InvalidSpec(format!(
                "lock name {name:?} must be machine-lock or machine-lock-<group>"
            )));
        }
        let path = dir.join(name);
        std::fs::create_dir_all(dir).map_err(|e| io_error(&path, e))?;
        std::fs::create_dir_all(waiting_dir(&path)).map_err(|e| io_error(&path, e))?;
        Ok(MachineLock {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                history: History::new(path.with_extension("log")),
                path,
                agent: agent.to_owned(),
                state: Mutex::new(State::default()),
                changed: Notify::new(),
            }),
        })
    }

    /// `machine-lock` or `machine-lock-<group>`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The lock file; the history, holder and waiter files sit beside it.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Wait for the lock, first come first served within this process.
    pub async fn acquire(&self, spec: Spec) -> Result<LockGuard, LockError> {
        spec.check()?;
        let started = Instant::now();
        let deadline = spec.timeout.filter(|t| !t.is_zero()).map(|t| started + t);
        let party = Party::for_here(&self.inner.agent, &spec);
        let mut ticket = Ticket::register(self.inner.clone(), party.clone());
        loop {
            // Created before looking at the state, so no wake-up is missed.
            let changed = self.inner.changed.notified();
            if spec.abort.as_ref().is_some_and(|a| a.load(Ordering::SeqCst)) {
                return Err(LockError::Cancelled);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(LockError::Timeout);
            }
            if ticket.is_next() {
                if let Some(file) = self.try_flock()? {
                    ticket.promote_to_holder();
                    let waited = started.elapsed();
                    self.inner.write_holder_file(&party);
                    return Ok(LockGuard {
                        inner: self.inner.clone(),
                        file: Some(file),
                        party,
                        waited,
                        acquired: Instant::now(),
                    });
                }
                // Another process holds it: poll.
                tokio::time::sleep(POLL).await;
            } else {
                let _ = tokio::time::timeout(POLL, changed).await;
            }
        }
    }

    /// The flock, if no other open file description holds it.
    fn try_flock(&self) -> Result<Option<File>, LockError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&self.inner.path) // std opens with O_CLOEXEC: children never inherit the lock
            .map_err(|e| io_error(&self.inner.path, e))?;
        match file.try_lock() {
            Ok(()) => Ok(Some(file)),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(e)) => Err(io_error(&self.inner.path, e)),
        }
    }

    /// Holder, waiters (of every process on the machine) and the last `history` lines.
    pub fn report(&self, history: usize) -> Report {
        let holder = read_party(&holder_path(&self.inner.path)).filter(|p| pid_alive(p.pid));
        let mut waiting: Vec<Party> = std::fs::read_dir(waiting_dir(&self.inner.path))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| read_party(&entry.path()))
            .filter(|p| pid_alive(p.pid))
            .collect();
        waiting.sort_by_key(|p| p.since);
        Report { name: self.inner.name.clone(), holder, waiting, history: self.inner.history.tail(history) }
    }
}

fn io_error(path: &Path, e: std::io::Error) -> LockError {
    LockError::Io { path: path.display().to_string(), cause: e }
}

fn holder_path(lock: &Path) -> PathBuf {
    lock.with_extension("holder")
}

fn waiting_dir(lock: &Path) -> PathBuf {
    lock.with_extension("waiting")
}

fn read_party(path: &Path) -> Option<Party> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn write_party(path: &Path, party: &Party) {
    // Report files are best effort: the lock itself never depends on them.
    if let Ok(bytes) = serde_json::to_vec(party) {
        let _ = std::fs::write(path, bytes);
    }
}

impl Inner {
    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_holder_file(&self, party: &Party) {
        write_party(&holder_path(&self.path), party);
    }
}

/// A place in the in-process queue; leaving it (dropped, timed out, aborted)
/// passes the turn to the next waiter.
struct Ticket {
    inner: Arc<Inner>,
    id: u64,
    file: PathBuf,
    queued: bool,
}

impl Ticket {
    fn register(inner: Arc<Inner>, party: Party) -> Ticket {
        let id = {
            let mut state = inner.lock_state();
            state.next_id += 1;
            let id = state.next_id;
            state.queue.push_back(Waiter { id, party: party.clone() });
            id
        };
        let file = waiting_dir(&inner.path).join(format!("{}-{id}", party.pid));
        write_party(&file, &party);
        Ticket { inner, id, file, queued: true }
    }

    /// First in the queue, and nobody in this process holds the lock.
    fn is_next(&self) -> bool {
        let state = self.inner.lock_state();
        state.holder.is_none() && state.queue.front().is_some_and(|w| w.id == self.id)
    }

    fn promote_to_holder(&mut self) {
        let mut state = self.inner.lock_state();
        if let Some(waiter) = state.queue.pop_front() {
            state.holder = Some(waiter.party);
        }
        self.queued = false;
        drop(state);
        let _ = std::fs::remove_file(&self.file);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.queued {
            self.inner.lock_state().queue.retain(|w| w.id != self.id);
            let _ = std::fs::remove_file(&self.file);
            self.inner.changed.notify_waiters();
        }
    }
}

/// The held lock. Released by [`LockGuard::release`] or on drop.
pub struct LockGuard {
    inner: Arc<Inner>,
    file: Option<File>,
    party: Party,
    waited: Duration,
    acquired: Instant,
}

impl LockGuard {
    /// Release the lock; idempotent. The history line is written first, while
    /// the lock is still held, so history lines are in holding order.
    pub fn release(&mut self) {
        let Some(file) = self.file.take() else { return };
        self.inner.history.append(&self.inner.agent, &self.party.label(), self.waited, self.acquired.elapsed());
        let _ = std::fs::remove_file(holder_path(&self.inner.path));
        let _ = file.unlock();
        drop(file);
        self.inner.lock_state().holder = None;
        self.inner.changed.notify_waiters();
    }

    /// How long the acquire waited for it.
    pub fn waited(&self) -> Duration {
        self.waited
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.release();
    }
}
