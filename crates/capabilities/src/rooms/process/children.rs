//! Long-running children: the host's records of them (which survive a
//! restart) and the live handles of the ones this process spawned.

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::process::Child;
use std::sync::Mutex;

/// What the host remembers of a spawned child.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildRecord {
    /// The provider that spawned it.
    pub provider: String,
    /// Unique per provider: how the provider finds it again.
    pub name: String,
    /// Also its process group id: signals go to the whole group.
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat`: with the pid, it names one process for
    /// good, so a recycled pid is never mistaken for the child.
    pub start_time: u64,
    /// The program as run: its host path.
    pub program: String,
    /// The arguments as run, in host paths.
    pub args: Vec<String>,
    /// Where its stdout and stderr go (`logs/<name>.log` in the data dir).
    pub log: String,
    /// The pid and start time of its sandbox's first process (bubblewrap's
    /// init of its pid namespace), which lives as long as any process of the
    /// sandbox does: the child is running while it is, even after the program
    /// itself exited leaving processes behind (`qemu -daemonize`), and killing
    /// it kills them all. `None` for records of hosts from before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<(u32, u64)>,
}

impl ChildRecord {
    /// Whether the child's sandbox still has a process in it.
    pub(crate) fn sandbox_lives(&self) -> bool {
        self.sandbox.is_some_and(|(pid, start)| {
            proc_stat(pid).is_some_and(|(now, state)| now == start && state != 'Z' && state != 'X')
        })
    }
}

/// The child records' storage failed; its cause is kept, typed (the real
/// store's database or decoding error), and named in the message (so it is
/// not this error's `source()` as well).
#[derive(Debug)]
pub struct RecordsError {
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl std::fmt::Display for RecordsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "child records: {}", crate::error_text::cause_text(&*self.source))
    }
}

impl std::error::Error for RecordsError {}

impl RecordsError {
    /// The store's failure, its cause kept.
    pub fn new(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        RecordsError { source: Box::new(source) }
    }

    /// What failed, as the storage said it.
    pub fn cause(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }
}

/// Storage of child records; the real one is in [`crate::store`]. A change
/// is made when it is asked for (a future dropped unpolled still makes it)
/// and is durable when its future is done; reads are served at once.
pub trait ChildRecords: Send + Sync + 'static {
    /// Record `record`, replacing any under its provider and name.
    fn put(&self, record: &ChildRecord) -> BoxFuture<'static, Result<(), RecordsError>>;
    /// The record of `provider`'s child `name`, if any.
    fn get(&self, provider: &str, name: &str) -> Result<Option<ChildRecord>, RecordsError>;
    /// Forget a record; an absent one is no error.
    fn remove(&self, provider: &str, name: &str) -> BoxFuture<'static, Result<(), RecordsError>>;
    /// Every record of `provider`.
    fn list(&self, provider: &str) -> Result<Vec<ChildRecord>, RecordsError>;
}

/// Child records in memory (lost with the process), for tests.
#[derive(Default)]
pub struct MemoryChildRecords {
    records: Mutex<BTreeMap<(String, String), ChildRecord>>,
}

impl MemoryChildRecords {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), ChildRecord>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ChildRecords for MemoryChildRecords {
    fn put(&self, record: &ChildRecord) -> BoxFuture<'static, Result<(), RecordsError>> {
        self.lock().insert((record.provider.clone(), record.name.clone()), record.clone());
        Box::pin(std::future::ready(Ok(())))
    }
    fn get(&self, provider: &str, name: &str) -> Result<Option<ChildRecord>, RecordsError> {
        Ok(self.lock().get(&(provider.to_owned(), name.to_owned())).cloned())
    }
    fn remove(&self, provider: &str, name: &str) -> BoxFuture<'static, Result<(), RecordsError>> {
        self.lock().remove(&(provider.to_owned(), name.to_owned()));
        Box::pin(std::future::ready(Ok(())))
    }
    fn list(&self, provider: &str) -> Result<Vec<ChildRecord>, RecordsError> {
        Ok(self.lock().values().filter(|r| r.provider == provider).cloned().collect())
    }
}

/// How a child is doing, as far as the host can see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Still running.
    Running,
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal.
    Signalled(i32),
    /// No such process any more (or its pid now names another one).
    Gone,
}

/// `(start time, state)` of a pid from `/proc/<pid>/stat`.
pub fn proc_stat(pid: u32) -> Option<(u64, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is parenthesised and may hold spaces.
    let after_name = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    // Fields are counted from 1 and this slice starts at field 3: starttime (22) is index 19.
    let start_time = fields.get(19)?.parse().ok()?;
    Some((start_time, state))
}

/// How long ago a process started.
fn process_age(pid: u32) -> Option<std::time::Duration> {
    let (start_ticks, _) = proc_stat(pid)?;
    let ticks_per_second = rustix::param::clock_ticks_per_second().max(1) as f64;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime").ok()?.split_whitespace().next()?.parse().ok()?;
    let age = uptime - start_ticks as f64 / ticks_per_second;
    Some(std::time::Duration::from_secs_f64(age.max(0.0)))
}

/// A process's real uid and parent pid, from `/proc/<pid>/status`.
fn uid_and_parent(pid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name))?.split_whitespace().next()?.parse().ok();
    Some((field("Uid:")?, field("PPid:")?))
}

/// How far up its parents a process is followed to a recorded child.
const MAX_ANCESTRY: usize = 64;

/// Kill what runs as a provider's sandbox user and descends from no recorded
/// child: a host killed between spawning a child and recording it leaves it
/// running, and no provider can find it again. A recorded child (its pid
/// and start time, so a recycled pid is no match) keeps itself and every
/// descendant (bubblewrap's own children); the rest of those users'
/// processes belong to no record. Returns what was killed: the uid's owner
/// (from `uids`) and the pid.
///
/// Only for uids the host's sandbox gives out and nobody else uses; never
/// root's, nor the host's own (without root, programs run as it).
///
/// A uid range may be shared by several hosts on one machine (each data dir
/// allocates from the same base), so a process counts as this host's only if
/// one of its ancestors' command lines names `ours` (the host's data dir, in
/// bubblewrap's binds); the others are left alone.
/// Processes younger than `min_age` are left alone: a periodic reap runs
/// while providers spawn, and a child is recorded just after it starts. So
/// are the descendants of `host` (this host process, while it runs: a `run`
/// in progress is its child and has no record).
pub fn reap_unrecorded(
    uids: &HashMap<u32, String>,
    recorded: &[ChildRecord],
    ours: &str,
    min_age: std::time::Duration,
    host: Option<u32>,
) -> Vec<(String, u32)> {
    let young = |pid: u32| min_age > std::time::Duration::ZERO && process_age(pid).is_none_or(|age| age < min_age);
    let kept: std::collections::HashSet<(u32, u64)> =
        recorded.iter().flat_map(|r| std::iter::once((r.pid, r.start_time)).chain(r.sandbox)).collect();
    let own = rustix::process::getuid().as_raw();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let pids: Vec<u32> = entries.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
    let names_ours = |pid: u32| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        String::from_utf8_lossy(&cmdline).contains(ours)
    };
    // Whether to leave it: it descends from a record, or from nothing of this host's.
    let descends_from_a_record = |pid: u32| {
        let (mut at, mut seen_ours) = (pid, false);
        for _ in 0..MAX_ANCESTRY {
            if proc_stat(at).is_some_and(|(start, _)| kept.contains(&(at, start))) || Some(at) == host {
                return true;
            }
            seen_ours |= names_ours(at);
            match uid_and_parent(at) {
                Some((_, parent)) if parent > 1 => at = parent,
                _ => return !seen_ours,
            }
        }
        true
    };
    let mut killed = Vec::new();
    for pid in pids {
        let Some((uid, _)) = uid_and_parent(pid) else { continue };
        let Some(owner) = uids.get(&uid).filter(|_| uid != 0 && uid != own) else { continue };
        if young(pid) || descends_from_a_record(pid) {
            continue;
        }
        let target = nix::unistd::Pid::from_raw(pid as i32);
        if nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGKILL).is_ok() {
            killed.push((owner.clone(), pid));
        }
    }
    killed
}

/// Live handles of children spawned by this host process, so they are reaped
/// and their exit status is known. Shared by every provider of the host.
#[derive(Default)]
pub struct LiveChildren {
    handles: Mutex<HashMap<(String, String), Child>>,
}

impl LiveChildren {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Child>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn insert(&self, provider: &str, name: &str, child: Child) {
        self.lock().insert((provider.to_owned(), name.to_owned()), child);
    }

    /// Collect the exit status of every child that has ended, so none stays a
    /// zombie; `std` keeps the status for later `liveness` calls.
    pub fn reap(&self) {
        for child in self.lock().values_mut() {
            let _ = child.try_wait();
        }
    }

    /// Kill every child still running (with its process group) and reap it.
    pub fn kill_all(&self) {
        for ((provider, name), child) in self.lock().iter_mut() {
            if let Ok(None) = child.try_wait() {
                tracing::warn!(provider, child = name, pid = child.id(), "killing a child left running");
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(child.id() as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                let _ = child.wait();
            }
        }
    }

    pub(crate) fn remove(&self, provider: &str, name: &str) {
        self.lock().remove(&(provider.to_owned(), name.to_owned()));
    }

    /// The child's state: from its handle if this process spawned it, else
    /// from `/proc`, matched by pid and start time.
    pub fn liveness(&self, record: &ChildRecord) -> Liveness {
        match self.program_liveness(record) {
            // The program is done, not what it left in its sandbox.
            Liveness::Running => Liveness::Running,
            _ if record.sandbox_lives() => Liveness::Running,
            done => done,
        }
    }

    fn program_liveness(&self, record: &ChildRecord) -> Liveness {
        use std::os::unix::process::ExitStatusExt;
        let key = (record.provider.clone(), record.name.clone());
        if let Some(child) = self.lock().get_mut(&key) {
            return match child.try_wait() {
                Ok(None) => Liveness::Running,
                Ok(Some(status)) => match (status.code(), status.signal()) {
                    (Some(code), _) => Liveness::Exited(code),
                    (None, Some(signal)) => Liveness::Signalled(signal),
                    (None, None) => Liveness::Gone,
                },
                Err(_) => Liveness::Gone,
            };
        }
        match proc_stat(record.pid) {
            Some((start, state)) if start == record.start_time && state != 'Z' && state != 'X' => Liveness::Running,
            _ => Liveness::Gone,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two programs as a sandbox user, one recorded (with a child of its
    /// own). The reaper kills the other, and nothing of another user. (As root
    /// only: it takes root to run as another user.)
    #[test]
    fn the_reaper_kills_a_sandbox_users_processes_that_descend_from_no_record() {
        use std::os::unix::process::CommandExt;
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root to run programs as a sandbox user");
            return;
        }
        const UID: u32 = 2_000_123_457;
        const OURS: &str = "/nonexistent/broker-reaper-test-data-dir";
        let spawn = |uid: u32, script: &str, data_dir: &str| {
            std::process::Command::new("setsid").args(["sh", "-c", script, data_dir]).uid(uid).spawn().unwrap()
        };
        // The recorded one's own child (as bubblewrap's program is) is kept with it.
        let (mut recorded, mut stray, mut others) =
            (spawn(UID, "sleep 60 & wait", OURS), spawn(UID, "sleep 60; :", OURS), spawn(UID + 1, "sleep 60; :", OURS));
        // Another host's (its command line names another data dir) is left alone.
        let mut another_hosts = spawn(UID, "sleep 60; :", "/nonexistent/another-host");
        let record = |child: &Child| ChildRecord {
            provider: "p".into(),
            name: "vm".into(),
            pid: child.id(),
            start_time: proc_stat(child.id()).unwrap().0,
            program: "sleep".into(),
            args: Vec::new(),
            log: String::new(),
            sandbox: None,
        };
        // Once the shell has its child, the recorded one has a descendant to keep.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let grandchild = || {
            let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", recorded.id()));
            children.ok().and_then(|c| c.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()))
        };
        let grandchild = loop {
            if let Some(pid) = grandchild().filter(|pid| uid_and_parent(*pid).is_some_and(|(uid, _)| uid == UID)) {
                break pid;
            }
            assert!(std::time::Instant::now() < until, "the recorded child never started its own");
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let uids = HashMap::from([(UID, "p".to_owned())]);
        // Its own children are what a running host spares (a `run` in progress): these are the test's.
        let spared_as_ours = reap_unrecorded(&uids, &[], OURS, std::time::Duration::ZERO, Some(std::process::id()));
        assert!(spared_as_ours.is_empty(), "{spared_as_ours:?}");
        let killed = reap_unrecorded(&uids, &[record(&recorded)], OURS, std::time::Duration::ZERO, None);
        // The stray and what it ran (its `sleep`), nothing else.
        assert!(killed.contains(&("p".to_owned(), stray.id())), "{killed:?}");
        let spared = [recorded.id(), others.id(), another_hosts.id(), grandchild];
        assert!(killed.iter().all(|(_, pid)| !spared.contains(pid)), "{killed:?} includes one of {spared:?}");
        assert!(stray.wait().unwrap().code().is_none(), "killed by a signal");
        assert!(proc_stat(grandchild).is_some_and(|(_, state)| state != 'Z'), "the recorded one's child was killed");
        for alive in [&mut recorded, &mut others, &mut another_hosts] {
            assert!(alive.try_wait().unwrap().is_none(), "{} was killed", alive.id());
        }
        // Only now: the recorded shell ends once its child does.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(grandchild as i32), nix::sys::signal::SIGKILL);
        for alive in [&mut recorded, &mut others, &mut another_hosts] {
            let _ = alive.kill();
            alive.wait().unwrap();
        }
    }

    /// The storage's own error stays reachable, typed.
    #[test]
    fn a_records_error_keeps_its_cause() {
        let err = RecordsError::new(std::io::Error::other("disk gone"));
        assert_eq!(err.to_string(), "child records: disk gone");
        assert!(err.cause().downcast_ref::<std::io::Error>().is_some(), "{:?}", err.cause());
        // Named once: in the message, not again as its source.
        assert!(std::error::Error::source(&err).is_none());
    }

    #[test]
    fn reaping_leaves_no_zombie_and_keeps_the_status() {
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let live = LiveChildren::default();
        live.insert("p", "quick", child);
        let record = ChildRecord {
            provider: "p".into(),
            name: "quick".into(),
            pid,
            start_time: 0,
            program: "true".into(),
            args: vec![],
            sandbox: None,
            log: String::new(),
        };
        for _ in 0..500 {
            live.reap();
            if proc_stat(pid).is_none() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(proc_stat(pid).is_none(), "the exited child was reaped, not left a zombie");
        assert_eq!(live.liveness(&record), Liveness::Exited(0));
    }

    #[test]
    fn proc_stat_reads_our_own_start_time() {
        let (start, state) = proc_stat(std::process::id()).unwrap();
        assert!(start > 0);
        assert!("RS".contains(state), "{state}");
        assert_eq!(proc_stat(std::process::id()).unwrap().0, start, "start time is stable");
    }
}
