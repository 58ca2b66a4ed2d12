//! cloud-init `network-config` version 2 (netplan) for a machine's
//! interfaces: what a KVM seed ISO carries and what LXD takes as
//! `user.network-config`. JSON is YAML, so the JSON form serves both.

use crate::types::{AddressConfigType, InterfaceInfo};
use serde_json::{Map, Value, json};

/// One interface of the network info, as network-config needs it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Interface {
    /// Name inside the machine; `eth<i>` when empty.
    pub name: String,
    pub mac: String,
    pub dhcp: bool,
    /// `10.0.0.5/24`
    pub addresses: Vec<String>,
    pub gateway: Option<String>,
    pub dns: Vec<String>,
    pub mtu: u32,
}

/// The `network-config` document: one `ethernets` entry per interface,
/// matched by MAC and renamed to its interface name.
pub fn network_config(interfaces: &[Interface]) -> Value {
    let mut ethernets = Map::new();
    for (i, nic) in interfaces.iter().enumerate() {
        let id = if nic.name.is_empty() { format!("eth{i}") } else { nic.name.clone() };
        let mut entry = json!({ "match": { "macaddress": nic.mac }, "set-name": id });
        if nic.dhcp {
            entry["dhcp4"] = Value::Bool(true);
        }
        if !nic.addresses.is_empty() {
            entry["addresses"] = json!(nic.addresses);
        }
        if let Some(gateway) = &nic.gateway {
            entry["routes"] = json!([{ "to": "default", "via": gateway }]);
        }
        if !nic.dns.is_empty() {
            entry["nameservers"] = json!({ "addresses": nic.dns });
        }
        if nic.mtu != 0 {
            entry["mtu"] = json!(nic.mtu);
        }
        ethernets.insert(id, entry);
    }
    json!({ "version": 2, "ethernets": ethernets })
}

/// The network info as cloud-init's network-config needs it, with the MAC
/// each interface actually gets (`macs[i]`, or its own when `macs` is short).
pub fn interfaces(network: &[InterfaceInfo], macs: &[String]) -> Vec<Interface> {
    network
        .iter()
        .enumerate()
        .map(|(i, info)| Interface {
            name: info.interface_name.clone(),
            mac: macs.get(i).cloned().unwrap_or_else(|| info.mac_address.clone()),
            dhcp: info.config_type == AddressConfigType::Dhcp,
            addresses: info
                .addresses
                .iter()
                .map(|a| match a.cidr.as_deref().and_then(|c| c.split_once('/')) {
                    Some((_, prefix)) => format!("{}/{prefix}", a.value),
                    None => a.value.clone(),
                })
                .collect(),
            gateway: info.gateway_address.clone(),
            dns: info.dns_servers.clone(),
            mtu: info.mtu,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_dhcp_interfaces() {
        let nics = [
            Interface {
                name: "eth0".into(),
                mac: "00:16:3e:00:00:01".into(),
                addresses: vec!["10.1.0.5/24".into()],
                gateway: Some("10.1.0.1".into()),
                dns: vec!["10.1.0.2".into()],
                mtu: 1400,
                ..Interface::default()
            },
            Interface { mac: "00:16:3e:00:00:02".into(), dhcp: true, ..Interface::default() },
        ];
        let net = network_config(&nics);
        assert_eq!(net["version"], 2);
        let eth0 = &net["ethernets"]["eth0"];
        assert_eq!(eth0["match"]["macaddress"], "00:16:3e:00:00:01");
        assert_eq!(eth0["routes"][0]["via"], "10.1.0.1");
        assert_eq!(eth0["nameservers"]["addresses"][0], "10.1.0.2");
        assert_eq!(eth0["mtu"], 1400);
        assert!(eth0.get("dhcp4").is_none());
        let eth1 = &net["ethernets"]["eth1"];
        assert_eq!((eth1["dhcp4"].as_bool(), eth1["set-name"].as_str()), (Some(true), Some("eth1")));
    }
}
