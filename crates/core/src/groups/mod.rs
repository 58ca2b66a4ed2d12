//! Groups: InfraKit's group plugin in the host, over any registered provider.
//!
//! A group is a committed spec ([`spec::Group`]) and the instances whose
//! records carry its tag (`infrakit.group=ID`): membership is the host's
//! records, so it survives a restart and needs nothing of the provider but
//! starts, stops and listings. While `broker serve` runs, each group has a
//! convergence loop ([`Groups::start_loops`]): a pass every poll interval and
//! at once after a commit, replacing members the provider no longer runs,
//! destroying the surplus, starting the missing (at most `max-parallel` at
//! once) and rolling members made from an older spec one at a time. Every
//! action is an event. The calls themselves (commit, describe, size, …) work
//! without the loop: they change the spec and the records, and say so.
//!
//! Here: the calls. `loops.rs`: the loops and what they remember;
//! `converge.rs`: one pass; `spec.rs`: InfraKit's spec; `error.rs`.

mod converge;
mod error;
mod loops;
pub mod spec;

pub use error::GroupError;

use crate::broker::{Broker, BrokerServiceError};
use crate::store::{Event, EventKind, GroupRecord, InstanceRecord};
use converge::is_converged;
use loops::{GroupLoop, LoopState};
use serde::Serialize;
use spec::{CONFIG_HASH_TAG, GROUP_TAG, Group, GroupSpec, LOGICAL_ID_TAG, Members, SpecError};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the convergence loops run.
#[derive(Debug, Clone, Copy)]
pub struct GroupSettings {
    /// Between passes of a group, when nothing wakes it sooner.
    pub poll: Duration,
    /// Most starts or stops one pass has in flight at once.
    pub max_parallel: usize,
    /// How long a rolling update waits for its replacement to be healthy
    /// (beyond `Updating.Duration`) before it stops and says so.
    pub update_patience: Duration,
    /// A member lost within this of its start counts as a failed start:
    /// passes that replace such members wait longer each time (from a
    /// second, doubling, at most `poll`), and after `max_failed_passes` in a
    /// row the group stops replacing until its spec is committed again.
    pub failure_window: Duration,
    /// See `failure_window`.
    pub max_failed_passes: u32,
}

impl Default for GroupSettings {
    fn default() -> Self {
        GroupSettings {
            poll: Duration::from_secs(10),
            max_parallel: 4,
            update_patience: Duration::from_secs(600),
            failure_window: Duration::from_secs(120),
            max_failed_passes: 5,
        }
    }
}

/// The most groups one host keeps: each has a loop and listings of its own.
pub(crate) const MAX_GROUPS: usize = 1000;

/// One member as `describe` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MemberDescription {
    /// The instance id.
    pub id: String,
    /// Its logical id, in a quorum group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logical_id: Option<String>,
    /// Its instance config tags (the group's among them).
    pub tags: BTreeMap<String, String>,
    /// Its status, as the provider reports it now.
    pub status: String,
    /// The provider's word on it; may be empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// What `describe` answers.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GroupDescription {
    /// The group.
    pub id: String,
    /// Its provider.
    pub provider: String,
    /// How many members it should have.
    pub size: usize,
    /// Its members, by id.
    pub instances: Vec<MemberDescription>,
    /// Whether its members are what the spec asks: as many (or the logical
    /// ids), all running, all made from the committed spec, and no rolling
    /// update stopped.
    pub converged: bool,
    /// Why the group stopped converging until its spec is committed again
    /// (a rolling update whose replacement never became healthy, or members
    /// failing as soon as they start), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_stopped: Option<String>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A member's record read for the group.
fn config_hash(record: &InstanceRecord) -> Option<&str> {
    record.instance_tags.get(CONFIG_HASH_TAG).map(String::as_str)
}

fn logical_id(record: &InstanceRecord) -> Option<&str> {
    record.instance_tags.get(LOGICAL_ID_TAG).map(String::as_str)
}

/// A member the provider no longer runs: replaced.
fn is_lost(record: &InstanceRecord) -> bool {
    matches!(record.status.as_str(), "stopped" | "stopping" | "unknown" | "error" | "provisioning-error")
}

/// How long ago the member was recorded as started (forever if unreadable:
/// such a member never counts as failing young).
fn age(record: &InstanceRecord, now: std::time::SystemTime) -> Duration {
    humantime::parse_rfc3339(&record.created)
        .ok()
        .and_then(|created| now.duration_since(created).ok())
        .unwrap_or(Duration::MAX)
}

/// The groups of one host.
pub struct Groups {
    broker: Arc<Broker>,
    settings: GroupSettings,
    loops: Mutex<HashMap<String, GroupLoop>>,
    /// Set once [`Groups::start_loops`] ran: commits then start loops too.
    serving: std::sync::atomic::AtomicBool,
}

impl Groups {
    /// The groups of `broker`'s host; no loop runs until [`Groups::start_loops`].
    pub fn new(broker: Arc<Broker>, settings: GroupSettings) -> Arc<Groups> {
        Arc::new(Groups {
            broker,
            settings,
            loops: Mutex::new(HashMap::new()),
            serving: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Whether convergence loops run in this process (`broker serve`).
    pub(crate) fn converging(&self) -> bool {
        self.serving.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The committed group `id`, checked.
    fn committed(&self, id: &str) -> Result<Group, GroupError> {
        let record = self.broker.store().group(id)?.ok_or_else(|| GroupError::UnknownGroup(id.to_owned()))?;
        let stored = |why: String| GroupError::StoredSpec { group: id.to_owned(), why };
        let spec: GroupSpec = serde_json::from_value(record.spec).map_err(|e| stored(e.to_string()))?;
        Group::check(spec).map_err(|e| stored(e.to_string()))
    }

    /// The provider a committed group's stored spec names, even a spec that
    /// no longer checks (so that such a group can still be freed).
    fn committed_provider(&self, id: &str) -> Result<String, GroupError> {
        match self.committed(id) {
            Ok(group) => Ok(group.provider),
            Err(GroupError::StoredSpec { group, why }) => {
                let record = self.broker.store().group(id)?.ok_or_else(|| GroupError::UnknownGroup(id.to_owned()))?;
                let plugin = record.spec.pointer("/Properties/Instance/Plugin").and_then(|p| p.as_str());
                plugin.map(str::to_owned).ok_or(GroupError::StoredSpec { group, why })
            }
            Err(other) => Err(other),
        }
    }

    /// The group's members: its provider's instances whose records carry its tag, by id.
    async fn members(&self, group: &Group) -> Result<Vec<InstanceRecord>, GroupError> {
        let listed = self.broker.provider_instances(&group.provider).await?;
        Ok(listed.into_iter().filter(|r| r.instance_tags.get(GROUP_TAG).is_some_and(|g| g == group.id())).collect())
    }

    /// The ids of the group's members by the host's records alone (no
    /// provider asked: it may be gone, or failing).
    async fn recorded_members(&self, id: &str, provider: &str) -> Result<Vec<String>, GroupError> {
        let records = self.broker.records_of(provider).await?;
        Ok(records
            .into_iter()
            .filter(|r| r.instance_tags.get(GROUP_TAG).is_some_and(|g| g == id))
            .map(|r| r.id)
            .collect())
    }

    /// Commit a spec (its file's text): the plan, in InfraKit's words; with
    /// `pretend`, only the plan, and nothing changes.
    #[tracing::instrument(skip(self, text))]
    pub async fn commit_text(self: &Arc<Self>, text: &str, pretend: bool) -> Result<String, GroupError> {
        self.commit(Group::parse(text)?, pretend).await
    }

    /// Commit a checked spec; see [`Groups::commit_text`].
    pub async fn commit(self: &Arc<Self>, group: Group, pretend: bool) -> Result<String, GroupError> {
        // Read, check and write under the group's lock: two commits of one
        // group never both see "no previous spec".
        let (slot, mut state) = self.locked(group.id(), false).await?;
        let outcome = self.commit_locked(&group, pretend, &mut state).await;
        drop(state);
        match &outcome {
            Ok(_) if !pretend => self.ensure_loop(group.id()),
            _ => self.drop_idle_slot(group.id(), &slot),
        }
        outcome
    }

    async fn commit_locked(&self, group: &Group, pretend: bool, state: &mut LoopState) -> Result<String, GroupError> {
        let registered = self.broker.registry().list().map_err(BrokerServiceError::from)?;
        if !registered.iter().any(|p| p.name == group.provider) {
            return Err(GroupError::UnknownProvider(group.provider.clone()));
        }
        let previous = match self.committed(group.id()) {
            Ok(previous) => Some(previous),
            Err(GroupError::UnknownGroup(_)) => None,
            // A spec that no longer reads is replaced, as long as it names the same provider.
            Err(GroupError::StoredSpec { .. }) => {
                let was = self.committed_provider(group.id())?;
                if was != group.provider {
                    return Err(provider_changed(group, was));
                }
                None
            }
            Err(other) => return Err(other),
        };
        if let Some(previous) = &previous {
            if previous.provider != group.provider {
                return Err(provider_changed(group, previous.provider.clone()));
            }
            let kind = |members: &Members| match members {
                Members::Size(_) => "a size (Allocation.Size)",
                Members::LogicalIds(_) => "logical ids (Allocation.LogicalIDs)",
            };
            if kind(&previous.members) != kind(&group.members) {
                return Err(GroupError::AllocationChanged {
                    group: group.id().to_owned(),
                    was: kind(&previous.members),
                    now: kind(&group.members),
                });
            }
        }
        let plan = match &previous {
            None => format!("Managing {} instances", group.size()),
            Some(previous) => plan_text(previous, group, &self.members(group).await?),
        };
        if pretend {
            return Ok(plan);
        }
        let spec = serde_json::to_value(&group.spec).map_err(|e| SpecError::Parse(e.to_string()))?;
        let record = GroupRecord { spec, committed: crate::store::records::now_rfc3339() };
        let event = group_event(EventKind::GroupCommitted, group, plan.clone());
        // The cap is checked in the write itself: concurrent first commits cannot pass it.
        if !self.broker.store().put_group(group.id(), &record, &event, MAX_GROUPS).await? {
            return Err(GroupError::TooManyGroups(MAX_GROUPS));
        }
        // The next pass works from the new spec.
        state.recommitted();
        Ok(plan)
    }

    /// The committed specs, by id. One that does not read back is named in
    /// the log and left out: it hides no other.
    pub fn inspect(&self) -> Result<Vec<GroupSpec>, GroupError> {
        let mut specs = Vec::new();
        for (id, _) in self.broker.store().groups()? {
            match self.committed(&id) {
                Ok(group) => specs.push(group.spec),
                Err(error) => {
                    tracing::error!(group = %id, error = %broker_capabilities::error_text::error_text(&error), "left out of the listing")
                }
            }
        }
        Ok(specs)
    }

    /// The group's members now, and whether it has converged. It does not
    /// wait for a pass in progress.
    pub async fn describe(&self, id: &str) -> Result<GroupDescription, GroupError> {
        let group = self.committed(id)?;
        let members = self.members(&group).await?;
        // Read where it is, never made: a group destroyed meanwhile leaves no slot behind.
        let update_stopped = lock(&self.loops).get(id).and_then(|entry| lock(&entry.slot.halted).clone());
        let converged = update_stopped.is_none() && is_converged(&group, &members);
        let instances = members
            .into_iter()
            .map(|r| MemberDescription {
                logical_id: logical_id(&r).map(str::to_owned),
                id: r.id,
                tags: r.instance_tags,
                status: r.status,
                message: r.message,
            })
            .collect();
        let size = group.size();
        Ok(GroupDescription { id: id.to_owned(), provider: group.provider, size, instances, converged, update_stopped })
    }

    /// How many members the group should have.
    pub fn size(&self, id: &str) -> Result<usize, GroupError> {
        Ok(self.committed(id)?.size())
    }

    /// Commit the group's spec with a new size; returns the plan. Its
    /// members follow while the loop runs (`describe` tells when).
    pub async fn set_size(self: &Arc<Self>, id: &str, size: u32) -> Result<String, GroupError> {
        let plan = {
            let (_, mut state) = self.locked(id, true).await?;
            let mut spec = self.committed(id)?.spec;
            if spec.properties.allocation.logical_ids.is_some() {
                return Err(GroupError::QuorumSize(id.to_owned()));
            }
            spec.properties.allocation.size = Some(size);
            self.commit_locked(&Group::check(spec)?, false, &mut state).await?
        };
        self.ensure_loop(id);
        Ok(plan)
    }

    /// Destroy `ids`, all members of the group, and shrink it by as many;
    /// one that is not a member fails the call before anything is destroyed.
    /// The smaller spec, the members' stop marks and their leaving the group
    /// are one write, so neither a crash before the stop nor a failed stop
    /// regrows the group, shrinks it twice on a retry, or has it stop
    /// another member in their place.
    pub async fn destroy_instances(self: &Arc<Self>, id: &str, ids: &[String]) -> Result<(), GroupError> {
        let _pass = self.locked(id, true).await?;
        let group = self.committed(id)?;
        let members: std::collections::HashSet<String> =
            self.recorded_members(id, &group.provider).await?.into_iter().collect();
        let mut unique: Vec<String> = Vec::with_capacity(ids.len());
        for wanted in ids {
            if !members.contains(wanted) {
                return Err(GroupError::NotAMember { group: id.to_owned(), id: wanted.clone() });
            }
            if !unique.contains(wanted) {
                unique.push(wanted.clone());
            }
        }
        let mut spec = group.spec.clone();
        // A quorum member destroyed is made again: its logical id is still wanted.
        if let Some(size) = &mut spec.properties.allocation.size {
            *size = size.saturating_sub(u32::try_from(unique.len()).unwrap_or(u32::MAX));
        }
        let shrunk = Group::check(spec)?;
        let plan = format!("Terminating {} instances to reduce the group size to {}", unique.len(), shrunk.size());
        let spec = serde_json::to_value(&shrunk.spec).map_err(|e| SpecError::Parse(e.to_string()))?;
        let record = GroupRecord { spec, committed: crate::store::records::now_rfc3339() };
        let event = group_event(EventKind::GroupCommitted, &shrunk, plan);
        self.broker.store().shrink_group(id, &record, &event, &group.provider, &unique).await?;
        self.broker.stop_instances(&group.provider, &unique).await?;
        for stopped in &unique {
            self.note(&group, EventKind::InstanceDestroyed, format!("{stopped}: destroyed on request")).await;
        }
        Ok(())
    }

    /// Forget the group; its instances run on, recorded as ungrouped. Its
    /// members are chosen, untagged and the group forgotten in one write: a
    /// crash never leaves the group committed with its members untagged,
    /// nor a member tagged meanwhile behind. Works without the provider, and
    /// on a spec that no longer reads.
    pub async fn free(&self, id: &str) -> Result<(), GroupError> {
        let (slot, _pass) = self.locked(id, true).await?;
        let provider = self.committed_provider(id)?;
        let mut event = Event::new(EventKind::GroupFreed, &provider);
        event.group = Some(id.to_owned());
        self.broker.store().free_group(id, &event, &provider).await?;
        slot.wake.notify_one();
        Ok(())
    }

    /// Destroy the group's instances and forget it. The group is forgotten
    /// and its members (chosen in the same write) marked for stopping and
    /// ungrouped in one write, before the stop: a crash midway never makes
    /// the members again, and the restart's reconcile finishes their stops.
    pub async fn destroy(&self, id: &str) -> Result<(), GroupError> {
        let (slot, _pass) = self.locked(id, true).await?;
        let provider = self.committed_provider(id)?;
        let registered = self.broker.registry().list().map_err(BrokerServiceError::from)?;
        if !registered.iter().any(|p| p.name == provider) {
            return Err(GroupError::ProviderGone { group: id.to_owned(), provider });
        }
        let mut event = Event::new(EventKind::GroupDestroyed, &provider);
        event.group = Some(id.to_owned());
        let ids = self.broker.store().destroy_group(id, &event, &provider).await?;
        slot.wake.notify_one();
        self.broker.stop_instances(&provider, &ids).await.map_err(|source| GroupError::StopsUnfinished {
            group: id.to_owned(),
            count: ids.len(),
            source: Box::new(source),
        })
    }
}

fn provider_changed(group: &Group, was: String) -> GroupError {
    GroupError::ProviderChanged { group: group.id().to_owned(), was, now: group.provider.clone() }
}

fn group_event(kind: EventKind, group: &Group, detail: String) -> Event {
    let mut event = Event::new(kind, &group.provider);
    event.group = Some(group.id().to_owned());
    event.detail = detail;
    event
}

/// The plan of committing `next` over `previous`, in InfraKit's words.
fn plan_text(previous: &Group, next: &Group, members: &[InstanceRecord]) -> String {
    let live: Vec<&InstanceRecord> = members.iter().filter(|m| !is_lost(m)).collect();
    let undesired = live.iter().filter(|m| config_hash(m) != Some(next.config_hash.as_str())).count();
    let desired = live.len() - undesired;
    match (&previous.members, &next.members) {
        (Members::Size(old), Members::Size(new)) => {
            let (old, new) = (*old as usize, *new as usize);
            match new.cmp(&old) {
                std::cmp::Ordering::Equal if undesired == 0 => "Noop".into(),
                std::cmp::Ordering::Equal => format!("Performing a rolling update on {undesired} instances"),
                std::cmp::Ordering::Less => {
                    let terminate = format!("Terminating {} instances to reduce the group size to {new}", old - new);
                    match new.saturating_sub(desired) {
                        0 => terminate,
                        roll => format!("{terminate}, then performing a rolling update on {roll} instances"),
                    }
                }
                std::cmp::Ordering::Greater => {
                    let add = new - old;
                    match undesired {
                        0 => format!("Adding {add} instances to increase the group size to {new}"),
                        roll => format!(
                            "Performing a rolling update on {roll} instances, then adding {add} instances to increase the group size to {new}"
                        ),
                    }
                }
            }
        }
        (_, Members::LogicalIds(ids)) => {
            let have: Vec<&str> = live.iter().filter_map(|m| logical_id(m)).collect();
            let adding: Vec<&str> = ids.iter().map(String::as_str).filter(|id| !have.contains(id)).collect();
            let removing: Vec<&str> = have.iter().copied().filter(|h| !ids.iter().any(|id| id == h)).collect();
            let mut parts = Vec::new();
            if !adding.is_empty() {
                parts.push(format!("Adding {} instances for logical ids {}", adding.len(), adding.join(", ")));
            }
            if !removing.is_empty() {
                parts.push(format!("Terminating {} instances of logical ids {}", removing.len(), removing.join(", ")));
            }
            let rolled = live
                .iter()
                .filter(|m| config_hash(m) != Some(next.config_hash.as_str()))
                .filter(|m| logical_id(m).is_some_and(|lid| ids.iter().any(|id| id == lid)))
                .count();
            if rolled > 0 {
                parts.push(format!("Performing a rolling update on {rolled} instances"));
            }
            if parts.is_empty() { "Noop".into() } else { parts.join(", then ") }
        }
        (Members::LogicalIds(_), Members::Size(new)) => {
            format!("Managing {new} instances, replacing the quorum's {} members", live.len())
        }
    }
}

/// What a pass did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pass {
    /// Nothing to do: the group is as its spec asks, or waits on its provider.
    Steady,
    /// It started or stopped instances.
    Changed,
    /// It replaced members lost soon after their start, on this many passes
    /// in a row: the loop waits longer each time.
    Replaced {
        /// Passes in a row that did so.
        failed_passes: u32,
    },
    /// A rolling update waits for a replacement to settle.
    Updating,
    /// The group is no longer committed: its loop ends.
    Gone,
}

impl Pass {
    /// How long the loop waits after this pass, with `poll` between steady passes.
    pub fn wait(&self, poll: Duration) -> Duration {
        match self {
            // What it changed is looked at again at once.
            Pass::Changed => Duration::ZERO,
            // Members that fail as they start: never a tight loop of starts
            // (1 s, 2 s, 4 s, … at most `poll`).
            Pass::Replaced { failed_passes } => {
                Duration::from_secs(1).saturating_mul(1 << failed_passes.saturating_sub(1).min(16)).min(poll)
            }
            Pass::Updating => poll.min(Duration::from_secs(1)),
            Pass::Steady | Pass::Gone => poll,
        }
    }
}
