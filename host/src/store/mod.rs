//! The host's embedded state, in one redb file in the data dir: registered
//! providers, instance records, and every provider's kv namespace.
//!
//! redb is ACID with copy-on-write pages and a checksummed commit, so a crash
//! mid-write leaves the previous committed state; it is pure Rust (no C
//! toolchain), and one file per host is all the host needs.

mod events;
mod kv;
pub mod records;
mod sandbox_users;

pub use events::Event;

pub use kv::RedbKv;
pub use records::{InstanceRecord, ObservedNetwork, ProviderRecord};

use crate::capabilities::network_bridge::Device;
use crate::capabilities::process::{ChildRecord, ChildRecords, RecordsError};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const PROVIDERS: TableDefinition<&str, &[u8]> = TableDefinition::new("providers");
/// Key: (provider, instance id).
const INSTANCES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("instances");
/// Key: (provider namespace, key).
const KV: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("kv");
/// The host's network as HostPreparer last observed it; one key, `host`.
const OBSERVED_NETWORK: TableDefinition<&str, &[u8]> = TableDefinition::new("observed_network");
/// Key: (provider, child name).
const CHILDREN: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("children");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state database {path}: {reason}")]
    Open { path: String, reason: String },
    #[error("state database: {0}")]
    Db(String),
    #[error("state database holds a corrupt {what} record: {reason}")]
    Corrupt { what: &'static str, reason: String },
}

fn db_error(err: impl Into<redb::Error>) -> StoreError {
    StoreError::Db(err.into().to_string())
}

pub struct Store {
    db: Arc<Database>,
    kv: Arc<RedbKv>,
    data_dir: PathBuf,
}

impl Store {
    /// Open (or create) the state file; the data dir is created if missing.
    pub fn open(data_dir: &Path) -> Result<Store, StoreError> {
        let open_error =
            |reason: String| StoreError::Open { path: data_dir.join("state.redb").display().to_string(), reason };
        std::fs::create_dir_all(data_dir).map_err(|e| open_error(e.to_string()))?;
        let db = Database::create(data_dir.join("state.redb")).map_err(|e| open_error(e.to_string()))?;
        let txn = db.begin_write().map_err(db_error)?;
        txn.open_table(PROVIDERS).map_err(db_error)?;
        txn.open_table(INSTANCES).map_err(db_error)?;
        txn.open_table(KV).map_err(db_error)?;
        txn.open_table(CHILDREN).map_err(db_error)?;
        txn.open_table(OBSERVED_NETWORK).map_err(db_error)?;
        txn.open_table(events::EVENTS).map_err(db_error)?;
        txn.commit().map_err(db_error)?;
        let db = Arc::new(db);
        Ok(Store { kv: Arc::new(RedbKv::new(db.clone())), db, data_dir: data_dir.to_owned() })
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Record the host network HostPreparer observed after bridging.
    pub fn put_observed_network(&self, devices: &[Device]) -> Result<(), StoreError> {
        let record = ObservedNetwork { observed: records::now_rfc3339(), devices: devices.to_vec() };
        let bytes = serde_json::to_vec(&record).map_err(|e| StoreError::Db(e.to_string()))?;
        let txn = self.db.begin_write().map_err(db_error)?;
        txn.open_table(OBSERVED_NETWORK).map_err(db_error)?.insert("host", bytes.as_slice()).map_err(db_error)?;
        txn.commit().map_err(db_error)
    }

    pub fn observed_network(&self) -> Result<Option<ObservedNetwork>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(OBSERVED_NETWORK).map_err(db_error)?;
        let value = table.get("host").map_err(db_error)?;
        value.map(|v| decode("observed network", v.value())).transpose()
    }

    /// The records of providers' long-running children.
    pub fn child_records(&self) -> Arc<dyn ChildRecords> {
        Arc::new(RedbChildren { db: self.db.clone() })
    }

    /// The kv backend behind every provider's namespace.
    pub fn kv(&self) -> Arc<RedbKv> {
        self.kv.clone()
    }

    pub fn put_provider(&self, record: &ProviderRecord) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).map_err(|e| StoreError::Db(e.to_string()))?;
        let txn = self.db.begin_write().map_err(db_error)?;
        txn.open_table(PROVIDERS)
            .map_err(db_error)?
            .insert(record.name.as_str(), bytes.as_slice())
            .map_err(db_error)?;
        txn.commit().map_err(db_error)
    }

    /// True if it was registered.
    pub fn remove_provider(&self, name: &str) -> Result<bool, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let existed = txn.open_table(PROVIDERS).map_err(db_error)?.remove(name).map_err(db_error)?.is_some();
        txn.commit().map_err(db_error)?;
        Ok(existed)
    }

    pub fn provider(&self, name: &str) -> Result<Option<ProviderRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(PROVIDERS).map_err(db_error)?;
        let value = table.get(name).map_err(db_error)?;
        value.map(|v| decode("provider", v.value())).transpose()
    }

    pub fn providers(&self) -> Result<Vec<ProviderRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(PROVIDERS).map_err(db_error)?;
        let mut records = Vec::new();
        for entry in table.iter().map_err(db_error)? {
            let (_, value) = entry.map_err(db_error)?;
            records.push(decode("provider", value.value())?);
        }
        Ok(records)
    }

    pub fn put_instance(&self, record: &InstanceRecord) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).map_err(|e| StoreError::Db(e.to_string()))?;
        let txn = self.db.begin_write().map_err(db_error)?;
        txn.open_table(INSTANCES)
            .map_err(db_error)?
            .insert((record.provider.as_str(), record.id.as_str()), bytes.as_slice())
            .map_err(db_error)?;
        txn.commit().map_err(db_error)
    }

    /// Record an instance a provider has just started, unless its id is already
    /// recorded for another provider: checked in the same write transaction, so two
    /// starts cannot both take one id. Returns that other provider, and then
    /// writes nothing.
    pub fn put_new_instance(&self, record: &InstanceRecord) -> Result<Option<String>, StoreError> {
        let bytes = serde_json::to_vec(record).map_err(|e| StoreError::Db(e.to_string()))?;
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
            for entry in table.iter().map_err(db_error)? {
                let (key, _) = entry.map_err(db_error)?;
                let (provider, id) = key.value();
                if id == record.id && provider != record.provider {
                    return Ok(Some(provider.to_owned()));
                }
            }
            table.insert((record.provider.as_str(), record.id.as_str()), bytes.as_slice()).map_err(db_error)?;
        }
        txn.commit().map_err(db_error)?;
        Ok(None)
    }

    /// Remove records in one transaction; unknown ids are ignored.
    pub fn remove_instances(&self, provider: &str, ids: &[String]) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut table = txn.open_table(INSTANCES).map_err(db_error)?;
            for id in ids {
                table.remove((provider, id.as_str())).map_err(db_error)?;
            }
        }
        txn.commit().map_err(db_error)
    }

    pub fn instance(&self, provider: &str, id: &str) -> Result<Option<InstanceRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let value = table.get((provider, id)).map_err(db_error)?;
        value.map(|v| decode("instance", v.value())).transpose()
    }

    /// Records of one provider, or of all, in (provider, id) order.
    pub fn instances(&self, provider: Option<&str>) -> Result<Vec<InstanceRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(INSTANCES).map_err(db_error)?;
        let mut records = Vec::new();
        for entry in table.iter().map_err(db_error)? {
            let (key, value) = entry.map_err(db_error)?;
            if provider.is_none_or(|p| key.value().0 == p) {
                records.push(decode("instance", value.value())?);
            }
        }
        Ok(records)
    }
}

fn decode<T: serde::de::DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt { what, reason: e.to_string() })
}

/// Child records in the `children` table.
struct RedbChildren {
    db: Arc<Database>,
}

fn records_error(err: impl std::fmt::Display) -> RecordsError {
    RecordsError(err.to_string())
}

impl ChildRecords for RedbChildren {
    fn put(&self, record: &ChildRecord) -> Result<(), RecordsError> {
        let bytes = serde_json::to_vec(record).map_err(records_error)?;
        let txn = self.db.begin_write().map_err(records_error)?;
        txn.open_table(CHILDREN)
            .map_err(records_error)?
            .insert((record.provider.as_str(), record.name.as_str()), bytes.as_slice())
            .map_err(records_error)?;
        txn.commit().map_err(records_error)
    }

    fn get(&self, provider: &str, name: &str) -> Result<Option<ChildRecord>, RecordsError> {
        let txn = self.db.begin_read().map_err(records_error)?;
        let table = txn.open_table(CHILDREN).map_err(records_error)?;
        let value = table.get((provider, name)).map_err(records_error)?;
        value.map(|v| serde_json::from_slice(v.value()).map_err(records_error)).transpose()
    }

    fn remove(&self, provider: &str, name: &str) -> Result<(), RecordsError> {
        let txn = self.db.begin_write().map_err(records_error)?;
        txn.open_table(CHILDREN).map_err(records_error)?.remove((provider, name)).map_err(records_error)?;
        txn.commit().map_err(records_error)
    }

    fn list(&self, provider: &str) -> Result<Vec<ChildRecord>, RecordsError> {
        let txn = self.db.begin_read().map_err(records_error)?;
        let table = txn.open_table(CHILDREN).map_err(records_error)?;
        let mut records = Vec::new();
        for entry in table.range((provider, "")..).map_err(records_error)? {
            let (key, value) = entry.map_err(records_error)?;
            if key.value().0 != provider {
                break;
            }
            records.push(serde_json::from_slice(value.value()).map_err(records_error)?);
        }
        Ok(records)
    }
}

impl crate::broker::host_preparer::ObservedNetworkSink for Store {
    fn record(&self, observed: &[Device]) -> Result<(), String> {
        self.put_observed_network(observed).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::records::Hardware;

    fn record(provider: &str, id: &str) -> InstanceRecord {
        InstanceRecord {
            id: id.into(),
            provider: provider.into(),
            status: "running".into(),
            message: String::new(),
            display_name: String::new(),
            hardware: Hardware::default(),
            tags: Vec::new(),
            addresses: Vec::new(),
            created: String::new(),
            params: None,
        }
    }

    #[test]
    fn a_new_instance_cannot_take_an_id_recorded_for_another_provider() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.put_new_instance(&record("fake", "fake-0")).unwrap(), None);
        assert_eq!(store.put_new_instance(&record("hostile", "fake-0")).unwrap().as_deref(), Some("fake"));
        assert_eq!(store.instance("hostile", "fake-0").unwrap(), None, "nothing was written");
        assert_eq!(store.instances(None).unwrap().len(), 1);
        // The provider's own id again (a restart that reuses it) is its business.
        assert_eq!(store.put_new_instance(&record("fake", "fake-0")).unwrap(), None);
        assert_eq!(store.put_new_instance(&record("hostile", "hostile-0")).unwrap(), None);
        assert_eq!(store.instances(None).unwrap().len(), 2);
    }
}
