//! `broker:provider/kv`: each provider's own persistent namespace.
//!
//! [`KvBackend`] is the storage seam: the real backend lives in
//! [`crate::store`] (redb), [`MemoryKv`] serves unit tests and benchmarks.

use crate::bindings::broker::provider::kv::{self as wit};
use futures_util::future::BoxFuture;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use wasmtime::component::{HasSelf, Linker};

/// Its interface in the contract package.
pub const INTERFACE: &str = "kv";

/// Keys longer than this are refused.
pub const MAX_KEY_BYTES: usize = 1024;
/// Values larger than this are refused.
pub const MAX_VALUE_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KvError {
    #[error("too large: {0}")]
    TooLarge(String),
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("storage: {0}")]
    Storage(String),
}

impl From<KvError> for wit::KvError {
    fn from(err: KvError) -> Self {
        match err {
            KvError::TooLarge(m) => wit::KvError::TooLarge(m),
            KvError::Invalid(m) => wit::KvError::Invalid(m),
            KvError::Storage(m) => wit::KvError::Storage(m),
        }
    }
}

/// A change to one key.
#[derive(Debug, Clone, PartialEq)]
pub enum KvChange {
    Set(Vec<u8>),
    Delete,
    /// Add to the little-endian i64 counter (absent counts as 0).
    Increment(i64),
}

/// What a change did.
#[derive(Debug, Clone, PartialEq)]
pub enum KvChanged {
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

/// Storage of provider namespaces. `scan` returns entries in key order.
///
/// Reads answer from memory. A change is durable once [`KvBackend::change`]
/// resolves; host functions await it (the real backend commits on the store's
/// writer thread, never on the executor). The blocking forms are for tests and
/// tools, which are not async.
pub trait KvBackend: Send + Sync + 'static {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError>;
    /// Entries under `prefix`, already packed as `scan` returns them to guests.
    fn scan_packed(&self, namespace: &str, prefix: &str) -> Result<Vec<u8>, KvError>;
    /// Apply one change; resolves once it is durable.
    fn change(&self, namespace: &str, key: &str, change: KvChange) -> BoxFuture<'static, Result<KvChanged, KvError>>;
    /// As [`KvBackend::change`], waiting on this thread.
    fn change_blocking(&self, namespace: &str, key: &str, change: KvChange) -> Result<KvChanged, KvError>;

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

/// Append one scan entry to `out` in the wire format of `kv.scan`.
pub fn pack_entry(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
}

/// Pack every entry of `entries` under `prefix`.
pub fn pack_prefix(entries: &BTreeMap<String, Vec<u8>>, prefix: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for (key, value) in entries.range(prefix.to_owned()..).take_while(|(k, _)| k.starts_with(prefix)) {
        pack_entry(&mut out, key, value);
    }
    out
}

/// Decode a little-endian i64 counter as `increment` stores it.
pub fn decode_counter(bytes: &[u8]) -> Result<i64, KvError> {
    let array: [u8; 8] = bytes
        .try_into()
        .map_err(|_| KvError::Invalid(format!("increment: value is {} bytes, not an 8-byte integer", bytes.len())))?;
    Ok(i64::from_le_bytes(array))
}

pub fn check_key(key: &str) -> Result<(), KvError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(KvError::TooLarge(format!("key of {} bytes (limit {MAX_KEY_BYTES})", key.len())));
    }
    Ok(())
}

pub fn check_value(value: &[u8]) -> Result<(), KvError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(KvError::TooLarge(format!("value of {} bytes (limit {MAX_VALUE_BYTES})", value.len())));
    }
    Ok(())
}

/// In-memory namespaces, for unit tests and benchmarks.
#[derive(Default)]
pub struct MemoryKv {
    namespaces: Mutex<HashMap<String, BTreeMap<String, Vec<u8>>>>,
}

impl MemoryKv {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, BTreeMap<String, Vec<u8>>>> {
        self.namespaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn apply(&self, namespace: &str, key: &str, change: KvChange) -> Result<KvChanged, KvError> {
        change.check(key)?;
        let mut namespaces = self.lock();
        let ns = namespaces.entry(namespace.to_owned()).or_default();
        match change {
            KvChange::Set(value) => {
                ns.insert(key.to_owned(), value);
                Ok(KvChanged::Set)
            }
            KvChange::Delete => Ok(KvChanged::Deleted(ns.remove(key).is_some())),
            KvChange::Increment(delta) => {
                let current = ns.get(key).map(|v| decode_counter(v)).transpose()?.unwrap_or(0);
                let next = current
                    .checked_add(delta)
                    .ok_or_else(|| KvError::Invalid(format!("increment of {key:?} overflows")))?;
                ns.insert(key.to_owned(), next.to_le_bytes().to_vec());
                Ok(KvChanged::Counter(next))
            }
        }
    }
}

impl KvBackend for MemoryKv {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.lock().get(namespace).and_then(|ns| ns.get(key).cloned()))
    }
    fn scan_packed(&self, namespace: &str, prefix: &str) -> Result<Vec<u8>, KvError> {
        Ok(self.lock().get(namespace).map(|ns| pack_prefix(ns, prefix)).unwrap_or_default())
    }
    fn change(&self, namespace: &str, key: &str, change: KvChange) -> BoxFuture<'static, Result<KvChanged, KvError>> {
        Box::pin(std::future::ready(self.apply(namespace, key, change)))
    }
    fn change_blocking(&self, namespace: &str, key: &str, change: KvChange) -> Result<KvChanged, KvError> {
        self.apply(namespace, key, change)
    }
}

/// Per-store context: which namespace this guest may touch, and where it lives.
pub struct KvCtx {
    namespace: Arc<str>,
    backend: Arc<dyn KvBackend>,
}

impl KvCtx {
    pub fn new(namespace: Arc<str>, backend: Arc<dyn KvBackend>) -> Self {
        KvCtx { namespace, backend }
    }
}

type WitResult<T> = wasmtime::Result<Result<T, wit::KvError>>;

impl KvCtx {
    async fn change(&self, key: String, change: KvChange) -> Result<KvChanged, wit::KvError> {
        self.backend.change(&self.namespace, &key, change).await.map_err(Into::into)
    }
}

/// A backend that answered a change with what another change answers.
fn mismatched(answer: KvChanged) -> wit::KvError {
    wit::KvError::Storage(format!("the store answered {answer:?}"))
}

impl wit::Host for KvCtx {
    async fn get(&mut self, key: String) -> WitResult<Option<Vec<u8>>> {
        Ok(self.backend.get(&self.namespace, &key).map_err(Into::into))
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
        Ok(self.backend.scan_packed(&self.namespace, &prefix).map_err(Into::into))
    }
}

pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut KvCtx,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, HasSelf<KvCtx>>(linker, getter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::broker::provider::kv::Host;

    fn ctx(ns: &str, backend: &Arc<MemoryKv>) -> KvCtx {
        KvCtx::new(ns.into(), backend.clone())
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
