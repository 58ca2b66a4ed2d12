//! The KVM provider's decisions, kept apart from wasm so they are tested
//! natively: the config, Juju's sizing rules, names, the commands to run, the
//! NoCloud seed, and QMP's messages. The component (`guests/kvm`) acts on them
//! through the host's capabilities.

pub mod config;
pub mod qemu;
pub mod qmp;
pub mod spec;

pub use config::{Accel, Config};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvmError {
    InvalidParams(String),
    NotFound(String),
    Provider(String),
}

impl std::fmt::Display for KvmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvmError::InvalidParams(m) | KvmError::NotFound(m) | KvmError::Provider(m) => f.write_str(m),
        }
    }
}
