#![warn(missing_docs)]
//! wasm-broker's front: the `broker` command, the daemon that serves the
//! broker over a local socket, InfraKit's plugin sockets and the daemon's
//! client. Everything here is built on `broker-core`; nothing below names it.
//!
//! # Public surface
//! The `broker` binary's [`cli::main`]; for the tests, the daemon's
//! [`daemon`] pieces they drive and InfraKit's wire protocol ([`infrakit`]).
//! The rest (the client, the accept loop, the streaming lines) is `pub(crate)`.

pub mod cli;
pub(crate) mod client;
pub mod daemon;
pub mod infrakit;
pub(crate) mod listen;
pub(crate) mod wire;
