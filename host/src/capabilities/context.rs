//! `broker:provider/context`: the `call-context` resource, the home of Juju's
//! StartInstanceParams callbacks (status, cleanup, distribution group, abort).
//! Values are produced by the host when the guest asks, as the Go funcs were.

use crate::bindings::broker::provider::context::{self as wit};
use crate::bindings::{BrokerError, InstanceStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

/// Its interface in the contract package.
pub const INTERFACE: &str = "context";

/// What a guest reports during a call.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum CallEvent {
    /// The guest's `set-status`.
    Status {
        /// The instance's new status.
        status: InstanceStatus,
        /// The status message, cut to 4096 bytes.
        info: String,
        /// Extra key/value details, as the guest gave them.
        data: Vec<(String, String)>,
    },
    /// The guest's `cleanup` (Juju's CleanupCallback).
    Cleanup {
        /// What is being cleaned up, cut to 4096 bytes.
        info: String,
    },
}

/// Where a call's [`CallEvent`]s go.
pub type EventSink = Arc<dyn Fn(CallEvent) + Send + Sync>;
/// Juju's DistributionGroup: ids of the instances to keep a new one apart from;
/// an `Err` reaches the guest as a provider error.
pub type DistributionGroupFn = Arc<dyn Fn() -> Result<Vec<String>, String> + Send + Sync>;

/// Caller-side hooks for one call. Cheap to clone.
#[derive(Clone, Default)]
pub struct CallHooks {
    /// Receives status and cleanup reports; `None` drops them.
    pub events: Option<EventSink>,
    /// Asked only when the guest calls `distribution-group`; `None` answers an empty group.
    pub distribution_group: Option<DistributionGroupFn>,
    /// Set to tell the guest the call is aborted.
    pub abort: Arc<AtomicBool>,
}

impl CallHooks {
    /// Hooks that send events to `events`, with no distribution group.
    pub fn with_events(events: impl Fn(CallEvent) + Send + Sync + 'static) -> Self {
        CallHooks { events: Some(Arc::new(events)), ..Default::default() }
    }
}

/// The host object behind a guest's `call-context` handle.
pub struct CallContext {
    /// The caller's hooks for this call.
    pub hooks: CallHooks,
    /// The provider's config as JSON text, handed to the guest on request.
    pub provider_config: Arc<str>,
}

impl CallContext {
    fn emit(&self, event: CallEvent) {
        if let Some(sink) = &self.hooks.events {
            sink(event);
        }
    }
}

/// What the context interface needs from the store: the resource table.
pub struct ContextView<'a> {
    /// The store's table, where `call-context` handles live.
    pub table: &'a mut ResourceTable,
}

impl ContextView<'_> {
    fn get(&self, handle: &Resource<CallContext>) -> wasmtime::Result<&CallContext> {
        Ok(self.table.get(handle)?)
    }
}

pub(crate) struct ContextData;

impl HasData for ContextData {
    type Data<'a> = ContextView<'a>;
}

/// Longest `info` string kept from a guest.
const MAX_INFO_BYTES: usize = 4096;

impl wit::HostCallContext for ContextView<'_> {
    async fn set_status(
        &mut self,
        handle: Resource<CallContext>,
        status: InstanceStatus,
        info: String,
        data: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<(), BrokerError>> {
        let info = super::log::truncate(&info, MAX_INFO_BYTES).to_owned();
        self.get(&handle)?.emit(CallEvent::Status { status, info, data });
        Ok(Ok(()))
    }

    async fn cleanup(
        &mut self,
        handle: Resource<CallContext>,
        info: String,
    ) -> wasmtime::Result<Result<(), BrokerError>> {
        let info = super::log::truncate(&info, MAX_INFO_BYTES).to_owned();
        self.get(&handle)?.emit(CallEvent::Cleanup { info });
        Ok(Ok(()))
    }

    async fn distribution_group(
        &mut self,
        handle: Resource<CallContext>,
    ) -> wasmtime::Result<Result<Vec<String>, BrokerError>> {
        let ctx = self.get(&handle)?;
        Ok(match &ctx.hooks.distribution_group {
            None => Ok(Vec::new()),
            Some(group) => group().map_err(BrokerError::Provider),
        })
    }

    async fn aborted(&mut self, handle: Resource<CallContext>) -> wasmtime::Result<bool> {
        Ok(self.get(&handle)?.hooks.abort.load(Ordering::SeqCst))
    }

    async fn provider_config(&mut self, handle: Resource<CallContext>) -> wasmtime::Result<String> {
        Ok(self.get(&handle)?.provider_config.to_string())
    }

    async fn drop(&mut self, handle: Resource<CallContext>) -> wasmtime::Result<()> {
        // The host owns the context and deletes it after the call; a guest
        // only ever borrows it, so there is nothing to do here.
        let _ = handle;
        Ok(())
    }
}

impl wit::Host for ContextView<'_> {}

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> ContextView<'_>,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, ContextData>(linker, getter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::broker::provider::context::HostCallContext;
    use std::sync::Mutex;

    #[tokio::test]
    async fn callbacks_reach_the_caller_lazily() {
        let events = Arc::new(Mutex::new(Vec::new()));
        let group_calls = Arc::new(Mutex::new(0));
        let sink = events.clone();
        let counter = group_calls.clone();
        let hooks = CallHooks {
            events: Some(Arc::new(move |e| sink.lock().unwrap().push(e))),
            distribution_group: Some(Arc::new(move || {
                *counter.lock().unwrap() += 1;
                Ok(vec!["i-1".into()])
            })),
            abort: Arc::new(AtomicBool::new(false)),
        };
        let mut table = ResourceTable::new();
        let handle = table.push(CallContext { hooks: hooks.clone(), provider_config: "{}".into() }).unwrap();
        let borrowed = || Resource::<CallContext>::new_borrow(handle.rep());
        let mut view = ContextView { table: &mut table };

        assert_eq!(*group_calls.lock().unwrap(), 0, "distribution group is evaluated only when asked");
        view.set_status(borrowed(), InstanceStatus::Allocating, "x".into(), vec![]).await.unwrap().unwrap();
        assert_eq!(view.distribution_group(borrowed()).await.unwrap().unwrap(), vec!["i-1".to_string()]);
        assert_eq!(*group_calls.lock().unwrap(), 1);
        assert!(!view.aborted(borrowed()).await.unwrap());
        hooks.abort.store(true, Ordering::SeqCst);
        assert!(view.aborted(borrowed()).await.unwrap());
        assert_eq!(
            events.lock().unwrap().as_slice(),
            &[CallEvent::Status { status: InstanceStatus::Allocating, info: "x".into(), data: vec![] }]
        );
    }
}
