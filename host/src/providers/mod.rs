//! Providers: their manifests and the registry of the ones this host runs.

pub mod data_dirs;
pub mod manifest;
pub mod registry;
pub mod view;
pub mod watch;

pub use manifest::{Grants, Isolation, Limits, Manifest, ManifestError, Method};
pub use registry::{CandidateCheck, Registry, RegistryError};
