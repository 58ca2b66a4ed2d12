//! The contract's vocabulary on the host side: Juju's constraint syntax and
//! builders of the params a start takes.

pub mod constraints;
pub mod start;

use crate::bindings::StartInstanceParams;

/// Params with nothing in them but the given constraints.
pub fn params_with(constraints: crate::bindings::Constraints) -> StartInstanceParams {
    StartInstanceParams {
        controller_uuid: String::new(),
        constraints,
        tools: Vec::new(),
        instance_config: None,
        placement: None,
        volumes: Vec::new(),
        volume_attachments: Vec::new(),
        network_info: Vec::new(),
        subnets_to_zones: Vec::new(),
        endpoint_bindings: Vec::new(),
        image_metadata: Vec::new(),
        availability_zone: None,
        root_disk: None,
        charm_lxd_profiles: Vec::new(),
    }
}

/// An instance config with nothing in it (no machine, no user data, no tags).
pub fn empty_instance_config() -> crate::bindings::InstanceConfig {
    crate::bindings::InstanceConfig {
        machine_id: String::new(),
        machine_nonce: String::new(),
        controller_uuid: String::new(),
        container_type: None,
        hostname: None,
        base: None,
        image_stream: None,
        user_data: None,
        authorized_keys: Vec::new(),
        tags: Vec::new(),
        profiles: Vec::new(),
        proxy_settings: None,
        apt_proxy_settings: None,
        apt_mirror: None,
        cloud_init_properties: Vec::new(),
        enable_os_refresh_update: false,
        enable_os_upgrade: false,
    }
}

/// Params with nothing in them at all.
pub fn empty_params() -> StartInstanceParams {
    params_with(constraints::empty())
}

/// A DHCP ethernet interface `eth0` (device index 0) hanging off host device or bridge `parent`.
pub fn interface_on(parent: &str, mac: &str) -> crate::bindings::InterfaceInfo {
    use crate::bindings::{AddressConfigType, InterfaceInfo, InterfaceType};
    InterfaceInfo {
        device_index: 0,
        mac_address: mac.into(),
        provider_id: None,
        provider_subnet_id: None,
        provider_space_id: None,
        provider_vlan_id: None,
        availability_zones: vec![],
        vlan_tag: 0,
        interface_name: "eth0".into(),
        parent_interface_name: parent.into(),
        interface_type: InterfaceType::Ethernet,
        disabled: false,
        no_auto_start: false,
        config_type: AddressConfigType::Dhcp,
        addresses: vec![],
        shadow_addresses: vec![],
        dns_servers: vec![],
        dns_search_domains: vec![],
        gateway_address: None,
        routes: vec![],
        mtu: 0,
        is_default_gateway: false,
    }
}
