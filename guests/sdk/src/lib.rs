//! Everything a provider component needs: the generated `broker:provider`
//! bindings, an `export_provider!` macro, and helpers for the host imports.
//!
//! ```ignore
//! struct MyProvider;
//! impl broker_guest::Guest for MyProvider { /* ... */ }
//! broker_guest::export_provider!(MyProvider);
//! ```

wit_bindgen::generate!({
    path: "../../wit",
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

pub mod kv;

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
        };
        types::BrokerError::Provider(detail)
    }
}
