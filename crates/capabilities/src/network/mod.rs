//! Host bridging, as Juju's bridger does it: a host device is moved under a new
//! Linux bridge that takes over its addresses and keeps its MAC, so instances
//! attached to the bridge sit on the device's network. A host facility, not a
//! capability: HostPreparer, the `network-bridge` capability and the tests all
//! act through [`backend::NetworkBackend`]: the kernel over netlink
//! ([`netlink::Netlink`], taps in [`tap`]), or in the conformance kit a
//! simulated network ([`simulated::SimNetwork`]); [`names`] has Juju's bridge names;
//! [`owners`] records which provider made which device.

pub mod backend;
pub mod names;
pub mod netlink;
pub mod owners;
pub mod simulated;
pub mod tap;

use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// Juju's `network.DeviceToBridge`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceToBridge {
    /// The host device to bridge (`eth0`).
    pub device: String,
    /// The bridge it goes into, made if missing (`br-eth0`).
    pub bridge: String,
    /// The MAC the bridge takes; empty = the device's own.
    pub mac: String,
}

/// An address on a device: `10.0.0.5/24`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceAddress {
    /// IPv4 or IPv6.
    pub address: IpAddr,
    /// Prefix length in bits.
    pub prefix: u8,
}

impl std::fmt::Display for DeviceAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

/// One network device as observed on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// The interface name: at most 15 bytes.
    pub name: String,
    /// The kernel's; a script may leave it out.
    #[serde(default)]
    pub index: u32,
    /// `aa:bb:cc:dd:ee:ff`; empty for devices without one (lo has zeros).
    pub mac: String,
    /// In bytes.
    pub mtu: u32,
    /// `bridge`, `veth`, `dummy`, `tun`, … ; empty for physical devices.
    #[serde(default)]
    pub kind: String,
    /// The bridge (or bond) this device is enslaved to.
    pub controller: Option<String>,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// Every address on it, IPv6 link-local ones included.
    #[serde(default)]
    pub addresses: Vec<DeviceAddress>,
    /// A tap's owner (`TUNSETOWNER`): the one user who may attach to it
    /// without privileges; `None` for other kinds and taps open to all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tun_owner: Option<u32>,
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`): the devices the host
/// makes do not outlive a boot, so neither do the records of who made them.
pub(crate) fn boot_id() -> Option<&'static str> {
    static BOOT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BOOT.get_or_init(|| std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|id| id.trim().to_owned()))
        .as_deref()
}

/// Why a bridging call failed, on the kernel or in the simulation.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// A netlink request the kernel refused.
    #[error("netlink: {}", crate::error_text::cause_text(.0))]
    Netlink(rtnetlink::Error),
    /// A system call of the bridger's own (a tap's ioctls, the netlink socket).
    #[error("netlink: {what}: {}", crate::error_text::cause_text(.cause))]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// No device of that name.
    #[error("device {0:?} not found")]
    NoDevice(String),
    /// The device is already in another bridge; it is left there.
    #[error("device {device:?} is already bridged into {existing:?}, not {wanted:?}")]
    BridgedElsewhere {
        /// The device asked for.
        device: String,
        /// The bridge asked for.
        wanted: String,
        /// The bridge it is in.
        existing: String,
    },
    /// A device to attach to, or to bridge into, that is not a bridge.
    #[error("{0:?} exists and is not a bridge")]
    NotABridge(String),
    /// Not six `:`-separated pairs of hex digits.
    #[error("invalid MAC address {0:?}")]
    BadMac(String),
    /// Not a valid Linux interface name.
    #[error("invalid device name {0:?}: 1-15 characters of letters, digits, '-', '_' or '.'")]
    BadName(String),
    /// A tap is only ever given to the user it was made for: re-owning another's
    /// would hand a confined program someone else's traffic.
    #[error("tap {device:?} exists and belongs to {owner}, not to uid {wanted} (this provider's)")]
    TapOwnedElsewhere {
        /// The tap.
        device: String,
        /// Its owner now: a uid, or a group.
        owner: String,
        /// This provider's sandbox user.
        wanted: u32,
    },
    /// A device that exists and is not a tap, where a tap is wanted.
    #[error("{0:?} exists and is not a tap")]
    NotATap(String),
}

pub(crate) fn format_mac(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

pub(crate) fn parse_mac(text: &str) -> Result<Vec<u8>, BridgeError> {
    let bytes: Result<Vec<u8>, _> = text.split(':').map(|part| u8::from_str_radix(part, 16)).collect();
    match bytes {
        Ok(bytes) if bytes.len() == 6 && text.split(':').all(|p| p.len() == 2) => Ok(bytes),
        _ => Err(BridgeError::BadMac(text.to_owned())),
    }
}

/// Where a device to bridge stands: `Ok(true)` already in the wanted bridge
/// (nothing to do), `Ok(false)` in none, an error when in another. The one
/// rule for the kernel and the simulation alike.
pub(crate) fn already_bridged(change: &DeviceToBridge, existing: Option<String>) -> Result<bool, BridgeError> {
    match existing {
        None => Ok(false),
        Some(existing) if existing == change.bridge => Ok(true),
        Some(existing) => Err(BridgeError::BridgedElsewhere {
            device: change.device.clone(),
            wanted: change.bridge.clone(),
            existing,
        }),
    }
}

/// Linux interface names: at most 15 bytes, no '/', no whitespace.
pub fn check_name(name: &str) -> Result<(), BridgeError> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok { Ok(()) } else { Err(BridgeError::BadName(name.to_owned())) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_round_trip_and_garbage_is_refused() {
        assert_eq!(format_mac(&parse_mac("00:16:3e:aa:bb:cc").unwrap()), "00:16:3e:aa:bb:cc");
        assert!(parse_mac("00:16:3e:aa:bb").is_err());
        assert!(parse_mac("00:16:3e:aa:bb:zz").is_err());
        assert!(parse_mac("0:16:3e:aa:bb:cc").is_err());
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("br-eth0").is_ok());
        assert!(check_name("b-0123456789ab").is_ok());
        assert!(check_name("sixteen-chars-xx").is_err());
        assert!(check_name("../etc").is_err());
        assert!(check_name("").is_err());
    }
}
