//! The providers this host runs: registered in the store, loaded on first use.

use crate::manifest::Manifest;
use crate::runtime::{HostCapabilities, Runtime};
use crate::store::{Event, EventKind, ProviderRecord, Store, StoreError, records::now_rfc3339};
use crate::version::CallError;
use crate::version::Serving;
use crate::version::{LoadError, ProviderVersion};
use broker_capabilities::rooms::process::{Process, stop_children};
use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Why a registration change or a lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// No provider is registered under this name.
    #[error("unknown provider {0:?} (see `broker provider list`)")]
    UnknownProvider(String),
    /// The name is taken by a provider registered from another manifest.
    #[error("provider {name:?} is already registered from {existing}; remove it first")]
    AlreadyRegistered {
        /// The provider.
        name: String,
        /// The manifest path it is registered from.
        existing: String,
    },
    /// Removal refused: the host still records instances of it.
    #[error("provider {name:?} still has {count} recorded instance(s); stop them first")]
    HasInstances {
        /// The provider.
        name: String,
        /// Instances recorded.
        count: usize,
    },
    /// Its `validate-config` refused the manifest's config.
    #[error("provider {name:?} rejected its config: {}", broker_capabilities::error_text::cause_text(.cause))]
    ConfigRejected {
        /// The provider.
        name: String,
        /// What the call returned.
        cause: CallError,
    },
    /// The provider version could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A call to the provider failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The host's store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The manifest path could not be resolved.
    #[error("cannot resolve manifest path {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Path {
        /// The path as given.
        path: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// A swap candidate's component could not be read or kept.
    #[error("cannot read candidate component {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Candidate {
        /// The candidate's path, or where it was to be kept.
        path: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The candidate failed a check; nothing changed.
    #[error("swap of {name:?} refused; version {serving} keeps serving: {reason}")]
    SwapRefused {
        /// The provider.
        name: String,
        /// The version that keeps serving.
        serving: String,
        /// Why, on one line (also the `swap-refused` event's detail).
        reason: String,
    },
    /// The provider is being removed and takes no new calls.
    #[error("provider {0:?} is being removed: it takes no new calls while those in flight finish")]
    Removing(String),
    /// Removal gave up: calls in flight outlasted the wait; the provider stays.
    #[error("provider {name:?} was not removed: its calls in flight did not finish within {waited:?}")]
    DrainTimeout {
        /// The provider.
        name: String,
        /// How long it waited: the longest deadline plus a slack.
        waited: std::time::Duration,
    },
    /// The manifest on disk grants more, or bounds less, than the one the operator approved.
    #[error(
        "provider {name:?}: its manifest {manifest} now asks for {grant}, which was not approved; add it again to approve (`broker provider add {manifest}`)"
    )]
    GrantsWidened {
        /// The provider.
        name: String,
        /// The manifest's path.
        manifest: String,
        /// Each room's first new grant, comma-separated.
        grant: String,
    },
    /// A swap candidate lies in a provider's data dir.
    #[error("{0}")]
    InDataDir(String),
}

/// What a swap replaced with what.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SwapReport {
    pub(crate) provider: String,
    /// The replaced component's SHA-256.
    pub old_sha256: String,
    /// The candidate's SHA-256.
    pub new_sha256: String,
    /// What the replaced component's `describe` reported.
    pub old_version: String,
    /// What the candidate's `describe` reported.
    pub new_version: String,
    /// The candidate passed the conformance scenarios before it was swapped in.
    pub checked: bool,
}

/// What a swap candidate must pass besides loading and `validate-config`
/// (`swap --check`: the conformance kit, given by the caller).
pub trait CandidateCheck: Send + Sync {
    /// The failures, one line each (empty: it passed); `Err` if it could not run.
    fn check<'a>(&'a self, manifest: &'a Manifest) -> BoxFuture<'a, Result<Vec<String>, String>>;
}

/// The registered providers and, for each, the version new calls get.
pub struct Registry {
    runtime: Arc<Runtime>,
    store: Arc<Store>,
    capabilities: HostCapabilities,
    /// What serves and what is being removed, under one lock that is never
    /// held across an await or the store's I/O.
    slots: Mutex<Slots>,
    /// Registration changes (add, swap, remove) commit one at a time: the
    /// store's record and the loaded version change together.
    changing: tokio::sync::Mutex<()>,
    /// One swap at a time, so two candidates cannot race for the slot.
    swapping: tokio::sync::Mutex<()>,
    swap_counts: SwapCounts,
    /// Versions replaced or removed lately, whose counters `/metrics` still shows.
    retired: std::sync::Mutex<Vec<Retired>>,
}

#[derive(Default)]
struct Slots {
    /// The version new calls get, per provider.
    loaded: HashMap<String, Arc<ProviderVersion>>,
    /// Providers being removed: they take no new calls while those in flight finish.
    draining: HashSet<String>,
    /// Removals so far: a first load that raced one is not kept.
    removals: u64,
}

/// A version no longer serving new calls: its counters, kept for a while so a
/// scrape after a swap still sees its last increments.
#[derive(Clone)]
pub struct Retired {
    /// The provider's name.
    pub name: String,
    /// The retired component's SHA-256.
    pub sha256: String,
    /// Its counters, as they were at the end.
    pub stats: Arc<crate::version::ProviderStats>,
    /// When it stopped taking new calls.
    pub since: std::time::Instant,
}

/// How long a removed provider's children get between TERM and KILL.
const CHILD_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a retired version's counters stay in `/metrics`: a few scrape intervals.
pub(crate) const RETIRED_METRICS_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// Swaps since this process started, for `/metrics` (the event log has them all).
#[derive(Debug, Default)]
pub struct SwapCounts {
    /// Candidates swapped in.
    pub swapped: AtomicU64,
    /// Candidates refused (failed to load, or failed their checks).
    pub refused: AtomicU64,
}

impl Registry {
    /// The host facilities every provider loaded here draws on.
    pub fn capabilities(&self) -> &HostCapabilities {
        &self.capabilities
    }

    pub(crate) fn new(runtime: Arc<Runtime>, store: Arc<Store>, capabilities: HostCapabilities) -> Self {
        Registry {
            runtime,
            store,
            capabilities,
            slots: Mutex::default(),
            changing: Default::default(),
            swapping: Default::default(),
            swap_counts: SwapCounts::default(),
            retired: Default::default(),
        }
    }

    /// Load and check a provider, run its `validate-config`, then register it.
    /// Re-adding from the same manifest reloads it.
    pub async fn add(&self, manifest_path: &Path) -> Result<ProviderRecord, RegistryError> {
        let path = std::fs::canonicalize(manifest_path)
            .map_err(|source| RegistryError::Path { path: manifest_path.display().to_string(), cause: source })?;
        let (_, text) = Manifest::load_with_text(&path).map_err(LoadError::from)?;
        self.add_read(&path, text).await
    }

    /// As [`Registry::add`], with the manifest's text as the caller read and
    /// checked it: what is applied is what was checked, whatever the file says
    /// by now. Parsed against the manifest's resolved path, as a restart will.
    pub(crate) async fn add_read(&self, manifest_path: &Path, text: String) -> Result<ProviderRecord, RegistryError> {
        let path = std::fs::canonicalize(manifest_path)
            .map_err(|source| RegistryError::Path { path: manifest_path.display().to_string(), cause: source })?;
        let manifest = Manifest::parse(&path, &text).map_err(LoadError::from)?;
        manifest.refuse_inline_secrets().map_err(LoadError::from)?;
        let approved_manifest = Some(text);
        let existing = self.store.provider(&manifest.name)?;
        if let Some(existing) = &existing
            && existing.manifest != path.display().to_string()
        {
            return Err(RegistryError::AlreadyRegistered { name: manifest.name, existing: existing.manifest.clone() });
        }
        let provider = self.load(manifest).await?;
        let info = provider.describe().await?;
        let record = ProviderRecord {
            name: provider.name().to_owned(),
            manifest: path.display().to_string(),
            component_sha256: provider.sha256().to_owned(),
            version: info.version,
            added: now_rfc3339(),
            component: None,
            approved_manifest,
        };
        let mut event =
            Event::new(if existing.is_some() { EventKind::Reloaded } else { EventKind::Added }, &record.name);
        event.old_sha256 = existing.as_ref().map(|e| e.component_sha256.clone());
        event.new_sha256 = Some(record.component_sha256.clone());
        event.new_version = Some(record.version.clone());
        event.old_version = existing.as_ref().map(|e| e.version.clone());
        let replaced = {
            // A removal either finished before this (and the provider is added
            // anew) or refuses it; it cannot run between the record and the slot.
            let _changing = self.changing.lock().await;
            if self.slots().draining.contains(&record.name) {
                return Err(RegistryError::Removing(record.name));
            }
            // Again, now that no other add can record a provider meanwhile: two adds at
            // once (the API, the watcher) each checked against the other's absence.
            if let Err(refused) = self.check_grant_placement(provider.manifest()) {
                if existing.is_none() {
                    // A provider never registered: what its load shared is taken back.
                    let sandbox = self.capabilities.sandbox.clone();
                    let name = record.name.clone();
                    let _ = tokio::task::spawn_blocking(move || sandbox.release(&name)).await;
                }
                return Err(refused);
            }
            self.store.put_provider(&record, &event).await?;
            self.slots().loaded.insert(record.name.clone(), provider)
        };
        if let Some(replaced) = replaced {
            self.retire(&replaced);
        }
        // A swapped-in copy is no longer what loads: the manifest's component is.
        if let Some(kept) = existing.and_then(|e| e.component) {
            let _ = std::fs::remove_file(kept);
        }
        Ok(record)
    }

    /// Compile, link and validate the config of a manifest's component.
    pub async fn load(&self, manifest: Manifest) -> Result<Arc<ProviderVersion>, RegistryError> {
        let name = manifest.name.clone();
        // Where it is loaded from first (the load checks it again): a manifest a
        // provider planted is refused as that, whatever it grants.
        for loaded in [&manifest.path, &manifest.component] {
            crate::manifest::check_loadable(loaded, &self.capabilities.data_dirs)
                .map_err(|reason| LoadError::InDataDir { provider: name.clone(), reason })?;
        }
        self.check_grant_placement(&manifest)?;
        let capabilities = self.capabilities.clone();
        let runtime = self.runtime.clone();
        // Compiling is CPU-bound: keep it off the async workers.
        let provider = tokio::task::spawn_blocking(move || ProviderVersion::load(runtime, manifest, capabilities))
            .await
            .map_err(|e| RegistryError::Path { path: name.clone(), cause: std::io::Error::other(e) })??;
        provider
            .validate_config(&provider.guest_config())
            .await
            .map_err(|source| RegistryError::ConfigRejected { name: name.clone(), cause: source })?;
        Ok(Arc::new(provider))
    }

    /// Refuse host paths granted where another party could replace them with
    /// a link, or that reach the host's own data dir ([`broker_capabilities::sandbox::granted::check_placement`]),
    /// against every registered provider's approved grants.
    fn check_grant_placement(&self, manifest: &Manifest) -> Result<(), RegistryError> {
        let of = |manifest: &Manifest| {
            let grant = manifest.grants.rooms.of::<Process>();
            let programs =
                broker_capabilities::rooms::process::ProcessPolicy::resolve(&grant.process, &[], Path::new("/"))
                    .map(|policy| policy.resolved_programs())
                    .unwrap_or_default();
            broker_capabilities::sandbox::granted::GrantedPaths {
                provider: manifest.name.clone(),
                read: grant.paths.iter().cloned().chain(programs).chain(grant.devices.iter().cloned()).collect(),
                write: grant.paths_rw.clone(),
            }
        };
        // Every registered provider, loaded or not (a CLI process loads none until asked),
        // as its approved manifest grants.
        let others: Vec<_> = self
            .store
            .providers()?
            .into_iter()
            .filter(|record| record.name != manifest.name)
            .filter_map(|record| Manifest::parse(Path::new(&record.manifest), &record.approved_manifest?).ok())
            .map(|other| of(&other))
            .collect();
        let data_dir = self.store.data_dir();
        let data_dir = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_owned());
        broker_capabilities::sandbox::granted::check_placement(&of(manifest), &others, &data_dir)
            .map_err(|source| LoadError::Prepare { provider: manifest.name.clone(), cause: Box::new(source) })?;
        Ok(())
    }

    /// Unregister a provider that has no recorded instances. New calls are
    /// refused at once; the ones in flight finish first (a start among them may
    /// record an instance, and then the provider stays).
    pub async fn remove(&self, name: &str) -> Result<(), RegistryError> {
        let count = self.store.instances(Some(name))?.len();
        if count > 0 {
            return Err(RegistryError::HasInstances { name: name.to_owned(), count });
        }
        if self.store.provider(name)?.is_none() {
            return Err(RegistryError::UnknownProvider(name.to_owned()));
        }
        let (_draining, unloaded) = {
            let _changing = self.changing.lock().await;
            let draining = Draining::begin(&self.slots, name)?;
            let mut slots = self.slots();
            slots.removals += 1;
            (draining, slots.loaded.remove(name))
        };
        // Uses of the version now, not holders of it (a metrics scrape holds it too).
        let in_flight = unloaded.as_ref().map_or(0, |p| p.in_flight());
        let restore = |provider: Option<Arc<ProviderVersion>>| {
            if let Some(provider) = provider {
                self.slots().loaded.insert(name.to_owned(), provider);
            }
        };
        if let Some(provider) = &unloaded {
            let waited = provider.manifest().limits.deadlines.longest() + DRAIN_SLACK;
            if !provider.drained(waited).await {
                restore(unloaded);
                return Err(RegistryError::DrainTimeout { name: name.to_owned(), waited });
            }
        }
        let count = self.store.instances(Some(name))?.len();
        if count > 0 {
            restore(unloaded);
            return Err(RegistryError::HasInstances { name: name.to_owned(), count });
        }
        // Nothing of the provider runs on once it is gone: its children neither.
        // Drained and draining, it records no instance now; stopped without the
        // registry's lock, which every add and swap waits for.
        let children = match self.capabilities.backends.of::<Process>() {
            Some(process) => stop_children(&*process, name, CHILD_STOP_GRACE).await.unwrap_or_else(|error| {
                tracing::warn!(provider = name, %error, "cannot list the removed provider's children to stop them");
                0
            }),
            None => 0,
        };
        let _changing = self.changing.lock().await;
        let count = self.store.instances(Some(name))?.len();
        if count > 0 {
            restore(unloaded);
            return Err(RegistryError::HasInstances { name: name.to_owned(), count });
        }
        // The taps, veths and bridges it made go with it, and their records.
        let devices = self.release_devices(name).await;
        let mut event = Event::new(EventKind::Removed, name);
        let mut detail = Vec::new();
        if in_flight > 0 {
            detail.push(format!("after {in_flight} call(s) in flight finished"));
        }
        if children > 0 {
            detail.push(format!("{children} child process(es) it left running stopped"));
        }
        detail.extend(devices);
        event.detail = detail.join("; ");
        if let Some(provider) = &unloaded {
            event.old_sha256 = Some(provider.sha256().to_owned());
        }
        if !self.store.remove_provider(name, &event).await? {
            return Err(RegistryError::UnknownProvider(name.to_owned()));
        }
        if let Some(provider) = &unloaded {
            self.retire(provider);
        }
        // What its user was given on host paths and devices is taken back.
        let sandbox = self.capabilities.sandbox.clone();
        let released = name.to_owned();
        let _ = tokio::task::spawn_blocking(move || sandbox.release(&released)).await;
        tracing::info!(provider = name, in_flight, "provider removed");
        Ok(())
    }

    /// Delete the network devices `name` made and drop their records, for its
    /// removal; what was done, for its event (each device it left, with why).
    async fn release_devices(&self, name: &str) -> Vec<String> {
        let Some(network) =
            self.capabilities.backends.of::<broker_capabilities::rooms::network_bridge::NetworkBridge>()
        else {
            return Vec::new();
        };
        match broker_capabilities::network::owners::release_provider(&*network, name).await {
            Ok(released) => {
                let mut said = Vec::new();
                if !released.deleted.is_empty() {
                    said.push(format!("network devices it made deleted: {}", released.deleted.join(", ")));
                }
                for left in released.left {
                    tracing::warn!(provider = name, device = %left, "a removed provider's network device was left");
                    said.push(format!("network device left: {left}"));
                }
                said
            }
            Err(error) => {
                tracing::warn!(provider = name, %error, "cannot delete the network devices of a removed provider");
                vec![format!("its network devices could not be deleted: {error}")]
            }
        }
    }

    /// Replace a provider's component while it serves: compile, link and
    /// type-check the candidate, run its `validate-config` on the live config
    /// and, given a `check` (`swap --check`: the conformance kit), that too;
    /// only then swap it in. Calls in flight finish on the version they
    /// started on; new calls get the candidate. A refused candidate changes nothing.
    pub async fn swap(
        &self,
        name: &str,
        component: &Path,
        check: Option<&dyn CandidateCheck>,
    ) -> Result<SwapReport, RegistryError> {
        let _one_at_a_time = self.swapping.lock().await;
        let record = self.store.provider(name)?.ok_or_else(|| RegistryError::UnknownProvider(name.to_owned()))?;
        let serving = self.get(name).await?;
        crate::manifest::check_loadable(component, &self.capabilities.data_dirs).map_err(RegistryError::InDataDir)?;
        // Reading, hashing and keeping the candidate: file I/O and CPU, off the async workers.
        let (path, components) = (component.to_owned(), self.store.data_dir().join("components"));
        let owned = name.to_owned();
        let (sha256, kept) = tokio::task::spawn_blocking(move || {
            let bytes = crate::manifest::read_regular_file(&path, crate::manifest::MAX_COMPONENT_BYTES)
                .map_err(|source| RegistryError::Candidate { path: path.display().to_string(), cause: source })?;
            let sha256 = hex::encode(Sha256::digest(&bytes));
            let kept = keep_component(&components, &owned, &sha256, &bytes)?;
            Ok::<_, RegistryError>((sha256, kept))
        })
        .await
        .map_err(|e| RegistryError::Candidate {
            path: component.display().to_string(),
            cause: std::io::Error::other(e),
        })??;
        let mut refusal = Event::new(EventKind::SwapRefused, name);
        refusal.old_sha256 = Some(serving.sha256().to_owned());
        refusal.new_sha256 = Some(sha256.clone());
        refusal.old_version = Some(record.version.clone());
        let refuse = async |reason: String| {
            // wasmtime's messages can span lines; an event is one line.
            let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
            if kept != serving.manifest().component {
                let _ = std::fs::remove_file(&kept);
            }
            let mut event = refusal.clone();
            event.detail = reason.clone();
            if let Err(e) = self.store.append_event(&event).await {
                tracing::warn!(provider = name, error = %e, "cannot record a refused swap");
            }
            self.swap_counts.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(provider = name, new_sha256 = %sha256, reason = %reason, "swap refused");
            RegistryError::SwapRefused { name: name.to_owned(), serving: record.version.clone(), reason }
        };

        let mut manifest = serving.manifest().clone();
        manifest.component = kept.clone();
        manifest.sha256 = Some(sha256.clone());
        let candidate = match self.load(manifest.clone()).await {
            Ok(candidate) => candidate,
            Err(err) => return Err(refuse(format!("candidate {}: {err}", component.display())).await),
        };
        let info = match candidate.describe().await {
            Ok(info) => info,
            Err(e) => return Err(refuse(format!("describe: {e}")).await),
        };
        if let Some(check) = check {
            match check.check(&manifest).await {
                Ok(failed) if failed.is_empty() => {}
                Ok(failed) => return Err(refuse(format!("check failed: {}", failed.join("; "))).await),
                Err(e) => return Err(refuse(format!("check: {e}")).await),
            }
        }

        let changing = self.changing.lock().await;
        // `remove` does not wait for a swap; a provider removed meanwhile stays removed.
        let removing = self.slots().draining.contains(name);
        if removing || self.store.provider(name)?.is_none_or(|now| now.added != record.added) {
            return Err(refuse("the provider was removed or re-added during the swap".into()).await);
        }
        let swapped = ProviderRecord {
            component_sha256: sha256.clone(),
            version: info.version.clone(),
            component: Some(kept.display().to_string()),
            ..record.clone()
        };
        let report = SwapReport {
            provider: name.to_owned(),
            old_sha256: serving.sha256().to_owned(),
            new_sha256: sha256,
            old_version: record.version,
            new_version: info.version,
            checked: check.is_some(),
        };
        let mut event = Event::new(EventKind::Swapped, name);
        event.old_sha256 = Some(report.old_sha256.clone());
        event.new_sha256 = Some(report.new_sha256.clone());
        event.old_version = Some(report.old_version.clone());
        event.new_version = Some(report.new_version.clone());
        self.store.put_provider(&swapped, &event).await?;
        self.slots().loaded.insert(name.to_owned(), candidate);
        drop(changing);
        self.retire(serving.version());
        self.swap_counts.swapped.fetch_add(1, Ordering::Relaxed);
        // The replaced copy in components/ is no longer what loads; calls still on
        // the old version run from memory, not from the file.
        let old = &serving.manifest().component;
        if *old != kept
            && old.parent() == kept.parent()
            && let Err(e) = std::fs::remove_file(old)
        {
            tracing::warn!(provider = name, path = %old.display(), error = %e, "cannot prune a replaced component");
        }
        tracing::info!(provider = name, old_sha256 = %report.old_sha256, new_sha256 = %report.new_sha256, "provider swapped");
        Ok(report)
    }

    /// A registered provider's manifest, with a swapped-in component in place of its own.
    fn manifest_of(record: &ProviderRecord) -> Result<Manifest, RegistryError> {
        let mut manifest = Manifest::load(Path::new(&record.manifest)).map_err(LoadError::from)?;
        if let Some(approved) = &record.approved_manifest {
            let approved = Manifest::parse(Path::new(&record.manifest), approved).map_err(LoadError::from)?;
            if let Some(grant) = manifest.widening(&approved) {
                return Err(RegistryError::GrantsWidened {
                    name: record.name.clone(),
                    manifest: record.manifest.clone(),
                    grant,
                });
            }
        }
        if let Some(component) = &record.component {
            manifest.component = PathBuf::from(component);
            manifest.sha256 = Some(record.component_sha256.clone());
        }
        Ok(manifest)
    }

    /// A registered provider's record and its manifest as it is now.
    pub fn show(&self, name: &str) -> Result<(ProviderRecord, Manifest), RegistryError> {
        let record = self.store.provider(name)?.ok_or_else(|| RegistryError::UnknownProvider(name.to_owned()))?;
        let manifest = Self::manifest_of(&record)?;
        Ok((record, manifest))
    }

    /// Every registered provider's record, as the store has it.
    pub fn list(&self) -> Result<Vec<ProviderRecord>, RegistryError> {
        Ok(self.store.providers()?)
    }

    /// As [`Registry::list`], as it may be shown: an approved manifest's
    /// inline secret-looking values (approved before they were refused) hidden.
    pub fn list_shown(&self) -> Result<Vec<ProviderRecord>, RegistryError> {
        let mut records = self.list()?;
        for record in &mut records {
            if let Some(text) = &mut record.approved_manifest {
                *text = broker_capabilities::secrets::hide_inline_in_manifest(text);
            }
        }
        Ok(records)
    }

    /// The version of `name` new calls get, loading it from its registered
    /// manifest if needed, as one use of it (see [`Serving`]): a removal waits
    /// for the uses handed out before it, and refuses new ones.
    pub async fn get(&self, name: &str) -> Result<Serving, RegistryError> {
        loop {
            let removals = {
                let slots = self.slots();
                if slots.draining.contains(name) {
                    return Err(RegistryError::Removing(name.to_owned()));
                }
                if let Some(provider) = slots.loaded.get(name) {
                    return Ok(Serving::enter(provider.clone()));
                }
                slots.removals
            };
            let record = self.store.provider(name)?.ok_or_else(|| RegistryError::UnknownProvider(name.to_owned()))?;
            let provider = self.load(Self::manifest_of(&record)?).await?;
            if provider.sha256() != record.component_sha256 {
                tracing::warn!(
                    provider = name,
                    registered = %record.component_sha256,
                    loaded = %provider.sha256(),
                    "component changed since it was registered"
                );
            }
            let mut slots = self.slots();
            if slots.draining.contains(name) {
                return Err(RegistryError::Removing(name.to_owned()));
            }
            // Loaded meanwhile by another first call, an add or a swap: that one serves.
            if let Some(provider) = slots.loaded.get(name) {
                return Ok(Serving::enter(provider.clone()));
            }
            // A removal finished while this loaded: the record read may be gone; look again.
            if slots.removals != removals {
                continue;
            }
            slots.loaded.insert(name.to_owned(), provider.clone());
            return Ok(Serving::enter(provider));
        }
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// Swaps done and refused since this process started.
    pub fn swap_counts(&self) -> &SwapCounts {
        &self.swap_counts
    }

    /// The versions loaded now, one per provider (the ones new calls get).
    pub fn loaded(&self) -> Vec<Arc<ProviderVersion>> {
        let mut providers: Vec<_> = self.slots().loaded.values().cloned().collect();
        providers.sort_by(|a, b| a.name().cmp(b.name()));
        providers
    }

    /// Versions retired within [`RETIRED_METRICS_FOR`], oldest first.
    pub fn retired(&self) -> Vec<Retired> {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.retain(|r| r.since.elapsed() < RETIRED_METRICS_FOR);
        retired.clone()
    }

    /// A version replaced or removed: its counters stay in the metrics a
    /// while, and its instance slots go back to the host once its calls in
    /// flight have ended (whoever still holds it only reads it).
    fn retire(&self, version: &ProviderVersion) {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.retain(|r| r.since.elapsed() < RETIRED_METRICS_FOR);
        retired.push(Retired {
            name: version.name().to_owned(),
            sha256: version.sha256().to_owned(),
            stats: version.shared_stats(),
            since: std::time::Instant::now(),
        });
        // Its slots go back once nothing uses it: a call may hold it past
        // every deadline (a start waiting for the machine lock).
        version.retire();
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How long past its longest deadline a removal waits for a provider's calls.
const DRAIN_SLACK: std::time::Duration = std::time::Duration::from_secs(5);

/// A provider's name in the draining set, for as long as this lives.
struct Draining<'a> {
    slots: &'a Mutex<Slots>,
    name: String,
}

impl<'a> Draining<'a> {
    fn begin(slots: &'a Mutex<Slots>, name: &str) -> Result<Self, RegistryError> {
        if !slots.lock().unwrap_or_else(|p| p.into_inner()).draining.insert(name.to_owned()) {
            return Err(RegistryError::Removing(name.to_owned()));
        }
        Ok(Draining { slots, name: name.to_owned() })
    }
}

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).draining.remove(&self.name);
    }
}

/// A candidate's bytes, kept in the data dir's `components/` under their hash,
/// so the swapped-in version is what loads after a restart.
fn keep_component(dir: &Path, name: &str, sha256: &str, bytes: &[u8]) -> Result<PathBuf, RegistryError> {
    // `sha256` was computed here from the bytes: 64 hex digits.
    let path = dir.join(format!("{name}-{}.wasm", &sha256[..16]));
    let io = |source| RegistryError::Candidate { path: path.display().to_string(), cause: source };
    if !path.exists() {
        std::fs::create_dir_all(dir).map_err(io)?;
        let staging = dir.join(format!(".{name}-{}.tmp", &sha256[..16]));
        std::fs::write(&staging, bytes).and_then(|_| std::fs::rename(&staging, &path)).map_err(io)?;
    }
    Ok(path)
}
