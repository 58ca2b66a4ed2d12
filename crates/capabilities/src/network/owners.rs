//! Who made each device and bridge that providers made through the
//! `network-bridge` capability: the record the capability checks before it
//! lets a provider touch a device. A device no record names is the host's
//! (its NICs, HostPreparer's bridges, what the operator made).
//!
//! On the host the record is the store's (`device_owners`, surviving
//! restarts, written before the device is made); in the conformance kit and
//! in tests it is [`MemoryOwners`]. A backend without one
//! ([`super::backend::HostNetwork`] alone) lets a provider make nothing.
//!
//! A name is not a device: a record also holds the boot the device was made
//! in and, once made, the kernel's index of it. A record of another boot, or
//! one whose name now belongs to a device of another index, names nothing the
//! provider made: it is forgotten where it is met ([`settled_owner`]), and the
//! device under the name is the host's.

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
    /// The boot it was made in ([`super::boot_id`]); `None` in records
    /// written before boots were, taken as this boot's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
    /// The kernel's index of it once made; `None` while it is being made (and
    /// in records written before indexes were).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
}

impl OwnedDevice {
    /// A record of `provider`'s `kind` of device, about to be made in this boot.
    pub fn new(provider: &str, kind: &str, peer: Option<&str>) -> OwnedDevice {
        OwnedDevice {
            provider: provider.to_owned(),
            kind: kind.to_owned(),
            peer: peer.map(str::to_owned),
            boot: super::boot_id().map(str::to_owned),
            index: None,
        }
    }

    /// Whether the record still names `device`, what is under its name now
    /// (`None`: nothing): not when it was made in another boot (no device the
    /// host makes outlives one), nor when the device there has another index
    /// (it was deleted and the name taken again). Indexes are not reused
    /// within a boot; a simulated device without one (0) is not compared.
    pub fn names(&self, device: Option<&Device>) -> bool {
        let same_boot = match (self.boot.as_deref(), super::boot_id()) {
            (Some(made), Some(now)) => made == now,
            _ => true,
        };
        let same_device = match (self.index, device) {
            (Some(index), Some(device)) => device.index == 0 || device.index == index,
            _ => true,
        };
        same_boot && same_device
    }
}

/// The record of `name` if it names `device`, what is under the name now
/// (see [`OwnedDevice::names`]). A record that names something else is
/// forgotten, so the device there is the host's; a record of a device made
/// since it was written gets the device's index and this boot.
pub async fn settled_owner(
    owners: &dyn DeviceOwners,
    name: &str,
    device: Option<&Device>,
) -> Result<Option<OwnedDevice>, OwnersError> {
    let Some(record) = owners.owner(name)? else { return Ok(None) };
    if !record.names(device) {
        owners.replace(name, &record, None).await?;
        tracing::info!(
            device = name,
            provider = %crate::error_text::escape_unprintable(&record.provider),
            "forgot a stale record of a device: it was made in another boot, or the name is another device's now"
        );
        return Ok(None);
    }
    match device.filter(|d| d.index != 0) {
        Some(device) if record.index != Some(device.index) || record.boot.is_none() => {
            let settled =
                OwnedDevice { index: Some(device.index), boot: super::boot_id().map(str::to_owned), ..record.clone() };
            owners.replace(name, &record, Some(settled.clone())).await?;
            Ok(Some(settled))
        }
        _ => Ok(Some(record)),
    }
}

/// Take as `provider`'s a tap that no record names and that only `user`, its
/// programs' user, may attach to: one the host made for it before the host
/// recorded owners (only a privileged process sets a tap's owner, and a
/// provider's user is its alone unless `[sandbox] user` makes one user of
/// all). Whether it was taken.
pub(crate) async fn adopt_tap(
    owners: &dyn DeviceOwners,
    provider: &str,
    device: &Device,
    user: Option<u32>,
) -> Result<bool, OwnersError> {
    let Some(user) = user.filter(|uid| *uid != 0) else { return Ok(false) };
    if device.kind != "tun" || device.tun_owner != Some(user) || owners.owner(&device.name)?.is_some() {
        return Ok(false);
    }
    let record =
        OwnedDevice { index: (device.index != 0).then_some(device.index), ..OwnedDevice::new(provider, "tap", None) };
    let taken = owners.claim(vec![(device.name.clone(), record)]).await?.is_none();
    if taken {
        tracing::info!(
            provider = %crate::error_text::escape_unprintable(provider),
            device = %device.name,
            "adopted a tap made for the provider's user before the host recorded who made devices"
        );
    }
    Ok(taken)
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
    /// Replace the record of `name` with `now` (`None`: drop it) if it is
    /// still `was`; whether it was.
    fn replace(
        &self,
        name: &str,
        was: &OwnedDevice,
        now: Option<OwnedDevice>,
    ) -> BoxFuture<'static, Result<bool, OwnersError>>;
    /// Every record (for pruning the stale ones).
    fn all(&self) -> Result<Vec<(String, OwnedDevice)>, OwnersError>;
}

/// The record in memory: for the conformance kit and tests.
#[derive(Debug, Default)]
pub struct MemoryOwners {
    devices: Mutex<BTreeMap<String, OwnedDevice>>,
}

impl MemoryOwners {
    /// A record that already names `devices` (name, provider): the kit's
    /// script seeds what other providers made.
    pub(crate) fn seeded(devices: impl IntoIterator<Item = (String, OwnedDevice)>) -> MemoryOwners {
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

    fn replace(
        &self,
        name: &str,
        was: &OwnedDevice,
        now: Option<OwnedDevice>,
    ) -> BoxFuture<'static, Result<bool, OwnersError>> {
        let mut table = self.lock();
        let still = table.get(name) == Some(was);
        if still {
            match now {
                Some(now) => table.insert(name.to_owned(), now),
                None => table.remove(name),
            };
        }
        Box::pin(std::future::ready(Ok(still)))
    }

    fn all(&self) -> Result<Vec<(String, OwnedDevice)>, OwnersError> {
        Ok(self.lock().iter().map(|(n, o)| (n.clone(), o.clone())).collect())
    }
}

/// Forget every record that names no device the provider made (made in
/// another boot, its name now another device's, or a claim whose device was
/// never made): at the daemon's start.
/// How many were forgotten.
pub async fn prune_stale(network: &dyn NetworkBackend) -> Result<usize, OwnersError> {
    let Some(owners) = network.owners() else { return Ok(0) };
    let records = owners.all()?;
    if records.is_empty() {
        return Ok(0);
    }
    let devices = network.devices().await.map_err(|e| OwnersError(format!("cannot list devices: {e}")))?;
    let mut forgotten = 0;
    for (name, record) in records {
        let device = devices.iter().find(|d| d.name == name);
        // A claim never completed (a crash between it and the make) names
        // nothing: dropped, or a device made later under the name would be taken for it.
        let unmade = record.index.is_none() && device.is_none();
        if (!record.names(device) || unmade) && owners.replace(&name, &record, None).await? {
            forgotten += 1;
        } else if device.is_some() {
            // Written before records held indexes: the device there now gets its index.
            settled_owner(&*owners, &name, device).await?;
        }
    }
    Ok(forgotten)
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
    for (name, record) in others.into_iter().chain(bridges) {
        let device = devices.iter().find(|d| &d.name == name);
        // Gone, or what is there now is not what it made (another boot's record): only forgotten.
        if gone.contains(name) || device.is_none() || !record.names(device) {
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
