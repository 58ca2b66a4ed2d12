//! The broker service: provider calls plus the host's records of what they did.

use super::host_preparer::{HostPreparer, PrepareError};
use crate::providers::data_dirs::DATA_DIRS;
use crate::providers::{Registry, RegistryError};
use crate::runtime::{HostCapabilities, Runtime, RuntimeError};
use crate::store::records::{
    Hardware, MAX_REPORTED_ENTRIES, MAX_REPORTED_MESSAGE_BYTES, MAX_REPORTED_WORD_BYTES, id_for_message,
    instance_id_problem, now_rfc3339, reported, status_name,
};
use crate::store::{Store, StoreError};
use crate::version::CallError;
use broker_capabilities::bindings::BrokerError;
use broker_capabilities::bindings::{ListedInstance, StartInstanceParams};
use broker_capabilities::contract::empty_params;
use broker_capabilities::data_fs::{DATA_IMAGES, DataFilesystems};
use broker_capabilities::machine_lock::{LockError, MachineLock};
use broker_capabilities::rooms::context::{CallHooks, ClaimFn};
use broker_capabilities::rooms::http_egress::signing::CREDENTIALS_DIR;
use broker_capabilities::rooms::kv::KvWrites;
use broker_capabilities::rooms::machine_lock::MachineLockRoom;
use broker_capabilities::sandbox::{Sandbox, SandboxConfig, UidAllocations};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use crate::store::InstanceRecord;

/// Why a broker operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BrokerServiceError {
    /// Finding, loading or changing a registered provider failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The provider call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The host's store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The wasm runtime could not be set up.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The machine lock could not be set up.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The host could not be bridged for a start.
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// `host.toml` could not be read or parsed.
    #[error("host config {path}: {reason}")]
    HostConfig {
        /// Its path.
        path: String,
        /// The read or parse error.
        reason: String,
    },
    /// No provider has a record of this instance id.
    #[error("unknown instance {0:?}: the host has no record of it (pass --provider to ask a provider directly)")]
    UnknownInstance(String),
    /// Several providers have a record of this instance id.
    #[error("instance id {id:?} is recorded for several providers ({providers}); pass --provider")]
    AmbiguousInstance {
        /// The instance id.
        id: String,
        /// Those providers, comma-separated.
        providers: String,
    },
    /// A start would take the provider past its declared bound of records: refused before it ran.
    #[error(
        "provider {provider} is at its bound of {bound} instances (limits.max-records in its manifest): {recorded} recorded, {starting} more starting; stop some, or raise the bound, before starting more"
    )]
    AtRecordBound {
        /// The provider.
        provider: String,
        /// Its `max-records`.
        bound: usize,
        /// Instances recorded for it.
        recorded: usize,
        /// Its starts under way.
        starting: usize,
    },
    /// A provider's paged listing went on past every page it may have.
    #[error(
        "provider {provider} broke the contract: a listing of more than {pages} pages, more than the instances it may list (limits.max-records) allow"
    )]
    EndlessListing {
        /// The provider.
        provider: String,
        /// The most pages its listing may take: three times its `max-records` and one.
        pages: usize,
    },
    /// A started instance could not be recorded, so it was stopped.
    #[error("provider {provider}: started {id} but could not record it ({}); the instance was stopped again", broker_capabilities::error_text::cause_text(.cause))]
    RecordFailed {
        /// The provider that started it.
        provider: String,
        /// The instance id.
        id: String,
        /// The store's failure.
        cause: StoreError,
    },
    /// The provider returned an id the host does not take, so the instance was stopped.
    #[error(
        "provider {provider} returned an unusable instance id {id}: {reason}; nothing was recorded and the instance was stopped again"
    )]
    InvalidInstanceId {
        /// The provider that started it.
        provider: String,
        /// The id, escaped for a message.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A start was answered with the id of an instance already recorded for the same provider.
    #[error(
        "provider {provider} answered a start with instance id {id}, which is already recorded as one of its instances; nothing was recorded (a provider must not hand out one id twice)"
    )]
    InstanceIdReused {
        /// The provider.
        provider: String,
        /// The id, escaped for a message.
        id: String,
    },
    /// The provider returned an id recorded for another provider; the instance is left running.
    #[error(
        "provider {provider} returned instance id {id}, which is recorded for provider {owner}; nothing was recorded, and the instance was not stopped, as the id may name {owner}'s instance"
    )]
    InstanceIdTaken {
        /// The provider that started it.
        provider: String,
        /// The id, escaped for a message.
        id: String,
        /// The provider it is recorded for.
        owner: String,
    },
    /// `provider call` of a method whose effect the host records, on a registered provider.
    #[error(
        "{0} changes what the host records: use `broker instance start|stop|maintain`, or call the component file, which runs in the kit's sandbox"
    )]
    Recorded(crate::manifest::Method),
    /// `provider call` named no method, or gave params that do not fit it.
    #[error(transparent)]
    ByName(crate::version::by_name::ByNameError),
    /// Only a sandbox without a network has none; a host always has its own.
    #[error("unable to setup network: this host gives no network backend")]
    NoNetwork,
}

/// The host's service: the registered providers, the store of what they did, and the machine lock.
pub struct Broker {
    pub(super) store: Arc<Store>,
    registry: Registry,
    machine_lock: MachineLock,
    host: HostConfig,
    /// Providers whose starts wait for their first reconcile's harvest.
    pub(super) unsettled: Unsettled,
    /// The ids this process's starts and stops are working on now.
    pub(super) in_flight: Arc<super::in_flight::InFlight>,
    /// Seals the listing's cursors.
    pub(super) cursor_key: super::listing::CursorKey,
}

/// Providers whose new starts wait until the first reconcile after a restart
/// has harvested their unknown instances: an instance whose start is in
/// flight is not known yet, and must not be taken for one to stop.
#[derive(Default)]
pub(super) struct Unsettled {
    providers: std::sync::Mutex<std::collections::HashSet<String>>,
    settled: tokio::sync::Notify,
}

impl Unsettled {
    pub(super) fn hold(&self, names: impl IntoIterator<Item = String>) {
        self.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(names);
    }

    pub(super) fn settle(&self, name: &str) {
        if self.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(name) {
            self.settled.notify_waiters();
        }
    }

    pub(super) fn settle_all(&self) {
        let mut held = self.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !held.is_empty() {
            held.clear();
            self.settled.notify_waiters();
        }
    }

    async fn wait(&self, name: &str) {
        loop {
            let settled = self.settled.notified();
            if !self.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(name) {
                return;
            }
            tracing::debug!(provider = name, "a start waits for the provider's first reconcile");
            settled.await;
        }
    }
}

/// `DATA_DIR/host.toml`: how this machine's network is to be bridged.
///
/// ```toml
/// [bridges]          # bridge name -> the host device it is made over
/// br-lan = "eth0"
/// [sandbox]          # how granted programs are confined (all optional)
/// bwrap = "/usr/bin/bwrap"
/// uid-base = 2000000000   # per-provider users: uid-base + n, never reused
/// # user = 64000          # or one user for every provider's programs
/// ```
/// A bridge not listed here is made over the device whose Juju bridge name it is
/// (`br-eth0` over `eth0`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// `[bridges]`: a bridge name providers are granted -> the host's device it stands for.
    #[serde(default)]
    pub bridges: BTreeMap<String, String>,
    /// How granted programs are confined (`[sandbox]`: `bwrap`, `user`, `uid-base`).
    #[serde(default)]
    pub sandbox: SandboxConfig,
}

impl HostConfig {
    /// `DATA_DIR/host.toml`, or the defaults when there is none.
    pub fn load(data_dir: &Path) -> Result<HostConfig, BrokerServiceError> {
        let path = data_dir.join("host.toml");
        let error = |reason: String| BrokerServiceError::HostConfig { path: path.display().to_string(), reason };
        match crate::manifest::read_regular_file(&path, crate::manifest::MAX_MANIFEST_BYTES) {
            Ok(bytes) => {
                let text = String::from_utf8(bytes).map_err(|_| error("not UTF-8 text".into()))?;
                toml::from_str(&text).map_err(|e| error(e.to_string().trim_end().to_owned()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HostConfig::default()),
            Err(e) => Err(error(e.to_string())),
        }
    }
}

impl Broker {
    /// Open the host state in `data_dir` (compiled components are cached in `data_dir/cache`).
    pub fn open(data_dir: &Path) -> Result<Broker, BrokerServiceError> {
        Broker::open_with(data_dir, |_| {})
    }

    /// As [`Broker::open`], with the host capabilities changed by `adjust`
    /// before any provider loads: a test's scripted world in place of a real one.
    pub fn open_with(
        data_dir: &Path,
        adjust: impl FnOnce(&mut HostCapabilities),
    ) -> Result<Broker, BrokerServiceError> {
        let store = Arc::new(Store::open(data_dir)?);
        let runtime = Runtime::new(Some(&data_dir.join("cache")))?;
        let machine_lock = machine_lock(data_dir)?;
        let host = HostConfig::load(data_dir)?;
        crate::providers::data_dirs::move_out_of_providers_dir(&store);
        crate::providers::data_dirs::pin_approved_manifests(&store);
        Ok(Broker::with_parts(runtime, store, machine_lock, host, adjust))
    }

    /// As [`Broker::open`], waiting up to `patience` while another process (a
    /// CLI command working on the state itself, or a daemon on its way out)
    /// holds the state file, then trying again. `keep_waiting` is asked before
    /// each retry: `false` gives up at once (a daemon came up to talk to instead).
    pub async fn open_when_free(
        data_dir: &Path,
        patience: std::time::Duration,
        mut keep_waiting: impl AsyncFnMut() -> bool,
    ) -> Result<Broker, BrokerServiceError> {
        let until = std::time::Instant::now() + patience;
        let mut said = false;
        loop {
            match Broker::open(data_dir) {
                Err(BrokerServiceError::Store(StoreError::Busy { path }))
                    if std::time::Instant::now() < until && keep_waiting().await =>
                {
                    if !said {
                        tracing::info!(path, "the state file is held by another broker process: waiting for it");
                        said = true;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                opened => return opened,
            }
        }
    }

    pub(crate) fn with_parts(
        runtime: Arc<Runtime>,
        store: Arc<Store>,
        machine_lock: MachineLock,
        host: HostConfig,
        adjust: impl FnOnce(&mut HostCapabilities),
    ) -> Broker {
        let sandbox = Sandbox::new(host.sandbox.clone(), Some(store.clone() as Arc<dyn UidAllocations>));
        let on_host =
            HostCapabilities::on_host(store.kv(), store.data_dir().join(DATA_DIRS), sandbox, store.child_records());
        // The host's kernel, with the store's record of which provider made which device.
        let network = broker_capabilities::network::owners::OwnedNetwork::new(
            Arc::new(broker_capabilities::network::backend::HostNetwork),
            store.device_owners(),
        );
        let backends = on_host
            .backends
            .clone()
            .with::<MachineLockRoom>(Arc::new(machine_lock.clone()))
            .with::<broker_capabilities::rooms::network_bridge::NetworkBridge>(Arc::new(network))
            // Signed egress with the operator's credentials (DATA_DIR/credentials), the host's alone.
            .with::<broker_capabilities::rooms::http_egress::HttpEgress>(Arc::new(
                broker_capabilities::rooms::http_egress::HostEgress::with_credentials(
                    store.data_dir().join(CREDENTIALS_DIR),
                ),
            ));
        // Mounting needs root; elsewhere (a developer's host) data dirs stay plain, and it says so.
        let data_filesystems = if rustix::process::geteuid().is_root() {
            Some(Arc::new(DataFilesystems::new(store.data_dir().join(DATA_IMAGES))))
        } else {
            tracing::warn!("not root: providers' data dirs are plain directories, not held to their data-mib");
            None
        };
        // The operator's secrets for providers' configs (DATA_DIR/secrets/PROVIDER/NAME).
        let secrets = broker_capabilities::secrets::SecretSource::dir(
            store.data_dir().join(broker_capabilities::secrets::SECRETS_DIR),
        );
        let mut capabilities = HostCapabilities { backends, data_filesystems, secrets, ..on_host };
        adjust(&mut capabilities);
        let registry = Registry::new(runtime, store.clone(), capabilities);
        let (unsettled, in_flight, cursor_key) = (Unsettled::default(), Arc::default(), Default::default());
        Broker { registry, store, machine_lock, host, unsettled, in_flight, cursor_key }
    }

    /// The registered providers and the versions loaded for them.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The host's state: provider and instance records, events, every provider's kv.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The machine lock the host and its providers share.
    pub fn lock(&self) -> &MachineLock {
        &self.machine_lock
    }

    /// Start an instance. The provider places it (Juju's rule: the allowed
    /// zone with the fewest of the distribution group). If it answers
    /// `zone-unavailable`, the caller named no zone and the failed start
    /// claimed no instance, the host goes on as Juju's provisioner does: over
    /// the zones the provider lists (`describe`'s `zone=NAME` features, within
    /// a `zones` constraint, at most 16), emptiest first
    /// (the distribution group's instances, else the provider's, by the host's
    /// records; ties by name), each once, until one takes it, one answers any
    /// other error, or the caller aborts. The happy path costs nothing more.
    #[tracing::instrument(skip_all, fields(provider = %provider))]
    pub async fn start_instance(
        &self,
        provider: &str,
        params: &StartInstanceParams,
        hooks: &CallHooks,
    ) -> Result<InstanceRecord, BrokerServiceError> {
        let claimed = std::sync::atomic::AtomicBool::new(false);
        let failed = match self.start_placed(provider, params, hooks, &claimed).await {
            Err(failed) if zone_unavailable(&failed) => failed,
            done => return done,
        };
        let named = params.availability_zone.as_deref().is_some_and(|z| !z.is_empty())
            || params.placement.as_deref().is_some_and(|p| !p.is_empty());
        let mut zones = match named {
            true => Vec::new(),
            false => self.provider_zones(provider, params.constraints.zones.as_deref()).await,
        };
        if zones.is_empty() {
            return Err(failed);
        }
        let per_zone = self.instances_per_zone(provider, hooks).await;
        zones.sort_by_key(|z| (per_zone.get(z).copied().unwrap_or(0), z.clone()));
        let mut params = params.clone();
        let mut last = failed;
        for zone in zones {
            // Something made and claimed may be left of that start: not a second one beside it.
            if claimed.load(std::sync::atomic::Ordering::SeqCst)
                || hooks.abort.load(std::sync::atomic::Ordering::SeqCst)
            {
                break;
            }
            tracing::info!(provider, zone, error = %broker_capabilities::error_text::error_text(&last), "zone unavailable; the host tries the next");
            params.availability_zone = Some(zone);
            match self.start_placed(provider, &params, hooks, &claimed).await {
                Err(failed) if zone_unavailable(&failed) => last = failed,
                done => return done,
            }
        }
        Err(last)
    }

    /// The zones `provider` lists (`describe`'s `zone=NAME` features), in the
    /// `zones` constraint when there is one. None when it lists none or cannot say.
    async fn provider_zones(&self, provider: &str, allowed: Option<&[String]>) -> Vec<String> {
        let Ok(wasm) = self.registry.get(provider).await else { return Vec::new() };
        let Ok(info) = wasm.describe().await else { return Vec::new() };
        if !info.features.iter().any(|f| f == "zones") {
            return Vec::new();
        }
        let mut zones: Vec<String> = (info.features.iter())
            .filter_map(|f| f.strip_prefix("zone="))
            .filter(|z| instance_id_problem(z).is_none() && z.len() <= MAX_REPORTED_WORD_BYTES)
            .filter(|z| allowed.is_none_or(|a| a.iter().any(|w| w == z)))
            .take(MAX_PLACEMENT_ZONES)
            .map(str::to_owned)
            .collect();
        zones.sort();
        zones.dedup();
        zones
    }

    /// How many of the distribution group's instances (without one: the
    /// provider's) the host's records place in each zone.
    async fn instances_per_zone(&self, provider: &str, hooks: &CallHooks) -> BTreeMap<String, usize> {
        let group = hooks.distribution_group.as_ref().and_then(|group| group().ok());
        let mut per_zone = BTreeMap::new();
        for record in self.records_of(provider).await.unwrap_or_default() {
            if group.as_ref().is_some_and(|ids| !ids.contains(&record.id)) {
                continue;
            }
            if let Some(zone) = record.hardware.availability_zone {
                *per_zone.entry(zone).or_insert(0) += 1;
            }
        }
        per_zone
    }

    /// Bridge the host if the params' network needs it, then start the instance and record it
    /// in one commit with the provider's kv changes.
    #[tracing::instrument(skip_all, fields(provider = %provider, zone = params.availability_zone.as_deref().unwrap_or_default(), instance_id = tracing::field::Empty))]
    async fn start_placed(
        &self,
        provider: &str,
        params: &StartInstanceParams,
        hooks: &CallHooks,
        claimed_any: &std::sync::atomic::AtomicBool,
    ) -> Result<InstanceRecord, BrokerServiceError> {
        let wasm = self.registry.get(provider).await?;
        self.unsettled.wait(provider).await;
        // Its records and its starts under way stay within what it declares it
        // lists in one answer: refused here, before anything is made (after
        // the restart's reconcile has counted what it adopted).
        let bound = wasm.manifest().limits.max_records;
        let slot = self.store.record_counts().reserve(provider, bound).map_err(|at| {
            let provider = provider.to_owned();
            BrokerServiceError::AtRecordBound { provider, bound, recorded: at.recorded, starting: at.starting }
        })?;
        self.prepare_host(params, hooks).await?;
        // What the provider makes outside the store can outlive this call:
        // the intent is durable first, and the id the guest claims with it,
        // so a restart can finish the start (see reconcile).
        let pending = match wasm.acts_outside_the_store() {
            true => Some(self.store.put_pending_start(provider, &pending_start(&self.store, params)).await?),
            false => None,
        };
        let claimed = Arc::new(std::sync::Mutex::new(None::<String>));
        // Until this start has recorded what it made, a reconcile beside it leaves that alone.
        let flying = Arc::new(self.in_flight.call(provider));
        let claim = self.claim_hook(provider, pending.as_deref(), &claimed, &flying);
        let hooks = &CallHooks { claim: Some(claim), ..hooks.clone() };
        // A kv-only provider's instance is in the kv changes its call leaves
        // for the record's commit below; were the call dropped midway (a
        // drain cut short), those would be persisted without it. Declared
        // after the call, the guard is dropped before it: its pending start
        // is queued ahead of those changes.
        let mut call = std::pin::pin!(wasm.start_instance_leaving_writes(hooks, params));
        let abandoned =
            AbandonedStart { store: &self.store, provider, params, claimed: pending.is_none().then_some(&claimed) };
        // A kv-only provider's changes are left to commit with the record below.
        let outcome = call.as_mut().await;
        std::mem::forget(abandoned);
        let (result, writes) = match outcome {
            Ok(answer) => answer,
            Err(failed) => {
                let claimed = claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
                if claimed.is_some() {
                    claimed_any.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                self.after_failed_start(&wasm, provider, pending.as_deref(), claimed, &failed).await;
                return Err(failed.into());
            }
        };
        let instance = &result.instance;
        flying.note(&instance.id);
        if let Some(reason) = instance_id_problem(&instance.id) {
            // An instance the host cannot record is stopped, as below; the provider
            // gets back the id it chose.
            self.persist_unrecorded(provider, writes).await;
            let _ = wasm.stop_instances(&CallHooks::default(), std::slice::from_ref(&instance.id)).await;
            if let Some(key) = &pending {
                self.forget_pending_start(provider, key).await;
            }
            let (provider, id) = (provider.to_owned(), id_for_message(&instance.id));
            return Err(BrokerServiceError::InvalidInstanceId { provider, id, reason });
        }
        let claimed = claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(claimed) = claimed.filter(|claimed| *claimed != instance.id) {
            let (claimed, returned) = (id_for_message(&claimed), id_for_message(&instance.id));
            tracing::warn!(provider, %claimed, %returned, "the provider claimed one instance id and returned another");
        }
        tracing::Span::current().record("instance_id", instance.id.as_str());
        let record = InstanceRecord {
            id: instance.id.clone(),
            provider: provider.to_owned(),
            status: status_name(instance.status).to_owned(),
            // Cut to the record's bounds: held, listed and stored, the provider's bytes.
            message: reported(&instance.message, MAX_REPORTED_MESSAGE_BYTES),
            display_name: reported(&result.display_name, MAX_REPORTED_WORD_BYTES),
            hardware: result.hardware.as_ref().map(Hardware::from).unwrap_or_default(),
            tags: params.constraints.tags.clone().unwrap_or_default(),
            addresses: (instance.addresses.iter().take(MAX_REPORTED_ENTRIES))
                .map(|a| reported(&a.value, MAX_REPORTED_WORD_BYTES))
                .collect(),
            created: now_rfc3339(),
            instance_tags: params.instance_config.iter().flat_map(|config| config.tags.iter().cloned()).collect(),
            params: Some(Box::new(params.clone())),
        };
        // One commit: the provider's state of the instance and the host's record
        // of it are durable together (a crash between them cannot orphan it).
        match self.store.put_started_instance(&record, writes, pending, slot).await {
            Ok(None) => Ok(record),
            // Not stopped: the id may well name the other provider's instance (two
            // providers over one backend), and stopping it there would be worse.
            // A second start answered with a recorded instance's id: refused,
            // never an overwrite of that record (its tags, its group).
            Ok(Some(owner)) if owner == provider => {
                Err(BrokerServiceError::InstanceIdReused { provider: owner, id: id_for_message(&record.id) })
            }
            Ok(Some(owner)) => Err(BrokerServiceError::InstanceIdTaken {
                provider: provider.to_owned(),
                id: id_for_message(&record.id),
                owner,
            }),
            Err(source) => {
                // As Juju's provisioner does: an instance the host cannot record is stopped.
                let _ = wasm.stop_instances(&CallHooks::default(), std::slice::from_ref(&record.id)).await;
                Err(BrokerServiceError::RecordFailed { provider: provider.to_owned(), id: record.id, cause: source })
            }
        }
    }

    /// The `claim-instance-id` of the start pending as `key`: checked as a
    /// returned id is, once per call, then noted durably before the guest goes on.
    /// Without `key` (a kv-only provider) the claim is only held, for [`AbandonedStart`].
    fn claim_hook(
        &self,
        provider: &str,
        key: Option<&str>,
        claimed: &Arc<std::sync::Mutex<Option<String>>>,
        flying: &Arc<super::in_flight::CallIds>,
    ) -> ClaimFn {
        let (store, provider, claimed) = (self.store.clone(), provider.to_owned(), claimed.clone());
        let (key, flying) = (key.map(str::to_owned), flying.clone());
        Arc::new(move |id: String| {
            let (store, provider, key, claimed) = (store.clone(), provider.clone(), key.clone(), claimed.clone());
            let flying = flying.clone();
            Box::pin(async move {
                let invalid = |why: String| Err(BrokerError::InvalidParams(format!("claim-instance-id: {why}")));
                if let Some(reason) = instance_id_problem(&id) {
                    return invalid(format!("the id {} is not one the host takes: {reason}", id_for_message(&id)));
                }
                {
                    let mut held = claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    match held.as_deref() {
                        Some(same) if same == id => return Ok(()),
                        Some(other) => {
                            return invalid(format!(
                                "this start already claimed {}; a start claims one id",
                                id_for_message(other)
                            ));
                        }
                        None => {}
                    }
                    // Never written: a hostile guest's claims cost one write per call at most.
                    *held = Some(id.clone());
                    // In flight before the guest may act on it, and only the one id
                    // a start may claim: a guest's refused claims note nothing.
                    flying.note(&id);
                }
                let unclaim = || *claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                match store.owner_of(&id) {
                    Ok(Some(owner)) if owner != provider => {
                        unclaim();
                        return invalid(format!("the id {} is recorded for provider {owner}", id_for_message(&id)));
                    }
                    // Refused before the guest acts on it, as its answer would be
                    // (InstanceIdReused): a start never takes over a recorded instance.
                    Ok(Some(_)) => {
                        unclaim();
                        return invalid(format!(
                            "the id {} is already recorded as one of this provider's instances; a start claims a new id",
                            id_for_message(&id)
                        ));
                    }
                    Ok(None) => {}
                    Err(failed) => {
                        unclaim();
                        return Err(BrokerError::Provider(format!("the host cannot check the claimed id: {failed}")));
                    }
                }
                let Some(key) = key else { return Ok(()) };
                match store.claim_pending_start(&provider, &key, &id).await {
                    Ok(_) => Ok(()),
                    Err(failed) => {
                        unclaim();
                        Err(BrokerError::Provider(format!("the host cannot record the claimed id: {failed}")))
                    }
                }
            })
        })
    }

    /// A start that failed leaves nothing pending, unless the call was cut
    /// off (trap, deadline, limit) after claiming an id no record holds:
    /// whatever it made is then stopped (a kv-only provider's too: a failed
    /// call's kv changes are persisted), and if that fails the pending start
    /// stays for the next restart's reconcile to adopt or forget.
    async fn after_failed_start(
        &self,
        wasm: &crate::version::ProviderVersion,
        provider: &str,
        key: Option<&str>,
        claimed: Option<String>,
        failed: &CallError,
    ) {
        let cut_off = !matches!(failed, CallError::Guest { .. });
        if let Some(id) = claimed.filter(|id| cut_off && matches!(self.store.owner_of(id), Ok(None))) {
            let stopped = wasm.stop_instances(&CallHooks::default(), std::slice::from_ref(&id)).await;
            if let Err(error) = stopped {
                let id = id_for_message(&id);
                tracing::error!(provider, instance_id = %id, %error, "a start cut off after claiming its id could not be stopped: its pending start stays for the next restart");
                return;
            }
        }
        if let Some(key) = key {
            self.forget_pending_start(provider, key).await;
        }
    }

    async fn forget_pending_start(&self, provider: &str, key: &str) {
        if let Err(error) = self.store.remove_pending_start(provider, key).await {
            tracing::warn!(provider, key, %error, "a pending start could not be removed: the next restart's reconcile will");
        }
    }

    /// Persist a start's kv changes that no record will carry.
    async fn persist_unrecorded(&self, provider: &str, writes: KvWrites) {
        let Some(kv) = self.registry.capabilities().kv() else { return };
        if let Err(error) = kv.persist(writes).await {
            tracing::error!(provider, %error, "kv changes of a refused start not persisted");
        }
    }

    /// HostPreparer, when the network info hangs off host bridges.
    async fn prepare_host(&self, params: &StartInstanceParams, hooks: &CallHooks) -> Result<(), BrokerServiceError> {
        if params.network_info.iter().all(|i| i.parent_interface_name.is_empty()) {
            return Ok(());
        }
        let network = self.registry.capabilities().network().ok_or_else(|| BrokerServiceError::NoNetwork)?;
        let preparer = HostPreparer {
            lock: &self.machine_lock,
            network: &*network,
            sink: &*self.store,
            host_bridges: &self.host.bridges,
            lock_timeout: None,
        };
        preparer.prepare(&params.network_info, hooks.abort.clone()).await?;
        Ok(())
    }

    /// Stop instances of one provider; unknown ids are ignored. The records
    /// are marked first, so a stop cut short by the host's end is finished by
    /// the reconcile after its restart.
    #[tracing::instrument(skip(self, ids), fields(instance_ids = ?ids))]
    pub async fn stop_instances(&self, provider: &str, ids: &[String]) -> Result<(), BrokerServiceError> {
        let wasm = self.registry.get(provider).await?;
        let flying = self.in_flight.call(provider);
        ids.iter().for_each(|id| flying.note(id));
        self.store.mark_stopping(provider, ids).await?;
        wasm.stop_instances(&CallHooks::default(), ids).await?;
        self.store.remove_instances(provider, ids).await?;
        Ok(())
    }

    /// `broker provider call` on a registered provider: one method that
    /// changes nothing the host records (`describe`, `validate-config`,
    /// `all-instances`), its answer as JSON, redacted of the provider's secrets.
    #[tracing::instrument(skip(self, params), fields(method = %method))]
    pub async fn call_provider(
        &self,
        provider: &str,
        method: crate::manifest::Method,
        params: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, BrokerServiceError> {
        use crate::version::by_name::{ByNameError, call_by_name};
        if !method.is_read_only() {
            return Err(BrokerServiceError::Recorded(method));
        }
        let wasm = self.registry.get(provider).await?;
        match call_by_name(&wasm, method, params, &CallHooks::default()).await {
            Ok(answer) => Ok(answer),
            Err(ByNameError::Call(call)) => Err(call.into()),
            Err(refused) => Err(BrokerServiceError::ByName(refused)),
        }
    }

    /// The provider's `maintain-instance` on `id`, with the params recorded at its start (empty if none).
    #[tracing::instrument(skip(self, id), fields(instance_id = %id))]
    pub async fn maintain_instance(&self, provider: &str, id: &str) -> Result<(), BrokerServiceError> {
        let wasm = self.registry.get(provider).await?;
        let params =
            self.store.instance(provider, id)?.and_then(|r| r.params).map_or_else(empty_params, |params| *params);
        wasm.maintain_instance(&CallHooks::default(), id, &params).await?;
        Ok(())
    }

    /// The provider's `maintain-instance` on `id` with `params` (those recorded
    /// at its start, read by the caller: a reconcile reads them a page at a
    /// time); what it changed in its kv is made durable apart (see
    /// [`ProviderVersion::maintain_instance_durable_apart`]).
    ///
    /// [`ProviderVersion::maintain_instance_durable_apart`]: crate::version::ProviderVersion::maintain_instance_durable_apart
    pub(crate) async fn maintain_durable_apart(
        &self,
        provider: &str,
        id: &str,
        params: &broker_capabilities::bindings::StartInstanceParams,
    ) -> Result<crate::version::Durable, BrokerServiceError> {
        let wasm = self.registry.get(provider).await?;
        Ok(wasm.maintain_instance_durable_apart(&CallHooks::default(), id, params).await?)
    }

    /// The provider to stop `id` through: the one it is recorded for, else
    /// the one provider that reports it (an instance the host has no record
    /// of: started before a crash recorded it, or its record lost); `None`
    /// when nobody knows it.
    pub async fn owner_for_stop(&self, id: &str) -> Result<Option<String>, BrokerServiceError> {
        match self.provider_of(id) {
            Ok(owner) => return Ok(Some(owner)),
            Err(BrokerServiceError::UnknownInstance(_)) => {}
            Err(failed) => return Err(failed),
        }
        // Every provider asked at once; one that cannot answer may be the
        // owner, so "nobody has it" is said only when all of them answered.
        let names: Vec<String> = self.registry.list()?.into_iter().map(|p| p.name).collect();
        let answers = futures_util::future::join_all(names.iter().map(async |name| {
            let wasm = self.registry.get(name).await?;
            Ok::<_, BrokerServiceError>(wasm.all_instances(&CallHooks::default()).await?)
        }))
        .await;
        let mut reporting = Vec::new();
        for (name, answer) in names.iter().zip(answers) {
            match answer {
                Ok(live) if live.iter().any(|instance| instance.id == id) => reporting.push(name.clone()),
                Ok(_) | Err(BrokerServiceError::Registry(RegistryError::Removing(_))) => {}
                Err(failed) => return Err(failed),
            }
        }
        match reporting.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(one.clone())),
            _ => Err(BrokerServiceError::AmbiguousInstance { id: id.to_owned(), providers: reporting.join(", ") }),
        }
    }

    /// The provider that owns a recorded instance id.
    pub fn provider_of(&self, id: &str) -> Result<String, BrokerServiceError> {
        // The id index holds one owner per id (the store refuses a second).
        self.store.owner_of(id)?.ok_or_else(|| BrokerServiceError::UnknownInstance(id.to_owned()))
    }

    /// What the providers report, joined with the host's records, in order of
    /// provider and id: live status from `all-instances`; records the provider
    /// no longer reports show as `unknown`, and instances the host never
    /// recorded appear without hardware. Listing every provider asks them all
    /// at once, and one that fails to answer fails no other: its records show
    /// as `unknown`, its error named. Asked for one provider, its failure is
    /// the answer (the API's 502 or 503; the CLI then lists its records as the
    /// listing of all does).
    pub async fn list_instances(&self, provider: Option<&str>) -> Result<Vec<InstanceRecord>, BrokerServiceError> {
        if let Some(name) = provider {
            // Asked by name: its answer, or why there is none.
            return self.provider_instances(name).await;
        }
        // In name order, each provider's records in id order: the answer is
        // sorted without sorting it.
        let mut names: Vec<String> = self.registry.list()?.into_iter().map(|p| p.name).collect();
        names.sort_unstable();
        let answers = futures_util::future::join_all(names.iter().map(|name| self.provider_instances(name))).await;
        let mut out = Vec::new();
        for (name, answer) in names.iter().zip(answers) {
            match answer {
                Ok(records) => out.extend(records),
                // Being removed, so it has no recorded instances; listing all is not its business.
                Err(BrokerServiceError::Registry(RegistryError::Removing(_))) => {}
                Err(failed) => {
                    let mut records = self.records_of(name).await?;
                    Broker::unanswered(name, &failed, &mut records);
                    out.extend(records);
                }
            }
        }
        Ok(out)
    }

    /// One provider's instances, in id order: what it reports joined with the
    /// host's records (a merge of the two, each in id order); an error when it
    /// cannot answer. What acts on the answer (a group's convergence, InfraKit's
    /// `DescribeInstances`) asks this, not [`Broker::list_instances`]: a record
    /// shown `unknown` because its provider did not answer is not a lost instance.
    pub async fn provider_instances(&self, name: &str) -> Result<Vec<InstanceRecord>, BrokerServiceError> {
        let wasm = self.registry.get(name).await?;
        // The records are read while the provider answers.
        let hooks = CallHooks::default();
        let (live, records) = tokio::join!(wasm.listed_instances(&hooks), self.records_of(name));
        self.joined(name, crate::version::in_id_order(live?), records?)
    }

    /// What provider `name` lists joined with its records, both in id order:
    /// a record it does not list shows as `unknown`, an instance it lists
    /// that the host never recorded shows without hardware (if its id is
    /// one the host may show: see [`Broker::screen_reported`]).
    pub(super) fn joined(
        &self,
        name: &str,
        live: Vec<ListedInstance>,
        records: Vec<InstanceRecord>,
    ) -> Result<Vec<InstanceRecord>, BrokerServiceError> {
        // Only an id no record of this provider's holds needs screening (a
        // recorded id was screened when it was recorded): invalid, or another's.
        let mut unrecorded_ids = Vec::new();
        let mut at = 0;
        for listed in &live {
            let id = &listed.instance.id;
            while records.get(at).is_some_and(|record| record.id < *id) {
                at += 1;
            }
            if records.get(at).is_none_or(|record| record.id != *id) {
                unrecorded_ids.push(listed.clone());
            }
        }
        let (unrecorded_kept, refused) = self.screen_reported(name, unrecorded_ids)?;
        if let Some(first) = refused.first() {
            // One line however many: a provider decides how many it reports.
            let count = refused.len();
            tracing::warn!(provider = %name, count, first = %first, "dropped instances the provider reported");
        }
        let not_reported = |mut missing: InstanceRecord| {
            missing.status = "unknown".into();
            missing.message = "not reported by the provider".into();
            missing
        };
        let mut out = Vec::with_capacity(live.len().max(records.len()));
        let mut kept = unrecorded_kept.into_iter().peekable();
        let mut records = records.into_iter().peekable();
        for ListedInstance { instance, .. } in &live {
            out.extend(std::iter::from_fn(|| records.next_if(|r| r.id < instance.id)).map(not_reported));
            if let Some(mut record) = records.next_if(|r| r.id == instance.id) {
                record.status = status_name(instance.status).to_owned();
                record.message = reported(&instance.message, MAX_REPORTED_MESSAGE_BYTES);
                out.push(record);
            } else if let Some(kept) = kept.next_if(|k| k.instance.id == instance.id) {
                out.push(unrecorded(name, &kept));
            }
        }
        out.extend(records.map(not_reported));
        Ok(out)
    }

    /// A provider's records, in id order (the store's key order), read off
    /// the async workers: thousands of them take milliseconds.
    pub(crate) async fn records_of(&self, name: &str) -> Result<Vec<InstanceRecord>, StoreError> {
        self.records_after(name, &None, usize::MAX).await
    }

    /// At most `limit` of provider `name`'s records after `after`, in id
    /// order, read off the async workers.
    pub(super) async fn records_after(
        &self,
        name: &str,
        after: &Option<String>,
        limit: usize,
    ) -> Result<Vec<InstanceRecord>, StoreError> {
        let (store, name, after) = (self.store.clone(), name.to_owned(), after.clone());
        tokio::task::spawn_blocking(move || store.instances_after(&name, after.as_deref(), limit))
            .await
            .map_err(|_| StoreError::ReadPanicked)?
    }

    /// Why provider `name` did not answer the listing of all (it is warned
    /// of), and its `records` as that listing shows them: `unknown`, with why.
    pub(super) fn unanswered(name: &str, failed: &BrokerServiceError, records: &mut [InstanceRecord]) {
        let why = broker_capabilities::error_text::error_text(failed);
        tracing::warn!(provider = %name, error = %why, "a provider did not answer the listing of all");
        for record in records {
            record.status = "unknown".into();
            record.message = format!("provider {name} did not answer: {why}");
        }
    }

    /// Split what a provider's `all-instances` reported into the instances the
    /// host takes and, for the others, why not: an id that is not a valid id
    /// ([`instance_id_problem`]), or one recorded for another provider and not for
    /// this one. Those are dropped (and the caller warns) rather than failing the
    /// whole answer: one bad entry must not hide the provider's other instances,
    /// nor every other provider's in a listing of all, and it could be neither
    /// shown safely nor acted on.
    pub(crate) fn screen_reported(
        &self,
        provider: &str,
        live: Vec<ListedInstance>,
    ) -> Result<(Vec<ListedInstance>, Vec<String>), BrokerServiceError> {
        // The id index: one lookup per id, whatever the host records.
        let owners = self.store.owners_of(live.iter().map(|i| i.instance.id.as_str()))?;
        let (mut kept, mut refused) = (Vec::with_capacity(live.len()), Vec::new());
        for listed in live {
            let id = &listed.instance.id;
            let why = match instance_id_problem(id) {
                Some(problem) => Some(problem),
                None => match owners.get(id) {
                    Some(owner) if owner != provider => Some(format!("it is recorded for provider {owner}")),
                    _ => None,
                },
            };
            match why {
                Some(why) => refused.push(format!("{} ({why})", id_for_message(id))),
                None => kept.push(listed),
            }
        }
        Ok((kept, refused))
    }
}

/// Armed while a kv-only provider's start runs: dropped with the call (the
/// guard is forgotten once the call answers), it leaves a pending start with
/// the id the guest claimed, so the restart's reconcile adopts the instance
/// whose kv changes the dropped call persists.
struct AbandonedStart<'a> {
    store: &'a Store,
    provider: &'a str,
    params: &'a StartInstanceParams,
    /// `None`: the provider's starts are made pending before the call already.
    claimed: Option<&'a std::sync::Mutex<Option<String>>>,
}

impl Drop for AbandonedStart<'_> {
    fn drop(&mut self) {
        let Some(claimed) = self.claimed else { return };
        let Some(id) = claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() else { return };
        tracing::warn!(provider = self.provider, instance_id = %id_for_message(&id), "a start was dropped midway: pending until the next restart's reconcile");
        let start = crate::store::PendingStart { claimed: Some(id), ..pending_start(self.store, self.params) };
        self.store.put_pending_start_detached(self.provider, &start);
    }
}

/// What the host records before asking `params`' start of a provider.
fn pending_start(store: &Store, params: &StartInstanceParams) -> crate::store::PendingStart {
    crate::store::PendingStart {
        session: store.session(),
        started: now_rfc3339(),
        nonce: params.instance_config.as_ref().map(|ic| ic.machine_nonce.clone()).unwrap_or_default(),
        claimed: None,
        params: params.clone(),
    }
}

/// The most zones of one provider the host tries a start in after the first.
const MAX_PLACEMENT_ZONES: usize = 16;

/// The provider answered that this zone cannot take the instance now.
fn zone_unavailable(failed: &BrokerServiceError) -> bool {
    matches!(failed, BrokerServiceError::Call(CallError::Guest { error: BrokerError::ZoneUnavailable(_), .. }))
}

/// The machine's lock in `data_dir`, as this host (agent `broker`) takes it.
pub fn machine_lock(data_dir: &Path) -> Result<MachineLock, LockError> {
    MachineLock::new(data_dir, "machine-lock", "broker")
}

/// An instance the provider lists and the host did not record: shown with
/// what the provider says of it, but never a group's member (its tags are
/// the provider's word, not the host's record of a start).
fn unrecorded(provider: &str, listed: &ListedInstance) -> InstanceRecord {
    let instance = &listed.instance;
    InstanceRecord {
        id: instance.id.clone(),
        provider: provider.to_owned(),
        status: status_name(instance.status).to_owned(),
        message: reported(&instance.message, MAX_REPORTED_MESSAGE_BYTES),
        display_name: reported(&listed.display_name, MAX_REPORTED_WORD_BYTES),
        hardware: listed.hardware.as_ref().map(Hardware::from).unwrap_or_default(),
        tags: Vec::new(),
        addresses: (instance.addresses.iter().take(MAX_REPORTED_ENTRIES))
            .map(|a| reported(&a.value, MAX_REPORTED_WORD_BYTES))
            .collect(),
        created: String::new(),
        instance_tags: Default::default(),
        params: None,
    }
}

/// The cursor of `record` in a listing: `PROVIDER/ID` (a provider's name has no `/`).
pub fn cursor(record: &InstanceRecord) -> String {
    format!("{}/{}", record.provider, record.id)
}

/// A page of a listing sorted by provider, then id: the records after
/// `after` (a [`cursor`]), at most `limit` of them, and the cursor to ask for
/// the next page with if more remain.
pub fn page(
    records: Vec<InstanceRecord>,
    after: Option<&str>,
    limit: Option<usize>,
) -> (Vec<InstanceRecord>, Option<String>) {
    let start = match after.and_then(|after| after.split_once('/')) {
        Some((provider, id)) => records.partition_point(|r| (r.provider.as_str(), r.id.as_str()) <= (provider, id)),
        None => 0,
    };
    let mut page: Vec<InstanceRecord> = records.into_iter().skip(start).collect();
    let next = match limit {
        Some(limit) if page.len() > limit => {
            page.truncate(limit);
            page.last().map(cursor)
        }
        _ => None,
    };
    (page, next)
}
