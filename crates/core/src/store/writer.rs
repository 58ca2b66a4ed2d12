//! The store's one writer: a thread of its own that takes every write, applies
//! the writes waiting at that moment in one transaction and commits them with
//! one fsync (group commit). Callers wait for their own answer (async callers
//! without blocking a tokio worker), and it comes only once their write is
//! durable. Durability then costs one commit per batch instead of one per
//! write, and no commit runs on the executor.
//!
//! A batch is whatever queued while the previous commit ran: no timer, so a
//! lone write commits at once and a busy store commits in bigger batches.
//! A batch is durable once its frame is in the write-ahead log ([`super::wal`]);
//! redb commits it without a sync, except at a checkpoint.

use super::StoreError;
use super::db::StateDb;
use super::wal::{Txn, Wal};
use redb::{Database, Durability};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Writes applied in one transaction at most; the rest wait for the next.
const MAX_BATCH: usize = 1024;

/// One write: applied to the batch's transaction, answered after its commit.
pub(crate) trait Job: Send {
    /// Apply to the batch's transaction. An error here is the storage's (a
    /// refusal the caller should see, like an id taken, is an `Ok` answer);
    /// it aborts the batch, whose jobs are then applied again one per
    /// transaction, so only the job that failed fails.
    fn apply(&mut self, txn: &Txn<'_>) -> Result<(), StoreError>;
    /// Answer the caller with how its transaction ended. Called on the writer
    /// thread, in the order the jobs were queued.
    fn finish(self: Box<Self>, committed: Result<(), StoreError>);
}

/// Where an answer goes: a task awaiting it, or a thread waiting for it.
pub(crate) enum Reply<T> {
    Task(tokio::sync::oneshot::Sender<T>),
    Thread(std::sync::mpsc::SyncSender<T>),
}

impl<T> Reply<T> {
    pub(crate) fn send(self, answer: T) {
        // A caller that stopped waiting (a cancelled call) no longer wants it;
        // the write itself stands.
        match self {
            Reply::Task(sender) => drop(sender.send(answer)),
            Reply::Thread(sender) => drop(sender.send(answer)),
        }
    }
}

/// A job made of a closure over the transaction and what it returns.
struct Op<R, F> {
    op: F,
    result: Option<R>,
    reply: Reply<Result<R, StoreError>>,
}

impl<R: Send, F: FnMut(&Txn<'_>) -> Result<R, StoreError> + Send> Job for Op<R, F> {
    fn apply(&mut self, txn: &Txn<'_>) -> Result<(), StoreError> {
        self.result = Some((self.op)(txn)?);
        Ok(())
    }

    fn finish(self: Box<Self>, committed: Result<(), StoreError>) {
        let Op { result, reply, .. } = *self;
        reply.send(committed.and_then(|()| result.ok_or(StoreError::Closed)));
    }
}

/// An op whose result's second part goes to `committed` once it commits.
struct Then<T, A, F, C> {
    op: F,
    result: Option<(T, A)>,
    committed: C,
    reply: Reply<Result<T, StoreError>>,
}

impl<T, A, F, C> Job for Then<T, A, F, C>
where
    T: Send,
    A: Send,
    F: FnMut(&Txn<'_>) -> Result<(T, A), StoreError> + Send,
    C: FnOnce(A) + Send,
{
    fn apply(&mut self, txn: &Txn<'_>) -> Result<(), StoreError> {
        self.result = Some((self.op)(txn)?);
        Ok(())
    }

    fn finish(self: Box<Self>, outcome: Result<(), StoreError>) {
        let Then { result, committed, reply, .. } = *self;
        let answer = match (outcome, result) {
            (Ok(()), Some((value, change))) => {
                committed(change);
                Ok(value)
            }
            (Ok(()), None) => Err(StoreError::Closed),
            (Err(failed), _) => Err(failed),
        };
        reply.send(answer);
    }
}

/// A write not yet queued: `.await` it from async code, or [`Pending::wait`]
/// for it from a thread that is not a tokio worker's. It is queued when first
/// awaited (or waited for): a `Pending` dropped unused writes nothing.
#[must_use = "a store write does nothing until it is awaited or waited for"]
pub struct Pending<T> {
    writer: Arc<Writer>,
    job: MakeJob<T>,
}

/// Makes a write's job once it is known where the answer goes.
type MakeJob<T> = Box<dyn FnOnce(Reply<Result<T, StoreError>>) -> Box<dyn Job> + Send>;

impl<T: Send + 'static> Pending<T> {
    pub(crate) fn new<F>(writer: &Arc<Writer>, op: F) -> Pending<T>
    where
        F: FnMut(&Txn<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        Self::with_job(writer, move |reply| Box::new(Op { op, result: None, reply }))
    }

    /// A write whose op also returns what `committed` is to be given once its
    /// transaction commits (and only then): what the host keeps in memory
    /// beside the file, such as its count of records, follows the commits.
    pub(crate) fn new_then<A, F, C>(writer: &Arc<Writer>, op: F, committed: C) -> Pending<T>
    where
        A: Send + 'static,
        F: FnMut(&Txn<'_>) -> Result<(T, A), StoreError> + Send + 'static,
        C: FnOnce(A) + Send + 'static,
    {
        Self::with_job(writer, move |reply| Box::new(Then { op, result: None, committed, reply }))
    }

    /// A write whose job is its own (see [`Job`]): the kv's, which also keeps its mirror.
    pub(crate) fn with_job(
        writer: &Arc<Writer>,
        job: impl FnOnce(Reply<Result<T, StoreError>>) -> Box<dyn Job> + Send + 'static,
    ) -> Pending<T> {
        Pending { writer: writer.clone(), job: Box::new(job) }
    }

    /// This write with `first`'s in one transaction: both commit or neither.
    /// (`first`'s answer, if it has one, is sent first.)
    pub(crate) fn joined(self, first: Box<dyn Job>) -> Pending<T> {
        let Pending { writer, job } = self;
        Pending { writer, job: Box::new(move |reply| Box::new(Joined { first, then: job(reply) })) }
    }

    /// Hand the write to the writer and wait for nobody: for a caller that is
    /// going away (a dropped call's guard); its failure is the writer's to log.
    pub(crate) fn detach(self) {
        let (reply, _gone) = tokio::sync::oneshot::channel();
        self.writer.submit((self.job)(Reply::Task(reply)));
    }

    /// Hand the write to the writer now; the answer resolves once it is
    /// committed. Dropped, the answer leaves the write to commit (its failure
    /// then the writer's to log).
    pub(crate) fn submit(self) -> impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.writer.submit((self.job)(Reply::Task(reply)));
        async move { answer.await.unwrap_or(Err(StoreError::Closed)) }
    }

    /// Wait on this thread until the write is committed: for callers that are
    /// not async (opening the store, tools, tests), never for a host function.
    pub fn wait(self) -> Result<T, StoreError> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.writer.submit((self.job)(Reply::Thread(reply)));
        answer.recv().unwrap_or(Err(StoreError::Closed))
    }
}

impl<T: Send + 'static> std::future::IntoFuture for Pending<T> {
    type Output = Result<T, StoreError>;
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move { self.submit().await })
    }
}

/// Two jobs applied in one transaction, in order.
struct Joined {
    first: Box<dyn Job>,
    then: Box<dyn Job>,
}

impl Job for Joined {
    fn apply(&mut self, txn: &Txn<'_>) -> Result<(), StoreError> {
        self.first.apply(txn)?;
        self.then.apply(txn)
    }

    fn finish(self: Box<Self>, committed: Result<(), StoreError>) {
        self.first.finish(committed.clone());
        self.then.finish(committed);
    }
}

enum Message {
    Job(Box<dyn Job>),
    Stop,
}

/// The handle writes are queued on; [`Writer::stop`] ends the thread once
/// what was queued before it is committed.
pub(crate) struct Writer {
    queue: std::sync::Mutex<Option<Sender<Message>>>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Writer {
    /// The writer of `state`, whose file is `data_dir`'s state file (opened
    /// again there after a fault).
    pub(crate) fn start(state: Arc<StateDb>, data_dir: PathBuf, wal: Wal) -> std::io::Result<Writer> {
        let (queue, jobs) = std::sync::mpsc::channel();
        let mut writing = Writing { state, data_dir, wal, reopen_at: None };
        let thread =
            std::thread::Builder::new().name("broker-store-writer".into()).spawn(move || writing.run(&jobs))?;
        Ok(Writer { queue: std::sync::Mutex::new(Some(queue)), thread: std::sync::Mutex::new(Some(thread)) })
    }

    /// Queue a job; it is answered (with [`StoreError::Closed`] once the store is closed).
    pub(crate) fn submit(&self, job: Box<dyn Job>) {
        let queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        match queue.as_ref() {
            Some(queue) => {
                if let Err(refused) = queue.send(Message::Job(job))
                    && let Message::Job(job) = refused.0
                {
                    job.finish(Err(StoreError::Closed));
                }
            }
            None => job.finish(Err(StoreError::Closed)),
        }
    }

    /// Commit what is queued, then end the thread; later writes are refused.
    pub(crate) fn stop(&self) {
        if let Some(queue) = self.queue.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = queue.send(Message::Stop);
        }
        if let Some(thread) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long a faulted store waits between attempts to open its file again.
const REOPEN_EVERY: Duration = Duration::from_secs(1);

/// How long a reopen waits for readers to let go of the old handle.
const READERS_LET_GO: Duration = Duration::from_secs(2);

/// The writer thread's state.
struct Writing {
    state: Arc<StateDb>,
    data_dir: PathBuf,
    wal: Wal,
    /// While faulted: when to try opening the file again.
    reopen_at: Option<Instant>,
}

impl Writing {
    fn run(&mut self, jobs: &Receiver<Message>) {
        let mut batch: Vec<Box<dyn Job>> = Vec::new();
        let mut stopping = false;
        while !stopping {
            // A reader's failed read faults the store too.
            self.note_fault();
            // Idle with frames in the log: checkpoint when they come of age, so a
            // quiet host's state file holds everything and its log is empty.
            // Faulted: try to reopen the file when it is time, writes or none.
            // Otherwise look again each REOPEN_EVERY, for a reader's fault.
            let wait = match self.reopen_at {
                Some(at) => at.saturating_duration_since(Instant::now()),
                None => self.wal.idle_for().map_or(REOPEN_EVERY, |wait| wait.min(REOPEN_EVERY)),
            };
            match jobs.recv_timeout(wait) {
                Ok(Message::Job(job)) => batch.push(job),
                Ok(Message::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    self.housekeep();
                    continue;
                }
            }
            while batch.len() < MAX_BATCH {
                match jobs.try_recv() {
                    Ok(Message::Job(job)) => batch.push(job),
                    Ok(Message::Stop) => {
                        stopping = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if self.reopen_at.is_some_and(|at| at <= Instant::now()) {
                self.reopen();
            }
            self.commit(std::mem::take(&mut batch));
        }
        if let Ok(db) = self.state.handle() {
            let _ = checkpoint(&self.state, &db, &mut self.wal);
        }
    }

    /// While idle: reopen a faulted file, or checkpoint an aged log.
    fn housekeep(&mut self) {
        if self.reopen_at.is_some() {
            self.reopen();
        } else if self.wal.idle_for().is_some_and(|wait| wait.is_zero())
            && let Ok(db) = self.state.handle()
            && checkpoint(&self.state, &db, &mut self.wal).is_ok()
            && !self.wal.unsettled()
        {
            // A log that failed is settled by the checkpoint: writes are taken again.
            self.state.log_settled();
        }
        self.note_fault();
    }

    /// After a failure: if it faulted the store, reopen soon.
    fn note_fault(&mut self) {
        if self.state.is_faulted() && self.reopen_at.is_none() {
            self.reopen_at = Some(Instant::now());
        }
    }

    /// Apply and commit a batch; on a failure, each job again in its own
    /// transaction, unless the file itself failed.
    fn commit(&mut self, mut batch: Vec<Box<dyn Job>>) {
        let _span = tracing::debug_span!("store_commit", writes = batch.len()).entered();
        let db = match self.state.handle() {
            Ok(db) => db,
            Err(refused) => {
                for job in batch {
                    finish(job, Err(refused.clone()));
                }
                self.note_fault();
                return;
            }
        };
        let outcome = apply_all(&self.state, &db, &mut self.wal, &mut batch);
        match &outcome {
            Ok(()) => self.state.log_settled(),
            Err(StoreError::Log(cause)) => self.state.log_failed(cause),
            Err(_) => {}
        }
        // A failure of the log or of the file is no job's: retrying each alone would only fail again.
        if outcome.is_ok() || batch.len() == 1 || matches!(outcome, Err(StoreError::Log(_) | StoreError::Faulted(_))) {
            for job in batch {
                finish(job, outcome.clone());
            }
            self.note_fault();
            return;
        }
        for mut job in batch {
            // Once the file has failed, the rest are refused with it, not tried.
            let alone = match self.state.handle() {
                Ok(_) => apply_all(&self.state, &db, &mut self.wal, std::slice::from_mut(&mut job)),
                Err(refused) => Err(refused),
            };
            if alone.is_ok() {
                self.state.log_settled();
            }
            finish(job, alone);
        }
        self.note_fault();
    }

    /// Close the faulted file and open it again, the log's committed frames
    /// applied on top (the file's own last writes may not have reached it);
    /// on a failure, try again later, or give up for good if the file is
    /// damaged.
    fn reopen(&mut self) {
        let _span = tracing::info_span!("store_reopen").entered();
        self.state.close();
        // redb panics on some damage: that is a file that cannot be reopened, not the writer's end.
        let reopened = super::salvage::caught(|| self.reopened()).unwrap_or_else(|payload| {
            let reason = format!("redb panicked reopening it: {}", super::salvage::panic_text(&*payload));
            Err(StoreError::Damaged { path: super::state_file(&self.data_dir).display().to_string(), reason })
        });
        match reopened {
            Ok(db) => {
                self.state.healed(db);
                self.reopen_at = None;
                // The log is in the file now: a new generation, settled.
                if restarted(&mut self.wal).is_ok() && !self.wal.unsettled() {
                    self.state.log_settled();
                }
            }
            Err(why) if transient(&why) => {
                tracing::warn!(error = %why, "the state file cannot be reopened yet; trying again");
                self.reopen_at = Some(Instant::now() + REOPEN_EVERY);
            }
            Err(why) => {
                self.state.fatal(&why);
                self.reopen_at = Some(Instant::now() + REOPEN_EVERY);
            }
        }
    }

    fn reopened(&self) -> Result<Database, StoreError> {
        let path = super::state_file(&self.data_dir);
        // Gone (moved or deleted under the daemon): never made anew empty,
        // which would lose every record; refused until it is back.
        if let Err(missing) = std::fs::symlink_metadata(&path) {
            return Err(StoreError::Open {
                path: path.display().to_string(),
                cause: Arc::new(redb::Error::Io(missing)),
            });
        }
        let waited = Instant::now();
        let db = loop {
            match super::open_database(&self.data_dir) {
                Ok(db) => break db,
                // A reader still holds the old handle.
                Err(redb::DatabaseError::DatabaseAlreadyOpen) if waited.elapsed() < READERS_LET_GO => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(error) => return Err(StoreError::Db(Arc::new(error.into()))),
            }
        };
        // Another broker's file put in its place is not this one's to write.
        super::refuse_newer(&db, &path)?;
        let txn = db.begin_write().map_err(super::db_error)?;
        let replayed = self
            .wal
            .replay_committed(|table, key, value| super::replay_change(&txn, table, key, value))
            .map_err(|e| StoreError::Log(Arc::new(e)))?;
        txn.commit().map_err(super::db_error)?;
        tracing::info!(frames = replayed, "reopened the state file and applied the log's committed writes");
        Ok(db)
    }
}

/// A reopen that failed for a reason that may pass: the disk's I/O (full,
/// read-only, failing), the log's, or a reader still holding the old handle.
fn transient(why: &StoreError) -> bool {
    match why {
        StoreError::Db(cause) | StoreError::Open { cause, .. } => {
            super::db::is_io_failure(cause) || matches!(**cause, redb::Error::DatabaseAlreadyOpen)
        }
        StoreError::Log(cause) => matches!(**cause, super::WalError::Io { .. }),
        _ => false,
    }
}

/// Make the state file hold every logged write (an empty transaction with
/// redb's durability), then start the log afresh, which also settles it.
/// A failure is said here and tried again after the checkpoint age.
fn checkpoint(state: &StateDb, db: &Database, wal: &mut Wal) -> Result<(), StoreError> {
    let _span = tracing::debug_span!("store_checkpoint").entered();
    let committed = db.begin_write().map_err(redb::Error::from).and_then(|txn| txn.commit().map_err(redb::Error::from));
    if let Err(error) = committed {
        tracing::error!(%error, "a checkpoint of the state file failed; the log keeps the writes");
        wal.postpone();
        return Err(state.failed(error));
    }
    restarted(wal)
}

/// Start the log's next generation after a durable commit.
fn restarted(wal: &mut Wal) -> Result<(), StoreError> {
    wal.restart().map_err(|error| {
        // Writes are refused until a restart succeeds: the header on disk
        // may be either generation's.
        tracing::error!(%error, "the write-ahead log could not be restarted after a checkpoint");
        StoreError::Log(error)
    })
}

/// One transaction: the jobs applied, their changes logged and synced, then
/// committed (with redb's own sync only at a checkpoint).
fn apply_all(state: &StateDb, db: &Database, wal: &mut Wal, batch: &mut [Box<dyn Job>]) -> Result<(), StoreError> {
    apply_batch(state, db, wal, batch).map_err(|failed| state.noted(failed))
}

fn apply_batch(state: &StateDb, db: &Database, wal: &mut Wal, batch: &mut [Box<dyn Job>]) -> Result<(), StoreError> {
    if wal.unsettled() {
        // A frame on disk may be one whose batch failed: checkpoint and
        // restart the log before anything more is logged, or refuse at once
        // if that failed less than a checkpoint age ago.
        if let Some(cause) = wal.refusal() {
            return Err(StoreError::Log(cause));
        }
        checkpoint(state, db, wal)?;
    }
    let mut txn = db.begin_write().map_err(super::db_error)?;
    let durable = wal.checkpoint_due();
    if !durable {
        txn.set_durability(Durability::None).map_err(super::db_error)?;
    }
    let logged = Txn::new(&txn);
    for job in batch.iter_mut() {
        // A job that panics fails (its batch, then itself alone), not the writer:
        // the writer serves every provider. Dropping the transaction aborts it.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.apply(&logged)))
            .unwrap_or_else(|_| Err(StoreError::WritePanicked))?;
    }
    let frame = logged.into_frame();
    if let Some(mut frame) = frame {
        // Logged (and synced) before the commit: a reader never sees a write
        // that a crash could take back.
        wal.append(&mut frame).map_err(StoreError::Log)?;
        if let Err(error) = txn.commit() {
            // Whatever redb did, the callers are told the batch failed: its
            // frame must not be replayed.
            wal.retract(frame.len());
            return Err(super::db_error(error));
        }
    } else {
        txn.commit().map_err(super::db_error)?;
    }
    if durable {
        // The batch itself is durable; a failed restart only stops later writes.
        let _ = restarted(wal);
    }
    Ok(())
}

/// Answer a job; a panic in its answer is its own.
fn finish(job: Box<dyn Job>, outcome: Result<(), StoreError>) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.finish(outcome))).is_err() {
        tracing::error!("a store write panicked while it was answered");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::TableDefinition;

    const T: TableDefinition<u64, u64> = TableDefinition::new("t");

    fn put(key: u64, value: u64) -> impl FnMut(&Txn<'_>) -> Result<u64, StoreError> + Send + 'static {
        move |txn| {
            if value == u64::MAX {
                let refusal = serde_json::from_str::<u64>("refused on purpose").unwrap_err();
                return Err(StoreError::Encode { what: "test", cause: std::sync::Arc::new(refusal) });
            }
            txn.open_table(T).map_err(super::super::db_error)?.insert(key, value).map_err(super::super::db_error)?;
            Ok(key)
        }
    }

    fn wal(dir: &std::path::Path) -> Wal {
        // No checkpoint by age during a test: what the log holds is what the test wrote.
        let checkpoints =
            super::super::wal::Checkpoints { age: std::time::Duration::from_secs(3600), ..Default::default() };
        Wal::open(&dir.join("wal"), checkpoints).unwrap()
    }

    fn value(db: &StateDb, key: u64) -> Option<u64> {
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(T).ok()?;
        table.get(key).unwrap().map(|v| v.value())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writes_commit_together_and_one_failure_fails_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(StateDb::new(Database::create(dir.path().join("state.redb")).unwrap()));
        let writer = Arc::new(Writer::start(db.clone(), dir.path().to_owned(), wal(dir.path())).unwrap());
        let tasks: Vec<_> = (0..200u64)
            .map(|n| {
                let writer = writer.clone();
                // Every 50th write fails; the batch it lands in is retried job by job.
                tokio::spawn(
                    async move { Pending::new(&writer, put(n, if n % 50 == 7 { u64::MAX } else { n * 10 })).await },
                )
            })
            .collect();
        for (n, task) in tasks.into_iter().enumerate() {
            let answer = task.await.unwrap();
            if n % 50 == 7 {
                assert!(matches!(answer, Err(StoreError::Encode { what: "test", .. })), "{answer:?}");
            } else {
                assert_eq!(answer.unwrap(), n as u64);
            }
        }
        for n in 0..200u64 {
            let expected = (n % 50 != 7).then_some(n * 10);
            assert_eq!(value(&db, n), expected, "key {n}");
        }
        assert_eq!(Pending::new(&writer, put(1000, 1)).wait().unwrap(), 1000);
        // A write that panics fails alone; the writer serves on.
        let panicked = Pending::new(&writer, |_: &Txn<'_>| -> Result<(), StoreError> { panic!("on purpose") });
        assert!(matches!(panicked.wait(), Err(StoreError::WritePanicked)));
        assert_eq!(Pending::new(&writer, put(1003, 3)).await.unwrap(), 1003);
        assert_eq!(value(&db, 1003), Some(3));
        // Made, then dropped unused: nothing is written.
        drop(Pending::new(&writer, put(1002, 1)));
        writer.stop();
        assert!(matches!(Pending::new(&writer, put(1001, 1)).await, Err(StoreError::Closed)));
        assert_eq!(value(&db, 1002), None);
        assert_eq!(value(&db, 1001), None);
    }

    /// A log left unsettled (a frame whose batch failed could not be erased)
    /// is checkpointed and restarted before the next batch is logged: that
    /// batch commits, and the failed frame is never replayed.
    #[test]
    fn an_unsettled_log_is_settled_before_the_next_batch() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(StateDb::new(Database::create(dir.path().join("state.redb")).unwrap()));
        let mut log = wal(dir.path());
        log.append(&mut super::super::wal::tests::frame(&[("t", b"failed", Some(b"1"))])).unwrap();
        log.unsettle(std::io::Error::other("a failed erase, on purpose"));
        let writer = Arc::new(Writer::start(db.clone(), dir.path().to_owned(), log).unwrap());
        assert_eq!(Pending::new(&writer, put(1, 10)).wait().unwrap(), 1);
        // Read while the writer runs: stopping it checkpoints and empties the log.
        let seen = super::super::wal::tests::replayed(&dir.path().join("wal"));
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].0, "t");
        assert_eq!(seen[0].1, 1u64.to_le_bytes());
        assert_eq!(value(&db, 1), Some(10));
        writer.stop();
    }

    /// A job joined to a write commits with it or not at all, and each is answered.
    #[test]
    fn joined_writes_commit_together_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(StateDb::new(Database::create(dir.path().join("state.redb")).unwrap()));
        let writer = Arc::new(Writer::start(db.clone(), dir.path().to_owned(), wal(dir.path())).unwrap());
        let first = |key| -> (Box<dyn Job>, std::sync::mpsc::Receiver<Result<u64, StoreError>>) {
            let (reply, answer) = std::sync::mpsc::sync_channel(1);
            (Box::new(Op { op: put(key, 1), result: None, reply: Reply::Thread(reply) }), answer)
        };
        let (job, first_answer) = first(1);
        assert_eq!(Pending::new(&writer, put(2, 2)).joined(job).wait().unwrap(), 2);
        assert_eq!(first_answer.recv().unwrap().unwrap(), 1);
        assert_eq!((value(&db, 1), value(&db, 2)), (Some(1), Some(2)));
        // The second fails: the first, applied in the same transaction, is not committed.
        let (job, first_answer) = first(3);
        assert!(Pending::new(&writer, put(4, u64::MAX)).joined(job).wait().is_err());
        assert!(first_answer.recv().unwrap().is_err());
        assert_eq!((value(&db, 3), value(&db, 4)), (None, None));
    }
}
