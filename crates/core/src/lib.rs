#![warn(missing_docs)]
//! wasm-broker's core: runs provider components behind Juju's
//! `environs.InstanceBroker` contract (`wit/`) with the capabilities of
//! `broker-capabilities`, keeps the host's state, serves the broker and
//! InfraKit's groups over any provider, and tests providers in the kit.

pub mod broker;
pub mod conformance;
pub mod groups;
pub mod manifest;
pub mod providers;
pub mod runtime;
pub mod store;
pub mod version;

#[cfg(test)]
pub(crate) use broker_capabilities::fuzz_text;
