//! Brokers: the wasm adapter that runs a provider component, the contract's
//! errors, Juju's constraint syntax, and the service that ties providers to
//! the host's records.

pub mod breaker;
pub mod constraints;
mod errors;
pub mod host_preparer;
pub mod imports;
pub mod method_stats;
pub mod reconcile;
pub mod service;
pub mod wasm;

pub use errors::{CallError, describe_broker_error};
pub use service::{Broker, BrokerServiceError, InstanceRecord};
pub use wasm::WasmProvider;
