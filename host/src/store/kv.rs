//! The real kv backend: an in-memory mirror per namespace, which every read
//! answers from and every change is applied to at once, and redb behind it,
//! written through the store's one writer (group commit).
//!
//! Persisting a set of keys writes each key's value *as the mirror holds it
//! when the writer applies the write*, not the value a change once set: two
//! calls persisting one key in either order leave the newest value on disk.
//! The mirror is loaded from the file on a namespace's first use, and every
//! change goes through it, so a namespace not loaded yet has nothing waiting
//! to be persisted. (Namespaces are bounded by the quotas issue.)

use super::writer::{Job, Pending, Reply, Writer};
use super::{KV, StoreError, Txn, db_error};
use crate::capabilities::kv::{
    Entries, KvBackend, KvChange, KvChanged, KvError, KvQuota, KvWrites, ScanPage, apply_change, pack_page,
};
use redb::{Database, ReadableDatabase};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

type Namespace = Arc<RwLock<Entries>>;

/// The store's [`KvBackend`](crate::capabilities::kv::KvBackend): each namespace
/// mirrored in memory, writes made durable through the store's writer.
pub struct RedbKv {
    db: Arc<Database>,
    writer: Arc<Writer>,
    /// Loaded namespaces; a namespace is read from disk once, on first use.
    mirror: RwLock<HashMap<String, Namespace>>,
}

fn storage(err: StoreError) -> KvError {
    KvError::Storage(err.to_string())
}

impl RedbKv {
    pub(crate) fn new(db: Arc<Database>, writer: Arc<Writer>) -> Self {
        RedbKv { db, writer, mirror: RwLock::default() }
    }

    fn namespace(&self, name: &str) -> Result<Namespace, KvError> {
        if let Some(ns) = self.mirror.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(ns.clone());
        }
        let mut namespaces = self.mirror.write().unwrap_or_else(|p| p.into_inner());
        if let Some(ns) = namespaces.get(name) {
            return Ok(ns.clone());
        }
        let loaded = Arc::new(RwLock::new(self.load(name).map_err(storage)?));
        namespaces.insert(name.to_owned(), loaded.clone());
        Ok(loaded)
    }

    fn load(&self, name: &str) -> Result<Entries, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(KV).map_err(db_error)?;
        let mut entries = Entries::default();
        for entry in table.range((name, "")..).map_err(db_error)? {
            let (key, value) = entry.map_err(db_error)?;
            let (namespace, key) = key.value();
            if namespace != name {
                break;
            }
            entries.insert(key.to_owned(), value.value().to_vec());
        }
        Ok(entries)
    }

    /// What the state file holds under `key`, whatever the mirror shows: the
    /// durable value (for tools and tests; guests read the mirror).
    pub fn committed(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        let read = || -> Result<Option<Vec<u8>>, StoreError> {
            let txn = self.db.begin_read().map_err(db_error)?;
            let table = txn.open_table(KV).map_err(db_error)?;
            Ok(table.get((namespace, key)).map_err(db_error)?.map(|v| v.value().to_vec()))
        };
        read().map_err(storage)
    }

    /// The writer's job that persists `writes`, to commit in the transaction
    /// of another write (the host's record of the instance they describe);
    /// `None` if there is nothing to persist. (A namespace not loaded has no
    /// change waiting: every change is applied to the mirror first.)
    pub(crate) fn persist_job(&self, writes: KvWrites) -> Option<Box<dyn Job>> {
        if writes.is_empty() {
            return None;
        }
        let loaded = self.mirror.read().unwrap_or_else(|p| p.into_inner()).get(&*writes.namespace).cloned();
        let Some(namespace) = loaded else {
            // Changes are applied here first, so they would be loaded: these came
            // through another backend, whose own persist is what makes them durable.
            tracing::warn!(namespace = %writes.namespace, keys = writes.keys.len(), "kv changes of a namespace this store never loaded");
            return None;
        };
        Some(Box::new(Persist { namespace, writes, reply: None }))
    }

    fn pending(&self, writes: KvWrites) -> Result<Pending<()>, KvError> {
        let namespace = self.namespace(&writes.namespace)?;
        Ok(Pending::with_job(&self.writer, move |reply| Box::new(Persist { namespace, writes, reply: Some(reply) })))
    }
}

/// Keys of one namespace, written with their values as the mirror holds them now.
struct Persist {
    namespace: Namespace,
    writes: KvWrites,
    reply: Option<Reply<Result<(), StoreError>>>,
}

impl Job for Persist {
    fn apply(&mut self, txn: &Txn<'_>) -> Result<(), StoreError> {
        let mut table = txn.open_table(KV).map_err(db_error)?;
        let name = &*self.writes.namespace;
        for key in &self.writes.keys {
            // The value as the mirror holds it now, read under the lock one key
            // at a time (a guest's change is never held up by a whole job); a
            // change after this read waits for the next persist of its key.
            let value = self.namespace.read().unwrap_or_else(|p| p.into_inner()).get(key).cloned();
            match value {
                Some(value) => drop(table.insert((name, key.as_str()), value.as_slice()).map_err(db_error)?),
                None => drop(table.remove((name, key.as_str())).map_err(db_error)?),
            }
        }
        Ok(())
    }

    fn finish(self: Box<Self>, committed: Result<(), StoreError>) {
        match self.reply {
            Some(reply) => reply.send(committed),
            None => {
                if let Err(error) = committed {
                    let (namespace, keys) = (&self.writes.namespace, self.writes.keys.len());
                    tracing::error!(%namespace, keys, %error, "kv changes were not persisted");
                }
            }
        }
    }
}

impl KvBackend for RedbKv {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        let ns = self.namespace(namespace)?;
        let entries = ns.read().unwrap_or_else(|p| p.into_inner());
        Ok(entries.get(key).cloned())
    }

    fn scan_page(
        &self,
        namespace: &str,
        prefix: &str,
        after: Option<&str>,
        max_bytes: usize,
    ) -> Result<ScanPage, KvError> {
        let ns = self.namespace(namespace)?;
        let entries = ns.read().unwrap_or_else(|p| p.into_inner());
        Ok(pack_page(&entries, prefix, after, max_bytes))
    }

    fn apply(&self, namespace: &str, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError> {
        let ns = self.namespace(namespace)?;
        let mut entries = ns.write().unwrap_or_else(|p| p.into_inner());
        apply_change(&mut entries, key, change, quota)
    }

    fn persist(&self, writes: KvWrites) -> futures_util::future::BoxFuture<'static, Result<(), KvError>> {
        if writes.is_empty() {
            return Box::pin(std::future::ready(Ok(())));
        }
        match self.pending(writes) {
            Ok(pending) => Box::pin(async move { pending.await.map_err(storage) }),
            Err(refused) => Box::pin(std::future::ready(Err(refused))),
        }
    }

    fn persist_blocking(&self, writes: KvWrites) -> Result<(), KvError> {
        if writes.is_empty() {
            return Ok(());
        }
        self.pending(writes)?.wait().map_err(storage)
    }

    fn persist_detached(&self, writes: KvWrites) {
        if let Some(persist) = self.persist_job(writes) {
            self.writer.submit(persist);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Store;
    use crate::capabilities::kv::{
        Entries, KvBackend, KvChange, KvChanged, KvError, KvQuota, KvWrites, MemoryKv, pack_prefix,
    };

    /// The real backend and the in-memory fake agree, and the real one persists.
    #[test]
    fn redb_kv_matches_memory_kv_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let memory = MemoryKv::default();
        {
            let store = Store::open(dir.path()).unwrap();
            let real = store.kv();
            for backend in [&*real as &dyn KvBackend, &memory] {
                backend.set("p", "i/a", b"1").unwrap();
                backend.set("p", "i/b", b"2").unwrap();
                backend.set("q", "i/a", b"other").unwrap();
                assert!(backend.delete("p", "i/b").unwrap());
                assert!(!backend.delete("p", "i/b").unwrap());
                assert_eq!(backend.increment("p", "n", 3).unwrap(), 3);
                assert!(matches!(backend.increment("p", "i/a", 1), Err(KvError::Invalid(_))));
            }
            assert_eq!(real.scan_packed("p", "i/").unwrap(), memory.scan_packed("p", "i/").unwrap());
        }
        let reopened = Store::open(dir.path()).unwrap().kv();
        assert_eq!(reopened.get("p", "i/a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(reopened.get("p", "i/b").unwrap(), None);
        assert_eq!(reopened.get("q", "i/a").unwrap(), Some(b"other".to_vec()));
        assert_eq!(reopened.increment("p", "n", 1).unwrap(), 4);
    }

    /// Concurrent increments of one counter, each persisted in shared batches:
    /// each sees the one before it, none is lost, and the file ends with the
    /// newest value whatever order the persists were applied in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_batch_without_losing_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        let tasks: Vec<_> = (0..400)
            .map(|n| {
                let kv = kv.clone();
                tokio::spawn(async move {
                    let counted = kv.apply("p", "n", KvChange::Increment(1), KvQuota::UNBOUNDED).unwrap();
                    let key = format!("k/{n}");
                    kv.apply("p", &key, KvChange::Set(vec![n as u8]), KvQuota::UNBOUNDED).unwrap();
                    let mut writes = KvWrites::new("p".into());
                    writes.keys.extend(["n".to_owned(), key]);
                    kv.persist(writes).await.unwrap();
                    counted
                })
            })
            .collect();
        let mut counts = Vec::new();
        for task in tasks {
            let KvChanged::Counter(n) = task.await.unwrap() else { panic!("not a counter") };
            counts.push(n);
        }
        counts.sort_unstable();
        assert_eq!(counts, (1..=400).collect::<Vec<_>>(), "every increment saw the one before it");
        assert_eq!(kv.increment("p", "n", 0).unwrap(), 400);
        assert_eq!(kv.get("p", "k/399").unwrap(), Some(vec![(399 % 256) as u8]));
        drop((kv, store));
        let reopened = Store::open(dir.path()).unwrap().kv();
        assert_eq!(reopened.get("p", "n").unwrap(), Some(400i64.to_le_bytes().to_vec()));
        let expected: Entries = (0..400).map(|n| (format!("k/{n}"), vec![n as u8])).collect();
        assert_eq!(reopened.scan_packed("p", "k/").unwrap(), pack_prefix(&expected, "k/").unwrap());
    }

    /// A change is visible at once and reaches the file only when its key is
    /// persisted; one never persisted is gone after a reopen.
    #[test]
    fn a_change_is_durable_once_persisted_and_not_before() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            let kv = store.kv();
            kv.apply("p", "kept", KvChange::Set(b"1".to_vec()), KvQuota::UNBOUNDED).unwrap();
            kv.apply("p", "lost", KvChange::Set(b"2".to_vec()), KvQuota::UNBOUNDED).unwrap();
            assert_eq!(kv.get("p", "lost").unwrap(), Some(b"2".to_vec()), "applied at once");
            let mut writes = KvWrites::new("p".into());
            writes.keys.insert("kept".into());
            kv.persist_blocking(writes).unwrap();
            // A key persisted after a later change holds the later value.
            kv.apply("p", "kept", KvChange::Set(b"3".to_vec()), KvQuota::UNBOUNDED).unwrap();
            let mut writes = KvWrites::new("p".into());
            writes.keys.insert("kept".into());
            kv.persist_blocking(writes).unwrap();
        }
        let reopened = Store::open(dir.path()).unwrap().kv();
        assert_eq!(reopened.get("p", "kept").unwrap(), Some(b"3".to_vec()));
        assert_eq!(reopened.get("p", "lost").unwrap(), None);
    }
}
