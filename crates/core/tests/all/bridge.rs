//! Host bridging through real netlink, in a network namespace each test makes
//! for itself (`unshare(CLONE_NEWNET)` on a thread of its own), with veth
//! devices standing in for the host's NICs (this kernel has no `dummy` driver).

use broker_capabilities::contract::{empty_params, interface_on};
use broker_capabilities::network::backend::NetworkBackend;
use broker_capabilities::network::names::bridge_name;
use broker_capabilities::network::netlink::Netlink;
use broker_capabilities::network::{BridgeError, Device, DeviceToBridge};
use broker_capabilities::rooms::context::CallHooks;
use broker_core::broker::Broker;
use broker_core::store::EventKind;
use broker_tests::netns::{in_netns, make_nic};

async fn add_default_route(gateway: &str, oif: u32) {
    use rtnetlink::RouteMessageBuilder;
    let (connection, handle, _) = rtnetlink::new_connection().unwrap();
    tokio::spawn(connection);
    let route = RouteMessageBuilder::<std::net::Ipv4Addr>::new()
        .gateway(gateway.parse().unwrap())
        .output_interface(oif)
        .build();
    handle.route().add(route).execute().await.unwrap();
}

/// The output interface of the IPv4 default route, if there is one.
async fn default_route_oif() -> Option<u32> {
    use futures_util::TryStreamExt;
    use rtnetlink::packet_route::route::RouteAttribute;
    let (connection, handle, _) = rtnetlink::new_connection().unwrap();
    tokio::spawn(connection);
    let routes: Vec<_> = handle
        .route()
        .get(rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new().build())
        .execute()
        .try_collect()
        .await
        .unwrap();
    routes
        .iter()
        .filter(|r| r.header.destination_prefix_length == 0)
        .find_map(|r| r.attributes.iter().find_map(|a| if let RouteAttribute::Oif(i) = a { Some(*i) } else { None }))
}

fn addresses(device: &Device) -> Vec<String> {
    let mut addrs: Vec<String> =
        device.addresses.iter().map(|a| a.to_string()).filter(|a| !a.starts_with("fe80")).collect();
    addrs.sort();
    addrs
}

#[test]
fn bridging_moves_addresses_keeps_the_mac_and_is_idempotent() {
    in_netns(|| async {
        make_nic("eth0", [0x00, 0x16, 0x3e, 0x11, 0x22, 0x33], "10.10.0.2/24").await;
        let nl = Netlink::connect().unwrap();
        let before = nl.device("eth0").await.unwrap().unwrap();
        assert_eq!(addresses(&before), ["10.10.0.2/24"]);
        add_default_route("10.10.0.1", before.index).await;
        assert_eq!(default_route_oif().await, Some(before.index));

        let change = DeviceToBridge { device: "eth0".into(), bridge: bridge_name("eth0"), mac: String::new() };
        nl.bridge(&change).await.unwrap();
        let bridge = nl.device("br-eth0").await.unwrap().expect("bridge made");
        let eth0 = nl.device("eth0").await.unwrap().unwrap();
        assert_eq!(bridge.kind, "bridge");
        assert_eq!(bridge.mac, "00:16:3e:11:22:33", "the bridge keeps the device's MAC");
        assert_eq!(addresses(&bridge), ["10.10.0.2/24"], "the address moved to the bridge");
        assert!(addresses(&eth0).is_empty(), "and left the device");
        assert_eq!(eth0.controller.as_deref(), Some("br-eth0"));
        assert!(bridge.up && eth0.up);
        assert_eq!(default_route_oif().await, Some(bridge.index), "the default route followed the address");

        // Again: a no-op.
        let devices = nl.devices().await.unwrap();
        nl.bridge(&change).await.unwrap();
        assert_eq!(nl.devices().await.unwrap(), devices);

        // Into another bridge: refused.
        let elsewhere = DeviceToBridge { device: "eth0".into(), bridge: "br-other".into(), mac: String::new() };
        assert!(matches!(nl.bridge(&elsewhere).await, Err(BridgeError::BridgedElsewhere { .. })));
        assert!(nl.device("br-other").await.unwrap().is_none(), "nothing was made for the refused change");
        let missing = DeviceToBridge { device: "eth9".into(), bridge: "br-eth9".into(), mac: String::new() };
        assert!(matches!(nl.bridge(&missing).await, Err(BridgeError::NoDevice(_))));
    });
}

#[test]
fn an_instance_veth_is_attached_and_cleanup_restores_the_namespace() {
    in_netns(|| async {
        make_nic("eth1", [0x00, 0x16, 0x3e, 0x44, 0x55, 0x66], "192.168.77.5/24").await;
        let nl = Netlink::connect().unwrap();
        let initial = nl.devices().await.unwrap();
        let eth1_index = initial.iter().find(|d| d.name == "eth1").unwrap().index;
        add_default_route("192.168.77.1", eth1_index).await;

        nl.bridge(&DeviceToBridge { device: "eth1".into(), bridge: "br-eth1".into(), mac: String::new() })
            .await
            .unwrap();
        nl.create_veth("vm1-host", "vm1-guest", "br-eth1").await.unwrap();
        let host_end = nl.device("vm1-host").await.unwrap().unwrap();
        assert_eq!(host_end.controller.as_deref(), Some("br-eth1"));
        assert_eq!(host_end.kind, "veth");
        assert!(nl.device("vm1-guest").await.unwrap().unwrap().up);
        assert!(matches!(nl.attach("vm1-guest", "eth1").await, Err(BridgeError::NotABridge(_))));
        nl.create_tap("tap-vm2", "br-eth1", "52:54:00:12:34:56").await.unwrap();
        let tap = nl.device("tap-vm2").await.unwrap().expect("tap made");
        assert_eq!(tap.kind, "tun");
        assert_eq!(tap.mac, "52:54:00:12:34:56");
        assert_eq!(tap.controller.as_deref(), Some("br-eth1"));
        nl.delete("tap-vm2").await.unwrap();
        assert!(nl.device("tap-vm2").await.unwrap().is_none(), "the persistent tap is gone");

        // Delete what the host made: the veth pair, then the bridge.
        nl.delete("vm1-host").await.unwrap();
        assert!(nl.device("vm1-guest").await.unwrap().is_none(), "the peer went with it");
        nl.unbridge("eth1", "br-eth1").await.unwrap();
        let after = nl.devices().await.unwrap();
        let names = |ds: &[Device]| ds.iter().map(|d| d.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&after), names(&initial));
        let eth1 = after.iter().find(|d| d.name == "eth1").unwrap();
        assert_eq!(addresses(eth1), ["192.168.77.5/24"]);
        assert_eq!(eth1.controller, None);
        assert_eq!(default_route_oif().await, Some(eth1_index), "the default route came back to eth1");
    });
}

/// A tap goes to the sandbox user it is made for, and an existing tap is never
/// handed to another user (root may re-own any tap; the host is root) nor
/// deleted for one; the host's own taps are root's, not open to every user.
#[test]
fn a_tap_is_never_re_owned_to_another_user() {
    in_netns(|| async {
        make_nic("eth3", [0x00, 0x16, 0x3e, 0x12, 0x21, 0x31], "10.30.0.2/24").await;
        let nl = Netlink::connect().unwrap();
        nl.bridge(&DeviceToBridge { device: "eth3".into(), bridge: "br-eth3".into(), mac: String::new() })
            .await
            .unwrap();
        let (mine, theirs) = (2_000_000_001, 2_000_000_002);
        let owned_elsewhere = |r: &Result<(), BridgeError>| matches!(r, Err(BridgeError::TapOwnedElsewhere { .. }));
        nl.create_tap_owned("tap-a", "br-eth3", "", Some(mine)).await.unwrap();
        // Made again for the same user: reused.
        nl.create_tap_owned("tap-a", "br-eth3", "52:54:00:00:00:0a", Some(mine)).await.unwrap();
        let refused = nl.create_tap_owned("tap-a", "br-eth3", "", Some(theirs)).await;
        assert!(owned_elsewhere(&refused), "{refused:?}");
        let refused = nl.delete_owned("tap-a", Some(theirs)).await;
        assert!(owned_elsewhere(&refused), "{refused:?}");
        // The host's own tap is root's: not given to a sandbox user.
        nl.create_tap("tap-root", "br-eth3", "").await.unwrap();
        let refused = nl.create_tap_owned("tap-root", "br-eth3", "", Some(mine)).await;
        assert!(owned_elsewhere(&refused), "{refused:?}");
        // Nothing was re-owned: each is still reusable by its own user only.
        nl.create_tap_owned("tap-a", "br-eth3", "", Some(mine)).await.unwrap();
        nl.create_tap("tap-root", "br-eth3", "").await.unwrap();
        // A tap no one owns is open to every user already: it may be given to this one.
        let made = std::process::Command::new("ip").args(["tuntap", "add", "tap-free", "mode", "tap"]).status();
        assert!(made.unwrap().success());
        nl.create_tap_owned("tap-free", "br-eth3", "", Some(mine)).await.unwrap();
        let refused = nl.create_tap_owned("tap-free", "br-eth3", "", Some(theirs)).await;
        assert!(owned_elsewhere(&refused), "tap-free is now {mine}'s: {refused:?}");
        // A name that is not a tap is not taken over.
        let refused = nl.create_tap_owned("eth3", "br-eth3", "", Some(mine)).await;
        assert!(matches!(refused, Err(BridgeError::NotATap(_))), "{refused:?}");
        nl.delete_owned("tap-a", Some(mine)).await.unwrap();
        assert!(nl.device("tap-a").await.unwrap().is_none());
    });
}

/// Through the real broker: a start whose network info hangs off `br-eth2`
/// first bridges eth2 under the machine lock, records the observed network,
/// then starts the instance; a parent the host cannot make stops the start
/// before the provider is called.
#[test]
fn start_instance_prepares_the_host_bridge_first() {
    in_netns(|| async {
        make_nic("eth2", [0x00, 0x16, 0x3e, 0x77, 0x88, 0x99], "10.20.0.2/24").await;
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(&dir.path().join("data")).unwrap();
        broker.registry().add(&broker_tests::bundled_manifest("fake")).await.unwrap();

        let mut params = empty_params();
        params.network_info = vec![interface_on("br-eth2", "00:16:3e:00:00:01")];
        let first = broker.start_instance("fake", &params, &CallHooks::default()).await.unwrap();
        let nl = Netlink::connect().unwrap();
        let bridge = nl.device("br-eth2").await.unwrap().expect("HostPreparer made the bridge");
        assert_eq!(addresses(&bridge), ["10.20.0.2/24"]);
        let observed = broker.store().observed_network().unwrap().expect("observed network recorded");
        assert!(observed.devices.iter().any(|d| d.name == "br-eth2" && d.mac == "00:16:3e:77:88:99"));
        let lock_report = broker_core::broker::service::machine_lock(&dir.path().join("data")).unwrap().report(10);
        assert_eq!(lock_report.history.len(), 1);
        assert!(lock_report.history[0].contains("broker: broker (bridging devices)"), "{:?}", lock_report.history);

        // The bridge exists now: a second start takes the lock, finds nothing to do.
        let second = broker.start_instance("fake", &params, &CallHooks::default()).await.unwrap();
        assert_ne!(first.id, second.id);
        let before = broker.list_instances(Some("fake")).await.unwrap().len();

        params.network_info = vec![interface_on("br-nowhere", "00:16:3e:00:00:02")];
        let err = broker.start_instance("fake", &params, &CallHooks::default()).await.unwrap_err();
        assert!(err.to_string().starts_with("unable to setup network: no host device"), "{err}");
        assert_eq!(broker.list_instances(Some("fake")).await.unwrap().len(), before, "the provider was not called");
    });
}

/// A guest bridges through the capability only what its grant names, and of
/// that only what it made: a host device, granted by name, is still the
/// host's (HostPreparer's to bridge).
#[test]
fn a_guest_bridges_only_granted_devices_it_made() {
    in_netns(|| async {
        use broker_capabilities::bindings::BrokerError;
        use broker_capabilities::rooms::kv::{KvBackend, MemoryKv};
        use std::sync::Arc;

        make_nic("eth3", [0x00, 0x16, 0x3e, 0x01, 0x02, 0x03], "10.30.0.2/24").await;
        make_nic("eth4", [0x00, 0x16, 0x3e, 0x04, 0x05, 0x06], "10.40.0.2/24").await;
        let dir = tempfile::tempdir().unwrap();
        let kv = Arc::new(MemoryKv::default());
        let rt = broker_tests::runtime();
        let load = |extra: &str| {
            broker_tests::load_provider(&rt, kv.clone(), dir.path(), "hostile", "test-hostile", extra).unwrap()
        };
        let ungranted = load("[grants]\nkv = true\n");
        let granted =
            load("[grants]\nkv = true\n[grants.bridge]\ndevices = [\"eth3\", \"vh*\"]\nbridges = [\"br-*\"]\n");

        kv.set("hostile", "mode", b"bridge:eth3").unwrap();
        let err = ungranted.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err.broker_error(), Some(BrokerError::AccessDenied(_))), "{err}");
        let err = granted.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(
            matches!(err.broker_error(), Some(BrokerError::AccessDenied(m)) if m.contains("eth3 is the host's")),
            "{err}"
        );
        let nl = Netlink::connect().unwrap();
        assert!(nl.device("br-eth3").await.unwrap().is_none(), "nothing was made for the host's device");
        assert_eq!(addresses(&nl.device("eth3").await.unwrap().unwrap()), ["10.30.0.2/24"]);

        kv.set("hostile", "mode", b"bridge:eth4").unwrap();
        let err = granted.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err.broker_error(), Some(BrokerError::AccessDenied(m)) if m.contains("eth4")), "{err}");
        assert!(nl.device("br-eth4").await.unwrap().is_none(), "nothing was done for the ungranted device");

        // Its own veth: made, bridged into a bridge of its own (made now, its own too).
        kv.set("hostile", "mode", b"veth:vh1:vh1p:br-eth3").unwrap();
        let err = granted.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err.broker_error(), Some(BrokerError::NotFound(_))), "no such bridge: {err}");
        assert!(nl.device("vh1").await.unwrap().is_none());
        kv.set("hostile", "mode", b"bridge-to:vh1:br-own").unwrap();
        let err = granted.all_instances(&CallHooks::default()).await.unwrap_err();
        assert!(matches!(err.broker_error(), Some(BrokerError::NotFound(_))), "{err}");
        assert!(nl.device("br-own").await.unwrap().is_none(), "a bridge not made is not left");
    });
}

/// Set `provider`'s test-hostile mode and call it (`all-instances`): the
/// first id it answers, or the guest's error.
async fn hostile_call(
    broker: &Broker,
    provider: &str,
    mode: &str,
) -> Result<String, broker_capabilities::bindings::BrokerError> {
    use broker_capabilities::rooms::kv::KvBackend;
    broker.store().kv().set(provider, "mode", mode.as_bytes()).unwrap();
    let wasm = broker.registry().get(provider).await.unwrap();
    match wasm.all_instances(&CallHooks::default()).await {
        Ok(instances) => Ok(instances[0].id.clone()),
        Err(err) => Err(err.broker_error().cloned().unwrap_or_else(|| panic!("not the guest's error: {err}"))),
    }
}

/// `outcome` is an `access-denied` that says `says`.
fn refused(outcome: Result<String, broker_capabilities::bindings::BrokerError>, says: &str) {
    match outcome {
        Err(broker_capabilities::bindings::BrokerError::AccessDenied(message)) => {
            assert!(message.contains(says), "{message:?} lacks {says:?}")
        }
        other => panic!("not refused ({says}): {other:?}"),
    }
}

/// Issue 36, class 2, through real netlink and the real broker (its store
/// keeps the record): two providers with the KVM grant. The attacker cannot
/// attach the victim's tap to its own bridge, delete the victim's veth, or
/// unbridge the host's bridge (which carries the host's address and default
/// route) — each refusal names the owner and nothing changes; the record
/// survives a restart; removing a provider deletes what it made.
#[test]
fn a_provider_touches_only_the_devices_it_made() {
    in_netns(|| async {
        make_nic("eth5", [0x00, 0x16, 0x3e, 0x05, 0x05, 0x05], "10.50.0.2/24").await;
        let nl = Netlink::connect().unwrap();
        add_default_route("10.50.0.1", nl.device("eth5").await.unwrap().unwrap().index).await;
        // The host's bridge, as HostPreparer makes it: eth5's address and default route move onto it.
        let host_bridge = DeviceToBridge { device: "eth5".into(), bridge: "br-eth5".into(), mac: String::new() };
        nl.bridge(&host_bridge).await.unwrap();
        let br_index = nl.device("br-eth5").await.unwrap().unwrap().index;
        assert_eq!(default_route_oif().await, Some(br_index));

        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let grant = "[grants]\nkv = true\n[grants.bridge]\ndevices = [\"kt*\", \"vh*\"]\nbridges = [\"br-*\"]\n\
                     attach-to = [\"br-eth5\"]\n";
        let manifests = |name: &str| broker_tests::write_manifest(dir.path(), name, "test-hostile", grant);
        let broker = Broker::open(&data).unwrap();
        for name in ["victim", "attacker"] {
            broker.registry().add(&manifests(name)).await.unwrap();
        }
        let call = hostile_call;

        // The victim: a VM's tap on the host bridge, a veth pair.
        assert_eq!(call(&broker, "victim", "tap:kt1:br-eth5").await.unwrap(), "done");
        assert_eq!(call(&broker, "victim", "veth:vh1:vh1p:br-eth5").await.unwrap(), "done");
        // The attacker: a veth and a bridge of its own.
        call(&broker, "attacker", "veth:vh2:vh2p:br-eth5").await.unwrap();
        call(&broker, "attacker", "bridge-to:vh2p:br-evil").await.unwrap();
        assert_eq!(nl.device("br-evil").await.unwrap().unwrap().kind, "bridge");

        let host_state = async || {
            let br = nl.device("br-eth5").await.unwrap().expect("the host bridge is there");
            let eth5 = nl.device("eth5").await.unwrap().unwrap();
            (addresses(&br), eth5.controller, default_route_oif().await == Some(br.index))
        };
        let host_before = host_state().await;
        assert_eq!(host_before, (vec!["10.50.0.2/24".to_owned()], Some("br-eth5".to_owned()), true));

        refused(call(&broker, "attacker", "attach:kt1:br-evil").await, "tap kt1 belongs to provider victim");
        assert_eq!(nl.device("kt1").await.unwrap().unwrap().controller.as_deref(), Some("br-eth5"), "kt1 stays");
        refused(call(&broker, "attacker", "delete-link:vh1").await, "veth vh1 belongs to provider victim");
        refused(call(&broker, "attacker", "delete-link:vh1p").await, "veth vh1p belongs to provider victim");
        assert!(nl.device("vh1").await.unwrap().is_some() && nl.device("vh1p").await.unwrap().is_some());
        refused(call(&broker, "attacker", "unbridge:vh2p:br-eth5").await, "bridge br-eth5 is the host's");
        refused(call(&broker, "attacker", "unbridge:kt1:br-eth5").await, "tap kt1 belongs to provider victim");
        refused(call(&broker, "attacker", "bridge-to:vh2:br-eth5").await, "bridge br-eth5 is the host's");
        refused(call(&broker, "attacker", "tap:kt1:br-evil").await, "tap kt1 belongs to provider victim");
        refused(call(&broker, "victim", "attach:kt1:br-evil").await, "bridge br-evil belongs to provider attacker");
        assert_eq!(host_state().await, host_before, "the host bridge keeps its address and default route");

        // The record is the store's: it survives a restart.
        drop(broker);
        let broker = Broker::open(&data).unwrap();
        refused(call(&broker, "attacker", "attach:kt1:br-evil").await, "tap kt1 belongs to provider victim");
        assert_eq!(nl.device("kt1").await.unwrap().unwrap().controller.as_deref(), Some("br-eth5"));

        // Its own, it may: the attacker unbridges its bridge and deletes its veth.
        call(&broker, "attacker", "unbridge:vh2p:br-evil").await.unwrap();
        assert!(nl.device("br-evil").await.unwrap().is_none());
        // Removing the victim deletes what it made and drops its records.
        broker.registry().remove("victim").await.unwrap();
        for gone in ["kt1", "vh1", "vh1p"] {
            assert!(nl.device(gone).await.unwrap().is_none(), "{gone} was deleted with its provider");
        }
        assert!(broker.store().device_owners().owned_by("victim").unwrap().is_empty());
        assert_eq!(broker.store().device_owners().owned_by("attacker").unwrap().len(), 2, "vh2, vh2p");
        assert_eq!(host_state().await, host_before, "and the host's bridge is untouched");
        let removed =
            broker.store().events(0, 1000).unwrap().into_iter().rev().find(|e| e.kind == EventKind::Removed).unwrap();
        assert!(removed.detail.contains("network devices it made deleted: kt1, vh1"), "{}", removed.detail);
    });
}

/// Issue 36, what the second round left: a record names a device, not a
/// name. Through real netlink and the real broker: a tap the host made for a
/// provider's user before owners were recorded (an upgrade with VMs running)
/// is that provider's to attach and delete, one of another user's is not; a
/// veth the provider made, deleted and made again under its name by someone
/// else, is not the provider's; the name HostPreparer gives a host device's
/// bridge cannot be taken first.
#[test]
fn a_record_names_a_device_and_an_old_tap_of_the_providers_user_is_its_own() {
    in_netns(|| async {
        make_nic("eth6", [0x00, 0x16, 0x3e, 0x06, 0x06, 0x06], "10.60.0.2/24").await;
        make_nic("eth7", [0x00, 0x16, 0x3e, 0x07, 0x07, 0x07], "10.70.0.2/24").await;
        let nl = Netlink::connect().unwrap();
        let host_bridge = DeviceToBridge { device: "eth6".into(), bridge: "br-eth6".into(), mac: String::new() };
        nl.bridge(&host_bridge).await.unwrap();

        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        // A granted program: the provider has a sandbox user, which its taps are made for.
        let grant = "[grants]\nkv = true\nprocess = [\"true\"]\n[grants.bridge]\ndevices = [\"kt*\", \"vh*\"]\n\
                     bridges = [\"br-*\"]\nattach-to = [\"br-eth6\"]\n";
        let broker = Broker::open(&data).unwrap();
        broker.registry().add(&broker_tests::write_manifest(dir.path(), "kvm", "test-hostile", grant)).await.unwrap();
        let call = async |mode: &str| hostile_call(&broker, "kvm", mode).await;
        let owners = broker.store().device_owners();

        // (in_netns needs root: the host switches to sandbox users and sets tap owners here.)
        let uid = broker.store().sandbox_users().unwrap().into_iter().find(|(p, _)| p == "kvm").unwrap().1;
        // As the last release made a VM's tap: owned by the provider's user, no record.
        broker_capabilities::network::tap::create_persistent_tap("kt-old", uid, true).unwrap();
        broker_capabilities::network::tap::create_persistent_tap("kt-else", uid + 1, true).unwrap();
        assert_eq!(owners.owner("kt-old").unwrap(), None);
        assert_eq!(call("attach:kt-old:br-eth6").await.unwrap(), "done");
        assert_eq!(nl.device("kt-old").await.unwrap().unwrap().controller.as_deref(), Some("br-eth6"));
        assert_eq!(call("delete-link:kt-old").await.unwrap(), "done", "a VM started before the upgrade stops");
        assert!(nl.device("kt-old").await.unwrap().is_none());
        refused(call("attach:kt-else:br-eth6").await, "tap kt-else is the host's");
        refused(call("delete-link:kt-else").await, "tap kt-else is the host's");
        assert!(nl.device("kt-else").await.unwrap().is_some());
        assert_eq!(owners.owner("kt-else").unwrap(), None);

        // Made, recorded with its index; deleted and its name taken by a device of the host's.
        assert_eq!(call("veth:vh1:vh1p:br-eth6").await.unwrap(), "done");
        let made = owners.owner("vh1").unwrap().expect("recorded");
        assert_eq!(made.index, Some(nl.device("vh1").await.unwrap().unwrap().index));
        nl.delete("vh1").await.unwrap();
        make_nic("vh1", [0x00, 0x16, 0x3e, 0x08, 0x08, 0x08], "10.80.0.2/24").await;
        refused(call("delete-link:vh1").await, "is the host's");
        assert!(nl.device("vh1").await.unwrap().is_some(), "the host's device stays");
        assert_eq!(owners.owner("vh1").unwrap(), None, "the stale record is forgotten");

        // eth7's bridge is HostPreparer's to make.
        assert_eq!(call("veth:vh2:vh2p:br-eth6").await.unwrap(), "done");
        refused(call("bridge-to:vh2p:br-eth7").await, "the bridge of eth7 (HostPreparer)");
        assert!(nl.device("br-eth7").await.unwrap().is_none());
        assert_eq!(call("bridge-to:vh2p:br-vms").await.unwrap(), "done", "a name of its own is fine");
    });
}

/// What the simulated network must agree with the kernel on, for the devices
/// a sequence touches: kind, bridge, state, addresses (not link-local), and
/// the MAC where it was chosen (a bridge's, and `kt1`'s, given by its step).
async fn view(network: &dyn NetworkBackend, names: &[&str]) -> Vec<String> {
    let devices = network.devices().await.unwrap();
    names
        .iter()
        .filter_map(|name| devices.iter().find(|d| d.name == *name))
        .map(|d| {
            let mac = if d.kind == "bridge" || d.name == "kt1" { d.mac.as_str() } else { "-" };
            let controller = d.controller.as_deref().unwrap_or("-");
            format!("{} {} {controller} up={} {mac} {:?}", d.name, d.kind, d.up, addresses(d))
        })
        .collect()
}

/// One bridging call, to make on the kernel and on the simulation alike.
enum Op {
    Bridge(&'static str, &'static str),
    Tap(&'static str, &'static str, &'static str),
    Veth(&'static str, &'static str, &'static str),
    Attach(&'static str, &'static str),
    Delete(&'static str),
    Unbridge(&'static str, &'static str),
}

impl Op {
    /// The outcome; an error as its text, but a netlink error only as such
    /// (the kernel's words are not the simulation's).
    async fn apply(&self, network: &dyn NetworkBackend) -> Result<(), String> {
        let done = match *self {
            Op::Bridge(device, bridge) => {
                let change = DeviceToBridge { device: device.into(), bridge: bridge.into(), mac: String::new() };
                network.bridge(&change).await
            }
            Op::Tap(name, bridge, mac) => network.create_tap(name, bridge, mac, None).await,
            Op::Veth(name, peer, bridge) => network.create_veth(name, peer, bridge).await,
            Op::Attach(device, bridge) => network.attach(device, bridge).await,
            Op::Delete(name) => network.delete(name).await,
            Op::Unbridge(device, bridge) => network.unbridge(device, bridge).await,
        };
        done.map_err(|e| match e {
            BridgeError::Netlink(_) | BridgeError::Io { .. } => "netlink error".to_owned(),
            other => other.to_string(),
        })
    }
}

#[test]
fn the_simulated_network_behaves_as_the_kernel_does() {
    use broker_capabilities::network::backend::HostNetwork;
    use broker_capabilities::network::simulated::SimNetwork;
    in_netns(|| async {
        make_nic("eth0", [0x00, 0x16, 0x3e, 0x44, 0x55, 0x66], "10.20.0.2/24").await;
        let real = HostNetwork;
        // The simulation starts from the host as a recording would find it.
        let found: Vec<Device> = real.devices().await.unwrap().into_iter().filter(|d| d.name != "lo").collect();
        let simulated = SimNetwork::new(found);
        let names = ["eth0", "eth0p", "br-eth0", "kt1", "kt3", "vh1", "vh1p", "vh3", "vh3p"];
        let steps = [
            ("bridge eth0", Op::Bridge("eth0", "br-eth0")),
            ("bridge eth0 again", Op::Bridge("eth0", "br-eth0")),
            ("bridge eth0 elsewhere", Op::Bridge("eth0", "br-x")),
            ("bridge into a veth", Op::Bridge("eth0p", "eth0")),
            ("tap", Op::Tap("kt1", "br-eth0", "52:54:00:12:34:56")),
            ("tap on a missing bridge", Op::Tap("kt2", "br-none", "")),
            ("tap on a non-bridge", Op::Tap("kt3", "eth0p", "")),
            ("veth", Op::Veth("vh1", "vh1p", "br-eth0")),
            ("veth that exists", Op::Veth("vh1", "vh2p", "br-eth0")),
            ("veth on a non-bridge", Op::Veth("vh3", "vh3p", "eth0p")),
            ("attach", Op::Attach("eth0p", "br-eth0")),
            ("attach to a non-bridge", Op::Attach("vh1p", "eth0")),
            ("delete a veth", Op::Delete("vh1")),
            ("delete the tap", Op::Delete("kt1")),
            ("delete nothing", Op::Delete("nothing")),
            ("unbridge", Op::Unbridge("eth0", "br-eth0")),
        ];
        for (what, op) in steps {
            let on_host = op.apply(&real).await;
            let in_simulation = op.apply(&simulated).await;
            assert_eq!(in_simulation, on_host, "{what}: the outcome");
            assert_eq!(view(&simulated, &names).await, view(&real, &names).await, "{what}: the devices after");
        }
    });
}
