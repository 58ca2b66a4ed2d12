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
//! Layout: a header at 0 (magic, generation, a random salt, CRC-32 of the
//! three), frames from [`FRAMES_AT`]: length, generation, CRC-32, then the
//! payload — changes, each a table name, a key and a value or none. A frame's
//! CRC covers the salt and the frame's offset as well as its bytes: a restart
//! does not erase the file, and the bytes past the last frame (older frames,
//! holding values a provider chose) must never read as a frame of the
//! current generation. A provider cannot know the salt of a generation that
//! starts after its value was written, so a forgery is a 1 in 2^32 guess.
//! (CRC-32 is not a MAC: whoever can read the log's frames can read its
//! header and salt too; the log is the host's, never a provider's to read.)
//! Version 1 logs, without salt, are replayed once and restarted as version 2.
//!
//! Any failure of the log (a write, a sync, an erase, a new header) leaves
//! it *unsettled*: what the file holds is no longer known, so nothing more is
//! appended until a checkpoint and a new generation succeed. Settling is
//! tried at once; after it fails, writes are refused with the error that
//! unsettled the log until the checkpoint age has passed, then tried again.

use nix::fcntl::OFlag;
use redb::{Key, TableDefinition, TableError, TableHandle, Value, WriteTransaction};
use std::borrow::Borrow;
use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"BRKRWAL2";
/// Magic, generation, salt, CRC-32.
const HEADER_LEN: usize = 28;
const MAGIC_V1: &[u8; 8] = b"BRKRWAL1";
/// Magic, generation, CRC-32.
const V1_HEADER_LEN: usize = 20;
/// Where frames begin: the header has a block of its own.
pub(crate) const FRAMES_AT: u64 = 4096;
/// Length, generation, CRC-32.
pub(crate) const FRAME_HEADER_LEN: usize = 16;

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
    /// Opening, reading, writing or syncing it failed.
    #[error("write-ahead log {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Io {
        /// The log file.
        path: String,
        /// The I/O error.
        cause: io::Error,
    },
    /// Something other than a regular file is at its path.
    #[error("write-ahead log {path} is not a regular file")]
    NotAFile {
        /// The log file.
        path: String,
    },
    /// Its header does not check.
    #[error(
        "write-ahead log {path} has a corrupt header; the changes committed since the last \
         checkpoint are in it. Move it aside to open the state file without them"
    )]
    CorruptHeader {
        /// The log file.
        path: String,
    },
    /// A frame whose checksum holds could not be decoded or replayed.
    #[error("write-ahead log {path}, frame at byte {offset}: {reason}")]
    CorruptFrame {
        /// The log file.
        path: String,
        /// Where the frame starts, in bytes from the start of the file.
        offset: u64,
        /// What was wrong with it.
        reason: String,
    },
}

/// How the frames of the header's generation are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// CRC-32 of generation and payload.
    V1,
    /// CRC-32 of salt, offset, length, generation and payload.
    V2 { salt: u64 },
}

/// Why the log is unsettled, and when settling it may be tried next.
struct Unsettled {
    cause: Arc<WalError>,
    retry_at: Instant,
}

/// The log file and where the next frame goes.
pub(crate) struct Wal {
    file: File,
    path: PathBuf,
    generation: u64,
    format: Format,
    /// Where the next frame is written.
    end: u64,
    /// When the first frame since the last checkpoint was written.
    oldest: Option<Instant>,
    /// A write to the file failed: see the module's doc.
    unsettled: Option<Unsettled>,
    checkpoints: Checkpoints,
}

impl Wal {
    /// Open (or create) the log at `path`, never through a symlink and never
    /// anything but a regular file.
    pub(crate) fn open(path: &Path, checkpoints: Checkpoints) -> Result<Wal, WalError> {
        let shown = || path.display().to_string();
        let io_error = |source| WalError::Io { path: shown(), cause: source };
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
        let mut wal = Wal {
            file,
            path: path.to_owned(),
            generation: 0,
            format: Format::V1,
            end: FRAMES_AT,
            oldest: None,
            unsettled: None,
            checkpoints,
        };
        if meta.len() < V1_HEADER_LEN as u64 {
            // New, or made by a crash before its header landed: nothing was logged in it.
            wal.write_header(1).map_err(io_error)?;
            // The file's name must survive a crash as well as its bytes.
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_error)?;
            return Ok(wal);
        }
        let mut header = [0u8; HEADER_LEN];
        let read = (meta.len() as usize).min(HEADER_LEN);
        wal.file.read_exact_at(&mut header[..read], 0).map_err(io_error)?;
        let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap_or_default());
        let crc_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap_or_default());
        wal.generation = word(8);
        wal.format = if &header[..8] == MAGIC && read == HEADER_LEN && crc32fast::hash(&header[..24]) == crc_at(24) {
            Format::V2 { salt: word(16) }
        } else if &header[..8] == MAGIC_V1 && crc32fast::hash(&header[..16]) == crc_at(16) {
            Format::V1
        } else {
            return Err(WalError::CorruptHeader { path: shown() });
        };
        Ok(wal)
    }

    /// Each frame of the current generation, in order, until the first that
    /// is torn or not of this generation; the next frame goes after the last.
    pub(crate) fn replay(
        &mut self,
        apply: impl FnMut(&str, &[u8], Option<&[u8]>) -> Result<(), String>,
    ) -> Result<usize, WalError> {
        let len = self.file.metadata().map_err(|source| self.io_error(source))?.len();
        let (frames, end) = self.read_frames(len, apply)?;
        self.end = end;
        self.oldest = (frames > 0).then(Instant::now);
        Ok(frames)
    }

    /// The frames this process appended since the last restart, each batch
    /// that was answered as committed and none other (the file past them may
    /// hold a frame whose batch failed): what a reopened state file is missing.
    pub(crate) fn replay_committed(
        &self,
        apply: impl FnMut(&str, &[u8], Option<&[u8]>) -> Result<(), String>,
    ) -> Result<usize, WalError> {
        let (frames, end) = self.read_frames(self.end, apply)?;
        if end != self.end {
            let reason = format!("the log's frames end at {end}, not at {} as they were written", self.end);
            return Err(WalError::CorruptFrame { path: self.path.display().to_string(), offset: end, reason });
        }
        Ok(frames)
    }

    /// The frames before `len`: how many, and where the last one ends.
    fn read_frames(
        &self,
        len: u64,
        mut apply: impl FnMut(&str, &[u8], Option<&[u8]>) -> Result<(), String>,
    ) -> Result<(usize, u64), WalError> {
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
            if self.frame_crc(at, &header, &payload) != crc {
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
        Ok((frames, at))
    }

    fn frame_crc(&self, at: u64, header: &[u8], payload: &[u8]) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        match self.format {
            Format::V1 => hasher.update(&header[4..12]),
            Format::V2 { salt } => {
                hasher.update(&salt.to_le_bytes());
                hasher.update(&at.to_le_bytes());
                hasher.update(&header[..12]);
            }
        }
        hasher.update(payload);
        hasher.finalize()
    }

    /// Write `frame` (a [`Txn`]'s, its header still to fill) and make it
    /// durable. Refused while the log is unsettled.
    pub(crate) fn append(&mut self, frame: &mut [u8]) -> Result<(), Arc<WalError>> {
        if let Some(unsettled) = &self.unsettled {
            return Err(unsettled.cause.clone());
        }
        let (header, payload) = frame.split_at_mut(FRAME_HEADER_LEN);
        let Ok(size) = u32::try_from(payload.len()) else {
            let too_big = io::Error::new(io::ErrorKind::InvalidInput, "a batch of over 4 GiB");
            return Err(Arc::new(self.io_error(too_big)));
        };
        header[..4].copy_from_slice(&size.to_le_bytes());
        header[4..12].copy_from_slice(&self.generation.to_le_bytes());
        let crc = self.frame_crc(self.end, header, payload);
        header[12..16].copy_from_slice(&crc.to_le_bytes());
        let written = self.file.write_all_at(frame, self.end).and_then(|()| self.file.sync_data());
        if let Err(source) = written {
            // The frame may be on disk, whole or in part, though its batch
            // fails: erased if the disk lets us, and in any case never
            // appended after until a new generation starts.
            let _ = self.erase_at(self.end);
            return Err(self.unsettle(source));
        }
        self.end += frame.len() as u64;
        self.oldest.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Undo the last [`Wal::append`] of a `len`-byte frame: its transaction
    /// did not commit, so it must not be replayed.
    pub(crate) fn retract(&mut self, len: usize) {
        self.end -= len as u64;
        if let Err(error) = self.erase_at(self.end) {
            // Until a new generation starts, a crash would replay writes that
            // were answered with an error.
            tracing::error!(path = %self.path.display(), %error, "a frame whose commit failed could not be erased");
            self.unsettle(error);
        }
    }

    /// Make the frame at `at` end the chain: a zero length, synced.
    fn erase_at(&self, at: u64) -> io::Result<()> {
        self.file.write_all_at(&[0u8; 4], at).and_then(|()| self.file.sync_data())
    }

    /// Whether nothing may be appended until a checkpoint and [`Wal::restart`].
    pub(crate) fn unsettled(&self) -> bool {
        self.unsettled.is_some()
    }

    /// While unsettled and settling failed less than the checkpoint age ago:
    /// the error every write is refused with.
    pub(crate) fn refusal(&self) -> Option<Arc<WalError>> {
        let unsettled = self.unsettled.as_ref()?;
        (Instant::now() < unsettled.retry_at).then(|| unsettled.cause.clone())
    }

    /// Note a failed write to the log; the error, for the caller.
    pub(super) fn unsettle(&mut self, source: io::Error) -> Arc<WalError> {
        let cause = Arc::new(self.io_error(source));
        // Settling is tried at once (at the next batch, or by the idle writer).
        self.unsettled = Some(Unsettled { cause: cause.clone(), retry_at: Instant::now() });
        self.oldest.get_or_insert_with(Instant::now);
        cause
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

    /// A checkpoint (or the restart after it) failed: try again after
    /// another `age`, not at once (the idle writer would spin on a failing disk).
    pub(crate) fn postpone(&mut self) {
        if self.oldest.is_some() {
            self.oldest = Some(Instant::now());
        }
        if let Some(unsettled) = &mut self.unsettled {
            unsettled.retry_at = Instant::now() + self.checkpoints.age;
        }
    }

    /// After a checkpoint (a commit durable in the state file): start a new
    /// generation, which settles the log. A failure leaves it unsettled: the
    /// header on disk may be the old or the new one.
    pub(crate) fn restart(&mut self) -> Result<(), Arc<WalError>> {
        let settled = self.unsettled.is_none() && matches!(self.format, Format::V2 { .. });
        if settled && self.end == FRAMES_AT && self.oldest.is_none() {
            return Ok(());
        }
        self.write_header(self.generation + 1).map_err(|source| {
            let cause = self.unsettle(source);
            self.postpone();
            cause
        })
    }

    fn write_header(&mut self, generation: u64) -> io::Result<()> {
        let salt = getrandom::u64().map_err(|e| io::Error::other(format!("no random salt: {e}")))?;
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(MAGIC);
        header[8..16].copy_from_slice(&generation.to_le_bytes());
        header[16..24].copy_from_slice(&salt.to_le_bytes());
        let crc = crc32fast::hash(&header[..24]);
        header[24..28].copy_from_slice(&crc.to_le_bytes());
        self.file.write_all_at(&header, 0)?;
        self.file.sync_data()?;
        self.generation = generation;
        self.format = Format::V2 { salt };
        (self.end, self.oldest, self.unsettled) = (FRAMES_AT, None, None);
        Ok(())
    }

    fn io_error(&self, source: io::Error) -> WalError {
        WalError::Io { path: self.path.display().to_string(), cause: source }
    }

    #[cfg(test)]
    fn header_salt(&self) -> u64 {
        match self.format {
            Format::V2 { salt } => salt,
            Format::V1 => 0,
        }
    }
}

/// A write transaction whose inserts and removes are noted for the log.
/// Reads go straight to redb.
pub(crate) struct Txn<'t> {
    txn: &'t WriteTransaction,
    changes: RefCell<Vec<u8>>,
}

impl<'t> Txn<'t> {
    pub(crate) fn new(txn: &'t WriteTransaction) -> Self {
        // Room for the frame's header, so the frame is written as it was noted.
        let mut changes = Vec::with_capacity(512);
        changes.resize(FRAME_HEADER_LEN, 0);
        Txn { txn, changes: RefCell::new(changes) }
    }

    /// The changes noted, as a frame for [`Wal::append`]; `None` if there are none.
    pub(crate) fn into_frame(self) -> Option<Vec<u8>> {
        Some(self.changes.into_inner()).filter(|frame| frame.len() > FRAME_HEADER_LEN)
    }

    pub(crate) fn open_table<K: Key + 'static, V: Value + 'static>(
        &self,
        definition: TableDefinition<'static, K, V>,
    ) -> Result<LoggedTable<'_, K, V>, TableError> {
        Ok(LoggedTable { table: self.txn.open_table(definition)?, definition, changes: &self.changes })
    }
}

/// A table of a [`Txn`]: reads through `Deref`, writes noted.
pub(crate) struct LoggedTable<'t, K: Key + 'static, V: Value + 'static> {
    table: redb::Table<'t, K, V>,
    definition: TableDefinition<'static, K, V>,
    changes: &'t RefCell<Vec<u8>>,
}

impl<K: Key + 'static, V: Value + 'static> LoggedTable<'_, K, V> {
    pub(crate) fn insert<'k, 'v>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
        value: impl Borrow<V::SelfType<'v>>,
    ) -> Result<Option<redb::AccessGuard<'_, V>>, redb::StorageError> {
        let (key, value) = (key.borrow(), value.borrow());
        self.note(PUT, K::as_bytes(key).as_ref(), Some(V::as_bytes(value).as_ref()));
        self.table.insert(key, value)
    }

    pub(crate) fn remove<'k>(
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
        put_bytes(&mut changes, self.definition.name().as_bytes());
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
pub(super) mod tests {
    use super::*;

    /// A frame of `changes` as a [`Txn`] would note them, header still to fill.
    pub(in crate::store) fn frame(changes: &[Change<'_>]) -> Vec<u8> {
        let mut out = vec![0u8; FRAME_HEADER_LEN];
        for (table, key, value) in changes {
            out.push(if value.is_some() { PUT } else { REMOVE });
            put_bytes(&mut out, table.as_bytes());
            put_bytes(&mut out, key);
            if let Some(value) = value {
                put_bytes(&mut out, value);
            }
        }
        out
    }

    type Seen = Vec<(String, Vec<u8>, Option<Vec<u8>>)>;

    /// What a fresh open of the log at `path` replays.
    pub(in crate::store) fn replayed(path: &Path) -> Seen {
        let mut wal = Wal::open(path, Checkpoints::default()).unwrap();
        let mut seen = Vec::new();
        wal.replay(|table, key, value| {
            seen.push((table.to_owned(), key.to_vec(), value.map(<[u8]>::to_vec)));
            Ok(())
        })
        .unwrap();
        seen
    }

    fn put(table: &str, key: &[u8], value: &[u8]) -> (String, Vec<u8>, Option<Vec<u8>>) {
        (table.to_owned(), key.to_vec(), Some(value.to_vec()))
    }

    /// A provider's kv value is logged verbatim, and a restart does not erase
    /// the file: a value that is a whole frame of the next generation, left
    /// where the next generation's frames end, must not be replayed. The
    /// attacker here is stronger than a provider can be: it knows the offset
    /// and the salt of the generation it writes in.
    #[test]
    fn bytes_a_provider_chose_never_replay_as_a_frame() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wal");
        let mut wal = Wal::open(&path, Checkpoints::default()).unwrap();
        let payload = frame(&[("sandbox_users", b"evil", Some(b"0"))]).split_off(FRAME_HEADER_LEN);
        let key = b"k";
        // After the frame's header: the change's kind, table name "kv", key, and the value's length.
        let value_at = FRAMES_AT + (FRAME_HEADER_LEN + 1 + (4 + 2) + (4 + key.len()) + 4) as u64;
        type Guess = fn(salt: u64, at: u64, header: &[u8], payload: &[u8]) -> u32;
        let guesses: [(&str, Guess); 3] = [
            ("version 1", |_, _, header, payload| crc32fast::hash(&[&header[4..12], payload].concat())),
            ("salt 0", |_, at, header, payload| {
                crc32fast::hash(&[&0u64.to_le_bytes()[..], &at.to_le_bytes(), &header[..12], payload].concat())
            }),
            ("the writing generation's salt", |salt, at, header, payload| {
                crc32fast::hash(&[&salt.to_le_bytes()[..], &at.to_le_bytes(), &header[..12], payload].concat())
            }),
        ];
        for (name, guess) in guesses {
            wal.restart().unwrap();
            let mut forged = Vec::new();
            forged.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            forged.extend_from_slice(&(wal.generation + 1).to_le_bytes());
            let crc = guess(wal.header_salt(), value_at, &forged, &payload);
            forged.extend_from_slice(&crc.to_le_bytes());
            forged.extend_from_slice(&payload);
            wal.append(&mut frame(&[("kv", key, Some(&forged))])).unwrap();
            // A checkpoint, then a frame that ends exactly where the forged one begins.
            wal.restart().unwrap();
            let filler = vec![7u8; (value_at - FRAMES_AT) as usize - FRAME_HEADER_LEN - (1 + (4 + 2) + (4 + 1) + 4)];
            let mut second = frame(&[("kv", b"f", Some(&filler))]);
            assert_eq!(FRAMES_AT + second.len() as u64, value_at);
            wal.append(&mut second).unwrap();
            assert_eq!(replayed(&path), [put("kv", b"f", &filler)], "a forged frame ({name}) was replayed");
        }
    }

    /// A log written before the salt (version 1) is replayed, then restarted as version 2.
    #[test]
    fn a_version_1_log_is_replayed_then_upgraded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wal");
        let generation = 5u64.to_le_bytes();
        let mut header = [MAGIC_V1.as_slice(), &generation].concat();
        header.extend_from_slice(&crc32fast::hash(&header).to_le_bytes());
        let payload = frame(&[("kv", b"a", Some(b"1"))]).split_off(FRAME_HEADER_LEN);
        let mut file = header;
        file.resize(FRAMES_AT as usize, 0);
        file.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        file.extend_from_slice(&generation);
        file.extend_from_slice(&crc32fast::hash(&[&generation[..], &payload].concat()).to_le_bytes());
        file.extend_from_slice(&payload);
        std::fs::write(&path, file).unwrap();
        assert_eq!(replayed(&path), [put("kv", b"a", b"1")]);

        let mut wal = Wal::open(&path, Checkpoints::default()).unwrap();
        assert_eq!(wal.format, Format::V1);
        wal.replay(|_, _, _| Ok(())).unwrap();
        wal.restart().unwrap();
        assert!(matches!(wal.format, Format::V2 { .. }), "{:?}", wal.format);
        assert_eq!(wal.generation, 6);
        wal.append(&mut frame(&[("kv", b"b", Some(b"2"))])).unwrap();
        assert_eq!(replayed(&path), [put("kv", b"b", b"2")]);
        // Even an empty version 1 log is rewritten, so what is appended next is checked as version 2.
        let empty = dir.path().join("empty");
        let mut header = [MAGIC_V1.as_slice(), &generation].concat();
        header.extend_from_slice(&crc32fast::hash(&header).to_le_bytes());
        std::fs::write(&empty, header).unwrap();
        let mut wal = Wal::open(&empty, Checkpoints::default()).unwrap();
        assert_eq!(wal.replay(|_, _, _| Ok(())).unwrap(), 0);
        wal.restart().unwrap();
        wal.append(&mut frame(&[("kv", b"c", Some(b"3"))])).unwrap();
        assert_eq!(replayed(&empty), [put("kv", b"c", b"3")]);
    }

    /// After a failure the log takes no frame until it is restarted, and the
    /// restart drops the frame that could not be erased.
    #[test]
    fn an_unsettled_log_refuses_frames_until_it_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wal");
        let mut wal = Wal::open(&path, Checkpoints::default()).unwrap();
        let mut failed = frame(&[("kv", b"failed", Some(b"1"))]);
        wal.append(&mut failed).unwrap();
        // What a failed erase of that frame leaves.
        wal.unsettle(io::Error::other("the disk said no"));
        assert!(wal.unsettled());
        assert!(wal.idle_for().is_some(), "an idle writer must come back to settle it");
        assert!(wal.refusal().is_none(), "settling is tried at once");
        let refused = wal.append(&mut frame(&[("kv", b"next", Some(b"2"))])).unwrap_err();
        assert!(refused.to_string().contains("the disk said no"), "{refused}");
        // Settling failed: for the checkpoint age, writes are refused with the cause.
        wal.postpone();
        let refusal = wal.refusal().expect("refused until the age has passed");
        assert!(refusal.to_string().contains("the disk said no"), "{refusal}");
        assert_eq!(replayed(&path), [put("kv", b"failed", b"1")]);
        wal.restart().unwrap();
        assert!(!wal.unsettled());
        assert_eq!(replayed(&path), []);
        wal.append(&mut frame(&[("kv", b"next", Some(b"2"))])).unwrap();
        assert_eq!(replayed(&path), [put("kv", b"next", b"2")]);
    }

    /// Fuzzed (bolero): a frame's payload of any bytes decodes to changes or
    /// an error, never a panic (a log is read back after any crash).
    #[test]
    fn fuzz_frame_changes() {
        bolero::check!().with_iterations(50_000).for_each(|bytes: &[u8]| {
            for change in Changes(bytes) {
                if change.is_err() {
                    break;
                }
            }
        });
    }

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
