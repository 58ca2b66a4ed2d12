//! `broker:provider/network-bridge` for guests: the host's bridger
//! ([`crate::network`]), limited to the devices and bridges the manifest grants.

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::network_bridge::{self as wit};
use crate::capabilities::denials::Denials;
use crate::network::backend::NetworkBackend;
use crate::network::{BridgeError, Device, DeviceToBridge, names};
use serde::Deserialize;
use std::sync::Arc;
use wasmtime::component::{HasSelf, Linker};

/// Its interface in the contract package.
pub const INTERFACE: &str = "network-bridge";

/// `[grants.bridge]`: names, or prefixes when they end in `*`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeGrant {
    #[serde(default)]
    pub devices: Vec<String>,
    #[serde(default)]
    pub bridges: Vec<String>,
}

fn matches(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => p == name,
    })
}

impl BridgeGrant {
    /// Whether the grant lets a provider see `name` (a device or a bridge).
    pub fn covers(&self, name: &str) -> bool {
        matches(&self.devices, name) || matches(&self.bridges, name)
    }

    fn device(&self, name: &str) -> Result<(), BrokerError> {
        if matches(&self.devices, name) {
            Ok(())
        } else {
            Err(BrokerError::AccessDenied(format!(
                "device {name:?} is not granted: add it to `devices` under [grants.bridge]"
            )))
        }
    }

    fn bridge(&self, name: &str) -> Result<(), BrokerError> {
        if matches(&self.bridges, name) {
            Ok(())
        } else {
            Err(BrokerError::AccessDenied(format!(
                "bridge {name:?} is not granted: add it to `bridges` under [grants.bridge]"
            )))
        }
    }
}

pub struct BridgeCtx {
    /// `None` without a `[grants.bridge]`.
    grant: Option<BridgeGrant>,
    network: Arc<dyn NetworkBackend>,
    /// The sandbox user of the provider's programs, given the taps it makes
    /// (`TUNSETOWNER`), so its confined qemu may open them; `None`: root's.
    tap_owner: Option<u32>,
    denials: Denials,
}

impl BridgeCtx {
    pub fn new(
        grant: Option<BridgeGrant>,
        network: Arc<dyn NetworkBackend>,
        tap_owner: Option<u32>,
        denials: Denials,
    ) -> Self {
        BridgeCtx { grant, network, tap_owner, denials }
    }

    fn grant(&self) -> Result<&BridgeGrant, BrokerError> {
        self.grant.as_ref().ok_or_else(|| {
            BrokerError::AccessDenied(
                "network-bridge is not granted: add [grants.bridge] with devices and bridges".into(),
            )
        })
    }
}

fn to_broker_error(err: BridgeError) -> BrokerError {
    match err {
        BridgeError::NoDevice(_) => BrokerError::NotFound(err.to_string()),
        BridgeError::Netlink(_) | BridgeError::Io { .. } => BrokerError::Provider(err.to_string()),
        BridgeError::TapOwnedElsewhere { .. } => BrokerError::AccessDenied(err.to_string()),
        BridgeError::BridgedElsewhere { .. }
        | BridgeError::NotABridge(_)
        | BridgeError::NotATap(_)
        | BridgeError::BadMac(_)
        | BridgeError::BadName(_) => BrokerError::InvalidParams(err.to_string()),
    }
}

fn to_wit(device: Device) -> wit::Device {
    wit::Device {
        name: device.name,
        mac: device.mac,
        mtu: device.mtu,
        kind: device.kind,
        controller: device.controller,
        up: device.up,
        addresses: device
            .addresses
            .into_iter()
            .map(|a| wit::DeviceAddress { address: a.address.to_string(), prefix: a.prefix })
            .collect(),
    }
}

type WitResult<T> = wasmtime::Result<Result<T, BrokerError>>;

fn answered<T>(result: Result<T, BridgeError>) -> WitResult<T> {
    Ok(result.map_err(to_broker_error))
}

impl wit::Host for BridgeCtx {
    async fn devices(&mut self) -> WitResult<Vec<wit::Device>> {
        let grant = match self.grant() {
            Ok(grant) => grant.clone(),
            Err(e) => return Ok(Err(self.denials.refuse("network-bridge", e))),
        };
        let all = self.network.devices().await.map_err(to_broker_error);
        Ok(all.map(|devices| devices.into_iter().filter(|d| grant.covers(&d.name)).map(to_wit).collect()))
    }

    async fn bridge_name(&mut self, device: String) -> wasmtime::Result<String> {
        Ok(names::bridge_name(&device))
    }

    async fn bridge(&mut self, changes: Vec<wit::DeviceToBridge>) -> WitResult<()> {
        let checked = self.grant().and_then(|grant| {
            changes.iter().try_for_each(|c| grant.device(&c.device).and_then(|_| grant.bridge(&c.bridge)))
        });
        if let Err(e) = checked {
            return Ok(Err(self.denials.refuse("network-bridge", e)));
        }
        for c in changes {
            let change = DeviceToBridge { device: c.device, bridge: c.bridge, mac: c.mac };
            if let Err(e) = self.network.bridge(&change).await {
                return answered(Err(e));
            }
        }
        Ok(Ok(()))
    }

    async fn unbridge(&mut self, device: String, bridge: String) -> WitResult<()> {
        if let Err(e) = self.grant().and_then(|g| g.device(&device).and_then(|_| g.bridge(&bridge))) {
            return Ok(Err(self.denials.refuse("network-bridge", e)));
        }
        answered(self.network.unbridge(&device, &bridge).await)
    }

    async fn create_veth(&mut self, name: String, peer: String, bridge: String) -> WitResult<()> {
        let checked =
            self.grant().and_then(|g| g.device(&name).and_then(|_| g.device(&peer)).and_then(|_| g.bridge(&bridge)));
        if let Err(e) = checked {
            return Ok(Err(self.denials.refuse("network-bridge", e)));
        }
        answered(self.network.create_veth(&name, &peer, &bridge).await)
    }

    async fn create_tap(&mut self, name: String, bridge: String, mac: String) -> WitResult<()> {
        if let Err(e) = self.grant().and_then(|g| g.device(&name).and_then(|_| g.bridge(&bridge))) {
            return Ok(Err(self.denials.refuse("network-bridge", e)));
        }
        let owner = self.tap_owner;
        answered(self.network.create_tap(&name, &bridge, &mac, owner).await)
    }

    async fn attach(&mut self, device: String, bridge: String) -> WitResult<()> {
        if let Err(e) = self.grant().and_then(|g| g.device(&device).and_then(|_| g.bridge(&bridge))) {
            return Ok(Err(self.denials.refuse("network-bridge", e)));
        }
        answered(self.network.attach(&device, &bridge).await)
    }

    async fn delete_link(&mut self, name: String) -> WitResult<()> {
        if let Err(e) = self.grant().and_then(|g| g.device(&name)) {
            return Ok(Err(self.denials.refuse("network-bridge", e)));
        }
        let owner = self.tap_owner;
        let deleted = match self.network.device(&name).await {
            Err(e) => Err(e),
            Ok(Some(device)) if device.kind == "veth" || device.kind == "tun" => {
                self.network.delete_owned(&name, owner).await
            }
            Ok(Some(_)) => {
                Err(BridgeError::NotABridge(format!("{name} is not a veth or tap; nothing else is deleted")))
            }
            Ok(None) => Err(BridgeError::NoDevice(name.clone())),
        };
        answered(deleted)
    }
}

pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut BridgeCtx,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, HasSelf<BridgeCtx>>(linker, getter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::broker::provider::network_bridge::Host;
    use crate::network::backend::HostNetwork;

    #[test]
    fn grants_match_names_and_prefixes() {
        let grant = BridgeGrant { devices: vec!["eth0".into(), "vm-*".into()], bridges: vec!["br-*".into()] };
        assert!(grant.device("eth0").is_ok());
        assert!(grant.device("vm-17").is_ok());
        assert!(grant.device("eth1").is_err());
        assert!(grant.device("eth00").is_err());
        assert!(grant.bridge("br-eth0").is_ok());
        assert!(grant.bridge("virbr0").is_err());
    }

    #[tokio::test]
    async fn without_the_grant_everything_is_access_denied_before_netlink() {
        let mut ctx = BridgeCtx::new(None, Arc::new(HostNetwork), None, Denials::default());
        let denied = ctx.devices().await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("[grants.bridge]")));
        let mut partial = BridgeCtx::new(
            Some(BridgeGrant { devices: vec!["eth0".into()], bridges: vec![] }),
            Arc::new(HostNetwork),
            None,
            Denials::default(),
        );
        let change = wit::DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        let denied = partial.bridge(vec![change]).await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("bridge \"br-eth0\"")));
        assert_eq!(partial.bridge_name("eth0".into()).await.unwrap(), "br-eth0");
    }
}
