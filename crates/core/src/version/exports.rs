//! A component's `instance-broker`, of whichever published contract version
//! it exports: the host calls them alike. The versions share every type (see
//! `bindings::v0_2`, `bindings::v0_1`) but `all-instances`, which 0.3.0
//! pages: an older component's one answer is paged by the host.

use crate::runtime::HostState;
use broker_capabilities::bindings::{
    self, BrokerError, Instance, InstancePage, ListedInstance, PageRequest, v0_1, v0_2,
};
use broker_capabilities::rooms::context::CallContext;
use wasmtime::Store;
use wasmtime::component::{InstancePre, Resource};

/// Ready to instantiate, for the version [`super::imports::check`] found.
pub(crate) enum ExportsPre {
    /// The current contract.
    Current(bindings::ProviderPre<HostState>),
    /// 0.2.0, as published.
    V0_2(v0_2::ProviderPre<HostState>),
    /// 0.1.0, as published.
    V0_1(v0_1::ProviderPre<HostState>),
}

/// One instance's exports.
pub(crate) enum Exports {
    Current(bindings::Provider),
    V0_2(v0_2::Provider),
    V0_1(v0_1::Provider),
}

impl ExportsPre {
    /// The exports of `version` (one of `bindings::SERVED_VERSIONS`) in `pre`.
    pub(crate) fn new(version: &str, pre: InstancePre<HostState>) -> wasmtime::Result<ExportsPre> {
        Ok(match version {
            "0.1.0" => ExportsPre::V0_1(v0_1::ProviderPre::new(pre)?),
            "0.2.0" => ExportsPre::V0_2(v0_2::ProviderPre::new(pre)?),
            _ => ExportsPre::Current(bindings::ProviderPre::new(pre)?),
        })
    }

    pub(crate) async fn instantiate_async(&self, store: &mut Store<HostState>) -> wasmtime::Result<Exports> {
        Ok(match self {
            ExportsPre::Current(pre) => Exports::Current(pre.instantiate_async(store).await?),
            ExportsPre::V0_2(pre) => Exports::V0_2(pre.instantiate_async(store).await?),
            ExportsPre::V0_1(pre) => Exports::V0_1(pre.instantiate_async(store).await?),
        })
    }
}

/// What `all-instances` answered, as the host reads it.
pub(crate) enum Listing {
    /// One page of a paging provider (0.3.0 on).
    Page(InstancePage),
    /// Every instance at once (0.2.0 and before), as listed instances.
    Whole(Vec<ListedInstance>),
}

impl Exports {
    /// `all-instances` of whichever version: a page of the current one (asked
    /// with `page`), or an older one's whole answer (`page` unused).
    pub(crate) async fn all_instances(
        &self,
        store: &mut Store<HostState>,
        ctx: &Resource<CallContext>,
        page: &PageRequest,
    ) -> wasmtime::Result<Result<Listing, BrokerError>> {
        let ctx = Resource::<CallContext>::new_borrow(ctx.rep());
        Ok(match self {
            Exports::Current(exports) => {
                let guest = exports.broker_provider_instance_broker();
                guest.call_all_instances(store, ctx, page).await?.map(Listing::Page)
            }
            Exports::V0_2(exports) => {
                let guest = exports.broker_provider_instance_broker();
                guest.call_all_instances(store, ctx).await?.map(whole)
            }
            Exports::V0_1(exports) => {
                let guest = exports.broker_provider_instance_broker();
                guest.call_all_instances(store, ctx).await?.map(whole)
            }
        })
    }
}

/// An older version's answer: instances with nothing more known of them.
fn whole(instances: Vec<Instance>) -> Listing {
    let listed = |instance| ListedInstance { instance, display_name: String::new(), hardware: None, tags: Vec::new() };
    Listing::Whole(instances.into_iter().map(listed).collect())
}

/// `$call` on the instance's `instance-broker` (bound to `$guest`),
/// whichever version it is: the arms are the same code on three types.
macro_rules! on_guest {
    ($exports:expr, |$guest:ident| $call:expr) => {
        match $exports {
            $crate::version::exports::Exports::Current(exports) => {
                let $guest = exports.broker_provider_instance_broker();
                $call.await
            }
            $crate::version::exports::Exports::V0_2(exports) => {
                let $guest = exports.broker_provider_instance_broker();
                $call.await
            }
            $crate::version::exports::Exports::V0_1(exports) => {
                let $guest = exports.broker_provider_instance_broker();
                $call.await
            }
        }
    };
}
pub(crate) use on_guest;
