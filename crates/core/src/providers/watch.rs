//! The providers directory `broker serve` watches. A manifest dropped in
//! (`DIR/NAME.toml` or `DIR/NAME/provider.toml`) is added; its component
//! changed is swapped in (calls in flight finish on the old version); the
//! manifest itself changed is reloaded; the manifest removed unregisters the
//! provider once its calls in flight finish. Only providers registered from
//! this directory are touched. What cannot be done is an event
//! (`watch-refused`, `remove-refused`) and the version serving keeps serving.

use super::registry::{Registry, RegistryError};
use crate::manifest::Manifest;
use crate::store::{Event, EventKind};
use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// What a rescan did about one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A new manifest: the provider was registered.
    Added(String),
    /// Its component changed: the new one serves.
    Swapped(String),
    /// Its manifest changed (no grant widened): reloaded from it.
    Reloaded(String),
    /// Its manifest is gone: unregistered.
    Removed(String),
    /// Name (or manifest path) and why.
    Refused(String, String),
}

/// A file as `stat` sees it: a change to any of these is worth a look.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified_ns: i128,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some(Stamp {
        len: meta.len(),
        modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        inode: meta.ino(),
    })
}

/// A manifest as the last rescan saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    manifest: Option<Stamp>,
    /// Where its component is, read from it when its stamp last changed.
    component: Option<PathBuf>,
    component_stamp: Option<Stamp>,
}

/// The watched directory, and what each manifest in it looked like at the last rescan.
pub struct ProvidersDir {
    dir: PathBuf,
    /// Manifest path -> what it and its component looked like last time.
    seen: HashMap<PathBuf, Seen>,
    /// Provider -> the last reason its removal was refused (said once, retried each rescan).
    removal_refused: HashMap<String, String>,
}

impl ProvidersDir {
    /// Watch `dir` (created if missing).
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(ProvidersDir { dir: std::fs::canonicalize(dir)?, seen: HashMap::new(), removal_refused: HashMap::new() })
    }

    /// The directory, canonicalized.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `DIR/*.toml` and `DIR/*/provider.toml`, sorted. Hidden names are skipped:
    /// editors and `cp` stage files there before renaming them into place.
    pub fn manifests(&self) -> Vec<PathBuf> {
        let mut found = BTreeSet::new();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            let path = entry.path();
            if path.is_dir() {
                let inner = path.join("provider.toml");
                if inner.is_file() {
                    found.insert(inner);
                }
            } else if path.extension().is_some_and(|e| e == "toml") && path.is_file() {
                found.insert(path);
            }
        }
        found.into_iter().collect()
    }

    /// Bring the registry in line with the directory. A manifest unchanged since
    /// the last rescan costs a `stat` of it and of its component.
    pub async fn rescan(&mut self, registry: &Registry) -> Vec<Change> {
        let present = self.manifests();
        let mut changes = Vec::new();
        for path in &present {
            let manifest = stamp(path);
            // The manifest is parsed again only when it changed: otherwise two stats.
            let component = match self.seen.get(path) {
                Some(seen) if seen.manifest == manifest => seen.component.clone(),
                _ => Manifest::load(path).ok().map(|m| m.component),
            };
            let component_stamp = component.as_deref().and_then(stamp);
            let now = Seen { manifest, component, component_stamp };
            if self.seen.get(path) == Some(&now) {
                continue;
            }
            self.seen.insert(path.clone(), now);
            if let Some(change) = self.apply(path, registry).await {
                changes.push(change);
            }
        }
        self.seen.retain(|path, _| present.contains(path));
        changes.extend(self.remove_vanished(&present, registry).await);
        changes
    }

    /// Add, swap or reload the provider `path` describes; `None` if it is already what serves.
    async fn apply(&self, path: &Path, registry: &Registry) -> Option<Change> {
        // Read once: what is checked below is what is applied, not a later rewrite of the file.
        let (manifest, text) = match Manifest::load_with_text(path) {
            Ok(read) => read,
            Err(e) => return Some(refuse(registry, &path.display().to_string(), e.to_string()).await),
        };
        let name = manifest.name.clone();
        let registered = match registry.store().provider(&name) {
            Ok(registered) => registered,
            Err(e) => return Some(refuse(registry, &name, e.to_string()).await),
        };
        let Some(record) = registered else {
            return Some(match registry.add_read(path, text).await {
                Ok(_) => Change::Added(name),
                Err(e) => refuse(registry, &name, e.to_string()).await,
            });
        };
        if Path::new(&record.manifest) != path {
            let reason = format!("{} names provider {name:?}, registered from {}", path.display(), record.manifest);
            return Some(refuse(registry, &name, reason).await);
        }
        // The pin, if any, is checked here: a component that does not match it is not swapped in.
        let sha256 = match manifest.read_component() {
            Ok((_, sha256)) => sha256,
            Err(e) => return Some(refuse(registry, &name, e.to_string()).await),
        };
        let serving = match registry.get(&name).await {
            Ok(serving) => serving,
            Err(e) => return Some(refuse(registry, &name, e.to_string()).await),
        };
        let mut same_settings = manifest.clone();
        same_settings.component = serving.manifest().component.clone();
        same_settings.sha256 = serving.manifest().sha256.clone();
        if same_settings != *serving.manifest() {
            // Narrowing applies here; widening is the operator's to approve, never the watcher's.
            if let Some(grant) = manifest.widening(serving.manifest()) {
                let reason = format!(
                    "{} now asks for {grant}, which was not approved: apply it with `broker provider add {}`",
                    path.display(),
                    path.display()
                );
                return Some(refuse(registry, &name, reason).await);
            }
            return Some(match registry.add_read(path, text).await {
                Ok(_) => Change::Reloaded(name),
                Err(e) => refuse(registry, &name, e.to_string()).await,
            });
        }
        if sha256 == record.component_sha256 {
            return None;
        }
        Some(match registry.swap(&name, &manifest.component, None).await {
            Ok(_) => Change::Swapped(name),
            // The registry has recorded the refusal with both hashes.
            Err(e @ RegistryError::SwapRefused { .. }) => Change::Refused(name, e.to_string()),
            Err(e) => refuse(registry, &name, e.to_string()).await,
        })
    }

    /// Remove the providers registered from this directory whose manifest is gone.
    async fn remove_vanished(&mut self, present: &[PathBuf], registry: &Registry) -> Vec<Change> {
        let records = match registry.list() {
            Ok(records) => records,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list providers to find removed manifests");
                return Vec::new();
            }
        };
        let mut changes = Vec::new();
        for record in records {
            let manifest = PathBuf::from(&record.manifest);
            if !manifest.starts_with(&self.dir) || present.contains(&manifest) {
                self.removal_refused.remove(&record.name);
                continue;
            }
            match registry.remove(&record.name).await {
                Ok(()) => {
                    self.removal_refused.remove(&record.name);
                    changes.push(Change::Removed(record.name));
                }
                Err(e) => {
                    let reason = e.to_string();
                    if self.removal_refused.get(&record.name) != Some(&reason) {
                        self.removal_refused.insert(record.name.clone(), reason.clone());
                        record_event(registry, EventKind::RemoveRefused, &record.name, &reason).await;
                        changes.push(Change::Refused(record.name, reason));
                    }
                }
            }
        }
        changes
    }
}

async fn refuse(registry: &Registry, name: &str, reason: String) -> Change {
    let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
    record_event(registry, EventKind::WatchRefused, name, &reason).await;
    Change::Refused(name.to_owned(), reason)
}

async fn record_event(registry: &Registry, kind: EventKind, name: &str, reason: &str) {
    tracing::warn!(provider = name, %kind, reason, "providers directory");
    let mut event = Event::new(kind, name);
    event.detail = reason.to_owned();
    if let Err(e) = registry.store().append_event(&event).await {
        tracing::warn!(provider = name, error = %e, "cannot record a providers-directory event");
    }
}

/// Rescan `dir` whenever something in it changes (inotify, settled for
/// `settle`) and every `poll` anyway, for components that live elsewhere,
/// until `stop` resolves.
pub async fn watch(
    mut dir: ProvidersDir,
    registry: &Registry,
    settle: std::time::Duration,
    poll: std::time::Duration,
    stop: impl Future<Output = ()>,
) {
    use notify::Watcher;
    let (wake, mut woken) = tokio::sync::mpsc::unbounded_channel::<()>();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Reads (the API loading a manifest, a rescan hashing a component) are not changes.
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = wake.send(());
        }
    })
    .and_then(|mut watcher| watcher.watch(dir.dir(), notify::RecursiveMode::Recursive).map(|()| watcher));
    if let Err(e) = &watcher {
        tracing::warn!(dir = %dir.dir().display(), error = %e, "cannot watch the providers directory; polling it");
    }
    tokio::pin!(stop);
    loop {
        let changes = dir.rescan(registry).await;
        for change in changes {
            tracing::info!(dir = %dir.dir().display(), change = ?change, "providers directory");
        }
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(poll) => {}
            Some(()) = woken.recv() => {
                // A copy is many writes: wait until they stop, but not for ever.
                let settling = tokio::time::Instant::now();
                while settling.elapsed() < poll
                    && let Ok(Some(())) = tokio::time::timeout(settle, woken.recv()).await
                {}
            }
        }
    }
    drop(watcher);
}
