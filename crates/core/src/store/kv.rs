//! The real kv backend: an in-memory mirror per namespace, which every read
//! answers from and every change is applied to at once, and redb behind it,
//! written through the store's one writer (group commit).
//!
//! Persisting a set of keys writes each key's value *as the mirror holds it
//! when the writer applies the write*, not the value a change once set: two
//! calls persisting one key in either order leave the newest value on disk.
//! The mirror is loaded from the file on a namespace's first use, and every
//! change goes through it, so a namespace not loaded has nothing waiting to
//! be persisted.
//!
//! The mirror is bounded host-wide ([`MIRROR_BUDGET_BYTES`]): past it, the
//! least recently used namespaces that are *clean* (every change they hold is
//! in the file, and nobody holds them) are let go, to be loaded again on their
//! next use. A namespace with a change not yet persisted is never let go, so
//! eviction can lose nothing; each namespace is bounded by its `kv-mib`.

use super::db::StateDb;
use super::writer::{Job, Pending, Reply, Writer};
use super::{KV, StoreError, Txn, db_error};
use broker_capabilities::rooms::kv::{
    Entries, KvBackend, KvChange, KvChanged, KvError, KvOp, KvQuota, KvWrites, ScanPage, apply_change,
    apply_transaction, pack_page,
};
use std::collections::BTreeSet;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

/// Most bytes (keys and values) the mirrors of all namespaces keep together
/// before clean ones are let go. A namespace in use is kept whatever its
/// size, so the mirror holds at most this plus the namespaces in use.
pub const MIRROR_BUDGET_BYTES: usize = 256 << 20;

/// One namespace's mirror: its entries, and the changes to them not yet in the file.
#[derive(Default)]
struct Mirror {
    entries: Entries,
    /// For each key changed since the file last took its value, the number of
    /// its last change; a key leaves when a commit took its value *as of that
    /// change* (two persists of a key in one batch may have read the same one).
    dirty: HashMap<String, u64>,
    /// Numbers the namespace's changes.
    changes: u64,
}

impl Mirror {
    /// Apply `change` to `key` (within `quota`), noting it as not yet in the file.
    fn change(&mut self, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError> {
        let answer = apply_change(&mut self.entries, key, change, quota)?;
        self.changes += 1;
        self.dirty.insert(key.to_owned(), self.changes);
        Ok(answer)
    }

    /// Apply a transaction (within `quota`): its keys are one change, not yet in the file.
    fn transact(&mut self, ops: &[KvOp], quota: KvQuota) -> Result<Option<BTreeSet<String>>, KvError> {
        let written = apply_transaction(&mut self.entries, ops, quota)?;
        if let Some(keys) = &written {
            self.changes += 1;
            for key in keys {
                self.dirty.insert(key.clone(), self.changes);
            }
        }
        Ok(written)
    }

    /// A commit took each key's value as of the change numbered with it: the
    /// key is in the file now, unless it changed again since.
    fn settle(&mut self, taken: &[(String, u64)]) {
        for (key, last_change) in taken {
            if self.dirty.get(key) == Some(last_change) {
                self.dirty.remove(key);
            }
        }
    }
}

struct Namespace {
    mirror: RwLock<Mirror>,
    /// When it was last used, on the backend's clock (for letting go the least recent).
    used: AtomicU64,
    /// Its entries' bytes as of its last change (read without its lock).
    bytes: AtomicUsize,
}

impl Namespace {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Mirror> {
        self.mirror.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Mirror> {
        self.mirror.write().unwrap_or_else(|p| p.into_inner())
    }
}

type Shared = Arc<Namespace>;

/// How the mirror fares: what it holds, and how often namespaces were loaded and let go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorStats {
    /// Namespaces held in memory.
    pub namespaces: usize,
    /// Their keys and values, in bytes.
    pub bytes: usize,
    /// Namespaces read from the state file so far.
    pub loads: u64,
    /// Clean namespaces let go so far, to keep within the budget.
    pub evictions: u64,
}

/// The store's [`KvBackend`](broker_capabilities::rooms::kv::KvBackend): each namespace
/// mirrored in memory, writes made durable through the store's writer.
pub struct RedbKv {
    db: Arc<StateDb>,
    writer: Arc<Writer>,
    mirrors: Arc<Mirrors>,
}

/// The loaded namespaces, bounded together by a budget.
struct Mirrors {
    /// A namespace is read from disk on its first use after it was let go (or ever).
    loaded: RwLock<HashMap<String, Shared>>,
    budget: AtomicUsize,
    clock: AtomicU64,
    loads: AtomicU64,
    evictions: AtomicU64,
}

impl Mirrors {
    fn map(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Shared>> {
        self.loaded.read().unwrap_or_else(|p| p.into_inner())
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    fn stats(&self) -> MirrorStats {
        let loaded = self.map();
        MirrorStats {
            namespaces: loaded.len(),
            bytes: loaded.values().map(|ns| ns.bytes.load(Ordering::Relaxed)).sum(),
            loads: self.loads.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    /// Let go of the least recently used clean namespaces while the mirror is
    /// past its budget. Clean: no change waits to be persisted and nobody holds
    /// it (a call reading it, a persist on its way). Both are checked under the
    /// map's write lock, where nobody can take a new hold. The namespace used
    /// last is kept whatever its size (its `kv-mib` bounds it): let go, a
    /// namespace larger than the budget would be read whole from the file
    /// again at every call of its provider.
    fn trim(&self) {
        let budget = self.budget.load(Ordering::Relaxed);
        if self.stats().bytes <= budget {
            return;
        }
        let mut loaded = self.loaded.write().unwrap_or_else(|p| p.into_inner());
        let mut total: usize = loaded.values().map(|ns| ns.bytes.load(Ordering::Relaxed)).sum();
        let mut by_age: Vec<(u64, String)> =
            loaded.iter().map(|(name, ns)| (ns.used.load(Ordering::Relaxed), name.clone())).collect();
        by_age.sort_unstable();
        by_age.pop();
        for (_, name) in by_age {
            if total <= budget {
                break;
            }
            let Some(ns) = loaded.get(&name) else { continue };
            let clean = Arc::strong_count(ns) == 1 && ns.mirror.try_read().is_ok_and(|mirror| mirror.dirty.is_empty());
            if clean {
                total -= ns.bytes.load(Ordering::Relaxed);
                loaded.remove(&name);
                self.evictions.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(namespace = %name, "kv namespace let go of the mirror (clean, least recently used)");
            }
        }
    }
}

fn storage(err: StoreError) -> KvError {
    KvError::Storage(err.to_string())
}

/// Loads a namespace may retry when namespaces are let go while it reads,
/// before it reads under the map's lock.
const LOAD_RETRIES: usize = 4;

/// `name`'s mirror, read from the file if it is not held. The file is read
/// outside the map's lock (a large namespace takes milliseconds to read, and
/// every other namespace's reads go through the map); what was read is kept
/// only if no namespace was let go meanwhile, since one let go may be this one
/// with commits the read missed.
fn load_namespace(db: &StateDb, mirrors: &Mirrors, name: &str) -> Result<Shared, KvError> {
    let held = |ns: &Shared| {
        ns.used.store(mirrors.tick(), Ordering::Relaxed);
        Ok(ns.clone())
    };
    let mut attempt = 0;
    loop {
        if let Some(ns) = mirrors.map().get(name) {
            return held(ns);
        }
        let evictions = mirrors.evictions.load(Ordering::SeqCst);
        let last = attempt == LOAD_RETRIES;
        let mut read_unlocked = if last { None } else { Some(read_namespace(db, name).map_err(storage)?) };
        let mut loaded = mirrors.loaded.write().unwrap_or_else(|p| p.into_inner());
        if let Some(ns) = loaded.get(name) {
            // Loaded by another call meanwhile: its mirror may hold changes since.
            return held(ns);
        }
        if !last && mirrors.evictions.load(Ordering::SeqCst) != evictions {
            attempt += 1;
            continue;
        }
        let entries = match read_unlocked.take() {
            Some(entries) => entries,
            None => read_namespace(db, name).map_err(storage)?,
        };
        mirrors.loads.fetch_add(1, Ordering::Relaxed);
        let bytes = AtomicUsize::new(entries.bytes());
        let mirror = RwLock::new(Mirror { entries, dirty: HashMap::new(), changes: 0 });
        let ns = Arc::new(Namespace { mirror, used: AtomicU64::new(mirrors.tick()), bytes });
        loaded.insert(name.to_owned(), ns.clone());
        drop(loaded);
        mirrors.trim();
        return Ok(ns);
    }
}

/// Every entry of `name` in the file.
fn read_namespace(db: &StateDb, name: &str) -> Result<Entries, StoreError> {
    let txn = db.begin_read()?;
    let table = txn.open_table(KV).map_err(db_error)?;
    let mut entries = Entries::default();
    super::each_of_owner(&table, name, |key, value| {
        entries.insert(key.to_owned(), value.to_vec());
        Ok(())
    })?;
    Ok(entries)
}

impl RedbKv {
    pub(crate) fn new(db: Arc<StateDb>, writer: Arc<Writer>) -> Self {
        let mirrors = Mirrors {
            loaded: RwLock::default(),
            budget: AtomicUsize::new(MIRROR_BUDGET_BYTES),
            clock: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        };
        RedbKv { db, writer, mirrors: Arc::new(mirrors) }
    }

    /// Bound the mirror to `bytes` instead of [`MIRROR_BUDGET_BYTES`]
    /// (`broker serve --kv-mirror-mib`; tests and benchmarks).
    pub fn set_mirror_budget(&self, bytes: usize) {
        self.mirrors.budget.store(bytes, Ordering::Relaxed);
        self.mirrors.trim();
    }

    /// What the mirror holds now, and its loads and evictions so far.
    pub fn mirror_stats(&self) -> MirrorStats {
        self.mirrors.stats()
    }

    fn namespace(&self, name: &str) -> Result<Shared, KvError> {
        load_namespace(&self.db, &self.mirrors, name)
    }

    /// What the state file holds under `key`, whatever the mirror shows: the
    /// durable value (for tools and tests; guests read the mirror).
    pub fn committed(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        let read = || -> Result<Option<Vec<u8>>, StoreError> {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(KV).map_err(db_error)?;
            Ok(table.get((namespace, key)).map_err(db_error)?.map(|v| v.value().to_vec()))
        };
        read().map_err(storage)
    }

    /// The writer's job that persists `writes`, to commit in the transaction
    /// of another write (the host's record of the instance they describe);
    /// `None` if there is nothing to persist. (A namespace with changes to
    /// persist is loaded, and stays so until they are persisted.)
    pub(crate) fn persist_job(&self, writes: KvWrites) -> Option<Box<dyn Job>> {
        if writes.is_empty() {
            return None;
        }
        let loaded = self.mirrors.map().get(&*writes.namespace).cloned();
        let Some(namespace) = loaded else {
            // Changes are applied here first, so they would be loaded: these came
            // through another backend, whose own persist is what makes them durable.
            tracing::warn!(namespace = %writes.namespace, keys = writes.keys.len(), "kv changes of a namespace this store never loaded");
            return None;
        };
        Some(Box::new(Persist { mirrors: self.mirrors.clone(), namespace, writes, taken: Vec::new(), reply: None }))
    }

    fn pending(&self, writes: KvWrites) -> Result<Pending<()>, KvError> {
        let namespace = self.namespace(&writes.namespace)?;
        let mirrors = self.mirrors.clone();
        Ok(Pending::with_job(&self.writer, move |reply| {
            Box::new(Persist { mirrors, namespace, writes, taken: Vec::new(), reply: Some(reply) })
        }))
    }
}

/// Keys of one namespace, written with their values as the mirror holds them now.
struct Persist {
    mirrors: Arc<Mirrors>,
    namespace: Shared,
    writes: KvWrites,
    /// For each key written, the number of the last change its written value
    /// held: on a commit, the key is clean unless it changed since.
    taken: Vec<(String, u64)>,
    reply: Option<Reply<Result<(), StoreError>>>,
}

impl Job for Persist {
    fn apply(&mut self, txn: &Txn<'_>) -> Result<(), StoreError> {
        let mut table = txn.open_table(KV).map_err(db_error)?;
        let name = &*self.writes.namespace;
        self.taken.clear();
        for key in &self.writes.keys {
            // The value as the mirror holds it now, read under the lock one key
            // at a time (a guest's change is never held up by a whole job); a
            // change after this read waits for the next persist of its key.
            let (value, last_change) = {
                let mirror = self.namespace.read();
                (mirror.entries.get(key).cloned(), mirror.dirty.get(key).copied())
            };
            match value {
                Some(value) => drop(table.insert((name, key.as_str()), value.as_slice()).map_err(db_error)?),
                None => drop(table.remove((name, key.as_str())).map_err(db_error)?),
            }
            if let Some(last_change) = last_change {
                self.taken.push((key.clone(), last_change));
            }
        }
        Ok(())
    }

    fn finish(self: Box<Self>, committed: Result<(), StoreError>) {
        if committed.is_ok() && !self.taken.is_empty() {
            self.namespace.write().settle(&self.taken);
        }
        let Persist { mirrors, namespace, writes, reply, .. } = *self;
        // This job's hold goes first: the namespace may be the one to let go.
        drop(namespace);
        mirrors.trim();
        match reply {
            Some(reply) => reply.send(committed),
            None => {
                if let Err(error) = committed {
                    let (namespace, keys) = (&writes.namespace, writes.keys.len());
                    tracing::error!(%namespace, keys, %error, "kv changes were not persisted");
                }
            }
        }
    }
}

impl KvBackend for RedbKv {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        let ns = self.namespace(namespace)?;
        let value = ns.read().entries.get(key).cloned();
        Ok(value)
    }

    fn scan_page(
        &self,
        namespace: &str,
        prefix: &str,
        after: Option<&str>,
        max_bytes: usize,
    ) -> Result<ScanPage, KvError> {
        let ns = self.namespace(namespace)?;
        let page = pack_page(&ns.read().entries, prefix, after, max_bytes);
        Ok(page)
    }

    fn warm(&self, namespace: &str) -> Option<futures_util::future::BoxFuture<'static, Result<(), KvError>>> {
        if self.mirrors.map().contains_key(namespace) {
            return None;
        }
        let (db, mirrors, name) = (self.db.clone(), self.mirrors.clone(), namespace.to_owned());
        let loading = tokio::task::spawn_blocking(move || load_namespace(&db, &mirrors, &name).map(drop));
        Some(Box::pin(async move {
            loading
                .await
                .unwrap_or_else(|failed| Err(KvError::Storage(format!("reading the namespace failed: {failed}"))))
        }))
    }

    fn apply(&self, namespace: &str, key: &str, change: KvChange, quota: KvQuota) -> Result<KvChanged, KvError> {
        let ns = self.namespace(namespace)?;
        let mut mirror = ns.write();
        // Numbered under the lock the change is made under: a persist reads the
        // value and this number together, so it knows which change it took.
        let answer = mirror.change(key, change, quota)?;
        ns.bytes.store(mirror.entries.bytes(), Ordering::Relaxed);
        Ok(answer)
    }

    fn transact(&self, namespace: &str, ops: &[KvOp], quota: KvQuota) -> Result<Option<BTreeSet<String>>, KvError> {
        let ns = self.namespace(namespace)?;
        let mut mirror = ns.write();
        let written = mirror.transact(ops, quota)?;
        ns.bytes.store(mirror.entries.bytes(), Ordering::Relaxed);
        Ok(written)
    }

    fn persist(&self, writes: KvWrites) -> futures_util::future::BoxFuture<'static, Result<(), KvError>> {
        if writes.is_empty() {
            return Box::pin(std::future::ready(Ok(())));
        }
        // Handed to the writer now, not when first polled: changes every
        // reader already sees reach the file even if nobody waits for them.
        match self.pending(writes) {
            Ok(pending) => {
                let committed = pending.submit();
                Box::pin(async move { committed.await.map_err(storage) })
            }
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
    use broker_capabilities::rooms::kv::{
        Entries, KvBackend, KvChange, KvChanged, KvError, KvOp, KvQuota, KvWrites, MemoryKv, pack_prefix,
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
                let ops = [KvOp::ExpectAbsent("t/c".into()), KvOp::Set("t/c".into(), b"3".to_vec())];
                let written = backend.transact("p", &ops, KvQuota::UNBOUNDED).unwrap().unwrap();
                let refused = [KvOp::ExpectAbsent("t/c".into()), KvOp::Set("t/never".into(), vec![])];
                assert_eq!(backend.transact("p", &refused, KvQuota::UNBOUNDED).unwrap(), None);
                let mut writes = KvWrites::new("p".into());
                writes.keys = written;
                backend.persist_blocking(writes).unwrap();
            }
            assert_eq!(real.scan_packed("p", "i/").unwrap(), memory.scan_packed("p", "i/").unwrap());
        }
        let reopened = Store::open(dir.path()).unwrap().kv();
        assert_eq!(reopened.get("p", "i/a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(reopened.get("p", "t/c").unwrap(), Some(b"3".to_vec()), "a transaction's writes persist together");
        assert_eq!(reopened.get("p", "t/never").unwrap(), None);
        assert_eq!(reopened.get("p", "i/b").unwrap(), None);
        assert_eq!(reopened.get("q", "i/a").unwrap(), Some(b"other".to_vec()));
        assert_eq!(reopened.increment("p", "n", 1).unwrap(), 4);
    }

    /// Changes handed to `persist` reach the file even if nobody waits for
    /// them: every reader already sees them (a reconcile that is dropped
    /// while its calls' changes commit). Fails with a persist that writes
    /// only when first polled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_persist_nobody_waits_for_still_commits() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            let kv = store.kv();
            kv.set("p", "k", b"seen").unwrap();
            let mut writes = KvWrites::new("p".into());
            writes.keys.insert("k".into());
            drop(kv.persist(writes));
        }
        let reopened = Store::open(dir.path()).unwrap().kv();
        assert_eq!(reopened.get("p", "k").unwrap(), Some(b"seen".to_vec()));
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

    /// Two persists of one key in one commit both took its value as of the
    /// same change, and the key changed again before the commit settled: it
    /// stays unpersisted (counting changes instead settled it twice, and the
    /// namespace could be let go holding a change the file lacks).
    #[test]
    fn a_key_changed_after_two_persists_read_it_stays_dirty() {
        let mut mirror = super::Mirror::default();
        mirror.change("n", KvChange::Increment(1), KvQuota::UNBOUNDED).unwrap();
        let read = vec![("n".to_owned(), *mirror.dirty.get("n").unwrap())];
        let (first, second) = (read.clone(), read);
        mirror.change("n", KvChange::Increment(1), KvQuota::UNBOUNDED).unwrap();
        mirror.settle(&first);
        mirror.settle(&second);
        assert!(mirror.dirty.contains_key("n"), "the second increment is not in the file");
        let latest = vec![("n".to_owned(), mirror.changes)];
        mirror.settle(&latest);
        assert!(mirror.dirty.is_empty());
    }

    /// Past its budget the mirror lets go of the least recently used clean
    /// namespace, and reads it again from the file on its next use.
    #[test]
    fn the_mirror_lets_go_of_the_least_recently_used_clean_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        for namespace in ["a", "b", "c"] {
            kv.set(namespace, "k", &[7; 1000]).unwrap();
        }
        assert_eq!(kv.mirror_stats().namespaces, 3);
        // Room for two: "a", the least recently used, goes.
        kv.get("b", "k").unwrap();
        kv.get("c", "k").unwrap();
        kv.set_mirror_budget(2100);
        let stats = kv.mirror_stats();
        assert_eq!((stats.namespaces, stats.evictions), (2, 1), "{stats:?}");
        assert_eq!(kv.get("a", "k").unwrap(), Some(vec![7; 1000]), "read again from the file");
        let stats = kv.mirror_stats();
        assert_eq!((stats.namespaces, stats.loads, stats.evictions), (2, 4, 2), "{stats:?}");
    }

    /// A namespace larger than the whole budget, used call after call, is
    /// read from the file once, not at every call (each call leaves it clean).
    #[test]
    fn a_namespace_past_the_budget_is_not_read_again_at_every_use() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        kv.set_mirror_budget(1000);
        for n in 0..20 {
            kv.set("big", &format!("instance/{n}"), &[1; 100]).unwrap();
            assert_eq!(kv.get("big", "instance/0").unwrap(), Some(vec![1; 100]));
        }
        let stats = kv.mirror_stats();
        assert_eq!((stats.namespaces, stats.loads, stats.evictions), (1, 1, 0), "{stats:?}");
        // Another namespace's use makes it the least recently used: let go then.
        kv.set("small", "k", b"v").unwrap();
        let stats = kv.mirror_stats();
        assert_eq!((stats.namespaces, stats.evictions), (1, 1), "{stats:?}");
    }

    /// A namespace holding a change the file does not have is never let go,
    /// whatever the budget; once the change is persisted, it may be.
    #[test]
    fn a_namespace_with_changes_not_persisted_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        kv.set("p", "old", b"1").unwrap();
        kv.apply("p", "new", KvChange::Set(b"2".to_vec()), KvQuota::UNBOUNDED).unwrap();
        kv.set_mirror_budget(0);
        assert_eq!(kv.mirror_stats().namespaces, 1, "kept: 'new' is not in the file");
        kv.set("q", "k", b"3").unwrap();
        assert_eq!(kv.get("p", "new").unwrap(), Some(b"2".to_vec()));
        let mut writes = KvWrites::new("p".into());
        writes.keys.insert("new".into());
        kv.persist_blocking(writes).unwrap();
        let stats = kv.mirror_stats();
        assert_eq!(
            (stats.namespaces, stats.evictions),
            (1, 1),
            "clean and past the budget: let go, but for the last used"
        );
        assert_eq!(kv.get("p", "new").unwrap(), Some(b"2".to_vec()), "read again from the file");
        assert_eq!(kv.get("q", "k").unwrap(), Some(b"3".to_vec()));
    }

    /// A namespace let go and read again while another thread changes it
    /// loses nothing: a read that raced a commit is not kept. (A budget of 0
    /// lets the namespace go after each commit once another was used since;
    /// the reader uses one between its reads, and reads it again.)
    #[test]
    fn reading_a_namespace_again_races_no_change_away() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        // Large enough that reading it takes about as long as a commit.
        for n in 0..2000 {
            kv.apply("p", &format!("filler/{n}"), KvChange::Set(vec![0; 1024]), KvQuota::UNBOUNDED).unwrap();
        }
        let mut writes = KvWrites::new("p".into());
        writes.keys.extend((0..2000).map(|n| format!("filler/{n}")));
        kv.persist_blocking(writes).unwrap();
        kv.set_mirror_budget(0);
        let counting = {
            let kv = kv.clone();
            std::thread::spawn(move || {
                for _ in 0..300 {
                    kv.increment("p", "n", 1).unwrap();
                }
            })
        };
        kv.set("q", "k", b"other").unwrap();
        let mut seen = 0;
        while !counting.is_finished() {
            kv.get("q", "k").unwrap();
            let now = kv.get("p", "n").unwrap().map_or(0, |v| i64::from_le_bytes(v.try_into().unwrap()));
            assert!(now >= seen, "went back from {seen} to {now}");
            seen = now;
        }
        counting.join().unwrap();
        assert_eq!(kv.increment("p", "n", 0).unwrap(), 300);
        assert!(kv.mirror_stats().evictions > 10, "{:?}", kv.mirror_stats());
    }

    /// `warm` reads a namespace that is not held off the caller's thread, and
    /// is nothing for one that is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn warm_reads_a_namespace_not_held() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let kv = store.kv();
        kv.set("p", "k", b"v").unwrap();
        assert!(kv.warm("p").is_none(), "held");
        kv.set("q", "k", b"v").unwrap();
        kv.set_mirror_budget(0);
        assert_eq!(kv.mirror_stats().namespaces, 1, "all but the last used let go");
        kv.warm("p").expect("not held").await.unwrap();
        let stats = kv.mirror_stats();
        assert_eq!((stats.namespaces, stats.loads), (1, 3), "{stats:?}");
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
