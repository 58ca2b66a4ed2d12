//! Checks a component's imports and exports against what this host offers and
//! what the manifest grants, so a refusal names the exact import.

use crate::manifest::Grants;
use broker_capabilities::bindings::{CONTRACT_PACKAGE, SERVED_VERSIONS};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Why a component cannot be loaded as a provider under its manifest.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ContractError {
    /// An import this host links only under a grant the manifest lacks.
    #[error("component imports {import}, which the manifest does not grant (add `{grant} = true` under [grants])")]
    NotGranted {
        /// The full import name (`ns:pkg/iface@version`).
        import: String,
        /// The `[grants]` key that would link it.
        grant: &'static str,
    },
    /// An import this host never links, or not at that version.
    #[error("component imports {import}, which this host does not provide{hint}")]
    Unsupported {
        /// The full import name.
        import: String,
        /// Empty, or ` (…)` appended to the message, saying why.
        hint: String,
    },
    /// No `instance-broker` export of a version this host serves.
    #[error(
        "component does not export {CONTRACT_PACKAGE}/instance-broker at a version this host serves ({}); it exports: {exports}",
        served()
    )]
    MissingExport {
        /// What it exports, comma-separated (`nothing` if none).
        exports: String,
    },
}

/// Split `ns:pkg/iface@version` into (`ns:pkg`, `iface`, `version`).
fn split_name(name: &str) -> Option<(&str, &str, &str)> {
    let (path, version) = name.split_once('@')?;
    let (package, interface) = path.split_once('/')?;
    Some((package, interface, version))
}

/// The versions served, as a message names them (`0.2.0, 0.1.0`).
fn served() -> String {
    SERVED_VERSIONS.join(", ")
}

/// The version served that `version` is compatible with, if any.
fn served_as(version: &str) -> Option<&'static str> {
    SERVED_VERSIONS.iter().copied().find(|ours| compatible(version, ours))
}

/// Two versions are compatible as semver treats 0.x: same major, and the same
/// minor while the major is 0.
fn compatible(version: &str, ours: &str) -> bool {
    let parts = |v: &str| -> Vec<String> { v.split('.').map(str::to_owned).collect() };
    let (theirs, ours) = (parts(version), parts(ours));
    match (theirs.as_slice(), ours.as_slice()) {
        ([major, minor, ..], [our_major, our_minor, ..]) => major == our_major && (major != "0" || minor == our_minor),
        _ => false,
    }
}

/// Check `component` against what this host serves and `grants` allow;
/// the contract version whose `instance-broker` it exports (the newest
/// served, should it export several).
pub(crate) fn check(engine: &Engine, component: &Component, grants: &Grants) -> Result<&'static str, ContractError> {
    let ty = component.component_type();
    for (import, _) in ty.imports(engine) {
        check_import(import, grants)?;
    }
    let served = ty
        .exports(engine)
        .filter_map(|(name, _)| match split_name(name)? {
            (CONTRACT_PACKAGE, "instance-broker", version) => served_as(version),
            _ => None,
        })
        .min_by_key(|version| SERVED_VERSIONS.iter().position(|v| v == version));
    served.ok_or_else(|| {
        let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
        let exports = if exports.is_empty() { "nothing".to_owned() } else { exports.join(", ") };
        ContractError::MissingExport { exports }
    })
}

/// The WASI packages the runtime links: `wasmtime_wasi::p2` and `wasi:http`
/// (whose requests are denied unless `[grants.http]` names the authority).
const LINKED_WASI_PACKAGES: &[&str] =
    &["wasi:cli", "wasi:clocks", "wasi:filesystem", "wasi:io", "wasi:random", "wasi:sockets", "wasi:http"];

fn check_import(import: &str, grants: &Grants) -> Result<(), ContractError> {
    let unsupported = |hint: &str| ContractError::Unsupported { import: import.to_owned(), hint: hint.to_owned() };
    let Some((package, interface, version)) = split_name(import) else {
        return Err(unsupported(" (only versioned interface imports can be satisfied)"));
    };
    if package.starts_with("wasi:") {
        // WASI 0.2 is linked for every provider, with nothing ambient in it.
        if !LINKED_WASI_PACKAGES.contains(&package) {
            return Err(unsupported(""));
        }
        return if compatible(version, "0.2.0") { Ok(()) } else { Err(unsupported(" (this host provides WASI 0.2)")) };
    }
    if package != CONTRACT_PACKAGE {
        return Err(unsupported(""));
    }
    if served_as(version).is_none() {
        return Err(unsupported(&format!(
            " (this host serves {CONTRACT_PACKAGE} {}: build the component against one of them, \
             e.g. with the SDK of this host's release)",
            served()
        )));
    }
    if interface == "types" {
        return Ok(());
    }
    match broker_capabilities::rooms::room(interface) {
        Some(room) if room.linked_for(grants) => Ok(()),
        Some(room) => Err(ContractError::NotGranted { import: import.to_owned(), grant: room.grant() }),
        None => Err(unsupported("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_capabilities::rooms::RoomGrants;
    use broker_capabilities::rooms::kv::Kv;

    #[test]
    fn versions_follow_semver_for_zero_majors() {
        assert!(compatible("0.1.0", "0.1.0"));
        assert!(compatible("0.1.7", "0.1.0"));
        assert!(!compatible("0.2.0", "0.1.0"));
        assert!(compatible("0.2.6", "0.2.0"));
        assert!(!compatible("1.0.0", "0.1.0"));
        assert!(!compatible("garbage", "0.1.0"));
    }

    #[test]
    fn imports_need_grants_and_known_versions() {
        let none = Grants::default();
        let kv = Grants { rooms: RoomGrants::default().with::<Kv>(true) };
        assert!(check_import("wasi:cli/environment@0.2.6", &none).is_ok());
        assert!(check_import("broker:provider/types@0.1.0", &none).is_ok());
        assert_eq!(
            check_import("broker:provider/kv@0.1.0", &none),
            Err(ContractError::NotGranted { import: "broker:provider/kv@0.1.0".into(), grant: "kv" })
        );
        assert!(check_import("broker:provider/kv@0.1.0", &kv).is_ok());
        // Every published version is served; one this host does not know is refused, naming those it serves.
        assert!(check_import("broker:provider/kv@0.2.0", &kv).is_ok());
        assert!(check_import("broker:provider/kv@0.3.0", &kv).is_ok());
        assert!(check_import("broker:provider/kv@0.2.3", &kv).is_ok(), "a patch of a served version");
        let newer = check_import("broker:provider/kv@0.4.0", &kv).unwrap_err().to_string();
        assert!(
            newer.contains("broker:provider/kv@0.4.0") && newer.contains("serves broker:provider 0.3.0, 0.2.0, 0.1.0"),
            "{newer}"
        );
        assert!(check_import("wasi:http/outgoing-handler@0.2.0", &none).is_ok(), "linked; denied per request");
        assert!(check_import("wasi:keyvalue/store@0.2.0", &none).is_err());
        assert!(check_import("evil:net/raw-sockets@1.0.0", &none).is_err());
        assert!(check_import("broker:provider/process@0.1.0", &kv).is_ok(), "linked; denied per call");
        assert!(check_import("broker:provider/network-bridge@0.1.0", &kv).is_ok());
        assert!(check_import("broker:provider/teleporter@0.1.0", &kv).is_err());
    }
}
