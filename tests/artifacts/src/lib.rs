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

/// A bundled manifest's text with its `component` made absolute, so the
/// manifest can be written (and changed) anywhere.
pub fn manifest_text(guest_dir: &str) -> String {
    let path = manifest(guest_dir);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.replace("\"../target/wasm32-wasip2/release/", &format!("\"{}/", wasm_dir().display()))
}

include!(concat!(env!("OUT_DIR"), "/guests.rs"));
