//! The store's write-ahead log, `state.wal` beside `state.redb`: what makes a
//! batch durable with one small sequential write and one `fdatasync`, instead
//! of redb's commit of every page the batch dirtied.
//!
//! The writer applies a batch in a redb transaction through [`Txn`], which
//! notes every insert and remove as it happens; the batch's changes go to the
//! log as one frame (durable before anyone is answered), and the transaction
//! commits without a sync. A *checkpoint* — a batch committed with redb's own
//! durability, when the log has grown or aged — makes everything before it
//! durable in the state file; the log then starts a new generation.
//!
//! Opening the store applies the log's frames of the current generation, in
//! order, to the state file's last durable state. That is right whatever the
//! last checkpoint included: every change logged is a blind insert or remove
//! of a whole value, as the job that made it decided, so replaying a run of
//! frames over a state that already holds a prefix of them ends where the run
//! ends. A torn last frame (a crash mid-append) fails its checksum and ends
//! the replay: its writes were never answered.
//!
//! Layout: a header at 0 (magic, generation, CRC-32 of both), frames from
//! [`FRAMES_AT`]: length, generation, CRC-32 of generation and payload, then
//! the payload — changes, each a table name, a key and a value or none.

use nix::fcntl::OFlag;
use redb::{Key, TableDefinition, TableError, TableHandle, Value, WriteTransaction};
use std::borrow::Borrow;
use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"BRKRWAL1";
const HEADER_LEN: usize = 20;
/// Where frames begin: the header has a block of its own.
pub(crate) const FRAMES_AT: u64 = 4096;
const FRAME_HEADER_LEN: usize = 16;

const PUT: u8 = 1;
const REMOVE: u8 = 2;

/// When the writer checkpoints: once the log holds `bytes`, or its oldest
/// frame is `age` old (then also when the store goes idle).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Checkpoints {
    pub bytes: u64,
    pub age: Duration,
}

impl Default for Checkpoints {
    fn default() -> Self {
        // A checkpoint writes what the frames since the last one dirtied: a
        // second of changes keeps it to milliseconds and bounds what redb
        // holds in memory between two.
        Checkpoints { bytes: 16 << 20, age: Duration::from_secs(1) }
    }
}

/// Why the log cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("write-ahead log {path} is not a regular file")]
    NotAFile { path: String },
    #[error(
        "write-ahead log {path} has a corrupt header; the changes committed since the last \
         checkpoint are in it. Move it aside to open the state file without them"
    )]
    CorruptHeader { path: String },
    #[error("write-ahead log {path}, frame at byte {offset}: {reason}")]
    CorruptFrame { path: String, offset: u64, reason: String },
}

/// The log file and where the next frame goes.
pub(crate) struct Wal {
    file: File,
    path: PathBuf,
    generation: u64,
    /// Where the next frame is written.
    end: u64,
    /// When the first frame since the last checkpoint was written.
    oldest: Option<Instant>,
    checkpoints: Checkpoints,
}

impl Wal {
    /// Open (or create) the log at `path`, never through a symlink and never
    /// anything but a regular file.
    pub(crate) fn open(path: &Path, checkpoints: Checkpoints) -> Result<Wal, WalError> {
        let shown = || path.display().to_string();
        let io_error = |source| WalError::Io { path: shown(), source };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            // A FIFO would block the open without O_NONBLOCK; it is refused below.
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC).bits())
            .open(path)
            .map_err(io_error)?;
        let meta = file.metadata().map_err(io_error)?;
        if !meta.file_type().is_file() {
            return Err(WalError::NotAFile { path: shown() });
        }
        let mut wal = Wal { file, path: path.to_owned(), generation: 0, end: FRAMES_AT, oldest: None, checkpoints };
        if meta.len() < HEADER_LEN as u64 {
            // New, or made by a crash before its header landed: nothing was logged in it.
            wal.write_header(1).map_err(io_error)?;
            return Ok(wal);
        }
        let mut header = [0u8; HEADER_LEN];
        wal.file.read_exact_at(&mut header, 0).map_err(io_error)?;
        let crc = u32::from_le_bytes(header[16..20].try_into().unwrap_or_default());
        if &header[..8] != MAGIC || crc32fast::hash(&header[..16]) != crc {
            return Err(WalError::CorruptHeader { path: shown() });
        }
        wal.generation = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        Ok(wal)
    }

    /// Each frame of the current generation, in order, until the first that
    /// is torn or of an older generation; the next frame goes after the last.
    pub(crate) fn replay(
        &mut self,
        mut apply: impl FnMut(&str, &[u8], Option<&[u8]>) -> Result<(), String>,
    ) -> Result<usize, WalError> {
        let len = self.file.metadata().map_err(|source| self.io_error(source))?.len();
        let mut at = FRAMES_AT;
        let mut frames = 0;
        while at + FRAME_HEADER_LEN as u64 <= len {
            let mut header = [0u8; FRAME_HEADER_LEN];
            self.file.read_exact_at(&mut header, at).map_err(|source| self.io_error(source))?;
            let size = u64::from(u32::from_le_bytes(header[..4].try_into().unwrap_or_default()));
            let generation = u64::from_le_bytes(header[4..12].try_into().unwrap_or_default());
            let crc = u32::from_le_bytes(header[12..16].try_into().unwrap_or_default());
            let body = at + FRAME_HEADER_LEN as u64;
            if size == 0 || generation != self.generation || body + size > len {
                break;
            }
            let mut payload = vec![0u8; size as usize];
            self.file.read_exact_at(&mut payload, body).map_err(|source| self.io_error(source))?;
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(&header[4..12]);
            hasher.update(&payload);
            if hasher.finalize() != crc {
                tracing::warn!(path = %self.path.display(), offset = at, "the log ends in a torn frame; its writes were never answered");
                break;
            }
            let corrupt =
                |reason: String| WalError::CorruptFrame { path: self.path.display().to_string(), offset: at, reason };
            for change in Changes(&payload) {
                let (table, key, value) = change.map_err(|reason| corrupt(reason.to_owned()))?;
                apply(table, key, value).map_err(corrupt)?;
            }
            frames += 1;
            at = body + size;
        }
        self.end = at;
        self.oldest = (frames > 0).then(Instant::now);
        Ok(frames)
    }

    /// Write a frame of `changes` and make it durable.
    pub(crate) fn append(&mut self, changes: &[u8]) -> Result<(), WalError> {
        let size = u32::try_from(changes.len())
            .map_err(|_| self.io_error(io::Error::new(io::ErrorKind::InvalidInput, "a batch of over 4 GiB")))?;
        let generation = self.generation.to_le_bytes();
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&generation);
        hasher.update(changes);
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + changes.len());
        frame.extend_from_slice(&size.to_le_bytes());
        frame.extend_from_slice(&generation);
        frame.extend_from_slice(&hasher.finalize().to_le_bytes());
        frame.extend_from_slice(changes);
        self.file.write_all_at(&frame, self.end).map_err(|source| self.io_error(source))?;
        self.file.sync_data().map_err(|source| self.io_error(source))?;
        self.end += frame.len() as u64;
        self.oldest.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Undo the last [`Wal::append`] of `len` bytes of changes: its
    /// transaction did not commit, so it must not be replayed.
    pub(crate) fn retract(&mut self, len: usize) {
        let at = self.end - (FRAME_HEADER_LEN + len) as u64;
        let erased = self.file.write_all_at(&[0u8; 4], at).and_then(|()| self.file.sync_data());
        match erased {
            Ok(()) => self.end = at,
            // The frame stays: replaying it applies writes that were answered
            // with an error. Said, since nothing better can be done.
            Err(error) => {
                tracing::error!(path = %self.path.display(), %error, "a frame whose commit failed could not be erased")
            }
        }
    }

    /// Whether the next batch should be a checkpoint.
    pub(crate) fn checkpoint_due(&self) -> bool {
        self.end - FRAMES_AT >= self.checkpoints.bytes
            || self.oldest.is_some_and(|t| t.elapsed() >= self.checkpoints.age)
    }

    /// How long the writer may wait idle before it checkpoints (`None`: the log is empty).
    pub(crate) fn idle_for(&self) -> Option<Duration> {
        self.oldest.map(|t| self.checkpoints.age.saturating_sub(t.elapsed()))
    }

    /// A checkpoint failed: try again after another `age`, not at once (the
    /// idle writer would spin on a failing disk).
    pub(crate) fn postpone(&mut self) {
        if self.oldest.is_some() {
            self.oldest = Some(Instant::now());
        }
    }

    /// After a checkpoint (a commit durable in the state file): start a new generation.
    pub(crate) fn restart(&mut self) -> Result<(), WalError> {
        if self.end == FRAMES_AT && self.oldest.is_none() {
            return Ok(());
        }
        self.write_header(self.generation + 1).map_err(|source| self.io_error(source))
    }

    fn write_header(&mut self, generation: u64) -> io::Result<()> {
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(MAGIC);
        header[8..16].copy_from_slice(&generation.to_le_bytes());
        let crc = crc32fast::hash(&header[..16]);
        header[16..20].copy_from_slice(&crc.to_le_bytes());
        self.file.write_all_at(&header, 0)?;
        self.file.sync_data()?;
        (self.generation, self.end, self.oldest) = (generation, FRAMES_AT, None);
        Ok(())
    }

    fn io_error(&self, source: io::Error) -> WalError {
        WalError::Io { path: self.path.display().to_string(), source }
    }
}

/// A write transaction whose inserts and removes are noted for the log.
/// Reads go straight to redb.
pub struct Txn<'t> {
    txn: &'t WriteTransaction,
    changes: RefCell<Vec<u8>>,
}

impl<'t> Txn<'t> {
    pub(crate) fn new(txn: &'t WriteTransaction) -> Self {
        Txn { txn, changes: RefCell::default() }
    }

    /// The changes noted, encoded for a frame.
    pub(crate) fn into_changes(self) -> Vec<u8> {
        self.changes.into_inner()
    }

    pub fn open_table<K: Key + 'static, V: Value + 'static>(
        &self,
        definition: TableDefinition<'static, K, V>,
    ) -> Result<LoggedTable<'_, K, V>, TableError> {
        let name = definition.name().to_owned();
        Ok(LoggedTable { table: self.txn.open_table(definition)?, name, changes: &self.changes })
    }
}

/// A table of a [`Txn`]: reads through `Deref`, writes noted.
pub struct LoggedTable<'t, K: Key + 'static, V: Value + 'static> {
    table: redb::Table<'t, K, V>,
    name: String,
    changes: &'t RefCell<Vec<u8>>,
}

impl<K: Key + 'static, V: Value + 'static> LoggedTable<'_, K, V> {
    pub fn insert<'k, 'v>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
        value: impl Borrow<V::SelfType<'v>>,
    ) -> Result<Option<redb::AccessGuard<'_, V>>, redb::StorageError> {
        let (key, value) = (key.borrow(), value.borrow());
        self.note(PUT, K::as_bytes(key).as_ref(), Some(V::as_bytes(value).as_ref()));
        self.table.insert(key, value)
    }

    pub fn remove<'k>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> Result<Option<redb::AccessGuard<'_, V>>, redb::StorageError> {
        let key = key.borrow();
        self.note(REMOVE, K::as_bytes(key).as_ref(), None);
        self.table.remove(key)
    }

    fn note(&self, kind: u8, key: &[u8], value: Option<&[u8]>) {
        let mut changes = self.changes.borrow_mut();
        changes.push(kind);
        put_bytes(&mut changes, self.name.as_bytes());
        put_bytes(&mut changes, key);
        if let Some(value) = value {
            put_bytes(&mut changes, value);
        }
    }
}

impl<'t, K: Key + 'static, V: Value + 'static> std::ops::Deref for LoggedTable<'t, K, V> {
    type Target = redb::Table<'t, K, V>;

    fn deref(&self) -> &Self::Target {
        &self.table
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Keys and values are bounded by redb (under 4 GiB); the table name is ours.
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// The changes of one frame: (table, key, value or `None` for a remove).
struct Changes<'a>(&'a [u8]);

type Change<'a> = (&'a str, &'a [u8], Option<&'a [u8]>);

impl<'a> Changes<'a> {
    fn bytes(&mut self) -> Result<&'a [u8], &'static str> {
        let (len, rest) = self.0.split_first_chunk::<4>().ok_or("a length cut short")?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err("a field longer than its frame");
        }
        let (bytes, rest) = rest.split_at(len);
        self.0 = rest;
        Ok(bytes)
    }

    fn change(&mut self) -> Result<Change<'a>, &'static str> {
        let (&kind, rest) = self.0.split_first().ok_or("empty")?;
        self.0 = rest;
        let table = std::str::from_utf8(self.bytes()?).map_err(|_| "a table name that is not UTF-8")?;
        let key = self.bytes()?;
        match kind {
            PUT => Ok((table, key, Some(self.bytes()?))),
            REMOVE => Ok((table, key, None)),
            _ => Err("an unknown kind of change"),
        }
    }
}

impl<'a> Iterator for Changes<'a> {
    type Item = Result<Change<'a>, &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let change = self.change();
        if change.is_err() {
            self.0 = &[];
        }
        Some(change)
    }
}

/// Apply one logged change to `definition`'s table in `txn`.
pub(crate) fn replay_into<K: Key + 'static, V: Value + 'static>(
    txn: &WriteTransaction,
    definition: TableDefinition<'static, K, V>,
    key: &[u8],
    value: Option<&[u8]>,
) -> Result<(), String> {
    // redb decodes fixed-width and tuple types by slicing; a frame that passed
    // its checksum was written by this code, but a bad one must not panic here.
    let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), redb::Error> {
        let mut table = txn.open_table(definition)?;
        let key = K::from_bytes(key);
        match value {
            Some(value) => drop(table.insert(key, V::from_bytes(value))?),
            None => drop(table.remove(key)?),
        }
        Ok(())
    }));
    match applied {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(format!("table {}: {error}", definition.name())),
        Err(_) => Err(format!("table {}: a key or value that does not decode", definition.name())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_round_trip_and_garbage_is_an_error_not_a_panic() {
        let mut out = Vec::new();
        out.push(PUT);
        put_bytes(&mut out, b"kv");
        put_bytes(&mut out, b"key");
        put_bytes(&mut out, b"value");
        let first = out.len();
        out.push(REMOVE);
        put_bytes(&mut out, b"kv");
        put_bytes(&mut out, b"gone");
        let changes: Vec<_> = Changes(&out).collect::<Result<_, _>>().unwrap();
        assert_eq!(changes, [("kv", &b"key"[..], Some(&b"value"[..])), ("kv", &b"gone"[..], None)]);
        for cut in 1..out.len() {
            // Every prefix either decodes to fewer changes or ends in an error.
            let decoded: Vec<_> = Changes(&out[..cut]).collect();
            assert!(decoded.len() <= 2);
            if cut != first {
                assert!(decoded.last().unwrap().is_err(), "a frame cut at {cut} decoded whole");
            }
        }
        assert!(Changes(&[9, 0, 0, 0, 0]).next().unwrap().is_err());
    }
}
