//! HostPreparer: before a provider's `start-instance`, make the host bridges
//! that the params' network info hangs off, in Juju's (newer) order:
//! take the machine lock FIRST, compute the devices to bridge, bridge,
//! observe the network, record what was observed, release.

use crate::store::{Store, StoreError};
use broker_capabilities::bindings::InterfaceInfo;
use broker_capabilities::machine_lock::{LockError, MachineLock, Spec};
use broker_capabilities::network::backend::NetworkBackend;
use broker_capabilities::network::names::bridge_name;
use broker_capabilities::network::{BridgeError, Device, DeviceToBridge};
use futures_util::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

pub(crate) const LOCK_WORKER: &str = "broker";
pub(crate) const LOCK_COMMENT: &str = "bridging devices";

/// The messages are Juju's.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The machine lock was not taken: timed out, cancelled or failed.
    #[error("failed to acquire machine lock for bridging: {0}")]
    Lock(LockError),
    /// The devices could not be listed, or a bridge has no device to go over.
    #[error("unable to setup network: {0}")]
    Changes(String),
    /// Making a bridge failed.
    #[error("failed to bridge devices: {0}")]
    Bridge(BridgeError),
    /// The devices could not be listed after bridging.
    #[error("cannot discover observed network config: {0}")]
    Observe(BridgeError),
    /// The observed devices could not be stored.
    #[error("cannot record observed network config: {}", broker_capabilities::error_text::cause_text(.0))]
    Record(StoreError),
}

/// Where observed network config is kept (the host's store).
pub(crate) trait ObservedNetworkSink: Sync {
    /// Durable when the future is done.
    fn record<'a>(&'a self, observed: &'a [Device]) -> BoxFuture<'a, Result<(), StoreError>>;
}

impl ObservedNetworkSink for Store {
    fn record<'a>(&'a self, observed: &'a [Device]) -> BoxFuture<'a, Result<(), StoreError>> {
        let pending = self.put_observed_network(observed);
        Box::pin(pending.into_future())
    }
}

/// Juju's `HostChangesForContainer`, computed on the host: each network-info
/// parent that is not an existing device is a bridge to make, over the host
/// device that `host_bridges` maps to it, or else the device whose Juju bridge
/// name it is (`br-eth0` over `eth0`).
pub(crate) fn host_changes(
    network_info: &[InterfaceInfo],
    devices: &[Device],
    host_bridges: &BTreeMap<String, String>,
) -> Result<Vec<DeviceToBridge>, String> {
    let mut changes: Vec<DeviceToBridge> = Vec::new();
    for parent in network_info.iter().map(|i| i.parent_interface_name.as_str()).filter(|p| !p.is_empty()) {
        if devices.iter().any(|d| d.name == parent) || changes.iter().any(|c| c.bridge == parent) {
            continue;
        }
        let device = host_bridges
            .get(parent)
            .cloned()
            .or_else(|| devices.iter().find(|d| bridge_name(&d.name) == parent).map(|d| d.name.clone()))
            .ok_or_else(|| {
                format!("no host device to make bridge {parent:?} over (map it under [bridges] in the host config)")
            })?;
        let mac = devices.iter().find(|d| d.name == device).map(|d| d.mac.clone()).unwrap_or_default();
        changes.push(DeviceToBridge { device, bridge: parent.to_owned(), mac });
    }
    Ok(changes)
}

pub(crate) struct HostPreparer<'a> {
    pub lock: &'a MachineLock,
    pub network: &'a dyn NetworkBackend,
    pub sink: &'a dyn ObservedNetworkSink,
    pub(crate) host_bridges: &'a BTreeMap<String, String>,
    pub(crate) lock_timeout: Option<Duration>,
}

impl HostPreparer<'_> {
    /// A parent a provider made (a bridge it named like a host bridge) is
    /// never the host's: the host neither bridges its devices into it nor
    /// hands it to an instance as the host's network.
    /// A record of another boot, or of a device since replaced, names no
    /// provider's device: it is forgotten, and the bridge is the host's.
    async fn refuse_providers_devices(&self, network_info: &[InterfaceInfo]) -> Result<(), PrepareError> {
        let Some(owners) = self.network.owners() else { return Ok(()) };
        let parents: Vec<&str> =
            network_info.iter().map(|i| i.parent_interface_name.as_str()).filter(|p| !p.is_empty()).collect();
        if parents.iter().all(|p| matches!(owners.owner(p), Ok(None))) {
            return Ok(());
        }
        let devices = self.network.devices().await.map_err(|e| PrepareError::Changes(e.to_string()))?;
        for parent in parents {
            let device = devices.iter().find(|d| d.name == parent);
            let owner = broker_capabilities::network::owners::settled_owner(&*owners, parent, device)
                .await
                .map_err(|e| PrepareError::Changes(e.to_string()))?;
            if let Some(owner) = owner {
                return Err(PrepareError::Changes(format!(
                    "{parent:?} was made by provider {}, not by the host: it is not used as a host bridge (delete it or name another)",
                    broker_capabilities::error_text::escape_unprintable(&owner.provider)
                )));
            }
        }
        Ok(())
    }

    /// Returns the changes made (empty when none were needed).
    pub(crate) async fn prepare(
        &self,
        network_info: &[InterfaceInfo],
        abort: Arc<AtomicBool>,
    ) -> Result<Vec<DeviceToBridge>, PrepareError> {
        let spec = Spec {
            worker: LOCK_WORKER.into(),
            comment: LOCK_COMMENT.into(),
            timeout: self.lock_timeout,
            abort: Some(abort),
        };
        let _held = self.lock.acquire(spec).await.map_err(PrepareError::Lock)?;
        let devices = self.network.devices().await.map_err(|e| PrepareError::Changes(e.to_string()))?;
        self.refuse_providers_devices(network_info).await?;
        let changes = host_changes(network_info, &devices, self.host_bridges).map_err(PrepareError::Changes)?;
        if changes.is_empty() {
            tracing::debug!("no host bridges needed");
            return Ok(changes);
        }
        tracing::info!(?changes, "bridging host devices");
        for change in &changes {
            self.network.bridge(change).await.map_err(PrepareError::Bridge)?;
        }
        let observed = self.network.devices().await.map_err(PrepareError::Observe)?;
        if !observed.is_empty() {
            self.sink.record(&observed).await.map_err(PrepareError::Record)?;
        }
        Ok(changes)
        // `_held` drops here: the lock is released on every path.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_capabilities::contract::interface_on;
    use broker_capabilities::network::simulated::SimNetwork;
    use std::sync::Mutex;

    /// A simulated host network that also notes each step and whether the
    /// lock was held then, and fails where told to.
    struct FakeNetwork {
        lock: MachineLock,
        network: SimNetwork,
        events: Mutex<Vec<String>>,
        fail_bridge: bool,
        fail_second_observe: bool,
        observe_nothing_after_bridge: bool,
    }

    impl FakeNetwork {
        fn new(lock: &MachineLock) -> Self {
            FakeNetwork {
                lock: lock.clone(),
                network: SimNetwork::new(vec![device("eth0", "00:16:3e:00:00:01")]),
                events: Mutex::default(),
                fail_bridge: false,
                fail_second_observe: false,
                observe_nothing_after_bridge: false,
            }
        }

        fn note(&self, step: &str) -> usize {
            let holder = self.lock.report(0).holder.map(|h| h.label());
            let held = holder.as_deref() == Some("broker (bridging devices)");
            let mut events = self.events.lock().unwrap();
            events.push(format!("{step}{}", if held { "" } else { " WITHOUT LOCK" }));
            events.len()
        }

        fn events(&self) -> Vec<String> {
            self.events.lock().unwrap().clone()
        }
    }

    impl NetworkBackend for FakeNetwork {
        fn devices(&self) -> BoxFuture<'_, Result<Vec<Device>, BridgeError>> {
            Box::pin(async {
                let n = self.note("observe");
                if n > 1 && self.fail_second_observe {
                    return Err(BridgeError::Io { what: "observe".into(), cause: std::io::Error::other("failed") });
                }
                if n > 1 && self.observe_nothing_after_bridge {
                    return Ok(vec![]);
                }
                NetworkBackend::devices(&self.network).await
            })
        }
        fn bridge<'a>(&'a self, change: &'a DeviceToBridge) -> BoxFuture<'a, Result<(), BridgeError>> {
            Box::pin(async move {
                self.note(&format!("bridge {}->{}", change.device, change.bridge));
                if self.fail_bridge {
                    return Err(BridgeError::Io { what: "bridge".into(), cause: std::io::Error::other("failed") });
                }
                NetworkBackend::bridge(&self.network, change).await
            })
        }
        fn unbridge<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
            NetworkBackend::unbridge(&self.network, device, bridge)
        }
        fn owners(&self) -> Option<std::sync::Arc<dyn broker_capabilities::network::owners::DeviceOwners>> {
            NetworkBackend::owners(&self.network)
        }
        fn create_veth<'a>(
            &'a self,
            name: &'a str,
            peer: &'a str,
            bridge: &'a str,
        ) -> BoxFuture<'a, Result<(), BridgeError>> {
            NetworkBackend::create_veth(&self.network, name, peer, bridge)
        }
        fn create_tap<'a>(
            &'a self,
            name: &'a str,
            bridge: &'a str,
            mac: &'a str,
            owner: Option<u32>,
        ) -> BoxFuture<'a, Result<(), BridgeError>> {
            NetworkBackend::create_tap(&self.network, name, bridge, mac, owner)
        }
        fn attach<'a>(&'a self, device: &'a str, bridge: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
            NetworkBackend::attach(&self.network, device, bridge)
        }
        fn delete_owned<'a>(&'a self, name: &'a str, owner: Option<u32>) -> BoxFuture<'a, Result<(), BridgeError>> {
            NetworkBackend::delete_owned(&self.network, name, owner)
        }
        fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), BridgeError>> {
            NetworkBackend::delete(&self.network, name)
        }
    }

    impl ObservedNetworkSink for FakeNetwork {
        fn record<'a>(&'a self, observed: &'a [Device]) -> BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(async move {
                self.note(&format!("record {}", observed.len()));
                Ok(())
            })
        }
    }

    fn device(name: &str, mac: &str) -> Device {
        Device {
            name: name.into(),
            index: 2,
            mac: mac.into(),
            mtu: 1500,
            kind: String::new(),
            controller: None,
            up: true,
            addresses: vec![],
            tun_owner: None,
        }
    }

    /// Network info with one interface whose parent is `parent`.
    fn nic_on(parent: &str) -> Vec<InterfaceInfo> {
        vec![interface_on(parent, "00:16:3e:00:00:99")]
    }

    fn lock() -> (tempfile::TempDir, MachineLock) {
        let dir = tempfile::tempdir().unwrap();
        let lock = MachineLock::new(dir.path(), "machine-lock", "test").unwrap();
        (dir, lock)
    }

    async fn prepare(
        lock: &MachineLock,
        network: &FakeNetwork,
        info: &[InterfaceInfo],
        timeout: Option<Duration>,
        abort: bool,
    ) -> Result<Vec<DeviceToBridge>, PrepareError> {
        let bridges = BTreeMap::new();
        let preparer = HostPreparer { lock, network, sink: network, host_bridges: &bridges, lock_timeout: timeout };
        preparer.prepare(info, Arc::new(AtomicBool::new(abort))).await
    }

    #[tokio::test]
    async fn no_devices_to_bridge_means_no_bridging_and_the_lock_released() {
        let (_dir, lock) = lock();
        let network = FakeNetwork::new(&lock);
        let changes = prepare(&lock, &network, &nic_on("eth0"), None, false).await.unwrap();
        assert!(changes.is_empty(), "eth0 exists: nothing to bridge");
        assert_eq!(network.events(), ["observe"]);
        let report = lock.report(10);
        assert!(report.holder.is_none());
        assert!(report.history[0].contains("test: broker (bridging devices)"));
    }

    #[tokio::test]
    async fn happy_path_runs_in_jujus_order_under_the_lock() {
        let (_dir, lock) = lock();
        let network = FakeNetwork::new(&lock);
        let changes = prepare(&lock, &network, &nic_on("br-eth0"), None, false).await.unwrap();
        assert_eq!(
            changes,
            [DeviceToBridge { device: "eth0".into(), bridge: "br-eth0".into(), mac: "00:16:3e:00:00:01".into() }]
        );
        // What was observed after bridging is the device and its new bridge.
        assert_eq!(network.events(), ["observe", "bridge eth0->br-eth0", "observe", "record 2"]);
        let bridged = network.network.devices();
        assert_eq!(bridged.iter().find(|d| d.name == "eth0").and_then(|d| d.controller.as_deref()), Some("br-eth0"));
        assert!(lock.report(0).holder.is_none(), "released at the end");
    }

    /// A bridge a provider made under a host bridge's name is never taken
    /// for the host's: the start is refused, nothing is bridged into it.
    #[tokio::test]
    async fn a_providers_bridge_is_never_the_hosts() {
        let (_dir, lock) = lock();
        let mut bridge = device("br-eth0", "02:00:00:00:00:09");
        bridge.kind = "bridge".into();
        let owners = BTreeMap::from([("br-eth0".to_owned(), "kvm2".to_owned())]);
        let simulated = SimNetwork::with_owners(vec![device("eth0", "00:16:3e:00:00:01"), bridge], owners);
        let network = FakeNetwork { network: simulated, ..FakeNetwork::new(&lock) };
        let err = prepare(&lock, &network, &nic_on("br-eth0"), None, false).await.unwrap_err();
        assert!(err.to_string().contains("was made by provider kvm2, not by the host"), "{err}");
        assert_eq!(
            network.events(),
            ["observe", "observe"],
            "nothing bridged (the devices are read to check the record)"
        );
        assert!(lock.report(0).holder.is_none());
    }

    #[tokio::test]
    async fn bridge_failure_skips_observe_and_releases() {
        let (_dir, lock) = lock();
        let network = FakeNetwork { fail_bridge: true, ..FakeNetwork::new(&lock) };
        let err = prepare(&lock, &network, &nic_on("br-eth0"), None, false).await.unwrap_err();
        assert_eq!(err.to_string(), "failed to bridge devices: netlink: bridge: failed");
        assert_eq!(network.events(), ["observe", "bridge eth0->br-eth0"]);
        assert!(lock.report(0).holder.is_none());
    }

    #[tokio::test]
    async fn observe_failure_skips_the_record() {
        let (_dir, lock) = lock();
        let network = FakeNetwork { fail_second_observe: true, ..FakeNetwork::new(&lock) };
        let err = prepare(&lock, &network, &nic_on("br-eth0"), None, false).await.unwrap_err();
        assert_eq!(err.to_string(), "cannot discover observed network config: netlink: observe: failed");
        assert_eq!(network.events(), ["observe", "bridge eth0->br-eth0", "observe"]);
        assert!(lock.report(0).holder.is_none());
    }

    #[tokio::test]
    async fn nothing_observed_means_nothing_recorded() {
        let (_dir, lock) = lock();
        let network = FakeNetwork { observe_nothing_after_bridge: true, ..FakeNetwork::new(&lock) };
        prepare(&lock, &network, &nic_on("br-eth0"), None, false).await.unwrap();
        assert_eq!(network.events(), ["observe", "bridge eth0->br-eth0", "observe"]);
    }

    #[tokio::test]
    async fn lock_timeout_and_abort_run_nothing() {
        let (_dir, lock) = lock();
        let network = FakeNetwork::new(&lock);
        let held = lock.acquire(Spec { worker: "other".into(), ..Default::default() }).await.unwrap();
        let err = prepare(&lock, &network, &nic_on("br-eth0"), Some(Duration::from_millis(30)), false).await;
        assert_eq!(
            err.unwrap_err().to_string(),
            "failed to acquire machine lock for bridging: timeout acquiring mutex"
        );
        drop(held);
        let err = prepare(&lock, &network, &nic_on("br-eth0"), None, true).await.unwrap_err();
        assert_eq!(err.to_string(), "failed to acquire machine lock for bridging: cancelled acquiring mutex");
        assert!(network.events().is_empty(), "neither observe nor bridge ran");
        assert_eq!(lock.report(10).history.len(), 1, "only the other holder ever held it");
    }

    #[test]
    fn host_changes_follow_the_host_config_then_jujus_names() {
        let devices = vec![device("eth0", "aa:aa:aa:aa:aa:aa"), device("br-data", "bb:bb:bb:bb:bb:bb")];
        let mapping = BTreeMap::from([("br-lan".to_string(), "eth0".to_string())]);
        let info: Vec<InterfaceInfo> =
            ["br-lan", "br-eth0", "br-data", "", "br-lan"].iter().flat_map(|p| nic_on(p)).collect();
        let changes = host_changes(&info, &devices, &mapping).unwrap();
        let pairs: Vec<_> = changes.iter().map(|c| (c.device.as_str(), c.bridge.as_str())).collect();
        assert_eq!(pairs, [("eth0", "br-lan"), ("eth0", "br-eth0")]);
        let err = host_changes(&nic_on("br-nowhere"), &devices, &BTreeMap::new()).unwrap_err();
        assert!(err.contains("br-nowhere"), "{err}");
    }
}
