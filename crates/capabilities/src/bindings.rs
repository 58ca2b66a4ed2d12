//! The host side of the contract: the `bindgen!` of `broker:provider@0.2.0`
//! (`wit/`), and of 0.1.0 as it was published (`wit/0.1.0/`, never edited),
//! whose interfaces are the current ones but for `kv` and the exports.
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

/// `broker:provider@0.1.0` as published: only what differs from 0.2.0 is
/// generated (`kv`, whose error has no `quota-exceeded`, and the exports'
/// names); every other interface is the current one's, linked under both
/// versions' names ([`served_instances`]).
pub mod v0_1 {
    #![allow(missing_docs)]

    wasmtime::component::bindgen!({
        path: "../../wit/0.1.0",
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
        },
        additional_derives: [PartialEq],
    });
}

/// The contract package this host implements; components must speak it.
pub const CONTRACT_PACKAGE: &str = "broker:provider";
/// The newest version of [`CONTRACT_PACKAGE`]: what `wit/` and the SDK are.
pub const CONTRACT_VERSION: &str = "0.2.0";
/// Every published version this host serves, newest first: a component built
/// against any of them loads unchanged. A published version never changes
/// (`wit/0.1.0/` is 0.1.0 as published; a test pins its text).
pub const SERVED_VERSIONS: &[&str] = &["0.2.0", "0.1.0"];

/// The instance names an interface of the contract is linked under, one per
/// version served (`broker:provider/log@0.2.0`, `…@0.1.0`): an interface that
/// did not change between them is the same host functions under each.
pub fn served_instances(interface: &str) -> impl Iterator<Item = String> + '_ {
    SERVED_VERSIONS.iter().map(move |version| format!("{CONTRACT_PACKAGE}/{interface}@{version}"))
}
