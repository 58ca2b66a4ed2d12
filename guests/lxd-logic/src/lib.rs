//! The LXD provider's decisions, kept apart from wasm so they are tested
//! natively: the config, names, the container spec Juju would send, and how
//! to read what LXD answers. The component (`guests/lxd`) sends the requests.

pub mod api;
pub mod config;
pub mod spec;

pub use config::Config;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LxdError {
    InvalidParams(String),
    NotFound(String),
    Provider(String),
}

impl std::fmt::Display for LxdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LxdError::InvalidParams(m) | LxdError::NotFound(m) | LxdError::Provider(m) => f.write_str(m),
        }
    }
}
