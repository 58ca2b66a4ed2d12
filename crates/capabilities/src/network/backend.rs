//! What bridging acts on, as one trait: the host's kernel over netlink
//! ([`HostNetwork`]), or a simulated network ([`SimNetwork`], the conformance
//! kit). Both behave alike; a grant is checked before either is reached. The
//! bridge capability and HostPreparer both act through it.

use super::netlink::Netlink;
use super::owners::DeviceOwners;
use super::simulated::SimNetwork;
use super::{BridgeError, Device, DeviceToBridge};
use futures_util::future::BoxFuture;
use std::sync::Arc;

/// A host network's devices, and the changes bridging makes to them.
pub trait NetworkBackend: Send + Sync + 'static {
    /// Every device with its addresses, MAC, MTU and controller.
    fn devices(&self) -> BoxFuture<'_, Result<Vec<Device>, BridgeError>>;
    /// Move `change.device` into a new bridge (its MAC and addresses go with it).
    fn bridge<'a>(&'a self, change: &'a DeviceToBridge) -> BoxFuture<'a, Result<(), BridgeError>>;
    /// Undo [`NetworkBackend::bridge`]: the addresses go back to the device, the bridge is deleted.
    fn unbridge<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>>;
    /// A veth pair: `name` attached to `bridge` and up, `peer` up and left for the instance.
    fn create_veth<'a>(
        &'a self,
        name: &'a str,
        peer: &'a str,
        bridge: &'a str,
    ) -> BoxFuture<'a, Result<(), BridgeError>>;
    /// A tap on `bridge`, owned by `owner` (root if `None`).
    fn create_tap<'a>(
        &'a self,
        name: &'a str,
        bridge: &'a str,
        mac: &'a str,
        owner: Option<u32>,
    ) -> BoxFuture<'a, Result<(), BridgeError>>;
    /// Attach an existing device (a tap, a veth) to `bridge` and bring it up.
    fn attach<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>>;
    /// Delete a veth, or a tap that is `owner`'s (root's if `None`) or no one's.
    fn delete_owned<'a>(&'a self, name: &'a str, owner: Option<u32>) -> BoxFuture<'a, Result<(), BridgeError>>;
    /// Delete a device (a veth's peer goes too), whoever owns it.
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), BridgeError>>;

    /// The device named `name`, if there is one.
    fn device<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Device>, BridgeError>> {
        Box::pin(async move { Ok(self.devices().await?.into_iter().find(|d| d.name == name)) })
    }

    /// The record of which provider made which device (`None`: none is kept
    /// here, and the bridge capability lets a provider make or change nothing).
    fn owners(&self) -> Option<Arc<dyn DeviceOwners>> {
        None
    }
}

/// The host's kernel, in the host's network namespace: each call on a fresh
/// netlink connection, so nothing is held between a provider's calls.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostNetwork;

impl NetworkBackend for HostNetwork {
    fn devices(&self) -> BoxFuture<'_, Result<Vec<Device>, BridgeError>> {
        Box::pin(async { Netlink::connect()?.devices().await })
    }

    fn bridge<'a>(&'a self, change: &'a DeviceToBridge) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.bridge(change).await })
    }

    fn unbridge<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.unbridge(device, bridge).await })
    }

    fn create_veth<'a>(
        &'a self,
        name: &'a str,
        peer: &'a str,
        bridge: &'a str,
    ) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.create_veth(name, peer, bridge).await })
    }

    fn create_tap<'a>(
        &'a self,
        name: &'a str,
        bridge: &'a str,
        mac: &'a str,
        owner: Option<u32>,
    ) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.create_tap_owned(name, bridge, mac, owner).await })
    }

    fn attach<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.attach(device, bridge).await })
    }

    fn delete_owned<'a>(&'a self, name: &'a str, owner: Option<u32>) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.delete_owned(name, owner).await })
    }

    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { Netlink::connect()?.delete(name).await })
    }
}

/// The simulation answers at once; a tap's owner uid is not modelled, the
/// record of which provider made which device is (in memory).
impl NetworkBackend for SimNetwork {
    fn devices(&self) -> BoxFuture<'_, Result<Vec<Device>, BridgeError>> {
        Box::pin(async { Ok(SimNetwork::devices(self)) })
    }

    fn bridge<'a>(&'a self, change: &'a DeviceToBridge) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::bridge(self, change) })
    }

    fn unbridge<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::unbridge(self, device, bridge) })
    }

    fn create_veth<'a>(
        &'a self,
        name: &'a str,
        peer: &'a str,
        bridge: &'a str,
    ) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::create_veth(self, name, peer, bridge) })
    }

    fn create_tap<'a>(
        &'a self,
        name: &'a str,
        bridge: &'a str,
        mac: &'a str,
        owner: Option<u32>,
    ) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::create_tap(self, name, bridge, mac, owner) })
    }

    fn attach<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::attach(self, device, bridge) })
    }

    fn delete_owned<'a>(&'a self, name: &'a str, _owner: Option<u32>) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::delete(self, name) })
    }

    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        Box::pin(async move { SimNetwork::delete(self, name) })
    }

    fn owners(&self) -> Option<Arc<dyn DeviceOwners>> {
        Some(self.owners.clone())
    }
}
