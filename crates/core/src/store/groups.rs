//! Committed group specs (`broker group commit`): what each group converges to.

use super::{Pending, Store, StoreError, Txn, db_error, decode, encoded, events, starts};
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};
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
    /// Commit `record` as group `id`'s spec, with `event` in the same
    /// transaction; a group not yet committed is refused (`false`, nothing
    /// written) when `max_groups` are already.
    pub fn put_group(&self, id: &str, record: &GroupRecord, event: &events::Event, max_groups: usize) -> Pending<bool> {
        let (id, bytes, event) = (id.to_owned(), encoded("group", record), event.clone());
        self.write(move |txn| {
            let bytes = bytes.as_ref().map_err(Clone::clone)?;
            let mut groups = txn.open_table(GROUPS).map_err(db_error)?;
            let known = groups.get(id.as_str()).map_err(db_error)?.is_some();
            if !known && usize::try_from(groups.len().map_err(db_error)?).unwrap_or(usize::MAX) >= max_groups {
                return Ok(false);
            }
            groups.insert(id.as_str(), bytes.as_slice()).map_err(db_error)?;
            events::append(txn, &event)?;
            Ok(true)
        })
    }

    /// Commit `record` as group `id`'s spec, and mark `stopping` (members of
    /// `provider`) as being stopped and no longer the group's (its tags
    /// dropped), with `event`, in one transaction: a group shrunk by
    /// destroying named members. A crash, or a failed stop, leaves them
    /// marked and ungrouped: the restart's reconcile stops them, and the
    /// group never counts them again nor stops another in their place.
    pub(crate) fn shrink_group(
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
            super::untag(txn, &provider, &stopping, &group_tags())?;
            events::append(txn, &event)?;
            Ok(())
        })
    }

    /// Forget group `id` and mark its members (the records of `provider`
    /// tagged with it, chosen in the same transaction) as being stopped and
    /// ungrouped, with `event` (its detail the count), in one transaction: a
    /// destroyed group whose stops a crash cuts short is not made again, and
    /// its members' stops are finished by the restart's reconcile. Returns
    /// the members, to stop.
    pub fn destroy_group(&self, id: &str, event: &events::Event, provider: &str) -> Pending<Vec<String>> {
        let (id, event, mark, provider) = (id.to_owned(), event.clone(), self.stop_mark(), provider.to_owned());
        self.write(move |txn| {
            let members = members_in(txn, &provider, &id)?;
            forget(txn, &id)?;
            starts::mark_stops(txn, &mark, &provider, &members)?;
            super::untag(txn, &provider, &members, &group_tags())?;
            let mut event = event.clone();
            event.detail = format!("{} instances destroyed", members.len());
            events::append(txn, &event)?;
            Ok(members)
        })
    }

    /// Forget group `id` and drop its tags from its members' records (those
    /// of `provider` tagged with it, chosen in the same transaction), with
    /// `event` (its detail the count), in one transaction: the instances run
    /// on, recorded as ungrouped. Returns how many there were.
    pub fn free_group(&self, id: &str, event: &events::Event, provider: &str) -> Pending<usize> {
        let (id, event, provider) = (id.to_owned(), event.clone(), provider.to_owned());
        self.write(move |txn| {
            let members = members_in(txn, &provider, &id)?;
            forget(txn, &id)?;
            super::untag(txn, &provider, &members, &group_tags())?;
            let mut event = event.clone();
            event.detail = format!("{} instances left running, ungrouped", members.len());
            events::append(txn, &event)?;
            Ok(members.len())
        })
    }

    /// Group `id`'s committed spec.
    pub fn group(&self, id: &str) -> Result<Option<GroupRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(GROUPS).map_err(db_error)?;
        let value = table.get(id).map_err(db_error)?;
        value.map(|v| decode("group", v.value())).transpose()
    }

    /// Every committed group, by id. One that does not decode is named in the
    /// log and left out: it hides no other.
    pub fn groups(&self) -> Result<Vec<(String, GroupRecord)>, StoreError> {
        let txn = self.db.begin_read()?;
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

/// The instance config tags that make a record a group's member.
fn group_tags() -> Vec<String> {
    ["infrakit.group", "infrakit.config.hash", "infrakit.logical_id"].map(str::to_owned).to_vec()
}

/// The ids of `provider`'s records tagged as members of group `id`, read in `txn`.
fn members_in(txn: &Txn<'_>, provider: &str, id: &str) -> Result<Vec<String>, StoreError> {
    let table = txn.open_table(super::INSTANCES).map_err(db_error)?;
    let mut members = Vec::new();
    super::each_of_owner(&*table, provider, |instance, value| {
        let record: super::InstanceRecord = decode("instance", value)?;
        if record.instance_tags.get("infrakit.group").is_some_and(|group| group == id) {
            members.push(instance.to_owned());
        }
        Ok(())
    })?;
    Ok(members)
}
