//! Everything a provider component needs: the generated `broker:provider`
//! bindings, an `export_provider!` macro, and helpers for the host imports.
//!
//! ```ignore
//! struct MyProvider;
//! impl broker_guest::Guest for MyProvider { /* ... */ }
//! broker_guest::export_provider!(MyProvider);
//! ```

wit_bindgen::generate!({
    path: "wit",
    world: "provider",
    pub_export_macro: true,
    export_macro_name: "export_provider",
    default_bindings_module: "broker_guest",
    additional_derives: [serde::Serialize, serde::Deserialize, PartialEq],
});

pub use broker::provider::{
    context::CallContext, kv as host_kv, local_socket, log as host_log, machine_lock, network_bridge, process, types,
};
pub use exports::broker::provider::instance_broker::Guest;

pub mod cloud_ids;
pub mod http;
pub mod kv;
pub mod listing;
pub mod netplan;

/// [`netplan::interfaces`], by the name SDK 0.2 gave it.
pub use netplan::interfaces as netplan_interfaces;

/// Log through the host's tracing, tagged with this provider's name.
pub fn log(level: host_log::Level, message: &str) {
    host_log::log(level, message);
}

impl From<host_kv::KvError> for types::BrokerError {
    fn from(err: host_kv::KvError) -> Self {
        let detail = match err {
            host_kv::KvError::TooLarge(m) => format!("kv: too large: {m}"),
            host_kv::KvError::Invalid(m) => format!("kv: invalid: {m}"),
            host_kv::KvError::Storage(m) => format!("kv: storage: {m}"),
            host_kv::KvError::QuotaExceeded(m) => format!("kv: quota exceeded: {m}"),
        };
        types::BrokerError::Provider(detail)
    }
}

impl types::BrokerError {
    /// The message inside the error, without its kind.
    pub fn message(&self) -> &str {
        use types::BrokerError as E;
        match self {
            E::InvalidParams(m)
            | E::NotFound(m)
            | E::NotSupported(m)
            | E::ZoneIndependent(m)
            | E::ZoneUnavailable(m)
            | E::AccessDenied(m)
            | E::Aborted(m)
            | E::Timeout(m)
            | E::Provider(m) => m,
        }
    }

    /// The same kind of error with its message rewritten (e.g. Juju's "Creating container: …").
    pub fn map_message(self, f: impl FnOnce(String) -> String) -> Self {
        use types::BrokerError as E;
        match self {
            E::InvalidParams(m) => E::InvalidParams(f(m)),
            E::NotFound(m) => E::NotFound(f(m)),
            E::NotSupported(m) => E::NotSupported(f(m)),
            E::ZoneIndependent(m) => E::ZoneIndependent(f(m)),
            E::ZoneUnavailable(m) => E::ZoneUnavailable(f(m)),
            E::AccessDenied(m) => E::AccessDenied(f(m)),
            E::Aborted(m) => E::Aborted(f(m)),
            E::Timeout(m) => E::Timeout(f(m)),
            E::Provider(m) => E::Provider(f(m)),
        }
    }
}
