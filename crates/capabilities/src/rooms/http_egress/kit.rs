//! wasi:http in the kit: scripted exchanges answered in order (`http`), or
//! the host's own egress (signing with the run's credentials) with each
//! exchange written down.

use super::{Exchange, HostEgress, HttpEgress, RecordedEgress, Script, Tape};
use crate::rooms::Backends;
use crate::rooms::kit::{KitPart, KitSetup, Recorder, Simulation, put_section, section_value};
use futures_util::future::BoxFuture;
use serde_json::{Map, Value};
use std::sync::Arc;

/// The script file's key: request/answer exchanges, answered in order.
const HTTP: &str = "http";

/// wasi:http's part in the kit.
pub(crate) struct HttpKit;

impl KitPart for HttpKit {
    fn keys(&self) -> &'static [&'static str] {
        &[HTTP]
    }
    fn scripted(&self, mut section: Map<String, Value>, missing: Option<&str>) -> Result<Arc<dyn Simulation>, String> {
        let exchanges: Vec<Exchange> = section_value(&mut section, HTTP)?;
        Ok(Arc::new(ScriptedHttp(Arc::new(match missing {
            Some(why) => Script::missing(why.to_owned()),
            None => Script::new(exchanges),
        }))))
    }
    fn recorder<'a>(&'a self, setup: &'a KitSetup) -> BoxFuture<'a, Result<Arc<dyn Recorder>, String>> {
        Box::pin(async move {
            let host = match &setup.credentials {
                Some(dir) => HostEgress::with_credentials(dir.clone()),
                None => HostEgress::default(),
            };
            let tape = Arc::new(Tape::default());
            let egress = Arc::new(RecordedEgress::new(Arc::new(host), tape.clone()));
            Ok(Arc::new(RecordedHttp { tape, egress }) as Arc<dyn Recorder>)
        })
    }
}

struct ScriptedHttp(Arc<Script>);

impl Simulation for ScriptedHttp {
    fn install(&self, backends: Backends, _: &KitSetup) -> Result<Backends, String> {
        Ok(backends.with::<HttpEgress>(self.0.clone()))
    }
    fn take_unexpected(&self) -> Vec<String> {
        self.0.take_unexpected()
    }
    fn remaining(&self) -> usize {
        self.0.remaining()
    }
}

struct RecordedHttp {
    tape: Arc<Tape>,
    egress: Arc<RecordedEgress>,
}

impl Recorder for RecordedHttp {
    fn install(&self, backends: Backends) -> Backends {
        backends.with::<HttpEgress>(self.egress.clone())
    }
    fn script(&self, file: &mut Map<String, Value>) {
        put_section(file, HTTP, &self.tape.exchanges());
    }
    fn pause(&self, paused: bool) {
        self.tape.pause(paused);
    }
}
