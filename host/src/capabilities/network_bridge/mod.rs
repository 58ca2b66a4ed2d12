//! `broker:provider/network-bridge` for guests: the host's bridger
//! ([`crate::network`]), limited to the devices and bridges the manifest grants.

use crate::bindings::BrokerError;
use crate::bindings::broker::provider::network_bridge::{self as wit};
use crate::capabilities::denials::Denials;
use crate::network::backend::HostNetwork;
use crate::network::backend::NetworkBackend;
use crate::network::{BridgeError, Device, DeviceToBridge, names};
use crate::runtime::HostState;
use crate::runtime::rooms::{GrantLine, GrantValue, Linking, Room, StoreSetup};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::sync::Arc;
use wasmtime::component::{HasSelf, Linker};

/// Its interface in the contract package.
pub const INTERFACE: &str = "network-bridge";

/// `[grants.bridge]`: names, or prefixes when they end in `*`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeGrant {
    /// Devices the provider may act on.
    #[serde(default)]
    pub devices: Vec<String>,
    /// Bridges the provider may make, attach to or remove.
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

/// Per-store context; the default grants nothing and reaches nothing.
#[derive(Default)]
pub struct BridgeCtx {
    /// `None` without a `[grants.bridge]`.
    grant: Option<BridgeGrant>,
    /// `None` without the grant, or in a sandbox that gives no network.
    network: Option<Arc<dyn NetworkBackend>>,
    /// The sandbox user of the provider's programs, given the taps it makes
    /// (`TUNSETOWNER`), so its confined qemu may open them; `None`: root's.
    tap_owner: Option<u32>,
    denials: Denials,
}

impl BridgeCtx {
    pub(crate) fn new(
        grant: Option<BridgeGrant>,
        network: Option<Arc<dyn NetworkBackend>>,
        tap_owner: Option<u32>,
        denials: Denials,
    ) -> Self {
        BridgeCtx { grant, network, tap_owner, denials }
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
        self.granted(names).map_err(|refused| self.denials.refuse("network-bridge", refused))
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
        let checked = self.checked(|grant| {
            changes.iter().try_for_each(|c| grant.device(&c.device).and_then(|_| grant.bridge(&c.bridge)))
        });
        let network = match checked {
            Ok((_, network)) => network,
            Err(refused) => return Ok(Err(refused)),
        };
        for c in changes {
            let change = DeviceToBridge { device: c.device, bridge: c.bridge, mac: c.mac };
            if let Err(e) = network.bridge(&change).await {
                return answered(Err(e));
            }
        }
        Ok(Ok(()))
    }

    async fn unbridge(&mut self, device: String, bridge: String) -> WitResult<()> {
        let network = match self.checked(|g| g.device(&device).and_then(|_| g.bridge(&bridge))) {
            Ok((_, network)) => network,
            Err(refused) => return Ok(Err(refused)),
        };
        answered(network.unbridge(&device, &bridge).await)
    }

    async fn create_veth(&mut self, name: String, peer: String, bridge: String) -> WitResult<()> {
        let checked = self.checked(|g| g.device(&name).and_then(|_| g.device(&peer)).and_then(|_| g.bridge(&bridge)));
        let network = match checked {
            Ok((_, network)) => network,
            Err(refused) => return Ok(Err(refused)),
        };
        answered(network.create_veth(&name, &peer, &bridge).await)
    }

    async fn create_tap(&mut self, name: String, bridge: String, mac: String) -> WitResult<()> {
        let network = match self.checked(|g| g.device(&name).and_then(|_| g.bridge(&bridge))) {
            Ok((_, network)) => network,
            Err(refused) => return Ok(Err(refused)),
        };
        answered(network.create_tap(&name, &bridge, &mac, self.tap_owner).await)
    }

    async fn attach(&mut self, device: String, bridge: String) -> WitResult<()> {
        let network = match self.checked(|g| g.device(&device).and_then(|_| g.bridge(&bridge))) {
            Ok((_, network)) => network,
            Err(refused) => return Ok(Err(refused)),
        };
        answered(network.attach(&device, &bridge).await)
    }

    async fn delete_link(&mut self, name: String) -> WitResult<()> {
        let network = match self.checked(|g| g.device(&name)) {
            Ok((_, network)) => network,
            Err(refused) => return Ok(Err(refused)),
        };
        let deleted = match network.device(&name).await {
            Err(e) => Err(e),
            Ok(Some(device)) if device.kind == "veth" || device.kind == "tun" => {
                network.delete_owned(&name, self.tap_owner).await
            }
            Ok(Some(_)) => {
                Err(BridgeError::NotABridge(format!("{name} is not a veth or tap; nothing else is deleted")))
            }
            Ok(None) => Err(BridgeError::NoDevice(name.clone())),
        };
        answered(deleted)
    }
}

pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    getter: fn(&mut T) -> &mut BridgeCtx,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, HasSelf<BridgeCtx>>(linker, getter)
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
                .or_else(|| new_item(&now.bridges, &before.bridges, "bridge")),
        }
    }

    fn shown(&self) -> String {
        shown_list(self.as_ref().map(|g| g.devices.clone()).unwrap_or_default())
    }
}

fn shown_list(items: Vec<String>) -> String {
    if items.is_empty() { "denied".to_owned() } else { items.join(", ") }
}

/// How the API reports the grant (as before rooms): two lists.
const VIEW_DEVICES: &str = "bridge-devices";
const VIEW_BRIDGES: &str = "bridge-bridges";

/// The room: `[grants.bridge]`, the devices and bridges a provider may act on
/// through the host's bridger. Linked for every provider (an ungranted call
/// answers `access-denied`); taps it makes belong to the provider's sandbox user.
pub struct NetworkBridge;

impl Room for NetworkBridge {
    const INTERFACE: &'static str = INTERFACE;
    const GRANT: &'static str = "bridge";
    const LINKING: Linking = Linking::Always;
    type Grant = Option<BridgeGrant>;
    type Backend = dyn NetworkBackend;
    type Ctx = BridgeCtx;
    type Prepared = ();

    fn host_backend() -> Option<Arc<dyn NetworkBackend>> {
        Some(Arc::new(HostNetwork))
    }

    fn ctx(grant: &Option<BridgeGrant>, network: Option<Arc<dyn NetworkBackend>>, store: &StoreSetup<'_>) -> BridgeCtx {
        BridgeCtx::new(grant.clone(), network, store.sandbox_user, store.denials.clone())
    }

    fn add_to_linker(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
        add_to_linker(linker, |state| state.rooms.of::<NetworkBridge>())
    }

    fn view(grant: &Option<BridgeGrant>) -> Map<String, Value> {
        let (devices, bridges) = grant.as_ref().map(|g| (g.devices.clone(), g.bridges.clone())).unwrap_or_default();
        Map::from_iter([
            (VIEW_DEVICES.to_owned(), Value::from(devices)),
            (VIEW_BRIDGES.to_owned(), Value::from(bridges)),
        ])
    }

    fn shown_view(view: &Map<String, Value>) -> Vec<GrantLine> {
        let list = |key: &str| view.get(key).and_then(|v| Vec::<String>::deserialize(v).ok());
        [("bridge devices", VIEW_DEVICES), ("bridge bridges", VIEW_BRIDGES)]
            .into_iter()
            .filter_map(|(label, key)| list(key).map(|items| GrantLine::new(key, label, shown_list(items))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::broker::provider::network_bridge::Host;

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

    /// The room: granted in a sandbox that gives no network, every call is
    /// refused (never the host's kernel); the grant is reported as the API
    /// always did (two lists) and shown as two lines; widening names what is new.
    #[tokio::test]
    async fn the_room_refuses_without_a_network_and_reports_two_lists() {
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
        };
        let grant = Some(BridgeGrant { devices: vec!["eth0".into()], bridges: vec!["br-*".into()] });
        let mut sealed = NetworkBridge::ctx(&grant, None, &store);
        let refused = sealed.devices().await.unwrap();
        assert!(matches!(refused, Err(BrokerError::AccessDenied(m)) if m.contains("no backend")));
        let change = wit::DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        assert!(matches!(sealed.bridge(vec![change]).await.unwrap(), Err(BrokerError::AccessDenied(_))));
        assert_eq!(denied.lock().unwrap().len(), 2, "both refusals noted");

        let view = NetworkBridge::view(&grant);
        assert_eq!(
            (&view["bridge-devices"], &view["bridge-bridges"]),
            (&serde_json::json!(["eth0"]), &serde_json::json!(["br-*"]))
        );
        let shown = NetworkBridge::shown_view(&view);
        let line = |key, label, text: &str| GrantLine::new(key, label, text.to_owned());
        assert_eq!(shown, [line(VIEW_DEVICES, "bridge devices", "eth0"), line(VIEW_BRIDGES, "bridge bridges", "br-*")]);
        let none = NetworkBridge::shown_view(&NetworkBridge::view(&None));
        assert_eq!(
            none,
            [line(VIEW_DEVICES, "bridge devices", "denied"), line(VIEW_BRIDGES, "bridge bridges", "denied")]
        );
        assert_eq!(NetworkBridge::widening(&grant, &None).as_deref(), Some("[grants.bridge]"));
        let wider = Some(BridgeGrant { devices: vec!["eth0".into(), "eth1".into()], bridges: vec!["br-*".into()] });
        assert_eq!(NetworkBridge::widening(&wider, &grant).as_deref(), Some("bridge device \"eth1\""));
        assert_eq!(NetworkBridge::widening(&grant, &wider), None);
    }

    #[tokio::test]
    async fn without_the_grant_everything_is_access_denied_before_netlink() {
        let mut ctx = BridgeCtx::new(None, Some(Arc::new(HostNetwork)), None, Denials::default());
        let denied = ctx.devices().await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("[grants.bridge]")));
        let mut partial = BridgeCtx::new(
            Some(BridgeGrant { devices: vec!["eth0".into()], bridges: vec![] }),
            Some(Arc::new(HostNetwork)),
            None,
            Denials::default(),
        );
        let change = wit::DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: String::new() };
        let denied = partial.bridge(vec![change]).await.unwrap();
        assert!(matches!(denied, Err(BrokerError::AccessDenied(m)) if m.contains("bridge \"br-eth0\"")));
        assert_eq!(partial.bridge_name("eth0".into()).await.unwrap(), "br-eth0");
    }
}
