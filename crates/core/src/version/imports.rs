//! Checks a component's imports and exports against what this host offers and
//! what the manifest grants, so a refusal names the exact import.

use crate::manifest::Grants;
use broker_capabilities::bindings::{CONTRACT_PACKAGE, CONTRACT_VERSION};
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
    /// No compatible `instance-broker` export.
    #[error(
        "component does not export {CONTRACT_PACKAGE}/instance-broker@{CONTRACT_VERSION} \
         (this host speaks contract {CONTRACT_VERSION}); it exports: {exports}"
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

pub(crate) fn check(engine: &Engine, component: &Component, grants: &Grants) -> Result<(), ContractError> {
    let ty = component.component_type();
    for (import, _) in ty.imports(engine) {
        check_import(import, grants)?;
    }
    let wanted = |name: &str| {
        split_name(name).is_some_and(|(package, interface, version)| {
            package == CONTRACT_PACKAGE && interface == "instance-broker" && compatible(version, CONTRACT_VERSION)
        })
    };
    if !ty.exports(engine).any(|(name, _)| wanted(name)) {
        let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
        let exports = if exports.is_empty() { "nothing".to_owned() } else { exports.join(", ") };
        return Err(ContractError::MissingExport { exports });
    }
    Ok(())
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
    if !compatible(version, CONTRACT_VERSION) {
        return Err(unsupported(&format!(" (this host speaks {CONTRACT_PACKAGE}@{CONTRACT_VERSION})")));
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
        let newer = check_import("broker:provider/kv@0.2.0", &kv).unwrap_err().to_string();
        assert!(newer.contains("broker:provider/kv@0.2.0") && newer.contains("0.1.0"), "{newer}");
        assert!(check_import("wasi:http/outgoing-handler@0.2.0", &none).is_ok(), "linked; denied per request");
        assert!(check_import("wasi:keyvalue/store@0.2.0", &none).is_err());
        assert!(check_import("evil:net/raw-sockets@1.0.0", &none).is_err());
        assert!(check_import("broker:provider/process@0.1.0", &kv).is_ok(), "linked; denied per call");
        assert!(check_import("broker:provider/network-bridge@0.1.0", &kv).is_ok());
        assert!(check_import("broker:provider/teleporter@0.1.0", &kv).is_err());
    }
}
