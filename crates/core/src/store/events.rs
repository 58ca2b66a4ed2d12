//! The host's event log: provider swaps, refusals, loads and unloads, in order.

use super::{Pending, Store, StoreError, db_error, decode};
use redb::{ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

pub(super) const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");

/// What an [`Event`] records; stored and served as its kebab-case name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A provider was added.
    Added,
    /// A provider was added again over itself (its manifest or component changed).
    Reloaded,
    /// A candidate replaced the version serving.
    Swapped,
    /// A candidate was refused; the version serving kept serving.
    SwapRefused,
    /// A provider was removed.
    Removed,
    /// The providers directory dropped a manifest whose provider still has instances.
    RemoveRefused,
    /// The providers directory held a manifest that could not be loaded.
    WatchRefused,
    /// The records were reconciled with what the provider reports.
    Reconciled,
    /// A provider's data dir was moved to where this host keeps them.
    DataDirMoved,
    /// A provider loaded from the approved manifest, its file having changed.
    ApprovedManifestPinned,
    /// A group spec was committed.
    GroupCommitted,
    /// A group started a member.
    InstanceAdded,
    /// A group stopped a member.
    InstanceDestroyed,
    /// A group replaced a member that was gone.
    InstanceReplaced,
    /// A group stopped replacing members (they kept failing).
    ReplacementStopped,
    /// A rolling update replaced one member.
    UpdateStep,
    /// A rolling update stopped.
    UpdateStopped,
    /// A zone turned a start away.
    ZoneUnavailable,
    /// A group reached its spec.
    Converged,
    /// A group was freed: its members left running, unmanaged.
    GroupFreed,
    /// A group was destroyed with its members.
    GroupDestroyed,
    /// A kind this build does not know (written by a newer one): kept as read.
    Other(String),
}

impl EventKind {
    /// Every kind this build writes.
    pub const ALL: [EventKind; 21] = [
        EventKind::Added,
        EventKind::Reloaded,
        EventKind::Swapped,
        EventKind::SwapRefused,
        EventKind::Removed,
        EventKind::RemoveRefused,
        EventKind::WatchRefused,
        EventKind::Reconciled,
        EventKind::DataDirMoved,
        EventKind::ApprovedManifestPinned,
        EventKind::GroupCommitted,
        EventKind::InstanceAdded,
        EventKind::InstanceDestroyed,
        EventKind::InstanceReplaced,
        EventKind::ReplacementStopped,
        EventKind::UpdateStep,
        EventKind::UpdateStopped,
        EventKind::ZoneUnavailable,
        EventKind::Converged,
        EventKind::GroupFreed,
        EventKind::GroupDestroyed,
    ];

    /// Its name, as stored, served and printed.
    pub fn as_str(&self) -> &str {
        match self {
            EventKind::Added => "added",
            EventKind::Reloaded => "reloaded",
            EventKind::Swapped => "swapped",
            EventKind::SwapRefused => "swap-refused",
            EventKind::Removed => "removed",
            EventKind::RemoveRefused => "remove-refused",
            EventKind::WatchRefused => "watch-refused",
            EventKind::Reconciled => "reconciled",
            EventKind::DataDirMoved => "data-dir-moved",
            EventKind::ApprovedManifestPinned => "approved-manifest-pinned",
            EventKind::GroupCommitted => "group-committed",
            EventKind::InstanceAdded => "instance-added",
            EventKind::InstanceDestroyed => "instance-destroyed",
            EventKind::InstanceReplaced => "instance-replaced",
            EventKind::ReplacementStopped => "replacement-stopped",
            EventKind::UpdateStep => "update-step",
            EventKind::UpdateStopped => "update-stopped",
            EventKind::ZoneUnavailable => "zone-unavailable",
            EventKind::Converged => "converged",
            EventKind::GroupFreed => "group-freed",
            EventKind::GroupDestroyed => "group-destroyed",
            EventKind::Other(name) => name,
        }
    }

    /// The kind named `name`; one this build does not know is kept as [`EventKind::Other`].
    pub fn named(name: &str) -> EventKind {
        EventKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == name)
            .unwrap_or_else(|| EventKind::Other(name.to_owned()))
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl Serialize for EventKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for EventKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Ok(EventKind::named(&name))
    }
}

/// One thing that happened to a provider, with both versions where two are involved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Event {
    /// Assigned by the store, increasing.
    #[serde(default)]
    pub seq: u64,
    /// RFC 3339, UTC.
    pub time: String,
    /// What happened.
    pub kind: EventKind,
    /// The provider it happened to.
    pub provider: String,
    /// The group it happened in (`group-committed`, `instance-added`, …), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The component hash before (of the version replaced or removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_sha256: Option<String>,
    /// The component hash after the change, or the one refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The version `describe` reported before.
    pub old_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The version `describe` reported after, or the one refused.
    pub new_version: Option<String>,
    /// Why, or what else happened (a refusal's reason, calls drained); may be empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl Event {
    /// An event of `kind` for `provider`, timed now, with no versions or detail;
    /// the store assigns `seq`.
    pub fn new(kind: EventKind, provider: &str) -> Event {
        Event {
            seq: 0,
            time: super::records::now_rfc3339(),
            kind,
            provider: provider.to_owned(),
            group: None,
            old_sha256: None,
            new_sha256: None,
            old_version: None,
            new_version: None,
            detail: String::new(),
        }
    }
}

/// How many events the log keeps: the oldest go as new ones come (a group
/// replacing members forever must not fill the disk).
pub(crate) const MAX_EVENTS: u64 = 100_000;

/// Most old events one append removes: a log longer than the bound (a lower
/// bound than the one it was written under) shrinks over appends, each cheap.
const PRUNED_PER_APPEND: usize = 8;

/// Append `event` in `txn`, numbered after the last; its sequence number.
pub(super) fn append(txn: &super::Txn<'_>, event: &Event) -> Result<u64, StoreError> {
    append_keeping(txn, event, MAX_EVENTS)
}

fn append_keeping(txn: &super::Txn<'_>, event: &Event, keep: u64) -> Result<u64, StoreError> {
    let mut table = txn.open_table(EVENTS).map_err(db_error)?;
    let next = table.last().map_err(db_error)?.map_or(1, |(k, _)| k.value() + 1);
    let stored = Event { seq: next, ..event.clone() };
    let bytes = super::encoded("event", &stored)?;
    table.insert(next, bytes.as_slice()).map_err(db_error)?;
    // Numbers are never reused: a reader paging with `after` sees a gap, never another event.
    let oldest_kept = next.saturating_sub(keep) + 1;
    for _ in 0..PRUNED_PER_APPEND {
        let oldest = table.first().map_err(db_error)?.map(|(k, _)| k.value());
        match oldest {
            Some(seq) if seq < oldest_kept => {
                table.remove(seq).map_err(db_error)?;
            }
            _ => break,
        }
    }
    Ok(next)
}

impl Store {
    /// Append an event; returns its sequence number.
    pub(crate) fn append_event(&self, event: &Event) -> Pending<u64> {
        let event = event.clone();
        self.write(move |txn| append(txn, &event))
    }

    /// Events after `after` (0 = from the start), at most `limit`, oldest first.
    pub fn events(&self, after: u64, limit: usize) -> Result<Vec<Event>, StoreError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(EVENTS).map_err(db_error)?;
        let mut out = Vec::new();
        for entry in table.range(after.saturating_add(1)..).map_err(db_error)?.take(limit) {
            let (_, value) = entry.map_err(db_error)?;
            out.push(decode("event", value.value())?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind is stored under its own name and read back as itself; a
    /// kind a newer build wrote is kept as read, not refused.
    #[test]
    fn event_kinds_are_stored_by_name_and_an_unknown_one_is_kept() {
        let mut names: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), EventKind::ALL.len(), "two kinds share a name");
        for kind in EventKind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind);
        }
        assert_eq!(serde_json::to_string(&EventKind::SwapRefused).unwrap(), "\"swap-refused\"");
        let newer: EventKind = serde_json::from_str("\"instance-migrated\"").unwrap();
        assert_eq!(newer, EventKind::Other("instance-migrated".into()));
        assert_eq!(serde_json::to_string(&newer).unwrap(), "\"instance-migrated\"");
        assert_eq!(format!("{:<8}|", EventKind::Added), "added   |");
    }

    #[test]
    fn events_are_numbered_in_order_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            assert_eq!(store.append_event(&Event::new(EventKind::Added, "a")).wait().unwrap(), 1);
            let mut swap = Event::new(EventKind::Swapped, "a");
            swap.old_sha256 = Some("01".into());
            swap.new_sha256 = Some("02".into());
            assert_eq!(store.append_event(&swap).wait().unwrap(), 2);
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.append_event(&Event::new(EventKind::Removed, "a")).wait().unwrap(), 3);
        let all = store.events(0, 100).unwrap();
        assert_eq!(
            all.iter().map(|e| (e.seq, e.kind.as_str())).collect::<Vec<_>>(),
            [(1, "added"), (2, "swapped"), (3, "removed")]
        );
        assert_eq!(all[1].new_sha256.as_deref(), Some("02"));
        assert_eq!(store.events(1, 1).unwrap()[0].seq, 2);
    }

    #[test]
    fn the_log_keeps_its_newest_events_and_shrinks_to_a_lower_bound() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let seqs = |store: &Store| store.events(0, 1000).unwrap().iter().map(|e| e.seq).collect::<Vec<_>>();
        let append = |keep: u64| {
            store.write(move |txn| append_keeping(txn, &Event::new(EventKind::Added, "a"), keep)).wait().unwrap()
        };
        for _ in 0..30 {
            append(20);
        }
        assert_eq!(seqs(&store), (11..=30).collect::<Vec<_>>(), "the newest 20, numbered as written");
        // A lower bound: each append removes a few more, until the log fits.
        append(5);
        assert_eq!(seqs(&store).len(), 21 - PRUNED_PER_APPEND);
        for _ in 0..3 {
            append(5);
        }
        assert_eq!(seqs(&store), (30..=34).collect::<Vec<_>>());
        assert_eq!(store.events(31, 10).unwrap()[0].seq, 32, "paging reads on");
    }
}
