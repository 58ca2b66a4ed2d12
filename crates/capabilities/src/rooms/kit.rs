//! The conformance kit's part of each room: what stands in for the room's
//! backend when a run is scripted, and what records the host's own when a run
//! is recorded. A room declares its part with [`Room::KIT`]; the kit's script
//! file, its scripted sandbox and its recorded one are made of the parts the
//! registered rooms declare, nothing else (the kit names no room).
//!
//! A script file is a JSON object; each part owns some of its keys (`http`,
//! `runs`, `children`, `devices`, `owners`), and a key no part owns is refused.

use super::{Backends, Grants, ROOMS};
use crate::rooms::process::LiveChildren;
use futures_util::future::BoxFuture;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::Arc;

/// A room's part in the kit.
pub trait KitPart: Send + Sync {
    /// The keys of a script file this part owns (none: it needs no script).
    fn keys(&self) -> &'static [&'static str];
    /// Its stand-in, answering from `section` (its keys of the script file;
    /// absent ones are empty). `missing` says why there is no script at all:
    /// every call it cannot answer then says so.
    fn scripted(&self, section: Map<String, Value>, missing: Option<&str>) -> Result<Arc<dyn Simulation>, String>;
    /// Its recorder of the host's own backend.
    fn recorder<'a>(&'a self, setup: &'a KitSetup) -> BoxFuture<'a, Result<Arc<dyn Recorder>, String>>;
}

/// What stands in for one or more rooms' backends in a scripted run.
pub trait Simulation: Send + Sync {
    /// Give the rooms it stands in for their backends.
    fn install(&self, backends: Backends, setup: &KitSetup) -> Result<Backends, String>;
    /// Calls it had no answer for since the last time it was asked.
    fn take_unexpected(&self) -> Vec<String> {
        Vec::new()
    }
    /// Scripted answers nobody asked for (yet).
    fn remaining(&self) -> usize {
        0
    }
}

/// What records one or more rooms' calls to the host's own backends.
pub trait Recorder: Send + Sync {
    /// Give the rooms it records their backends.
    fn install(&self, backends: Backends) -> Backends;
    /// What it recorded so far, under its keys of a script file (an empty section left out).
    fn script(&self, file: &mut Map<String, Value>);
    /// Stop (or resume) recording: the kit's own look at what existed is no exchange of a scenario.
    fn pause(&self, _paused: bool) {}
}

/// What the kit lends a run, scripted or recorded.
pub struct KitSetup {
    /// The grants of the provider under test.
    pub grants: Grants,
    /// A directory of the run's own (the machine lock's, say).
    pub scratch: PathBuf,
    /// Where the signing credentials are, if the run may sign.
    pub credentials: Option<PathBuf>,
    /// The programs the run starts: none may outlive it.
    pub live_children: Arc<LiveChildren>,
}

/// The kit's parts of the registered rooms, in registration order.
pub fn parts() -> impl Iterator<Item = &'static dyn KitPart> {
    ROOMS.iter().filter_map(|room| room.kit())
}

/// Every key a script file may have.
pub fn script_keys() -> Vec<&'static str> {
    parts().flat_map(|part| part.keys().iter().copied()).collect()
}

/// One key of a script section: its value, or the default when absent.
pub(crate) fn section_value<T: serde::de::DeserializeOwned + Default>(
    section: &mut Map<String, Value>,
    key: &str,
) -> Result<T, String> {
    match section.remove(key) {
        None => Ok(T::default()),
        Some(value) => serde_json::from_value(value).map_err(|e| format!("script section `{key}`: {e}")),
    }
}

/// Write `value` under `key` unless it is empty (`[]`, `{}`).
pub(crate) fn put_section<T: serde::Serialize>(file: &mut Map<String, Value>, key: &str, value: &T) {
    let value = serde_json::to_value(value).unwrap_or(Value::Null);
    let empty = match &value {
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        Value::Null => true,
        _ => false,
    };
    if !empty {
        file.insert(key.to_owned(), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted sandbox made of the kit's parts gives every room that
    /// reaches out a stand-in: none is left to refuse for want of one.
    #[test]
    fn the_kit_parts_stand_in_for_every_room_that_reaches_out() {
        let scratch = tempfile::tempdir().unwrap();
        let setup = KitSetup {
            grants: Grants::default(),
            scratch: scratch.path().to_owned(),
            credentials: None,
            live_children: Arc::default(),
        };
        assert_eq!(super::super::unserved(&Backends::sealed()).len(), 6, "sealed, nothing is served");
        let mut backends = Backends::sealed();
        for part in parts() {
            backends = part.scripted(Map::new(), None).unwrap().install(backends, &setup).unwrap();
        }
        assert_eq!(super::super::unserved(&backends), Vec::<&str>::new());
        let mut keys = script_keys();
        keys.sort();
        assert_eq!(keys, ["children", "devices", "http", "owners", "runs"], "each key owned once");
    }
}
