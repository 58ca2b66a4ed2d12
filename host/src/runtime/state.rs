//! The data of one guest store.

use super::GuestLimiter;
use crate::capabilities::context::ContextView;
use crate::capabilities::kv::{KvBackend, KvCtx};
use crate::capabilities::log::LogCtx;
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
    pub limiter: GuestLimiter,
}

impl HostState {
    pub fn new(provider: Arc<str>, kv: Arc<dyn KvBackend>, memory_bytes: usize) -> Self {
        HostState {
            table: ResourceTable::new(),
            wasi: wasi::sandboxed_ctx(&provider),
            kv: KvCtx::new(provider.clone(), kv),
            log: LogCtx::new(provider.clone()),
            limiter: GuestLimiter::new(memory_bytes),
            provider,
        }
    }

    pub fn context_view(&mut self) -> ContextView<'_> {
        ContextView { table: &mut self.table }
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}
