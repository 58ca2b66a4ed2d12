//! Where a kit run's answers come from: a script, where every capability
//! the manifest grants is simulated and answers from a script file, or the
//! real one, recorded into such a file.
//!
//! A script file (`<manifest stem>.script.json`) has a section per capability,
//! each optional:
//! - `http`: request/answer exchanges, answered in order;
//! - `runs`: programs run to completion, with their output, answered in order;
//! - `children`: long-running programs, one per spawn, in order: what they
//!   greet a connection with and answer to each line sent on their sockets;
//! - `devices`: the host network devices (and bridges) the provider finds.

use crate::capabilities::http_egress::{Exchange, Script, Tape};
use crate::capabilities::network_bridge::NetworkBridge;
use crate::capabilities::process::simulated::{ScriptedChild, ScriptedRun};
use crate::capabilities::process::{ProcessTape, SimProcesses};
use crate::manifest::Manifest;
use crate::network::Device;
use crate::network::backend::{HostNetwork, NetworkBackend};
use crate::network::simulated::SimNetwork;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptFile {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub http: Vec<Exchange>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<ScriptedRun>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ScriptedChild>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<Device>,
}

impl ScriptFile {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a script is plain data") + "\n"
    }
}

/// The simulations a script file sets up.
#[derive(Default)]
pub struct Scripted {
    pub http: Arc<Script>,
    pub processes: Arc<SimProcesses>,
    pub network: Arc<SimNetwork>,
}

impl Scripted {
    pub fn new(file: ScriptFile) -> Scripted {
        Scripted {
            http: Arc::new(Script::new(file.http)),
            processes: Arc::new(SimProcesses::new(file.runs, file.children)),
            network: Arc::new(SimNetwork::new(file.devices)),
        }
    }

    pub fn parse(text: &str) -> Result<Scripted, String> {
        let file: ScriptFile = serde_json::from_str(text).map_err(|e| format!("invalid script: {e}"))?;
        Ok(Scripted::new(file))
    }

    /// Host calls the script had no answer for since the last call.
    pub fn take_unexpected(&self) -> Vec<String> {
        let mut unexpected = self.http.take_unexpected();
        unexpected.extend(self.processes.take_unexpected());
        unexpected
    }

    /// Scripted answers nobody asked for (yet): HTTP exchanges, runs and children.
    pub fn remaining(&self) -> usize {
        self.http.remaining() + self.processes.remaining()
    }
}

/// What a run against the real capabilities did, to be written as a script.
#[derive(Default)]
pub struct Recording {
    pub http: Arc<Tape>,
    pub processes: Arc<ProcessTape>,
    /// The granted devices as the run found them.
    devices: Mutex<Vec<Device>>,
}

impl Recording {
    /// Note the host devices the manifest's bridge grant lets the provider
    /// see, as they are before the run (the simulated network starts there).
    pub async fn note_devices(&self, manifest: &Manifest) -> Result<(), String> {
        let Some(grant) = manifest.grants.rooms.of::<NetworkBridge>() else { return Ok(()) };
        let found = HostNetwork.devices().await.map_err(|e| e.to_string())?;
        *self.devices.lock().unwrap_or_else(|p| p.into_inner()) =
            found.into_iter().filter(|d| grant.covers(&d.name)).collect();
        Ok(())
    }

    pub fn script(&self) -> ScriptFile {
        let (runs, children) = self.processes.script();
        let devices = self.devices.lock().unwrap_or_else(|p| p.into_inner()).clone();
        ScriptFile { http: self.http.exchanges(), runs, children, devices }
    }

    pub fn to_script_json(&self) -> String {
        self.script().to_json()
    }
}

/// Where a kit run's host calls go.
pub enum Answers {
    /// Scripted answers; nothing real is touched.
    Script(Arc<Scripted>),
    /// The real granted capabilities, every call written down.
    Record(Arc<Recording>),
}
