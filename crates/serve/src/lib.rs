#![warn(missing_docs)]
//! wasm-broker's front: the `broker` command, the daemon that serves the
//! broker over a local socket, InfraKit's plugin sockets and the daemon's
//! client. Everything here is built on `broker-core`; nothing below names it.

pub mod cli;
pub mod client;
pub mod daemon;
pub mod infrakit;
pub mod listen;
pub mod wire;
