//! Start-up reconcile, as Juju's agent does when it starts: each recorded
//! instance gets `maintain-instance`, and what each provider reports is
//! compared with the host's records. What differs is reported (an event per
//! provider and a log line).
//!
//! After a restart it also finishes what the last process left in flight,
//! as Juju's provisioner does: a start it recorded as pending is adopted if
//! the provider reports the id the start claimed, else forgotten; a stop it
//! marked is finished (the record goes once the provider no longer reports
//! the instance); and instances no record claims are harvested as the
//! [`HarvestMode`] says, only after a complete inventory and before the
//! provider starts anything new.

use super::BrokerServiceError;
use super::service::Broker;
use crate::store::{Event, EventKind, InstanceRecord, StoreError};
use broker_capabilities::bindings::{ListedInstance, StartInstanceParams};
use broker_capabilities::contract::empty_params;
use broker_capabilities::rooms::context::CallHooks;
use clap::ValueEnum;

/// What a reconcile found for one provider.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Reconciled {
    /// The provider reconciled.
    pub provider: String,
    /// Instances `maintain-instance` answered for.
    pub maintained: Vec<String>,
    /// Instance id and why `maintain-instance` failed.
    pub maintain_failed: Vec<(String, String)>,
    /// Reported by the provider, never recorded by the host.
    pub unknown_to_host: Vec<String>,
    /// Recorded by the host, no longer reported by the provider.
    pub vanished: Vec<String>,
    /// Reported by the provider with an id the host does not take (not a valid
    /// id, or another provider's), escaped, with why; left out of the above.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
    /// The provider could not be asked at all.
    pub error: Option<String>,
    /// Instances whose start the last process left pending, recorded now.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub adopted: Vec<String>,
    /// Pending starts of the last process that made nothing the provider reports.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forgotten: Vec<String>,
    /// Stops the last process left unfinished, finished now.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stops_finished: Vec<String>,
    /// Unknown instances stopped by the harvest mode.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub harvested: Vec<String>,
    /// What finishing the last process's work could not do, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unresolved: Vec<String>,
}

/// Which instances the first reconcile after a restart stops (Juju's
/// `provisioner-harvest-mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HarvestMode {
    /// Stop nothing: unfinished stops stay marked, unknown instances reported.
    None,
    /// Finish the stops the host was asked for (its "destroyed" machines); unknown instances are reported.
    #[default]
    Destroyed,
    /// Stop instances no record claims; unfinished stops stay marked.
    Unknown,
    /// Both.
    All,
}

impl HarvestMode {
    fn finishes_stops(self) -> bool {
        matches!(self, HarvestMode::Destroyed | HarvestMode::All)
    }

    /// Whether new starts must wait for the harvest (it would take theirs for unknown).
    pub(crate) fn stops_unknown(self) -> bool {
        matches!(self, HarvestMode::Unknown | HarvestMode::All)
    }
}

impl Reconciled {
    /// One line for the `reconciled` event: counts, failures and differences, or why it could not run.
    pub fn summary(&self) -> String {
        if let Some(error) = &self.error {
            return format!("cannot reconcile: {error}");
        }
        let mut parts = vec![format!("maintained {}", self.maintained.len())];
        if !self.maintain_failed.is_empty() {
            let failed = self.maintain_failed.iter().map(|(id, why)| format!("{id} ({why})"));
            parts.push(format!("maintain failed: {}", named(failed)));
        }
        if !self.unknown_to_host.is_empty() {
            parts.push(format!("unknown to the host: {}", named(self.unknown_to_host.iter().cloned())));
        }
        if !self.vanished.is_empty() {
            parts.push(format!("vanished: {}", named(self.vanished.iter().cloned())));
        }
        if !self.refused.is_empty() {
            parts.push(format!("refused ids: {}", named(self.refused.iter().cloned())));
        }
        let finished = [
            ("adopted", &self.adopted),
            ("forgot pending starts", &self.forgotten),
            ("finished stops", &self.stops_finished),
            ("harvested", &self.harvested),
            ("unresolved", &self.unresolved),
        ];
        for (what, ids) in finished.into_iter().filter(|(_, ids)| !ids.is_empty()) {
            parts.push(format!("{what}: {}", named(ids.iter().cloned())));
        }
        parts.join("; ")
    }
}

/// `maintain-instance` calls a reconcile runs at once per provider: half its
/// `max-concurrent-calls`, the other half left to the calls the API serves
/// meanwhile (the bound is the operator's word on what its backend takes).
fn maintain_at_once(max_concurrent_calls: usize) -> usize {
    (max_concurrent_calls / 2).max(1)
}

/// Records a reconcile reads at once (with their params) to maintain them.
const MAINTAIN_PAGE: usize = 256;

/// Ids a `reconciled` event names per kind; past that it counts them.
const IDS_NAMED: usize = 20;

/// `ids`, the first [`IDS_NAMED`] of them, then how many more.
fn named(ids: impl ExactSizeIterator<Item = String>) -> String {
    let count = ids.len();
    let mut text: Vec<String> = ids.take(IDS_NAMED).collect();
    if count > IDS_NAMED {
        text.push(format!("and {} more", count - IDS_NAMED));
    }
    text.join(", ")
}

/// Where one instance's maintenance is in a reconcile.
enum Maintained {
    /// Its call answered: failed, or its kv changes are on their way.
    Called(String, Result<crate::version::Durable, BrokerServiceError>),
    /// Its kv changes are durable, or could not be made so.
    Durable(String, Result<(), BrokerServiceError>),
}

/// Opens a provider's starts when its first reconcile ends, however it ends.
struct SettleOnDrop<'a>(&'a Broker, &'a str);

impl Drop for SettleOnDrop<'_> {
    fn drop(&mut self) {
        self.0.unsettled.settle(self.1);
    }
}

impl Broker {
    /// Reconcile every registered provider; each result is also an event.
    pub async fn reconcile(&self) -> Vec<Reconciled> {
        self.reconcile_all(None).await
    }

    /// The reconcile after a restart: as [`Broker::reconcile`], finishing the
    /// starts and stops the last process left in flight and harvesting as
    /// `harvest` says. With a mode that stops unknown instances, each
    /// provider's new starts wait until its harvest is done.
    pub async fn reconcile_after_restart(&self, harvest: HarvestMode) -> Vec<Reconciled> {
        self.reconcile_all(Some(harvest)).await
    }

    /// With a `harvest` that stops unknown instances, hold every registered
    /// provider's new starts until [`Broker::reconcile_after_restart`] has
    /// harvested it (called before the API serves, so none slips in first).
    pub fn hold_starts_for_harvest(&self, harvest: HarvestMode) {
        if !harvest.stops_unknown() {
            return;
        }
        match self.registry().list() {
            Ok(records) => self.unsettled.hold(records.into_iter().map(|p| p.name)),
            Err(e) => tracing::warn!(error = %e, "cannot list providers to hold their starts for the harvest"),
        }
    }

    /// Forget the records of devices that providers made in an earlier boot
    /// (or whose names are other devices' now): before any provider is
    /// called, so none can touch a device of the host's through one.
    pub async fn prune_stale_device_records(&self) {
        let network = broker_capabilities::network::owners::OwnedNetwork::new(
            std::sync::Arc::new(broker_capabilities::network::backend::HostNetwork),
            self.store().device_owners(),
        );
        match broker_capabilities::network::owners::prune_stale(&network).await {
            Ok(0) => {}
            Ok(forgotten) => tracing::info!(forgotten, "forgot the records of devices made in an earlier boot"),
            Err(error) => {
                tracing::warn!(%error, "cannot prune the records of devices: stale ones are forgotten as met")
            }
        }
    }

    /// Kill the processes left running as a provider's sandbox user that no
    /// child record holds: spawned by a host killed before it recorded them
    /// (see [`reap_unrecorded`]). Run before any provider is called after a
    /// restart; as root only (else programs run as the host's own user), and
    /// for the per-provider uids the host allocates (not a `[sandbox] user`).
    ///
    /// [`reap_unrecorded`]: broker_capabilities::rooms::process::reap_unrecorded
    pub fn reap_unrecorded_children(&self) -> Vec<(String, u32)> {
        self.reap_unrecorded_older_than(std::time::Duration::ZERO)
    }

    /// As [`Broker::reap_unrecorded_children`], while the host runs: processes
    /// younger than `min_age` are spared (a child is recorded just after it starts).
    pub fn reap_unrecorded_older_than(&self, min_age: std::time::Duration) -> Vec<(String, u32)> {
        if !rustix::process::geteuid().is_root() {
            return Vec::new();
        }
        let users = match self.store().sandbox_users() {
            Ok(users) => users,
            Err(error) => {
                tracing::warn!(%error, "cannot read the sandbox users: unrecorded children are not reaped");
                return Vec::new();
            }
        };
        // Only the uids the host gave out itself: one `[sandbox] user` set in
        // host.toml may be shared with programs that are none of the host's.
        let uids: std::collections::HashMap<u32, String> = users.iter().map(|(p, uid)| (*uid, p.clone())).collect();
        // Every provider that may have children: those given a uid, and the
        // registered ones (with `[sandbox] user`, none is given a uid of its own).
        let mut providers: std::collections::BTreeSet<String> = users.into_iter().map(|(p, _)| p).collect();
        match self.registry().list() {
            Ok(registered) => providers.extend(registered.into_iter().map(|p| p.name)),
            Err(error) => {
                tracing::warn!(%error, "cannot list the providers: unrecorded children are not reaped");
                return Vec::new();
            }
        }
        let children = self.store().child_records();
        let mut recorded = Vec::new();
        for provider in &providers {
            match children.list(provider) {
                Ok(records) => recorded.extend(records),
                Err(error) => {
                    // Without its records every child of it would look unrecorded.
                    tracing::warn!(provider, %error, "cannot read child records: unrecorded children are not reaped");
                    return Vec::new();
                }
            }
        }
        let ours = self.store().data_dir().display().to_string();
        // While this process runs programs (a periodic reap), its own children are spared.
        let host = (min_age > std::time::Duration::ZERO).then(std::process::id);
        let killed = broker_capabilities::rooms::process::reap_unrecorded(&uids, &recorded, &ours, min_age, host);
        for (provider, pid) in &killed {
            tracing::warn!(provider, pid, "killed a process a killed host left running without a child record");
        }
        killed
    }

    async fn reconcile_all(&self, harvest: Option<HarvestMode>) -> Vec<Reconciled> {
        let names: Vec<String> = match self.registry().list() {
            Ok(records) => records.into_iter().map(|p| p.name).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list providers to reconcile");
                return Vec::new();
            }
        };
        if harvest.is_some_and(HarvestMode::stops_unknown) {
            self.unsettled.hold(names.iter().cloned());
        }
        // All at once, as listing does: a slow or failing provider holds up no other.
        let all = futures_util::future::join_all(names.iter().map(|name| async move {
            let _settle = SettleOnDrop(self, name);
            self.reconcile_one(name, harvest).await
        }))
        .await;
        // Held before the list was read, since removed: nothing holds them now.
        self.unsettled.settle_all();
        let mut out = Vec::new();
        for (name, found) in names.into_iter().zip(all) {
            let mut event = Event::new(EventKind::Reconciled, &name);
            event.detail = found.summary();
            if let Err(e) = self.store().append_event(&event).await {
                tracing::warn!(provider = %name, error = %e, "cannot record a reconcile");
            }
            tracing::info!(provider = %name, result = %event.detail, "reconciled");
            out.push(found);
        }
        out
    }

    async fn reconcile_one(&self, name: &str, harvest: Option<HarvestMode>) -> Reconciled {
        use futures_util::StreamExt;
        use std::collections::HashSet;
        let mut found = Reconciled { provider: name.to_owned(), ..Reconciled::default() };
        // Not maintained: what a stop is ending (this process's now, or the
        // last process's, which the restart's reconcile finishes below).
        let stopping: HashSet<String> = match self.store().interrupted_stops(name) {
            Ok(marked) => marked.into_iter().chain(self.in_flight.of(name)).collect(),
            Err(e) => return Reconciled { error: Some(e.to_string()), ..found },
        };
        // The records a page at a time, each with its params, as the calls
        // take them: a million records are never all in hand, nor read twice.
        // `before` (in id order) is what was recorded before the provider was
        // asked. Several calls at once (each waits for the provider's backend,
        // or for its kv's), not all it may run.
        let at_once = match self.registry().get(name).await {
            Ok(wasm) => maintain_at_once(wasm.manifest().limits.max_concurrent_calls),
            Err(e) => return Reconciled { error: Some(e.to_string()), ..found },
        };
        let mut before: Vec<String> = Vec::new();
        let mut queued = std::collections::VecDeque::new();
        // The next page is read on the blocking pool while the calls of this
        // one run: the reads and the calls take a core each.
        let mut reading = Some(self.read_to_maintain(name, None));
        // Calls running (at most `at_once`), and changes of calls that answered
        // on their way to the state file: many commit together while the next
        // calls run.
        let mut steps =
            futures_util::stream::FuturesUnordered::<futures_util::future::BoxFuture<'_, Maintained>>::new();
        let (mut calling, mut unread) = (0, None);
        loop {
            while calling < at_once && steps.len() < MAINTAIN_PAGE {
                // Until a page leaves something to maintain (one may be all stopping).
                while queued.is_empty()
                    && let Some(read) = reading.take()
                {
                    let page = match read.await {
                        Ok(Ok(page)) => page,
                        // No more pages: the calls under way finish, then the error is the answer.
                        Ok(Err(e)) => {
                            unread = Some(e.to_string());
                            break;
                        }
                        Err(_) => {
                            unread = Some(StoreError::ReadPanicked.to_string());
                            break;
                        }
                    };
                    if page.len() == MAINTAIN_PAGE
                        && let Some((last, _)) = page.last()
                    {
                        reading = Some(self.read_to_maintain(name, Some(last.clone())));
                    }
                    before.extend(page.iter().map(|(id, _)| id.clone()));
                    queued.extend(page.into_iter().filter(|(id, _)| !stopping.contains(id)));
                }
                let Some((id, params)) = queued.pop_front() else { break };
                calling += 1;
                steps.push(Box::pin(self.maintain_recorded(name, id, params)));
            }
            match steps.next().await {
                None => break,
                Some(Maintained::Called(id, Ok(durable))) => {
                    calling -= 1;
                    steps.push(Box::pin(async move { Maintained::Durable(id, durable.await.map_err(Into::into)) }));
                }
                Some(Maintained::Called(id, Err(e))) => {
                    calling -= 1;
                    found.maintain_failed.push((id, e.to_string()));
                }
                Some(Maintained::Durable(id, Ok(()))) => found.maintained.push(id),
                Some(Maintained::Durable(id, Err(e))) => found.maintain_failed.push((id, e.to_string())),
            }
        }
        found.maintained.sort_unstable();
        found.maintain_failed.sort_unstable();
        if let Some(e) = unread {
            return Reconciled { error: Some(e), ..found };
        }
        let live = match self.registry().get(name).await {
            Ok(wasm) => wasm
                .listed_instances(&CallHooks::default())
                .await
                .map(crate::version::in_id_order)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let live = match live.and_then(|live| self.screen_reported(name, live).map_err(|e| e.to_string())) {
            Ok((live, refused)) => {
                found.refused = refused;
                live
            }
            Err(e) => return Reconciled { error: Some(e), ..found },
        };
        if let Some(mode) = harvest
            && let Err(e) = self.finish_last_process(name, mode, &live, &mut found).await
        {
            return Reconciled { error: Some(e.to_string()), ..found };
        }
        // Like with like: the records are read again now the provider has
        // answered. An instance started meanwhile is in both; one stopped
        // meanwhile is in neither the records after nor (likely) the answer.
        // What this process's starts and stops are still working on is in
        // one and not yet the other: left out, taken before the records are
        // read, so a call that ended between the two has its record read.
        let flying = self.in_flight.of(name);
        let after = match self.store().instance_ids(name) {
            Ok(ids) => ids,
            Err(e) => return Reconciled { error: Some(e.to_string()), ..found },
        };
        let recorded_after: HashSet<&str> = after.iter().map(String::as_str).collect();
        // Stopped by this reconcile: in the inventory, no longer anyone's.
        let harvested: HashSet<&str> =
            found.harvested.iter().chain(&found.stops_finished).map(String::as_str).collect();
        let reported: HashSet<&str> = live.iter().map(|i| i.instance.id.as_str()).collect();
        found.unknown_to_host = (live.iter().map(|i| &i.instance.id))
            .filter(|id| !recorded_after.contains(id.as_str()) && !harvested.contains(id.as_str()))
            .filter(|id| !flying.contains(*id))
            .cloned()
            .collect();
        found.vanished = before
            .into_iter()
            .filter(|id| recorded_after.contains(id.as_str()) && !reported.contains(id.as_str()))
            .filter(|id| !flying.contains(id))
            .collect();
        found
    }

    /// Read a page of `name`'s records to maintain, after `after`, on the blocking pool.
    fn read_to_maintain(
        &self,
        name: &str,
        after: Option<String>,
    ) -> tokio::task::JoinHandle<Result<Vec<crate::store::ToMaintain>, StoreError>> {
        let (store, name) = (self.store.clone(), name.to_owned());
        tokio::task::spawn_blocking(move || store.to_maintain_after(&name, after.as_deref(), MAINTAIN_PAGE))
    }

    /// `maintain-instance` on one recorded instance with its recorded params.
    async fn maintain_recorded(
        &self,
        name: &str,
        id: String,
        params: Result<Option<StartInstanceParams>, StoreError>,
    ) -> Maintained {
        let outcome = match params {
            Ok(params) => self.maintain_durable_apart(name, &id, &params.unwrap_or_else(empty_params)).await,
            Err(unreadable) => Err(unreadable.into()),
        };
        Maintained::Called(id, outcome)
    }

    /// Finish what the last process left of `name`'s calls, against `live`
    /// (a complete inventory, taken after every record was maintained), then
    /// harvest as `mode` says.
    async fn finish_last_process(
        &self,
        name: &str,
        mode: HarvestMode,
        live: &[ListedInstance],
        found: &mut Reconciled,
    ) -> Result<(), BrokerServiceError> {
        use std::collections::{HashMap, HashSet};
        let reported: HashMap<&str, &ListedInstance> = live.iter().map(|i| (i.instance.id.as_str(), i)).collect();
        let mut recorded: HashSet<String> = self.store().instance_ids(name)?.into_iter().collect();

        for (key, start) in self.store().interrupted_starts(name)? {
            let claimed = start.claimed.clone();
            match claimed.as_deref().and_then(|id| reported.get(id).map(|i| (id, *i))) {
                Some((id, instance)) if !recorded.contains(id) => {
                    let record = adopted(name, instance, start);
                    match self.store().put_adopted_instance(&record, &key).await? {
                        None => {
                            found.adopted.push(id.to_owned());
                            recorded.insert(id.to_owned());
                        }
                        Some(owner) => found.unresolved.push(format!("{id} (claimed, but recorded for {owner})")),
                    }
                }
                // Its record made it (the id was claimed by another start too): nothing to adopt.
                Some(_) => self.store().remove_pending_start(name, &key).await?,
                None => {
                    let what = match (&claimed, start.nonce.as_str()) {
                        (Some(id), _) => id.clone(),
                        (None, "") => format!("a start at {} that claimed no id", start.started),
                        (None, nonce) => format!("a start of nonce {nonce} that claimed no id"),
                    };
                    self.store().remove_pending_start(name, &key).await?;
                    found.forgotten.push(what);
                }
            }
        }

        let marked = self.store().interrupted_stops(name)?;
        let (still, gone): (Vec<String>, Vec<String>) =
            marked.into_iter().partition(|id| reported.contains_key(id.as_str()));
        if !gone.is_empty() {
            self.store().remove_instances(name, &gone).await?;
            found.stops_finished.extend(gone.iter().cloned());
            recorded.retain(|id| !gone.contains(id));
        }
        if !still.is_empty() {
            match mode.finishes_stops() {
                true => match self.stop_instances(name, &still).await {
                    Ok(()) => found.stops_finished.extend(still),
                    Err(e) => found.unresolved.push(format!("stopping {} failed: {e}", still.join(", "))),
                },
                false => {
                    let mode = mode.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
                    found.unresolved.push(format!("left stopping (harvest mode {mode}): {}", still.join(", ")));
                }
            }
        }

        let unknown: Vec<String> =
            live.iter().map(|i| &i.instance.id).filter(|id| !recorded.contains(*id)).cloned().collect();
        if mode.stops_unknown() && !unknown.is_empty() {
            let wasm = self.registry().get(name).await?;
            match wasm.stop_instances(&CallHooks::default(), &unknown).await {
                Ok(()) => found.harvested = unknown,
                Err(e) => found.unresolved.push(format!("harvesting {} unknown instances failed: {e}", unknown.len())),
            }
        }
        Ok(())
    }
}

/// The record of an instance whose start the last process left pending:
/// what the provider lists of it (its hardware and zone, 0.3.0 on), and
/// what the host recorded of its start.
fn adopted(provider: &str, listed: &ListedInstance, start: crate::store::PendingStart) -> InstanceRecord {
    use crate::store::records::{Hardware, MAX_REPORTED_ENTRIES, MAX_REPORTED_WORD_BYTES, reported, status_name};
    let instance = &listed.instance;
    InstanceRecord {
        id: instance.id.clone(),
        provider: provider.to_owned(),
        status: status_name(instance.status).to_owned(),
        message: "adopted: its start was cut short by the host's end".into(),
        display_name: reported(&listed.display_name, MAX_REPORTED_WORD_BYTES),
        hardware: listed.hardware.as_ref().map(Hardware::from).unwrap_or_default(),
        tags: start.params.constraints.tags.clone().unwrap_or_default(),
        addresses: (instance.addresses.iter().take(MAX_REPORTED_ENTRIES))
            .map(|a| reported(&a.value, MAX_REPORTED_WORD_BYTES))
            .collect(),
        created: start.started,
        // A group's member adopted stays its member.
        instance_tags: start.params.instance_config.iter().flat_map(|config| config.tags.iter().cloned()).collect(),
        params: Some(Box::new(start.params)),
    }
}
