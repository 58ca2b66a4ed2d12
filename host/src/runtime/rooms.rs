//! The guest-facing capabilities of `broker:provider`, registered: one entry
//! each, with its interface, its grant and how it joins a store's linker. The
//! linker, the import check at load and the conformance kit's "ungranted"
//! finding all read this list, so a new capability is its folder under
//! `capabilities/`, its WIT, its context in [`HostState`], and one entry here.

use super::HostState;
use crate::capabilities::{context, kv, local_socket, log, machine_lock, network_bridge, process};
use crate::manifest::Grants;
use wasmtime::component::Linker;

/// How a capability is linked into a provider's stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linking {
    /// For every provider: without the grant each call answers `access-denied`
    /// (and the refusal is noted), so a provider can say what it lacks.
    Always,
    /// Only when granted: a component that imports it ungranted is refused at load.
    WhenGranted,
}

/// One registered capability.
pub struct Room {
    /// Its interface in the contract package (`local-socket`).
    pub interface: &'static str,
    /// Its key under `[grants]`, as a manifest spells it (`local-sockets`).
    pub grant: &'static str,
    pub granted: fn(&Grants) -> bool,
    pub linking: Linking,
    pub add_to_linker: fn(&mut Linker<HostState>) -> wasmtime::Result<()>,
}

impl Room {
    /// Whether a provider with `grants` gets it in its linker.
    pub fn linked_for(&self, grants: &Grants) -> bool {
        self.linking == Linking::Always || (self.granted)(grants)
    }
}

/// Every capability this host provides, besides WASI and `wasi:http` (linked
/// for all, nothing ambient in them) and `types` (no functions).
pub const ROOMS: &[Room] = &[
    Room {
        interface: context::INTERFACE,
        grant: "",
        granted: |_| true,
        linking: Linking::Always,
        add_to_linker: |linker| context::add_to_linker(linker, HostState::context_view),
    },
    Room {
        interface: kv::INTERFACE,
        grant: "kv",
        granted: |grants| grants.kv,
        linking: Linking::WhenGranted,
        add_to_linker: |linker| kv::add_to_linker(linker, |s| &mut s.kv),
    },
    Room {
        interface: log::INTERFACE,
        grant: "log",
        granted: |grants| grants.log,
        linking: Linking::WhenGranted,
        add_to_linker: |linker| log::add_to_linker(linker, |s| &mut s.log),
    },
    Room {
        interface: machine_lock::INTERFACE,
        grant: "machine-lock",
        granted: |grants| grants.machine_lock,
        linking: Linking::Always,
        add_to_linker: |linker| machine_lock::add_to_linker(linker, HostState::machine_lock_view),
    },
    Room {
        interface: process::INTERFACE,
        grant: "process",
        granted: |grants| !grants.process.is_empty(),
        linking: Linking::Always,
        add_to_linker: |linker| process::add_to_linker(linker, HostState::process_view),
    },
    Room {
        interface: network_bridge::INTERFACE,
        grant: "bridge",
        granted: |grants| grants.bridge.is_some(),
        linking: Linking::Always,
        add_to_linker: |linker| network_bridge::wit::add_to_linker(linker, |s| &mut s.bridge),
    },
    Room {
        interface: local_socket::INTERFACE,
        grant: "local-sockets",
        granted: |grants| grants.local_sockets,
        linking: Linking::Always,
        add_to_linker: |linker| local_socket::add_to_linker(linker, HostState::local_socket_view),
    },
];

/// The registered capability serving `interface`.
pub fn room(interface: &str) -> Option<&'static Room> {
    ROOMS.iter().find(|room| room.interface == interface)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_interface_is_registered_once_and_only_some_are_linked_without_a_grant() {
        let mut interfaces: Vec<&str> = ROOMS.iter().map(|r| r.interface).collect();
        interfaces.sort();
        interfaces.dedup();
        assert_eq!(interfaces.len(), ROOMS.len(), "an interface registered twice");
        let none = Grants::default();
        let linked: Vec<&str> = ROOMS.iter().filter(|r| r.linked_for(&none)).map(|r| r.interface).collect();
        assert_eq!(linked, ["context", "machine-lock", "process", "network-bridge", "local-socket"]);
    }
}
