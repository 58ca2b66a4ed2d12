//! The wasmtime side: one [`Engine`] per host (epoch interruption, pooling
//! allocator, compiled components kept on disk and compiled apart), the
//! per-store [`HostState`], and the linker built from a provider's grants.

pub mod compiled;
mod limits;
mod state;
mod ticker;
pub mod turnstile;

pub(crate) use limits::GuestLimiter;
pub use state::HostCapabilities;
pub use state::HostState;
pub(crate) use state::ProviderCapabilities;

use crate::manifest::MAX_GUEST_MEMORY_BYTES;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// How often the epoch advances: a long-running guest passes its turn on
/// this often (see [`turnstile`]), and a call's deadline is checked.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(1);

/// A cause from wasmtime, kept whole (its own causes reachable through `source`).
pub use broker_capabilities::rooms::BoxError;

/// Why the engine could not be set up or a component not compiled.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// wasmtime refused the engine's configuration.
    #[error("cannot configure the wasm engine: {}", broker_capabilities::error_text::cause_text(&**.0))]
    Engine(BoxError),
    /// The directory compiled components are kept in could not be made.
    #[error("cannot keep compiled components in {path}: {}", broker_capabilities::error_text::cause_text(.cause))]
    Compiled {
        /// The directory.
        path: String,
        /// Why.
        cause: std::io::Error,
    },
    /// The bytes are not a component this engine can compile.
    #[error("cannot compile component {path}: {}", broker_capabilities::error_text::cause_text(&**.cause))]
    Compile {
        /// The component file.
        path: String,
        /// wasmtime's error.
        cause: BoxError,
    },
    /// A core wasm module (a `wasm32-wasip1` or `wasm32-unknown-unknown`
    /// build), which has no imports or exports of the contract's types.
    #[error(
        "{path} is a core wasm module, not a component: build the provider for wasm32-wasip2 (`cargo build --target wasm32-wasip2`)"
    )]
    CoreModule {
        /// The file.
        path: String,
    },
    /// Not wasm at all.
    #[error("{path} is not a wasm component (it does not begin with the wasm magic bytes `\\0asm`)")]
    NotWasm {
        /// The file.
        path: String,
    },
    /// The engine's instance slots are all reserved by the providers loaded.
    #[error(
        "provider {provider} needs {wanted} guest instance slots (its max-concurrent-calls and pool-size), and {free} of the host's {INSTANCE_SLOTS} are not reserved by the providers loaded: lower its limits, or remove a provider"
    )]
    NoSlots {
        /// The provider loading.
        provider: String,
        /// Slots it asks for.
        wanted: usize,
        /// Slots not reserved.
        free: usize,
    },
    /// The thread that advances the epoch could not be spawned.
    #[error("cannot start the epoch thread, without which no guest deadline holds: {}", broker_capabilities::error_text::cause_text(.0))]
    Ticker(std::io::Error),
}

/// Guest instances the engine's pool holds, for all providers together.
pub const INSTANCE_SLOTS: usize = 512;

/// Shared by every provider of one host.
pub struct Runtime {
    engine: Engine,
    /// Where compiled components are kept; `None`: compiled in this process, kept nowhere.
    compiled: Option<compiled::CompiledStore>,
    _ticker: ticker::EpochTicker,
    /// Turns of executor time for long-running guests.
    turnstile: Arc<turnstile::Turnstile>,
    /// Instance slots reserved by the provider versions loaded.
    reserved: std::sync::Mutex<usize>,
}

/// Instance slots held for one provider version while it is loaded: no other
/// provider can take them, and it never uses more (its calls at once and its
/// warm pool are bounded by what it reserved).
pub(crate) struct SlotReservation {
    runtime: Arc<Runtime>,
    slots: usize,
}

impl Drop for SlotReservation {
    fn drop(&mut self) {
        *self.runtime.reserved.lock().unwrap_or_else(|p| p.into_inner()) -= self.slots;
    }
}

impl Runtime {
    /// `cache_dir`: where compiled components are kept across runs (keyed by
    /// the component's content hash and the engine's settings); `None` = no disk cache.
    /// Long-running guests get one fewer turn than the executor has workers
    /// (the tokio runtime this is made in, else the machine's cores).
    pub fn new(cache_dir: Option<&Path>) -> Result<Arc<Runtime>, RuntimeError> {
        let workers = match tokio::runtime::Handle::try_current() {
            Ok(handle) => handle.metrics().num_workers(),
            Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        Self::with_guest_turns(cache_dir, turnstile::turns_for(workers))
    }

    /// As [`Runtime::new`], with `turns` long-running guests at once (at least one).
    pub fn with_guest_turns(cache_dir: Option<&Path>, turns: usize) -> Result<Arc<Runtime>, RuntimeError> {
        let engine = Engine::new(&engine_config()).map_err(|e| RuntimeError::Engine(e.into_boxed_dyn_error()))?;
        let compiled = cache_dir
            .map(|dir| {
                compiled::CompiledStore::open(dir, &engine)
                    .map_err(|cause| RuntimeError::Compiled { path: dir.display().to_string(), cause })
            })
            .transpose()?;
        let turnstile = turnstile::Turnstile::new(turns, EPOCH_TICK);
        let ticker =
            ticker::EpochTicker::start(engine.clone(), EPOCH_TICK, turnstile.clone()).map_err(RuntimeError::Ticker)?;
        Ok(Arc::new(Runtime { engine, compiled, _ticker: ticker, turnstile, reserved: Default::default() }))
    }

    /// Reserve `slots` instance slots for `provider`, while the reservation lives.
    pub(crate) fn reserve(self: &Arc<Self>, provider: &str, slots: usize) -> Result<SlotReservation, RuntimeError> {
        let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let free = INSTANCE_SLOTS - *reserved;
        if slots > free {
            return Err(RuntimeError::NoSlots { provider: provider.to_owned(), wanted: slots, free });
        }
        *reserved += slots;
        Ok(SlotReservation { runtime: self.clone(), slots })
    }

    /// Instance slots not reserved by any provider loaded.
    pub fn free_slots(&self) -> usize {
        INSTANCE_SLOTS - *self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The turnstile long-running guests take turns at.
    pub fn turnstile(&self) -> &Arc<turnstile::Turnstile> {
        &self.turnstile
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The component of `bytes` (read from `path`, SHA-256 `sha256`): from
    /// the compiled store when this runtime keeps one (compiled apart and
    /// kept first if it is not there), else compiled here.
    pub(crate) fn compile(&self, path: &Path, bytes: &[u8], sha256: &str) -> Result<Component, RuntimeError> {
        let path_text = || path.display().to_string();
        // The preamble: magic, then a u16 version and a u16 layer (0: core module, 1: component).
        match bytes.get(..8) {
            Some([0, b'a', b's', b'm', _, _, 0, 0]) => return Err(RuntimeError::CoreModule { path: path_text() }),
            Some([0, b'a', b's', b'm', ..]) => {}
            _ => return Err(RuntimeError::NotWasm { path: path_text() }),
        }
        match &self.compiled {
            Some(store) => store.component(&self.engine, path, bytes, sha256),
            None => compile_here(&self.engine, path, bytes),
        }
    }

    /// A linker with WASI (nothing ambient), `wasi:http` (each request checked
    /// against the grant) and the registered capabilities `grants` links ([`ROOMS`]).
    pub fn linker(&self, grants: &crate::manifest::Grants) -> wasmtime::Result<Linker<HostState>> {
        let mut linker = Linker::new(&self.engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        broker_capabilities::rooms::wasi::refuse_symlinks(&mut linker, HostState::symlink_refused)?;
        broker_capabilities::rooms::add_to_linker(&mut linker, grants)?;
        Ok(linker)
    }
}

/// Compile `bytes` (read from `path`) in this process, keeping nothing.
fn compile_here(engine: &Engine, path: &Path, bytes: &[u8]) -> Result<Component, RuntimeError> {
    Component::new(engine, bytes)
        .map_err(|e| RuntimeError::Compile { path: path.display().to_string(), cause: e.into_boxed_dyn_error() })
}

/// The engine's settings; a compiler child uses them too, so that what it
/// makes loads here.
fn engine_config() -> Config {
    let mut config = Config::new();
    config.epoch_interruption(true);
    config.wasm_component_model(true);
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling_config()));
    // Guests get a small fiber stack: providers are not deep recursers.
    config.max_wasm_stack(512 << 10);
    config.async_stack_size(1 << 20);
    config
}

/// Most core instances, memories and tables one provider component may have
/// (a Rust `wasm32-wasip2` component has a handful of instances, one memory,
/// two tables): what each of its instance slots holds.
const CORE_INSTANCES_PER_COMPONENT: u32 = 8;
const MEMORIES_PER_COMPONENT: u32 = 2;
const TABLES_PER_COMPONENT: u32 = 4;

/// Slots for many warm instances; virtual reservations are cheap on 64-bit.
fn pooling_config() -> PoolingAllocationConfig {
    let mut pooling = PoolingAllocationConfig::new();
    pooling
        .total_component_instances(INSTANCE_SLOTS as u32)
        // Per component, so that the slots reserved hold whatever a component
        // declares: one with 64 memories would otherwise take others' share.
        .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
        .max_memories_per_component(MEMORIES_PER_COMPONENT)
        .max_tables_per_component(TABLES_PER_COMPONENT)
        .total_core_instances(INSTANCE_SLOTS as u32 * CORE_INSTANCES_PER_COMPONENT)
        .total_memories(INSTANCE_SLOTS as u32 * MEMORIES_PER_COMPONENT)
        .total_tables(INSTANCE_SLOTS as u32 * TABLES_PER_COMPONENT)
        .total_stacks(512)
        .max_memory_size(MAX_GUEST_MEMORY_BYTES as usize)
        // Reset the first pages by memset instead of madvise, so a recycled slot
        // does not page-fault them in again: per-call instantiation stays cheap.
        .linear_memory_keep_resident(256 << 10)
        .table_keep_resident(16 << 10)
        .async_stack_keep_resident(64 << 10);
    pooling
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `wasm32-wasip1` build is a core module: the error says so and what
    /// to build instead, not wasmtime's "component parser" text.
    #[test]
    fn a_core_module_or_not_wasm_is_named_for_what_it_is() {
        let runtime = Runtime::new(None).unwrap();
        let path = Path::new("provider.wasm");
        // The smallest core module: the preamble alone (version 1, layer 0).
        let core = runtime.compile(path, b"\0asm\x01\0\0\0", "").err().map(|e| e.to_string());
        assert_eq!(
            core.as_deref(),
            Some(
                "provider.wasm is a core wasm module, not a component: build the provider for wasm32-wasip2 (`cargo build --target wasm32-wasip2`)"
            )
        );
        for not_wasm in [&b""[..], b"\0as", b"#!/bin/sh\necho hi\n"] {
            let refused = runtime.compile(path, not_wasm, "").err();
            assert!(matches!(refused, Some(RuntimeError::NotWasm { .. })), "{refused:?}");
        }
        // A component's preamble (layer 1) goes on to wasmtime, whose error is kept.
        let truncated = runtime.compile(path, b"\0asm\x0d\0\x01\0\xff", "").err();
        assert!(matches!(truncated, Some(RuntimeError::Compile { .. })), "{truncated:?}");
    }
}
