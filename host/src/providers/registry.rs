//! The providers this host runs: registered in the store, loaded on first use.

use crate::broker::CallError;
use crate::broker::wasm::{LoadError, WasmProvider};
use crate::providers::Manifest;
use crate::runtime::{HostCapabilities, Runtime};
use crate::store::{ProviderRecord, Store, StoreError, records::now_rfc3339};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("unknown provider {0:?} (see `broker provider list`)")]
    UnknownProvider(String),
    #[error("provider {name:?} is already registered from {existing}; remove it first")]
    AlreadyRegistered { name: String, existing: String },
    #[error("provider {name:?} still has {count} recorded instance(s); stop them first")]
    HasInstances { name: String, count: usize },
    #[error("provider {name:?} rejected its config: {source}")]
    ConfigRejected { name: String, source: CallError },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Call(#[from] CallError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot resolve manifest path {path}: {source}")]
    Path { path: String, source: std::io::Error },
}

pub struct Registry {
    runtime: Arc<Runtime>,
    store: Arc<Store>,
    capabilities: HostCapabilities,
    loaded: RwLock<HashMap<String, Arc<WasmProvider>>>,
}

impl Registry {
    pub fn new(runtime: Arc<Runtime>, store: Arc<Store>, capabilities: HostCapabilities) -> Self {
        Registry { runtime, store, capabilities, loaded: RwLock::new(HashMap::new()) }
    }

    /// Load and check a provider, run its `validate-config`, then register it.
    /// Re-adding from the same manifest reloads it.
    pub async fn add(&self, manifest_path: &Path) -> Result<ProviderRecord, RegistryError> {
        let path = std::fs::canonicalize(manifest_path)
            .map_err(|source| RegistryError::Path { path: manifest_path.display().to_string(), source })?;
        let manifest = Manifest::load(&path).map_err(LoadError::from)?;
        if let Some(existing) = self.store.provider(&manifest.name)?
            && existing.manifest != path.display().to_string()
        {
            return Err(RegistryError::AlreadyRegistered { name: manifest.name, existing: existing.manifest });
        }
        let provider = self.load(manifest).await?;
        let info = provider.describe().await?;
        let record = ProviderRecord {
            name: provider.name().to_owned(),
            manifest: path.display().to_string(),
            component_sha256: provider.sha256().to_owned(),
            version: info.version,
            added: now_rfc3339(),
        };
        self.store.put_provider(&record)?;
        self.write_loaded().insert(record.name.clone(), provider);
        Ok(record)
    }

    /// Compile, link and validate the config of a manifest's component.
    pub async fn load(&self, manifest: Manifest) -> Result<Arc<WasmProvider>, RegistryError> {
        let name = manifest.name.clone();
        let config = manifest.config_json.clone();
        let capabilities = self.capabilities.clone();
        let runtime = self.runtime.clone();
        // Compiling is CPU-bound: keep it off the async workers.
        let provider = tokio::task::spawn_blocking(move || WasmProvider::load(runtime, manifest, capabilities))
            .await
            .map_err(|e| RegistryError::Path { path: name.clone(), source: std::io::Error::other(e) })??;
        provider
            .validate_config(&config)
            .await
            .map_err(|source| RegistryError::ConfigRejected { name: name.clone(), source })?;
        Ok(Arc::new(provider))
    }

    pub fn remove(&self, name: &str) -> Result<(), RegistryError> {
        let count = self.store.instances(Some(name))?.len();
        if count > 0 {
            return Err(RegistryError::HasInstances { name: name.to_owned(), count });
        }
        if !self.store.remove_provider(name)? {
            return Err(RegistryError::UnknownProvider(name.to_owned()));
        }
        self.write_loaded().remove(name);
        Ok(())
    }

    /// A registered provider's record and its manifest as it is now.
    pub fn show(&self, name: &str) -> Result<(ProviderRecord, Manifest), RegistryError> {
        let record = self.store.provider(name)?.ok_or_else(|| RegistryError::UnknownProvider(name.to_owned()))?;
        let manifest = Manifest::load(Path::new(&record.manifest)).map_err(LoadError::from)?;
        Ok((record, manifest))
    }

    pub fn list(&self) -> Result<Vec<ProviderRecord>, RegistryError> {
        Ok(self.store.providers()?)
    }

    /// The loaded provider, loading it from its registered manifest if needed.
    pub async fn get(&self, name: &str) -> Result<Arc<WasmProvider>, RegistryError> {
        if let Some(provider) = self.loaded.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(provider.clone());
        }
        let record = self.store.provider(name)?.ok_or_else(|| RegistryError::UnknownProvider(name.to_owned()))?;
        let manifest = Manifest::load(Path::new(&record.manifest)).map_err(LoadError::from)?;
        let provider = self.load(manifest).await?;
        if provider.sha256() != record.component_sha256 {
            tracing::warn!(
                provider = name,
                registered = %record.component_sha256,
                loaded = %provider.sha256(),
                "component changed since it was registered"
            );
        }
        Ok(self.write_loaded().entry(name.to_owned()).or_insert(provider).clone())
    }

    fn write_loaded(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<WasmProvider>>> {
        self.loaded.write().unwrap_or_else(|p| p.into_inner())
    }
}
