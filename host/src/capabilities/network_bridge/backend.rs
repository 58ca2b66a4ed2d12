//! What bridging acts on: the host's kernel over netlink, or a simulated
//! network (the conformance kit). Both behave alike; the grant is checked
//! before either is reached.

use super::netlink::Netlink;
use super::simulated::SimNetwork;
use super::{BridgeError, Device, DeviceToBridge};
use std::sync::Arc;

/// Which network a provider's bridging calls reach.
#[derive(Clone, Default)]
pub enum NetworkWorld {
    #[default]
    Host,
    Simulated(Arc<SimNetwork>),
}

/// One call's handle on the network of its world.
pub enum Network {
    Host(Netlink),
    Simulated(Arc<SimNetwork>),
}

impl NetworkWorld {
    /// A fresh netlink connection (in the host's network namespace), or the simulation.
    pub fn open(&self) -> Result<Network, BridgeError> {
        Ok(match self {
            NetworkWorld::Host => Network::Host(Netlink::connect()?),
            NetworkWorld::Simulated(network) => Network::Simulated(network.clone()),
        })
    }
}

impl Network {
    pub async fn devices(&self) -> Result<Vec<Device>, BridgeError> {
        match self {
            Network::Host(nl) => nl.devices().await,
            Network::Simulated(sim) => Ok(sim.devices()),
        }
    }

    pub async fn device(&self, name: &str) -> Result<Option<Device>, BridgeError> {
        Ok(self.devices().await?.into_iter().find(|d| d.name == name))
    }

    pub async fn bridge(&self, change: &DeviceToBridge) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.bridge(change).await,
            Network::Simulated(sim) => sim.bridge(change),
        }
    }

    pub async fn unbridge(&self, device: &str, bridge: &str) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.unbridge(device, bridge).await,
            Network::Simulated(sim) => sim.unbridge(device, bridge),
        }
    }

    pub async fn create_veth(&self, name: &str, peer: &str, bridge: &str) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.create_veth(name, peer, bridge).await,
            Network::Simulated(sim) => sim.create_veth(name, peer, bridge),
        }
    }

    pub async fn create_tap(&self, name: &str, bridge: &str, mac: &str, owner: Option<u32>) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.create_tap_owned(name, bridge, mac, owner).await,
            Network::Simulated(sim) => sim.create_tap(name, bridge, mac),
        }
    }

    pub async fn attach(&self, device: &str, bridge: &str) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.attach(device, bridge).await,
            Network::Simulated(sim) => sim.attach(device, bridge),
        }
    }

    /// Delete a veth, or a tap that is `owner`'s (root's if `None`) or no one's.
    pub async fn delete_owned(&self, name: &str, owner: Option<u32>) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.delete_owned(name, owner).await,
            Network::Simulated(sim) => sim.delete(name),
        }
    }

    pub async fn delete(&self, name: &str) -> Result<(), BridgeError> {
        match self {
            Network::Host(nl) => nl.delete(name).await,
            Network::Simulated(sim) => sim.delete(name),
        }
    }
}
