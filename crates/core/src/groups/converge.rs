//! One convergence pass: replace the lost, destroy the surplus, start the
//! missing (placed across zones), roll members of an older spec one at a time.

use super::loops::{Health, LoopState};
use super::spec::{Group, Members, UpdatePace};
use super::{GroupError, Groups, Pass, age, config_hash, group_event, is_lost, lock, logical_id};
use crate::broker::BrokerServiceError;
use crate::store::{EventKind, InstanceRecord};
use broker_capabilities::rooms::context::CallHooks;
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

impl Groups {
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
    pub(super) async fn note(&self, group: &Group, kind: EventKind, detail: String) {
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

/// Whether `members` are what `group` asks for.
pub(super) fn is_converged(group: &Group, members: &[InstanceRecord]) -> bool {
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
