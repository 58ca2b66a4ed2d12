//! kv in the kit: in memory, in scripted and recorded runs alike (a run
//! never touches the host's store), so it owns no script section.

use super::{Kv, MemoryKv};
use crate::rooms::Backends;
use crate::rooms::kit::{KitPart, KitSetup, Recorder, Simulation};
use futures_util::future::BoxFuture;
use serde_json::{Map, Value};
use std::sync::Arc;

/// kv's part in the kit.
pub(crate) struct KvKit;

impl KitPart for KvKit {
    fn keys(&self) -> &'static [&'static str] {
        &[]
    }
    fn scripted(&self, _: Map<String, Value>, _: Option<&str>) -> Result<Arc<dyn Simulation>, String> {
        Ok(Arc::new(KvKit))
    }
    fn recorder<'a>(&'a self, _: &'a KitSetup) -> BoxFuture<'a, Result<Arc<dyn Recorder>, String>> {
        Box::pin(async { Ok(Arc::new(KvKit) as Arc<dyn Recorder>) })
    }
}

impl Simulation for KvKit {
    fn install(&self, backends: Backends, _: &KitSetup) -> Result<Backends, String> {
        Ok(backends.with::<Kv>(Arc::new(MemoryKv::default())))
    }
}

impl Recorder for KvKit {
    fn install(&self, backends: Backends) -> Backends {
        backends.with::<Kv>(Arc::new(MemoryKv::default()))
    }
    fn script(&self, _: &mut Map<String, Value>) {}
}
