//! Committed group specs (`broker group commit`): what each group converges to.

use super::{Pending, Store, StoreError, db_error, decode, encoded, events};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

/// Group id -> its committed spec.
pub(super) const GROUPS: TableDefinition<&str, &[u8]> = TableDefinition::new("groups");

/// A committed group: the spec as the operator wrote it (InfraKit's shape), and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GroupRecord {
    /// The spec, `{"ID": …, "Properties": …}`, as committed.
    pub spec: serde_json::Value,
    /// RFC 3339, UTC.
    pub committed: String,
}

impl Store {
    /// Commit `record` as group `id`'s spec, with `event` in the same transaction.
    pub fn put_group(&self, id: &str, record: &GroupRecord, event: &events::Event) -> Pending<()> {
        let (id, bytes, event) = (id.to_owned(), encoded("group", record), event.clone());
        self.write(move |txn| {
            let bytes = bytes.as_ref().map_err(Clone::clone)?;
            txn.open_table(GROUPS).map_err(db_error)?.insert(id.as_str(), bytes.as_slice()).map_err(db_error)?;
            events::append(txn, &event)?;
            Ok(())
        })
    }

    /// Forget group `id`, with `event` in the same transaction.
    pub fn remove_group(&self, id: &str, event: &events::Event) -> Pending<()> {
        let (id, event) = (id.to_owned(), event.clone());
        self.write(move |txn| {
            txn.open_table(GROUPS).map_err(db_error)?.remove(id.as_str()).map_err(db_error)?;
            events::append(txn, &event)?;
            Ok(())
        })
    }

    /// Group `id`'s committed spec.
    pub fn group(&self, id: &str) -> Result<Option<GroupRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(GROUPS).map_err(db_error)?;
        let value = table.get(id).map_err(db_error)?;
        value.map(|v| decode("group", v.value())).transpose()
    }

    /// Every committed group, by id. One that does not decode is named in the
    /// log and left out: it hides no other.
    pub fn groups(&self) -> Result<Vec<(String, GroupRecord)>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(GROUPS).map_err(db_error)?;
        let mut groups = Vec::new();
        for entry in table.iter().map_err(db_error)? {
            let (id, value) = entry.map_err(db_error)?;
            match decode("group", value.value()) {
                Ok(record) => groups.push((id.value().to_owned(), record)),
                Err(error) => tracing::error!(group = id.value(), %error, "a group record does not decode: left out"),
            }
        }
        Ok(groups)
    }
}
