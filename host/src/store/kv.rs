//! The real kv backend: redb, with a write-through in-memory mirror per
//! namespace so guest reads (the hot path) never open a transaction.

use super::{KV, db_error};
use crate::capabilities::kv::{KvBackend, KvError, check_key, check_value, decode_counter, pack_prefix};
use redb::{Database, ReadableDatabase};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};

type Namespace = Arc<RwLock<BTreeMap<String, Vec<u8>>>>;

pub struct RedbKv {
    db: Arc<Database>,
    /// Loaded namespaces; a namespace is read from disk once, on first use.
    mirror: RwLock<HashMap<String, Namespace>>,
    /// Serialises writers so the mirror and the disk change in the same order.
    write_lock: Mutex<()>,
}

fn storage(err: super::StoreError) -> KvError {
    KvError::Storage(err.to_string())
}

impl RedbKv {
    pub fn new(db: Arc<Database>) -> Self {
        RedbKv { db, mirror: RwLock::new(HashMap::new()), write_lock: Mutex::new(()) }
    }

    fn namespace(&self, name: &str) -> Result<Namespace, KvError> {
        if let Some(ns) = self.mirror.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(ns.clone());
        }
        let loaded = self.load(name).map_err(storage)?;
        let mut mirror = self.mirror.write().unwrap_or_else(|p| p.into_inner());
        Ok(mirror.entry(name.to_owned()).or_insert_with(|| Arc::new(RwLock::new(loaded))).clone())
    }

    fn load(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, super::StoreError> {
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

    /// Apply one change durably, then to the mirror.
    fn write(&self, name: &str, key: &str, value: Option<&[u8]>) -> Result<(), KvError> {
        let txn = self.db.begin_write().map_err(|e| storage(db_error(e)))?;
        {
            let mut table = txn.open_table(KV).map_err(|e| storage(db_error(e)))?;
            match value {
                Some(value) => table.insert((name, key), value).map(|_| ()),
                None => table.remove((name, key)).map(|_| ()),
            }
            .map_err(|e| storage(db_error(e)))?;
        }
        txn.commit().map_err(|e| storage(db_error(e)))?;
        let ns = self.namespace(name)?;
        let mut entries = ns.write().unwrap_or_else(|p| p.into_inner());
        match value {
            Some(value) => entries.insert(key.to_owned(), value.to_vec()),
            None => entries.remove(key),
        };
        Ok(())
    }
}

impl KvBackend for RedbKv {
    fn get(&self, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        let ns = self.namespace(namespace)?;
        let entries = ns.read().unwrap_or_else(|p| p.into_inner());
        Ok(entries.get(key).cloned())
    }

    fn set(&self, namespace: &str, key: &str, value: &[u8]) -> Result<(), KvError> {
        check_key(key)?;
        check_value(value)?;
        let _writer = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.write(namespace, key, Some(value))
    }

    fn delete(&self, namespace: &str, key: &str) -> Result<bool, KvError> {
        let _writer = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        let existed = self.get(namespace, key)?.is_some();
        if existed {
            self.write(namespace, key, None)?;
        }
        Ok(existed)
    }

    fn increment(&self, namespace: &str, key: &str, delta: i64) -> Result<i64, KvError> {
        check_key(key)?;
        let _writer = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.get(namespace, key)?.map(|v| decode_counter(&v)).transpose()?.unwrap_or(0);
        let next =
            current.checked_add(delta).ok_or_else(|| KvError::Invalid(format!("increment of {key:?} overflows")))?;
        self.write(namespace, key, Some(&next.to_le_bytes()))?;
        Ok(next)
    }

    fn scan_packed(&self, namespace: &str, prefix: &str) -> Result<Vec<u8>, KvError> {
        let ns = self.namespace(namespace)?;
        let entries = ns.read().unwrap_or_else(|p| p.into_inner());
        Ok(pack_prefix(&entries, prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::super::Store;
    use crate::capabilities::kv::{KvBackend, MemoryKv};

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
            }
            assert_eq!(real.scan_packed("p", "i/").unwrap(), memory.scan_packed("p", "i/").unwrap());
        }
        let reopened = Store::open(dir.path()).unwrap().kv();
        assert_eq!(reopened.get("p", "i/a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(reopened.get("p", "i/b").unwrap(), None);
        assert_eq!(reopened.get("q", "i/a").unwrap(), Some(b"other".to_vec()));
        assert_eq!(reopened.increment("p", "n", 1).unwrap(), 4);
    }
}
