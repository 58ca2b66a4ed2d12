#![warn(missing_docs)]
//! wasm-broker's capabilities: what a provider component may reach, each in a
//! room of its own ([`rooms`]: its grant, backend, store part, linker and kit
//! simulation), the contract's bindings and vocabulary, and the host
//! facilities the rooms stand on (the network, the machine lock, the sandbox
//! of granted programs, data filesystems, secrets). It links against any store
//! that holds the rooms' parts ([`rooms::HasRooms`]) and knows nothing of the
//! host above it: state, versions, the broker and its front ends.
//!
//! # Public surface
//! What `broker-core` and `broker-serve` build on; the rest is `pub(crate)`
//! (`unreachable_pub` is on, and an item is `pub` only when another crate
//! names it or it is in the signature of one that is):
//! - [`rooms`]: the registry ([`rooms::ROOMS`], [`rooms::add_to_linker`],
//!   [`rooms::Grants`], [`rooms::Backends`], [`rooms::Parts`]) that a store
//!   implementing [`rooms::HasRooms`] links against; each room's backend
//!   trait, host backend and kit part.
//! - [`bindings`]: the contract's generated types; [`contract`]: Juju's
//!   constraints and the start params the host builds.
//! - The host facilities the core drives at load and cleanup: [`network`]
//!   (netlink, device owners), [`sandbox`] (programs' users, cgroups),
//!   [`data_fs`], [`machine_lock`], [`secrets`] (the redactor, credentials),
//!   [`quotas`].
//! - [`error_text`]: one line per error chain, escaped for a terminal.

pub mod bindings;
pub mod contract;
pub mod data_fs;
pub mod error_text;
pub mod machine_lock;
pub mod network;
pub mod quotas;
pub mod rooms;
pub mod sandbox;
pub mod secrets;

/// Inputs for the fuzz targets (bolero): random bytes made into text of a
/// grammar's own tokens, since random Unicode seldom reaches past a parser's
/// first check.
#[doc(hidden)]
pub mod fuzz_text {
    /// `bytes` as text: a byte below 128 picks a character of `alphabet`, one
    /// above picks a token of `tokens`.
    pub fn of(bytes: &[u8], alphabet: &str, tokens: &[&str]) -> String {
        let chars: Vec<char> = alphabet.chars().collect();
        let mut text = String::new();
        for &byte in bytes {
            match byte {
                0..=127 => text.push(chars[usize::from(byte) % chars.len()]),
                _ => text.push_str(tokens[usize::from(byte - 128) % tokens.len()]),
            }
        }
        text
    }
}
