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
//! - `owners`: which of those other providers made (name -> provider): the
//!   provider under test may not touch them, nor the host's (the others);
//!   what it makes in the run is its own.

use broker_capabilities::rooms::http_egress::{Exchange, Script, Tape};
use broker_capabilities::rooms::network_bridge::NetworkBridge;
use broker_capabilities::rooms::process::simulated::{ScriptedChild, ScriptedRun};
use broker_capabilities::rooms::process::{ProcessTape, SimProcesses};
use crate::manifest::Manifest;
use broker_capabilities::network::Device;
use broker_capabilities::network::backend::{HostNetwork, NetworkBackend};
use broker_capabilities::network::simulated::SimNetwork;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// A script file's contents, one section per capability.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptFile {
    /// HTTP exchanges, answered in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub http: Vec<Exchange>,
    /// Programs run to completion, answered in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<ScriptedRun>,
    /// Long-running programs, one per spawn, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ScriptedChild>,
    /// The host network devices (and bridges) the provider finds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<Device>,
    /// Devices other providers made: name -> provider.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub owners: std::collections::BTreeMap<String, String>,
}

impl ScriptFile {
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a script is plain data") + "\n"
    }
}

/// The simulations a script file sets up.
#[derive(Default)]
pub struct Scripted {
    pub(crate) http: Arc<Script>,
    pub(crate) processes: Arc<SimProcesses>,
    pub(crate) network: Arc<SimNetwork>,
    /// Set when there was no script file to read.
    missing: Option<String>,
}

impl Scripted {
    pub(crate) fn new(file: ScriptFile) -> Scripted {
        Scripted {
            http: Arc::new(Script::new(file.http)),
            processes: Arc::new(SimProcesses::new(file.runs, file.children)),
            network: Arc::new(SimNetwork::with_owners(file.devices, file.owners)),
            missing: None,
        }
    }

    /// No script at `path`: every host call it would answer is unscripted, and says so.
    pub(crate) fn missing(path: &std::path::Path) -> Scripted {
        let why = format!("no script at {}", path.display());
        Scripted {
            http: Arc::new(Script::missing(why.clone())),
            processes: Arc::default(),
            network: Arc::default(),
            missing: Some(why),
        }
    }

    /// Set up the simulations a script file's JSON describes.
    pub fn parse(text: &str) -> Result<Scripted, String> {
        let file: ScriptFile = serde_json::from_str(text).map_err(|e| format!("invalid script: {e}"))?;
        Ok(Scripted::new(file))
    }

    /// Host calls the script had no answer for since the last call.
    pub fn take_unexpected(&self) -> Vec<String> {
        let mut unexpected = self.http.take_unexpected();
        let runs = self.processes.take_unexpected();
        match &self.missing {
            Some(why) => unexpected.extend(runs.into_iter().map(|run| format!("{run} ({why})"))),
            None => unexpected.extend(runs),
        }
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
    /// The HTTP exchanges made, in order.
    pub http: Arc<Tape>,
    pub(crate) processes: Arc<ProcessTape>,
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

    /// What was recorded so far, as a script.
    pub fn script(&self) -> ScriptFile {
        let (runs, children) = self.processes.script();
        let devices = self.devices.lock().unwrap_or_else(|p| p.into_inner()).clone();
        ScriptFile { http: self.http.exchanges(), runs, children, devices, owners: Default::default() }
    }

    /// [`Recording::script`] as a script file's JSON.
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
