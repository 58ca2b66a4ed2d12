//! Paths of the guests built by this crate's build script.

use std::path::PathBuf;

/// The directory of the built `.wasm` files.
pub fn wasm_dir() -> PathBuf {
    PathBuf::from(env!("GUEST_WASM_DIR"))
}

/// A built guest by crate name, e.g. `wasm("fake")` or `wasm("test-hostile")`.
pub fn wasm(crate_name: &str) -> PathBuf {
    wasm_dir().join(format!("{}.wasm", crate_name.replace('-', "_")))
}

/// The bundled manifest of a guest: `guests/<dir>/provider.toml`.
pub fn manifest(guest_dir: &str) -> PathBuf {
    PathBuf::from(env!("GUESTS_DIR")).join(guest_dir).join("provider.toml")
}
