//! A component's `instance-broker`, of whichever published contract version
//! it exports: the host calls both alike (the two bindings share every type
//! but the version in the export's name, see `bindings::v0_1`).

use crate::runtime::HostState;
use broker_capabilities::bindings::{self, v0_1};
use wasmtime::Store;
use wasmtime::component::InstancePre;

/// Ready to instantiate, for the version [`super::imports::check`] found.
pub(crate) enum ExportsPre {
    /// The current contract.
    Current(bindings::ProviderPre<HostState>),
    /// 0.1.0, as published.
    V0_1(v0_1::ProviderPre<HostState>),
}

/// One instance's exports.
pub(crate) enum Exports {
    Current(bindings::Provider),
    V0_1(v0_1::Provider),
}

impl ExportsPre {
    /// The exports of `version` (one of `bindings::SERVED_VERSIONS`) in `pre`.
    pub(crate) fn new(version: &str, pre: InstancePre<HostState>) -> wasmtime::Result<ExportsPre> {
        Ok(match version {
            "0.1.0" => ExportsPre::V0_1(v0_1::ProviderPre::new(pre)?),
            _ => ExportsPre::Current(bindings::ProviderPre::new(pre)?),
        })
    }

    pub(crate) async fn instantiate_async(&self, store: &mut Store<HostState>) -> wasmtime::Result<Exports> {
        Ok(match self {
            ExportsPre::Current(pre) => Exports::Current(pre.instantiate_async(store).await?),
            ExportsPre::V0_1(pre) => Exports::V0_1(pre.instantiate_async(store).await?),
        })
    }
}

/// `$call` on the instance's `instance-broker` (bound to `$guest`),
/// whichever version it is: the arms are the same code on two types.
macro_rules! on_guest {
    ($exports:expr, |$guest:ident| $call:expr) => {
        match $exports {
            $crate::version::exports::Exports::Current(exports) => {
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
