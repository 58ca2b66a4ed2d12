#![warn(missing_docs)]
//! wasm-broker's host: runs provider components behind Juju's
//! `environs.InstanceBroker` contract (`wit/`), with nothing ambient.

pub mod bindings;
pub mod broker;
pub mod capabilities;
pub mod conformance;
pub mod contract;
pub mod error_text;
pub mod groups;
pub mod machine_lock;
pub mod manifest;
pub mod network;
pub mod providers;
pub mod runtime;
pub mod sandbox;
pub mod secrets;
pub mod store;
pub mod version;

/// Inputs for the fuzz targets (bolero): random bytes made into text of a
/// grammar's own tokens, since random Unicode seldom reaches past a parser's
/// first check.
#[cfg(test)]
pub(crate) mod fuzz_text {
    /// `bytes` as text: a byte below 128 picks a character of `alphabet`, one
    /// above picks a token of `tokens`.
    pub(crate) fn of(bytes: &[u8], alphabet: &str, tokens: &[&str]) -> String {
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
