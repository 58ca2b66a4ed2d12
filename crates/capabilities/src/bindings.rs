//! The one `bindgen!` for the host side of `broker:provider@0.1.0`.
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

/// The contract package this host implements; components must speak it.
pub const CONTRACT_PACKAGE: &str = "broker:provider";
/// The version of [`CONTRACT_PACKAGE`] it implements; components must be compatible with it.
pub const CONTRACT_VERSION: &str = "0.1.0";
