//! Providers: the registry of the ones this host runs (each served by its
//! loaded version), their data dirs, how they are shown, and the watched
//! manifests directory.

pub mod data_dirs;
pub mod registry;
pub mod view;
pub mod watch;

pub use registry::CandidateCheck;
pub use registry::{Registry, RegistryError};
