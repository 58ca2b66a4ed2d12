//! `broker:provider/network-bridge` for guests: the host's bridger
//! ([`crate::network`]), limited to the devices and bridges the manifest
//! grants, and of those to what the provider made itself.
//!
//! Every tap, veth (both ends) and bridge a provider makes is recorded as its
//! own before it is made ([`crate::network::owners`]; on the host, in the
//! store). A provider may attach, detach, bridge, unbridge or delete only
//! what it owns; it may also attach its own devices to host bridges its grant
//! names under `attach-to` (nothing else is done to those). A device no
//! record names is the host's: moving a host device's addresses and routes
//! is HostPreparer's act, never a provider's. Refusals are `access-denied`,
//! naming the owner, and are noted as any other refusal (the kit's
//! "no call touches an ungranted capability").

pub mod kit;

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::network_bridge::{self as wit};
use crate::error_text::escape_unprintable;
use crate::network::backend::HostNetwork;
use crate::network::backend::NetworkBackend;
use crate::network::owners::{DeviceOwners, OwnedDevice, adopt_tap, settled_owner};
use crate::network::{BridgeError, Device, DeviceToBridge, check_name, names};
use crate::rooms::HasRooms;
use crate::rooms::denials::Denials;
use crate::rooms::{GrantLine, GrantValue, Linking, Room, StoreSetup};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::sync::Arc;
use wasmtime::component::{HasSelf, Linker};

/// Its interface in the contract package.
pub(crate) const INTERFACE: &str = "network-bridge";

/// `[grants.bridge]`: names, or prefixes when they end in `*`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeGrant {
    /// Devices the provider may make (taps, veths) and act on.
    #[serde(default)]
    pub devices: Vec<String>,
    /// Bridges the provider may make, attach to or remove (its own only).
    #[serde(default)]
    pub bridges: Vec<String>,
    /// Host bridges (ones no provider made: HostPreparer's, the operator's)
    /// it may attach its own devices to; nothing else is done to them.
    #[serde(default, rename = "attach-to", skip_serializing_if = "Vec::is_empty")]
    pub(crate) attach_to: Vec<String>,
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
        matches(&self.devices, name) || matches(&self.bridges, name) || matches(&self.attach_to, name)
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

    /// A bridge to attach to: one it may make (`bridges`) or a host bridge named under `attach-to`.
    fn attachable(&self, name: &str) -> Result<(), BrokerError> {
        if matches(&self.bridges, name) || matches(&self.attach_to, name) {
            Ok(())
        } else {
            Err(BrokerError::AccessDenied(format!(
                "bridge {name:?} is not granted: add it to `bridges` (its own) or `attach-to` (the host's) under [grants.bridge]"
            )))
        }
    }
}

/// Per-store context; the default grants nothing and reaches nothing.
#[derive(Default)]
pub struct BridgeCtx {
    /// The provider whose store this is: what it makes is recorded as its own.
    provider: Arc<str>,
    /// `None` without a `[grants.bridge]`.
    grant: Option<BridgeGrant>,
    /// `None` without the grant, or in a sandbox that gives no network.
    network: Option<Arc<dyn NetworkBackend>>,
    /// The sandbox user of the provider's programs, given the taps it makes
    /// (`TUNSETOWNER`), so its confined qemu may open them; `None`: root's.
    tap_owner: Option<u32>,
    denials: Denials,
}

/// Where a device stands for the provider asking.
enum Standing {
    /// Recorded as the asking provider's (`Some`: it exists now).
    Ours(OwnedDevice, Option<Device>),
    /// Recorded as another provider's.
    Theirs(OwnedDevice),
    /// Exists and no provider made it: the host's.
    Host(Device),
    /// Neither recorded nor there.
    Absent,
}

/// What a device is called in a refusal.
fn kind_word(kind: &str) -> &'static str {
    match kind {
        "tun" | "tap" => "tap",
        "veth" => "veth",
        "bridge" => "bridge",
        _ => "device",
    }
}

fn denied(message: String) -> BrokerError {
    BrokerError::AccessDenied(message)
}

fn owners_failed(error: crate::network::owners::OwnersError) -> BrokerError {
    BrokerError::Provider(error.to_string())
}

/// Names are checked before any record is read or written.
fn valid_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), BrokerError> {
    names.into_iter().try_for_each(|name| check_name(name).map_err(to_broker_error))
}

/// What one call acts through: the network and its record of owners, for one provider.
struct Acting {
    network: Arc<dyn NetworkBackend>,
    owners: Arc<dyn DeviceOwners>,
    provider: Arc<str>,
    devices: Vec<Device>,
}

impl Acting {
    fn standing(&self, name: &str) -> Result<Standing, BrokerError> {
        let device = self.devices.iter().find(|d| d.name == name).cloned();
        Ok(match (self.owners.owner(name).map_err(owners_failed)?, device) {
            (Some(record), device) if record.provider == *self.provider => Standing::Ours(record, device),
            (Some(record), _) => Standing::Theirs(record),
            (None, Some(device)) => Standing::Host(device),
            (None, None) => Standing::Absent,
        })
    }

    fn theirs(&self, name: &str, owner: &OwnedDevice) -> BrokerError {
        denied(format!(
            "{} {name} belongs to provider {}, not to {}",
            kind_word(&owner.kind),
            escape_unprintable(&owner.provider),
            escape_unprintable(&self.provider)
        ))
    }

    /// `name` must be the provider's own (or absent, for the backend to say
    /// so); `act` says what a device of the host's is refused for.
    fn own(&self, name: &str, act: &str) -> Result<Standing, BrokerError> {
        match self.standing(name)? {
            Standing::Theirs(owner) => Err(self.theirs(name, &owner)),
            Standing::Host(device) => Err(denied(format!(
                "{} {name} is the host's, not made by provider {}: {act}",
                kind_word(&device.kind),
                escape_unprintable(&self.provider)
            ))),
            standing => Ok(standing),
        }
    }

    /// A bridge to attach a device of the provider's to: its own (granted
    /// under `bridges`), or a host bridge named under `attach-to`.
    fn attachable(&self, grant: &BridgeGrant, bridge: &str) -> Result<(), BrokerError> {
        match self.standing(bridge)? {
            Standing::Ours(..) => grant.bridge(bridge),
            Standing::Theirs(owner) => Err(self.theirs(bridge, &owner)),
            Standing::Host(_) if matches(&grant.attach_to, bridge) => Ok(()),
            Standing::Host(device) => Err(denied(format!(
                "{} {bridge} is the host's: a provider attaches to a host bridge only if `attach-to` under [grants.bridge] names it",
                kind_word(&device.kind)
            ))),
            // Not there: the backend says so.
            Standing::Absent => Ok(()),
        }
    }

    /// A name to make a device under: absent, or already the provider's.
    fn makeable(&self, name: &str) -> Result<bool, BrokerError> {
        match self.standing(name)? {
            Standing::Ours(_, device) => Ok(device.is_some()),
            Standing::Absent => self.not_reserved(name).map(|()| false),
            Standing::Theirs(owner) => Err(self.theirs(name, &owner)),
            Standing::Host(device) => Err(denied(format!(
                "{} {name} exists and is the host's: a provider makes only devices of its own",
                kind_word(&device.kind)
            ))),
        }
    }

    /// `name` is not the one HostPreparer gives the bridge of a device that
    /// is not the provider's (Juju's `br-<device>`): a provider that took it
    /// first would stand in for the host's bridge.
    fn not_reserved(&self, name: &str) -> Result<(), BrokerError> {
        let hosts = self.devices.iter().filter(|d| crate::network::names::bridge_name(&d.name) == name);
        for device in hosts {
            if !matches!(self.standing(&device.name)?, Standing::Ours(..)) {
                return Err(denied(format!(
                    "{name} is the name the host gives the bridge of {} (HostPreparer): a provider cannot take it",
                    device.name
                )));
            }
        }
        Ok(())
    }

    /// Settle what the host knows of `names` before a call reads it: a
    /// record of another boot, or of a device since replaced, is forgotten;
    /// a device made since its record gets its index; and a tap made for
    /// the provider's user before owners were recorded is taken as its own.
    async fn settle(&self, names: &[&str], tap_owner: Option<u32>) -> Result<(), BrokerError> {
        for name in names {
            let device = self.devices.iter().find(|d| d.name == *name);
            let owner = settled_owner(&*self.owners, name, device).await.map_err(owners_failed)?;
            if let (None, Some(device)) = (owner, device) {
                adopt_tap(&*self.owners, &self.provider, device, tap_owner).await.map_err(owners_failed)?;
            }
        }
        Ok(())
    }

    /// After a make: the records of `names` get the indexes of what was made.
    async fn made(&self, names: &[&str]) {
        let Ok(devices) = self.network.devices().await else { return };
        for name in names {
            let device = devices.iter().find(|d| d.name == *name);
            if let Err(error) = settled_owner(&*self.owners, name, device).await {
                tracing::warn!(provider = &*self.provider, device = name, %error, "cannot record a made device's index");
            }
        }
    }

    /// Record `names` as the provider's before they are made.
    async fn claim(&self, names: Vec<(String, OwnedDevice)>) -> Result<(), BrokerError> {
        match self.owners.claim(names).await.map_err(owners_failed)? {
            None => Ok(()),
            Some((name, provider)) => {
                let kind = self.owners.owner(&name).ok().flatten().map_or_else(|| "device".to_owned(), |o| o.kind);
                Err(self.theirs(&name, &OwnedDevice::new(&provider, &kind, None)))
            }
        }
    }

    /// After a failed make: drop the records of `names`. Even of one that is
    /// there now: what appeared under the name while the make failed is not
    /// known to be the provider's (a device it did make is then the host's to clean).
    async fn unclaim(&self, names: &[&str]) {
        let claimed: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        if let Err(error) = self.owners.release(&self.provider, claimed).await {
            tracing::warn!(provider = &*self.provider, %error, "cannot drop the record of a device that was not made");
        }
    }

    async fn release(&self, names: Vec<String>) -> Result<(), BrokerError> {
        self.owners.release(&self.provider, names).await.map_err(owners_failed)
    }
}

impl BridgeCtx {
    pub(crate) fn new(
        provider: Arc<str>,
        grant: Option<BridgeGrant>,
        network: Option<Arc<dyn NetworkBackend>>,
        tap_owner: Option<u32>,
        denials: Denials,
    ) -> Self {
        BridgeCtx { provider, grant, network, tap_owner, denials }
    }

    /// The grant and the network it acts on, once `names` are all granted
    /// (`names` checks each name against the grant).
    fn granted(
        &self,
        names: impl FnOnce(&BridgeGrant) -> Result<(), BrokerError>,
    ) -> Result<(&BridgeGrant, Arc<dyn NetworkBackend>), BrokerError> {
        let grant = self.grant.as_ref().ok_or_else(|| {
            BrokerError::AccessDenied(
                "network-bridge is not granted: add [grants.bridge] with devices and bridges".into(),
            )
        })?;
        let network = self.network.clone().ok_or_else(|| {
            BrokerError::AccessDenied(
                "network-bridge has no backend here: this sandbox gives the provider no network".into(),
            )
        })?;
        names(grant)?;
        Ok((grant, network))
    }

    /// As [`BridgeCtx::granted`], a refusal noted and answered to the guest.
    fn checked(
        &self,
        names: impl FnOnce(&BridgeGrant) -> Result<(), BrokerError>,
    ) -> Result<(&BridgeGrant, Arc<dyn NetworkBackend>), BrokerError> {
        self.granted(names).map_err(|refused| self.noted(refused))
    }

    /// A refusal noted (an `access-denied`), any error passed on.
    fn noted(&self, error: BrokerError) -> BrokerError {
        self.denials.refuse("network-bridge", error)
    }

    /// For a call that makes or changes something: the names granted and
    /// valid, the network with its record of owners and its devices now.
    async fn acting(
        &self,
        names: &[&str],
        granted: impl FnOnce(&BridgeGrant) -> Result<(), BrokerError>,
    ) -> Result<(BridgeGrant, Acting), BrokerError> {
        // Refusals are noted once, as the call answers.
        let (grant, network) = self.granted(granted)?;
        let grant = grant.clone();
        valid_names(names.iter().copied())?;
        let owners = network.owners().ok_or_else(|| {
            denied(
                "network-bridge keeps no record of who owns devices here: a provider can make or change nothing".into(),
            )
        })?;
        let devices = network.devices().await.map_err(to_broker_error)?;
        let acting = Acting { network, owners, provider: self.provider.clone(), devices };
        acting.settle(names, self.tap_owner).await?;
        Ok((grant, acting))
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

/// A call's outcome for the guest, a refusal noted.
macro_rules! answer {
    ($ctx:expr, $body:expr) => {{
        let outcome: Result<_, BrokerError> = $body;
        Ok(outcome.map_err(|e| $ctx.noted(e)))
    }};
}

impl wit::Host for BridgeCtx {
    async fn devices(&mut self) -> WitResult<Vec<wit::Device>> {
        let (grant, network) = match self.checked(|_| Ok(())) {
            Ok((grant, network)) => (grant.clone(), network),
            Err(refused) => return Ok(Err(refused)),
        };
        let all = network.devices().await.map_err(to_broker_error);
        Ok(all.map(|devices| devices.into_iter().filter(|d| grant.covers(&d.name)).map(to_wit).collect()))
    }

    async fn bridge_name(&mut self, device: String) -> wasmtime::Result<String> {
        Ok(names::bridge_name(&device))
    }

    async fn bridge(&mut self, changes: Vec<wit::DeviceToBridge>) -> WitResult<()> {
        answer!(self, self.bridge_own(changes).await)
    }

    async fn unbridge(&mut self, device: String, bridge: String) -> WitResult<()> {
        answer!(self, self.unbridge_own(&device, &bridge).await)
    }

    async fn create_veth(&mut self, name: String, peer: String, bridge: String) -> WitResult<()> {
        answer!(self, self.create_veth_own(&name, &peer, &bridge).await)
    }

    async fn create_tap(&mut self, name: String, bridge: String, mac: String) -> WitResult<()> {
        answer!(self, self.create_tap_own(&name, &bridge, &mac).await)
    }

    async fn attach(&mut self, device: String, bridge: String) -> WitResult<()> {
        answer!(self, self.attach_own(&device, &bridge).await)
    }

    async fn delete_link(&mut self, name: String) -> WitResult<()> {
        answer!(self, self.delete_own(&name).await)
    }
}

impl BridgeCtx {
    /// Each device must be the provider's own; each bridge its own or made
    /// now (and recorded as its own first). A host device is HostPreparer's
    /// to bridge, and a host bridge takes no addresses from a provider.
    async fn bridge_own(&self, changes: Vec<wit::DeviceToBridge>) -> Result<(), BrokerError> {
        let names: Vec<&str> = changes.iter().flat_map(|c| [c.device.as_str(), c.bridge.as_str()]).collect();
        let (_, acting) = self
            .acting(&names, |grant| {
                changes.iter().try_for_each(|c| grant.device(&c.device).and_then(|_| grant.bridge(&c.bridge)))
            })
            .await?;
        for c in changes {
            acting.own(
                &c.device,
                "moving a host device's addresses and routes into a bridge is the host's act (HostPreparer), never a provider's",
            )?;
            let made_now = match acting.standing(&c.bridge)? {
                Standing::Ours(_, Some(_)) => false,
                Standing::Ours(_, None) => true,
                Standing::Absent => acting.not_reserved(&c.bridge).map(|()| true)?,
                Standing::Theirs(owner) => return Err(acting.theirs(&c.bridge, &owner)),
                Standing::Host(device) => {
                    return Err(denied(format!(
                        "{} {} is the host's: a provider bridges only into bridges it makes (attach to a host bridge with `attach`)",
                        kind_word(&device.kind),
                        c.bridge
                    )));
                }
            };
            if made_now {
                acting.claim(vec![(c.bridge.clone(), OwnedDevice::new(&acting.provider, "bridge", None))]).await?;
            }
            let change = DeviceToBridge { device: c.device, bridge: c.bridge, mac: c.mac };
            if let Err(e) = acting.network.bridge(&change).await {
                if made_now {
                    acting.unclaim(&[&change.bridge]).await;
                }
                return Err(to_broker_error(e));
            }
            if made_now {
                acting.made(&[&change.bridge]).await;
            }
        }
        Ok(())
    }

    /// Both must be the provider's, and so must everything in the bridge:
    /// then the addresses on it (which only its own devices can have
    /// brought) go back to the device, and the bridge is deleted.
    async fn unbridge_own(&self, device: &str, bridge: &str) -> Result<(), BrokerError> {
        let (_, acting) = self.acting(&[device, bridge], |g| g.device(device).and_then(|_| g.bridge(bridge))).await?;
        let host_act = "unbridging (moving addresses and routes back) is the host's act on what the host made (HostPreparer), never a provider's";
        acting.own(device, host_act)?;
        // Recorded but gone, or never there: the backend says which.
        if let Standing::Ours(_, Some(br)) = acting.own(bridge, host_act)? {
            let foreign = acting
                .devices
                .iter()
                .filter(|d| d.controller.as_deref() == Some(br.name.as_str()))
                .find(|d| !matches!(acting.standing(&d.name), Ok(Standing::Ours(..))));
            if let Some(foreign) = foreign {
                return Err(denied(format!(
                    "bridge {bridge} carries {} {}, which is not provider {}'s: it is not unbridged",
                    kind_word(&foreign.kind),
                    foreign.name,
                    escape_unprintable(&acting.provider)
                )));
            }
        }
        acting.network.unbridge(device, bridge).await.map_err(to_broker_error)?;
        acting.release(vec![bridge.to_owned()]).await
    }

    async fn create_veth_own(&self, name: &str, peer: &str, bridge: &str) -> Result<(), BrokerError> {
        let (grant, acting) = self
            .acting(&[name, peer, bridge], |g| {
                g.device(name).and_then(|_| g.device(peer)).and_then(|_| g.attachable(bridge))
            })
            .await?;
        if name == peer {
            return Err(BrokerError::InvalidParams(format!("a veth's two ends need two names, not {name} twice")));
        }
        acting.makeable(name)?;
        acting.makeable(peer)?;
        acting.attachable(&grant, bridge)?;
        let record = |other: &str| OwnedDevice::new(&acting.provider, "veth", Some(other));
        acting.claim(vec![(name.to_owned(), record(peer)), (peer.to_owned(), record(name))]).await?;
        if let Err(e) = acting.network.create_veth(name, peer, bridge).await {
            acting.unclaim(&[name, peer]).await;
            return Err(to_broker_error(e));
        }
        acting.made(&[name, peer]).await;
        Ok(())
    }

    async fn create_tap_own(&self, name: &str, bridge: &str, mac: &str) -> Result<(), BrokerError> {
        let (grant, acting) =
            self.acting(&[name, bridge], |g| g.device(name).and_then(|_| g.attachable(bridge))).await?;
        let existed = acting.makeable(name)?;
        acting.attachable(&grant, bridge)?;
        if !existed {
            acting.claim(vec![(name.to_owned(), OwnedDevice::new(&acting.provider, "tap", None))]).await?;
        }
        if let Err(e) = acting.network.create_tap(name, bridge, mac, self.tap_owner).await {
            if !existed {
                acting.unclaim(&[name]).await;
            }
            return Err(to_broker_error(e));
        }
        if !existed {
            acting.made(&[name]).await;
        }
        Ok(())
    }

    async fn attach_own(&self, device: &str, bridge: &str) -> Result<(), BrokerError> {
        let (grant, acting) =
            self.acting(&[device, bridge], |g| g.device(device).and_then(|_| g.attachable(bridge))).await?;
        acting.own(device, "a provider attaches only devices it made")?;
        acting.attachable(&grant, bridge)?;
        acting.network.attach(device, bridge).await.map_err(to_broker_error)
    }

    async fn delete_own(&self, name: &str) -> Result<(), BrokerError> {
        let (_, acting) = self.acting(&[name], |g| g.device(name)).await?;
        let (record, device) = match acting.own(name, "a provider deletes only devices it made")? {
            Standing::Ours(record, device) => (record, device),
            _ => return Err(to_broker_error(BridgeError::NoDevice(name.to_owned()))),
        };
        let mut gone: Vec<String> = std::iter::once(name.to_owned()).chain(record.peer.clone()).collect();
        let Some(device) = device else {
            // Gone already (a reboot takes taps): the record goes too.
            acting.release(gone).await?;
            return Err(to_broker_error(BridgeError::NoDevice(name.to_owned())));
        };
        if device.kind != "veth" && device.kind != "tun" {
            return Err(to_broker_error(BridgeError::NotABridge(format!(
                "{name} is not a veth or tap; nothing else is deleted"
            ))));
        }
        acting.network.delete_owned(name, self.tap_owner).await.map_err(to_broker_error)?;
        gone.dedup();
        acting.release(gone).await
    }
}

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut BridgeCtx,
) -> wasmtime::Result<()> {
    // The same in every contract version served: linked under each one's name.
    for instance in crate::bindings::served_instances(INTERFACE) {
        wit::add_to_linker_instance::<T, HasSelf<BridgeCtx>>(&mut linker.instance(&instance)?, getter)?;
    }
    Ok(())
}

/// `[grants.bridge]`: present (even empty) or not.
impl GrantValue for Option<BridgeGrant> {
    fn granted(&self) -> bool {
        self.is_some()
    }

    fn widening(&self, approved: &Self, _key: &str) -> Option<String> {
        let new_item = |now: &[String], before: &[String], what: &str| {
            now.iter().find(|i| !before.contains(i)).map(|i| format!("{what} {i:?}"))
        };
        match (self, approved) {
            (None, _) => None,
            (Some(_), None) => Some("[grants.bridge]".into()),
            (Some(now), Some(before)) => new_item(&now.devices, &before.devices, "bridge device")
                .or_else(|| new_item(&now.bridges, &before.bridges, "bridge"))
                .or_else(|| new_item(&now.attach_to, &before.attach_to, "bridge to attach to")),
        }
    }

    fn shown(&self) -> String {
        shown_list(self.as_ref().map(|g| g.devices.clone()).unwrap_or_default())
    }
}

fn shown_list(items: Vec<String>) -> String {
    if items.is_empty() { "denied".to_owned() } else { items.join(", ") }
}

/// How the API reports the grant (as before rooms): two lists, and the host
/// bridges it may attach to.
const VIEW_DEVICES: &str = "bridge-devices";
const VIEW_BRIDGES: &str = "bridge-bridges";
const VIEW_ATTACH_TO: &str = "bridge-attach-to";

/// The room: `[grants.bridge]`, the devices and bridges a provider may act on
/// through the host's bridger. Linked for every provider (an ungranted call
/// answers `access-denied`); what it makes is recorded as its own, and taps
/// it makes belong to the provider's sandbox user.
pub struct NetworkBridge;

impl Room for NetworkBridge {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "bridge";
    const LINKING: Linking = Linking::Always;
    const KIT: Option<&'static dyn crate::rooms::kit::KitPart> = Some(&kit::BridgeKit);
    type Grant = Option<BridgeGrant>;
    type Backend = dyn NetworkBackend;
    type Ctx = BridgeCtx;
    type Prepared = ();

    fn host_backend() -> Option<Arc<dyn NetworkBackend>> {
        Some(Arc::new(HostNetwork))
    }

    fn ctx(grant: &Option<BridgeGrant>, network: Option<Arc<dyn NetworkBackend>>, store: &StoreSetup<'_>) -> BridgeCtx {
        BridgeCtx::new(store.provider.clone(), grant.clone(), network, store.sandbox_user, store.denials.clone())
    }

    fn add_to_linker<T: HasRooms>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state: &mut T| state.room::<NetworkBridge>().0)
    }

    fn view(grant: &Option<BridgeGrant>) -> Map<String, Value> {
        let grant = grant.clone().unwrap_or_default();
        Map::from_iter([
            (VIEW_DEVICES.to_owned(), Value::from(grant.devices)),
            (VIEW_BRIDGES.to_owned(), Value::from(grant.bridges)),
            (VIEW_ATTACH_TO.to_owned(), Value::from(grant.attach_to)),
        ])
    }

    fn shown_view(view: &Map<String, Value>) -> Vec<GrantLine> {
        let list = |key: &str| view.get(key).and_then(|v| Vec::<String>::deserialize(v).ok());
        [("bridge devices", VIEW_DEVICES), ("bridge bridges", VIEW_BRIDGES), ("bridge attach-to", VIEW_ATTACH_TO)]
            .into_iter()
            .filter_map(|(label, key)| list(key).map(|items| GrantLine::new(key, label, shown_list(items))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::broker::provider::network_bridge::Host;
    use crate::network::DeviceAddress;
    use crate::network::owners::release_provider;
    use crate::network::simulated::SimNetwork;

    fn grant(devices: &[&str], bridges: &[&str], attach_to: &[&str]) -> BridgeGrant {
        let list = |items: &[&str]| items.iter().map(|i| (*i).to_owned()).collect();
        BridgeGrant { devices: list(devices), bridges: list(bridges), attach_to: list(attach_to) }
    }

    #[test]
    fn grants_match_names_and_prefixes() {
        let grant = grant(&["eth0", "vm-*"], &["br-*"], &["lxdbr0"]);
        assert!(grant.device("eth0").is_ok());
        assert!(grant.device("vm-17").is_ok());
        assert!(grant.device("eth1").is_err());
        assert!(grant.device("eth00").is_err());
        assert!(grant.bridge("br-eth0").is_ok());
        assert!(grant.bridge("virbr0").is_err());
        assert!(grant.bridge("lxdbr0").is_err(), "attach-to is not a bridge to make");
        assert!(grant.attachable("lxdbr0").is_ok());
        assert!(grant.attachable("virbr0").is_err());
    }

    /// The room: granted in a sandbox that gives no network, every call is
    /// refused (never the host's kernel); the grant is reported as the API
    /// always did (two lists, and now the bridges to attach to) and shown as
    /// lines; widening names what is new.
    #[tokio::test]
    async fn the_room_refuses_without_a_network_and_reports_its_lists() {
        let provider: Arc<str> = "p".into();
        let (denials, denied) = Denials::collecting();
        let store = StoreSetup {
            provider: &provider,
            data_dir: std::path::Path::new("/nonexistent"),
            denials: &denials,
            acts_outside_the_store: true,
            sandbox_user: None,
            prepared: &Default::default(),
            quotas: &Default::default(),
            redactor: &Default::default(),
        };
        let granted = Some(grant(&["eth0"], &["br-*"], &[]));
        let mut sealed = NetworkBridge::ctx(&granted, None, &store);
        let refused = sealed.devices().await.unwrap();
        assert!(matches!(refused, Err(BrokerError::AccessDenied(m)) if m.contains("no backend")));
        let change = wit::DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        assert!(matches!(sealed.bridge(vec![change]).await.unwrap(), Err(BrokerError::AccessDenied(_))));
        assert_eq!(denied.lock().unwrap().len(), 2, "both refusals noted, once each");

        let view = NetworkBridge::view(&granted);
        assert_eq!(
            (&view["bridge-devices"], &view["bridge-bridges"], &view["bridge-attach-to"]),
            (&serde_json::json!(["eth0"]), &serde_json::json!(["br-*"]), &serde_json::json!([]))
        );
        let shown = NetworkBridge::shown_view(&view);
        let line = |key, label, text: &str| GrantLine::new(key, label, text.to_owned());
        assert_eq!(
            shown,
            [
                line(VIEW_DEVICES, "bridge devices", "eth0"),
                line(VIEW_BRIDGES, "bridge bridges", "br-*"),
                line(VIEW_ATTACH_TO, "bridge attach-to", "denied")
            ]
        );
        // An older daemon's report (no attach-to): its two lines.
        let mut older = view.clone();
        older.remove(VIEW_ATTACH_TO);
        assert_eq!(NetworkBridge::shown_view(&older).len(), 2);
        assert_eq!(NetworkBridge::widening(&granted, &None).as_deref(), Some("[grants.bridge]"));
        let wider = Some(grant(&["eth0", "eth1"], &["br-*"], &[]));
        assert_eq!(NetworkBridge::widening(&wider, &granted).as_deref(), Some("bridge device \"eth1\""));
        assert_eq!(NetworkBridge::widening(&granted, &wider), None);
        let attaching = Some(grant(&["eth0"], &["br-*"], &["br-eth0"]));
        assert_eq!(NetworkBridge::widening(&attaching, &granted).as_deref(), Some("bridge to attach to \"br-eth0\""));
        assert_eq!(NetworkBridge::widening(&granted, &attaching), None);
    }

    #[test]
    fn attach_to_parses_and_unknown_keys_are_refused() {
        let parsed: BridgeGrant = toml::from_str("devices = [\"kt*\"]\nattach-to = [\"br-eth0\"]\n").unwrap();
        assert_eq!(parsed, grant(&["kt*"], &[], &["br-eth0"]));
        assert!(toml::from_str::<BridgeGrant>("attach = [\"br-eth0\"]\n").is_err());
    }

    #[tokio::test]
    async fn without_the_grant_everything_is_access_denied_before_netlink() {
        let mut ctx = BridgeCtx::new("p".into(), None, Some(Arc::new(HostNetwork)), None, Denials::default());
        let denied = ctx.devices().await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("[grants.bridge]")));
        let mut partial = BridgeCtx::new(
            "p".into(),
            Some(grant(&["eth0"], &[], &[])),
            Some(Arc::new(HostNetwork)),
            None,
            Denials::default(),
        );
        let change = wit::DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        let denied = partial.bridge(vec![change]).await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("bridge \"br-eth0\"")));
        assert_eq!(partial.bridge_name("eth0".into()).await.unwrap(), "br-eth0");
        // The host's kernel with no record of owners: nothing is made, before netlink is reached.
        let mut unrecorded = BridgeCtx::new(
            "p".into(),
            Some(grant(&["kt*"], &["br-*"], &[])),
            Some(Arc::new(HostNetwork)),
            None,
            Denials::default(),
        );
        let denied = unrecorded.create_tap("kt1".into(), "br-x".into(), String::new()).await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(ref m)) if m.contains("no record")), "{denied:?}");
    }

    fn nic(name: &str, kind: &str, address: Option<&str>) -> Device {
        let addresses = address
            .map(|a| {
                let (ip, prefix) = a.split_once('/').unwrap();
                vec![DeviceAddress { address: ip.parse().unwrap(), prefix: prefix.parse().unwrap() }]
            })
            .unwrap_or_default();
        Device {
            name: name.into(),
            index: 0,
            mac: "00:16:3e:00:00:01".into(),
            mtu: 1500,
            kind: kind.into(),
            controller: None,
            up: true,
            addresses,
            tun_owner: None,
        }
    }

    /// The KVM grant, with its host bridges to attach to.
    fn kvm_grant() -> Option<BridgeGrant> {
        Some(grant(&["kt*", "vh*"], &["br-*"], &["br-eth0"]))
    }

    /// Two providers on one simulated host: the host's `eth0` bridged into
    /// `br-eth0` (by HostPreparer), a host tap `kt-host`.
    async fn two_providers() -> (Arc<SimNetwork>, BridgeCtx, BridgeCtx, Arc<std::sync::Mutex<Vec<String>>>) {
        let network =
            Arc::new(SimNetwork::new(vec![nic("eth0", "", Some("10.0.0.2/24")), nic("kt-host", "tun", None)]));
        let host_bridge = DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        NetworkBackend::bridge(&*network, &host_bridge).await.unwrap();
        let (denials, denied) = Denials::collecting();
        let ctx = |name: &str| {
            let backend: Arc<dyn NetworkBackend> = network.clone();
            BridgeCtx::new(name.into(), kvm_grant(), Some(backend), None, denials.clone())
        };
        let (kvm1, kvm2) = (ctx("kvm1"), ctx("kvm2"));
        (network, kvm1, kvm2, denied)
    }

    async fn device(network: &SimNetwork, name: &str) -> Option<Device> {
        NetworkBackend::device(network, name).await.unwrap()
    }

    fn refused(result: Result<(), BrokerError>, says: &str) {
        match result {
            Err(BrokerError::AccessDenied(message)) => assert!(message.contains(says), "{message:?} lacks {says:?}"),
            other => panic!("not refused ({says}): {other:?}"),
        }
    }

    /// Issue 36, class 2, on the simulation: with the KVM grant a provider
    /// cannot attach another's tap, delete another's veth, unbridge a host
    /// bridge or bridge a host device; each refusal names the owner, is
    /// noted as a denial, and changes nothing.
    #[tokio::test]
    async fn a_provider_touches_only_what_it_made() {
        let (network, mut kvm1, mut kvm2, denied) = two_providers().await;
        // kvm1: a tap on the host bridge (attach-to), a bridge of its own, a veth pair.
        kvm1.create_tap("kt1".into(), "br-eth0".into(), String::new()).await.unwrap().unwrap();
        kvm1.create_veth("vh0".into(), "vh0p".into(), "br-eth0".into()).await.unwrap().unwrap();
        kvm1.delete_link("vh0".into()).await.unwrap().unwrap();
        assert!(device(&network, "vh0p").await.is_none());
        kvm1.create_veth("vh1".into(), "vh1p".into(), "br-eth0".into()).await.unwrap().unwrap();
        let own = wit::DeviceToBridge { device: "vh1p".into(), bridge: "br-kvm1".into(), mac: String::new() };
        kvm1.bridge(vec![own]).await.unwrap().unwrap();
        // kvm2 makes a bridge of its own over a veth of its own.
        kvm2.create_veth("vh2".into(), "vh2p".into(), "br-eth0".into()).await.unwrap().unwrap();
        kvm2.attach("vh2".into(), "br-eth0".into()).await.unwrap().unwrap();
        let mine = wit::DeviceToBridge { device: "vh2p".into(), bridge: "br-kvm2".into(), mac: String::new() };
        kvm2.bridge(vec![mine]).await.unwrap().unwrap();
        assert!(denied.lock().unwrap().is_empty(), "nothing refused so far: {:?}", denied.lock().unwrap());

        // kvm2 attacks kvm1's devices.
        refused(kvm2.attach("kt1".into(), "br-kvm2".into()).await.unwrap(), "tap kt1 belongs to provider kvm1");
        assert_eq!(device(&network, "kt1").await.unwrap().controller.as_deref(), Some("br-eth0"), "kt1 stays");
        refused(kvm2.delete_link("vh1".into()).await.unwrap(), "veth vh1 belongs to provider kvm1");
        refused(kvm2.delete_link("vh1p".into()).await.unwrap(), "veth vh1p belongs to provider kvm1");
        assert!(device(&network, "vh1").await.is_some() && device(&network, "vh1p").await.is_some());
        refused(kvm2.attach("vh2".into(), "br-kvm1".into()).await.unwrap(), "bridge br-kvm1 belongs to provider kvm1");
        assert_eq!(device(&network, "vh2").await.unwrap().controller.as_deref(), Some("br-eth0"));
        refused(
            kvm2.create_tap("kt1".into(), "br-kvm2".into(), String::new()).await.unwrap(),
            "tap kt1 belongs to provider kvm1",
        );
        // kvm1 attacks kvm2's bridge and the host's.
        refused(kvm1.attach("kt1".into(), "br-kvm2".into()).await.unwrap(), "bridge br-kvm2 belongs to provider kvm2");
        refused(kvm1.unbridge("kt1".into(), "br-eth0".into()).await.unwrap(), "br-eth0 is the host's");
        let bridge = device(&network, "br-eth0").await.expect("the host bridge stays");
        assert_eq!(bridge.addresses.len(), 1, "and keeps its address");
        assert_eq!(device(&network, "eth0").await.unwrap().controller.as_deref(), Some("br-eth0"));
        refused(kvm1.unbridge("kt1".into(), "br-kvm2".into()).await.unwrap(), "belongs to provider kvm2");
        let host_device = wit::DeviceToBridge { device: "kt-host".into(), bridge: "br-kt".into(), mac: String::new() };
        refused(kvm1.bridge(vec![host_device]).await.unwrap(), "tap kt-host is the host's");
        assert!(device(&network, "br-kt").await.is_none(), "no bridge made for the refused change");
        let into_host = wit::DeviceToBridge { device: "vh1".into(), bridge: "br-eth0".into(), mac: String::new() };
        refused(kvm1.bridge(vec![into_host]).await.unwrap(), "bridge br-eth0 is the host's");
        refused(kvm1.attach("kt-host".into(), "br-eth0".into()).await.unwrap(), "tap kt-host is the host's");
        refused(kvm1.delete_link("kt-host".into()).await.unwrap(), "tap kt-host is the host's");
        refused(kvm1.create_tap("kt-host".into(), "br-eth0".into(), String::new()).await.unwrap(), "exists");
        assert!(device(&network, "kt-host").await.unwrap().controller.is_none());
        // A host bridge not named under attach-to: not attached to.
        NetworkBackend::bridge(
            &*network,
            &DeviceToBridge { device: "kt-host".into(), bridge: "br-other".into(), mac: String::new() },
        )
        .await
        .unwrap();
        refused(kvm1.attach("kt1".into(), "br-other".into()).await.unwrap(), "only if `attach-to`");
        let noted = denied.lock().unwrap().clone();
        assert_eq!(noted.len(), 14, "each refusal noted once: {noted:#?}");
        assert!(noted.iter().all(|n| n.starts_with("network-bridge: ")), "{noted:?}");

        // Its own: kvm2 unbridges its bridge (its veth back out), deletes its veth.
        kvm2.unbridge("vh2p".into(), "br-kvm2".into()).await.unwrap().unwrap();
        assert!(device(&network, "br-kvm2").await.is_none());
        kvm2.delete_link("vh2p".into()).await.unwrap().unwrap();
        assert!(device(&network, "vh2").await.is_none(), "its peer went too");
        let owners = network.owners().unwrap();
        assert!(owners.owned_by("kvm2").unwrap().is_empty(), "and their records");
    }

    /// A bridge of its own that carries a device not its own (here: one the
    /// host attached) is not unbridged; removing a provider deletes what it
    /// made, leaves such a bridge, and drops every record.
    #[tokio::test]
    async fn removal_deletes_what_a_provider_made_and_leaves_what_carries_the_hosts() {
        let (network, mut kvm1, _, _) = two_providers().await;
        kvm1.create_tap("kt1".into(), "br-eth0".into(), String::new()).await.unwrap().unwrap();
        kvm1.create_veth("vh1".into(), "vh1p".into(), "br-eth0".into()).await.unwrap().unwrap();
        let own = wit::DeviceToBridge { device: "vh1p".into(), bridge: "br-a".into(), mac: String::new() };
        kvm1.bridge(vec![own]).await.unwrap().unwrap();
        let own = wit::DeviceToBridge { device: "kt1".into(), bridge: "br-b".into(), mac: String::new() };
        // kt1 is in br-eth0: bridged elsewhere.
        assert!(matches!(kvm1.bridge(vec![own]).await.unwrap(), Err(BrokerError::InvalidParams(_))));
        assert!(device(&network, "br-b").await.is_none());
        assert_eq!(
            network.owners().unwrap().owner("br-b").unwrap(),
            None,
            "the record of what was not made is dropped"
        );
        NetworkBackend::attach(&*network, "kt-host", "br-a").await.unwrap();
        refused(kvm1.unbridge("vh1p".into(), "br-a".into()).await.unwrap(), "carries tap kt-host");
        assert!(device(&network, "br-a").await.is_some());

        let released = release_provider(&*network, "kvm1").await.unwrap();
        assert_eq!(released.deleted, ["kt1", "vh1"], "{released:?}");
        assert_eq!(released.left.len(), 1, "{released:?}");
        assert!(released.left[0].contains("br-a") && released.left[0].contains("kt-host"), "{released:?}");
        assert!(device(&network, "kt1").await.is_none() && device(&network, "vh1p").await.is_none());
        assert!(device(&network, "br-a").await.is_some() && device(&network, "br-eth0").await.is_some());
        assert!(network.owners().unwrap().owned_by("kvm1").unwrap().is_empty());
    }

    /// A record names a device, not a name: one of another boot, or whose
    /// name now belongs to a device of another index, gives the provider
    /// nothing (and is forgotten); one written before records held indexes
    /// is kept and completed. A tap made for the provider's user before
    /// owners were recorded is adopted; one of another user's is not. The
    /// name HostPreparer gives a host device's bridge is not a provider's.
    #[tokio::test]
    async fn a_record_names_a_device_not_a_name() {
        let tap = |name: &str, owner: Option<u32>| Device { tun_owner: owner, ..nic(name, "tun", None) };
        let devices = vec![
            nic("eth0", "", Some("10.0.0.2/24")),
            nic("eth5", "", None),
            tap("kt7", None),
            tap("kt8", None),
            tap("kt9", None),
            tap("kt-old", Some(4242)),
            tap("kt-other", Some(4343)),
        ];
        let network = Arc::new(SimNetwork::new(devices));
        let host_bridge = DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        NetworkBackend::bridge(&*network, &host_bridge).await.unwrap();
        let owners = network.owners().unwrap();
        let record = |boot: Option<&str>, index: Option<u32>| OwnedDevice {
            boot: boot.map(str::to_owned),
            index,
            ..OwnedDevice::new("kvm1", "tap", None)
        };
        let this_boot = crate::network::boot_id().map(str::to_owned);
        let kt8_index = device(&network, "kt8").await.unwrap().index;
        let kt7_index = device(&network, "kt7").await.unwrap().index;
        let seeded = vec![
            ("kt9".to_owned(), record(Some("an-earlier-boot"), None)),
            ("kt8".to_owned(), record(this_boot.as_deref(), Some(kt8_index + 100))),
            ("kt7".to_owned(), record(None, None)),
        ];
        assert_eq!(owners.claim(seeded).await.unwrap(), None);
        let backend: Arc<dyn NetworkBackend> = network.clone();
        let mut kvm1 = BridgeCtx::new("kvm1".into(), kvm_grant(), Some(backend), Some(4242), Denials::default());

        if this_boot.is_some() {
            refused(kvm1.delete_link("kt9".into()).await.unwrap(), "tap kt9 is the host's");
            assert!(device(&network, "kt9").await.is_some());
            assert_eq!(owners.owner("kt9").unwrap(), None, "another boot's record is forgotten");
        }
        refused(kvm1.attach("kt8".into(), "br-eth0".into()).await.unwrap(), "tap kt8 is the host's");
        assert!(device(&network, "kt8").await.unwrap().controller.is_none());
        assert_eq!(owners.owner("kt8").unwrap(), None, "a replaced device's record is forgotten");
        kvm1.attach("kt7".into(), "br-eth0".into()).await.unwrap().unwrap();
        let kept = owners.owner("kt7").unwrap().expect("an old record is kept");
        assert_eq!((kept.index, kept.boot), (Some(kt7_index), this_boot.clone()), "and completed");

        // Taps of its user made before owners were recorded: adopted; another user's: the host's.
        kvm1.attach("kt-old".into(), "br-eth0".into()).await.unwrap().unwrap();
        assert_eq!(owners.owner("kt-old").unwrap().map(|o| o.provider), Some("kvm1".to_owned()));
        kvm1.delete_link("kt-old".into()).await.unwrap().unwrap();
        assert!(device(&network, "kt-old").await.is_none());
        refused(kvm1.attach("kt-other".into(), "br-eth0".into()).await.unwrap(), "tap kt-other is the host's");
        assert_eq!(owners.owner("kt-other").unwrap(), None);

        // HostPreparer's name for eth5's bridge; a name of its own is fine.
        kvm1.create_veth("vh1".into(), "vh1p".into(), "br-eth0".into()).await.unwrap().unwrap();
        let made = owners.owner("vh1").unwrap().unwrap();
        assert_eq!(made.index, device(&network, "vh1").await.map(|d| d.index), "a made device's index is recorded");
        let squat = wit::DeviceToBridge { device: "vh1p".into(), bridge: "br-eth5".into(), mac: String::new() };
        refused(kvm1.bridge(vec![squat]).await.unwrap(), "the bridge of eth5 (HostPreparer)");
        assert!(device(&network, "br-eth5").await.is_none() && owners.owner("br-eth5").unwrap().is_none());
        let own = wit::DeviceToBridge { device: "vh1p".into(), bridge: "br-vms".into(), mac: String::new() };
        kvm1.bridge(vec![own]).await.unwrap().unwrap();

        // At a start: every stale record goes at once.
        let stale = vec![("kt-gone".to_owned(), record(Some("an-earlier-boot"), Some(3)))];
        assert_eq!(owners.claim(stale).await.unwrap(), None);
        let pruned = crate::network::owners::prune_stale(&*network).await.unwrap();
        assert_eq!(pruned, usize::from(this_boot.is_some()));
        assert!(
            owners.owner("vh1").unwrap().is_some() && owners.owner("br-vms").unwrap().is_some(),
            "current ones stay"
        );
    }
}
