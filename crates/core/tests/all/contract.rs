//! Every field of StartInstanceParams and StartInstanceResult crosses the
//! boundary intact, through the real fake component, in both isolation modes.

use broker_capabilities::bindings::*;
use broker_capabilities::contract::constraints;
use broker_capabilities::rooms::context::{CallEvent, CallHooks};
use broker_capabilities::rooms::kv::{KvBackend, MemoryKv};
use broker_tests::{fake_manifest_extra, load_provider, runtime};
use std::sync::{Arc, Mutex};

fn address(value: &str, kind: AddressKind) -> Address {
    Address {
        value: value.into(),
        kind,
        scope: AddressScope::LocalCloud,
        cidr: Some("10.0.0.0/24".into()),
        config_type: AddressConfigType::Static,
    }
}

fn attachment(volume: &str) -> VolumeAttachmentParams {
    VolumeAttachmentParams {
        volume: volume.into(),
        machine: "machine-7".into(),
        instance_id: Some("i-prev".into()),
        volume_id: Some("vol-x".into()),
        provider: "loop".into(),
        read_only: true,
    }
}

fn volume(tag: &str, size: u64) -> VolumeParams {
    VolumeParams {
        tag: tag.into(),
        size,
        provider: "loop".into(),
        attributes: vec![("persistent".into(), "false".into())],
        resource_tags: vec![("owner".into(), "test".into())],
        attachment: Some(attachment(tag)),
    }
}

fn proxy(prefix: &str) -> ProxySettings {
    ProxySettings {
        http: Some(format!("http://{prefix}:3128")),
        https: Some(format!("https://{prefix}:3129")),
        ftp: None,
        no_proxy: Some("localhost,127.0.0.1".into()),
    }
}

/// Params with every field set to something distinctive.
fn full_params() -> StartInstanceParams {
    let mut constraints = constraints::parse(
        "arch=arm64 container=lxd cores=4 cpu-power=250 mem=3G root-disk=20G root-disk-source=pool \
         tags=a,b instance-role=r instance-type=m5.large spaces=db,^public virt-type=kvm \
         zones=zone-b,zone-c allocate-public-ip=true image-id=img-1",
    )
    .unwrap();
    constraints.zones = Some(vec!["zone-b".into(), "zone-c".into()]);
    StartInstanceParams {
        controller_uuid: "deadbeef-0000-4000-8000-000000000001".into(),
        constraints,
        tools: vec![AgentTools {
            version: "3.6.1-ubuntu-arm64".into(),
            url: "https://example.invalid/tools.tgz".into(),
            sha256: "ab".repeat(32),
            size: 12345,
        }],
        instance_config: Some(InstanceConfig {
            machine_id: "7".into(),
            machine_nonce: "machine-7:0b9b6b1c".into(),
            controller_uuid: "deadbeef-0000-4000-8000-000000000001".into(),
            container_type: Some("lxd".into()),
            hostname: Some("juju-abc-7".into()),
            base: Some("ubuntu@24.04".into()),
            image_stream: Some("released".into()),
            user_data: Some(b"#cloud-config\npackages: [htop]\n\x00\xff".to_vec()),
            authorized_keys: vec!["ssh-ed25519 AAAA test@host".into()],
            tags: vec![("juju-model".into(), "m1".into())],
            profiles: vec!["default".into(), "juju-m1".into()],
            proxy_settings: Some(proxy("proxy")),
            apt_proxy_settings: Some(proxy("apt")),
            apt_mirror: Some("http://mirror.invalid/ubuntu".into()),
            cloud_init_properties: vec![("package_upgrade".into(), "true".into())],
            enable_os_refresh_update: true,
            enable_os_upgrade: false,
        }),
        placement: None,
        volumes: vec![volume("volume-0", 1024), volume("volume-1", 2048)],
        volume_attachments: vec![attachment("volume-0"), attachment("volume-1")],
        network_info: vec![InterfaceInfo {
            device_index: 0,
            mac_address: "00:16:3e:aa:bb:cc".into(),
            provider_id: Some("nic-1".into()),
            provider_subnet_id: Some("subnet-1".into()),
            provider_space_id: Some("space-1".into()),
            provider_vlan_id: Some("vlan-1".into()),
            availability_zones: vec!["zone-b".into()],
            vlan_tag: 42,
            interface_name: "eth0".into(),
            parent_interface_name: "br-eth0".into(),
            interface_type: InterfaceType::Ethernet,
            disabled: false,
            no_auto_start: true,
            config_type: AddressConfigType::Static,
            addresses: vec![address("10.0.0.5", AddressKind::Ipv4), address("fd00::5", AddressKind::Ipv6)],
            shadow_addresses: vec![address("203.0.113.5", AddressKind::Ipv4)],
            dns_servers: vec!["10.0.0.1".into()],
            dns_search_domains: vec!["example.internal".into()],
            gateway_address: Some("10.0.0.1".into()),
            routes: vec![Route { destination_cidr: "192.0.2.0/24".into(), gateway_ip: "10.0.0.254".into(), metric: 5 }],
            mtu: 9000,
            is_default_gateway: true,
        }],
        subnets_to_zones: vec![SubnetZones { subnet_id: "subnet-1".into(), zones: vec!["zone-b".into()] }],
        endpoint_bindings: vec![EndpointBinding { endpoint: "db".into(), space_id: "space-1".into() }],
        image_metadata: vec![ImageMetadata {
            id: "img-1".into(),
            arch: "arm64".into(),
            base: "ubuntu@24.04".into(),
            region: "r1".into(),
            endpoint: "https://images.invalid".into(),
            stream: "released".into(),
            virt_type: Some("kvm".into()),
            storage: Some("ssd".into()),
            extra: vec![("kernel".into(), "/boot/vmlinuz".into())],
        }],
        availability_zone: Some("zone-c".into()),
        root_disk: Some(volume("root", 20480)),
        charm_lxd_profiles: vec!["juju-m1-app-1".into()],
    }
}

async fn round_trip(isolation: &str) {
    let dir = tempfile::tempdir().unwrap();
    let kv = Arc::new(MemoryKv::default());
    let provider = load_provider(&runtime(), kv.clone(), dir.path(), "fake", "fake", &fake_manifest_extra(isolation))
        .expect("load fake");
    let params = full_params();
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let hooks = CallHooks::with_events(move |e| sink.lock().unwrap().push(e));

    let result = provider.start_instance(&hooks, &params).await.expect("start");

    // The guest stored the params exactly as it decoded them.
    let stored = kv.get("fake", &format!("params/{}", result.instance.id)).unwrap().expect("params recorded");
    let seen: StartInstanceParams = serde_json::from_slice(&stored).expect("guest params decode as host params");
    assert_eq!(seen, params, "every params field survives the trip into the guest");

    // Every result field carries what the guest made of them.
    assert_eq!(result.display_name, format!("{} (machine 7)", result.instance.id));
    assert_eq!(result.instance.status, InstanceStatus::Running);
    assert_eq!(result.instance.addresses.len(), 2);
    assert_eq!(result.instance.addresses[1].kind, AddressKind::Ipv6);
    assert_eq!(
        result.config,
        vec![
            ("provider-version".to_string(), "0.1.0".to_string()),
            ("controller-uuid".to_string(), params.controller_uuid.clone())
        ]
    );
    let hw = result.hardware.expect("hardware");
    assert_eq!(
        hw,
        HardwareCharacteristics {
            arch: Some("arm64".into()),
            mem: Some(3072),
            root_disk: Some(20480),
            root_disk_source: Some("pool".into()),
            cpu_cores: Some(4),
            cpu_power: Some(250),
            tags: Some(vec!["a".into(), "b".into()]),
            availability_zone: Some("zone-c".into()),
            virt_type: Some("kvm".into()),
        }
    );
    assert_eq!(result.network_info, params.network_info);
    let tags: Vec<_> = result.volumes.iter().map(|v| (v.tag.as_str(), v.size)).collect();
    assert_eq!(tags, [("volume-0", 1024), ("volume-1", 2048)]);
    assert_eq!(result.volume_attachments.len(), 2);
    assert_eq!(result.volume_attachments[0].device_name.as_deref(), Some("vdb"));
    assert!(result.volume_attachments.iter().all(|a| a.read_only && a.machine == "machine-7"));

    let events = events.lock().unwrap().clone();
    let statuses: Vec<_> = events
        .iter()
        .map(|e| match e {
            CallEvent::Status { status, .. } => *status,
            CallEvent::Cleanup { .. } => panic!("unexpected cleanup"),
        })
        .collect();
    assert_eq!(statuses, [InstanceStatus::Allocating, InstanceStatus::Running]);
}

#[tokio::test]
async fn every_field_round_trips_pooled() {
    round_trip("pooled").await;
}

#[tokio::test]
async fn every_field_round_trips_per_call() {
    round_trip("per-call").await;
}
