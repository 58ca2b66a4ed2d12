//! The host crate's end-to-end tests, one binary (wasmtime and cranelift are
//! linked once): the `broker` binary as a CLI and as a daemon, the machine
//! lock across processes, and the providers directory.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod authors;
mod cli;
mod cli_daemon;
mod common;
mod daemon;
mod grants;
mod groups;
mod infrakit;
mod lock;
mod providers_dir;
mod quotas;
mod readme;
mod record_bound;
mod secrets;
mod slow_clients;
mod store_faults;
