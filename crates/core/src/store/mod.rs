//! The host's embedded state, in one redb file in the data dir: registered
//! providers, instance records, and every provider's kv namespace.
//!
//! redb is ACID with copy-on-write pages and a checksummed commit, so a crash
//! mid-write leaves the previous committed state; it is pure Rust (no C
//! toolchain), and one file per host is all the host needs. Beside it,
//! `state.wal` makes each batch of writes durable with one small append
//! ([`wal`]); redb's own sync runs only at checkpoints.

mod counts;
mod db;
mod devices;
mod events;
mod groups;
mod kv;
pub mod records;
pub mod salvage;
mod sandbox_users;
mod starts;
mod wal;
mod writer;

pub use counts::{AtBound, RecordCounts, StartSlot};
pub use db::{Fault, FaultCause, Health};
pub use events::{Event, EventKind};
pub use groups::GroupRecord;
pub use starts::PendingStart;
pub(crate) use starts::StopMark;

pub use kv::MIRROR_BUDGET_BYTES;
pub use kv::{MirrorStats, RedbKv};
pub use records::ObservedNetwork;
pub use records::{InstanceRecord, ProviderRecord};
pub(crate) use wal::Txn;
pub use wal::WalError;
pub use writer::Pending;

use broker_capabilities::network::Device;
use broker_capabilities::rooms::kv::KvWrites;
use broker_capabilities::rooms::process::{ChildRecord, ChildRecords, RecordsError};
use db::StateDb;
use futures_util::future::BoxFuture;
use redb::{Database, ReadableTable, TableDefinition};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const PROVIDERS: TableDefinition<&str, &[u8]> = TableDefinition::new("providers");
/// Key: (provider, instance id).
const INSTANCES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("instances");
/// Key: (provider, instance id): the params an instance was started with,
/// apart from its record: only `maintain-instance` reads them, one at a time,
/// and they are most of a record's bytes, which a listing reads by the
/// thousand. (Records written before this table hold theirs inline.)
const INSTANCE_PARAMS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("instance_params");
/// Instance id -> the provider it is recorded for: ids are the host's, one owner each.
const INSTANCE_IDS: TableDefinition<&str, &str> = TableDefinition::new("instance_ids");
/// Key: (provider namespace, key).
const KV: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("kv");
/// The host's network as HostPreparer last observed it; one key, `host`.
const OBSERVED_NETWORK: TableDefinition<&str, &[u8]> = TableDefinition::new("observed_network");
/// Key: (provider, child name).
const CHILDREN: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("children");

/// What the state file says of itself, by name: [`FORMAT_KEY`] only, so far.
/// Its name and types never change, whatever the format: every broker,
/// older and newer, must be able to read the format to refuse it.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// The key in [`META`] of the state's format.
const FORMAT_KEY: &str = "format";
/// The layout of the state (its tables, its records' encoding) this host
/// writes, and the newest it reads. A host that changes the layout raises
/// it; an older host then refuses the file, naming both, instead of reading
/// records it does not know as corrupt (and `store recover` dropping them).
/// A file made before the format was recorded is format 1.
pub const STATE_FORMAT: u64 = 1;
/// Formats are counted one by one: one past this is damage, not a newer
/// broker's file (and `store recover` leaves it out).
const NO_BROKER_WRITES_FORMATS_PAST: u64 = 1 << 16;

/// Most instance config tags a record keeps once labelled (`Instance.Label`).
pub(crate) const MAX_INSTANCE_TAGS: usize = 128;

/// Why the state database could not be opened, read or written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The state file or its directory could not be created or opened.
    #[error("state database {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Open {
        /// `state.redb` in the data dir.
        path: String,
        /// redb's error.
        cause: Arc<redb::Error>,
    },
    /// The data dir may be written by others than its owner: whoever can
    /// write it can replace the state, the machine lock or a provider's data dir.
    #[error(
        "data dir {path} is writable by its group or by every user (mode {mode:o}): it holds every provider's state and data dirs; make it the host's alone (chmod go-w {path})"
    )]
    Exposed {
        /// The data dir.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A read, write or commit failed.
    #[error("state database: {}", broker_capabilities::error_text::cause_text(&**.0))]
    Db(Arc<redb::Error>),
    /// A record could not be serialized; nothing was written.
    #[error("cannot encode a {what} record: {}", broker_capabilities::error_text::cause_text(.cause))]
    Encode {
        /// The kind of record (`provider`, `instance`, …).
        what: &'static str,
        /// serde_json's error.
        cause: Arc<serde_json::Error>,
    },
    /// A stored record does not decode.
    #[error("state database holds a corrupt {what} record: {}", broker_capabilities::error_text::cause_text(.cause))]
    Corrupt {
        /// The kind of record (`provider`, `instance`, …).
        what: &'static str,
        /// serde_json's error.
        cause: Arc<serde_json::Error>,
    },
    /// The write-ahead log could not be opened, replayed or appended to.
    #[error(transparent)]
    Log(Arc<WalError>),
    /// A write that panicked fails alone; the writer serves on.
    #[error("state database: a write panicked while it was applied")]
    WritePanicked,
    /// A read that panicked (redb panics on some damage) fails alone.
    #[error("state database: a read panicked (the file may be damaged: `broker store check` shows what can be read)")]
    ReadPanicked,
    /// The state file failed (the disk full, read-only, failing): reads and
    /// writes are refused with the first failure until the writer has opened
    /// it again, which it tries until the fault clears.
    #[error(
        "state database: the state file failed ({}); reads and writes are refused until it is reopened, which is tried every second",
        broker_capabilities::error_text::cause_text(&**.0)
    )]
    Faulted(Arc<redb::Error>),
    /// The writer has stopped; nothing more can be written.
    #[error("state database is closed")]
    Closed,
    /// Another process (the daemon, or another broker command) holds the state file.
    #[error("state database {path} is open in another process (a running `broker serve`?): stop it first")]
    Busy {
        /// `state.redb`.
        path: String,
    },
    /// The state file is empty: opening it would silently start a new store.
    #[error(
        "state database {path} is empty (0 bytes): it holds no broker state, and opening it would start an empty one in its place. Put the real state file back, or delete this one to start afresh"
    )]
    Empty {
        /// `state.redb`.
        path: String,
    },
    /// The state file is damaged past what redb can open or read.
    #[error(
        "state database {path} is damaged: {reason}. `broker store check` shows what can be read; `broker store recover` makes a new state file of it (keeping the damaged one)"
    )]
    Damaged {
        /// `state.redb`.
        path: String,
        /// What failed.
        reason: String,
    },
    /// The state file is of a format newer than this host reads: a newer
    /// broker made it. No record was read or changed.
    #[error(
        "state database {path} is of state format {format}, made by a newer broker; this one reads formats up to {STATE_FORMAT}: run the newer broker on it (no record was read or changed)"
    )]
    Newer {
        /// `state.redb`.
        path: String,
        /// The format the file says it is.
        format: u64,
    },
    /// A recovered store could not be written.
    #[error("cannot write the recovered state database {path}: {reason}")]
    Salvage {
        /// The new file.
        path: String,
        /// What failed.
        reason: String,
    },
}

// Causes are shared (`Arc`): one failed commit answers every write in its batch.
fn db_error(err: impl Into<redb::Error>) -> StoreError {
    StoreError::Db(Arc::new(err.into()))
}

/// A record as JSON, or why it cannot be (kept until a write needs it).
fn encoded(what: &'static str, value: &impl serde::Serialize) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|e| StoreError::Encode { what, cause: Arc::new(e) })
}

/// The state file's page cache in the daemon's memory (redb's default is 1
/// GiB): reads of kv are answered from each namespace's mirror, so the cache
/// only has to keep what the writer and the records touch.
const STATE_CACHE_BYTES: usize = 64 << 20;

/// The host's state: `state.redb` in the data dir and its write-ahead log;
/// every write goes through one writer thread.
pub struct Store {
    db: Arc<StateDb>,
    /// Every write goes through it: one thread, concurrent writes in one commit.
    /// It stops (after committing what is queued) when its last handle goes:
    /// the store's, the kv's or a child-records handle.
    writer: Arc<writer::Writer>,
    kv: Arc<RedbKv>,
    data_dir: PathBuf,
    /// This opening's number: entries of [`starts`] that carry another are an earlier process's.
    session: u64,
    /// Pending starts this session has keyed.
    starts_made: std::sync::atomic::AtomicU64,
    /// Records per provider, and its starts under way.
    counts: Arc<RecordCounts>,
}

impl Store {
    /// Open (or create) the state file and its write-ahead log, applying what
    /// the log holds beyond the file's last checkpoint; the data dir is
    /// created if missing.
    ///
    /// A state file that is empty, not a regular file, or damaged past what
    /// redb opens is refused with what to do; redb panicking on a damaged file
    /// is one of those refusals, not a crash.
    pub fn open(data_dir: &Path) -> Result<Store, StoreError> {
        Self::open_checked(data_dir, wal::Checkpoints::default())
    }

    fn open_checked(data_dir: &Path, checkpoints: wal::Checkpoints) -> Result<Store, StoreError> {
        let path = state_file(data_dir);
        let shown = || path.display().to_string();
        match std::fs::metadata(&path) {
            Ok(metadata) if !metadata.is_file() => {
                let reason = "not a regular file".to_owned();
                return Err(StoreError::Damaged { path: shown(), reason });
            }
            // Empty, unless another process is making it this moment (it holds its lock).
            Ok(metadata) if metadata.len() == 0 => {
                return Err(match held_by_another(&path) {
                    true => StoreError::Busy { path: shown() },
                    false => StoreError::Empty { path: shown() },
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && data_dir.join("state.wal").exists() => {
                // The log is made after the state file: the state file was moved or deleted.
                let reason = "it is missing, but its write-ahead log state.wal is here: the state file was moved or deleted (put it back, or `broker store recover` if a damaged copy is all there is)".to_owned();
                return Err(StoreError::Damaged { path: shown(), reason });
            }
            _ => {}
        }
        let opened = salvage::caught(|| Self::open_with(data_dir, checkpoints));
        match opened {
            Ok(Err(StoreError::Open { cause: source, .. } | StoreError::Db(source)))
                if matches!(
                    &*source,
                    redb::Error::Corrupted(_)
                        | redb::Error::TypeDefinitionChanged { .. }
                        | redb::Error::TableTypeMismatch { .. }
                ) || matches!(&*source, redb::Error::Io(e) if e.kind() == std::io::ErrorKind::InvalidData) =>
            {
                Err(StoreError::Damaged { path: shown(), reason: source.to_string() })
            }
            Ok(Err(StoreError::Open { cause: source, .. } | StoreError::Db(source)))
                if matches!(&*source, redb::Error::DatabaseAlreadyOpen) =>
            {
                Err(StoreError::Busy { path: shown() })
            }
            // Whatever else failed in opening it, the error names the file.
            Ok(Err(StoreError::Db(source))) => Err(StoreError::Open { path: shown(), cause: source }),
            Ok(opened) => opened,
            Err(payload) => {
                let reason = format!("redb panicked reading it: {}", salvage::panic_text(&*payload));
                Err(StoreError::Damaged { path: shown(), reason })
            }
        }
    }

    fn open_with(data_dir: &Path, checkpoints: wal::Checkpoints) -> Result<Store, StoreError> {
        let open_error = |source: redb::Error| StoreError::Open {
            path: state_file(data_dir).display().to_string(),
            cause: Arc::new(source),
        };
        let log_error = |error: WalError| StoreError::Log(Arc::new(error));
        // The state holds every provider's kv (their secrets too): the host's alone.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(data_dir)
            .map_err(|e| open_error(redb::Error::Io(e)))?;
        check_not_exposed(data_dir)?;
        salvage::remove_check_copies(data_dir);
        // A newer broker's file is refused unwritten: opening it to write
        // rewrites its header, and closing it commits. (One not closed
        // cleanly cannot be read without the repair the open makes: it is
        // refused after that, its records unread and unchanged.)
        refuse_newer_read_only(&state_file(data_dir))?;
        let db = open_database(data_dir).map_err(|e| open_error(e.into()))?;
        // Before the log: a newer host's log may hold what this one cannot apply.
        refuse_newer(&db, &state_file(data_dir))?;
        let mut wal = wal::Wal::open(&data_dir.join("state.wal"), checkpoints).map_err(log_error)?;
        let txn = db.begin_write().map_err(db_error)?;
        let replayed = wal.replay(|table, key, value| replay_change(&txn, table, key, value)).map_err(log_error)?;
        txn.open_table(PROVIDERS).map_err(db_error)?;
        txn.open_table(INSTANCES).map_err(db_error)?;
        txn.open_table(INSTANCE_PARAMS).map_err(db_error)?;
        txn.open_table(groups::GROUPS).map_err(db_error)?;
        txn.open_table(KV).map_err(db_error)?;
        txn.open_table(CHILDREN).map_err(db_error)?;
        txn.open_table(OBSERVED_NETWORK).map_err(db_error)?;
        txn.open_table(events::EVENTS).map_err(db_error)?;
        txn.open_table(starts::STARTS).map_err(db_error)?;
        txn.open_table(starts::STOPPING).map_err(db_error)?;
        txn.open_table(sandbox_users::SANDBOX_USERS).map_err(db_error)?;
        txn.open_table(sandbox_users::SANDBOX_SHARED).map_err(db_error)?;
        txn.open_table(devices::DEVICE_OWNERS).map_err(db_error)?;
        let mut meta = txn.open_table(META).map_err(db_error)?;
        if meta.get(FORMAT_KEY).map_err(db_error)?.is_none() {
            meta.insert(FORMAT_KEY, STATE_FORMAT).map_err(db_error)?;
        }
        drop(meta);
        let counts = Arc::new(RecordCounts::new(index_instance_ids(&txn)?));
        txn.commit().map_err(db_error)?;
        if replayed > 0 {
            tracing::info!(frames = replayed, "applied the writes the log held beyond the last checkpoint");
        }
        // What was replayed is in the state file now.
        wal.restart().map_err(StoreError::Log)?;
        for file in ["state.redb", "state.wal"] {
            use std::os::unix::fs::PermissionsExt;
            let private = std::fs::Permissions::from_mode(0o600);
            if let Err(error) = std::fs::set_permissions(data_dir.join(file), private) {
                tracing::warn!(file, %error, "cannot make the state file private to its owner");
            }
        }
        let db = Arc::new(StateDb::new(db));
        let writer = Arc::new(
            writer::Writer::start(db.clone(), data_dir.to_owned(), wal).map_err(|e| open_error(redb::Error::Io(e)))?,
        );
        let kv = Arc::new(RedbKv::new(db.clone(), writer.clone()));
        // Random, so no two openings share one, whatever the clock did.
        let session = getrandom::u64().map_err(|e| open_error(redb::Error::Io(std::io::Error::other(e))))?;
        let starts_made = std::sync::atomic::AtomicU64::new(0);
        Ok(Store { kv, writer, db, data_dir: data_dir.to_owned(), session, starts_made, counts })
    }

    /// A write through the store's writer (see [`Pending`]).
    fn write<R, F>(&self, op: F) -> Pending<R>
    where
        R: Send + 'static,
        F: FnMut(&Txn<'_>) -> Result<R, StoreError> + Send + 'static,
    {
        Pending::new(&self.writer, op)
    }

    /// How many instances each provider has recorded, and its starts under way.
    pub fn record_counts(&self) -> &Arc<RecordCounts> {
        &self.counts
    }

    /// Whether the state file serves, and its faults so far.
    pub fn health(&self) -> Health {
        self.db.health()
    }

    /// The host's data dir, where `state.redb` and `state.wal` are.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Record the host network HostPreparer observed after bridging.
    pub(crate) fn put_observed_network(&self, devices: &[Device]) -> Pending<()> {
        let record = ObservedNetwork { observed: records::now_rfc3339(), devices: devices.to_vec() };
        let bytes = encoded("observed network", &record);
        self.write(move |txn| {
            let bytes = bytes.as_ref().map_err(Clone::clone)?;
            txn.open_table(OBSERVED_NETWORK).map_err(db_error)?.insert("host", bytes.as_slice()).map_err(db_error)?;
            Ok(())
        })
    }

    /// The host network as last recorded (`None`: never observed).
    pub fn observed_network(&self) -> Result<Option<ObservedNetwork>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(OBSERVED_NETWORK).map_err(db_error)?;
        let value = table.get("host").map_err(db_error)?;
        value.map(|v| decode("observed network", v.value())).transpose()
    }

    /// The records of providers' long-running children.
    pub fn child_records(&self) -> Arc<dyn ChildRecords> {
        Arc::new(RedbChildren { db: self.db.clone(), writer: self.writer.clone() })
    }

    /// The kv backend behind every provider's namespace.
    pub fn kv(&self) -> Arc<RedbKv> {
        self.kv.clone()
    }

    /// Register (or update) a provider, and note it as `event` in the same
    /// commit: the event log never misses a change, nor tells of one not made.
    pub fn put_provider(&self, record: &ProviderRecord, event: &Event) -> Pending<()> {
        let (name, bytes, event) = (record.name.clone(), encoded("provider", record), event.clone());
        self.write(move |txn| {
            let bytes = bytes.as_ref().map_err(Clone::clone)?;
            txn.open_table(PROVIDERS).map_err(db_error)?.insert(name.as_str(), bytes.as_slice()).map_err(db_error)?;
            events::append(txn, &event).map(drop)
        })
    }

    /// Unregister a provider, noting it as `event` in the same commit; true if
    /// it was registered (else nothing is noted).
    pub fn remove_provider(&self, name: &str, event: &Event) -> Pending<bool> {
        let (name, event) = (name.to_owned(), event.clone());
        self.write(move |txn| {
            let existed =
                txn.open_table(PROVIDERS).map_err(db_error)?.remove(name.as_str()).map_err(db_error)?.is_some();
            if existed {
                events::append(txn, &event)?;
            }
            Ok(existed)
        })
    }

    /// A registered provider's record, if it is registered.
    pub fn provider(&self, name: &str) -> Result<Option<ProviderRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(PROVIDERS).map_err(db_error)?;
        let value = table.get(name).map_err(db_error)?;
        value.map(|v| decode("provider", v.value())).transpose()
    }

    pub(crate) fn providers(&self) -> Result<Vec<ProviderRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(PROVIDERS).map_err(db_error)?;
        let mut records = Vec::new();
        for entry in table.iter().map_err(db_error)? {
            let (_, value) = entry.map_err(db_error)?;
            records.push(decode("provider", value.value())?);
        }
        Ok(records)
    }

    /// Record an instance a provider has just started, unless its id is already
    /// recorded for another provider: checked in the same write transaction, so two
    /// starts cannot both take one id. Returns that other provider, and then
    /// writes nothing. (The host's starts record with their kv changes and
    /// pending start, [`Store::put_started_instance`]; this is the record alone.)
    #[cfg(test)]
    pub(crate) fn put_new_instance(&self, record: &InstanceRecord) -> Pending<Option<String>> {
        self.put_instance_resolving(record, None, false, None)
    }

    /// Record an instance unless its id is recorded for another provider
    /// (returned; nothing is written); the pending start `pending` (of the
    /// record's provider) goes in the same commit, whatever the outcome: a
    /// refused record leaves nothing pending either. With `fresh` (a start's
    /// answer), an id already recorded for the same provider is refused too
    /// (the provider is returned): a start never overwrites another record.
    fn put_instance_resolving(
        &self,
        record: &InstanceRecord,
        pending: Option<String>,
        fresh: bool,
        slot: Option<StartSlot>,
    ) -> Pending<Option<String>> {
        let (provider, id) = (record.provider.clone(), record.id.clone());
        let bytes = encoded("instance", &InstanceRecord { params: None, ..record.clone() });
        let params = record.params.as_ref().map(|params| encoded("instance params", params));
        let (counts, counted) = (self.counts.clone(), provider.clone());
        let committed = move |added: isize| match slot {
            Some(slot) => slot.recorded(added),
            None => counts.committed(&counted, added),
        };
        Pending::new_then(
            &self.writer,
            move |txn| {
                let bytes = bytes.as_ref().map_err(Clone::clone)?;
                let params = params.as_ref().map(|params| params.as_ref().map_err(Clone::clone)).transpose()?;
                if let Some(key) = &pending {
                    let mut starts = txn.open_table(starts::STARTS).map_err(db_error)?;
                    starts.remove((provider.as_str(), key.as_str())).map_err(db_error)?;
                }
                let mut ids = txn.open_table(INSTANCE_IDS).map_err(db_error)?;
                if let Some(owner) = ids.get(id.as_str()).map_err(db_error)?.map(|owner| owner.value().to_owned())
                    && (owner != provider || fresh)
                {
                    return Ok((Some(owner), 0));
                }
                ids.insert(id.as_str(), provider.as_str()).map_err(db_error)?;
                let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
                let replaced =
                    table.insert((provider.as_str(), id.as_str()), bytes.as_slice()).map_err(db_error)?.is_some();
                let mut stored_params = txn.open_table(INSTANCE_PARAMS).map_err(db_error)?;
                match params {
                    Some(params) => stored_params.insert((provider.as_str(), id.as_str()), params.as_slice()),
                    None => stored_params.remove((provider.as_str(), id.as_str())),
                }
                .map_err(db_error)?;
                Ok((None, if replaced { 0 } else { 1 }))
            },
            committed,
        )
    }

    /// Record an instance whose start was left pending as `key` by an earlier
    /// process, removing the pending start in the same commit.
    pub(crate) fn put_adopted_instance(&self, record: &InstanceRecord, key: &str) -> Pending<Option<String>> {
        self.put_instance_resolving(record, Some(key.to_owned()), false, None)
    }

    /// Record an instance a provider has just started, unless its id is
    /// recorded for another provider (returned; nothing is written),
    /// committing in the same transaction the
    /// kv changes of the call that started the instance (the provider's own
    /// state and the host's record of it are durable together or not at
    /// all), and the removal of its pending start, `pending`.
    /// `slot`, the start's place under its provider's bound, becomes the
    /// record's in the same step as the commit, so the instance is never
    /// counted twice.
    pub(crate) fn put_started_instance(
        &self,
        record: &InstanceRecord,
        writes: KvWrites,
        pending: Option<String>,
        slot: StartSlot,
    ) -> Pending<Option<String>> {
        let put = self.put_instance_resolving(record, pending, true, Some(slot));
        match self.kv.persist_job(writes) {
            Some(persist) => put.joined(persist),
            None => put,
        }
    }

    /// Remove records, and their stop marks, in one transaction; unknown ids are ignored.
    pub fn remove_instances(&self, provider: &str, ids: &[String]) -> Pending<()> {
        let (provider, removed) = (provider.to_owned(), ids.to_vec());
        let (counts, counted) = (self.counts.clone(), provider.clone());
        let committed = move |gone: isize| counts.committed(&counted, -gone);
        Pending::new_then(
            &self.writer,
            move |txn| {
                let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
                let mut owners = txn.open_table(INSTANCE_IDS).map_err(db_error)?;
                let mut marks = txn.open_table(starts::STOPPING).map_err(db_error)?;
                let mut params = txn.open_table(INSTANCE_PARAMS).map_err(db_error)?;
                let mut gone = 0;
                for id in &removed {
                    marks.remove((provider.as_str(), id.as_str())).map_err(db_error)?;
                    params.remove((provider.as_str(), id.as_str())).map_err(db_error)?;
                    if table.remove((provider.as_str(), id.as_str())).map_err(db_error)?.is_some() {
                        gone += 1;
                        let owned = owners.get(id.as_str()).map_err(db_error)?.is_some_and(|o| o.value() == provider);
                        if owned {
                            owners.remove(id.as_str()).map_err(db_error)?;
                        }
                    }
                }
                Ok(((), gone))
            },
            committed,
        )
    }

    /// Set `labels` among the instance config tags of `provider`'s record of
    /// `id` (InfraKit's `Instance.Label`), in one transaction. Refused (the
    /// inner error, nothing written) when no such record is, or when the
    /// record would hold more than [`MAX_INSTANCE_TAGS`].
    pub fn label_instance(
        &self,
        provider: &str,
        id: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Pending<Result<(), String>> {
        let (provider, id, labels) = (provider.to_owned(), id.to_owned(), labels.clone());
        self.write(move |txn| {
            let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
            let key = (provider.as_str(), id.as_str());
            let Some(bytes) = table.get(key).map_err(db_error)?.map(|v| v.value().to_vec()) else {
                return Ok(Err(format!("no instance {} is recorded", records::id_for_message(&id))));
            };
            let mut record: InstanceRecord = decode("instance", &bytes)?;
            record.instance_tags.extend(labels.iter().map(|(k, v)| (k.clone(), v.clone())));
            if record.instance_tags.len() > MAX_INSTANCE_TAGS {
                return Ok(Err(format!(
                    "instance {} would have {} tags; at most {MAX_INSTANCE_TAGS}",
                    records::id_for_message(&id),
                    record.instance_tags.len()
                )));
            }
            table.insert(key, encoded("instance", &record)?.as_slice()).map_err(db_error)?;
            Ok(Ok(()))
        })
    }

    /// The provider an instance id is recorded for.
    pub fn owner_of(&self, id: &str) -> Result<Option<String>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCE_IDS).map_err(db_error)?;
        Ok(table.get(id).map_err(db_error)?.map(|owner| owner.value().to_owned()))
    }

    /// The providers `ids` are recorded for, those recorded at all, in one read.
    pub(crate) fn owners_of<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<std::collections::HashMap<String, String>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCE_IDS).map_err(db_error)?;
        let mut owners = std::collections::HashMap::new();
        for id in ids {
            if let Some(owner) = table.get(id).map_err(db_error)? {
                owners.insert(id.to_owned(), owner.value().to_owned());
            }
        }
        Ok(owners)
    }

    /// One instance's record, with its start params, if it is recorded for `provider`.
    pub fn instance(&self, provider: &str, id: &str) -> Result<Option<InstanceRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let Some(value) = table.get((provider, id)).map_err(db_error)? else { return Ok(None) };
        let mut record: InstanceRecord = decode("instance", value.value())?;
        if record.params.is_none() {
            let params = txn.open_table(INSTANCE_PARAMS).map_err(db_error)?;
            if let Some(value) = params.get((provider, id)).map_err(db_error)? {
                record.params = Some(Box::new(decode("instance params", value.value())?));
            }
        }
        Ok(Some(record))
    }

    /// Records of one provider, or of all, in (provider, id) order.
    ///
    /// Without their start params (`params` is `None`): [`Store::instance`]
    /// reads one record whole.
    pub fn instances(&self, provider: Option<&str>) -> Result<Vec<InstanceRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let mut records = Vec::new();
        let mut keep = |owner: &str, id: &str, value: &[u8]| records.extend(listed_record(owner, id, value));
        match provider {
            Some(owner) => each_of_owner(&table, owner, |id, value| {
                keep(owner, id, value);
                Ok(())
            })?,
            None => {
                for entry in table.iter().map_err(db_error)? {
                    let (key, value) = entry.map_err(db_error)?;
                    let (owner, id) = key.value();
                    keep(owner, id, value.value());
                }
            }
        }
        Ok(records)
    }

    /// At most `limit` of `provider`'s records whose ids sort after `after`
    /// (none: from its first), in id order, without their start params: a
    /// listing's page costs what it holds, however many are recorded.
    pub fn instances_after(
        &self,
        provider: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<InstanceRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let mut records = Vec::with_capacity(limit.min(1024));
        if limit > 0 {
            each_of_owner_after(&table, provider, after, |id, value| {
                records.extend(listed_record(provider, id, value));
                Ok(if records.len() == limit { ControlFlow::Break(()) } else { ControlFlow::Continue(()) })
            })?;
        }
        Ok(records)
    }
}

/// An instance a reconcile maintains: its id, and its start params (`None`
/// if none were recorded) or why they cannot be read.
pub type ToMaintain = (String, Result<Option<broker_capabilities::bindings::StartInstanceParams>, StoreError>);

impl Store {
    /// At most `limit` of `provider`'s instances whose ids sort after `after`
    /// (none: from its first), in id order, each with its start params: what a
    /// reconcile maintains, a page at a time. A record that does not decode is
    /// left out (as a listing leaves it out); params that do not decode are
    /// that instance's error, not the page's.
    pub fn to_maintain_after(
        &self,
        provider: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ToMaintain>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let params_table = txn.open_table(INSTANCE_PARAMS).map_err(db_error)?;
        let mut page = Vec::with_capacity(limit.min(1024));
        if limit == 0 {
            return Ok(page);
        }
        // The params in the same key order, walked beside the records (one
        // leaf after another, not a lookup from the root per record).
        let mut params =
            params_table.range::<(&str, &str)>(keys_of_owner_after(provider, after)).map_err(db_error)?.peekable();
        each_of_owner_after(&table, provider, after, |id, value| {
            // A record a listing would leave out (it does not decode) is left out here too.
            let Some(_) = listed_record(provider, id, value) else { return Ok(ControlFlow::Continue(())) };
            // Only a record from before the params' own table holds them inline.
            let decoded = match decode::<records::InlineParams>("instance", value) {
                Ok(records::InlineParams { params: Some(inline) }) => serde_json::from_value(inline)
                    .map(Some)
                    .map_err(|e| StoreError::Corrupt { what: "instance params", cause: Arc::new(e) }),
                Ok(records::InlineParams { params: None }) => params_of(&mut params, (provider, id))?.transpose(),
                Err(unreadable) => Err(unreadable),
            };
            page.push((id.to_owned(), decoded));
            Ok(if page.len() == limit { ControlFlow::Break(()) } else { ControlFlow::Continue(()) })
        })?;
        Ok(page)
    }

    /// The ids recorded for `provider`, in id order: the keys alone, no record decoded.
    pub fn instance_ids(&self, provider: &str) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let mut ids = Vec::new();
        each_of_owner(&table, provider, |id, _| {
            ids.push(id.to_owned());
            Ok(())
        })?;
        Ok(ids)
    }
}

/// The params stored for `key`, from `params` walked in key order up to it
/// (keys before it are passed over; one after it is left for the next key):
/// `None` if it has none, an error of the table's as the read's error, a
/// value that does not decode as that instance's.
fn params_of<'t>(
    params: &mut std::iter::Peekable<redb::Range<'t, (&'static str, &'static str), &'static [u8]>>,
    key: (&str, &str),
) -> Result<Option<Result<broker_capabilities::bindings::StartInstanceParams, StoreError>>, StoreError> {
    use std::cmp::Ordering;
    while let Some(entry) = params.peek() {
        // An error is taken below, where it is returned.
        let order = entry.as_ref().map_or(Ordering::Less, |(found, _)| found.value().cmp(&key));
        if order == Ordering::Greater {
            break;
        }
        match params.next() {
            Some(Err(e)) => return Err(db_error(e)),
            Some(Ok((_, value))) if order == Ordering::Equal => {
                return Ok(Some(decode("instance params", value.value())));
            }
            _ => {}
        }
    }
    Ok(None)
}

/// A record as a listing shows it. One that does not decode hides no other:
/// it is named, and `broker store recover` leaves it out.
fn listed_record(owner: &str, id: &str, value: &[u8]) -> Option<InstanceRecord> {
    match decode::<records::ListedRecord>("instance", value) {
        Ok(record) => Some(record.into()),
        Err(error) => {
            tracing::error!(
                provider = owner,
                instance_id = id,
                %error,
                "an instance record does not decode: left out (`broker store check` names it, `broker store recover` drops it)"
            );
            None
        }
    }
}

/// The state file in `data_dir` (its write-ahead log is `state.wal` beside it).
/// Refuse a data dir that others than its owner may write (its mode, not
/// a link: the dir itself is looked at).
fn check_not_exposed(data_dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    let shown = data_dir.display().to_string();
    let meta = std::fs::metadata(data_dir)
        .map_err(|e| StoreError::Open { path: shown.clone(), cause: Arc::new(redb::Error::Io(e)) })?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(StoreError::Exposed { path: shown, mode });
    }
    Ok(())
}

/// The state format `db` says it is (1 if it says none: it was made before
/// formats were recorded).
fn state_format(db: &impl redb::ReadableDatabase) -> Result<u64, redb::Error> {
    let txn = db.begin_read()?;
    let meta = match txn.open_table(META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(1),
        Err(e) => return Err(e.into()),
    };
    Ok(meta.get(FORMAT_KEY)?.map_or(1, |format| format.value()))
}

/// Refuse a state file (at `path`) of a format newer than [`STATE_FORMAT`]
/// (or one whose format no broker writes: damaged).
fn refuse_newer(db: &impl redb::ReadableDatabase, path: &Path) -> Result<(), StoreError> {
    let format = state_format(db).map_err(|e| StoreError::Db(Arc::new(e)))?;
    let path = path.display().to_string();
    match format {
        1..=STATE_FORMAT => Ok(()),
        format if (1..=NO_BROKER_WRITES_FORMATS_PAST).contains(&format) => Err(StoreError::Newer { path, format }),
        format => Err(StoreError::Damaged {
            path,
            reason: format!("its state format reads {format}, which no broker writes"),
        }),
    }
}

/// A newer broker's file at `path` refused, read with the file opened
/// read-only, if it opens so (it exists, was closed cleanly, no one holds
/// it, redb reads it): what does not is left to the open that follows,
/// which reports or repairs it.
fn refuse_newer_read_only(path: &Path) -> Result<(), StoreError> {
    if !path.exists() {
        return Ok(());
    }
    match salvage::caught(|| redb::ReadOnlyDatabase::open(path).map(|db| salvage::refuse_newer(&db, path))) {
        Ok(Ok(refused)) => refused,
        _ => Ok(()),
    }
}

/// Open (or create) the state file in `data_dir`, with the host's page cache.
fn open_database(data_dir: &Path) -> Result<Database, redb::DatabaseError> {
    Database::builder().set_cache_size(STATE_CACHE_BYTES).create(state_file(data_dir))
}

fn state_file(data_dir: &Path) -> PathBuf {
    data_dir.join("state.redb")
}

/// Whether another process holds the lock redb takes on an open state file.
fn held_by_another(path: &Path) -> bool {
    let Ok(file) = std::fs::File::open(path) else { return false };
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(_unlocked_on_drop) => false,
        Err((_, errno)) => errno == nix::errno::Errno::EWOULDBLOCK,
    }
}

/// Make the id index from the records, on every open: whatever wrote the file
/// before (a host from before the index, an older binary after a rollback),
/// the index then says exactly what the records say. Ids recorded for two
/// providers by a host from before the ownership check keep the owner whose
/// record sorts first, and are reported.
/// Returns how many records each provider has.
fn index_instance_ids(txn: &redb::WriteTransaction) -> Result<std::collections::HashMap<String, usize>, StoreError> {
    txn.delete_table(INSTANCE_IDS).map_err(db_error)?;
    let instances = txn.open_table(INSTANCES).map_err(db_error)?;
    let mut ids = txn.open_table(INSTANCE_IDS).map_err(db_error)?;
    let mut counts = std::collections::HashMap::<String, usize>::new();
    for entry in instances.iter().map_err(db_error)? {
        let (key, _) = entry.map_err(db_error)?;
        let (provider, id) = key.value();
        match counts.get_mut(provider) {
            Some(count) => *count += 1,
            None => drop(counts.insert(provider.to_owned(), 1)),
        }
        let owner = ids.get(id).map_err(db_error)?.map(|owner| owner.value().to_owned());
        match owner {
            None => drop(ids.insert(id, provider).map_err(db_error)?),
            Some(owner) => tracing::warn!(instance_id = id, owner, also = provider, "an instance id is recorded twice"),
        }
    }
    Ok(counts)
}

/// Apply a change the log holds to the table it names. Every table the
/// writer writes is here; a name the log holds and this host does not know
/// (a log of a newer host) stops the open rather than dropping the change.
fn replay_change(txn: &redb::WriteTransaction, table: &str, key: &[u8], value: Option<&[u8]>) -> Result<(), String> {
    use redb::TableHandle;
    match table {
        t if t == PROVIDERS.name() => wal::replay_into(txn, PROVIDERS, key, value),
        t if t == INSTANCES.name() => wal::replay_into(txn, INSTANCES, key, value),
        t if t == INSTANCE_PARAMS.name() => wal::replay_into(txn, INSTANCE_PARAMS, key, value),
        t if t == groups::GROUPS.name() => wal::replay_into(txn, groups::GROUPS, key, value),
        t if t == INSTANCE_IDS.name() => wal::replay_into(txn, INSTANCE_IDS, key, value),
        t if t == KV.name() => wal::replay_into(txn, KV, key, value),
        t if t == OBSERVED_NETWORK.name() => wal::replay_into(txn, OBSERVED_NETWORK, key, value),
        t if t == CHILDREN.name() => wal::replay_into(txn, CHILDREN, key, value),
        t if t == starts::STARTS.name() => wal::replay_into(txn, starts::STARTS, key, value),
        t if t == starts::STOPPING.name() => wal::replay_into(txn, starts::STOPPING, key, value),
        t if t == events::EVENTS.name() => wal::replay_into(txn, events::EVENTS, key, value),
        t if t == devices::DEVICE_OWNERS.name() => wal::replay_into(txn, devices::DEVICE_OWNERS, key, value),
        t if t == sandbox_users::SANDBOX_USERS.name() => {
            wal::replay_into(txn, sandbox_users::SANDBOX_USERS, key, value)
        }
        t if t == sandbox_users::SANDBOX_SHARED.name() => {
            wal::replay_into(txn, sandbox_users::SANDBOX_SHARED, key, value)
        }
        other => Err(format!("a change to table {other:?}, which this host does not have")),
    }
}

/// Visit, in key order, each entry `owner` has in `table`, a table keyed
/// `(owner, key)`: the one range scan every "entries of one provider" read is.
fn each_of_owner<T>(
    table: &T,
    owner: &str,
    mut visit: impl FnMut(&str, &[u8]) -> Result<(), StoreError>,
) -> Result<(), StoreError>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    each_of_owner_after(table, owner, None, |key, value| visit(key, value).map(|()| ControlFlow::Continue(())))
}

/// As [`each_of_owner`], from the first key after `after` (none: from the
/// first), until `visit` says to stop.
fn each_of_owner_after<T>(
    table: &T,
    owner: &str,
    after: Option<&str>,
    mut visit: impl FnMut(&str, &[u8]) -> Result<ControlFlow<()>, StoreError>,
) -> Result<(), StoreError>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    for entry in table.range::<(&str, &str)>(keys_of_owner_after(owner, after)).map_err(db_error)? {
        let (key, value) = entry.map_err(db_error)?;
        let (found, key) = key.value();
        if found != owner || visit(key, value.value())?.is_break() {
            break;
        }
    }
    Ok(())
}

/// A key of a table keyed by `(owner, id)`.
type OwnerKey<'k> = (&'k str, &'k str);

/// The keys of a `(owner, id)` table from `owner`'s first id after `after`
/// (none: from its first) on; the caller stops at the owner's last.
fn keys_of_owner_after<'k>(
    owner: &'k str,
    after: Option<&'k str>,
) -> (std::ops::Bound<OwnerKey<'k>>, std::ops::Bound<OwnerKey<'k>>) {
    use std::ops::Bound;
    let from = match after {
        Some(key) => Bound::Excluded((owner, key)),
        None => Bound::Included((owner, "")),
    };
    (from, Bound::Unbounded)
}

fn decode<T: serde::de::DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt { what, cause: Arc::new(e) })
}

/// Child records in the `children` table.
struct RedbChildren {
    db: Arc<StateDb>,
    writer: Arc<writer::Writer>,
}

fn records_error(err: impl std::error::Error + Send + Sync + 'static) -> RecordsError {
    RecordsError::new(err)
}

impl ChildRecords for RedbChildren {
    fn put(&self, record: &ChildRecord) -> BoxFuture<'static, Result<(), RecordsError>> {
        let bytes = match serde_json::to_vec(record) {
            Ok(bytes) => bytes,
            Err(e) => return Box::pin(std::future::ready(Err(records_error(e)))),
        };
        let (provider, name) = (record.provider.clone(), record.name.clone());
        let pending = Pending::new(&self.writer, move |txn| {
            let mut table = txn.open_table(CHILDREN).map_err(db_error)?;
            table.insert((provider.as_str(), name.as_str()), bytes.as_slice()).map_err(db_error)?;
            Ok(())
        });
        Box::pin(async move { pending.await.map_err(records_error) })
    }

    fn get(&self, provider: &str, name: &str) -> Result<Option<ChildRecord>, RecordsError> {
        let txn = self.db.begin_read().map_err(records_error)?;
        let table = txn.open_table(CHILDREN).map_err(records_error)?;
        let value = table.get((provider, name)).map_err(records_error)?;
        value.map(|v| decode("child", v.value()).map_err(records_error)).transpose()
    }

    fn remove(&self, provider: &str, name: &str) -> BoxFuture<'static, Result<(), RecordsError>> {
        let (provider, name) = (provider.to_owned(), name.to_owned());
        let pending = Pending::new(&self.writer, move |txn| {
            txn.open_table(CHILDREN).map_err(db_error)?.remove((provider.as_str(), name.as_str())).map_err(db_error)?;
            Ok(())
        });
        Box::pin(async move { pending.await.map_err(records_error) })
    }

    fn list(&self, provider: &str) -> Result<Vec<ChildRecord>, RecordsError> {
        let txn = self.db.begin_read().map_err(records_error)?;
        let table = txn.open_table(CHILDREN).map_err(records_error)?;
        let mut records = Vec::new();
        each_of_owner(&table, provider, |_, value| {
            records.push(decode("child", value)?);
            Ok(())
        })
        .map_err(records_error)?;
        Ok(records)
    }
}

/// Drop the instance config tags `keys` from the records of `ids` (those recorded for `provider`), in `txn`.
fn untag(txn: &Txn<'_>, provider: &str, ids: &[String], keys: &[String]) -> Result<(), StoreError> {
    let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
    for id in ids {
        let key = (provider, id.as_str());
        let Some(bytes) = table.get(key).map_err(db_error)?.map(|v| v.value().to_vec()) else { continue };
        let mut record: InstanceRecord = decode("instance", &bytes)?;
        record.instance_tags.retain(|k, _| !keys.contains(k));
        table.insert(key, encoded("instance", &record)?.as_slice()).map_err(db_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::records::Hardware;
    use broker_capabilities::bindings::StartInstanceParams;

    pub(super) fn record(provider: &str, id: &str) -> InstanceRecord {
        InstanceRecord {
            id: id.into(),
            provider: provider.into(),
            status: "running".into(),
            message: String::new(),
            display_name: String::new(),
            hardware: Hardware::default(),
            tags: Vec::new(),
            addresses: Vec::new(),
            created: String::new(),
            instance_tags: Default::default(),
            params: None,
        }
    }

    /// The state holds every provider's kv: a new data dir is the owner's
    /// alone (0700), and so are the state file and its log (0600).
    #[test]
    fn the_state_is_private_to_its_owner() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("new/data");
        drop(Store::open(&data).unwrap());
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&data), 0o700);
        assert_eq!((mode(&data.join("state.redb")), mode(&data.join("state.wal"))), (0o600, 0o600));
    }

    /// Whoever can write the data dir can replace the state or a provider's
    /// data dir: a group- or world-writable one is refused, a readable one is not.
    #[test]
    fn a_data_dir_others_may_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o777, 0o775, 0o1777, 0o757] {
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
            let refused = Store::open(dir.path()).err().unwrap_or_else(|| panic!("{mode:o} was opened"));
            assert!(matches!(refused, StoreError::Exposed { .. }), "{mode:o}: {refused}");
            assert!(refused.to_string().contains("chmod go-w"), "{refused}");
            assert!(!dir.path().join("state.redb").exists(), "nothing made in it");
        }
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        drop(Store::open(dir.path()).unwrap());
    }

    #[test]
    fn a_new_instance_cannot_take_an_id_recorded_for_another_provider() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let put = |provider, id| store.put_new_instance(&record(provider, id)).wait().unwrap();
        assert_eq!(put("fake", "fake-0"), None);
        assert_eq!(put("hostile", "fake-0").as_deref(), Some("fake"));
        assert_eq!(store.instance("hostile", "fake-0").unwrap(), None, "nothing was written");
        assert_eq!(store.instances(None).unwrap().len(), 1);
        // The provider's own id again (a restart that reuses it) is its business.
        assert_eq!(put("fake", "fake-0"), None);
        assert_eq!(put("hostile", "hostile-0"), None);
        assert_eq!(store.instances(None).unwrap().len(), 2);
        // Once its record is gone the id is free again; another provider's removal frees nothing.
        store.remove_instances("hostile", &["fake-0".into()]).wait().unwrap();
        assert_eq!(store.owner_of("fake-0").unwrap().as_deref(), Some("fake"));
        store.remove_instances("fake", &["fake-0".into()]).wait().unwrap();
        assert_eq!(store.owner_of("fake-0").unwrap(), None);
        assert_eq!(put("hostile", "fake-0"), None);
    }

    /// Start params live apart from the record: a listing reads records
    /// without them, one record is read with them, they go with the record,
    /// and records from before the split (params inline) still read whole.
    #[test]
    fn start_params_are_kept_apart_and_read_with_one_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut params = broker_capabilities::contract::empty_params();
        params.constraints.tags = Some(vec!["kept".into()]);
        let with_params = InstanceRecord { params: Some(Box::new(params.clone())), ..record("fake", "fake-0") };
        {
            let store = open_uncheckpointed(dir.path());
            assert_eq!(store.put_new_instance(&with_params).wait().unwrap(), None);
            // What a host before the split wrote: the params inside the record.
            let legacy = InstanceRecord { params: Some(Box::new(params.clone())), ..record("fake", "fake-1") };
            let bytes = serde_json::to_vec(&legacy).unwrap();
            store
                .write(move |txn| {
                    let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
                    table.insert(("fake", "fake-1"), bytes.as_slice()).map_err(db_error)?;
                    Ok(())
                })
                .wait()
                .unwrap();
            let txn = store.db.begin_read().unwrap();
            let raw = txn.open_table(INSTANCES).unwrap().get(("fake", "fake-0")).unwrap().unwrap().value().to_vec();
            assert!(!String::from_utf8_lossy(&raw).contains("kept"), "the record holds no params");
            // Read back below after the store is opened again.
        }
        let store = Store::open(dir.path()).unwrap();
        for id in ["fake-0", "fake-1"] {
            let read = store.instance("fake", id).unwrap().unwrap();
            assert_eq!(read.params.as_deref(), Some(&params), "{id}");
        }
        assert!(store.instances(None).unwrap().iter().all(|listed| listed.params.is_none()));
        // What a reconcile reads a page at a time: each id with its params, inline or apart.
        let maintained = |after: Option<&str>, limit| -> Vec<(String, Option<StartInstanceParams>)> {
            let page = store.to_maintain_after("fake", after, limit).unwrap();
            page.into_iter().map(|(id, params)| (id, params.unwrap())).collect()
        };
        assert_eq!(maintained(None, 1), [("fake-0".to_owned(), Some(params.clone()))]);
        assert_eq!(maintained(Some("fake-0"), 5), [("fake-1".to_owned(), Some(params.clone()))]);
        assert_eq!(maintained(Some("fake-1"), 5), []);
        assert_eq!(maintained(None, 0), []);
        // Records with params apart, inline and none, interleaved; whole or a page of one at a time.
        let mut other = params.clone();
        other.constraints.tags = Some(vec!["other".into()]);
        store.put_new_instance(&record("fake", "fake-00")).wait().unwrap();
        let later = InstanceRecord { params: Some(Box::new(other.clone())), ..record("fake", "fake-2") };
        store.put_new_instance(&later).wait().unwrap();
        let expected = [
            ("fake-0".to_owned(), Some(params.clone())),
            ("fake-00".to_owned(), None),
            ("fake-1".to_owned(), Some(params.clone())),
            ("fake-2".to_owned(), Some(other)),
        ];
        assert_eq!(maintained(None, 10), expected);
        let mut one_by_one = Vec::new();
        while let [next] = maintained(one_by_one.last().map(|(id, _): &(String, _)| id.as_str()), 1).as_slice() {
            one_by_one.push(next.clone());
        }
        assert_eq!(one_by_one, expected);
        assert_eq!(store.instance_ids("fake").unwrap(), ["fake-0", "fake-00", "fake-1", "fake-2"]);
        // Inline params that do not decode are that instance's error; the others still read.
        let mut broken = serde_json::to_value(record("fake", "fake-01")).unwrap();
        broken["params"] = serde_json::json!({"constraints": 5});
        let bytes = serde_json::to_vec(&broken).unwrap();
        store
            .write(move |txn| {
                let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
                table.insert(("fake", "fake-01"), bytes.as_slice()).map_err(db_error)?;
                Ok(())
            })
            .wait()
            .unwrap();
        let page = store.to_maintain_after("fake", None, 10).unwrap();
        let ids: Vec<&str> = page.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["fake-0", "fake-00", "fake-01", "fake-1", "fake-2"]);
        assert!(matches!(page[2].1, Err(StoreError::Corrupt { what: "instance params", .. })), "{:?}", page[2].1);
        assert!(page.iter().filter(|(id, _)| id != "fake-01").all(|(_, params)| params.is_ok()));
        for id in ["fake-00", "fake-01", "fake-2"] {
            store.remove_instances("fake", &[id.into()]).wait().unwrap();
        }
        assert_eq!(store.instance_ids("other").unwrap(), Vec::<String>::new());
        store.remove_instances("fake", &["fake-0".into()]).wait().unwrap();
        let txn = store.db.begin_read().unwrap();
        assert!(txn.open_table(INSTANCE_PARAMS).unwrap().get(("fake", "fake-0")).unwrap().is_none());
        drop(txn);
        // The id taken again without params does not inherit the old ones.
        store.put_new_instance(&with_params).wait().unwrap();
        store.put_new_instance(&record("fake", "fake-0")).wait().unwrap();
        assert_eq!(store.instance("fake", "fake-0").unwrap().unwrap().params, None);
    }

    /// No checkpoint for the life of a test: every write is only in the log
    /// (and in redb's non-durable commits) until the store closes.
    fn open_uncheckpointed(dir: &Path) -> Store {
        let never = wal::Checkpoints { bytes: u64::MAX, age: std::time::Duration::from_secs(3600) };
        Store::open_with(dir, never).unwrap()
    }

    /// What a crash of the host leaves: the files as the kernel holds them,
    /// taken while the store is still open (`with_log`: the log too).
    fn crash_image(store: &Store, with_log: bool) -> tempfile::TempDir {
        let image = tempfile::tempdir().unwrap();
        std::fs::copy(store.data_dir.join("state.redb"), image.path().join("state.redb")).unwrap();
        if with_log {
            std::fs::copy(store.data_dir.join("state.wal"), image.path().join("state.wal")).unwrap();
        }
        image
    }

    /// Every table the writer writes, written once and answered, then the host
    /// "crashes" before a checkpoint: the log brings each write back. Without
    /// the log the same image has none of them (so the test sees the replay).
    #[test]
    fn writes_answered_before_a_crash_survive_it_through_the_log() {
        use broker_capabilities::rooms::kv::KvBackend;
        let dir = tempfile::tempdir().unwrap();
        let store = open_uncheckpointed(dir.path());
        let provider = ProviderRecord {
            name: "fake".into(),
            manifest: "/m/fake.toml".into(),
            component_sha256: "ab".repeat(32),
            version: "1".into(),
            added: String::new(),
            component: None,
            approved_manifest: None,
        };
        store.put_provider(&provider, &Event::new(EventKind::Added, "fake")).wait().unwrap();
        store.put_new_instance(&record("fake", "fake-0")).wait().unwrap();
        store.put_new_instance(&record("fake", "fake-1")).wait().unwrap();
        store.remove_instances("fake", &["fake-1".into()]).wait().unwrap();
        store.kv().set("fake", "k", b"v").unwrap();
        store.kv().set("fake", "gone", b"x").unwrap();
        assert!(store.kv().delete("fake", "gone").unwrap());
        let child = ChildRecord {
            provider: "kvm".into(),
            name: "vm0".into(),
            pid: 7,
            start_time: 9,
            program: "qemu".into(),
            args: vec![],
            log: String::new(),
            sandbox: None,
        };
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(store.child_records().put(&child)).unwrap();
        store.put_observed_network(&[]).wait().unwrap();
        let uid = store.uid_for("kvm", 70_000).unwrap();

        let without_log = crash_image(&store, false);
        let with_log = crash_image(&store, true);
        let check = |image: &Path, expect: bool| {
            let opened = Store::open(image).unwrap();
            assert_eq!(opened.provider("fake").unwrap().is_some(), expect, "provider");
            assert_eq!(opened.events(0, 10).unwrap().len(), usize::from(expect), "event");
            let ids: Vec<String> = opened.instances(None).unwrap().into_iter().map(|r| r.id).collect();
            assert_eq!(ids, if expect { vec!["fake-0".to_owned()] } else { vec![] }, "instances");
            assert_eq!(opened.owner_of("fake-1").unwrap(), None);
            assert_eq!(opened.owner_of("fake-0").unwrap().is_some(), expect, "id index");
            assert_eq!(opened.kv().get("fake", "k").unwrap(), expect.then(|| b"v".to_vec()), "kv");
            assert_eq!(opened.kv().get("fake", "gone").unwrap(), None);
            assert_eq!(opened.child_records().get("kvm", "vm0").unwrap().is_some(), expect, "child");
            assert_eq!(opened.observed_network().unwrap().is_some(), expect, "observed network");
            // The uid is the provider's for good: after the replay it is handed out again only to it.
            assert_eq!(opened.uid_for("other", 70_000).unwrap() != uid, expect, "sandbox users");
        };
        check(with_log.path(), true);
        check(without_log.path(), false);
        // A replayed log is checkpointed on open: the state file alone holds it now.
        let reopened = crash_image(&Store::open(with_log.path()).unwrap(), false);
        check(reopened.path(), true);
        // Closing checkpoints too.
        drop(store);
        let closed = tempfile::tempdir().unwrap();
        std::fs::copy(dir.path().join("state.redb"), closed.path().join("state.redb")).unwrap();
        check(closed.path(), true);
    }

    /// A crash mid-append leaves a torn last frame: it is dropped (its write was
    /// never answered), and every frame before it is applied.
    #[test]
    fn a_torn_last_frame_is_dropped_and_the_frames_before_it_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = open_uncheckpointed(dir.path());
        store.put_new_instance(&record("fake", "fake-0")).wait().unwrap();
        store.put_new_instance(&record("fake", "fake-1")).wait().unwrap();
        let image = crash_image(&store, true);
        let log = image.path().join("state.wal");
        let len = std::fs::metadata(&log).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(len - 3).unwrap();
        let opened = Store::open(image.path()).unwrap();
        let ids: Vec<String> = opened.instances(None).unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, ["fake-0"]);
        // The new generation starts clean: what follows is kept and the torn frame stays gone.
        opened.put_new_instance(&record("fake", "fake-2")).wait().unwrap();
        let again = crash_image(&opened, true);
        let ids: Vec<String> =
            Store::open(again.path()).unwrap().instances(None).unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, ["fake-0", "fake-2"]);
    }

    /// A log that is not one this host wrote, or not a file, stops the open
    /// with what is wrong, and touches nothing.
    #[test]
    fn a_bad_log_is_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        drop(Store::open(dir.path()).unwrap());
        let log = dir.path().join("state.wal");
        std::fs::write(&log, vec![0x5a; 8192]).unwrap();
        let err = Store::open(dir.path()).err().expect("a corrupt header is refused");
        assert!(err.to_string().contains("corrupt header") && err.to_string().contains("Move it aside"), "{err}");
        assert_eq!(std::fs::read(&log).unwrap(), vec![0x5a; 8192], "the log is left as it was");

        std::fs::remove_file(&log).unwrap();
        nix::unistd::mkfifo(&log, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let err = Store::open(dir.path()).err().expect("a FIFO is refused");
        assert!(err.to_string().contains("not a regular file"), "{err}");

        std::fs::remove_file(&log).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &log).unwrap();
        let err = Store::open(dir.path()).err().expect("a symlink is not followed");
        assert!(err.to_string().contains("state.wal"), "{err}");
    }

    /// A state file from before the id index: the index is made from the records
    /// on open, so the ownership check holds for ids recorded then.
    #[test]
    fn ids_recorded_before_the_index_are_indexed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            store.put_new_instance(&record("fake", "fake-0")).wait().unwrap();
            store.put_new_instance(&record("fake", "fake-1")).wait().unwrap();
            // As an older binary could leave it: the index emptied, and an entry
            // for an id that has no record (the counts alike would hide it).
            let txn = store.db.handle().unwrap().begin_write().unwrap();
            txn.delete_table(INSTANCE_IDS).unwrap();
            txn.open_table(INSTANCE_IDS).unwrap().insert("stale-0", "gone").unwrap();
            txn.commit().unwrap();
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.owner_of("fake-1").unwrap().as_deref(), Some("fake"));
        assert_eq!(store.owner_of("stale-0").unwrap(), None, "an id without a record is free");
        assert_eq!(store.put_new_instance(&record("hostile", "fake-0")).wait().unwrap().as_deref(), Some("fake"));
    }
}
