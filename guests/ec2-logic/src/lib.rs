//! The EC2 provider's decisions, kept apart from wasm so they are tested
//! natively: the config, which instance type, image and zone a start gets
//! (Juju's EC2 broker rules), the Query API forms it sends, and how to read
//! EC2's XML answers and errors. The component (`guests/ec2`) sends them.

pub mod api;
pub mod config;
pub mod query;
pub mod select;

pub use config::Config;

/// What went wrong, as the contract's error kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ec2Error {
    InvalidParams(String),
    NotFound(String),
    /// Another zone may take it (capacity).
    ZoneUnavailable(String),
    /// No zone would help (bad image, no instance type fits).
    ZoneIndependent(String),
    AccessDenied(String),
    Provider(String),
}

impl std::fmt::Display for Ec2Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ec2Error::InvalidParams(m)
            | Ec2Error::NotFound(m)
            | Ec2Error::ZoneUnavailable(m)
            | Ec2Error::ZoneIndependent(m)
            | Ec2Error::AccessDenied(m)
            | Ec2Error::Provider(m) => f.write_str(m),
        }
    }
}
