//! Who made each device and bridge that providers made through the
//! `network-bridge` capability: the record the capability checks before it
//! lets a provider touch a device. A device no record names is the host's
//! (its NICs, HostPreparer's bridges, what the operator made).
//!
//! On the host the record is the store's (`device_owners`, surviving
//! restarts, written before the device is made); in the conformance kit and
//! in tests it is [`MemoryOwners`]. A backend without one
//! ([`super::backend::HostNetwork`] alone) lets a provider make nothing.

use super::backend::NetworkBackend;
use super::{BridgeError, Device, DeviceToBridge};
use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// One device a provider made, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedDevice {
    /// The provider that made it.
    pub provider: String,
    /// `tap`, `veth` or `bridge`.
    pub kind: String,
    /// A veth's other end (recorded too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
}

impl OwnedDevice {
    /// A record of `provider`'s `kind` of device.
    pub fn new(provider: &str, kind: &str, peer: Option<&str>) -> OwnedDevice {
        OwnedDevice { provider: provider.to_owned(), kind: kind.to_owned(), peer: peer.map(str::to_owned) }
    }
}

/// The record could not be read or written.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the host's record of who owns network devices: {0}")]
pub struct OwnersError(pub String);

/// The record of which provider made which device.
pub trait DeviceOwners: Send + Sync + 'static {
    /// The record of `name`, if a provider made it.
    fn owner(&self, name: &str) -> Result<Option<OwnedDevice>, OwnersError>;
    /// Every device recorded as `provider`'s.
    fn owned_by(&self, provider: &str) -> Result<Vec<(String, OwnedDevice)>, OwnersError>;
    /// Record `devices` (each a name and its record, all of one provider's),
    /// all or none: when one is recorded for another provider nothing is
    /// written and that name and provider are answered. Durable when done.
    fn claim(
        &self,
        devices: Vec<(String, OwnedDevice)>,
    ) -> BoxFuture<'static, Result<Option<(String, String)>, OwnersError>>;
    /// Drop the records of `names` that are `provider`'s (others are left).
    fn release(&self, provider: &str, names: Vec<String>) -> BoxFuture<'static, Result<(), OwnersError>>;
}

/// The record in memory: for the conformance kit and tests.
#[derive(Debug, Default)]
pub struct MemoryOwners {
    devices: Mutex<BTreeMap<String, OwnedDevice>>,
}

impl MemoryOwners {
    /// A record that already names `devices` (name, provider): the kit's
    /// script seeds what other providers made.
    pub fn seeded(devices: impl IntoIterator<Item = (String, OwnedDevice)>) -> MemoryOwners {
        MemoryOwners { devices: Mutex::new(devices.into_iter().collect()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, OwnedDevice>> {
        self.devices.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl DeviceOwners for MemoryOwners {
    fn owner(&self, name: &str) -> Result<Option<OwnedDevice>, OwnersError> {
        Ok(self.lock().get(name).cloned())
    }

    fn owned_by(&self, provider: &str) -> Result<Vec<(String, OwnedDevice)>, OwnersError> {
        Ok(self.lock().iter().filter(|(_, o)| o.provider == provider).map(|(n, o)| (n.clone(), o.clone())).collect())
    }

    fn claim(
        &self,
        devices: Vec<(String, OwnedDevice)>,
    ) -> BoxFuture<'static, Result<Option<(String, String)>, OwnersError>> {
        let mut table = self.lock();
        let taken = devices.iter().find_map(|(name, wanted)| {
            table
                .get(name)
                .filter(|had| had.provider != wanted.provider)
                .map(|had| (name.clone(), had.provider.clone()))
        });
        if taken.is_none() {
            table.extend(devices);
        }
        Box::pin(std::future::ready(Ok(taken)))
    }

    fn release(&self, provider: &str, names: Vec<String>) -> BoxFuture<'static, Result<(), OwnersError>> {
        let mut table = self.lock();
        for name in names {
            if table.get(&name).is_some_and(|o| o.provider == provider) {
                table.remove(&name);
            }
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

/// A network with its record of owners: what the bridge capability acts on
/// on the host (the kernel and the store's record) and in a recorded kit run.
pub struct OwnedNetwork {
    network: Arc<dyn NetworkBackend>,
    owners: Arc<dyn DeviceOwners>,
}

impl OwnedNetwork {
    /// `network`, its owners recorded in `owners`.
    pub fn new(network: Arc<dyn NetworkBackend>, owners: Arc<dyn DeviceOwners>) -> OwnedNetwork {
        OwnedNetwork { network, owners }
    }
}

impl NetworkBackend for OwnedNetwork {
    fn devices(&self) -> BoxFuture<'_, Result<Vec<Device>, BridgeError>> {
        self.network.devices()
    }

    fn bridge<'a>(&'a self, change: &'a DeviceToBridge) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.bridge(change)
    }

    fn unbridge<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.unbridge(device, bridge)
    }

    fn create_veth<'a>(
        &'a self,
        name: &'a str,
        peer: &'a str,
        bridge: &'a str,
    ) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.create_veth(name, peer, bridge)
    }

    fn create_tap<'a>(
        &'a self,
        name: &'a str,
        bridge: &'a str,
        mac: &'a str,
        owner: Option<u32>,
    ) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.create_tap(name, bridge, mac, owner)
    }

    fn attach<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.attach(device, bridge)
    }

    fn delete_owned<'a>(&'a self, name: &'a str, owner: Option<u32>) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.delete_owned(name, owner)
    }

    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
        self.network.delete(name)
    }

    fn device<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Device>, BridgeError>> {
        self.network.device(name)
    }

    fn owners(&self) -> Option<Arc<dyn DeviceOwners>> {
        Some(self.owners.clone())
    }
}

/// What removing a provider did to the devices it made.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Deleted.
    pub deleted: Vec<String>,
    /// Left in place, each with why (a bridge that carries a device of the
    /// host's, a device that could not be deleted); no longer recorded.
    pub left: Vec<String>,
}

/// Delete what `provider` made (taps and veths, then its bridges, unless a
/// device not its own hangs off one) and drop its records: for its removal.
/// A device already gone is only forgotten.
pub async fn release_provider(network: &dyn NetworkBackend, provider: &str) -> Result<Released, OwnersError> {
    let Some(owners) = network.owners() else { return Ok(Released::default()) };
    let owned = owners.owned_by(provider)?;
    if owned.is_empty() {
        return Ok(Released::default());
    }
    let devices = network.devices().await.map_err(|e| OwnersError(format!("cannot list devices: {e}")))?;
    let mut released = Released::default();
    let mut gone: Vec<String> = Vec::new();
    // Bridges last: what hangs off them goes first.
    let (bridges, others): (Vec<_>, Vec<_>) = owned.iter().partition(|(_, o)| o.kind == "bridge");
    for (name, _) in others.into_iter().chain(bridges) {
        if gone.contains(name) || !devices.iter().any(|d| &d.name == name) {
            continue;
        }
        let foreign = devices
            .iter()
            .filter(|d| d.controller.as_deref() == Some(name.as_str()) && !gone.contains(&d.name))
            .find(|d| !owned.iter().any(|(mine, _)| *mine == d.name));
        if let Some(foreign) = foreign {
            released.left.push(format!("{name}: it carries {}, which is not the provider's", foreign.name));
            continue;
        }
        match network.delete(name).await {
            Ok(()) => {
                released.deleted.push(name.clone());
                gone.push(name.clone());
                if let Some(peer) = owned.iter().find(|(n, _)| n == name).and_then(|(_, o)| o.peer.clone()) {
                    gone.push(peer);
                }
            }
            Err(error) => released.left.push(format!("{name}: {error}")),
        }
    }
    owners.release(provider, owned.into_iter().map(|(name, _)| name).collect()).await?;
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_claim_is_all_or_nothing_and_a_release_only_drops_ones_own() {
        let owners = MemoryOwners::default();
        let tap = |p: &str| OwnedDevice::new(p, "tap", None);
        assert_eq!(owners.claim(vec![("kt1".into(), tap("a"))]).await.unwrap(), None);
        assert_eq!(owners.claim(vec![("kt1".into(), tap("a"))]).await.unwrap(), None, "again: its own");
        let refused = owners.claim(vec![("kt2".into(), tap("b")), ("kt1".into(), tap("b"))]).await.unwrap();
        assert_eq!(refused, Some(("kt1".into(), "a".into())));
        assert_eq!(owners.owner("kt2").unwrap(), None, "nothing of a refused claim is written");
        owners.release("b", vec!["kt1".into()]).await.unwrap();
        assert_eq!(owners.owner("kt1").unwrap(), Some(tap("a")), "b cannot drop a's record");
        owners.release("a", vec!["kt1".into()]).await.unwrap();
        assert_eq!(owners.owner("kt1").unwrap(), None);
    }
}
