//! The real kv backend: redb, written through the store's one writer (group
//! commit), with an in-memory mirror per namespace so guest reads (the hot
//! path) never open a transaction. A change reaches the mirror only once it is
//! committed, and in commit order: the writer thread applies it there before
//! it answers the caller. (A first load of a large namespace holds the
//! writer back while it reads: namespaces are bounded by the quotas issue.)

use super::writer::{Job, Pending, Reply, Writer};
use super::{KV, StoreError, db_error};
use crate::capabilities::kv::{KvBackend, KvChange, KvChanged, KvError, decode_counter, pack_prefix};
use redb::{Database, ReadableDatabase, ReadableTable, WriteTransaction};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

type Namespace = Arc<RwLock<BTreeMap<String, Vec<u8>>>>;

/// Loaded namespaces; a namespace is read from disk once, on first use.
#[derive(Default)]
struct Mirror {
    namespaces: RwLock<HashMap<String, Namespace>>,
}

pub struct RedbKv {
    db: Arc<Database>,
    writer: Arc<Writer>,
    mirror: Arc<Mirror>,
}

fn storage(err: StoreError) -> KvError {
    KvError::Storage(err.to_string())
}

impl RedbKv {
    pub(crate) fn new(db: Arc<Database>, writer: Arc<Writer>) -> Self {
        RedbKv { db, writer, mirror: Arc::default() }
    }

    fn namespace(&self, name: &str) -> Result<Namespace, KvError> {
        if let Some(ns) = self.mirror.namespaces.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(ns.clone());
        }
        // Loaded under the writer's fence: a load sees a batch either before its
        // commit (and its answers apply it here after) or whole, never half
        // answered (a value going back as the batch's earlier writes answer).
        let _fence = self.writer.fence().write().unwrap_or_else(|p| p.into_inner());
        let mut namespaces = self.mirror.namespaces.write().unwrap_or_else(|p| p.into_inner());
        if let Some(ns) = namespaces.get(name) {
            return Ok(ns.clone());
        }
        let loaded = Arc::new(RwLock::new(self.load(name).map_err(storage)?));
        namespaces.insert(name.to_owned(), loaded.clone());
        Ok(loaded)
    }

    fn load(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(KV).map_err(db_error)?;
        let mut entries = BTreeMap::new();
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

    fn pending(&self, namespace: &str, key: &str, change: KvChange) -> Pending<Result<KvChanged, KvError>> {
        let (namespace, key, mirror) = (namespace.to_owned(), key.to_owned(), self.mirror.clone());
        Pending::with_job(&self.writer, move |reply| {
            Box::new(KvWrite { namespace, key, change, mirror, written: None, answer: None, reply })
        })
    }
}

/// One kv change as a job of the store's writer.
struct KvWrite {
    namespace: String,
    key: String,
    change: KvChange,
    mirror: Arc<Mirror>,
    /// The key's value after this change (`None`: deleted), once applied.
    written: Option<Option<Vec<u8>>>,
    answer: Option<Result<KvChanged, KvError>>,
    reply: Reply<Result<Result<KvChanged, KvError>, StoreError>>,
}

impl Job for KvWrite {
    fn apply(&mut self, txn: &WriteTransaction) -> Result<(), StoreError> {
        let mut table = txn.open_table(KV).map_err(db_error)?;
        let at = (self.namespace.as_str(), self.key.as_str());
        // Read in the batch's transaction: it holds the batch's earlier writes.
        let current = table.get(at).map_err(db_error)?.map(|v| v.value().to_vec());
        let (written, answer) = match &self.change {
            KvChange::Set(value) => (Some(Some(value.clone())), Ok(KvChanged::Set)),
            KvChange::Delete => match current {
                Some(_) => (Some(None), Ok(KvChanged::Deleted(true))),
                None => (None, Ok(KvChanged::Deleted(false))),
            },
            KvChange::Increment(delta) => {
                match current.map(|v| decode_counter(&v)).transpose().map(Option::unwrap_or_default) {
                    Ok(now) => match now.checked_add(*delta) {
                        Some(next) => (Some(Some(next.to_le_bytes().to_vec())), Ok(KvChanged::Counter(next))),
                        None => (None, Err(KvError::Invalid(format!("increment of {:?} overflows", self.key)))),
                    },
                    // Refused, not a storage failure: the batch goes on without it.
                    Err(refused) => (None, Err(refused)),
                }
            }
        };
        match &written {
            Some(Some(value)) => drop(table.insert(at, value.as_slice()).map_err(db_error)?),
            Some(None) => drop(table.remove(at).map_err(db_error)?),
            None => {}
        }
        self.written = written;
        self.answer = Some(answer);
        Ok(())
    }

    fn finish(self: Box<Self>, committed: Result<(), StoreError>) {
        let KvWrite { namespace, key, mirror, written, answer, reply, .. } = *self;
        if let (Ok(()), Some(written)) = (&committed, written) {
            let namespaces = mirror.namespaces.read().unwrap_or_else(|p| p.into_inner());
            // A namespace not loaded yet reads the committed value from the file.
            if let Some(ns) = namespaces.get(&namespace) {
                let mut entries = ns.write().unwrap_or_else(|p| p.into_inner());
                match written {
                    Some(value) => entries.insert(key, value),
                    None => entries.remove(&key),
                };
            }
        }
        reply.send(committed.and_then(|()| answer.ok_or(StoreError::Closed)));
    }
}

fn flatten(answer: Result<Result<KvChanged, KvError>, StoreError>) -> Result<KvChanged, KvError> {
    answer.map_err(storage)?
}

impl KvBackend for RedbKv {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        let ns = self.namespace(namespace)?;
        let entries = ns.read().unwrap_or_else(|p| p.into_inner());
        Ok(entries.get(key).cloned())
    }

    fn scan_packed(&self, namespace: &str, prefix: &str) -> Result<Vec<u8>, KvError> {
        let ns = self.namespace(namespace)?;
        let entries = ns.read().unwrap_or_else(|p| p.into_inner());
        Ok(pack_prefix(&entries, prefix))
    }

    fn change(
        &self,
        namespace: &str,
        key: &str,
        change: KvChange,
    ) -> futures_util::future::BoxFuture<'static, Result<KvChanged, KvError>> {
        if let Err(refused) = change.check(key) {
            return Box::pin(std::future::ready(Err(refused)));
        }
        let pending = self.pending(namespace, key, change);
        Box::pin(async move { flatten(pending.await) })
    }

    fn change_blocking(&self, namespace: &str, key: &str, change: KvChange) -> Result<KvChanged, KvError> {
        change.check(key)?;
        flatten(self.pending(namespace, key, change).wait())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Store;
    use crate::capabilities::kv::{KvBackend, KvChange, KvChanged, KvError, MemoryKv};

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

    /// Concurrent increments of one counter, committed in shared batches: each
    /// sees the one before it, none is lost, and what a caller is answered is
    /// in the mirror and in the file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_batch_without_losing_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        let tasks: Vec<_> = (0..400)
            .map(|n| {
                let kv = kv.clone();
                tokio::spawn(async move {
                    let counted = kv.change("p", "n", KvChange::Increment(1)).await.unwrap();
                    kv.change("p", &format!("k/{n}"), KvChange::Set(vec![n as u8])).await.unwrap();
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
        let expected: std::collections::BTreeMap<String, Vec<u8>> =
            (0..400).map(|n| (format!("k/{n}"), vec![n as u8])).collect();
        assert_eq!(reopened.scan_packed("p", "k/").unwrap(), crate::capabilities::kv::pack_prefix(&expected, "k/"));
    }
}
