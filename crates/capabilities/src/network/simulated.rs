//! An in-memory host network for the conformance kit: devices, bridges, veths
//! and taps that behave as [`super::netlink::Netlink`] makes them behave on a
//! real host (the same checks, the same errors), seeded from a script.

use super::owners::{MemoryOwners, OwnedDevice};
use super::{BridgeError, Device, DeviceToBridge, already_bridged, check_name, format_mac, parse_mac};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Debug, Default)]
struct State {
    devices: BTreeMap<String, Device>,
    /// Each veth's other end, both ways.
    peers: BTreeMap<String, String>,
    last_index: u32,
}

impl State {
    /// A new device with the next index; a locally administered MAC from it when none is given.
    fn make(&mut self, name: &str, kind: &str, mac: String, mtu: u32) -> Device {
        self.last_index += 1;
        let index = self.last_index;
        let mac = if mac.is_empty() { format_mac(&[0x02, 0, 0, 0, (index >> 8) as u8, index as u8]) } else { mac };
        let kind = kind.to_owned();
        Device {
            name: name.to_owned(),
            index,
            mac,
            mtu,
            kind,
            controller: None,
            up: false,
            addresses: Vec::new(),
            tun_owner: None,
        }
    }

    fn bridge(&self, bridge: &str) -> Result<&Device, BridgeError> {
        match self.devices.get(bridge) {
            None => Err(BridgeError::NoDevice(bridge.to_owned())),
            Some(found) if found.kind != "bridge" => Err(BridgeError::NotABridge(bridge.to_owned())),
            Some(found) => Ok(found),
        }
    }

    fn enslave(&mut self, device: &str, bridge: &str) {
        if let Some(device) = self.devices.get_mut(device) {
            device.controller = Some(bridge.to_owned());
            device.up = true;
        }
    }
}

/// The simulated network: one per kit run, shared by its stores, with its
/// record of which provider made which device.
#[derive(Debug, Default)]
pub struct SimNetwork {
    state: Mutex<State>,
    pub(super) owners: Arc<MemoryOwners>,
}

impl SimNetwork {
    /// A network where `devices` exist (indexes are renumbered from 1).
    pub fn new(devices: Vec<Device>) -> SimNetwork {
        let mut state = State::default();
        for device in devices {
            state.last_index += 1;
            state.devices.insert(device.name.clone(), Device { index: state.last_index, ..device });
        }
        SimNetwork { state: Mutex::new(state), owners: Arc::default() }
    }

    /// As [`SimNetwork::new`], some devices recorded as other providers'
    /// (name, provider): a kit script's `owners`.
    pub fn with_owners(devices: Vec<Device>, owners: BTreeMap<String, String>) -> SimNetwork {
        let kind = |name: &String| {
            let kind = devices.iter().find(|d| &d.name == name).map_or("", |d| d.kind.as_str());
            match kind {
                "tun" => "tap",
                "veth" | "bridge" => kind,
                _ => "device",
            }
            .to_owned()
        };
        let records: Vec<(String, OwnedDevice)> = owners
            .iter()
            .map(|(name, provider)| (name.clone(), OwnedDevice::new(provider, &kind(name), None)))
            .collect();
        SimNetwork { owners: Arc::new(MemoryOwners::seeded(records)), ..SimNetwork::new(devices) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The devices as they are now.
    pub fn devices(&self) -> Vec<Device> {
        self.lock().devices.values().cloned().collect()
    }

    pub(crate) fn bridge(&self, change: &DeviceToBridge) -> Result<(), BridgeError> {
        check_name(&change.device)?;
        check_name(&change.bridge)?;
        let mut state = self.lock();
        let device =
            state.devices.get(&change.device).ok_or_else(|| BridgeError::NoDevice(change.device.clone()))?.clone();
        if already_bridged(change, device.controller.clone())? {
            return Ok(());
        }
        let mac = if change.mac.is_empty() { device.mac.clone() } else { format_mac(&parse_mac(&change.mac)?) };
        match state.devices.get(&change.bridge) {
            Some(existing) if existing.kind != "bridge" => return Err(BridgeError::NotABridge(change.bridge.clone())),
            Some(_) => {}
            None => {
                let bridge = state.make(&change.bridge, "bridge", mac, device.mtu);
                state.devices.insert(change.bridge.clone(), bridge);
            }
        }
        let addresses = std::mem::take(&mut state.devices.get_mut(&change.device).expect("looked up").addresses);
        let bridge = state.devices.get_mut(&change.bridge).expect("made above");
        bridge.addresses.extend(addresses);
        bridge.up = true;
        state.enslave(&change.device, &change.bridge);
        Ok(())
    }

    pub(crate) fn unbridge(&self, device: &str, bridge: &str) -> Result<(), BridgeError> {
        let mut state = self.lock();
        for name in [device, bridge] {
            state.devices.get(name).ok_or_else(|| BridgeError::NoDevice(name.to_owned()))?;
        }
        let addresses = state.devices.remove(bridge).map(|b| b.addresses).unwrap_or_default();
        for other in state.devices.values_mut().filter(|d| d.controller.as_deref() == Some(bridge)) {
            other.controller = None;
        }
        state.devices.get_mut(device).expect("looked up").addresses.extend(addresses);
        Ok(())
    }

    /// As the kernel does it: the pair is made first, so a `bridge` that is
    /// not a bridge leaves it made, unattached and down.
    pub fn create_veth(&self, name: &str, peer: &str, bridge: &str) -> Result<(), BridgeError> {
        check_name(name)?;
        check_name(peer)?;
        let mut state = self.lock();
        let mtu = state.devices.get(bridge).ok_or_else(|| BridgeError::NoDevice(bridge.to_owned()))?.mtu;
        for taken in [name, peer] {
            if state.devices.contains_key(taken) {
                let source = std::io::Error::from_raw_os_error(nix::libc::EEXIST);
                return Err(BridgeError::Io { what: taken.to_owned(), cause: source });
            }
        }
        for (end, other) in [(name, peer), (peer, name)] {
            let device = state.make(end, "veth", String::new(), mtu);
            state.devices.insert(end.to_owned(), device);
            state.peers.insert(end.to_owned(), other.to_owned());
        }
        state.bridge(bridge)?;
        state.enslave(name, bridge);
        if let Some(peer) = state.devices.get_mut(peer) {
            peer.up = true;
        }
        Ok(())
    }

    /// As the kernel does it: the tap is made (or reused) first, so a `bridge`
    /// that is not a bridge leaves it made, unattached and down.
    pub fn create_tap(&self, name: &str, bridge: &str, mac: &str, owner: Option<u32>) -> Result<(), BridgeError> {
        let mut state = self.lock();
        // The bridge must exist before a tap is made for it.
        let mtu = state.devices.get(bridge).ok_or_else(|| BridgeError::NoDevice(bridge.to_owned()))?.mtu;
        check_name(name)?;
        let mac = if mac.is_empty() { String::new() } else { format_mac(&parse_mac(mac)?) };
        // A persistent tap of the same name is reused, as TUNSETIFF does.
        let mut tap = match state.devices.remove(name) {
            Some(existing) => existing,
            None => state.make(name, "tun", String::new(), mtu),
        };
        if !mac.is_empty() {
            tap.mac = mac;
        }
        tap.tun_owner = owner.filter(|uid| *uid != 0);
        state.devices.insert(name.to_owned(), tap);
        state.bridge(bridge)?;
        state.enslave(name, bridge);
        Ok(())
    }

    pub(crate) fn attach(&self, device: &str, bridge: &str) -> Result<(), BridgeError> {
        let mut state = self.lock();
        if !state.devices.contains_key(device) {
            return Err(BridgeError::NoDevice(device.to_owned()));
        }
        state.bridge(bridge)?;
        state.enslave(device, bridge);
        Ok(())
    }

    /// Delete a device; a veth takes its peer with it.
    pub fn delete(&self, name: &str) -> Result<(), BridgeError> {
        let mut state = self.lock();
        state.devices.remove(name).ok_or_else(|| BridgeError::NoDevice(name.to_owned()))?;
        let mut gone = vec![name.to_owned()];
        if let Some(peer) = state.peers.remove(name) {
            state.peers.remove(&peer);
            state.devices.remove(&peer);
            gone.push(peer);
        }
        for other in state.devices.values_mut() {
            if other.controller.as_ref().is_some_and(|c| gone.contains(c)) {
                other.controller = None;
            }
        }
        Ok(())
    }
}
