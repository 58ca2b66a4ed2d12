//! The machine lock in the kit: a lock of the run's own, in its scratch dir
//! (never the host's), in scripted and recorded runs alike.

use super::{MachineLock, MachineLockRoom};
use crate::rooms::Backends;
use crate::rooms::kit::{KitPart, KitSetup, Recorder, Simulation};
use futures_util::future::BoxFuture;
use serde_json::{Map, Value};
use std::sync::Arc;

/// The machine lock's part in the kit.
pub(crate) struct MachineLockKit;

fn scratch_lock(setup: &KitSetup) -> Result<Arc<MachineLock>, String> {
    MachineLock::new(&setup.scratch, "machine-lock", "broker-provider-test").map(Arc::new).map_err(|e| e.to_string())
}

impl KitPart for MachineLockKit {
    fn keys(&self) -> &'static [&'static str] {
        &[]
    }
    fn scripted(&self, _: Map<String, Value>, _: Option<&str>) -> Result<Arc<dyn Simulation>, String> {
        Ok(Arc::new(MachineLockKit))
    }
    fn recorder<'a>(&'a self, setup: &'a KitSetup) -> BoxFuture<'a, Result<Arc<dyn Recorder>, String>> {
        Box::pin(async move { Ok(Arc::new(RecordedLock(scratch_lock(setup)?)) as Arc<dyn Recorder>) })
    }
}

impl Simulation for MachineLockKit {
    fn install(&self, backends: Backends, setup: &KitSetup) -> Result<Backends, String> {
        Ok(backends.with::<MachineLockRoom>(scratch_lock(setup)?))
    }
}

/// A recorded run's lock: the scratch one too (what it waited for is not a script's).
struct RecordedLock(Arc<MachineLock>);

impl Recorder for RecordedLock {
    fn install(&self, backends: Backends) -> Backends {
        backends.with::<MachineLockRoom>(self.0.clone())
    }
    fn script(&self, _: &mut Map<String, Value>) {}
}
