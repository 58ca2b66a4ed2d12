//! The data of one guest store.

use super::GuestLimiter;
use crate::capabilities::context::ContextView;
use crate::capabilities::kv::{KvBackend, KvCtx};
use crate::capabilities::log::LogCtx;
use crate::capabilities::machine_lock::{MachineLock, MachineLockCtx, MachineLockView};
use crate::capabilities::wasi;
use std::sync::Arc;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

pub struct HostState {
    pub provider: Arc<str>,
    pub table: ResourceTable,
    pub wasi: WasiCtx,
    pub kv: KvCtx,
    pub log: LogCtx,
    pub machine_lock: MachineLockCtx,
    pub limiter: GuestLimiter,
}

/// The host facilities a provider's stores draw on; each is handed to a
/// store only as far as the manifest grants it.
#[derive(Clone)]
pub struct HostCapabilities {
    pub kv: Arc<dyn KvBackend>,
    pub machine_lock: Option<MachineLock>,
}

impl HostState {
    /// `machine_lock` is `None` unless the manifest grants it.
    pub fn new(
        provider: Arc<str>,
        kv: Arc<dyn KvBackend>,
        machine_lock: Option<MachineLock>,
        memory_bytes: usize,
    ) -> Self {
        HostState {
            table: ResourceTable::new(),
            wasi: wasi::sandboxed_ctx(&provider),
            kv: KvCtx::new(provider.clone(), kv),
            log: LogCtx::new(provider.clone()),
            machine_lock: MachineLockCtx::new(machine_lock),
            limiter: GuestLimiter::new(memory_bytes),
            provider,
        }
    }

    pub fn context_view(&mut self) -> ContextView<'_> {
        ContextView { table: &mut self.table }
    }

    pub fn machine_lock_view(&mut self) -> MachineLockView<'_> {
        MachineLockView { ctx: &mut self.machine_lock, table: &mut self.table }
    }

    /// Release what a call left behind (machine-lock guards).
    pub fn end_call(&mut self) {
        self.machine_lock.end_call(&mut self.table);
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}
