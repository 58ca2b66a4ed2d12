//! Host implementations of the imported WIT interfaces: one module per
//! interface, each with its context, its backend trait (real and in-memory)
//! where it has one, and its `add_to_linker`.

pub mod context;
pub mod denials;
pub mod http_egress;
pub mod kv;
pub mod local_socket;
pub mod log;
pub mod machine_lock;
pub mod network_bridge;
pub mod process;
pub mod view;
pub mod wasi;
