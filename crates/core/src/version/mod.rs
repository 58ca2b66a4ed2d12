//! One loaded version of a provider component: the wasm adapter, its warm
//! instance pool, the call path (store limits, epoch deadline, trap
//! classification, the call's kv changes made durable), the crash breaker,
//! per-method outcomes, the import checks made at load, and what a call's
//! failure says.

pub mod breaker;
pub mod by_name;
mod errors;
mod exports;
pub mod imports;
pub mod method_stats;

pub use errors::CallError;
pub(crate) use errors::describe_broker_error;

use crate::manifest::{Isolation, Manifest, ManifestError, Method};
use crate::runtime::turnstile::{FIRST_SLICE_TICKS, Lane};
use crate::runtime::{HostCapabilities, HostState, ProviderCapabilities, Runtime, RuntimeError};
use broker_capabilities::bindings::{
    BrokerError, HardwareCharacteristics, Instance, InstanceId, InstancePage, ListedInstance, PageRequest,
    ProviderInfo, StartInstanceParams, StartInstanceResult,
};
use broker_capabilities::quotas::{Quota, Quotas};
use broker_capabilities::rooms::LoadSetup;
use broker_capabilities::rooms::context::{CallContext, CallHooks};
use broker_capabilities::rooms::kv::{Kv, KvWrites};
use exports::{Exports, ExportsPre, Listing};
use method_stats::Outcome;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;
use wasmtime::component::Resource;
use wasmtime::{CallHook, Store, UpdateDeadline};

/// Why a provider version could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The manifest or its component could not be read or does not verify.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The component did not compile.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// Its imports or exports do not fit this host and the manifest's grants.
    #[error("provider {provider}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Contract {
        /// The provider being loaded.
        provider: String,
        /// The offending import or missing export.
        cause: imports::ContractError,
    },
    /// wasmtime could not link or pre-instantiate it.
    #[error("provider {provider}: cannot link component: {}", broker_capabilities::error_text::cause_text(&**.cause))]
    Link {
        /// The provider being loaded.
        provider: String,
        /// wasmtime's error.
        cause: crate::runtime::BoxError,
    },
    /// A room could not make its grant ready (programs looked up and confined).
    #[error("provider {provider}: {}", broker_capabilities::error_text::cause_text(&**.cause))]
    Prepare {
        /// The provider being loaded.
        provider: String,
        /// The room's error.
        cause: crate::runtime::BoxError,
    },
    /// Its data dir could not be created.
    #[error("provider {provider}: cannot make its data dir {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    DataDir {
        /// The provider being loaded.
        provider: String,
        /// The data dir on the host.
        path: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// Its data dir's own filesystem could not be made ready.
    #[error(transparent)]
    DataFs(#[from] broker_capabilities::data_fs::DataFsError),
    /// A secret its manifest names could not be read.
    #[error("provider {provider}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Secret {
        /// The provider being loaded.
        provider: String,
        /// Which secret, and why.
        cause: broker_capabilities::secrets::SecretError,
    },
    /// Its manifest or component lies in a data dir, which a provider can write.
    #[error("provider {provider}: {reason}")]
    InDataDir {
        /// The provider being loaded.
        provider: String,
        /// Which file, in whose data dir.
        reason: String,
    },
}

/// A call's kv changes on their way to the state file: resolves once they are durable.
pub type Durable = futures_util::future::BoxFuture<'static, Result<(), CallError>>;

/// The `maintain-instance` export on `id` with `params`: for the call that
/// waits for its kv changes and the one that leaves them to commit apart.
fn invoke_maintain_instance(
    id: &str,
    params: &StartInstanceParams,
) -> impl for<'a> FnOnce(&'a mut Store<HostState>, &'a Exports, Resource<CallContext>) -> CallFuture<'a, ()> {
    let (id, params) = (id.to_owned(), params.clone());
    move |store, exports, ctx| Box::pin(async move { exports.maintain_instance(store, &ctx, id, params).await })
}

/// Who persists the kv changes a call leaves for its end.
#[derive(Clone, Copy)]
enum Writes {
    /// The call, before it answers.
    Persist,
    /// The caller, if the call succeeds (else the call, as with `Persist`).
    LeaveToCaller,
}

/// A warm guest instance.
struct Warm {
    store: Store<HostState>,
    exports: Exports,
    calls: u64,
    born: Instant,
}

/// Counters a test or the metrics can read.
#[derive(Debug, Default)]
pub struct ProviderStats {
    /// Calls this version began (each is answered by this version alone).
    pub calls: AtomicU64,
    /// Fresh guest instances made (one per call under per-call isolation).
    pub instantiations: AtomicU64,
    pub(crate) discarded: AtomicU64,
    /// Outcomes and latency per method.
    pub methods: method_stats::MethodTable,
    /// What the provider's bounds refused or cut.
    pub quotas: Arc<Quotas>,
    /// Turns of executor time its long-running guests took (see `runtime::turnstile`).
    pub turns: Arc<AtomicU64>,
}

type CallFuture<'a, R> = Pin<Box<dyn Future<Output = wasmtime::Result<Result<R, BrokerError>>> + Send + 'a>>;

/// One loaded version of a provider component.
pub struct ProviderVersion {
    name: Arc<str>,
    manifest: Manifest,
    sha256: String,
    runtime: Arc<Runtime>,
    pre: ExportsPre,
    capabilities: ProviderCapabilities,
    /// Its config as the guest gets it, secrets filled in; and their redactor.
    config: Arc<broker_capabilities::secrets::ProviderConfig>,
    pool: Mutex<Vec<Warm>>,
    stats: Arc<ProviderStats>,
    breaker: breaker::Breaker,
    /// One permit per call running (`max-concurrent-calls`).
    running: tokio::sync::Semaphore,
    /// Its way to the runtime's turnstile, for calls that run long.
    lane: Lane,
    /// Its share of the engine's instance slots, until it is retired and drained.
    slots: Mutex<Option<crate::runtime::SlotReservation>>,
    /// Replaced or removed: it keeps no warm instances.
    retired: std::sync::atomic::AtomicBool,
    /// Callers using this version now (see [`Serving`]); a drain waits for none.
    in_flight: InFlight,
}

/// How many callers use a version, and a wake-up when none does.
#[derive(Default)]
struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// One caller's use of a loaded version, from the moment the registry hands
/// it out until it is dropped: what a removal's drain waits for. Holding the
/// `Arc` alone (a `/metrics` scrape, a retired version's counters) is not a use.
pub struct Serving {
    version: Arc<ProviderVersion>,
}

impl Serving {
    /// Counted from here: the registry takes it under the lock a removal takes to unload.
    pub fn enter(version: Arc<ProviderVersion>) -> Serving {
        version.in_flight.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Serving { version }
    }

    /// The version itself, to keep or compare.
    pub fn version(&self) -> &Arc<ProviderVersion> {
        &self.version
    }
}

impl std::ops::Deref for Serving {
    type Target = ProviderVersion;
    fn deref(&self) -> &ProviderVersion {
        &self.version
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let in_flight = &self.version.in_flight;
        if in_flight.count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            in_flight.idle.notify_waiters();
            // The last use of a retired version: its slots go back now.
            if self.version.retired.load(Ordering::SeqCst) {
                self.version.release_slots();
            }
        }
    }
}

/// A store's guest takes turns of executor time once it runs past its first
/// slice: at every epoch deadline it passes its turn on and waits for the
/// next (`runtime::turnstile`); back from a host call that lost its turn to
/// the sweeper, it waits for a turn before it runs wasm again.
fn take_turns(store: &mut Store<HostState>, first_slice: u64) {
    store.epoch_deadline_callback(|mut cx| Ok(UpdateDeadline::YieldCustom(1, cx.data_mut().turn.next_turn())));
    store.call_hook(|mut cx, hook| {
        match hook {
            CallHook::CallingHost => cx.data_mut().turn.entering_host(),
            CallHook::ReturningFromHost => {
                if cx.data_mut().turn.returning_from_host() {
                    cx.set_epoch_deadline(0);
                }
            }
            CallHook::CallingWasm | CallHook::ReturningFromWasm => {}
        }
        Ok(())
    });
    store.set_epoch_deadline(first_slice);
}

impl ProviderVersion {
    /// Read, verify, compile, check and link the manifest's component.
    pub fn load(
        runtime: Arc<Runtime>,
        manifest: Manifest,
        capabilities: HostCapabilities,
    ) -> Result<ProviderVersion, LoadError> {
        // Checked before anything is read: a provider can write its data dir.
        for loaded in [&manifest.path, &manifest.component] {
            crate::manifest::check_loadable(loaded, &capabilities.data_dirs)
                .map_err(|reason| LoadError::InDataDir { provider: manifest.name.clone(), reason })?;
        }
        // Its calls at once, and the warm instances kept between them.
        let limits = &manifest.limits;
        let pooled = if manifest.isolation == Isolation::Pooled { limits.pool_size } else { 0 };
        let slots = runtime.reserve(&manifest.name, limits.max_concurrent_calls + pooled)?;
        let (bytes, sha256) = manifest.read_component()?;
        let component = runtime.compile(&manifest.component, &bytes, &sha256)?;
        let provider = manifest.name.clone();
        let served = imports::check(runtime.engine(), &component, &manifest.grants)
            .map_err(|source| LoadError::Contract { provider: provider.clone(), cause: source })?;
        let linker = runtime
            .linker(&manifest.grants)
            .map_err(|e| LoadError::Link { provider: provider.clone(), cause: e.into_boxed_dyn_error() })?;
        let instance_pre = linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Link { provider: provider.clone(), cause: e.into_boxed_dyn_error() })?;
        let pre = ExportsPre::new(served, instance_pre)
            .map_err(|e| LoadError::Link { provider: provider.clone(), cause: e.into_boxed_dyn_error() })?;
        let config = broker_capabilities::secrets::ProviderConfig::load(
            &manifest.name,
            &manifest.config,
            &manifest.secrets,
            capabilities.secrets.clone(),
        )
        .map_err(|source| LoadError::Secret { provider: provider.clone(), cause: source })?;
        let config = Arc::new(config);
        let quotas = Arc::new(manifest.limits.quotas());
        let stats = Arc::new(ProviderStats { quotas, ..ProviderStats::default() });
        let capabilities = narrow(capabilities, &manifest, stats.quotas.clone(), config.redactor().clone())?;
        let running = tokio::sync::Semaphore::new(manifest.limits.max_concurrent_calls);
        let lane = runtime.turnstile().lane(stats.turns.clone());
        let breaker = breaker::Breaker::new(manifest.limits.breaker_failures, manifest.limits.breaker_window);
        Ok(ProviderVersion {
            name: provider.into(),
            config,
            manifest,
            sha256,
            runtime,
            pre,
            capabilities,
            pool: Mutex::new(Vec::new()),
            stats,
            breaker,
            running,
            lane,
            slots: Mutex::new(Some(slots)),
            retired: Default::default(),
            in_flight: InFlight::default(),
        })
    }

    /// No new calls come here (it was replaced or removed): its warm
    /// instances go now, and those its calls in flight use go as they end.
    /// Its instance slots go back to the host once nothing uses it: now, or
    /// when the last use ends (see `Serving`'s drop). Whoever still holds it
    /// only reads it.
    pub(crate) fn retire(&self) {
        {
            let mut pool = self.lock_pool();
            // Under the pool's lock, which `checkin` takes before looking at it.
            self.retired.store(true, Ordering::SeqCst);
            pool.clear();
        }
        // Read after `retired` is set, as the last use reads `retired` after
        // its count drops: one of the two sees the other.
        if self.in_flight() == 0 {
            self.release_slots();
        }
    }

    /// Give its instance slots back to the host (again is nothing).
    fn release_slots(&self) {
        drop(self.slots.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    /// Calls running now (each holds one of its `max-concurrent-calls`).
    pub fn calls_running(&self) -> usize {
        self.manifest.limits.max_concurrent_calls - self.running.available_permits()
    }

    /// Callers using this version now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Wait until no caller uses this version; false if some still did after `limit`.
    pub async fn drained(&self, limit: std::time::Duration) -> bool {
        let waiting = async {
            loop {
                // Registered before looking, so the last caller's wake-up is not missed.
                let idle = self.in_flight.idle.notified();
                if self.in_flight() == 0 {
                    return;
                }
                idle.await;
            }
        };
        tokio::time::timeout(limit, waiting).await.is_ok()
    }

    /// The provider's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The provider's data dir on the host (`/data` to the guest).
    pub fn data_dir(&self) -> &std::path::Path {
        &self.capabilities.data_dir
    }

    /// Whether its grants let it change anything outside the host's store
    /// (programs, devices, sockets, egress): then an instance it starts can
    /// outlive a start the host never recorded, and starts are made pending first.
    pub fn acts_outside_the_store(&self) -> bool {
        self.capabilities.acts_outside_the_store()
    }

    /// The manifest this version was loaded from (component path and pin as loaded).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// sha256 of the component bytes this version was loaded from.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// This version's counters, as `/metrics` reads them.
    pub fn stats(&self) -> &ProviderStats {
        &self.stats
    }

    /// The counters, to read after this version is gone (calls still on it keep counting).
    pub fn shared_stats(&self) -> Arc<ProviderStats> {
        self.stats.clone()
    }

    /// Warm instances waiting in the pool.
    pub fn pooled_instances(&self) -> usize {
        self.lock_pool().len()
    }

    /// The contract's `describe`: the provider's name, version and what it supports.
    pub async fn describe(&self) -> Result<ProviderInfo, CallError> {
        self.call(Method::Describe, &CallHooks::default(), |store, exports, _ctx| {
            Box::pin(async move { exports.describe(store).await.map(Ok) })
        })
        .await
    }

    /// Its config as its guest gets it (the manifest's `[config]` as JSON,
    /// `[secrets]` filled in): what `validate-config` is to be given.
    pub(crate) fn guest_config(&self) -> Arc<str> {
        self.config.for_guest()
    }

    /// Whether its `all-instances` answers a page at a time (0.3.0 on); an
    /// older provider answers every instance at once.
    pub fn lists_in_pages(&self) -> bool {
        self.pre.paged()
    }

    /// What hides its secrets' values in text the host shows.
    pub fn redactor(&self) -> &Arc<broker_capabilities::secrets::Redactor> {
        self.config.redactor()
    }

    /// The contract's `validate-config` on `config_json` (as [`ProviderVersion::guest_config`] gives it).
    pub async fn validate_config(&self, config_json: &str) -> Result<(), CallError> {
        let config = config_json.to_owned();
        self.call(Method::ValidateConfig, &CallHooks::default(), move |store, exports, _ctx| {
            Box::pin(async move { exports.validate_config(store, config).await })
        })
        .await
    }

    /// The contract's `start-instance`; its kv changes are durable before it returns.
    pub async fn start_instance(
        &self,
        hooks: &CallHooks,
        params: &StartInstanceParams,
    ) -> Result<StartInstanceResult, CallError> {
        self.start(hooks, params, Writes::Persist).await.map(|(started, _)| started)
    }

    /// As [`ProviderVersion::start_instance`], but a start that succeeds leaves
    /// its kv changes for the caller to persist (they are applied: every read
    /// sees them), so that they can commit with the host's record of the
    /// instance. Only [`KvDurability::CallEnd`] providers leave any.
    ///
    /// [`KvDurability::CallEnd`]: broker_capabilities::rooms::kv::KvDurability::CallEnd
    pub(crate) async fn start_instance_leaving_writes(
        &self,
        hooks: &CallHooks,
        params: &StartInstanceParams,
    ) -> Result<(StartInstanceResult, KvWrites), CallError> {
        self.start(hooks, params, Writes::LeaveToCaller).await
    }

    async fn start(
        &self,
        hooks: &CallHooks,
        params: &StartInstanceParams,
        writes: Writes,
    ) -> Result<(StartInstanceResult, KvWrites), CallError> {
        // Owned copies: the call future may only borrow the store.
        let params = params.clone();
        let (mut started, writes) = self
            .call_then(Method::StartInstance, hooks, writes, move |store, exports, ctx| {
                Box::pin(async move { exports.start_instance(store, &ctx, params).await })
            })
            .await?;
        // Its texts are kept and shown: never a secret of its own.
        let redactor = self.config.redactor();
        if !redactor.is_empty() {
            let described = (&mut started.instance, &mut started.display_name, started.hardware.as_mut());
            redact_described(redactor, described);
            started.config.iter_mut().for_each(|(_, value)| redactor.redact_string(value));
        }
        Ok((started, writes))
    }

    /// The contract's `stop-instances`; unknown ids are the provider's to ignore.
    pub async fn stop_instances(&self, hooks: &CallHooks, ids: &[InstanceId]) -> Result<(), CallError> {
        let ids = ids.to_vec();
        self.call(Method::StopInstances, hooks, move |store, exports, ctx| {
            Box::pin(async move { exports.stop_instances(store, &ctx, ids).await })
        })
        .await
    }

    /// The contract's `all-instances`: every instance the provider can see.
    /// More than `max-records` instances is refused as a limit.
    pub async fn all_instances(&self, hooks: &CallHooks) -> Result<Vec<Instance>, CallError> {
        Ok(self.listed_instances(hooks).await?.into_iter().map(|listed| listed.instance).collect())
    }

    /// As [`ProviderVersion::all_instances`], each instance with what else the
    /// provider lists of it (its hardware, zone and tags; 0.3.0 on): the pages
    /// of a paging provider asked for in one call, under one deadline.
    pub async fn listed_instances(&self, hooks: &CallHooks) -> Result<Vec<ListedInstance>, CallError> {
        let mut listed = self.call(Method::AllInstances, hooks, self.invoke_all_instances()).await?;
        self.redact_listed(&mut listed);
        Ok(listed)
    }

    /// One page of `all-instances`, of at most `size` (1 to [`LIST_PAGE_SIZE`])
    /// instances, from `cursor` (the previous page's `next`; none = the
    /// first). A provider of 0.2.0 or before answers every instance at once:
    /// the host cuts its page from that, in id order (its cursor is the page's
    /// last id), so each page costs a whole listing.
    pub async fn instances_page(
        &self,
        hooks: &CallHooks,
        cursor: Option<String>,
        size: u32,
    ) -> Result<InstancePage, CallError> {
        let page = PageRequest { cursor, size: size.clamp(1, LIST_PAGE_SIZE) };
        let max = self.manifest.limits.max_records;
        let mut answer = self
            .call(Method::AllInstances, hooks, move |store, exports, ctx| {
                Box::pin(async move {
                    let listing = match exports.all_instances(store, &ctx, &page).await? {
                        Ok(listing) => listing,
                        Err(refused) => return Ok(Err(refused)),
                    };
                    Ok(Ok(match listing {
                        Listing::Page(answer) => checked_page(&page, answer)?,
                        Listing::Whole(all) if all.len() > max => {
                            return Err(wasmtime::Error::new(TooManyRecords { answered: all.len(), max }));
                        }
                        Listing::Whole(all) => page_of_whole(all, &page),
                    }))
                })
            })
            .await?;
        self.redact_listed(&mut answer.instances);
        Ok(answer)
    }

    /// Their texts are kept and shown: never a secret of its own.
    fn redact_listed(&self, listed: &mut [ListedInstance]) {
        let redactor = self.config.redactor();
        if !redactor.is_empty() {
            for listed in listed {
                redact_described(redactor, (&mut listed.instance, &mut listed.display_name, listed.hardware.as_mut()));
                listed.tags.iter_mut().for_each(|(_, value)| redactor.redact_string(value));
            }
        }
    }

    /// The `all-instances` export, every page of it, its answer held to
    /// `max-records`: for a call and for the half-open re-observe alike.
    fn invoke_all_instances(
        &self,
    ) -> impl for<'a> FnOnce(
        &'a mut Store<HostState>,
        &'a Exports,
        Resource<CallContext>,
    ) -> CallFuture<'a, Vec<ListedInstance>> {
        let max = self.manifest.limits.max_records;
        move |store, exports, ctx| {
            Box::pin(async move {
                // Asked for one more than it may hold, a provider past it says so on its first page.
                let size = u32::try_from(max.saturating_add(1)).unwrap_or(u32::MAX).min(LIST_PAGE_SIZE);
                let mut page = PageRequest { cursor: None, size };
                let mut listed = Vec::new();
                // An empty page that is not the last is allowed, endlessly not:
                // every page but the last moves the cursor, and there are at
                // most as many pages as instances it may hold, and one more.
                for _ in 0..=max {
                    let answer = match exports.all_instances(store, &ctx, &page).await? {
                        Ok(Listing::Page(answer)) => checked_page(&page, answer)?,
                        Ok(Listing::Whole(all)) => InstancePage { instances: all, next: None },
                        Err(refused) => return Ok(Err(refused)),
                    };
                    listed.extend(answer.instances);
                    if listed.len() > max {
                        return Err(wasmtime::Error::new(TooManyRecords { answered: listed.len(), max }));
                    }
                    match answer.next {
                        None => return Ok(Ok(listed)),
                        next => page.cursor = next,
                    }
                }
                Err(wasmtime::Error::new(PageRefused::Endless { pages: max + 1 }))
            })
        }
    }

    /// The contract's `maintain-instance` on instance `id`, with the params it was started with.
    pub async fn maintain_instance(
        &self,
        hooks: &CallHooks,
        id: &str,
        params: &StartInstanceParams,
    ) -> Result<(), CallError> {
        self.call(Method::MaintainInstance, hooks, invoke_maintain_instance(id, params)).await
    }

    /// As [`ProviderVersion::maintain_instance`], but what a call that succeeds
    /// changed in its kv is made durable apart: the answer is a future that
    /// resolves once it is, and the call's slot is free before that. A
    /// reconcile makes its next calls while these commit (one commit for many),
    /// and says an instance is maintained once its future has resolved. A
    /// failed call's changes are durable before it answers, as ever.
    pub async fn maintain_instance_durable_apart(
        &self,
        hooks: &CallHooks,
        id: &str,
        params: &StartInstanceParams,
    ) -> Result<Durable, CallError> {
        let invoke = invoke_maintain_instance(id, params);
        let ((), writes) = self.call_then(Method::MaintainInstance, hooks, Writes::LeaveToCaller, invoke).await?;
        // The call was counted when it answered; a commit that fails is counted too.
        let (durable, stats, began) =
            (self.durable(Method::MaintainInstance, writes), self.stats.clone(), Instant::now());
        Ok(Box::pin(async move {
            let outcome = durable.await;
            if outcome.is_err() {
                stats.methods.get(Method::MaintainInstance).observe(Outcome::Storage, began.elapsed());
            }
            outcome
        }))
    }

    /// Run one export on a warm or fresh instance under the method's deadline;
    /// what it changed in its kv is durable before the answer.
    async fn call<R, F>(&self, method: Method, hooks: &CallHooks, invoke: F) -> Result<R, CallError>
    where
        F: for<'a> FnOnce(&'a mut Store<HostState>, &'a Exports, Resource<CallContext>) -> CallFuture<'a, R>,
    {
        self.call_then(method, hooks, Writes::Persist, invoke).await.map(|(value, _)| value)
    }

    /// As [`ProviderVersion::call`]; with [`Writes::LeaveToCaller`], a call that
    /// succeeds hands back the kv changes it left unpersisted.
    async fn call_then<R, F>(
        &self,
        method: Method,
        hooks: &CallHooks,
        writes: Writes,
        invoke: F,
    ) -> Result<(R, KvWrites), CallError>
    where
        F: for<'a> FnOnce(&'a mut Store<HostState>, &'a Exports, Resource<CallContext>) -> CallFuture<'a, R>,
    {
        let span = tracing::debug_span!("provider_call", provider = &*self.name, method = method.name());
        let began = Instant::now();
        // Held to the call's end: one provider never runs more than its share.
        let _running = match self.admit(method).await {
            Ok(permit) => permit,
            Err(busy) => {
                self.observe(method, Outcome::Busy, began);
                return Err(busy);
            }
        };
        if self.breaker.is_half_open()
            && let Err(refused) = self.reobserve(method).await
        {
            self.observe(method, Outcome::Unavailable, began);
            return Err(refused);
        }
        let result = async {
            let (result, unpersisted) = self.run_call(method, hooks, invoke).await;
            match (result, writes) {
                (Ok(value), Writes::LeaveToCaller) => Ok((value, unpersisted)),
                // Whatever the outcome: every reader already sees these changes.
                (result, _) => {
                    // A failed persist is the answer, whatever the call's own was:
                    // the call's changes are seen but may not survive the host.
                    if let Err(failed) = self.durable(method, unpersisted).await {
                        if let Err(own) = &result {
                            tracing::warn!(provider = &*self.name, error = %own, "the call's own outcome, superseded");
                        }
                        return Err(failed);
                    }
                    result.map(|value| (value, KvWrites::new(self.name.clone())))
                }
            }
        }
        .instrument(span)
        .await;
        self.observe(method, Outcome::of(&result), began);
        result
    }

    /// A slot among the provider's `max-concurrent-calls`, waiting up to `queue-wait`.
    async fn admit(&self, method: Method) -> Result<tokio::sync::SemaphorePermit<'_>, CallError> {
        if let Ok(permit) = self.running.try_acquire() {
            return Ok(permit);
        }
        let limits = &self.manifest.limits;
        match tokio::time::timeout(limits.queue_wait, self.running.acquire()).await {
            Ok(Ok(permit)) => Ok(permit),
            // Timed out (the semaphore is never closed).
            _ => {
                self.stats.quotas.refused(Quota::Concurrency, 1);
                Err(CallError::Busy {
                    provider: self.name.to_string(),
                    method,
                    limit: limits.max_concurrent_calls,
                    waited: limits.queue_wait,
                })
            }
        }
    }

    /// What makes a call's kv changes durable: the state's kv hands them to
    /// its writer at once, so they commit even if the future is dropped.
    fn durable(&self, method: Method, writes: KvWrites) -> Durable {
        // A store given no kv wrote nothing to persist.
        let kv = match self.capabilities.host.kv() {
            Some(kv) if !writes.is_empty() => kv,
            _ => return Box::pin(std::future::ready(Ok(()))),
        };
        let (keys, name) = (writes.keys.len(), self.name.clone());
        let persisting = kv.persist(writes);
        Box::pin(async move {
            persisting.await.map_err(|source| {
                tracing::error!(provider = &*name, method = method.name(), keys, error = %source, "kv changes not persisted");
                CallError::Storage { provider: name.to_string(), method, cause: source }
            })
        })
    }

    fn observe(&self, method: Method, outcome: Outcome, began: Instant) {
        // One clock read for both: a call's clock reads are a measurable part of it.
        let now = Instant::now();
        self.stats.methods.get(method).observe(outcome, now.saturating_duration_since(began));
        // A read-only call that answered more than a bound lets it hold (a
        // listing past max-records) is refused, not a sign that the provider
        // is failing: tripping on it would refuse the stops that bring the
        // count back down.
        if method.is_read_only() && outcome == Outcome::Limit {
            return;
        }
        if self.breaker.record(outcome, now) {
            tracing::warn!(provider = &*self.name, policy = %self.breaker.describe(), "provider half-open");
        }
    }

    /// A half-open provider serves again only after an `all-instances` that
    /// answers; concurrent calls share one re-observe. Its first page is
    /// enough (one instance asked for): a provider that lists more than it
    /// may hold still answers, and the stops that bring it back within its
    /// bound must not wait on a whole listing that can never pass.
    async fn reobserve(&self, method: Method) -> Result<(), CallError> {
        let probe = || async {
            let began = Instant::now();
            let (probe, unpersisted) =
                self.run_call(Method::AllInstances, &CallHooks::default(), first_page_answers).await;
            let probe = match self.durable(Method::AllInstances, unpersisted).await {
                Ok(()) => probe,
                Err(failed) => Err(failed),
            };
            self.stats.methods.get(Method::AllInstances).observe(Outcome::of(&probe), began.elapsed());
            if probe.is_ok() {
                tracing::info!(provider = &*self.name, "all-instances re-observe passed; serving again");
            }
            probe.map(drop).map_err(|e| e.to_string())
        };
        self.breaker.reobserve(probe).await.map_err(|reason| CallError::Unavailable {
            provider: self.name.to_string(),
            method,
            reason: format!("{}; the all-instances re-observe failed: {reason}", self.breaker.describe()),
        })
    }

    /// Whether the crash policy holds this version half-open, and how often it tripped.
    pub fn breaker_state(&self) -> (bool, u64) {
        (self.breaker.is_half_open(), self.breaker.trips())
    }

    /// One call, and the kv changes its store left to persist at its end.
    async fn run_call<R, F>(&self, method: Method, hooks: &CallHooks, invoke: F) -> (Result<R, CallError>, KvWrites)
    where
        F: for<'a> FnOnce(&'a mut Store<HostState>, &'a Exports, Resource<CallContext>) -> CallFuture<'a, R>,
    {
        let mut unpersisted = KvWrites::new(self.name.clone());
        let result = self.run_on_instance(method, hooks, invoke, &mut unpersisted).await;
        (result, unpersisted)
    }

    async fn run_on_instance<R, F>(
        &self,
        method: Method,
        hooks: &CallHooks,
        invoke: F,
        unpersisted: &mut KvWrites,
    ) -> Result<R, CallError>
    where
        F: for<'a> FnOnce(&'a mut Store<HostState>, &'a Exports, Resource<CallContext>) -> CallFuture<'a, R>,
    {
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        // One budget for the method: instantiating a fresh instance spends from it.
        let deadline = self.manifest.limits.deadlines.for_method(method);
        // Admitted now: the clock read once for the deadline, the pool's ages and the log.
        let began = Instant::now();
        let until = began + deadline;
        let mut warm = self.checkout(method, deadline, began).await?;
        // A first slice, unless the provider's long-runners fill its lane: then
        // the call queues at once, as its slice would take a worker from
        // another provider. The deadline is the timeout around the call.
        warm.store.set_epoch_deadline(self.first_slice());
        warm.store.data_mut().begin_call(&hooks.abort);
        let context = CallContext {
            hooks: hooks.clone(),
            provider_config: self.config.for_guest(),
            redactor: self.config.redactor().clone(),
            quotas: self.stats.quotas.clone(),
        };
        let handle = warm.store.data_mut().table.push(context).map_err(|e| CallError::Instantiate {
            provider: self.name.to_string(),
            method,
            reason: format!("call context: {e}"),
        })?;
        let borrowed = Resource::<CallContext>::new_borrow(handle.rep());
        let outcome = {
            let Warm { store, exports, .. } = &mut warm;
            tokio::time::timeout_at(until.into(), invoke(store, exports, borrowed)).await
        };
        let _ = warm.store.data_mut().table.delete(handle);
        if warm.store.data_mut().end_call() {
            // The store given the turn waits where only this worker looks:
            // it runs before this call's teardown does.
            crate::runtime::turnstile::yield_once().await;
        }
        // Taken whatever the outcome (a trap or deadline too): reads already see them.
        *unpersisted = warm.store.data_mut().rooms.of::<Kv>().take_unpersisted();
        warm.calls += 1;
        let ended = Instant::now();
        tracing::debug!(elapsed_us = ended.saturating_duration_since(began).as_micros() as u64, "call finished");
        match outcome {
            Ok(Ok(Ok(value))) => {
                self.checkin(warm, ended);
                Ok(value)
            }
            Ok(Ok(Err(error))) => {
                self.checkin(warm, ended);
                // Logged, listed, kept in events: never more of it than a status message.
                let error = cut_broker_error(error, self.config.redactor());
                Err(CallError::Guest { provider: self.name.to_string(), method, error })
            }
            Ok(Err(trap)) => {
                let error = self.classify_trap(method, &warm, &trap);
                self.discard(warm, &error);
                Err(error)
            }
            Err(_elapsed) => {
                let error = CallError::Deadline { provider: self.name.to_string(), method, deadline };
                self.discard(warm, &error);
                Err(error)
            }
        }
    }

    fn classify_trap(&self, method: Method, warm: &Warm, trap: &wasmtime::Error) -> CallError {
        let provider = self.name.to_string();
        if let Some(limit) = warm.store.data().limiter.hit() {
            return CallError::Limit { provider, method, limit: limit.to_owned() };
        }
        if let Some(too_many) = trap.downcast_ref::<TooManyRecords>() {
            self.stats.quotas.refused(Quota::Records, 1);
            return CallError::Limit { provider, method, limit: too_many.to_string() };
        }
        // wasmtime's own error for it is private: its text is what says so.
        if format!("{trap:#}").contains(HOSTCALL_FUEL_EXHAUSTED) {
            self.stats.quotas.refused(Quota::CallData, 1);
            let limit = format!(
                "call-data-mib limit of {} MiB (data handed to the host in one host call or answer)",
                self.manifest.limits.call_data_mib
            );
            return CallError::Limit { provider, method, limit };
        }
        let reason = match trap.downcast_ref::<wasmtime::Trap>() {
            Some(code) => code.to_string(),
            None => format!("{trap:#}"),
        };
        CallError::Trap { provider, method, reason, stderr: warm.store.data().stderr_tail.lines() }
    }

    fn lock_pool(&self) -> std::sync::MutexGuard<'_, Vec<Warm>> {
        self.pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Ticks a call (or an instantiation) runs before it needs a turn: none
    /// while the provider's long-runners fill its lane, as its slice would
    /// take a worker from another provider.
    fn first_slice(&self) -> u64 {
        if self.lane.is_full() { 0 } else { FIRST_SLICE_TICKS }
    }

    /// A healthy warm instance from the pool (of an age under `max-age` at
    /// `now`), or a fresh one.
    async fn checkout(&self, method: Method, deadline: Duration, now: Instant) -> Result<Warm, CallError> {
        if self.manifest.isolation == Isolation::Pooled {
            let max_age = self.manifest.limits.max_age;
            loop {
                let candidate = self.lock_pool().pop();
                match candidate {
                    Some(warm) if now.saturating_duration_since(warm.born) < max_age => return Ok(warm),
                    Some(_) => {
                        self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                    }
                    None => break,
                }
            }
        }
        self.instantiate(method, deadline).await
    }

    async fn instantiate(&self, method: Method, deadline: Duration) -> Result<Warm, CallError> {
        let memory_bytes = (self.manifest.limits.memory_mib << 20) as usize;
        let state = HostState::new(self.name.clone(), &self.capabilities, memory_bytes, self.lane.store_turn());
        let mut store = Store::new(self.runtime.engine(), state);
        take_turns(&mut store, self.first_slice());
        store.limiter(|state| &mut state.limiter);
        // Strings and lists are copied out of the guest per host call and per
        // answer; this bounds what one such copy can make the host allocate.
        store.set_hostcall_fuel((self.manifest.limits.call_data_mib << 20) as usize);
        let instantiation = tokio::time::timeout(deadline, self.pre.instantiate_async(&mut store));
        let exports = match instantiation.await {
            Ok(Ok(exports)) => exports,
            Ok(Err(e)) => {
                let reason = format!("{e:#}");
                return Err(CallError::Instantiate { provider: self.name.to_string(), method, reason });
            }
            Err(_elapsed) => return Err(CallError::Deadline { provider: self.name.to_string(), method, deadline }),
        };
        self.stats.instantiations.fetch_add(1, Ordering::Relaxed);
        Ok(Warm { store, exports, calls: 0, born: Instant::now() })
    }

    /// Return a healthy instance to the pool unless its isolation, call count,
    /// age (at `now`) or the pool's size says to retire it.
    fn checkin(&self, warm: Warm, now: Instant) {
        let limits = &self.manifest.limits;
        let keep = self.manifest.isolation == Isolation::Pooled
            && warm.calls < limits.max_calls
            && now.saturating_duration_since(warm.born) < limits.max_age;
        if keep {
            let mut pool = self.lock_pool();
            if pool.len() < limits.pool_size && !self.retired.load(Ordering::SeqCst) {
                pool.push(warm);
                return;
            }
        }
        self.stats.discarded.fetch_add(1, Ordering::Relaxed);
    }

    /// Throw away an instance that trapped or hit a limit: it is never reused.
    fn discard(&self, warm: Warm, error: &CallError) {
        tracing::warn!(provider = &*self.name, error = %error, "discarding guest instance");
        self.stats.discarded.fetch_add(1, Ordering::Relaxed);
        drop(warm);
    }
}

/// Longest text kept of a provider's typed error.
const MAX_ERROR_BYTES: usize = 4096;

/// A provider's typed error with its text cut to [`MAX_ERROR_BYTES`].
fn cut_broker_error(error: BrokerError, redactor: &broker_capabilities::secrets::Redactor) -> BrokerError {
    // Hidden before it is cut: a secret across the cut would leave a part.
    let cut =
        |text: String| broker_capabilities::rooms::log::truncate(&redactor.redact(&text), MAX_ERROR_BYTES).to_owned();
    match error {
        BrokerError::InvalidParams(m) => BrokerError::InvalidParams(cut(m)),
        BrokerError::NotFound(m) => BrokerError::NotFound(cut(m)),
        BrokerError::NotSupported(m) => BrokerError::NotSupported(cut(m)),
        BrokerError::ZoneIndependent(m) => BrokerError::ZoneIndependent(cut(m)),
        BrokerError::ZoneUnavailable(m) => BrokerError::ZoneUnavailable(cut(m)),
        BrokerError::AccessDenied(m) => BrokerError::AccessDenied(cut(m)),
        BrokerError::Aborted(m) => BrokerError::Aborted(cut(m)),
        BrokerError::Timeout(m) => BrokerError::Timeout(cut(m)),
        BrokerError::Provider(m) => BrokerError::Provider(cut(m)),
    }
}

/// The texts a provider hands the host of an instance (a start's answer, a
/// listing's): kept and shown, so never a secret of its own.
fn redact_described(
    redactor: &broker_capabilities::secrets::Redactor,
    (instance, display_name, hardware): (&mut Instance, &mut String, Option<&mut HardwareCharacteristics>),
) {
    redactor.redact_string(&mut instance.message);
    redactor.redact_string(display_name);
    instance.addresses.iter_mut().for_each(|address| redactor.redact_string(&mut address.value));
    if let Some(h) = hardware {
        let words = [&mut h.arch, &mut h.root_disk_source, &mut h.availability_zone, &mut h.virt_type];
        words.into_iter().flatten().for_each(|word| redactor.redact_string(word));
        h.tags.iter_mut().flatten().for_each(|tag| redactor.redact_string(tag));
    }
}

/// What wasmtime says when a copy out of the guest ran out of hostcall fuel.
const HOSTCALL_FUEL_EXHAUSTED: &str = "fuel allocated for hostcalls has been exhausted";

/// Most instances the host asks a paging provider for in one page.
pub const LIST_PAGE_SIZE: u32 = 1000;
/// Longest cursor a provider may hand the host for its next page.
pub const MAX_CURSOR_BYTES: usize = 1024;

/// A page of `all-instances` that breaks the contract: the call is ended as
/// a trap is (its instance discarded), with this as the reason.
#[derive(Debug, thiserror::Error)]
enum PageRefused {
    #[error("it broke the contract: a page of {answered} instances, asked for at most {size}")]
    Overrun { answered: usize, size: u32 },
    #[error("it broke the contract: a next-page cursor of {0} bytes (at most {MAX_CURSOR_BYTES})")]
    LongCursor(usize),
    #[error("it broke the contract: the next page's cursor is the one it was asked with (it would never end)")]
    SameCursor,
    #[error("it broke the contract: a listing of more than {pages} pages, more than the instances it may list")]
    Endless { pages: usize },
}

/// `answer` to `asked`, if it keeps the contract: no more instances than
/// asked for, a cursor of bounded length that moves on from the one asked with.
fn checked_page(asked: &PageRequest, answer: InstancePage) -> wasmtime::Result<InstancePage> {
    if answer.instances.len() > asked.size as usize {
        return Err(wasmtime::Error::new(PageRefused::Overrun { answered: answer.instances.len(), size: asked.size }));
    }
    if let Some(next) = &answer.next {
        if next.len() > MAX_CURSOR_BYTES {
            return Err(wasmtime::Error::new(PageRefused::LongCursor(next.len())));
        }
        if asked.cursor.as_ref() == Some(next) {
            return Err(wasmtime::Error::new(PageRefused::SameCursor));
        }
    }
    Ok(answer)
}

/// What a provider listed, in id order, each id once (a provider that
/// lists one twice is answered as if it had not).
pub(crate) fn in_id_order(mut listed: Vec<ListedInstance>) -> Vec<ListedInstance> {
    // Stable: of an id listed twice, the first is kept, every time.
    listed.sort_by(|a, b| a.instance.id.cmp(&b.instance.id));
    listed.dedup_by(|a, b| a.instance.id == b.instance.id);
    listed
}

/// The page `asked` for of an older provider's whole answer: in id order,
/// after the cursor (the previous page's last id).
fn page_of_whole(all: Vec<ListedInstance>, asked: &PageRequest) -> InstancePage {
    let mut all = in_id_order(all);
    let from = asked.cursor.as_ref().map_or(0, |after| all.partition_point(|listed| listed.instance.id <= *after));
    let mut rest = all.split_off(from);
    let more = rest.len() > asked.size as usize;
    rest.truncate(asked.size as usize);
    let next = if more { rest.last().map(|listed| listed.instance.id.clone()) } else { None };
    InstancePage { instances: rest, next }
}

/// The re-observe: the first page of `all-instances`, one instance asked for,
/// answered and held to the contract as any page is (a provider of 0.2.0 or
/// before answers them all; whatever it is, the answer is dropped here).
fn first_page_answers<'a>(
    store: &'a mut Store<HostState>,
    exports: &'a Exports,
    ctx: Resource<CallContext>,
) -> CallFuture<'a, ()> {
    Box::pin(async move {
        let page = PageRequest { cursor: None, size: 1 };
        match exports.all_instances(store, &ctx, &page).await? {
            Ok(Listing::Page(answer)) => checked_page(&page, answer).map(|_| Ok(())),
            Ok(Listing::Whole(_)) => Ok(Ok(())),
            Err(refused) => Ok(Err(refused)),
        }
    })
}

/// An `all-instances` answer longer than `max-records`.
#[derive(Debug, thiserror::Error)]
#[error("max-records limit of {max} instances per answer ({answered} answered)")]
struct TooManyRecords {
    answered: usize,
    max: usize,
}

/// The host's capabilities as far as the manifest grants them: programs
/// resolved now, a data dir of its own. (A room's backend, the machine lock
/// among them, reaches a store only with its grant: see `rooms::Parts::new`.)
fn narrow(
    host: HostCapabilities,
    manifest: &Manifest,
    quotas: Arc<Quotas>,
    redactor: Arc<broker_capabilities::secrets::Redactor>,
) -> Result<ProviderCapabilities, LoadError> {
    let provider = manifest.name.clone();
    let data_dir = host.data_dirs.join(&manifest.name);
    let data_dir_error =
        |source| LoadError::DataDir { provider: provider.clone(), path: data_dir.display().to_string(), cause: source };
    private_dir(&host.data_dirs).and_then(|()| private_dir(&data_dir)).map_err(data_dir_error)?;
    // Before a room sets the dir's owner and ACLs: they belong on the mount.
    if let (Some(filesystems), mib @ 1..) = (&host.data_filesystems, manifest.limits.data_mib) {
        // Its programs that outlived a host may hold the dir: their files do not move under them.
        let children = host
            .backends
            .of::<broker_capabilities::rooms::process::Process>()
            .and_then(|backend| backend.children(&manifest.name).ok())
            .map_or(0, |names| names.len());
        filesystems.mount(&manifest.name, &data_dir, mib, children)?;
        // The filesystem's root (mkfs makes it 0755) is the data dir now.
        private_dir(&data_dir).map_err(data_dir_error)?;
    } else if let Some(filesystems) = &host.data_filesystems {
        filesystems.check_none(&manifest.name)?;
    }
    let rooms = &manifest.grants.rooms;
    let load = LoadSetup {
        provider: &manifest.name,
        data_dir: &data_dir,
        grants: &manifest.grants,
        sandbox: &host.sandbox,
        backends: &host.backends,
        programs: manifest.limits.programs(),
    };
    let prepared = rooms.prepare(&load).map_err(|source| LoadError::Prepare { provider, cause: source })?;
    Ok(ProviderCapabilities { host, data_dir, rooms: rooms.clone(), prepared, quotas, redactor })
}

/// Make `dir` (and its parents) if missing, and make it the host's alone
/// (0700, or the provider's user's ACL entry and no one else's): whatever
/// mode the operator gave `DATA_DIR`, no local user reads a provider's files.
/// The dir itself is changed, never a link in its place.
fn private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700).create(dir)?;
    let fd =
        rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?;
    broker_capabilities::sandbox::acl::make_private(&fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_providers_error_text_is_cut_and_keeps_its_kind() {
        let none = broker_capabilities::secrets::Redactor::default();
        let long = "é".repeat(MAX_ERROR_BYTES);
        let BrokerError::ZoneUnavailable(cut) = cut_broker_error(BrokerError::ZoneUnavailable(long), &none) else {
            panic!("the kind changed")
        };
        assert_eq!(cut.len(), MAX_ERROR_BYTES, "cut on a character boundary at the bound");
        assert_eq!(cut_broker_error(BrokerError::NotFound("x".into()), &none), BrokerError::NotFound("x".into()));
        // A secret the guest put in its error is hidden, whatever the kind.
        let secrets = broker_capabilities::secrets::Redactor::default();
        secrets.set(vec![("tok-s3cr3t-123".into(), "<secret api>".into())]);
        let said = BrokerError::AccessDenied("token tok-s3cr3t-123 refused".into());
        assert_eq!(cut_broker_error(said, &secrets), BrokerError::AccessDenied("token <secret api> refused".into()));
    }
}
