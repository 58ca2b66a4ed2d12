//! The broker service: calls to the registered providers joined with the
//! host's records of what they did, HostPreparer (bridging the host before a
//! start), and the reconcile of records against what providers report.

pub mod host_preparer;
mod in_flight;
pub mod listing;
pub mod reconcile;
pub mod service;

pub use listing::{InstancesPage, ListCursor};
pub use service::{Broker, BrokerServiceError, InstanceRecord, cursor, page};
