//! The host side of the contract: the `bindgen!` of `broker:provider@0.3.0`
//! (`wit/`), and of each earlier version as it was published (`wit/0.2.0/`,
//! `wit/0.1.0/`, never edited): only what differs from the current one is
//! generated for them (their exports; 0.1.0's `kv`).
//!
//! Imports are async (so a capability may wait) and trappable (outer
//! `Result` = trap, inner = what the guest sees), and traced: each call is a
//! TRACE span with its arguments and result, which the conformance kit
//! collects (and which costs a level check when nothing listens). The generated data types
//! double as the host's domain types: they carry serde so they can be
//! stored, compared and served over the API.

/// The generated bindings; their items cannot carry hand-written docs.
mod generated {
    #![allow(missing_docs)]

    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "provider",
        imports: { default: async | trappable | tracing },
        exports: { default: async },
        with: {
            "broker:provider/context.call-context": crate::rooms::context::CallContext,
            "broker:provider/machine-lock.lock-guard": crate::rooms::machine_lock::HeldLock,
            "broker:provider/process.child": crate::rooms::process::HeldChild,
            "broker:provider/local-socket.connection": crate::rooms::local_socket::HeldConnection,
        },
        additional_derives: [serde::Serialize, serde::Deserialize, PartialEq],
    });
}

pub use generated::*;

pub use broker::provider::types::*;
pub use exports::broker::provider::instance_broker::Guest as InstanceBrokerExports;

/// The `bindgen!` of a published version (`wit/VERSION`): its interfaces
/// that did not change are the current ones (`with`); those listed after the
/// path (`"kv": …`) are mapped as well, the rest generated anew.
macro_rules! published_version {
    ($path:literal $(, $interface:literal: $module:path)* $(,)?) => {
        wasmtime::component::bindgen!({
            path: $path,
            world: "provider",
            imports: { default: async | trappable | tracing },
            exports: { default: async },
            with: {
                "broker:provider/types": crate::bindings::broker::provider::types,
                "broker:provider/context": crate::bindings::broker::provider::context,
                "broker:provider/log": crate::bindings::broker::provider::log,
                "broker:provider/machine-lock": crate::bindings::broker::provider::machine_lock,
                "broker:provider/process": crate::bindings::broker::provider::process,
                "broker:provider/network-bridge": crate::bindings::broker::provider::network_bridge,
                "broker:provider/local-socket": crate::bindings::broker::provider::local_socket,
                $($interface: $module,)*
            },
            additional_derives: [PartialEq],
        });
    };
}

/// `broker:provider@0.2.0` as published: its imports are the current ones
/// (0.3.0 only added to `kv` and `types`), its `all-instances` answers
/// every instance at once.
pub mod v0_2 {
    #![allow(missing_docs)]

    published_version!("../../wit/0.2.0", "broker:provider/kv": crate::bindings::broker::provider::kv);
}

/// `broker:provider@0.1.0` as published: what differs from 0.2.0 is `kv`,
/// whose error has no `quota-exceeded`; its exports are 0.2.0's.
pub mod v0_1 {
    #![allow(missing_docs)]

    published_version!("../../wit/0.1.0");
}

/// The contract package this host implements; components must speak it.
pub const CONTRACT_PACKAGE: &str = "broker:provider";
/// The newest version of [`CONTRACT_PACKAGE`]: what `wit/` and the SDK are.
pub const CONTRACT_VERSION: &str = "0.3.0";
/// Every published version this host serves, newest first: a component built
/// against any of them loads unchanged. A published version never changes
/// (`wit/0.2.0/`, `wit/0.1.0/` are as published; a test pins their text).
pub const SERVED_VERSIONS: &[&str] = &["0.3.0", "0.2.0", "0.1.0"];

/// The instance names an interface of the contract is linked under, one per
/// version served (`broker:provider/log@0.3.0`, `…@0.2.0`, `…@0.1.0`): an
/// interface that did not change between them is the same host functions
/// under each.
pub fn served_instances(interface: &str) -> impl Iterator<Item = String> + '_ {
    served_instances_since(interface, "0.1.0")
}

/// As [`served_instances`], of the versions from `first` on: an interface that
/// only gained functions since `first` is the current host functions under
/// each (a component type-checks only what it imports).
pub fn served_instances_since<'a>(interface: &'a str, first: &'a str) -> impl Iterator<Item = String> + 'a {
    let newer = SERVED_VERSIONS.iter().position(|version| *version == first).map_or(0, |at| at + 1);
    SERVED_VERSIONS[..newer].iter().map(move |version| format!("{CONTRACT_PACKAGE}/{interface}@{version}"))
}
