//! `broker:provider/machine-lock`: the machine lock for guests. The lock
//! itself ([`MachineLock`]) is a host facility ([`crate::machine_lock`]),
//! which the host and `broker lock` use too.

pub use crate::machine_lock::{LockError, LockGuard, MachineLock, Spec};

mod host;
pub mod kit;

use crate::bindings::broker::provider::machine_lock::{self as wit};
use crate::rooms::HasRooms;
use crate::rooms::view::{View, ViewOf};
use crate::rooms::{Linking, Room, StoreSetup};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use wasmtime::component::{Linker, Resource, ResourceTable};

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "machine-lock";

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
    denials: crate::rooms::denials::Denials,
}

impl MachineLockCtx {
    /// `lock` is `None` when the manifest does not grant `machine-lock`.
    pub fn new(lock: Option<MachineLock>, denials: crate::rooms::denials::Denials) -> Self {
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

pub(crate) type MachineLockView<'a> = View<'a, MachineLockCtx>;

/// The room: `machine-lock = true` under `[grants]`. Its backend is the
/// host's one lock, which only the host (or the kit, its own) can inject.
pub struct MachineLockRoom;

impl Room for MachineLockRoom {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "machine-lock";
    const LINKING: Linking = Linking::Always;
    const KIT: Option<&'static dyn crate::rooms::kit::KitPart> = Some(&kit::MachineLockKit);
    type Grant = bool;
    type Backend = MachineLock;
    type Ctx = MachineLockCtx;
    type Prepared = ();

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

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state: &mut T| {
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

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> MachineLockView<'_>,
) -> wasmtime::Result<()> {
    // The same in every contract version served: linked under each one's name.
    for instance in crate::bindings::served_instances(INTERFACE) {
        wit::add_to_linker_instance::<T, ViewOf<MachineLockCtx>>(&mut linker.instance(&instance)?, getter)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::BrokerError;
    use crate::bindings::broker::provider::machine_lock::{Host, HostLockGuard};
    use crate::machine_lock::tests::{lock, spec};
    use crate::machine_lock::{MAX_COMMENT_BYTES, MAX_WORKER_BYTES};

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
