//! Committed group specs (`broker group commit`): what each group converges to.

use super::{Pending, Store, StoreError, Txn, db_error, decode, encoded, events, starts};
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
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

    /// Commit `record` as group `id`'s spec and mark `stopping` (members of
    /// `provider`) as being stopped, with `event`, in one transaction: a group
    /// shrunk by destroying named members. A crash before their stop is
    /// finished leaves them marked, and the restart's reconcile stops them;
    /// the group never counts them again.
    pub fn shrink_group(
        &self,
        id: &str,
        record: &GroupRecord,
        event: &events::Event,
        provider: &str,
        stopping: &[String],
    ) -> Pending<()> {
        let (id, bytes, event) = (id.to_owned(), encoded("group", record), event.clone());
        let (mark, provider, stopping) = (self.stop_mark(), provider.to_owned(), stopping.to_vec());
        self.write(move |txn| {
            let bytes = bytes.as_ref().map_err(Clone::clone)?;
            txn.open_table(GROUPS).map_err(db_error)?.insert(id.as_str(), bytes.as_slice()).map_err(db_error)?;
            starts::mark_stops(txn, &mark, &provider, &stopping)?;
            events::append(txn, &event)?;
            Ok(())
        })
    }

    /// Forget group `id` and mark its members `stopping` (of `provider`) as
    /// being stopped, with `event`, in one transaction: a destroyed group
    /// whose stops a crash cuts short is not made again, and its members'
    /// stops are finished by the restart's reconcile.
    pub fn destroy_group(&self, id: &str, event: &events::Event, provider: &str, stopping: &[String]) -> Pending<()> {
        let (id, event) = (id.to_owned(), event.clone());
        let (mark, provider, stopping) = (self.stop_mark(), provider.to_owned(), stopping.to_vec());
        self.write(move |txn| {
            forget(txn, &id)?;
            starts::mark_stops(txn, &mark, &provider, &stopping)?;
            events::append(txn, &event)?;
            Ok(())
        })
    }

    /// Forget group `id` and drop the tags `keys` from its members' records
    /// (`members`, of `provider`), with `event`, in one transaction: the
    /// instances run on, recorded as ungrouped.
    pub fn free_group(
        &self,
        id: &str,
        event: &events::Event,
        provider: &str,
        members: &[String],
        keys: &[&str],
    ) -> Pending<()> {
        let (id, event, provider, members) = (id.to_owned(), event.clone(), provider.to_owned(), members.to_vec());
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        self.write(move |txn| {
            forget(txn, &id)?;
            super::untag(txn, &provider, &members, &keys)?;
            events::append(txn, &event)?;
            Ok(())
        })
    }

    /// How many groups are committed.
    pub fn group_count(&self) -> Result<u64, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(GROUPS).map_err(db_error)?;
        table.len().map_err(db_error)
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

fn forget(txn: &Txn<'_>, id: &str) -> Result<(), StoreError> {
    txn.open_table(GROUPS).map_err(db_error)?.remove(id).map_err(db_error)?;
    Ok(())
}
