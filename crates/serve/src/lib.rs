#![warn(missing_docs)]
//! wasm-broker's front: the `broker` command, the daemon that serves the
//! broker over a local socket, InfraKit's plugin sockets and the daemon's
//! client. Everything here is built on `broker-core`; nothing below names it.
//!
//! # Public surface
//! The `broker` binary's [`cli::main`]; for the benchmarks, the API server
//! ([`daemon::serve`]); for the tests, a client of InfraKit's plugin sockets
//! and its JSON-RPC error codes ([`infrakit::client`], [`infrakit::rpc`]).
//! The rest (the CLI's parts, the daemon's, the client, the accept loop, the
//! streaming lines) is `pub(crate)`.

pub mod cli;
pub(crate) mod client;
pub mod daemon;
pub mod infrakit;
pub(crate) mod listen;
pub(crate) mod wire;
