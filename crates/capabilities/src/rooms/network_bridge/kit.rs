//! Bridging in the kit: the host devices the provider finds (`devices`) and
//! which of them other providers made (`owners`, name -> provider), simulated;
//! or the host's kernel, with the granted devices noted as the run found them
//! (what the provider makes in the run is its own, recorded in memory).

use super::NetworkBridge;
use crate::network::Device;
use crate::network::backend::{HostNetwork, NetworkBackend};
use crate::network::owners::{MemoryOwners, OwnedNetwork};
use crate::network::simulated::SimNetwork;
use crate::rooms::Backends;
use crate::rooms::kit::{KitPart, KitSetup, Recorder, Simulation, put_section, section_value};
use futures_util::future::BoxFuture;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

const DEVICES: &str = "devices";
const OWNERS: &str = "owners";

/// The network bridge's part in the kit.
pub(crate) struct BridgeKit;

impl KitPart for BridgeKit {
    fn keys(&self) -> &'static [&'static str] {
        &[DEVICES, OWNERS]
    }
    fn scripted(&self, mut section: Map<String, Value>, _: Option<&str>) -> Result<Arc<dyn Simulation>, String> {
        let devices: Vec<Device> = section_value(&mut section, DEVICES)?;
        let owners: BTreeMap<String, String> = section_value(&mut section, OWNERS)?;
        Ok(Arc::new(ScriptedNetwork(Arc::new(SimNetwork::with_owners(devices, owners)))))
    }
    fn recorder<'a>(&'a self, setup: &'a KitSetup) -> BoxFuture<'a, Result<Arc<dyn Recorder>, String>> {
        Box::pin(async move {
            // The simulated network of a replay starts where the host's was before the run.
            let devices = match setup.grants.rooms.of::<NetworkBridge>() {
                Some(grant) => {
                    let found = HostNetwork.devices().await.map_err(|e| e.to_string())?;
                    found.into_iter().filter(|d| grant.covers(&d.name)).collect()
                }
                None => Vec::new(),
            };
            let network = Arc::new(OwnedNetwork::new(Arc::new(HostNetwork), Arc::new(MemoryOwners::default())));
            Ok(Arc::new(RecordedNetwork { devices, network }) as Arc<dyn Recorder>)
        })
    }
}

struct ScriptedNetwork(Arc<SimNetwork>);

impl Simulation for ScriptedNetwork {
    fn install(&self, backends: Backends, _: &KitSetup) -> Result<Backends, String> {
        Ok(backends.with::<NetworkBridge>(self.0.clone()))
    }
}

struct RecordedNetwork {
    devices: Vec<Device>,
    network: Arc<OwnedNetwork>,
}

impl Recorder for RecordedNetwork {
    fn install(&self, backends: Backends) -> Backends {
        backends.with::<NetworkBridge>(self.network.clone())
    }
    fn script(&self, file: &mut Map<String, Value>) {
        put_section(file, DEVICES, &self.devices);
    }
}
