#![warn(missing_docs)]
//! wasm-broker's host: runs provider components behind Juju's
//! `environs.InstanceBroker` contract (`wit/`), with nothing ambient.

pub mod bindings;
pub mod broker;
pub mod capabilities;
pub mod cli;
pub mod client;
pub mod conformance;
pub mod contract;
pub mod daemon;
pub mod error_text;
pub mod machine_lock;
pub mod manifest;
pub mod network;
pub mod providers;
pub mod runtime;
pub mod sandbox;
pub mod store;
pub mod version;
