//! The uid each provider's programs run as: allocated once, never reused for
//! another provider (files a removed provider's user left behind stay its own).

use super::{Store, db_error};
use redb::{ReadableTable, TableDefinition};

/// Provider name -> uid; the key `""` holds the next uid to hand out.
const SANDBOX_USERS: TableDefinition<&str, u32> = TableDefinition::new("sandbox_users");

impl crate::sandbox::UidAllocations for Store {
    fn uid_for(&self, provider: &str, base: u32) -> Result<u32, String> {
        let txn = self.db.begin_write().map_err(|e| db_error(e).to_string())?;
        let uid = {
            let mut table = txn.open_table(SANDBOX_USERS).map_err(|e| db_error(e).to_string())?;
            if let Some(uid) = table.get(provider).map_err(|e| db_error(e).to_string())? {
                return Ok(uid.value());
            }
            let next = table.get("").map_err(|e| db_error(e).to_string())?.map_or(base, |v| v.value()).max(base);
            if next >= base.saturating_add(crate::sandbox::UID_RANGE) || next == u32::MAX {
                return Err(format!("the sandbox uid range from {base} is used up"));
            }
            table.insert(provider, next).map_err(|e| db_error(e).to_string())?;
            table.insert("", next + 1).map_err(|e| db_error(e).to_string())?;
            next
        };
        txn.commit().map_err(|e| db_error(e).to_string())?;
        Ok(uid)
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
