//! `broker:provider/context`: the `call-context` resource, the home of Juju's
//! StartInstanceParams callbacks (status, cleanup, distribution group, abort).
//! Values are produced by the host when the guest asks, as the Go funcs were.

use crate::bindings::broker::provider::context::{self as wit};
use crate::bindings::{BrokerError, InstanceStatus};
use crate::quotas::{Quota, Quotas};
use futures_util::future::BoxFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "context";

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
        /// Extra key/value details, as the guest gave them up to the host's
        /// cut: [`MAX_STATUS_ENTRIES`] entries, keys and values cut to
        /// [`MAX_STATUS_KEY_BYTES`] and [`MAX_STATUS_VALUE_BYTES`], and no
        /// entries past [`MAX_STATUS_DATA_BYTES`] in all.
        data: Vec<(String, String)>,
    },
    /// The guest's `cleanup` (Juju's CleanupCallback).
    Cleanup {
        /// What is being cleaned up, cut to 4096 bytes.
        info: String,
    },
}

/// Where a call's [`CallEvent`]s go.
pub(crate) type EventSink = Arc<dyn Fn(CallEvent) + Send + Sync>;
/// Juju's DistributionGroup: ids of the instances to keep a new one apart from;
/// an `Err` reaches the guest as a provider error.
pub(crate) type DistributionGroupFn = Arc<dyn Fn() -> Result<Vec<String>, String> + Send + Sync>;

/// Records the id a start claims (`claim-instance-id`) durably before the
/// guest goes on; an `Err` reaches the guest as the error it carries.
pub type ClaimFn = Arc<dyn Fn(String) -> BoxFuture<'static, Result<(), BrokerError>> + Send + Sync>;

/// Caller-side hooks for one call. Cheap to clone.
#[derive(Clone, Default)]
pub struct CallHooks {
    /// Receives status and cleanup reports; `None` drops them.
    pub events: Option<EventSink>,
    /// Asked only when the guest calls `distribution-group`; `None` answers an empty group.
    pub distribution_group: Option<DistributionGroupFn>,
    /// Asked when the guest calls `claim-instance-id`; `None` records nothing
    /// (a call that is not a start the host records, or a kv-only provider).
    pub claim: Option<ClaimFn>,
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
    /// Where status data cut short is counted.
    pub quotas: Arc<Quotas>,
    /// Hides the provider's secrets in what it reports.
    pub redactor: Arc<crate::secrets::Redactor>,
}

impl CallContext {
    fn emit(&self, event: CallEvent) {
        if let Some(sink) = &self.hooks.events {
            sink(self.redacted(event));
        }
    }

    /// `event` with the provider's secrets hidden in every text of it.
    fn redacted(&self, mut event: CallEvent) -> CallEvent {
        if self.redactor.is_empty() {
            return event;
        }
        let redactor = &self.redactor;
        match &mut event {
            CallEvent::Status { info, data, .. } => {
                redactor.redact_string(info);
                for (key, value) in data {
                    redactor.redact_string(key);
                    redactor.redact_string(value);
                }
            }
            CallEvent::Cleanup { info } => redactor.redact_string(info),
        }
        event
    }
}

/// What the context interface needs from the store: the resource table.
pub(crate) struct ContextView<'a> {
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
/// Most status `data` entries kept from one `set-status`.
pub const MAX_STATUS_ENTRIES: usize = 32;
/// Longest status `data` key kept.
pub(crate) const MAX_STATUS_KEY_BYTES: usize = 128;
/// Longest status `data` value kept.
pub const MAX_STATUS_VALUE_BYTES: usize = 1024;
/// Most status `data` kept from one `set-status`, keys and values together.
pub const MAX_STATUS_DATA_BYTES: usize = 8192;

/// Status `data` as the host keeps it, and how many entries were cut short
/// or left out. A status is held (queued for a client, kept as the
/// instance's latest) long after the call, so it never holds more than this.
pub(crate) fn cut_status_data(data: Vec<(String, String)>) -> (Vec<(String, String)>, u64) {
    let given = data.len();
    let mut kept = Vec::new();
    let (mut bytes, mut shortened) = (0, 0u64);
    for (key, value) in data.into_iter().take(MAX_STATUS_ENTRIES) {
        let (cut_key, cut_value) =
            (super::log::truncate(&key, MAX_STATUS_KEY_BYTES), super::log::truncate(&value, MAX_STATUS_VALUE_BYTES));
        if bytes + cut_key.len() + cut_value.len() > MAX_STATUS_DATA_BYTES {
            break;
        }
        bytes += cut_key.len() + cut_value.len();
        shortened += u64::from(cut_key.len() < key.len() || cut_value.len() < value.len());
        kept.push((cut_key.to_owned(), cut_value.to_owned()));
    }
    let left_out = (given - kept.len()) as u64;
    (kept, left_out + shortened)
}

impl wit::HostCallContext for ContextView<'_> {
    async fn set_status(
        &mut self,
        handle: Resource<CallContext>,
        status: InstanceStatus,
        info: String,
        data: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<(), BrokerError>> {
        let info = super::log::truncate(&info, MAX_INFO_BYTES).to_owned();
        let ctx = self.get(&handle)?;
        let (data, cut) = cut_status_data(data);
        if cut > 0 {
            ctx.quotas.refused(Quota::StatusData, cut);
        }
        ctx.emit(CallEvent::Status { status, info, data });
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

    async fn claim_instance_id(
        &mut self,
        handle: Resource<CallContext>,
        id: String,
    ) -> wasmtime::Result<Result<(), BrokerError>> {
        let claim = self.get(&handle)?.hooks.claim.clone();
        Ok(match claim {
            Some(claim) => claim(id).await,
            None => Ok(()),
        })
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
    // The same in every contract version served: linked under each one's name.
    for instance in crate::bindings::served_instances(INTERFACE) {
        wit::add_to_linker_instance::<T, ContextData>(&mut linker.instance(&instance)?, getter)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_data_is_cut_to_the_hosts_bounds_and_the_cut_counted() {
        let small = vec![("k".to_owned(), "v".to_owned())];
        assert_eq!(cut_status_data(small.clone()), (small, 0));

        // Six aliased 20 MiB values (what a guest's list can name many times over).
        let big = "x".repeat(20 << 20);
        let (kept, cut) = cut_status_data((0..6).map(|i| (format!("k{i}"), big.clone())).collect());
        assert_eq!(cut, 6, "every entry shortened");
        assert!(kept.iter().all(|(_, v)| v.len() == MAX_STATUS_VALUE_BYTES));

        let many: Vec<_> = (0..10_000).map(|i| (format!("key-{i}"), "v".repeat(100))).collect();
        let (kept, cut) = cut_status_data(many);
        assert_eq!(kept.len(), MAX_STATUS_ENTRIES);
        assert_eq!(cut, 10_000 - MAX_STATUS_ENTRIES as u64);

        let wide: Vec<_> = (0..32).map(|i| ("k".repeat(1000) + &i.to_string(), "v".repeat(1000))).collect();
        let (kept, cut) = cut_status_data(wide);
        let bytes: usize = kept.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(bytes <= MAX_STATUS_DATA_BYTES, "{bytes}");
        assert!(kept.iter().all(|(k, _)| k.len() == MAX_STATUS_KEY_BYTES));
        assert_eq!(cut, 32, "each kept one shortened, the rest left out");
    }
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
            claim: Some(Arc::new(|id: String| {
                Box::pin(async move {
                    match id.as_str() {
                        "taken" => Err(BrokerError::InvalidParams("claim-instance-id: taken".into())),
                        _ => Ok(()),
                    }
                })
            })),
        };
        let mut table = ResourceTable::new();
        let context = CallContext {
            hooks: hooks.clone(),
            provider_config: "{}".into(),
            quotas: Arc::default(),
            redactor: Arc::default(),
        };
        let handle = table.push(context).unwrap();
        let borrowed = || Resource::<CallContext>::new_borrow(handle.rep());
        let mut view = ContextView { table: &mut table };

        assert_eq!(*group_calls.lock().unwrap(), 0, "distribution group is evaluated only when asked");
        view.set_status(borrowed(), InstanceStatus::Allocating, "x".into(), vec![]).await.unwrap().unwrap();
        assert_eq!(view.distribution_group(borrowed()).await.unwrap().unwrap(), vec!["i-1".to_string()]);
        assert_eq!(*group_calls.lock().unwrap(), 1);
        assert!(!view.aborted(borrowed()).await.unwrap());
        hooks.abort.store(true, Ordering::SeqCst);
        assert!(view.aborted(borrowed()).await.unwrap());
        // A claim is the caller's to answer, refusal and all.
        assert_eq!(view.claim_instance_id(borrowed(), "i-2".into()).await.unwrap(), Ok(()));
        let refused = view.claim_instance_id(borrowed(), "taken".into()).await.unwrap();
        assert!(matches!(refused, Err(BrokerError::InvalidParams(_))), "{refused:?}");
        assert_eq!(
            events.lock().unwrap().as_slice(),
            &[CallEvent::Status { status: InstanceStatus::Allocating, info: "x".into(), data: vec![] }]
        );
    }
}
