//! `broker:provider/machine-lock`: the machine lock for guests, and the lock
//! itself ([`MachineLock`]), which the host and `broker lock` use too.

mod history;
mod lock;

pub use history::go_duration;
pub use lock::{LockError, LockGuard, MAX_COMMENT_BYTES, MAX_WORKER_BYTES, MachineLock, Party, Report, Spec};

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::machine_lock::{self as wit};
use crate::capabilities::view::{View, ViewOf};
use crate::runtime::HostState;
use crate::runtime::rooms::{Linking, Room, StoreSetup};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use wasmtime::component::{Linker, Resource, ResourceTable};

/// Its interface in the contract package.
pub const INTERFACE: &str = "machine-lock";

/// The host object behind a guest's `lock-guard`.
pub struct HeldLock(LockGuard);

/// Per-store context: the lock if granted, and the guards handed out, so the
/// host can release whatever a guest still holds when its call ends. The
/// default holds no lock and refuses.
#[derive(Default)]
pub struct MachineLockCtx {
    lock: Option<MachineLock>,
    abort: Arc<AtomicBool>,
    handed_out: Vec<u32>,
    denials: crate::capabilities::denials::Denials,
}

impl MachineLockCtx {
    /// `lock` is `None` when the manifest does not grant `machine-lock`.
    pub fn new(lock: Option<MachineLock>, denials: crate::capabilities::denials::Denials) -> Self {
        MachineLockCtx { lock, abort: Arc::default(), handed_out: Vec::new(), denials }
    }

    /// Whether a lock is there to take (granted, and one was given).
    pub fn granted(&self) -> bool {
        self.lock.is_some()
    }

    /// The abort flag of the call about to run.
    pub fn begin_call(&mut self, abort: Arc<AtomicBool>) {
        self.abort = abort;
    }

    /// Release every guard the guest still holds; the handles it keeps go inert.
    pub fn end_call(&mut self, table: &mut ResourceTable) {
        for rep in self.handed_out.drain(..) {
            if let Ok(held) = table.get_mut(&Resource::<HeldLock>::new_own(rep)) {
                held.0.release();
            }
        }
    }
}

pub type MachineLockView<'a> = View<'a, MachineLockCtx>;

fn to_broker_error(err: LockError) -> BrokerError {
    match err {
        LockError::Timeout => BrokerError::Timeout(err.to_string()),
        LockError::Cancelled => BrokerError::Aborted(err.to_string()),
        LockError::InvalidSpec(_) => BrokerError::InvalidParams(err.to_string()),
        LockError::Io { .. } => BrokerError::Provider(err.to_string()),
    }
}

impl wit::Host for MachineLockView<'_> {
    async fn acquire(
        &mut self,
        worker: String,
        comment: String,
        timeout_ms: u64,
    ) -> wasmtime::Result<Result<Resource<HeldLock>, BrokerError>> {
        let Some(lock) = self.ctx.lock.clone() else {
            let refusal = BrokerError::AccessDenied(
                "machine-lock is not granted: add `machine-lock = true` under [grants]".into(),
            );
            return Ok(Err(self.ctx.denials.refuse("machine-lock", refusal)));
        };
        let spec = Spec {
            worker,
            comment,
            timeout: (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)),
            abort: Some(self.ctx.abort.clone()),
        };
        match lock.acquire(spec).await {
            Ok(guard) => {
                let handle = self.table.push(HeldLock(guard))?;
                self.ctx.handed_out.push(handle.rep());
                Ok(Ok(handle))
            }
            Err(e) => Ok(Err(to_broker_error(e))),
        }
    }
}

impl wit::HostLockGuard for MachineLockView<'_> {
    async fn release(&mut self, handle: Resource<HeldLock>) -> wasmtime::Result<()> {
        self.table.get_mut(&handle)?.0.release();
        Ok(())
    }

    async fn drop(&mut self, handle: Resource<HeldLock>) -> wasmtime::Result<()> {
        let rep = handle.rep();
        self.ctx.handed_out.retain(|r| *r != rep);
        // Dropping the guard releases the lock.
        self.table.delete(handle)?;
        Ok(())
    }
}

/// The room: `machine-lock = true` under `[grants]`. Its backend is the
/// host's one lock, which only the host (or the kit, its own) can inject.
pub struct MachineLockRoom;

impl Room for MachineLockRoom {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "machine-lock";
    const LINKING: Linking = Linking::Always;
    type Grant = bool;
    type Backend = MachineLock;
    type Ctx = MachineLockCtx;

    fn host_backend() -> Option<Arc<MachineLock>> {
        None
    }

    fn acts_outside_the_store(_: &bool) -> bool {
        // Waiting on a lock changes nothing outside; what a provider does
        // while holding it is under the grants that do.
        false
    }

    fn ctx(grant: &bool, lock: Option<Arc<MachineLock>>, store: &StoreSetup<'_>) -> MachineLockCtx {
        let lock = lock.filter(|_| *grant).map(|lock| MachineLock::clone(&lock));
        MachineLockCtx::new(lock, store.denials.clone())
    }

    fn add_to_linker(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state| {
            let (ctx, table) = state.room::<MachineLockRoom>();
            MachineLockView { ctx, table }
        })
    }

    fn begin_call(ctx: &mut MachineLockCtx, abort: &Arc<AtomicBool>) {
        ctx.begin_call(abort.clone());
    }

    fn end_call(ctx: &mut MachineLockCtx, table: &mut ResourceTable) {
        ctx.end_call(table);
    }
}

pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> MachineLockView<'_>,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, ViewOf<MachineLockCtx>>(linker, getter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::broker::provider::machine_lock::{Host, HostLockGuard};
    use std::sync::atomic::Ordering;

    fn lock(dir: &std::path::Path) -> MachineLock {
        MachineLock::new(dir, "machine-lock", "test-agent").unwrap()
    }

    /// A lock that cannot be made says where, and keeps the OS error typed.
    #[test]
    fn a_lock_in_a_file_is_refused_with_its_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, "").unwrap();
        let Err(err) = MachineLock::new(&file, "machine-lock", "test-agent") else { panic!("a lock inside a file") };
        assert!(matches!(&err, LockError::Io { path, .. } if path.starts_with(&*file.to_string_lossy())), "{err}");
        let source = std::error::Error::source(&err).expect("a source");
        assert!(source.downcast_ref::<std::io::Error>().is_some(), "{source:?}");
    }

    fn spec(worker: &str, timeout: Option<Duration>) -> Spec {
        Spec { worker: worker.into(), comment: "testing".into(), timeout, abort: None }
    }

    #[tokio::test]
    async fn waiters_are_served_in_arrival_order() {
        let dir = tempfile::tempdir().unwrap();
        let lock = lock(dir.path());
        let first = lock.acquire(spec("first", None)).await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for name in ["a", "b", "c", "d"] {
            let (waiter, order) = (lock.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _guard = waiter.acquire(spec(name, None)).await.unwrap();
                order.lock().unwrap().push(name);
                tokio::task::yield_now().await;
            }));
            // Each waiter is queued before the next one arrives.
            while lock.report(0).waiting.len() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(lock.report(0).holder.unwrap().worker, "first");
        drop(first);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["a", "b", "c", "d"]);
    }

    #[tokio::test]
    async fn timeout_and_abort_give_jujus_errors_and_pass_the_turn_on() {
        let dir = tempfile::tempdir().unwrap();
        let lock = lock(dir.path());
        let mut held = lock.acquire(spec("holder", None)).await.unwrap();
        let err = lock.acquire(spec("impatient", Some(Duration::from_millis(30)))).await.err().unwrap();
        assert_eq!(err.to_string(), "timeout acquiring mutex");

        let abort = Arc::new(AtomicBool::new(false));
        let aborting = {
            let lock = lock.clone();
            let abort = abort.clone();
            tokio::spawn(async move { lock.acquire(Spec { abort: Some(abort), ..spec("aborter", None) }).await.err() })
        };
        abort.store(true, Ordering::SeqCst);
        assert_eq!(aborting.await.unwrap().unwrap().to_string(), "cancelled acquiring mutex");
        assert!(lock.report(0).waiting.is_empty(), "waiters that gave up left the queue");

        held.release();
        held.release(); // idempotent
        let again = lock.acquire(spec("next", Some(Duration::from_millis(500)))).await;
        assert!(again.is_ok(), "the turn passed on to a new waiter");
    }

    #[tokio::test]
    async fn release_writes_history_and_the_report_shows_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let lock = lock(dir.path());
        let guard = lock.acquire(spec("uniter", None)).await.unwrap();
        let report = lock.report(10);
        assert_eq!(report.holder.as_ref().map(Party::label).as_deref(), Some("uniter (testing)"));
        assert!(report.text().contains("holder: uniter (testing), holding 0s"), "{}", report.text());
        drop(guard);
        let report = lock.report(10);
        assert!(report.text().contains("holder: none"), "{}", report.text());
        assert_eq!(report.history.len(), 1);
        assert!(
            report.history[0].ends_with(" test-agent: uniter (testing), waited 0s, held 0s"),
            "{:?}",
            report.history
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(lock.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn lock_names_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        assert!(MachineLock::new(dir.path(), "machine-lock-net", "a").is_ok());
        assert!(MachineLock::new(dir.path(), "other", "a").is_err());
        assert!(MachineLock::new(dir.path(), "machine-lock-../x", "a").is_err());
    }

    #[tokio::test]
    async fn worker_and_comment_are_checked_at_the_boundary_and_never_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let shared = lock(dir.path());
        let mut table = ResourceTable::new();
        let mut granted = MachineLockCtx::new(Some(shared.clone()), Default::default());
        let mut view = MachineLockView { ctx: &mut granted, table: &mut table };
        let forged = "uniter\n2023-11-14 22:13:20 broker: root (forged)";
        let cases: [(String, String, &str); 7] = [
            (forged.into(), String::new(), "worker must be printable: it has the control character U+000A at byte 6"),
            ("w".into(), "\x1b[2J".into(), "comment must be printable: it has the control character U+001B at byte 0"),
            ("w\x7f".into(), String::new(), "worker must be printable: it has the control character U+007F"),
            ("w".into(), "c1 \u{9b}31m".into(), "comment must be printable: it has the control character U+009B"),
            ("w".into(), "a\u{202e}b".into(), "comment must be printable: it has the control character U+202E"),
            ("w".repeat(MAX_WORKER_BYTES + 1), String::new(), "worker is 65 bytes long; at most 64 are allowed"),
            ("w".into(), "c".repeat(2 << 20), "comment is 2097152 bytes long; at most 256 are allowed"),
        ];
        for (worker, comment, rule) in cases {
            match view.acquire(worker.clone(), comment, 0).await.unwrap() {
                Err(BrokerError::InvalidParams(m)) => assert!(m.contains(rule), "{worker:?}: {m}"),
                Err(other) => panic!("{worker:?}: {other:?}"),
                Ok(_) => panic!("{worker:?} was taken"),
            }
        }
        assert!(shared.report(0).holder.is_none() && shared.report(0).waiting.is_empty());
        assert!(!dir.path().join("machine-lock.log").exists(), "a refused spec writes no history");

        // At the caps, printable text (not only ASCII) is taken and logged whole.
        let (worker, comment) = ("w".repeat(MAX_WORKER_BYTES), "é".repeat(MAX_COMMENT_BYTES / 2));
        let handle = view.acquire(worker.clone(), comment.clone(), 0).await.unwrap().unwrap();
        view.release(handle).await.unwrap();
        let log = std::fs::read_to_string(dir.path().join("machine-lock.log")).unwrap();
        assert_eq!(log.lines().count(), 1, "{log}");
        assert!(log.contains(&format!(" test-agent: {worker} ({comment}), waited")), "{log}");

        // `broker lock run` and the host go through the same check.
        let err = shared.acquire(spec("a\rb", None)).await.err().unwrap();
        assert!(matches!(&err, LockError::InvalidSpec(m) if m.contains("worker must be printable")), "{err}");
    }

    #[test]
    fn the_report_escapes_what_other_processes_wrote() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let party = |worker: &str| Party {
            agent: "agent\x1b[2J".into(),
            pid: 1,
            worker: worker.into(),
            comment: "c\nforged".into(),
            since: now,
        };
        let report = Report {
            name: "machine-lock".into(),
            holder: Some(party("holder")),
            waiting: vec![party("waiter")],
            history: vec!["old \x1b]0;title\x07 line".into()],
        };
        let text = report.text();
        assert!(!text.contains('\x1b') && !text.contains('\x07'), "{text:?}");
        assert!(text.contains("holder (c\\nforged)") && text.contains("agent\\x1b[2J pid 1"), "{text}");
        assert!(text.contains("old \\x1b]0;title\\x07 line"), "{text}");
        assert_eq!(text.lines().count(), 6, "{text}");
    }

    #[tokio::test]
    async fn guests_without_the_grant_get_access_denied_and_leaked_guards_are_released() {
        let dir = tempfile::tempdir().unwrap();
        let mut table = ResourceTable::new();
        let mut ungranted = MachineLockCtx::new(None, Default::default());
        let mut view = MachineLockView { ctx: &mut ungranted, table: &mut table };
        let denied = view.acquire("w".into(), String::new(), 0).await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("machine-lock = true")));

        let shared = lock(dir.path());
        let mut granted = MachineLockCtx::new(Some(shared.clone()), Default::default());
        let mut view = MachineLockView { ctx: &mut granted, table: &mut table };
        let handle = view.acquire("guest".into(), String::new(), 0).await.unwrap().unwrap();
        assert!(shared.report(0).holder.is_some());
        // The guest "forgets" its guard; the end of the call releases it anyway.
        let _kept = Resource::<HeldLock>::new_own(handle.rep());
        granted.end_call(&mut table);
        assert!(shared.report(0).holder.is_none());
        let mut view = MachineLockView { ctx: &mut granted, table: &mut table };
        view.release(Resource::new_own(handle.rep())).await.unwrap(); // inert, no error
    }
}
