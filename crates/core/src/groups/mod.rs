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

pub mod spec;

use crate::broker::{Broker, BrokerServiceError};
use crate::store::{Event, EventKind, GroupRecord, InstanceRecord, StoreError};
use broker_capabilities::rooms::context::CallHooks;
use futures_util::StreamExt;
use serde::Serialize;
use spec::{CONFIG_HASH_TAG, GROUP_TAG, Group, GroupSpec, LOGICAL_ID_TAG, Members, SpecError, UpdatePace};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why a group call failed.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// The spec was refused.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// No group of this id is committed.
    #[error("no group {0:?} is committed (`broker group ls` lists them)")]
    UnknownGroup(String),
    /// The spec names a provider that is not registered.
    #[error("group spec field Properties.Instance.Plugin: no provider {0:?} is registered")]
    UnknownProvider(String),
    /// A committed group's provider cannot change under its instances.
    #[error(
        "group spec field Properties.Instance.Plugin: group {group:?}'s instances are provider {was:?}'s; free or destroy the group to move it to {now:?}"
    )]
    ProviderChanged {
        /// The group.
        group: String,
        /// Its provider.
        was: String,
        /// The one the new spec names.
        now: String,
    },
    /// `destroy-instances` named an instance that is not the group's.
    #[error("instance {id:?} is not a member of group {group:?}: nothing was destroyed")]
    NotAMember {
        /// The group.
        group: String,
        /// The first id that is not its member.
        id: String,
    },
    /// A group cannot switch between a size and logical ids.
    #[error(
        "group spec field Properties.Allocation: group {group:?} is committed with {was}; a spec with {now} cannot replace it (free or destroy the group first)"
    )]
    AllocationChanged {
        /// The group.
        group: String,
        /// What it is committed with.
        was: &'static str,
        /// What the new spec gives.
        now: &'static str,
    },
    /// The host keeps at most [`MAX_GROUPS`] groups.
    #[error("{0} groups are committed, the most one host keeps: destroy or free one first")]
    TooManyGroups(usize),
    /// A committed spec does not read back (a damaged store, or an older host's spec).
    #[error("group {group:?}: its stored spec does not read ({why}); commit a new spec for it, or free it")]
    StoredSpec {
        /// The group.
        group: String,
        /// What is wrong with it.
        why: String,
    },
    /// The group's provider is gone, so its instances cannot be stopped.
    #[error(
        "group {group:?}: its provider {provider:?} is not registered, so its instances cannot be stopped; `broker group free {group}` forgets the group and leaves them"
    )]
    ProviderGone {
        /// The group.
        group: String,
        /// Its provider.
        provider: String,
    },
    /// The group is forgotten but stopping its members failed.
    #[error(
        "group {group:?} is destroyed, but stopping its {count} instances failed (they stay marked for stopping: `broker stop` or the next restart's reconcile finishes them)"
    )]
    StopsUnfinished {
        /// The group.
        group: String,
        /// How many members it had.
        count: usize,
        /// Why the stop failed.
        #[source]
        source: Box<BrokerServiceError>,
    },
    /// A quorum group's size is its logical ids.
    #[error(
        "group {0:?} is a quorum group (LogicalIDs): its size is its logical ids; commit a new spec to change them"
    )]
    QuorumSize(String),
    /// A convergence pass panicked (a host bug): the loop goes on after its backoff.
    #[error("group {0:?}: a convergence pass panicked (a bug in the host); the next pass tries again")]
    PassPanicked(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A broker call failed.
    #[error(transparent)]
    Broker(#[from] BrokerServiceError),
}

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
pub const MAX_GROUPS: usize = 1000;

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

/// How a member has looked to the rolling update.
#[derive(Debug, Clone, Copy)]
struct Health {
    /// Since when it has been listed running, pass after pass.
    since: Instant,
    /// On how many passes in a row.
    passes: u32,
    /// Whether `maintain-instance` answered for it once it settled (asked once).
    answered: bool,
}

/// What a convergence loop remembers between passes (not across restarts:
/// a restarted host waits out a replacement's health again, the safe side).
#[derive(Default)]
struct LoopState {
    /// The members listed running, by id.
    healthy: HashMap<String, Health>,
    /// When the last rolling-update step destroyed an old member.
    step_at: Option<Instant>,
    /// Passes in a row that replaced members lost soon after their start.
    failed_passes: u32,
    /// When the last of those passes ran: a failure window without another
    /// ends the row.
    last_failed: Option<Instant>,
    /// Set when those passes reached the most: no pass changes anything
    /// until the next commit.
    replacing_stopped: bool,
    /// Why the group stopped converging, until the next commit; read by
    /// `describe` without waiting for a pass.
    halted: Arc<Mutex<Option<String>>>,
    /// Whether `converged` was announced (once per convergence).
    announced: bool,
}

impl LoopState {
    fn halted(&self) -> Option<String> {
        lock(&self.halted).clone()
    }
    fn halt(&self, why: String) {
        *lock(&self.halted) = Some(why);
    }
    /// A new spec: a fresh start for the update and the failure count.
    fn recommitted(&mut self) {
        *lock(&self.halted) = None;
        self.step_at = None;
        self.failed_passes = 0;
        self.last_failed = None;
        self.replacing_stopped = false;
        self.announced = false;
    }
}

/// A group's loop: its pass lock, its wake-up, and what `describe` reads without the lock.
#[derive(Clone)]
struct Slot {
    /// One pass at a time; the calls that change members take it too.
    state: Arc<tokio::sync::Mutex<LoopState>>,
    wake: Arc<tokio::sync::Notify>,
    halted: Arc<Mutex<Option<String>>>,
}

impl Default for Slot {
    fn default() -> Self {
        let state = LoopState::default();
        let halted = state.halted.clone();
        Slot { state: Arc::new(tokio::sync::Mutex::new(state)), wake: Arc::default(), halted }
    }
}

#[derive(Default)]
struct GroupLoop {
    slot: Slot,
    running: bool,
    task: Option<tokio::task::AbortHandle>,
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
    pub fn converging(&self) -> bool {
        self.serving.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn slot(&self, id: &str) -> Slot {
        lock(&self.loops).entry(id.to_owned()).or_default().slot.clone()
    }

    /// The group's pass lock, held on the slot the map holds (a loop that
    /// ended may have removed the one first looked up: then again). With
    /// `committed`, an id no group has is refused before any slot is made
    /// for it, so a caller cannot fill the map with ids.
    async fn locked(
        &self,
        id: &str,
        committed: bool,
    ) -> Result<(Slot, tokio::sync::OwnedMutexGuard<LoopState>), GroupError> {
        loop {
            if committed && self.broker.store().group(id)?.is_none() {
                return Err(GroupError::UnknownGroup(id.to_owned()));
            }
            let slot = self.slot(id);
            let guard = slot.state.clone().lock_owned().await;
            let current = lock(&self.loops).get(id).is_some_and(|entry| Arc::ptr_eq(&entry.slot.state, &slot.state));
            if current {
                return Ok((slot, guard));
            }
        }
    }

    /// Forget `slot` if nothing uses it: no loop, no committed group (a
    /// refused or pretend first commit).
    fn drop_idle_slot(&self, id: &str, slot: &Slot) {
        let mut loops = lock(&self.loops);
        let idle = loops.get(id).is_some_and(|entry| !entry.running && Arc::ptr_eq(&entry.slot.state, &slot.state));
        if idle && matches!(self.broker.store().group(id), Ok(None)) {
            Self::remove_unheld(&mut loops, id, slot);
        }
    }

    /// Remove `id`'s entry if it is `slot` and nobody holds its pass lock:
    /// a holder works on, sure that no other pass runs, so its slot stays
    /// until it lets go. One waiting for the lock finds it gone and looks
    /// the slot up again ([`Groups::locked`]). Whether it was removed.
    fn remove_unheld(loops: &mut HashMap<String, GroupLoop>, id: &str, slot: &Slot) -> bool {
        if !loops.get(id).is_some_and(|entry| Arc::ptr_eq(&entry.slot.state, &slot.state)) {
            return false;
        }
        // Held across the removal: the map's lock keeps a new holder from checking it meanwhile.
        let Ok(_unheld) = slot.state.try_lock() else { return false };
        loops.remove(id);
        true
    }

    /// Start a convergence loop for every committed group, and for each
    /// committed from now on. The loops end when the runtime does.
    pub fn start_loops(self: &Arc<Self>) -> Result<(), GroupError> {
        self.serving.store(true, std::sync::atomic::Ordering::SeqCst);
        for (id, _) in self.broker.store().groups()? {
            self.ensure_loop(&id);
        }
        Ok(())
    }

    fn ensure_loop(self: &Arc<Self>, id: &str) {
        if !self.converging() {
            return;
        }
        let slot = {
            let mut loops = lock(&self.loops);
            let entry = loops.entry(id.to_owned()).or_default();
            if entry.running {
                entry.slot.wake.notify_one();
                return;
            }
            entry.running = true;
            entry.slot.clone()
        };
        let (groups, group_id, own) = (self.clone(), id.to_owned(), slot.clone());
        let task = tokio::spawn(async move {
            let id = group_id;
            let mut failures = 0u32;
            loop {
                let span = tracing::info_span!("group pass", group = %id);
                let pass = tracing::Instrument::instrument(groups.converge_once(&id), span);
                // A pass that panics is a failed pass: the loop goes on (with
                // its backoff), never leaving the group marked running unconverged.
                let outcome = match futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(pass)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(GroupError::PassPanicked(id.clone())),
                };
                let wait = match outcome {
                    Ok(Pass::Gone) => {
                        // Unless a commit made the group again meanwhile (its
                        // wake-up found this loop running), the loop ends. A
                        // slot in use (a destroy still stopping) stays, and the
                        // next pass waits for it.
                        let mut loops = lock(&groups.loops);
                        let gone = matches!(groups.broker.store().group(&id), Ok(None));
                        if !gone {
                            // Made again, or the store cannot tell: the loop goes on.
                            Duration::ZERO
                        } else if Self::remove_unheld(&mut loops, &id, &slot) {
                            break;
                        } else if loops.get(&id).is_some_and(|entry| Arc::ptr_eq(&entry.slot.state, &slot.state)) {
                            Duration::ZERO
                        } else {
                            // Not this loop's slot any more (never expected): end, leaving it be.
                            break;
                        }
                    }
                    Ok(pass) => {
                        failures = 0;
                        pass.wait(groups.settings.poll)
                    }
                    Err(error) => {
                        // Backoff: never a tight loop against a failing provider.
                        failures = failures.saturating_add(1);
                        let backoff = Duration::from_millis(100u64 << failures.min(10));
                        tracing::warn!(group = %id, error = %broker_capabilities::error_text::error_text(&error), "a group pass failed");
                        backoff.min(groups.settings.poll)
                    }
                };
                tokio::select! {
                    () = slot.wake.notified() => {}
                    () = tokio::time::sleep(wait) => {}
                }
            }
        });
        let mut loops = lock(&self.loops);
        // Loops stopped between the spawn and here: this one too.
        if !self.converging() {
            task.abort();
            return;
        }
        // Only on this loop's own entry: one that ended at once may have been replaced.
        if let Some(entry) = loops.get_mut(id)
            && Arc::ptr_eq(&entry.slot.state, &own.state)
            && !task.is_finished()
        {
            entry.task = Some(task.abort_handle());
        }
    }

    /// End every convergence loop where it stands (the host is going away:
    /// a start cut short is left pending, for the next host to resolve).
    pub fn stop_loops(&self) {
        self.serving.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut loops = lock(&self.loops);
        for slot in loops.values_mut() {
            if let Some(task) = slot.task.take() {
                task.abort();
            }
            slot.running = false;
        }
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
        let listed = self.broker.list_instances(Some(&group.provider)).await?;
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

    /// Wake the group's loop for a pass now.
    pub fn wake(&self, id: &str) {
        if let Some(entry) = lock(&self.loops).get(id) {
            entry.slot.wake.notify_one();
        }
    }

    /// One convergence pass of group `id`.
    pub async fn converge_once(&self, id: &str) -> Result<Pass, GroupError> {
        let (_, mut state) = self.locked(id, false).await?;
        let group = match self.committed(id) {
            Err(GroupError::UnknownGroup(_)) => return Ok(Pass::Gone),
            other => other?,
        };
        if state.replacing_stopped {
            // Until the spec is committed again.
            return Ok(Pass::Steady);
        }
        let members = self.members(&group).await?;
        let (lost, alive): (Vec<InstanceRecord>, Vec<InstanceRecord>) = members.into_iter().partition(is_lost);
        let wall = std::time::SystemTime::now();
        let failed_young = lost.iter().filter(|m| age(m, wall) < self.settings.failure_window).count();
        if failed_young > 0 {
            state.failed_passes = state.failed_passes.saturating_add(1);
            state.last_failed = Some(Instant::now());
            if state.failed_passes >= self.settings.max_failed_passes {
                let why = format!(
                    "members failed within {} of their start on {} passes in a row ({} now); replacing stopped until the spec is committed again",
                    humantime::format_duration(self.settings.failure_window),
                    state.failed_passes,
                    lost.iter().map(|m| format!("{} {}", m.id, m.status)).collect::<Vec<_>>().join(", "),
                );
                self.note(&group, EventKind::ReplacementStopped, why.clone()).await;
                state.halt(why);
                state.replacing_stopped = true;
                state.announced = false;
                return Ok(Pass::Steady);
            }
        } else if state.last_failed.is_none_or(|at| at.elapsed() >= self.settings.failure_window) {
            // A whole window without a member failing young: the row is over.
            state.failed_passes = 0;
            state.last_failed = None;
        }
        if !lost.is_empty() {
            let ids: Vec<String> = lost.iter().map(|m| m.id.clone()).collect();
            self.broker.stop_instances(&group.provider, &ids).await?;
            for member in &lost {
                self.note(
                    &group,
                    EventKind::InstanceReplaced,
                    format!("{}: {} ({})", member.id, member.status, member.message),
                )
                .await;
            }
        }
        let running: std::collections::HashSet<&str> =
            alive.iter().filter(|m| m.status == "running").map(|m| m.id.as_str()).collect();
        state.healthy.retain(|id, _| running.contains(id.as_str()));
        let now = Instant::now();
        for id in running {
            let seen = state.healthy.entry(id.to_owned()).or_insert(Health { since: now, passes: 0, answered: false });
            seen.passes = seen.passes.saturating_add(1);
        }
        let steady_members = (lost.is_empty()).then(|| alive.clone());
        let pass = match &group.members {
            Members::Size(_) => self.converge_scaled(&group, alive, &mut state).await?,
            Members::LogicalIds(ids) => self.converge_quorum(&group, ids, alive, &mut state).await?,
        };
        let pass = match pass {
            _ if failed_young > 0 => Pass::Replaced { failed_passes: state.failed_passes },
            pass if !lost.is_empty() => match pass {
                Pass::Steady | Pass::Updating => Pass::Changed,
                other => other,
            },
            pass => pass,
        };
        // A pass that changed nothing decides from its own listing; one that did lists again.
        let members = match steady_members {
            Some(members) if pass != Pass::Changed => members,
            _ => self.members(&group).await?,
        };
        if state.halted().is_none() && is_converged(&group, &members) {
            if !state.announced {
                state.announced = true;
                self.note(&group, EventKind::Converged, format!("{} instances", members.len())).await;
            }
        } else {
            state.announced = false;
        }
        Ok(pass)
    }

    async fn converge_scaled(
        &self,
        group: &Group,
        mut alive: Vec<InstanceRecord>,
        state: &mut LoopState,
    ) -> Result<Pass, GroupError> {
        let target = group.size();
        if alive.len() > target {
            // Oldest config first (not the committed hash), then by id: the same choice every pass.
            alive.sort_by(|a, b| {
                let current = |r: &InstanceRecord| config_hash(r) == Some(group.config_hash.as_str());
                (current(a), &a.id).cmp(&(current(b), &b.id))
            });
            let surplus: Vec<String> = alive.drain(..alive.len() - target).map(|m| m.id).collect();
            self.broker.stop_instances(&group.provider, &surplus).await?;
            for id in surplus {
                self.note(group, EventKind::InstanceDestroyed, format!("{id}: surplus")).await;
            }
            return Ok(Pass::Changed);
        }
        if alive.len() < target {
            // A bounded batch a pass: the group's lock is let go between
            // batches, so a commit or a destroy never waits for thousands of starts.
            let missing = (target - alive.len()).min(self.start_batch());
            self.start_members(group, &alive, vec![None; missing]).await?;
            return Ok(Pass::Changed);
        }
        self.rolling_step(group, &alive, state).await
    }

    async fn converge_quorum(
        &self,
        group: &Group,
        wanted: &[String],
        alive: Vec<InstanceRecord>,
        state: &mut LoopState,
    ) -> Result<Pass, GroupError> {
        // One member per logical id: a stranger or a second of one id goes.
        let mut kept: BTreeMap<&str, &InstanceRecord> = BTreeMap::new();
        let mut extra = Vec::new();
        for member in &alive {
            match logical_id(member) {
                Some(lid) if wanted.iter().any(|w| w == lid) && !kept.contains_key(lid) => {
                    kept.insert(lid, member);
                }
                _ => extra.push(member.id.clone()),
            }
        }
        if !extra.is_empty() {
            self.broker.stop_instances(&group.provider, &extra).await?;
            for id in &extra {
                self.note(group, EventKind::InstanceDestroyed, format!("{id}: its logical id is not the spec's")).await;
            }
        }
        let missing: Vec<Option<String>> = wanted
            .iter()
            .filter(|w| !kept.contains_key(w.as_str()))
            .take(self.start_batch())
            .map(|w| Some(w.clone()))
            .collect();
        if !missing.is_empty() {
            let kept: Vec<InstanceRecord> = kept.values().map(|m| (*m).clone()).collect();
            self.start_members(group, &kept, missing).await?;
            return Ok(Pass::Changed);
        }
        let alive: Vec<InstanceRecord> = kept.into_values().cloned().collect();
        match self.rolling_step(group, &alive, state).await? {
            // What it stopped is looked at again.
            _ if !extra.is_empty() => Ok(Pass::Changed),
            pass => Ok(pass),
        }
    }

    /// Most starts one pass makes.
    fn start_batch(&self) -> usize {
        self.settings.max_parallel.max(1).saturating_mul(4)
    }

    /// Start one member per entry (a logical id, or none), at most
    /// `max-parallel` at once. Zones follow Juju's rule, the group's members
    /// being the distribution group: with a `zones=` constraint the host
    /// places each start in the zone with fewest members (starts in flight
    /// count; ties by name) and tries the next zone on `zone-unavailable`;
    /// without one, the provider is given the members as the distribution
    /// group and chooses. The first failure is returned after the rest finish.
    async fn start_members(
        &self,
        group: &Group,
        members: &[InstanceRecord],
        logical_ids: Vec<Option<String>>,
    ) -> Result<(), GroupError> {
        let mut per_zone: BTreeMap<String, usize> = group.zones().into_iter().map(|z| (z, 0)).collect();
        for member in members {
            if let Some(count) = member.hardware.availability_zone.as_ref().and_then(|z| per_zone.get_mut(z)) {
                *count += 1;
            }
        }
        let placing = Placing { per_zone: Mutex::new(per_zone), said_unavailable: Mutex::default() };
        let distribution = Arc::new(Mutex::new(members.iter().map(|m| m.id.clone()).collect::<Vec<_>>()));
        // After a failure, starts not yet begun are not begun: a failing
        // provider gets the few in flight, not the whole batch.
        let failed = std::sync::atomic::AtomicBool::new(false);
        let starts = futures_util::stream::iter(logical_ids)
            .map(|lid| {
                let (placing, distribution, failed) = (&placing, distribution.clone(), &failed);
                async move {
                    if failed.load(std::sync::atomic::Ordering::SeqCst) {
                        return Ok(());
                    }
                    match self.start_member(group, lid.as_deref(), placing, distribution.clone()).await {
                        Ok(record) => {
                            lock(&distribution).push(record.id.clone());
                            self.note(group, EventKind::InstanceAdded, record.id).await;
                            Ok(())
                        }
                        Err(error) => {
                            failed.store(true, std::sync::atomic::Ordering::SeqCst);
                            Err(error)
                        }
                    }
                }
            })
            .buffer_unordered(self.settings.max_parallel.max(1));
        let outcomes: Vec<Result<(), GroupError>> = starts.collect().await;
        outcomes.into_iter().collect()
    }

    async fn start_member(
        &self,
        group: &Group,
        logical_id: Option<&str>,
        placing: &Placing,
        distribution: Arc<Mutex<Vec<String>>>,
    ) -> Result<InstanceRecord, GroupError> {
        let per_zone = &placing.per_zone;
        let hooks = CallHooks {
            distribution_group: Some(Arc::new(move || Ok(lock(&distribution).clone()))),
            ..CallHooks::default()
        };
        let mut params = group.params_for(logical_id);
        let mut tried: Vec<String> = Vec::new();
        loop {
            let zone = {
                let mut per_zone = lock(per_zone);
                let fewest = per_zone.iter().filter(|(z, _)| !tried.contains(z)).min_by_key(|(_, n)| **n);
                let zone = fewest.map(|(z, _)| z.clone());
                if let Some(zone) = &zone {
                    *per_zone.entry(zone.clone()).or_default() += 1;
                }
                zone
            };
            if zone.is_some() {
                params.availability_zone = zone.clone();
            }
            let started = self.broker.start_instance(&group.provider, &params, &hooks).await;
            let Some(zone) = zone else { return Ok(started?) };
            match started {
                Ok(record) => return Ok(record),
                Err(failed) => {
                    if let Some(count) = lock(per_zone).get_mut(&zone) {
                        *count = count.saturating_sub(1);
                    }
                    let unavailable = matches!(
                        &failed,
                        BrokerServiceError::Call(crate::version::CallError::Guest {
                            error: broker_capabilities::bindings::BrokerError::ZoneUnavailable(_),
                            ..
                        })
                    );
                    tried.push(zone.clone());
                    if !unavailable || tried.len() == lock(per_zone).len() {
                        return Err(failed.into());
                    }
                    // One event a zone a pass, however many starts it turned away.
                    if lock(&placing.said_unavailable).insert(zone.clone()) {
                        self.note(
                            group,
                            EventKind::ZoneUnavailable,
                            format!(
                                "{zone}: {}; trying the next zone",
                                broker_capabilities::error_text::error_text(&failed)
                            ),
                        )
                        .await;
                    }
                }
            }
        }
    }

    /// With the group at its size: if members from an older spec remain and
    /// every current one is healthy (for `Updating`'s pace), destroy one old
    /// member (the next pass makes its replacement); if a replacement stays
    /// unhealthy past the patience, stop the update and say so.
    async fn rolling_step(
        &self,
        group: &Group,
        alive: &[InstanceRecord],
        state: &mut LoopState,
    ) -> Result<Pass, GroupError> {
        if state.halted().is_some() {
            return Ok(Pass::Steady);
        }
        let mut old: Vec<&InstanceRecord> =
            alive.iter().filter(|m| config_hash(m) != Some(group.config_hash.as_str())).collect();
        if old.is_empty() {
            state.step_at = None;
            return Ok(Pass::Steady);
        }
        let now = Instant::now();
        let settled = |health: &Health| match group.pace {
            UpdatePace::Healthy => true,
            UpdatePace::For(duration) => now.duration_since(health.since) >= duration,
            UpdatePace::Passes(count) => health.passes >= count,
        };
        let current = alive.iter().filter(|m| config_hash(m) == Some(group.config_hash.as_str()));
        let mut all_settled = true;
        for member in current {
            // Healthy: the provider lists it running and, once it has been so
            // for the pace, answers `maintain-instance` for it (asked once).
            match state.healthy.get_mut(&member.id) {
                Some(health) if health.answered => {}
                Some(health) if settled(health) => {
                    match self.broker.maintain_instance(&group.provider, &member.id).await {
                        Ok(()) => health.answered = true,
                        Err(failed) => {
                            tracing::info!(group = %group.id(), instance_id = %member.id, error = %failed, "not healthy yet");
                            // Its pace starts again from the next pass that lists it running.
                            state.healthy.remove(&member.id);
                            all_settled = false;
                        }
                    }
                }
                _ => all_settled = false,
            }
        }
        if !all_settled {
            let pace = match group.pace {
                UpdatePace::For(duration) => duration,
                _ => Duration::ZERO,
            };
            if let Some(step_at) = state.step_at
                && now.duration_since(step_at) > pace.saturating_add(self.settings.update_patience)
            {
                let why = format!(
                    "a replacement was not healthy within {}; {} instances of the older spec remain",
                    humantime::format_duration(pace.saturating_add(self.settings.update_patience)),
                    old.len()
                );
                self.note(group, EventKind::UpdateStopped, why.clone()).await;
                state.halt(why);
                return Ok(Pass::Steady);
            }
            return Ok(Pass::Updating);
        }
        old.sort_by(|a, b| a.id.cmp(&b.id));
        let next = old[0].id.clone();
        self.note(
            group,
            EventKind::UpdateStep,
            format!("{next}: replaced by the committed spec ({} old left)", old.len() - 1),
        )
        .await;
        self.broker.stop_instances(&group.provider, std::slice::from_ref(&next)).await?;
        state.step_at = Some(now);
        Ok(Pass::Changed)
    }

    /// An event of the group's; one that cannot be written is logged, and the pass goes on.
    async fn note(&self, group: &Group, kind: EventKind, detail: String) {
        tracing::info!(group = %group.id(), provider = %group.provider, %kind, detail = %detail, "group event");
        if let Err(error) = self.broker.store().append_event(&group_event(kind, group, detail)).await {
            tracing::warn!(group = %group.id(), %error, "a group event was not recorded");
        }
    }
}

/// Where one pass's starts go: members per allowed zone (starts in flight
/// counted), and the zones already said to be unavailable.
struct Placing {
    per_zone: Mutex<BTreeMap<String, usize>>,
    said_unavailable: Mutex<std::collections::BTreeSet<String>>,
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

fn provider_changed(group: &Group, was: String) -> GroupError {
    GroupError::ProviderChanged { group: group.id().to_owned(), was, now: group.provider.clone() }
}

fn group_event(kind: EventKind, group: &Group, detail: String) -> Event {
    let mut event = Event::new(kind, &group.provider);
    event.group = Some(group.id().to_owned());
    event.detail = detail;
    event
}

/// Whether `members` are what `group` asks for.
fn is_converged(group: &Group, members: &[InstanceRecord]) -> bool {
    let all_current_and_running =
        members.iter().all(|m| m.status == "running" && config_hash(m) == Some(group.config_hash.as_str()));
    let right_members = match &group.members {
        Members::Size(size) => members.len() == *size as usize,
        Members::LogicalIds(ids) => {
            // Every member has one of the ids, each id once: a member without one is one too many.
            let mut have: Vec<Option<&str>> = members.iter().map(logical_id).collect();
            have.sort_unstable();
            let mut want: Vec<Option<&str>> = ids.iter().map(|id| Some(id.as_str())).collect();
            want.sort_unstable();
            have == want
        }
    };
    all_current_and_running && right_members
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_removed_only_if_it_is_the_ids_own_and_its_pass_lock_is_free() {
        let mut loops = HashMap::from([("g".to_owned(), GroupLoop::default())]);
        let slot = loops["g"].slot.clone();
        assert!(!Groups::remove_unheld(&mut loops, "g", &Slot::default()), "another slot is not removed for it");
        let held = slot.state.try_lock().unwrap();
        assert!(!Groups::remove_unheld(&mut loops, "g", &slot), "a holder keeps its slot");
        assert!(loops.contains_key("g"));
        drop(held);
        assert!(Groups::remove_unheld(&mut loops, "g", &slot));
        assert!(loops.is_empty());
    }
}
