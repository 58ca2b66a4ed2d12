//! The uid each provider's programs run as: allocated once, never reused for
//! another provider (files a removed provider's user left behind stay its own).

use super::{Store, db_error};
use redb::{ReadableTable, TableDefinition};

/// Provider name -> uid; the key `""` holds the next uid to hand out.
pub(super) const SANDBOX_USERS: TableDefinition<&str, u32> = TableDefinition::new("sandbox_users");

/// Provider name -> the host paths shared with its user (JSON list), so that
/// what a narrowed grant or a removal no longer gives is taken back.
pub(super) const SANDBOX_SHARED: TableDefinition<&str, &[u8]> = TableDefinition::new("sandbox_shared");

impl broker_capabilities::sandbox::UidAllocations for Store {
    fn host_dir(&self) -> &std::path::Path {
        self.data_dir()
    }

    fn recorded(&self, provider: &str) -> Result<Option<u32>, String> {
        let read = || -> Result<Option<u32>, super::StoreError> {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(SANDBOX_USERS).map_err(db_error)?;
            Ok(table.get(provider).map_err(db_error)?.map(|v| v.value()))
        };
        read().map_err(|e| e.to_string())
    }

    fn next_free(&self, base: u32) -> Result<u32, String> {
        Ok(self.recorded("")?.map_or(base, |next| next.max(base)))
    }

    fn record(&self, provider: &str, uid: u32) -> Result<u32, String> {
        let provider = provider.to_owned();
        let recorded = self.write(move |txn| {
            let mut table = txn.open_table(SANDBOX_USERS).map_err(db_error)?;
            if let Some(kept) = table.get(provider.as_str()).map_err(db_error)? {
                return Ok(kept.value());
            }
            let next = table.get("").map_err(db_error)?.map_or(0, |v| v.value());
            table.insert(provider.as_str(), uid).map_err(db_error)?;
            // Never handed out again by this host, nor anything below it.
            table.insert("", next.max(uid.saturating_add(1))).map_err(db_error)?;
            Ok(uid)
        });
        // Once per provider load (then the sandbox keeps it), beside compiling the component.
        recorded.wait().map_err(|e| e.to_string())
    }

    fn shared(&self, provider: &str) -> Result<Vec<std::path::PathBuf>, String> {
        let read = || -> Result<Vec<std::path::PathBuf>, super::StoreError> {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(SANDBOX_SHARED).map_err(db_error)?;
            match table.get(provider).map_err(db_error)? {
                Some(bytes) => super::decode("sandbox shared paths", bytes.value()),
                None => Ok(Vec::new()),
            }
        };
        read().map_err(|e| e.to_string())
    }

    fn record_shared(&self, provider: &str, paths: &[std::path::PathBuf]) -> Result<(), String> {
        let provider = provider.to_owned();
        let bytes = serde_json::to_vec(paths).map_err(|e| e.to_string())?;
        let written = self.write(move |txn| {
            let mut table = txn.open_table(SANDBOX_SHARED).map_err(db_error)?;
            if bytes == b"[]" {
                table.remove(provider.as_str()).map_err(db_error)?;
            } else {
                table.insert(provider.as_str(), bytes.as_slice()).map_err(db_error)?;
            }
            Ok(())
        });
        written.wait().map_err(|e| e.to_string())
    }
}

impl Store {
    /// `provider`'s uid, allocated from `base` if it has none (no machine claims: tests).
    #[cfg(test)]
    pub(crate) fn uid_for(&self, provider: &str, base: u32) -> Result<u32, String> {
        use broker_capabilities::sandbox::UidAllocations;
        match self.recorded(provider)? {
            Some(uid) => Ok(uid),
            None => {
                let next = self.next_free(base)?;
                if next == u32::MAX {
                    return Err("used up".into());
                }
                self.record(provider, next)
            }
        }
    }

    /// Every provider that was given a sandbox uid, with it (removed providers too: the uid stays theirs).
    pub fn sandbox_users(&self) -> Result<Vec<(String, u32)>, super::StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(SANDBOX_USERS).map_err(db_error)?;
        let mut users = Vec::new();
        for entry in table.iter().map_err(db_error)? {
            let (provider, uid) = entry.map_err(db_error)?;
            // The key "" holds the next uid to give out.
            if !provider.value().is_empty() {
                users.push((provider.value().to_owned(), uid.value()));
            }
        }
        Ok(users)
    }
}

#[cfg(test)]
mod tests {
    use broker_capabilities::sandbox::UidAllocations;

    #[test]
    fn each_provider_keeps_its_uid_across_reopens_and_none_is_reused() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::Store::open(dir.path()).unwrap();
        let allocate = |store: &super::Store, provider| {
            let uid = store.next_free(5000).unwrap();
            store.record(provider, uid).unwrap()
        };
        let kvm = allocate(&store, "kvm");
        let lxd = allocate(&store, "lxd");
        assert_eq!((kvm, lxd), (5000, 5001));
        assert_eq!(store.record("kvm", 5007).unwrap(), 5000, "a provider keeps the uid it has");
        drop(store);
        let store = super::Store::open(dir.path()).unwrap();
        assert_eq!(store.recorded("kvm").unwrap(), Some(5000));
        assert_eq!(allocate(&store, "fake"), 5002);
        // A uid claimed past others' (the machine's claims skipped some): none below it again.
        assert_eq!(store.record("qemu", 5010).unwrap(), 5010);
        assert_eq!(store.next_free(5000).unwrap(), 5011);
    }
}
