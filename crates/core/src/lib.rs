#![warn(missing_docs)]
//! wasm-broker's core: runs provider components behind Juju's
//! `environs.InstanceBroker` contract (`wit/`) with the capabilities of
//! `broker-capabilities`, keeps the host's state, serves the broker and
//! InfraKit's groups over any provider, and tests providers in the kit.
//!
//! # Public surface
//! What `broker-serve` (the CLI, the daemon, InfraKit's sockets) builds on;
//! the rest is `pub(crate)` (`unreachable_pub` is on, and an item is `pub`
//! only when another crate names it or it is in the signature of one that is):
//! - [`broker`]: the broker service (start, stop, list, reconcile) and the
//!   host's config; [`groups`]: InfraKit's group plugin over it.
//! - [`providers`]: the registry of providers (add, swap, remove, watch);
//!   [`version`]: one loaded provider version and its errors;
//!   [`manifest`]: `provider.toml`.
//! - [`runtime`]: the engine and a store's data; [`store`]: the host's state.
//! - [`conformance`]: the kit behind `broker provider test`.
//! - [`error_report`]: every error as one object with its kind (the API's
//!   `{"error": …}`, the CLI's `--json` error and exit code).

pub mod broker;
pub mod conformance;
pub mod error_report;
pub mod groups;
pub mod manifest;
pub mod providers;
pub mod runtime;
pub mod store;
pub mod version;

#[cfg(test)]
pub(crate) use broker_capabilities::fuzz_text;
