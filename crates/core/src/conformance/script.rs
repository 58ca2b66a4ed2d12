//! Where a kit run's answers come from: a script, where every capability
//! the manifest grants is simulated and answers from a script file, or the
//! real one, recorded into such a file.
//!
//! Both are made of the registered rooms' kit parts
//! ([`broker_capabilities::rooms::kit`]); nothing here names a room. A script
//! file (`<manifest stem>.script.json`) is a JSON object of the parts'
//! sections, each optional: `http` (exchanges answered in order), `runs`
//! (programs run to completion), `children` (long-running programs: what
//! they greet a connection with and answer each line), `devices` (the host
//! network devices the provider finds) and `owners` (which of those other
//! providers made).

use broker_capabilities::rooms::Backends;
use broker_capabilities::rooms::kit::{self, KitSetup, Recorder, Simulation};
use serde_json::{Map, Value};
use std::sync::{Arc, Mutex};

/// The simulations a script file sets up, one per kit part.
pub struct Scripted {
    simulations: Vec<Arc<dyn Simulation>>,
}

impl Scripted {
    /// Each part's simulation, from its keys of `file`; a key no part owns is refused.
    fn from_file(mut file: Map<String, Value>, missing: Option<&str>) -> Result<Scripted, String> {
        let mut simulations = Vec::new();
        for part in kit::parts() {
            let section: Map<String, Value> = part.keys().iter().filter_map(|key| file.remove_entry(*key)).collect();
            simulations.push(part.scripted(section, missing)?);
        }
        if let Some(key) = file.keys().next() {
            let known = kit::script_keys().join(", ");
            return Err(format!("invalid script: unknown section `{key}` (a script has {known})"));
        }
        Ok(Scripted { simulations })
    }

    /// No script at `path`: every host call it would answer is unscripted, and says so.
    pub(crate) fn missing(path: &std::path::Path) -> Result<Scripted, String> {
        Scripted::from_file(Map::new(), Some(&format!("no script at {}", path.display())))
    }

    /// Set up the simulations a script file's JSON describes.
    pub fn parse(text: &str) -> Result<Scripted, String> {
        let Sections(file) = serde_json::from_str(text).map_err(|e| format!("invalid script: {e}"))?;
        Scripted::from_file(file, None)
    }

    /// The sealed sandbox's backends: each part's stand-in.
    pub(crate) fn backends(&self, setup: &KitSetup) -> Result<Backends, String> {
        self.simulations.iter().try_fold(Backends::sealed(), |backends, sim| sim.install(backends, setup))
    }

    /// Host calls the script had no answer for since the last call.
    pub fn take_unexpected(&self) -> Vec<String> {
        self.simulations.iter().flat_map(|sim| sim.take_unexpected()).collect()
    }

    /// Scripted answers nobody asked for (yet): HTTP exchanges, runs and children.
    pub fn remaining(&self) -> usize {
        self.simulations.iter().map(|sim| sim.remaining()).sum()
    }
}

/// A script file's sections: a JSON object whose keys appear once each.
struct Sections(Map<String, Value>);

impl<'de> serde::Deserialize<'de> for Sections {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Sections;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object of script sections")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Sections, A::Error> {
                let mut sections = Map::new();
                while let Some((key, value)) = map.next_entry::<String, Value>()? {
                    if sections.contains_key(&key) {
                        return Err(serde::de::Error::custom(format!("duplicate section `{key}`")));
                    }
                    sections.insert(key, value);
                }
                Ok(Sections(sections))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// What a run against the real capabilities did, to be written as a script.
#[derive(Default)]
pub struct Recording {
    recorders: Mutex<Vec<Arc<dyn Recorder>>>,
}

impl Recording {
    /// The sealed sandbox's backends: the host's own, each part's recorded.
    pub(crate) async fn backends(&self, setup: &KitSetup) -> Result<Backends, String> {
        let mut backends = Backends::sealed();
        let mut recorders = Vec::new();
        for part in kit::parts() {
            let recorder = part.recorder(setup).await?;
            backends = recorder.install(backends);
            recorders.push(recorder);
        }
        *self.recorders.lock().unwrap_or_else(|p| p.into_inner()) = recorders;
        Ok(backends)
    }

    /// Stop (or resume) recording.
    pub(crate) fn pause(&self, paused: bool) {
        self.recorders.lock().unwrap_or_else(|p| p.into_inner()).iter().for_each(|r| r.pause(paused));
    }

    /// What was recorded so far, as a script file's sections.
    pub fn script(&self) -> Map<String, Value> {
        let mut file = Map::new();
        self.recorders.lock().unwrap_or_else(|p| p.into_inner()).iter().for_each(|r| r.script(&mut file));
        file
    }

    /// [`Recording::script`] as a script file's JSON.
    pub fn to_script_json(&self) -> String {
        script_json(&self.script())
    }
}

/// A script file's sections as its JSON.
pub(crate) fn script_json(file: &Map<String, Value>) -> String {
    serde_json::to_string_pretty(file).unwrap_or_default() + "\n"
}

/// Where a kit run's host calls go.
pub enum Answers {
    /// Scripted answers; nothing real is touched.
    Script(Arc<Scripted>),
    /// The real granted capabilities, every call written down.
    Record(Arc<Recording>),
}

#[cfg(test)]
mod tests {
    use super::Scripted;

    /// Every section is some room's, appears once and holds what the room reads.
    #[test]
    fn a_script_refuses_unknown_duplicate_and_null_sections() {
        let refused = |text: &str| Scripted::parse(text).err().unwrap_or_default();
        assert!(Scripted::parse("{}").is_ok());
        let full = r#"{"http": [], "runs": [], "children": [], "devices": [], "owners": {}}"#;
        assert!(Scripted::parse(full).is_ok());
        assert!(refused(r#"{"htp": []}"#).contains("unknown section `htp`"), "{}", refused(r#"{"htp": []}"#));
        assert!(refused(r#"{"http": [], "http": []}"#).contains("duplicate section `http`"));
        assert!(refused(r#"{"runs": null}"#).contains("script section `runs`"));
        assert!(refused(r#"{"devices": [{"name": 1}]}"#).contains("script section `devices`"));
        assert!(refused("[]").starts_with("invalid script"));
    }
}
