//! `broker:provider/kv`: each provider's own persistent namespace.
//!
//! [`KvBackend`] is the storage seam: the real backend lives in
//! [`crate::store`] (redb) and only the host can give it (the room's
//! backend is injected, as the machine lock's is); [`MemoryKv`] serves the
//! conformance kit, unit tests and benchmarks. The room is [`Kv`].

use crate::bindings::broker::provider::kv::{self as wit};
use crate::quotas::{Quota, Quotas};
use crate::rooms::HasRooms;
use crate::rooms::{Linking, Room, StoreSetup};
use futures_util::future::BoxFuture;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use wasmtime::component::{HasSelf, Linker};

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "kv";

/// Keys longer than this are refused.
pub(crate) const MAX_KEY_BYTES: usize = 1024;
/// Values larger than this are refused.
pub const MAX_VALUE_BYTES: usize = 1 << 20;
/// Most a `scan` returns at once: a larger one is refused (scan a narrower prefix).
pub const MAX_SCAN_BYTES: usize = 16 << 20;
/// Most steps one `transact` takes.
pub const MAX_TRANSACTION_OPS: usize = 64;
/// Most bytes of keys and values one `transact` carries.
pub const MAX_TRANSACTION_BYTES: usize = 4 << 20;

pub mod kit;
mod v0_1;

pub use crate::quotas::KvQuota;

impl KvQuota {
    fn check(&self, entries: &Entries, key: &str, value_len: usize) -> Result<(), KvError> {
        let old = entries.get(key).map(|v| key.len() + v.len());
        let keys = entries.len() + usize::from(old.is_none());
        let bytes = entries.bytes() - old.unwrap_or(0) + key.len() + value_len;
        self.check_totals(entries, keys, bytes)
    }

    /// Whether `entries` may come to hold `keys` keys of `bytes` bytes: past
    /// a bound only if it does not grow (shrinking always works).
    fn check_totals(&self, entries: &Entries, keys: usize, bytes: usize) -> Result<(), KvError> {
        if keys > self.keys && keys > entries.len() {
            let message = format!("the namespace holds {} keys, its kv-keys limit", entries.len());
            return Err(KvError::QuotaExceeded { quota: Quota::KvKeys, message });
        }
        if bytes > self.bytes && bytes > entries.bytes() {
            let message = format!(
                "the namespace would hold {bytes} bytes, past its kv-mib limit of {} MiB ({} bytes held)",
                self.bytes >> 20,
                entries.bytes()
            );
            return Err(KvError::QuotaExceeded { quota: Quota::KvBytes, message });
        }
        Ok(())
    }
}

/// One namespace's entries and what they weigh (keys and values, in bytes).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entries {
    map: BTreeMap<String, Vec<u8>>,
    bytes: usize,
}

impl Entries {
    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Keys and values together, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Set `key` to `value`.
    pub fn insert(&mut self, key: String, value: Vec<u8>) {
        let (key_len, value_len) = (key.len(), value.len());
        match self.map.insert(key, value) {
            // The key was counted already: only its value's weight changes.
            Some(old) => self.bytes = self.bytes - old.len() + value_len,
            None => self.bytes += key_len + value_len,
        }
    }

    /// Remove `key`, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Vec<u8>> {
        let old = self.map.remove(key)?;
        self.bytes -= key.len() + old.len();
        Some(old)
    }

    /// The entries whose key starts with `prefix` and sorts after `after`, in key order.
    pub(crate) fn with_prefix_after<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&str>,
    ) -> impl Iterator<Item = (&'a String, &'a Vec<u8>)> + 'a {
        use std::ops::Bound;
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after.to_owned()),
            _ => Bound::Included(prefix.to_owned()),
        };
        self.map.range((start, Bound::Unbounded)).take_while(move |(k, _)| k.starts_with(prefix))
    }
}

impl FromIterator<(String, Vec<u8>)> for Entries {
    fn from_iter<I: IntoIterator<Item = (String, Vec<u8>)>>(iter: I) -> Self {
        let mut entries = Entries::default();
        for (key, value) in iter {
            entries.insert(key, value);
        }
        entries
    }
}

/// A refused or failed kv call; the guest gets the matching WIT `kv-error`.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KvError {
    /// A key or value past [`MAX_KEY_BYTES`] or [`MAX_VALUE_BYTES`].
    #[error("too large: {0}")]
    TooLarge(String),
    /// Not applicable to what is stored (a non-counter, an overflow).
    #[error("invalid: {0}")]
    Invalid(String),
    /// The backend failed, or there is none.
    #[error("storage: {0}")]
    Storage(String),
    /// The change would grow the namespace past its quota.
    #[error("quota exceeded: {message}")]
    QuotaExceeded {
        /// Which bound (`kv-keys`, `kv-mib`).
        quota: Quota,
        /// What it holds and the bound.
        message: String,
    },
}

impl From<KvError> for wit::KvError {
    fn from(err: KvError) -> Self {
        match err {
            KvError::TooLarge(m) => wit::KvError::TooLarge(m),
            KvError::Invalid(m) => wit::KvError::Invalid(m),
            KvError::Storage(m) => wit::KvError::Storage(m),
            KvError::QuotaExceeded { message, .. } => wit::KvError::QuotaExceeded(message),
        }
    }
}

/// A change to one key.
#[derive(Debug, Clone, PartialEq)]
pub enum KvChange {
    /// Replace the value.
    Set(Vec<u8>),
    /// Remove the key; an absent key is no error.
    Delete,
    /// Add to the little-endian i64 counter (absent counts as 0).
    Increment(i64),
}

/// What a change did.
#[derive(Debug, Clone, PartialEq)]
pub enum KvChanged {
    /// The value was written.
    Set,
    /// Whether the key was there.
    Deleted(bool),
    /// The counter after the increment.
    Counter(i64),
}

impl KvChange {
    /// The bounds every backend holds a change to, before anything is written.
    pub fn check(&self, key: &str) -> Result<(), KvError> {
        match self {
            KvChange::Set(value) => check_key(key).and_then(|()| check_value(value)),
            KvChange::Increment(_) => check_key(key),
            KvChange::Delete => Ok(()),
        }
    }
}

/// Keys of one namespace whose changes are applied (every reader sees them)
/// but not yet known to be durable: what [`KvBackend::persist`] makes durable.
#[derive(Debug, Clone, PartialEq)]
pub struct KvWrites {
    /// The namespace written.
    pub namespace: Arc<str>,
    /// The keys changed (set or deleted).
    pub keys: BTreeSet<String>,
}

impl KvWrites {
    /// None yet, in `namespace`.
    pub fn new(namespace: Arc<str>) -> Self {
        KvWrites { namespace, keys: BTreeSet::new() }
    }

    /// Whether no key is waiting to be made durable.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Storage of provider namespaces. `scan` returns entries in key order.
///
/// A change is applied at once: every later read, in any call, sees it. It is
/// durable once [`KvBackend::persist`] of its key resolves (the real backend
/// writes the key's value *at that moment*, so a later change to it is never
/// overwritten by an earlier one, and commits on the store's writer thread,
/// never on the executor). The blocking forms are for tests and tools, which
/// are not async.
pub trait KvBackend: Send + Sync + 'static {
    /// The value under `key`, if any.
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError>;
    /// Entries under `prefix`, already packed as `scan` returns them to
    /// guests: the first page of [`MAX_SCAN_BYTES`], refused if there is more.
    fn scan_packed(&self, namespace: &str, prefix: &str) -> Result<Vec<u8>, KvError> {
        whole_scan(prefix, self.scan_page(namespace, prefix, None, MAX_SCAN_BYTES)?)
    }
    /// One page of a scan (see [`pack_page`]).
    fn scan_page(
        &self,
        namespace: &str,
        prefix: &str,
        after: Option<&str>,
        max_bytes: usize,
    ) -> Result<ScanPage, KvError>;
    /// Make `namespace` ready to answer at once, off the executor, if it is
    /// not (a backend that reads it from disk on first use); `None` when it is.
    fn warm(&self, _namespace: &str) -> Option<BoxFuture<'static, Result<(), KvError>>> {
        None
    }
    /// Apply one change, unless it would grow the namespace past `quota`;
    /// durable once its key is persisted.
    fn apply(&self, namespace: &str, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError>;
    /// Apply a transaction ([`apply_transaction`]), at once for every reader;
    /// the keys written are durable once persisted, in one commit.
    fn transact(&self, namespace: &str, ops: &[KvOp], quota: KvQuota) -> Result<Option<BTreeSet<String>>, KvError>;
    /// Make the current values of `writes.keys` durable; resolves once they are.
    fn persist(&self, writes: KvWrites) -> BoxFuture<'static, Result<(), KvError>>;
    /// As [`KvBackend::persist`], waiting on this thread.
    fn persist_blocking(&self, writes: KvWrites) -> Result<(), KvError>;
    /// As [`KvBackend::persist`], waiting for nobody: for changes whose call
    /// went away before persisting them (a failure is only logged).
    fn persist_detached(&self, writes: KvWrites);

    /// Apply one change and wait until it is durable.
    fn change_blocking(&self, namespace: &str, key: &str, change: KvChange) -> Result<KvChanged, KvError> {
        let answer = self.apply(namespace, key, change, KvQuota::UNBOUNDED)?;
        let mut writes = KvWrites::new(namespace.into());
        writes.keys.insert(key.to_owned());
        self.persist_blocking(writes)?;
        Ok(answer)
    }
    /// Set `key` and wait until it is durable.
    fn set(&self, namespace: &str, key: &str, value: &[u8]) -> Result<(), KvError> {
        self.change_blocking(namespace, key, KvChange::Set(value.to_vec())).map(drop)
    }
    /// True if the key was there.
    fn delete(&self, namespace: &str, key: &str) -> Result<bool, KvError> {
        match self.change_blocking(namespace, key, KvChange::Delete)? {
            KvChanged::Deleted(existed) => Ok(existed),
            other => Err(KvError::Storage(format!("delete answered {other:?}"))),
        }
    }
    /// The counter after adding `delta`.
    fn increment(&self, namespace: &str, key: &str, delta: i64) -> Result<i64, KvError> {
        match self.change_blocking(namespace, key, KvChange::Increment(delta))? {
            KvChanged::Counter(next) => Ok(next),
            other => Err(KvError::Storage(format!("increment answered {other:?}"))),
        }
    }
}

/// Apply `change` to one namespace's entries, as every backend does.
pub fn apply_change(entries: &mut Entries, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError> {
    change.check(key)?;
    match change {
        KvChange::Set(value) => {
            quota.check(entries, key, value.len())?;
            entries.insert(key.to_owned(), value);
            Ok(KvChanged::Set)
        }
        KvChange::Delete => Ok(KvChanged::Deleted(entries.remove(key).is_some())),
        KvChange::Increment(delta) => {
            let current = entries.get(key).map(|v| decode_counter(v)).transpose()?.unwrap_or(0);
            let next = current
                .checked_add(delta)
                .ok_or_else(|| KvError::Invalid(format!("increment of {key:?} overflows")))?;
            quota.check(entries, key, 8)?;
            entries.insert(key.to_owned(), next.to_le_bytes().to_vec());
            Ok(KvChanged::Counter(next))
        }
    }
}

/// One step of a transaction (`kv.transact`).
#[derive(Debug, Clone, PartialEq)]
pub enum KvOp {
    /// Check: the key is absent.
    ExpectAbsent(String),
    /// Check: the key holds exactly this value.
    ExpectEqual(String, Vec<u8>),
    /// Write: set the key.
    Set(String, Vec<u8>),
    /// Write: remove the key (absent is no error).
    Delete(String),
}

impl KvOp {
    fn key(&self) -> &str {
        match self {
            KvOp::ExpectAbsent(key) | KvOp::ExpectEqual(key, _) | KvOp::Set(key, _) | KvOp::Delete(key) => key,
        }
    }

    fn weight(&self) -> usize {
        match self {
            KvOp::ExpectEqual(key, value) | KvOp::Set(key, value) => key.len() + value.len(),
            KvOp::ExpectAbsent(key) | KvOp::Delete(key) => key.len(),
        }
    }
}

/// The bounds of one transaction, before anything is read.
pub fn check_transaction(ops: &[KvOp]) -> Result<(), KvError> {
    if ops.len() > MAX_TRANSACTION_OPS {
        return Err(KvError::TooLarge(format!("a transaction of {} steps (limit {MAX_TRANSACTION_OPS})", ops.len())));
    }
    let weight: usize = ops.iter().map(KvOp::weight).sum();
    if weight > MAX_TRANSACTION_BYTES {
        return Err(KvError::TooLarge(format!(
            "a transaction of {weight} bytes of keys and values (limit {} MiB)",
            MAX_TRANSACTION_BYTES >> 20
        )));
    }
    for op in ops {
        check_key(op.key())?;
        if let KvOp::Set(_, value) = op {
            check_value(value)?;
        }
    }
    Ok(())
}

/// Apply a transaction to one namespace's entries, as every backend does:
/// every check against the entries as they are, then every write in order,
/// the quota held to the result. The keys written, or `None` if a check
/// failed (nothing is written then).
pub fn apply_transaction(
    entries: &mut Entries,
    ops: &[KvOp],
    quota: KvQuota,
) -> Result<Option<BTreeSet<String>>, KvError> {
    check_transaction(ops)?;
    let holds = |op: &KvOp| match op {
        KvOp::ExpectAbsent(key) => entries.get(key).is_none(),
        KvOp::ExpectEqual(key, expected) => entries.get(key) == Some(expected),
        KvOp::Set(..) | KvOp::Delete(_) => true,
    };
    if !ops.iter().all(holds) {
        return Ok(None);
    }
    // Each written key's value after the transaction (the last write wins),
    // and what the namespace weighs then.
    let mut after: BTreeMap<&str, Option<&Vec<u8>>> = BTreeMap::new();
    for op in ops {
        match op {
            KvOp::Set(key, value) => after.insert(key, Some(value)),
            KvOp::Delete(key) => after.insert(key, None),
            KvOp::ExpectAbsent(_) | KvOp::ExpectEqual(..) => None,
        };
    }
    let (mut keys, mut bytes) = (entries.len(), entries.bytes());
    for (key, value) in &after {
        if let Some(old) = entries.get(key) {
            keys -= 1;
            bytes -= key.len() + old.len();
        }
        if let Some(value) = value {
            keys += 1;
            bytes += key.len() + value.len();
        }
    }
    quota.check_totals(entries, keys, bytes)?;
    let written: BTreeSet<String> = after.keys().map(|key| (*key).to_owned()).collect();
    let after: Vec<(String, Option<Vec<u8>>)> =
        after.into_iter().map(|(key, value)| (key.to_owned(), value.cloned())).collect();
    for (key, value) in after {
        match value {
            Some(value) => entries.insert(key, value),
            None => drop(entries.remove(&key)),
        }
    }
    Ok(Some(written))
}

/// Append one scan entry to `out` in the wire format of `kv.scan`.
pub(crate) fn pack_entry(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
}

/// Pack every entry of `entries` under `prefix`; more than
/// [`MAX_SCAN_BYTES`] is refused before it is all packed.
pub fn pack_prefix(entries: &Entries, prefix: &str) -> Result<Vec<u8>, KvError> {
    whole_scan(prefix, pack_page(entries, prefix, None, MAX_SCAN_BYTES))
}

/// A scan's first page as the whole scan: refused if more comes after it.
fn whole_scan(prefix: &str, page: ScanPage) -> Result<Vec<u8>, KvError> {
    if !page.complete {
        return Err(KvError::TooLarge(format!(
            "scan of {prefix:?} returns more than {} MiB at once: page through it (scan-page), or scan narrower prefixes",
            MAX_SCAN_BYTES >> 20
        )));
    }
    Ok(page.packed)
}

/// A page of a scan, packed; `complete` if it reached the prefix's last entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanPage {
    /// The entries, as `scan` packs them.
    pub packed: Vec<u8>,
    /// Nothing under the prefix comes after them.
    pub complete: bool,
}

/// The entries under `prefix` after `after`, as many as fit in `max_bytes`
/// packed, at least one (an entry is at most a key and a value, far less than
/// [`MAX_SCAN_BYTES`]).
pub fn pack_page(entries: &Entries, prefix: &str, after: Option<&str>, max_bytes: usize) -> ScanPage {
    let mut packed = Vec::new();
    for (key, value) in entries.with_prefix_after(prefix, after) {
        if !packed.is_empty() && packed.len() + 8 + key.len() + value.len() > max_bytes {
            return ScanPage { packed, complete: false };
        }
        pack_entry(&mut packed, key, value);
    }
    ScanPage { packed, complete: true }
}

/// Decode a little-endian i64 counter as `increment` stores it.
pub(crate) fn decode_counter(bytes: &[u8]) -> Result<i64, KvError> {
    let array: [u8; 8] = bytes
        .try_into()
        .map_err(|_| KvError::Invalid(format!("increment: value is {} bytes, not an 8-byte integer", bytes.len())))?;
    Ok(i64::from_le_bytes(array))
}

pub(crate) fn check_key(key: &str) -> Result<(), KvError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(KvError::TooLarge(format!("key of {} bytes (limit {MAX_KEY_BYTES})", key.len())));
    }
    Ok(())
}

pub(crate) fn check_value(value: &[u8]) -> Result<(), KvError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(KvError::TooLarge(format!("value of {} bytes (limit {MAX_VALUE_BYTES})", value.len())));
    }
    Ok(())
}

/// In-memory namespaces, for unit tests and benchmarks.
#[derive(Default)]
pub struct MemoryKv {
    namespaces: Mutex<HashMap<String, Entries>>,
}

impl MemoryKv {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entries>> {
        self.namespaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl KvBackend for MemoryKv {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.lock().get(namespace).and_then(|ns| ns.get(key).cloned()))
    }
    fn scan_page(
        &self,
        namespace: &str,
        prefix: &str,
        after: Option<&str>,
        max_bytes: usize,
    ) -> Result<ScanPage, KvError> {
        let empty = || ScanPage { packed: Vec::new(), complete: true };
        Ok(self.lock().get(namespace).map_or_else(empty, |ns| pack_page(ns, prefix, after, max_bytes)))
    }
    fn apply(&self, namespace: &str, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError> {
        apply_change(self.lock().entry(namespace.to_owned()).or_default(), key, change, quota)
    }
    fn transact(&self, namespace: &str, ops: &[KvOp], quota: KvQuota) -> Result<Option<BTreeSet<String>>, KvError> {
        apply_transaction(self.lock().entry(namespace.to_owned()).or_default(), ops, quota)
    }
    /// Memory is as durable as it gets.
    fn persist(&self, _writes: KvWrites) -> BoxFuture<'static, Result<(), KvError>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn persist_blocking(&self, _writes: KvWrites) -> Result<(), KvError> {
        Ok(())
    }
    fn persist_detached(&self, _writes: KvWrites) {}
}

/// When a store's kv changes are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDurability {
    /// Before the host function returns to the guest: for providers that act
    /// outside the store (programs, sockets, bridges, outgoing HTTP), whose
    /// state must be durable before the effect it describes happens.
    EachChange,
    /// When the call returns, in one commit (together with the host's record
    /// of a started instance): for providers whose only effect is their kv.
    CallEnd,
}

/// Keys a call may leave to be persisted at its end; past this many, the
/// changes so far are persisted at once (the set stays bounded).
pub(crate) const MAX_UNPERSISTED_KEYS: usize = 1024;

/// Per-store context: which namespace this guest may touch, where it lives,
/// and what its calls changed but have not persisted yet.
pub struct KvCtx {
    /// `None` in a store made without the grant or without a store to reach.
    backend: Option<Arc<dyn KvBackend>>,
    durability: KvDurability,
    unpersisted: KvWrites,
    /// The provider's bounds: its namespace's quota, and where refusals are counted.
    quotas: Arc<Quotas>,
}

impl Default for KvCtx {
    /// Reaches no store: every call answers a storage error.
    fn default() -> Self {
        let unpersisted = KvWrites::new("".into());
        KvCtx { backend: None, durability: KvDurability::EachChange, unpersisted, quotas: Arc::default() }
    }
}

impl KvCtx {
    pub(crate) fn new(
        namespace: Arc<str>,
        backend: Arc<dyn KvBackend>,
        durability: KvDurability,
        quotas: Arc<Quotas>,
    ) -> Self {
        KvCtx { backend: Some(backend), durability, unpersisted: KvWrites::new(namespace), quotas }
    }

    fn backend(&self) -> Result<&Arc<dyn KvBackend>, KvError> {
        self.backend.as_ref().ok_or_else(|| KvError::Storage("kv has no store here: the provider is given none".into()))
    }

    fn namespace(&self) -> &str {
        &self.unpersisted.namespace
    }

    /// What the calls so far changed and left to be persisted (emptied here):
    /// the caller persists it before the call's answer goes out.
    pub fn take_unpersisted(&mut self) -> KvWrites {
        let namespace = self.unpersisted.namespace.clone();
        std::mem::replace(&mut self.unpersisted, KvWrites::new(namespace))
    }

    /// The namespace made ready off the executor, if it is not held in memory.
    async fn warm(&self) -> Result<(), KvError> {
        match self.backend()?.warm(self.namespace()) {
            Some(loading) => loading.await,
            None => Ok(()),
        }
    }

    async fn change(&mut self, key: String, change: KvChange) -> Result<KvChanged, wit::KvError> {
        self.warm().await?;
        let backend = self.backend()?.clone();
        let answer = backend.apply(self.namespace(), &key, change, self.quotas.kv()).inspect_err(|refused| {
            self.count_refusal(refused);
        })?;
        self.written([key]).await?;
        Ok(answer)
    }

    /// `kv.transact`, and the compare-and-swaps made of it: true if it applied.
    async fn transact(&mut self, ops: Vec<KvOp>) -> Result<bool, wit::KvError> {
        check_transaction(&ops)?;
        self.warm().await?;
        let backend = self.backend()?.clone();
        let written = backend.transact(self.namespace(), &ops, self.quotas.kv()).inspect_err(|refused| {
            self.count_refusal(refused);
        })?;
        let Some(written) = written else { return Ok(false) };
        self.written(written).await?;
        Ok(true)
    }

    fn count_refusal(&self, refused: &KvError) {
        if let KvError::QuotaExceeded { quota, .. } = refused {
            self.quotas.refused(*quota, 1);
        }
    }

    /// Note `keys` as changed, and persist them now if the durability says so
    /// (or too many wait): all of them in one commit.
    async fn written(&mut self, keys: impl IntoIterator<Item = String>) -> Result<(), KvError> {
        self.unpersisted.keys.extend(keys);
        if self.durability == KvDurability::EachChange || self.unpersisted.keys.len() >= MAX_UNPERSISTED_KEYS {
            let backend = self.backend()?.clone();
            // The keys stay noted until their commit is known: a call stopped
            // while it waits (its deadline), or a failed commit, leaves them to
            // the call's end, which persists them before the call answers.
            backend.persist(self.unpersisted.clone()).await.map_err(|refused| match refused {
                KvError::Storage(why) => {
                    KvError::Storage(format!("the change is applied but not yet durable (retried): {why}"))
                }
                other => other,
            })?;
            self.unpersisted.keys.clear();
        }
        Ok(())
    }
}

impl Drop for KvCtx {
    /// A store dropped with changes not persisted (its call's future was
    /// dropped: a cancelled caller) hands them to the backend anyway: every
    /// reader already sees them, so the file must come to hold them too.
    fn drop(&mut self) {
        if let Some(backend) = self.backend.clone()
            && !self.unpersisted.is_empty()
        {
            backend.persist_detached(self.take_unpersisted());
        }
    }
}

type WitResult<T> = wasmtime::Result<Result<T, wit::KvError>>;

/// A backend that answered a change with what another change answers.
fn mismatched(answer: KvChanged) -> wit::KvError {
    wit::KvError::Storage(format!("the store answered {answer:?}"))
}

impl wit::Host for KvCtx {
    async fn get(&mut self, key: String) -> WitResult<Option<Vec<u8>>> {
        let warmed = self.warm().await;
        Ok(warmed.and_then(|()| self.backend()?.get(self.namespace(), &key)).map_err(Into::into))
    }
    async fn set(&mut self, key: String, value: Vec<u8>) -> WitResult<()> {
        Ok(self.change(key, KvChange::Set(value)).await.map(drop))
    }
    async fn delete(&mut self, key: String) -> WitResult<bool> {
        Ok(self.change(key, KvChange::Delete).await.and_then(|answer| match answer {
            KvChanged::Deleted(existed) => Ok(existed),
            other => Err(mismatched(other)),
        }))
    }
    async fn increment(&mut self, key: String, delta: i64) -> WitResult<i64> {
        Ok(self.change(key, KvChange::Increment(delta)).await.and_then(|answer| match answer {
            KvChanged::Counter(next) => Ok(next),
            other => Err(mismatched(other)),
        }))
    }
    async fn scan(&mut self, prefix: String) -> WitResult<Vec<u8>> {
        let warmed = self.warm().await;
        Ok(warmed.and_then(|()| self.backend()?.scan_packed(self.namespace(), &prefix)).map_err(Into::into))
    }
    async fn scan_page(&mut self, prefix: String, after: Option<String>, max_bytes: u32) -> WitResult<Vec<u8>> {
        let warmed = self.warm().await;
        let max_bytes = (max_bytes as usize).min(MAX_SCAN_BYTES);
        let page =
            warmed.and_then(|()| self.backend()?.scan_page(self.namespace(), &prefix, after.as_deref(), max_bytes));
        Ok(page.map(|page| page.packed).map_err(Into::into))
    }
    async fn set_if_absent(&mut self, key: String, value: Vec<u8>) -> WitResult<bool> {
        Ok(self.transact(vec![KvOp::ExpectAbsent(key.clone()), KvOp::Set(key, value)]).await)
    }
    async fn set_if_equal(&mut self, key: String, expected: Vec<u8>, value: Vec<u8>) -> WitResult<bool> {
        Ok(self.transact(vec![KvOp::ExpectEqual(key.clone(), expected), KvOp::Set(key, value)]).await)
    }
    async fn delete_if_equal(&mut self, key: String, expected: Vec<u8>) -> WitResult<bool> {
        Ok(self.transact(vec![KvOp::ExpectEqual(key.clone(), expected), KvOp::Delete(key)]).await)
    }
    async fn transact(&mut self, ops: Vec<wit::KvOp>) -> WitResult<bool> {
        let ops = ops.into_iter().map(KvOp::from).collect();
        Ok(KvCtx::transact(self, ops).await)
    }
}

impl From<wit::KvOp> for KvOp {
    fn from(op: wit::KvOp) -> KvOp {
        match op {
            wit::KvOp::ExpectAbsent(key) => KvOp::ExpectAbsent(key),
            wit::KvOp::ExpectEqual((key, value)) => KvOp::ExpectEqual(key, value),
            wit::KvOp::Set((key, value)) => KvOp::Set(key, value),
            wit::KvOp::Delete(key) => KvOp::Delete(key),
        }
    }
}

/// Link the current `kv` under the name of each version since 0.2.0 (they
/// only added functions to it) and, beside it, `kv` as 0.1.0 published it ([`v0_1`]).
pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut KvCtx,
) -> wasmtime::Result<()> {
    for instance in crate::bindings::served_instances_since(INTERFACE, "0.2.0") {
        wit::add_to_linker_instance::<T, HasSelf<KvCtx>>(&mut linker.instance(&instance)?, getter)?;
    }
    v0_1::add_to_linker(linker, getter)
}

/// The room: `kv = true` under `[grants]`, linked only when granted. Its
/// backend is the host's store, which only the host (or the kit, a memory
/// one) can inject.
pub struct Kv;

impl Room for Kv {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "kv";
    const LINKING: Linking = Linking::WhenGranted;
    const KIT: Option<&'static dyn crate::rooms::kit::KitPart> = Some(&kit::KvKit);
    type Grant = bool;
    type Backend = dyn KvBackend;
    type Ctx = KvCtx;
    type Prepared = ();

    fn host_backend() -> Option<Arc<dyn KvBackend>> {
        None
    }

    fn acts_outside_the_store(_: &bool) -> bool {
        false
    }

    fn ctx(_: &bool, backend: Option<Arc<dyn KvBackend>>, store: &StoreSetup<'_>) -> KvCtx {
        let durability = match store.acts_outside_the_store {
            true => KvDurability::EachChange,
            false => KvDurability::CallEnd,
        };
        match backend {
            Some(backend) => KvCtx::new(store.provider.clone(), backend, durability, store.quotas.clone()),
            None => KvCtx::default(),
        }
    }

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state: &mut T| state.room::<Kv>().0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_held_to_its_quota_and_shrinking_always_works() {
        let kv = MemoryKv::default();
        let quota = KvQuota { keys: 3, bytes: 100 };
        let set = |key: &str, len: usize, quota| kv.apply("p", key, KvChange::Set(vec![0; len]), quota);
        for key in ["a", "b", "c"] {
            set(key, 10, quota).unwrap();
        }
        let refused = |r: Result<KvChanged, KvError>| match r {
            Err(KvError::QuotaExceeded { quota, .. }) => quota,
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(refused(set("d", 1, quota)), Quota::KvKeys);
        assert_eq!(refused(kv.apply("p", "d", KvChange::Increment(1), quota)), Quota::KvKeys);
        // Replacing a value adds no key; past the bytes it is refused, under them it is not.
        assert_eq!(refused(set("a", 90, quota)), Quota::KvBytes, "33 - 11 + 91 bytes");
        set("a", 60, quota).expect("33 - 11 + 61 bytes");
        assert_eq!(kv.lock()["p"].bytes(), 83);
        // A quota lowered below what is held: shrinking and deleting work, growing does not.
        let tight = KvQuota { keys: 1, bytes: 10 };
        set("a", 5, tight).expect("shrinking is never refused");
        assert_eq!(refused(set("b", 11, tight)), Quota::KvBytes);
        assert!(kv.apply("p", "b", KvChange::Delete, tight).is_ok());
        assert_eq!(kv.lock()["p"].bytes(), 6 + 11);
        assert_eq!(kv.lock()["p"].len(), 2);
        let to_guest = wit::KvError::from(set("z", 1, tight).unwrap_err());
        assert!(matches!(&to_guest, wit::KvError::QuotaExceeded(m) if m.contains("kv-keys limit")), "{to_guest:?}");
    }

    /// Checks are of the namespace before the transaction; writes apply in
    /// order, all or none; the quota is held to the result, shrinking always
    /// works; the bounds are refused before anything is read.
    #[test]
    fn a_transaction_applies_whole_or_not_at_all() {
        let kv = MemoryKv::default();
        let quota = KvQuota { keys: 3, bytes: 100 };
        let set = |key: &str, value: &[u8]| KvOp::Set(key.into(), value.to_vec());
        let written = kv.transact("p", &[set("a", b"1"), set("b", b"2"), set("a", b"3")], quota).unwrap();
        assert_eq!(written, Some(["a".to_owned(), "b".to_owned()].into()));
        assert_eq!(kv.get("p", "a").unwrap(), Some(b"3".to_vec()), "the last write wins");
        // A check that fails writes nothing, wherever it stands.
        let ops = [set("c", b"x"), KvOp::ExpectEqual("a".into(), b"1".to_vec())];
        assert_eq!(kv.transact("p", &ops, quota).unwrap(), None);
        assert_eq!(kv.get("p", "c").unwrap(), None);
        // A check sees the namespace before the transaction, not its own writes.
        let ops = [set("c", b"x"), KvOp::ExpectAbsent("c".into())];
        assert_eq!(kv.transact("p", &ops, quota).unwrap(), Some(["c".to_owned()].into()));
        // Past the quota as a whole: refused whole; a swap that frees a key is not.
        let ops = [set("d", b"1"), KvOp::Delete("zz".into())];
        assert!(matches!(kv.transact("p", &ops, quota), Err(KvError::QuotaExceeded { quota: Quota::KvKeys, .. })));
        let ops = [set("d", b"1"), KvOp::Delete("c".into())];
        assert!(kv.transact("p", &ops, quota).unwrap().is_some());
        assert_eq!(kv.lock()["p"].len(), 3);
        assert_eq!(kv.lock()["p"].bytes(), 6);
        // The bounds.
        let many: Vec<KvOp> = (0..=MAX_TRANSACTION_OPS).map(|i| KvOp::ExpectAbsent(format!("k{i}"))).collect();
        assert!(matches!(kv.transact("p", &many, quota), Err(KvError::TooLarge(m)) if m.contains("65 steps")));
        let heavy = vec![set("h", &vec![0; 1 << 20]); 5];
        assert!(matches!(kv.transact("p", &heavy, quota), Err(KvError::TooLarge(m)) if m.contains("limit 4 MiB")));
        let long_key = KvOp::ExpectAbsent("k".repeat(MAX_KEY_BYTES + 1));
        assert!(matches!(kv.transact("p", &[long_key], quota), Err(KvError::TooLarge(_))));
    }

    /// A compare-and-swap from the guest is one transaction: its key persisted
    /// before the host function returns when each change must be durable.
    #[tokio::test]
    async fn compare_and_swap_answers_whether_it_applied_and_persists_what_it_wrote() {
        let backend = Arc::new(Persisted::default());
        let mut each = KvCtx::new("p".into(), backend.clone(), KvDurability::EachChange, Arc::default());
        assert!(each.set_if_absent("k".into(), b"1".to_vec()).await.unwrap().unwrap());
        assert!(!each.set_if_absent("k".into(), b"2".to_vec()).await.unwrap().unwrap());
        assert!(!each.delete_if_equal("k".into(), b"2".to_vec()).await.unwrap().unwrap());
        assert!(each.set_if_equal("k".into(), b"1".to_vec(), b"2".to_vec()).await.unwrap().unwrap());
        let ops = vec![wit::KvOp::ExpectEqual(("k".into(), b"2".to_vec())), wit::KvOp::Set(("j".into(), vec![]))];
        assert!(each.transact(ops.into_iter().map(KvOp::from).collect()).await.unwrap());
        let persisted = backend.persisted.lock().unwrap();
        assert_eq!(persisted.iter().map(keys).collect::<Vec<_>>(), [vec!["k"], vec!["k"], vec!["j"]]);
        drop(persisted);
        assert!(each.take_unpersisted().is_empty());
    }

    #[test]
    fn entries_keep_their_weight_through_every_change() {
        let mut entries: Entries = [("ab".to_owned(), vec![1, 2, 3])].into_iter().collect();
        assert_eq!(entries.bytes(), 5);
        entries.insert("ab".into(), vec![1]);
        assert_eq!(entries.bytes(), 3);
        entries.insert("c".into(), vec![]);
        assert_eq!((entries.bytes(), entries.len()), (4, 2));
        assert_eq!(entries.remove("ab"), Some(vec![1]));
        assert_eq!(entries.remove("ab"), None);
        assert_eq!(entries.bytes(), 1);
    }

    #[test]
    fn a_scan_past_its_bound_is_refused_and_a_narrower_one_answers() {
        let kv = MemoryKv::default();
        for n in 0..17 {
            kv.set("p", &format!("big/{n:02}"), &vec![0; MAX_VALUE_BYTES]).unwrap();
        }
        let err = kv.scan_packed("p", "big/").unwrap_err();
        assert!(matches!(&err, KvError::TooLarge(m) if m.contains("scan narrower prefixes")), "{err}");
        assert_eq!(kv.scan_packed("p", "big/0").unwrap().len(), 10 * (8 + 6 + MAX_VALUE_BYTES));
    }

    #[test]
    fn pages_hold_what_fits_at_least_one_entry_and_end_empty() {
        let entries: Entries = [("a/1", 10), ("a/2", 10), ("a/3", 10), ("b/1", 10)]
            .into_iter()
            .map(|(k, n)| (k.to_owned(), vec![0; n]))
            .collect();
        let entry = 8 + 3 + 10;
        let keys = |page: &ScanPage| {
            let mut keys = Vec::new();
            let mut rest = &page.packed[..];
            while !rest.is_empty() {
                let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
                keys.push(String::from_utf8(rest[4..4 + len].to_vec()).unwrap());
                let value = u32::from_le_bytes(rest[4 + len..8 + len].try_into().unwrap()) as usize;
                rest = &rest[8 + len + value..];
            }
            keys
        };
        let first = pack_page(&entries, "a/", None, 2 * entry);
        assert_eq!((keys(&first), first.complete), (vec!["a/1".to_owned(), "a/2".into()], false));
        let last = pack_page(&entries, "a/", Some("a/2"), 2 * entry);
        assert_eq!((keys(&last), last.complete), (vec!["a/3".to_owned()], true));
        assert!(pack_page(&entries, "a/", Some("a/3"), 2 * entry).packed.is_empty(), "past the last: the end");
        // Too small for one entry: one anyway, or a guest could never get past it.
        assert_eq!(keys(&pack_page(&entries, "a/", None, 1)), ["a/1"]);
        // `after` before the prefix starts at the prefix; a key equal to the prefix is not repeated.
        assert_eq!(keys(&pack_page(&entries, "b/", Some("a/9"), 1 << 20)), ["b/1"]);
        let with_prefix_key: Entries = [("p".to_owned(), vec![]), ("p1".to_owned(), vec![])].into_iter().collect();
        assert_eq!(keys(&pack_page(&with_prefix_key, "p", Some("p"), 1 << 20)), ["p1"]);
    }
    use crate::bindings::broker::provider::kv::Host;

    fn ctx(ns: &str, backend: &Arc<MemoryKv>) -> KvCtx {
        KvCtx::new(ns.into(), backend.clone(), KvDurability::EachChange, Arc::default())
    }

    /// A memory kv that notes what it is asked to persist.
    #[derive(Default)]
    struct Persisted {
        kv: MemoryKv,
        persisted: Mutex<Vec<KvWrites>>,
        detached: Mutex<Vec<KvWrites>>,
        /// Every persist fails, as on a full disk.
        failing: bool,
    }

    impl KvBackend for Persisted {
        fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
            self.kv.get(namespace, key)
        }
        fn scan_page(
            &self,
            namespace: &str,
            prefix: &str,
            after: Option<&str>,
            max_bytes: usize,
        ) -> Result<ScanPage, KvError> {
            self.kv.scan_page(namespace, prefix, after, max_bytes)
        }
        fn apply(&self, namespace: &str, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError> {
            self.kv.apply(namespace, key, change, quota)
        }
        fn transact(&self, namespace: &str, ops: &[KvOp], quota: KvQuota) -> Result<Option<BTreeSet<String>>, KvError> {
            self.kv.transact(namespace, ops, quota)
        }
        fn persist(&self, writes: KvWrites) -> BoxFuture<'static, Result<(), KvError>> {
            Box::pin(std::future::ready(self.persist_blocking(writes)))
        }
        fn persist_blocking(&self, writes: KvWrites) -> Result<(), KvError> {
            if self.failing {
                return Err(KvError::Storage("disk full".into()));
            }
            self.persisted.lock().unwrap().push(writes);
            Ok(())
        }
        fn persist_detached(&self, writes: KvWrites) {
            self.detached.lock().unwrap().push(writes);
        }
    }

    fn keys(writes: &KvWrites) -> Vec<&str> {
        writes.keys.iter().map(String::as_str).collect()
    }

    /// Each change is persisted before the host function returns, or all of a
    /// call's at its end, as the durability says; reads see a change at once either way.
    #[tokio::test]
    async fn changes_persist_per_change_or_at_the_call_end() {
        let backend = Arc::new(Persisted::default());
        let mut each = KvCtx::new("p".into(), backend.clone(), KvDurability::EachChange, Arc::default());
        each.set("a".into(), b"1".to_vec()).await.unwrap().unwrap();
        assert_eq!(each.increment("n".into(), 2).await.unwrap().unwrap(), 2);
        assert!(matches!(each.increment("a".into(), 1).await.unwrap(), Err(wit::KvError::Invalid(_))));
        {
            let persisted = backend.persisted.lock().unwrap();
            assert_eq!(
                persisted.iter().map(keys).collect::<Vec<_>>(),
                [["a"], ["n"]],
                "a refused change persists nothing"
            );
        }
        assert!(each.take_unpersisted().is_empty());

        backend.persisted.lock().unwrap().clear();
        let mut at_end = KvCtx::new("p".into(), backend.clone(), KvDurability::CallEnd, Arc::default());
        at_end.set("b".into(), b"2".to_vec()).await.unwrap().unwrap();
        assert!(at_end.delete("a".into()).await.unwrap().unwrap());
        assert_eq!(at_end.increment("n".into(), 1).await.unwrap().unwrap(), 3);
        assert_eq!(each.get("b".into()).await.unwrap().unwrap(), Some(b"2".to_vec()), "applied at once");
        assert!(backend.persisted.lock().unwrap().is_empty(), "nothing persisted during the call");
        let unpersisted = at_end.take_unpersisted();
        assert_eq!((&*unpersisted.namespace, keys(&unpersisted)), ("p", vec!["a", "b", "n"]));
        assert!(at_end.take_unpersisted().is_empty(), "taken once");
        // A store dropped with changes left (its call was cancelled) hands them on.
        at_end.set("c".into(), b"3".to_vec()).await.unwrap().unwrap();
        drop((at_end, each));
        let detached = backend.detached.lock().unwrap();
        assert_eq!(detached.iter().map(keys).collect::<Vec<_>>(), [["c"]]);
    }

    /// A change whose commit fails is reported to the guest as applied but not
    /// durable, and stays noted, so the call's end (or a drop) tries it again.
    #[tokio::test]
    async fn a_failed_persist_is_reported_and_kept_for_the_call_end() {
        let backend = Arc::new(Persisted { failing: true, ..Persisted::default() });
        let mut kv = KvCtx::new("p".into(), backend.clone(), KvDurability::EachChange, Arc::default());
        let refused = kv.set("a".into(), b"1".to_vec()).await.unwrap().unwrap_err();
        assert!(
            matches!(&refused, wit::KvError::Storage(m) if m.contains("not yet durable") && m.contains("disk full"))
        );
        assert_eq!(keys(&kv.take_unpersisted()), ["a"]);
    }

    /// A call that changes many keys persists them in bounded chunks as it
    /// goes, so what it leaves for its end never grows past the bound.
    #[tokio::test]
    async fn a_call_end_durability_persists_in_bounded_chunks() {
        let backend = Arc::new(Persisted::default());
        let mut kv = KvCtx::new("p".into(), backend.clone(), KvDurability::CallEnd, Arc::default());
        for n in 0..(MAX_UNPERSISTED_KEYS * 2 + 5) {
            kv.set(format!("k/{n}"), vec![]).await.unwrap().unwrap();
        }
        let chunks: Vec<usize> = backend.persisted.lock().unwrap().iter().map(|w| w.keys.len()).collect();
        assert_eq!(chunks, [MAX_UNPERSISTED_KEYS, MAX_UNPERSISTED_KEYS]);
        assert_eq!(kv.take_unpersisted().keys.len(), 5);
    }

    #[tokio::test]
    async fn namespaces_are_isolated() {
        let backend = Arc::new(MemoryKv::default());
        let mut a = ctx("a", &backend);
        let mut b = ctx("b", &backend);
        a.set("k".into(), b"1".to_vec()).await.unwrap().unwrap();
        assert_eq!(b.get("k".into()).await.unwrap().unwrap(), None);
        assert_eq!(a.get("k".into()).await.unwrap().unwrap(), Some(b"1".to_vec()));
    }

    #[tokio::test]
    async fn scan_packs_entries_in_key_order_under_prefix() {
        let backend = Arc::new(MemoryKv::default());
        let mut kv = ctx("p", &backend);
        for (k, v) in [("i/b", "2"), ("i/a", "1"), ("j/x", "3")] {
            kv.set(k.into(), v.as_bytes().to_vec()).await.unwrap().unwrap();
        }
        let packed = kv.scan("i/".into()).await.unwrap().unwrap();
        let mut expected = Vec::new();
        pack_entry(&mut expected, "i/a", b"1");
        pack_entry(&mut expected, "i/b", b"2");
        assert_eq!(packed, expected);
    }

    #[tokio::test]
    async fn increment_counts_and_refuses_non_counters() {
        let backend = Arc::new(MemoryKv::default());
        let mut kv = ctx("p", &backend);
        assert_eq!(kv.increment("n".into(), 1).await.unwrap().unwrap(), 1);
        assert_eq!(kv.increment("n".into(), 5).await.unwrap().unwrap(), 6);
        kv.set("s".into(), b"text".to_vec()).await.unwrap().unwrap();
        assert!(matches!(kv.increment("s".into(), 1).await.unwrap(), Err(wit::KvError::Invalid(_))));
    }

    #[tokio::test]
    async fn oversized_keys_and_values_are_refused() {
        let backend = Arc::new(MemoryKv::default());
        let mut kv = ctx("p", &backend);
        let long_key = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(matches!(kv.set(long_key, vec![]).await.unwrap(), Err(wit::KvError::TooLarge(_))));
        let big = vec![0u8; MAX_VALUE_BYTES + 1];
        assert!(matches!(kv.set("k".into(), big).await.unwrap(), Err(wit::KvError::TooLarge(_))));
    }
}
