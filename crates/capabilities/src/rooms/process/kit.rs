//! Programs in the kit, for the process room and the local-socket room
//! together (a socket's peer is a scripted child): programs run to completion
//! (`runs`) and long-running ones (`children`: what they greet a connection
//! with and answer each line), answered in order; or the host's own, each
//! exchange written down.

use super::simulated::{ScriptedChild, ScriptedRun};
use super::{HostProcesses, MemoryChildRecords, Process, ProcessTape, Recorded, RecordedSockets, SimProcesses};
use crate::rooms::Backends;
use crate::rooms::kit::{KitPart, KitSetup, Recorder, Simulation, put_section, section_value};
use crate::rooms::local_socket::{HostSockets, LocalSocket};
use futures_util::future::BoxFuture;
use serde_json::{Map, Value};
use std::sync::Arc;

const RUNS: &str = "runs";
const CHILDREN: &str = "children";

/// The programs' part in the kit (the process and local-socket rooms').
pub(crate) struct ProgramsKit;

impl KitPart for ProgramsKit {
    fn keys(&self) -> &'static [&'static str] {
        &[RUNS, CHILDREN]
    }
    fn scripted(&self, mut section: Map<String, Value>, missing: Option<&str>) -> Result<Arc<dyn Simulation>, String> {
        let runs: Vec<ScriptedRun> = section_value(&mut section, RUNS)?;
        let children: Vec<ScriptedChild> = section_value(&mut section, CHILDREN)?;
        let sim = Arc::new(SimProcesses::new(runs, children));
        Ok(Arc::new(ScriptedPrograms { sim, missing: missing.map(str::to_owned) }))
    }
    fn recorder<'a>(&'a self, setup: &'a KitSetup) -> BoxFuture<'a, Result<Arc<dyn Recorder>, String>> {
        Box::pin(async move {
            let tape = Arc::new(ProcessTape::default());
            let host = HostProcesses::new(Arc::new(MemoryChildRecords::default()), setup.live_children.clone());
            Ok(Arc::new(RecordedPrograms {
                process: Arc::new(Recorded::new(host, tape.clone())),
                sockets: Arc::new(RecordedSockets::new(HostSockets, tape.clone())),
                tape,
            }) as Arc<dyn Recorder>)
        })
    }
}

struct ScriptedPrograms {
    sim: Arc<SimProcesses>,
    /// Why there is no script, said with each call it could not answer.
    missing: Option<String>,
}

impl Simulation for ScriptedPrograms {
    fn install(&self, backends: Backends, _: &KitSetup) -> Result<Backends, String> {
        Ok(backends.with::<LocalSocket>(self.sim.clone()).with::<Process>(self.sim.clone()))
    }
    fn take_unexpected(&self) -> Vec<String> {
        let runs = self.sim.take_unexpected();
        match &self.missing {
            Some(why) => runs.into_iter().map(|run| format!("{run} ({why})")).collect(),
            None => runs,
        }
    }
    fn remaining(&self) -> usize {
        self.sim.remaining()
    }
}

struct RecordedPrograms {
    tape: Arc<ProcessTape>,
    process: Arc<Recorded<HostProcesses>>,
    sockets: Arc<RecordedSockets<HostSockets>>,
}

impl Recorder for RecordedPrograms {
    fn install(&self, backends: Backends) -> Backends {
        backends.with::<LocalSocket>(self.sockets.clone()).with::<Process>(self.process.clone())
    }
    fn script(&self, file: &mut Map<String, Value>) {
        let (runs, children) = self.tape.script();
        put_section(file, RUNS, &runs);
        put_section(file, CHILDREN, &children);
    }
}
