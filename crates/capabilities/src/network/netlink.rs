//! The real bridger: rtnetlink, in the network namespace of the thread that
//! connects. No shelling out to `ip`.

use super::{BridgeError, Device, DeviceAddress, DeviceToBridge, already_bridged, check_name, format_mac, parse_mac};
use futures_util::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use rtnetlink::packet_route::route::{RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteType};
use rtnetlink::{Handle, LinkBridge, LinkUnspec, LinkVeth, RouteMessageBuilder};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Where an existing device stands for a provider that wants it as its tap.
enum TapStanding {
    Absent,
    Unowned,
    Ours,
}

/// The kernel's main routing table.
const RT_TABLE_MAIN: u8 = 254;

fn nl(err: rtnetlink::Error) -> BridgeError {
    BridgeError::Netlink(err)
}

/// A netlink connection. Must be made inside a tokio runtime; it works on the
/// network namespace of the thread that makes it.
pub struct Netlink {
    handle: Handle,
}

struct Link {
    message: LinkMessage,
}

impl Link {
    fn index(&self) -> u32 {
        self.message.header.index
    }

    fn name(&self) -> String {
        self.message
            .attributes
            .iter()
            .find_map(|a| if let LinkAttribute::IfName(n) = a { Some(n.clone()) } else { None })
            .unwrap_or_default()
    }

    fn mac(&self) -> Vec<u8> {
        self.message
            .attributes
            .iter()
            .find_map(|a| if let LinkAttribute::Address(m) = a { Some(m.clone()) } else { None })
            .unwrap_or_default()
    }

    fn mtu(&self) -> u32 {
        self.message
            .attributes
            .iter()
            .find_map(|a| if let LinkAttribute::Mtu(m) = a { Some(*m) } else { None })
            .unwrap_or(0)
    }

    fn controller(&self) -> Option<u32> {
        self.message.attributes.iter().find_map(|a| if let LinkAttribute::Controller(c) = a { Some(*c) } else { None })
    }

    fn kind(&self) -> String {
        self.message
            .attributes
            .iter()
            .filter_map(|a| if let LinkAttribute::LinkInfo(infos) = a { Some(infos) } else { None })
            .flatten()
            .find_map(|i| if let LinkInfo::Kind(kind) = i { Some(format!("{kind}").to_lowercase()) } else { None })
            .unwrap_or_default()
    }

    /// A tun/tap's owner and group (`IFLA_TUN_OWNER`, `IFLA_TUN_GROUP`; each
    /// absent when unset).
    fn tun_owner_and_group(&self) -> (Option<u32>, Option<u32>) {
        use rtnetlink::packet_core::Nla;
        use rtnetlink::packet_route::link::InfoData;
        const IFLA_TUN_OWNER: u16 = 1;
        const IFLA_TUN_GROUP: u16 = 2;
        let attribute = |kind: u16| {
            self.message
                .attributes
                .iter()
                .filter_map(|a| if let LinkAttribute::LinkInfo(infos) = a { Some(infos) } else { None })
                .flatten()
                .filter_map(|i| if let LinkInfo::Data(InfoData::Tun(tun)) = i { Some(tun) } else { None })
                .flatten()
                .find_map(|nla| {
                    let mut value = [0u8; 4];
                    (nla.kind() == kind && nla.value_len() == 4).then(|| {
                        nla.emit_value(&mut value);
                        u32::from_ne_bytes(value)
                    })
                })
        };
        (attribute(IFLA_TUN_OWNER), attribute(IFLA_TUN_GROUP))
    }

    fn up(&self) -> bool {
        self.message.header.flags.contains(LinkFlags::Up)
    }
}

fn address_of(message: &AddressMessage) -> Option<DeviceAddress> {
    let address = message.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let address = address.or_else(|| {
        message.attributes.iter().find_map(|a| if let AddressAttribute::Address(ip) = a { Some(*ip) } else { None })
    })?;
    Some(DeviceAddress { address, prefix: message.header.prefix_len })
}

/// IPv6 link-local addresses belong to the link itself; they are not moved.
fn movable(address: &DeviceAddress) -> bool {
    match address.address {
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
        IpAddr::V4(_) => true,
    }
}

impl Netlink {
    /// A connection in this thread's network namespace; its driver task is
    /// spawned on the current tokio runtime.
    pub fn connect() -> Result<Netlink, BridgeError> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|source| BridgeError::Io { what: "connect".into(), cause: source })?;
        tokio::spawn(connection);
        Ok(Netlink { handle })
    }

    async fn links(&self) -> Result<Vec<Link>, BridgeError> {
        let messages: Vec<LinkMessage> = self.handle.link().get().execute().try_collect().await.map_err(nl)?;
        Ok(messages.into_iter().map(|message| Link { message }).collect())
    }

    /// The link named `name`; its absence is [`BridgeError::NoDevice`].
    async fn link(&self, name: &str) -> Result<Link, BridgeError> {
        self.links().await?.into_iter().find(|l| l.name() == name).ok_or_else(|| BridgeError::NoDevice(name.to_owned()))
    }

    async fn address_messages(&self, index: u32) -> Result<Vec<AddressMessage>, BridgeError> {
        let all: Vec<AddressMessage> =
            self.handle.address().get().set_link_index_filter(index).execute().try_collect().await.map_err(nl)?;
        // The kernel may ignore the filter on dumps: filter again.
        Ok(all.into_iter().filter(|m| m.header.index == index).collect())
    }

    /// Every device with its addresses, MAC, MTU and controller.
    pub async fn devices(&self) -> Result<Vec<Device>, BridgeError> {
        let links = self.links().await?;
        let names: HashMap<u32, String> = links.iter().map(|l| (l.index(), l.name())).collect();
        let mut devices = Vec::new();
        for link in &links {
            let addresses = self.address_messages(link.index()).await?.iter().filter_map(address_of).collect();
            devices.push(Device {
                name: link.name(),
                index: link.index(),
                mac: format_mac(&link.mac()),
                mtu: link.mtu(),
                kind: link.kind(),
                controller: link.controller().and_then(|c| names.get(&c).cloned()),
                up: link.up(),
                addresses,
                tun_owner: match link.tun_owner_and_group() {
                    (Some(owner), None) => Some(owner),
                    _ => None,
                },
            });
        }
        devices.sort_by_key(|d| d.index);
        Ok(devices)
    }

    /// The device named `name`, if there is one.
    pub async fn device(&self, name: &str) -> Result<Option<Device>, BridgeError> {
        Ok(self.devices().await?.into_iter().find(|d| d.name == name))
    }

    /// Bridge `device` as Juju does: the bridge takes the device's MAC (or the
    /// one given), MTU and addresses; the device is enslaved to it. Running it
    /// again for the same pair changes nothing; a device already in another
    /// bridge is an error.
    pub async fn bridge(&self, change: &DeviceToBridge) -> Result<(), BridgeError> {
        check_name(&change.device)?;
        check_name(&change.bridge)?;
        let links = self.links().await?;
        let device = links
            .iter()
            .find(|l| l.name() == change.device)
            .ok_or_else(|| BridgeError::NoDevice(change.device.clone()))?;
        let existing = device
            .controller()
            .map(|controller| links.iter().find(|l| l.index() == controller).map(Link::name).unwrap_or_default());
        if already_bridged(change, existing)? {
            return Ok(());
        }
        let mac = if change.mac.is_empty() { device.mac() } else { parse_mac(&change.mac)? };
        let bridge = match links.iter().find(|l| l.name() == change.bridge) {
            Some(existing) if existing.kind() != "bridge" => {
                return Err(BridgeError::NotABridge(change.bridge.clone()));
            }
            Some(existing) => existing.index(),
            None => {
                let mut builder = LinkBridge::new(&change.bridge).mtu(device.mtu());
                if !mac.is_empty() {
                    builder = builder.address(mac);
                }
                self.handle.link().add(builder.build()).execute().await.map_err(nl)?;
                self.link(&change.bridge).await?.index()
            }
        };
        // Removing the addresses takes the routes through the device with them
        // (the default route among them): note them first, put them back after.
        let routes = self.routes_via(device.index()).await?;
        self.move_addresses(device.index(), bridge).await?;
        self.set_controller(device.index(), Some(bridge)).await?;
        self.set_up(bridge).await?;
        self.set_up(device.index()).await?;
        self.restore_routes(routes, bridge).await
    }

    /// Undo [`Netlink::bridge`]: addresses back to the device, the bridge deleted.
    pub async fn unbridge(&self, device: &str, bridge: &str) -> Result<(), BridgeError> {
        let dev = self.link(device).await?;
        let br = self.link(bridge).await?;
        let routes = self.routes_via(br.index()).await?;
        self.set_controller(dev.index(), None).await?;
        self.move_addresses(br.index(), dev.index()).await?;
        self.delete(bridge).await?;
        self.restore_routes(routes, dev.index()).await
    }

    /// Routes out of `index` that the kernel did not make itself (those come
    /// back by themselves with the addresses).
    async fn routes_via(&self, index: u32) -> Result<Vec<RouteMessage>, BridgeError> {
        let mut routes = Vec::new();
        for request in [RouteMessageBuilder::<Ipv4Addr>::new().build(), RouteMessageBuilder::<Ipv6Addr>::new().build()]
        {
            let all: Vec<RouteMessage> = self.handle.route().get(request).execute().try_collect().await.map_err(nl)?;
            routes.extend(all.into_iter().filter(|r| {
                r.header.protocol != RouteProtocol::Kernel
                    && r.header.table == RT_TABLE_MAIN
                    && r.header.kind == RouteType::Unicast
                    && r.attributes.contains(&RouteAttribute::Oif(index))
            }));
        }
        Ok(routes)
    }

    /// Put routes back, now out of `index`; ones that still exist are left as they are.
    async fn restore_routes(&self, routes: Vec<RouteMessage>, index: u32) -> Result<(), BridgeError> {
        for mut route in routes {
            // Keep what defines the route; dump-only flags (linkdown) and
            // attributes (cache info, expiry) are refused on add.
            route.header.flags = RouteFlags::empty();
            route.attributes.retain(|a| {
                matches!(
                    a,
                    RouteAttribute::Destination(_)
                        | RouteAttribute::Gateway(_)
                        | RouteAttribute::PrefSource(_)
                        | RouteAttribute::Priority(_)
                        | RouteAttribute::Oif(_)
                )
            });
            for attribute in route.attributes.iter_mut() {
                if let RouteAttribute::Oif(oif) = attribute {
                    *oif = index;
                }
            }
            match self.handle.route().add(route).execute().await {
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -(nix::errno::Errno::EEXIST as i32) => {}
                other => other.map_err(nl)?,
            }
        }
        Ok(())
    }

    async fn move_addresses(&self, from: u32, to: u32) -> Result<(), BridgeError> {
        for message in self.address_messages(from).await? {
            let Some(address) = address_of(&message).filter(movable) else { continue };
            self.handle.address().del(message).execute().await.map_err(nl)?;
            self.handle.address().add(to, address.address, address.prefix).execute().await.map_err(nl)?;
        }
        Ok(())
    }

    async fn set_controller(&self, index: u32, controller: Option<u32>) -> Result<(), BridgeError> {
        let builder = LinkUnspec::new_with_index(index);
        let message = match controller {
            Some(c) => builder.controller(c).build(),
            None => builder.nocontroller().build(),
        };
        self.handle.link().set(message).execute().await.map_err(nl)
    }

    async fn set_up(&self, index: u32) -> Result<(), BridgeError> {
        self.handle.link().set(LinkUnspec::new_with_index(index).up().build()).execute().await.map_err(nl)
    }

    /// A veth pair for an instance: `name` attached to `bridge`, `peer` left for
    /// the instance; both up.
    pub async fn create_veth(&self, name: &str, peer: &str, bridge: &str) -> Result<(), BridgeError> {
        check_name(name)?;
        check_name(peer)?;
        let br = self.link(bridge).await?;
        self.handle.link().add(LinkVeth::new(name, peer).build()).execute().await.map_err(nl)?;
        self.attach(name, &br.name()).await?;
        let peer_link = self.link(peer).await?;
        self.set_up(peer_link.index()).await
    }

    /// A persistent tap for a VM, with the MAC given (empty = the kernel's),
    /// attached to `bridge` and up.
    pub async fn create_tap(&self, name: &str, bridge: &str, mac: &str) -> Result<(), BridgeError> {
        self.create_tap_owned(name, bridge, mac, None).await
    }

    /// As [`Self::create_tap`], the tap owned by `owner` (a sandbox user) if given.
    pub async fn create_tap_owned(
        &self,
        name: &str,
        bridge: &str,
        mac: &str,
        owner: Option<u32>,
    ) -> Result<(), BridgeError> {
        self.link(bridge).await?; // the bridge must exist before a tap is made for it
        // A tap no user owns is open to every user; the host's own are root's.
        let owner = owner.unwrap_or(0);
        match self.tap_standing(name, owner).await? {
            TapStanding::Absent => super::tap::create_persistent_tap(name, owner, true)?,
            TapStanding::Unowned => super::tap::create_persistent_tap(name, owner, false)?,
            TapStanding::Ours => {}
        }
        if !mac.is_empty() {
            let tap = self.link(name).await?;
            let message = LinkUnspec::new_with_index(tap.index()).address(parse_mac(mac)?).build();
            self.handle.link().set(message).execute().await.map_err(nl)?;
        }
        self.attach(name, bridge).await
    }

    /// Whether `name` is a tap `owner` may have: absent (made exclusively, so
    /// one made meanwhile is not taken), already `owner`'s, or owned by no
    /// user or group (open to every user already: it is given to `owner`).
    /// A tap of another user or group is refused: root may re-own any tap, and
    /// the host is root.
    async fn tap_standing(&self, name: &str, owner: u32) -> Result<TapStanding, BridgeError> {
        let existing = match self.link(name).await {
            Ok(existing) => existing,
            Err(BridgeError::NoDevice(_)) => return Ok(TapStanding::Absent),
            Err(e) => return Err(e),
        };
        if existing.kind() != "tun" {
            return Err(BridgeError::NotATap(name.to_owned()));
        }
        match existing.tun_owner_and_group() {
            (Some(has), None) if has == owner => Ok(TapStanding::Ours),
            (None, None) => Ok(TapStanding::Unowned),
            (has, group) => {
                let holder = match (has, group) {
                    (Some(uid), _) => format!("uid {uid}"),
                    (None, Some(gid)) => format!("group {gid}"),
                    (None, None) => unreachable!("matched above"),
                };
                Err(BridgeError::TapOwnedElsewhere { device: name.to_owned(), owner: holder, wanted: owner })
            }
        }
    }

    /// Delete a veth or a tap the provider may have (see [`Self::tap_standing`]).
    pub async fn delete_owned(&self, name: &str, owner: Option<u32>) -> Result<(), BridgeError> {
        if self.link(name).await?.kind() == "tun" {
            self.tap_standing(name, owner.unwrap_or(0)).await?;
        }
        self.delete(name).await
    }

    /// Attach an existing device (a tap, a veth) to a bridge and bring it up.
    pub async fn attach(&self, device: &str, bridge: &str) -> Result<(), BridgeError> {
        let dev = self.link(device).await?;
        let br = self.link(bridge).await?;
        if br.kind() != "bridge" {
            return Err(BridgeError::NotABridge(bridge.to_owned()));
        }
        self.set_controller(dev.index(), Some(br.index())).await?;
        self.set_up(dev.index()).await
    }

    /// Delete a device (for a veth, its peer goes too).
    pub async fn delete(&self, name: &str) -> Result<(), BridgeError> {
        let link = self.link(name).await?;
        self.handle.link().del(link.index()).execute().await.map_err(nl)
    }
}
