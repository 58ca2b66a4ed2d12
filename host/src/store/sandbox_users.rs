//! The uid each provider's programs run as: allocated once, never reused for
//! another provider (files a removed provider's user left behind stay its own).

use super::{Store, db_error};
use redb::{ReadableTable, TableDefinition};

/// Provider name -> uid; the key `""` holds the next uid to hand out.
pub(super) const SANDBOX_USERS: TableDefinition<&str, u32> = TableDefinition::new("sandbox_users");

impl crate::sandbox::UidAllocations for Store {
    fn uid_for(&self, provider: &str, base: u32) -> Result<u32, String> {
        let provider = provider.to_owned();
        let allocated = self.write(move |txn| {
            let mut table = txn.open_table(SANDBOX_USERS).map_err(db_error)?;
            if let Some(uid) = table.get(provider.as_str()).map_err(db_error)? {
                return Ok(Ok(uid.value()));
            }
            let next = table.get("").map_err(db_error)?.map_or(base, |v| v.value()).max(base);
            if next >= base.saturating_add(crate::sandbox::UID_RANGE) || next == u32::MAX {
                return Ok(Err(format!("the sandbox uid range from {base} is used up")));
            }
            table.insert(provider.as_str(), next).map_err(db_error)?;
            table.insert("", next + 1).map_err(db_error)?;
            Ok(Ok(next))
        });
        // Once per provider load (then the sandbox keeps it), beside compiling the component.
        allocated.wait().map_err(|e| e.to_string())?
    }
}

impl Store {
    /// Every provider that was given a sandbox uid, with it (removed providers too: the uid stays theirs).
    pub fn sandbox_users(&self) -> Result<Vec<(String, u32)>, super::StoreError> {
        use redb::ReadableDatabase;
        let txn = self.db.begin_read().map_err(db_error)?;
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
    use crate::sandbox::UidAllocations;

    #[test]
    fn each_provider_keeps_its_uid_across_reopens_and_none_is_reused() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::Store::open(dir.path()).unwrap();
        let kvm = store.uid_for("kvm", 5000).unwrap();
        let lxd = store.uid_for("lxd", 5000).unwrap();
        assert_eq!((kvm, lxd), (5000, 5001));
        drop(store);
        let store = super::Store::open(dir.path()).unwrap();
        assert_eq!(store.uid_for("kvm", 5000).unwrap(), 5000);
        assert_eq!(store.uid_for("fake", 5000).unwrap(), 5002);
    }
}
