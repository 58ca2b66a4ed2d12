//! The capabilities a provider imports, one room each: one module per WIT
//! interface, with its grant, its context, its backend trait (the host's, the
//! kit's simulation, a recorder) and its `add_to_linker`; and their registry
//! ([`ROOMS`], [`add_to_linker`]), which every part of the host reads.

pub mod context;
pub mod denials;
pub mod http_egress;
pub mod kit;
pub mod kv;
pub mod local_socket;
pub mod log;
pub mod machine_lock;
pub mod network_bridge;
pub mod process;
pub mod view;
pub mod wasi;

mod registry;

pub use registry::*;
