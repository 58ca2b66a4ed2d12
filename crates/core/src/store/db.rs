//! The state file's redb handle, shared by the writer and every reader, and
//! its health.
//!
//! redb answers every transaction after one failed write, sync or read with
//! "previous I/O error" until the database is closed and opened again: a disk
//! that was full for a second would stop every write until a restart. So the
//! first such failure marks the store *faulted* (its cause kept: what clients
//! are told, not redb's "previous I/O error"); reads and writes are refused
//! with that cause while the writer closes the handle and opens the file
//! again, retrying until the fault clears ([`super::writer`]). A fault that
//! opening cannot get past (the file damaged) is *fatal*: the daemon exits
//! for its supervisor.

use super::{StoreError, WalError};
use redb::{Database, ReadTransaction, ReadableDatabase};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

/// The state file's handle while it serves; none while it is being reopened.
pub(crate) struct StateDb {
    current: RwLock<Option<Arc<Database>>>,
    fault: Mutex<Option<Fault>>,
    /// The write-ahead log refuses writes (it settles by itself): reads are served.
    log_fault: Mutex<Option<Fault>>,
    faults: AtomicU64,
    heals: AtomicU64,
}

/// Why the store refuses writes now.
#[derive(Debug, Clone)]
pub struct Fault {
    /// The first failure: the disk's own error (`No space left on device`).
    pub cause: FaultCause,
    /// When it began.
    pub since: SystemTime,
    /// Opening the file again failed for a reason waiting cannot mend.
    pub fatal: bool,
}

/// What failed first.
#[derive(Debug, Clone)]
pub enum FaultCause {
    /// The state file: reads and writes are refused until it is reopened.
    File(Arc<redb::Error>),
    /// The write-ahead log: writes are refused until it settles.
    Log(Arc<WalError>),
}

impl Fault {
    /// The operating system's word for it (`No space left on device (os
    /// error 28)`), without a path: what an unauthenticated `/healthz` may say.
    pub fn os_text(&self) -> String {
        match &self.cause {
            FaultCause::File(cause) => match &**cause {
                redb::Error::Io(io) => io.to_string(),
                other => other.to_string(),
            },
            FaultCause::Log(cause) => match &**cause {
                WalError::Io { cause, .. } => cause.to_string(),
                _ => "the write-ahead log failed".to_owned(),
            },
        }
    }

    /// What a refused write is answered with.
    pub fn refusal(&self) -> StoreError {
        match &self.cause {
            FaultCause::File(cause) => StoreError::Faulted(cause.clone()),
            FaultCause::Log(cause) => StoreError::Log(cause.clone()),
        }
    }
}

/// The store's health, for `/healthz` and the metrics.
#[derive(Debug, Clone)]
pub struct Health {
    /// The fault the store is in, if it is.
    pub fault: Option<Fault>,
    /// Faults so far (each one the store has had to reopen for).
    pub faults: u64,
    /// Faults that ended: a reopen of the file, a log that settled.
    pub heals: u64,
}

impl StateDb {
    pub(crate) fn new(db: Database) -> StateDb {
        StateDb {
            current: RwLock::new(Some(Arc::new(db))),
            fault: Mutex::default(),
            log_fault: Mutex::default(),
            faults: AtomicU64::new(0),
            heals: AtomicU64::new(0),
        }
    }

    fn fault_slot(&self) -> std::sync::MutexGuard<'_, Option<Fault>> {
        self.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn log_fault_slot(&self) -> std::sync::MutexGuard<'_, Option<Fault>> {
        self.log_fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A read transaction, unless the store is faulted.
    pub(crate) fn begin_read(&self) -> Result<ReadTransaction, StoreError> {
        let db = self.handle()?;
        db.begin_read().map_err(|e| self.failed(e.into()))
    }

    /// The handle, unless the store is faulted (the writer's, for a batch).
    pub(crate) fn handle(&self) -> Result<Arc<Database>, StoreError> {
        if let Some(fault) = self.fault_slot().as_ref() {
            return Err(fault.refusal());
        }
        let current = self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        current.clone().ok_or(StoreError::Closed)
    }

    /// `error`, as the caller should see it: a failure of the file's I/O
    /// faults the store (the first one is the cause every refusal names until
    /// it heals); any other is a database error as ever.
    pub(crate) fn failed(&self, error: redb::Error) -> StoreError {
        match is_io_failure(&error) {
            true => self.faulted_by(Arc::new(error)),
            false => StoreError::Db(Arc::new(error)),
        }
    }

    /// The refusal once `cause`, an I/O failure, has faulted the store (the
    /// first such cause is kept).
    fn faulted_by(&self, cause: Arc<redb::Error>) -> StoreError {
        let mut slot = self.fault_slot();
        if let Some(fault) = slot.as_ref() {
            return fault.refusal();
        }
        tracing::error!(error = %cause, "the state file failed; writes are refused until it is reopened");
        self.faults.fetch_add(1, Ordering::Relaxed);
        *slot = Some(Fault { cause: FaultCause::File(cause.clone()), since: SystemTime::now(), fatal: false });
        StoreError::Faulted(cause)
    }

    /// The log refused a batch: the store is faulted (for `/healthz`) until
    /// a batch is logged again. The first refusal is the cause shown.
    pub(crate) fn log_failed(&self, cause: &Arc<WalError>) {
        let mut slot = self.log_fault_slot();
        if slot.is_none() {
            tracing::error!(error = %cause, "the write-ahead log failed; writes are refused until it settles");
            self.faults.fetch_add(1, Ordering::Relaxed);
            *slot = Some(Fault { cause: FaultCause::Log(cause.clone()), since: SystemTime::now(), fatal: false });
        }
    }

    /// A batch was logged and committed: a log fault is over.
    pub(crate) fn log_settled(&self) {
        if let Some(fault) = self.log_fault_slot().take() {
            let lasted = fault.since.elapsed().unwrap_or_default();
            tracing::info!(lasted_ms = lasted.as_millis() as u64, "the write-ahead log takes writes again");
            self.heals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// As [`StateDb::failed`] for an error already a [`StoreError`].
    pub(crate) fn noted(&self, error: StoreError) -> StoreError {
        match error {
            StoreError::Db(cause) if is_io_failure(&cause) => self.faulted_by(cause),
            other => other,
        }
    }

    pub(crate) fn is_faulted(&self) -> bool {
        self.fault_slot().is_some()
    }

    /// Let go of the handle (readers that hold it finish with it); the
    /// writer opens the file again.
    pub(crate) fn close(&self) {
        let taken = self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        drop(taken);
    }

    /// Serve `db` again: the fault is over.
    pub(crate) fn healed(&self, db: Database) {
        *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(db));
        if let Some(fault) = self.fault_slot().take() {
            let lasted = fault.since.elapsed().unwrap_or_default();
            tracing::info!(cause = %fault.refusal(), lasted_ms = lasted.as_millis() as u64, "the state file is reopened; writes are served again");
            self.heals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Opening again failed for a reason that waiting will not mend.
    pub(crate) fn fatal(&self, why: &StoreError) {
        let mut slot = self.fault_slot();
        tracing::error!(error = %why, "the state file cannot be reopened");
        let cause = Arc::new(redb::Error::Io(std::io::Error::other(why.to_string())));
        let since = slot.as_ref().map_or_else(SystemTime::now, |f| f.since);
        *slot = Some(Fault { cause: FaultCause::File(cause), since, fatal: true });
    }

    pub(crate) fn health(&self) -> Health {
        Health {
            fault: self.fault_slot().clone().or_else(|| self.log_fault_slot().clone()),
            faults: self.faults.load(Ordering::Relaxed),
            heals: self.heals.load(Ordering::Relaxed),
        }
    }
}

/// redb's own word that its handle is spent: an I/O error, or one before it.
pub(crate) fn is_io_failure(error: &redb::Error) -> bool {
    matches!(error, redb::Error::Io(_) | redb::Error::PreviousIo)
}
