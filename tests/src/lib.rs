//! Helpers for the end-to-end tests and benchmarks: providers loaded from the
//! built guests with manifests written on the fly.

use broker_host::broker::WasmProvider;
use broker_host::capabilities::kv::KvBackend;
use broker_host::capabilities::process::MemoryChildRecords;
use broker_host::providers::Manifest;
use broker_host::runtime::{HostCapabilities, Runtime};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use guest_artifacts::{manifest as bundled_manifest, wasm};

pub mod netns;

/// Write `provider.toml` for a built guest into `dir`; `extra` is appended
/// TOML (isolation, limits, grants, config).
pub fn write_manifest(dir: &Path, name: &str, guest_crate: &str, extra: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!("name = \"{name}\"\ncomponent = \"{}\"\n{extra}\n", wasm(guest_crate).display());
    std::fs::write(&path, text).expect("write manifest");
    path
}

/// Load a provider from manifest text written for a built guest.
pub fn load_provider(
    runtime: &Arc<Runtime>,
    kv: Arc<dyn KvBackend>,
    dir: &Path,
    name: &str,
    guest_crate: &str,
    extra: &str,
) -> Result<WasmProvider, broker_host::broker::wasm::LoadError> {
    load_provider_with(runtime, host_capabilities(dir, kv), dir, name, guest_crate, extra)
}

/// Host capabilities for tests: the given kv, no machine lock, data dirs under `dir/providers`.
pub fn host_capabilities(dir: &Path, kv: Arc<dyn KvBackend>) -> HostCapabilities {
    HostCapabilities {
        kv,
        machine_lock: None,
        providers_dir: dir.join("providers"),
        child_records: Arc::new(MemoryChildRecords::default()),
        live_children: Arc::default(),
    }
}

/// As [`load_provider`], with every host capability given.
pub fn load_provider_with(
    runtime: &Arc<Runtime>,
    capabilities: HostCapabilities,
    dir: &Path,
    name: &str,
    guest_crate: &str,
    extra: &str,
) -> Result<WasmProvider, broker_host::broker::wasm::LoadError> {
    let manifest = Manifest::load(&write_manifest(dir, name, guest_crate, extra))?;
    WasmProvider::load(runtime.clone(), manifest, capabilities)
}

/// Grants and config of the bundled fake, with a chosen isolation.
pub fn fake_manifest_extra(isolation: &str) -> String {
    format!(
        "isolation = \"{isolation}\"\n[limits]\nmemory-mib = 64\n[grants]\nkv = true\nlog = true\n\
         [config]\nzones = [\"zone-a\", \"zone-b\", \"zone-c\"]\n"
    )
}

/// One runtime for a test binary: the engine and its epoch thread are shared.
pub fn runtime() -> Arc<Runtime> {
    Runtime::new(None).expect("engine")
}
