//! The fake provider: Juju's "dummy" broker. Instances live only in the
//! provider's kv namespace, so the provider is correct whether its wasm
//! instance is reused or fresh for every call.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Key prefix of the instance records.
pub const INSTANCE_PREFIX: &str = "instance/";
const SEQUENCE_KEY: &str = "sequence";
/// The config's zones as last seen by a start, one a line: what `describe`
/// (which has no config) lists for the host's placement.
pub const ZONES_KEY: &str = "zones";

/// The storage the logic needs; the component maps it to the host's `kv`.
pub trait Kv {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, FakeError>;
    fn set(&self, key: &str, value: &[u8]) -> Result<(), FakeError>;
    fn delete(&self, key: &str) -> Result<bool, FakeError>;
    fn increment(&self, key: &str, delta: i64) -> Result<i64, FakeError>;
    fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, FakeError>;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeError {
    InvalidParams(String),
    NotFound(String),
    ZoneIndependent(String),
    /// The zone cannot take an instance now; another may.
    ZoneUnavailable(String),
    Storage(String),
}

impl std::fmt::Display for FakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FakeError::InvalidParams(m) => write!(f, "invalid params: {m}"),
            FakeError::NotFound(m) => write!(f, "not found: {m}"),
            FakeError::ZoneIndependent(m) => write!(f, "{m}"),
            FakeError::ZoneUnavailable(m) => write!(f, "{m}"),
            FakeError::Storage(m) => write!(f, "storage: {m}"),
        }
    }
}

/// The provider config from the manifest's `[config]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    /// Availability zones this fake cloud offers, in preference order.
    #[serde(default = "default_zones")]
    pub zones: Vec<String>,
    /// Instance ids are `<prefix>-<n>`.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    #[serde(default = "default_arch")]
    pub default_arch: String,
    /// start-instance takes this long (tests of calls in flight).
    #[serde(default)]
    pub start_delay_ms: u64,
    /// start-instance waits this long once the instance is made, before it
    /// answers (tests of a host killed mid-start).
    #[serde(default)]
    pub answer_delay_ms: u64,
    /// Zones that answer `zone-unavailable` to a start placed in them
    /// (tests of a group trying the next zone).
    #[serde(default)]
    pub unavailable_zones: Vec<String>,
    /// Instances in these zones are listed with status `error` (tests of a
    /// group whose members fail as they start).
    #[serde(default)]
    pub failed_zones: Vec<String>,
    /// `maintain-instance` fails for an instance started with this instance
    /// config tag (tests of a rolling update whose replacement is listed
    /// running but never healthy).
    #[serde(default)]
    pub unhealthy_tag: Option<String>,
    /// `stop-instances` fails, stopping nothing (tests of a stop that fails
    /// after the host marked it).
    #[serde(default)]
    pub stops_fail: bool,
}

fn default_zones() -> Vec<String> {
    vec!["zone-a".into(), "zone-b".into(), "zone-c".into()]
}
fn default_prefix() -> String {
    "fake".into()
}
fn default_arch() -> String {
    "amd64".into()
}

impl Default for Config {
    fn default() -> Self {
        Config {
            zones: default_zones(),
            prefix: default_prefix(),
            default_arch: default_arch(),
            start_delay_ms: 0,
            answer_delay_ms: 0,
            unavailable_zones: Vec::new(),
            failed_zones: Vec::new(),
            unhealthy_tag: None,
            stops_fail: false,
        }
    }
}

impl Config {
    /// Parse and check the JSON config; an empty string means all defaults.
    pub fn parse(json: &str) -> Result<Config, FakeError> {
        let config: Config = if json.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(json).map_err(|e| FakeError::InvalidParams(format!("config: {e}")))?
        };
        if config.zones.is_empty() {
            return Err(FakeError::InvalidParams("config: zones must not be empty".into()));
        }
        if config.prefix.is_empty() || !config.prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(FakeError::InvalidParams(format!(
                "config: prefix {:?} must be non-empty and use only letters, digits and '-'",
                config.prefix
            )));
        }
        Ok(config)
    }
}

/// The test knobs listing, maintenance and stops read ([`Config::failed_zones`],
/// [`Config::unhealthy_tag`], [`Config::stops_fail`]), leniently: a provider built on the fake
/// (test-broken) adds keys of its own to the config, and a config that does
/// not parse was already refused by validate-config and start.
#[derive(Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Knobs {
    #[serde(default)]
    pub failed_zones: Vec<String>,
    #[serde(default)]
    pub unhealthy_tag: Option<String>,
    #[serde(default)]
    pub stops_fail: bool,
}

impl Knobs {
    pub fn read(json: &str) -> Knobs {
        serde_json::from_str(json).unwrap_or_default()
    }
}

/// Hardware as Juju names it; echoed from the constraints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    pub arch: Option<String>,
    pub mem: Option<u64>,
    pub root_disk: Option<u64>,
    pub root_disk_source: Option<String>,
    pub cpu_cores: Option<u64>,
    pub cpu_power: Option<u64>,
    pub tags: Option<Vec<String>>,
    pub availability_zone: Option<String>,
    pub virt_type: Option<String>,
}

/// What a start needs, already extracted from the contract's params.
#[derive(Debug, Clone, Default)]
pub struct StartRequest {
    pub machine_id: Option<String>,
    /// Constraints as hardware wishes; the zone is chosen below.
    pub wanted: Hardware,
    pub zones_constraint: Option<Vec<String>>,
    pub placement: Option<String>,
    pub availability_zone: Option<String>,
    /// Instance ids of the distribution group (already evaluated).
    pub distribution_group: Vec<String>,
    pub addresses: Vec<String>,
}

/// The record kept in kv for each instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FakeInstance {
    pub id: String,
    pub machine_id: Option<String>,
    pub hardware: Hardware,
    pub addresses: Vec<String>,
    /// How many times `maintain-instance` ran on it.
    pub maintained: u32,
}

fn instance_key(id: &str) -> String {
    format!("{INSTANCE_PREFIX}{id}")
}

/// Records are postcard, not JSON: decoding dominates `all-instances`, and
/// postcard decodes several times faster, inside wasm as natively.
pub fn decode(bytes: &[u8]) -> Result<FakeInstance, FakeError> {
    postcard::from_bytes(bytes).map_err(|e| FakeError::Storage(format!("corrupt instance record: {e}")))
}

fn encode(instance: &FakeInstance) -> Result<Vec<u8>, FakeError> {
    postcard::to_allocvec(instance).map_err(|e| FakeError::Storage(e.to_string()))
}

/// Start an instance: pick its zone, echo the constraints as hardware, store it.
pub fn start(kv: &impl Kv, config: &Config, request: StartRequest) -> Result<FakeInstance, FakeError> {
    start_claiming(kv, config, request, |_| Ok(()))
}

/// As [`start`], calling `claim` with the id once it is chosen, before the
/// instance is written.
pub fn start_claiming(
    kv: &impl Kv,
    config: &Config,
    request: StartRequest,
    claim: impl FnOnce(&str) -> Result<(), FakeError>,
) -> Result<FakeInstance, FakeError> {
    remember_zones(kv, config)?;
    let zone = choose_zone(kv, config, &request)?;
    let sequence = kv.increment(SEQUENCE_KEY, 1)?;
    let id = format!("{}-{}", config.prefix, sequence - 1);
    claim(&id)?;
    let hardware = Hardware {
        arch: Some(request.wanted.arch.clone().unwrap_or_else(|| config.default_arch.clone())),
        availability_zone: Some(zone),
        ..request.wanted
    };
    let instance =
        FakeInstance { id, machine_id: request.machine_id, hardware, addresses: request.addresses, maintained: 0 };
    kv.set(&instance_key(&instance.id), &encode(&instance)?)?;
    Ok(instance)
}

/// Keep the config's zones for [`listed_zones`] (written only when they change).
fn remember_zones(kv: &impl Kv, config: &Config) -> Result<(), FakeError> {
    let listed = config.zones.join("\n");
    if kv.get(ZONES_KEY)?.as_deref() != Some(listed.as_bytes()) {
        kv.set(ZONES_KEY, listed.as_bytes())?;
    }
    Ok(())
}

/// The zones the last start saw in the config.
pub fn listed_zones(kv: &impl Kv) -> Vec<String> {
    let bytes = kv.get(ZONES_KEY).ok().flatten().unwrap_or_default();
    String::from_utf8_lossy(&bytes).lines().filter(|z| !z.is_empty()).map(str::to_owned).collect()
}

/// Zone choice as Juju's provisioner makes it: a placement `zone=X` or an
/// explicit zone wins; otherwise the allowed zone with the fewest members of
/// the distribution group, first in config order among ties.
fn choose_zone(kv: &impl Kv, config: &Config, request: &StartRequest) -> Result<String, FakeError> {
    let allowed: Vec<&String> = config
        .zones
        .iter()
        .filter(|z| request.zones_constraint.as_ref().is_none_or(|wanted| wanted.contains(z)))
        .collect();
    if allowed.is_empty() {
        return Err(FakeError::ZoneIndependent(format!(
            "no zone satisfies the zones constraint {:?}; this cloud has {:?}",
            request.zones_constraint.as_deref().unwrap_or_default(),
            config.zones
        )));
    }
    let explicit = match request.placement.as_deref() {
        None | Some("") => request.availability_zone.clone(),
        Some(placement) => match placement.split_once('=') {
            Some(("zone", zone)) => Some(zone.to_owned()),
            _ => {
                return Err(FakeError::InvalidParams(format!(
                    "unknown placement directive {placement:?} (expected zone=NAME)"
                )));
            }
        },
    };
    if let Some(zone) = explicit {
        if config.unavailable_zones.contains(&zone) {
            return Err(FakeError::ZoneUnavailable(format!("zone {zone:?} cannot take an instance now")));
        }
        if !allowed.iter().any(|z| **z == zone) {
            return Err(FakeError::InvalidParams(format!(
                "zone {zone:?} is not available: allowed zones are {allowed:?}"
            )));
        }
        return Ok(zone);
    }
    let mut members: BTreeMap<&str, usize> = allowed.iter().map(|z| (z.as_str(), 0)).collect();
    let group_zones: Vec<String> = request
        .distribution_group
        .iter()
        .filter_map(|id| kv.get(&instance_key(id)).transpose())
        .map(|bytes| bytes.and_then(|b| decode(&b)))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter_map(|instance| instance.hardware.availability_zone)
        .collect();
    for zone in &group_zones {
        if let Some(count) = members.get_mut(zone.as_str()) {
            *count += 1;
        }
    }
    let fewest = allowed.iter().min_by_key(|z| members[z.as_str()]).expect("allowed is not empty");
    // A full zone turns the start away whoever chose it; the host then tries the others.
    if config.unavailable_zones.contains(fewest) {
        return Err(FakeError::ZoneUnavailable(format!("zone {fewest:?} cannot take an instance now")));
    }
    Ok((*fewest).clone())
}

/// Stop instances; unknown ids are ignored (idempotent).
pub fn stop(kv: &impl Kv, ids: &[String]) -> Result<(), FakeError> {
    for id in ids {
        kv.delete(&instance_key(id))?;
    }
    Ok(())
}

/// Every instance, in id order of the kv.
pub fn all(kv: &impl Kv) -> Result<Vec<FakeInstance>, FakeError> {
    kv.scan(INSTANCE_PREFIX)?.iter().map(|(_, value)| decode(value)).collect()
}

/// Mark an existing instance maintained.
pub fn maintain(kv: &impl Kv, id: &str) -> Result<FakeInstance, FakeError> {
    let key = instance_key(id);
    let bytes = kv.get(&key)?.ok_or_else(|| FakeError::NotFound(format!("instance {id:?}")))?;
    let mut instance = decode(&bytes)?;
    instance.maintained += 1;
    kv.set(&key, &encode(&instance)?)?;
    Ok(instance)
}

/// An in-memory kv for native use (tests, the benchmark baseline).
#[derive(Default)]
pub struct MemoryKv {
    entries: std::sync::Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemoryKv {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Kv for MemoryKv {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, FakeError> {
        Ok(self.lock().get(key).cloned())
    }
    fn set(&self, key: &str, value: &[u8]) -> Result<(), FakeError> {
        self.lock().insert(key.to_owned(), value.to_vec());
        Ok(())
    }
    fn delete(&self, key: &str) -> Result<bool, FakeError> {
        Ok(self.lock().remove(key).is_some())
    }
    fn increment(&self, key: &str, delta: i64) -> Result<i64, FakeError> {
        let mut entries = self.lock();
        let current = entries.get(key).map(|v| decode_i64(v)).transpose()?.unwrap_or(0);
        let next = current + delta;
        entries.insert(key.to_owned(), next.to_le_bytes().to_vec());
        Ok(next)
    }
    fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, FakeError> {
        Ok(self
            .lock()
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }
}

fn decode_i64(bytes: &[u8]) -> Result<i64, FakeError> {
    let array: [u8; 8] = bytes.try_into().map_err(|_| FakeError::Storage("counter is not an 8-byte integer".into()))?;
    Ok(i64::from_le_bytes(array))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_in_group(group: &[&str]) -> StartRequest {
        StartRequest { distribution_group: group.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn distribution_group_spreads_over_zones() {
        let kv = MemoryKv::default();
        let config = Config::default();
        let a = start(&kv, &config, request_in_group(&[])).unwrap();
        let b = start(&kv, &config, request_in_group(&[&a.id])).unwrap();
        let c = start(&kv, &config, request_in_group(&[&a.id, &b.id])).unwrap();
        let zones: Vec<_> = [a, b, c].into_iter().map(|i| i.hardware.availability_zone.unwrap()).collect();
        assert_eq!(zones, ["zone-a", "zone-b", "zone-c"]);
    }

    #[test]
    fn placement_and_constraints_limit_zones() {
        let kv = MemoryKv::default();
        let config = Config::default();
        let placed = StartRequest { placement: Some("zone=zone-c".into()), ..Default::default() };
        assert_eq!(start(&kv, &config, placed).unwrap().hardware.availability_zone.as_deref(), Some("zone-c"));
        let bad = StartRequest { placement: Some("host=x".into()), ..Default::default() };
        assert!(matches!(start(&kv, &config, bad), Err(FakeError::InvalidParams(_))));
        let none = StartRequest { zones_constraint: Some(vec!["mars".into()]), ..Default::default() };
        assert!(matches!(start(&kv, &config, none), Err(FakeError::ZoneIndependent(_))));
    }

    /// A start keeps the config's zones for describe, even one a full zone
    /// turned away; a full zone refuses its own choice as well as a placement.
    #[test]
    fn full_zones_turn_starts_away_and_the_zones_are_listed() {
        let kv = MemoryKv::default();
        let config = Config { unavailable_zones: vec!["zone-a".into()], ..Config::default() };
        assert!(listed_zones(&kv).is_empty());
        assert!(matches!(start(&kv, &config, StartRequest::default()), Err(FakeError::ZoneUnavailable(_))));
        assert_eq!(listed_zones(&kv), ["zone-a", "zone-b", "zone-c"]);
        let placed = StartRequest { availability_zone: Some("zone-b".into()), ..Default::default() };
        assert_eq!(start(&kv, &config, placed).unwrap().hardware.availability_zone.as_deref(), Some("zone-b"));
        let full = StartRequest { availability_zone: Some("zone-a".into()), ..Default::default() };
        assert!(matches!(start(&kv, &config, full), Err(FakeError::ZoneUnavailable(_))));
    }

    #[test]
    fn stop_is_idempotent_and_all_reflects_it() {
        let kv = MemoryKv::default();
        let config = Config::default();
        let ids: Vec<_> = (0..3).map(|_| start(&kv, &config, StartRequest::default()).unwrap().id).collect();
        stop(&kv, &ids[1..2]).unwrap();
        stop(&kv, &ids[1..2]).unwrap();
        stop(&kv, &["never-existed".to_string()]).unwrap();
        let left: Vec<_> = all(&kv).unwrap().into_iter().map(|i| i.id).collect();
        assert_eq!(left, [ids[0].clone(), ids[2].clone()]);
    }

    #[test]
    fn config_rejects_garbage() {
        assert!(Config::parse("{\"zones\": []}").is_err());
        assert!(Config::parse("{\"bogus\": 1}").is_err());
        assert!(Config::parse("not json").is_err());
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }
}
