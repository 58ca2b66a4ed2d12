//! A group's spec in InfraKit's shape (`{"ID", "Properties": {"Allocation",
//! "Instance", "Flavor", "Updating"}}`), JSON or YAML, checked whole before
//! anything is committed: an unknown field, a size and logical ids together,
//! an unknown flavor are errors naming the field.
//!
//! `Instance.Properties` maps onto `StartInstanceParams`:
//!
//! | field | params |
//! |---|---|
//! | `Constraints` (Juju syntax, `"mem=2G cores=2"`) | `constraints` |
//! | `Placement` | `placement` |
//! | `UserData` (text) | `instance-config.user-data` |
//! | `Tags` (`{"k": "v"}`) | `instance-config.tags` |
//! | `Base` (`ubuntu@24.04`) | `instance-config.base` |
//!
//! The built-in flavor `vanilla` appends its `Init` lines to the user data
//! and adds its `Tags`. The group adds `infrakit.group`, `infrakit.config.hash`
//! and, in a quorum group, `infrakit.logical_id` to the instance config's tags.

use broker_capabilities::bindings::{InstanceConfig, StartInstanceParams};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeMap;
use std::time::Duration;

/// The tag naming the group an instance belongs to.
pub(crate) const GROUP_TAG: &str = "infrakit.group";
/// The tag holding the hash of the Instance and Flavor sections it was made from.
pub const CONFIG_HASH_TAG: &str = "infrakit.config.hash";
/// The tag holding a quorum member's logical id.
pub const LOGICAL_ID_TAG: &str = "infrakit.logical_id";
/// Largest spec file read.
pub const MAX_SPEC_BYTES: usize = 64 * 1024;
/// Largest group: every member is a provider call and a record.
pub(crate) const MAX_GROUP_SIZE: u32 = 10_000;
/// Longest group id or logical id: they are tags, URL segments and event text.
pub(crate) const MAX_ID_BYTES: usize = 128;
/// Longest `Updating.Duration`: a replacement healthy for a day is settled.
pub(crate) const MAX_UPDATE_DURATION: Duration = Duration::from_secs(24 * 3600);
/// The flavors this host has built in.
pub(crate) const FLAVORS: [&str; 1] = ["vanilla"];

/// Why a spec was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// Not JSON or YAML of the spec's shape (an unknown field is named here).
    #[error("the group spec does not parse: {0}")]
    Parse(String),
    /// A field's value is not allowed.
    #[error("group spec field {field}: {why}")]
    Field {
        /// The field, as a path: `Properties.Allocation.Size`.
        field: String,
        /// What is wrong with it.
        why: String,
    },
}

fn field(field: &str, why: impl Into<String>) -> SpecError {
    SpecError::Field { field: field.to_owned(), why: why.into() }
}

/// The spec as written: InfraKit's field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    /// The group's id.
    #[serde(rename = "ID")]
    pub id: String,
    /// What it is made of.
    #[serde(rename = "Properties")]
    pub properties: GroupProperties,
}

/// `Properties` of a group spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct GroupProperties {
    /// How many, or which.
    pub(crate) allocation: Allocation,
    /// The provider and what to start.
    pub instance: PluginSection,
    /// How to prepare each instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flavor: Option<PluginSection>,
    /// How a rolling update paces itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) updating: Option<Updating>,
}

/// `Allocation`: a size (a scaled group) or logical ids (a quorum group), not both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// How many instances.
    #[serde(rename = "Size", default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u32>,
    /// Named members, one instance each.
    #[serde(rename = "LogicalIDs", default, skip_serializing_if = "Option::is_none")]
    pub(crate) logical_ids: Option<Vec<String>>,
}

/// `Instance` or `Flavor`: a plugin's name and its properties.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct PluginSection {
    /// A registered provider's name (`Instance`), or a built-in flavor (`Flavor`).
    pub plugin: String,
    /// The plugin's own properties.
    #[serde(default)]
    pub properties: serde_json::Value,
}

/// `Updating`: how long a replacement must stay healthy before the next old
/// instance goes (`Duration`, Go's syntax: `30s`), or for how many passes (`Count`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct Updating {
    /// `"30s"`, `"1m30s"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    /// Consecutive healthy passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// `Instance.Properties`: what each instance is started with.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
struct InstanceProperties {
    #[serde(default)]
    constraints: String,
    #[serde(default)]
    placement: Option<String>,
    #[serde(default)]
    user_data: Option<String>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    #[serde(default)]
    base: Option<String>,
}

/// The `vanilla` flavor's properties.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
struct VanillaFlavor {
    /// Lines appended to the user data.
    #[serde(default)]
    init: Vec<String>,
    /// Tags added to the instance's.
    #[serde(default)]
    tags: BTreeMap<String, String>,
}

/// How many, or which.
#[derive(Debug, Clone, PartialEq)]
pub enum Members {
    /// A scaled group of this many.
    Size(u32),
    /// A quorum group: one instance per logical id.
    LogicalIds(Vec<String>),
}

/// When a rolling update's replacement counts as settled.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) enum UpdatePace {
    /// As soon as it is healthy.
    #[default]
    Healthy,
    /// Healthy for this long.
    For(Duration),
    /// Healthy on this many passes in a row.
    Passes(u32),
}

/// A checked spec: what the convergence loop works from.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The spec as written (what `inspect` shows and the store keeps).
    pub spec: GroupSpec,
    /// The provider its instances come from.
    pub provider: String,
    /// How many, or which.
    pub members: Members,
    /// The hash of the Instance and Flavor sections (`infrakit.config.hash`).
    pub(crate) config_hash: String,
    /// How a rolling update paces itself.
    pub(crate) pace: UpdatePace,
    /// What every member is started with, but for the group's tags.
    params: StartInstanceParams,
}

impl Group {
    /// Parse and check a spec file's text: JSON if it starts with `{`, else YAML.
    pub fn parse(text: &str) -> Result<Group, SpecError> {
        if text.len() > MAX_SPEC_BYTES {
            return Err(SpecError::Parse(format!("it is {} bytes; at most {MAX_SPEC_BYTES} are read", text.len())));
        }
        let spec: GroupSpec = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| SpecError::Parse(format!("JSON: {e}")))?
        } else {
            serde_norway::from_str(text).map_err(|e| SpecError::Parse(format!("YAML: {e}")))?
        };
        Group::check(spec)
    }

    /// Check a spec already in its shape (from the store, or an API body).
    pub fn check(mut spec: GroupSpec) -> Result<Group, SpecError> {
        if let Some(why) = id_problem(&spec.id) {
            return Err(field("ID", why));
        }
        // InfraKit's Go clients write both fields of an allocation: a zero
        // size beside logical ids, an empty list beside a size. Read as meant.
        let allocation = &mut spec.properties.allocation;
        match (allocation.size, allocation.logical_ids.as_deref()) {
            (Some(0), Some([_, ..])) => allocation.size = None,
            (Some(_), Some([])) => allocation.logical_ids = None,
            _ => {}
        }
        let properties = &spec.properties;
        let members = match (&properties.allocation.size, &properties.allocation.logical_ids) {
            (Some(_), Some(_)) => {
                return Err(field(
                    "Properties.Allocation",
                    "Size and LogicalIDs are both given; a group has one or the other",
                ));
            }
            (None, None) => {
                return Err(field(
                    "Properties.Allocation",
                    "give Size (a scaled group) or LogicalIDs (a quorum group)",
                ));
            }
            (Some(size), None) if *size > MAX_GROUP_SIZE => {
                return Err(field("Properties.Allocation.Size", format!("{size} is more than {MAX_GROUP_SIZE}")));
            }
            (Some(size), None) => Members::Size(*size),
            (None, Some(ids)) => {
                if ids.is_empty() || ids.len() > MAX_GROUP_SIZE as usize {
                    return Err(field("Properties.Allocation.LogicalIDs", format!("give 1 to {MAX_GROUP_SIZE} ids")));
                }
                let mut seen = std::collections::BTreeSet::new();
                for id in ids {
                    if let Some(why) = id_problem(id) {
                        return Err(field("Properties.Allocation.LogicalIDs", format!("{id:?}: {why}")));
                    }
                    if !seen.insert(id) {
                        return Err(field("Properties.Allocation.LogicalIDs", format!("{id:?} is given twice")));
                    }
                }
                Members::LogicalIds(ids.clone())
            }
        };
        let provider = properties.instance.plugin.clone();
        if provider.is_empty() {
            return Err(field("Properties.Instance.Plugin", "name the provider its instances come from"));
        }
        let flavor = match &properties.flavor {
            None => VanillaFlavor::default(),
            Some(section) if FLAVORS.contains(&section.plugin.as_str()) => match &section.properties {
                serde_json::Value::Null => VanillaFlavor::default(),
                value => serde_json::from_value(value.clone())
                    .map_err(|e| field("Properties.Flavor.Properties", e.to_string()))?,
            },
            Some(section) => {
                return Err(field(
                    "Properties.Flavor.Plugin",
                    format!(
                        "unknown flavor {:?}: this host has the built-in flavor {}",
                        section.plugin,
                        FLAVORS.join(", ")
                    ),
                ));
            }
        };
        let pace = match &properties.updating {
            None => UpdatePace::Healthy,
            Some(Updating { duration: Some(_), count: Some(_) }) => {
                return Err(field("Properties.Updating", "Duration and Count are both given; give one"));
            }
            Some(Updating { duration: Some(text), count: None }) => {
                let duration = humantime::parse_duration(text)
                    .map_err(|e| field("Properties.Updating.Duration", format!("{text:?}: {e}")))?;
                if duration > MAX_UPDATE_DURATION {
                    return Err(field("Properties.Updating.Duration", format!("{text:?} is more than a day")));
                }
                UpdatePace::For(duration)
            }
            Some(Updating { duration: None, count: Some(count) }) => UpdatePace::Passes(*count),
            Some(Updating { duration: None, count: None }) => UpdatePace::Healthy,
        };
        let params = start_params(
            "Properties.Instance.Properties",
            &properties.instance.properties,
            &flavor.init,
            flavor.tags,
            false,
        )?;
        let config_hash = config_hash(&properties.instance, properties.flavor.as_ref());
        Ok(Group { provider, members, config_hash, pace, params, spec })
    }

    /// The group's id.
    pub fn id(&self) -> &str {
        &self.spec.id
    }

    /// How many members it should have.
    pub fn size(&self) -> usize {
        match &self.members {
            Members::Size(size) => *size as usize,
            Members::LogicalIds(ids) => ids.len(),
        }
    }

    /// The zones its `zones=` constraint allows, by name; none without one.
    pub fn zones(&self) -> Vec<String> {
        let mut zones = self.params.constraints.zones.clone().unwrap_or_default();
        zones.sort();
        zones.dedup();
        zones
    }

    /// What a new member is started with: the spec's params, tagged as the
    /// group's (and as `logical_id`, in a quorum group).
    pub(crate) fn params_for(&self, logical_id: Option<&str>) -> StartInstanceParams {
        let mut params = self.params.clone();
        if let Some(config) = &mut params.instance_config {
            config.tags.push((GROUP_TAG.into(), self.id().into()));
            config.tags.push((CONFIG_HASH_TAG.into(), self.config_hash.clone()));
            if let Some(logical_id) = logical_id {
                config.tags.push((LOGICAL_ID_TAG.into(), logical_id.into()));
            }
        }
        params
    }
}

/// Why a group id or logical id is refused: they are tags, URL segments and
/// file names' worth of text, so 1 to 128 of `A-Z a-z 0-9 . _ -`, not starting with `.`.
pub(crate) fn id_problem(id: &str) -> Option<String> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Some(format!("must be 1 to {MAX_ID_BYTES} bytes"));
    }
    if id.starts_with('.') {
        return Some("must not start with '.'".into());
    }
    let bad = id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))?;
    Some(format!("has {:?}; only A-Z, a-z, 0-9, '.', '_' and '-' are allowed", bad))
}

/// Start params from an instance plugin's `Properties` (field names
/// prefixed by `at` in errors), with `init` lines appended to the user data
/// and `tags` added to the properties' own. `infrakit.*` tags are refused in
/// the properties and the extra tags unless `infrakit_tags` (InfraKit's own
/// group controller sends them to an instance plugin).
pub fn start_params(
    at: &str,
    properties: &serde_json::Value,
    init: &[String],
    tags: BTreeMap<String, String>,
    infrakit_tags: bool,
) -> Result<StartInstanceParams, SpecError> {
    let instance: InstanceProperties = match properties {
        serde_json::Value::Null => InstanceProperties::default(),
        value => serde_json::from_value(value.clone()).map_err(|e| field(at, e.to_string()))?,
    };
    let constraints = broker_capabilities::contract::constraints::parse(&instance.constraints)
        .map_err(|e| field(&format!("{at}.Constraints"), format!("{:?}: {e}", instance.constraints)))?;
    let mut params = broker_capabilities::contract::params_with(constraints);
    params.placement = instance.placement;
    let mut user_data = instance.user_data.unwrap_or_default();
    for line in init {
        if !user_data.is_empty() && !user_data.ends_with('\n') {
            user_data.push('\n');
        }
        user_data.push_str(line);
        user_data.push('\n');
    }
    let mut all_tags = instance.tags;
    if let Some(reserved) = all_tags.keys().find(|key| key.starts_with("infrakit.")) {
        return Err(field(&format!("{at}.Tags"), format!("{reserved:?}: infrakit.* tags are the group's")));
    }
    all_tags.extend(tags);
    if !infrakit_tags && let Some(reserved) = all_tags.keys().find(|key| key.starts_with("infrakit.")) {
        return Err(field(&format!("{at}.Tags"), format!("{reserved:?}: infrakit.* tags are the group's")));
    }
    params.instance_config = Some(instance_config(user_data, all_tags, instance.base));
    Ok(params)
}

fn instance_config(user_data: String, tags: BTreeMap<String, String>, base: Option<String>) -> InstanceConfig {
    InstanceConfig {
        base,
        user_data: (!user_data.is_empty()).then(|| user_data.into_bytes()),
        tags: tags.into_iter().collect(),
        ..broker_capabilities::contract::empty_instance_config()
    }
}

/// The hash of the Instance and Flavor sections as InfraKit makes it (their
/// JSON with sorted keys; base32 of 20 bytes of digest, lower case, 32
/// characters), but with SHA-256: the same spec in another key order or
/// layout hashes the same; a change to either section starts a rolling update.
pub(crate) fn config_hash(instance: &PluginSection, flavor: Option<&PluginSection>) -> String {
    let mut digest = sha2::Sha256::new();
    digest.update(canonical_json(&serde_json::to_value(instance).unwrap_or_default()));
    digest.update(canonical_json(&serde_json::to_value(flavor).unwrap_or_default()));
    let digest = digest.finalize();
    data_encoding::BASE32_NOPAD.encode(&digest[..20]).to_ascii_lowercase()
}

/// JSON with every object's keys in order, whatever order they were written in.
fn canonical_json(value: &serde_json::Value) -> String {
    fn write(value: &serde_json::Value, out: &mut String) {
        match value {
            serde_json::Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, key) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::Value::String(key.clone()).to_string());
                    out.push(':');
                    write(&map[key], out);
                }
                out.push('}');
            }
            serde_json::Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(value, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORKERS: &str = r##"{"ID": "workers", "Properties": {
        "Allocation": {"Size": 3},
        "Instance": {"Plugin": "fake", "Properties": {"Constraints": "mem=2G", "Tags": {"role": "worker"}, "UserData": "#cloud-config"}},
        "Flavor": {"Plugin": "vanilla", "Properties": {"Init": ["echo hi"], "Tags": {"tier": "web"}}},
        "Updating": {"Duration": "1m30s"}}}"##;

    #[test]
    fn a_spec_maps_onto_start_params_with_the_groups_tags() {
        let group = Group::parse(WORKERS).unwrap();
        assert_eq!((group.id(), group.provider.as_str(), group.size()), ("workers", "fake", 3));
        assert_eq!(group.pace, UpdatePace::For(Duration::from_secs(90)));
        assert_eq!(group.config_hash.len(), 32);
        let params = group.params_for(Some("a"));
        assert_eq!(params.constraints.mem, Some(2048));
        let config = params.instance_config.unwrap();
        assert_eq!(config.user_data.as_deref(), Some(b"#cloud-config\necho hi\n".as_slice()));
        let tags: BTreeMap<_, _> = config.tags.into_iter().collect();
        assert_eq!(tags["role"], "worker");
        assert_eq!(tags["tier"], "web");
        assert_eq!(tags[GROUP_TAG], "workers");
        assert_eq!(tags[CONFIG_HASH_TAG], group.config_hash);
        assert_eq!(tags[LOGICAL_ID_TAG], "a");
    }

    #[test]
    fn yaml_and_json_in_any_key_order_hash_the_same_and_allocation_does_not_count() {
        let yaml = "ID: workers\nProperties:\n  Allocation: {Size: 7}\n  Flavor:\n    Properties: {Tags: {tier: web}, Init: [echo hi]}\n    Plugin: vanilla\n  Instance:\n    Properties: {UserData: '#cloud-config', Tags: {role: worker}, Constraints: mem=2G}\n    Plugin: fake\n";
        let (a, b) = (Group::parse(WORKERS).unwrap(), Group::parse(yaml).unwrap());
        assert_eq!(a.config_hash, b.config_hash);
        assert_eq!(b.size(), 7);
        let changed = WORKERS.replace("mem=2G", "mem=4G");
        assert_ne!(Group::parse(&changed).unwrap().config_hash, a.config_hash);
    }

    #[test]
    fn bad_specs_are_refused_naming_the_field() {
        let cases = [
            (
                WORKERS.replace(r#""Size": 3"#, r#""Size": 3, "LogicalIDs": ["a"]"#),
                "Properties.Allocation: Size and LogicalIDs",
            ),
            (WORKERS.replace(r#""Size": 3"#, ""), "Properties.Allocation: give Size"),
            (WORKERS.replace(r#""Size": 3"#, r#""LogicalIDs": ["a", "a"]"#), r#""a" is given twice"#),
            (
                WORKERS.replace(r#""Plugin": "vanilla""#, r#""Plugin": "swarm""#),
                r#"Properties.Flavor.Plugin: unknown flavor "swarm""#,
            ),
            (
                WORKERS.replace("Constraints", "Constrains"),
                "Properties.Instance.Properties: unknown field `Constrains`",
            ),
            (WORKERS.replace(r#""Allocation""#, r#""Alocation""#), "unknown field `Alocation`"),
            (WORKERS.replace("mem=2G", "mem=lots"), "Properties.Instance.Properties.Constraints"),
            (WORKERS.replace("1m30s", "soon"), "Properties.Updating.Duration"),
            (WORKERS.replace("1m30s", "25h"), "is more than a day"),
            (
                WORKERS.replace(r#""Duration": "1m30s""#, r#""Duration": "1s", "Count": 2"#),
                "Duration and Count are both given",
            ),
            (WORKERS.replace(r#""ID": "workers""#, r#""ID": "../x""#), "group spec field ID"),
            (WORKERS.replace(r#""role""#, r#""infrakit.group""#), "infrakit.* tags are the group's"),
            (WORKERS.replace(r#""Size": 3"#, r#""Size": 10001"#), "more than 10000"),
            ("ID: [".to_owned(), "YAML"),
            ("{".to_owned(), "JSON"),
            (" ".repeat(MAX_SPEC_BYTES + 1), "at most 65536"),
        ];
        for (text, expected) in cases {
            let error = Group::parse(&text).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
    }

    #[test]
    fn a_quorum_group_has_its_logical_ids_and_size_zero_is_a_group_of_none() {
        let quorum = Group::parse(&WORKERS.replace(r#""Size": 3"#, r#""LogicalIDs": ["m1", "m2"]"#)).unwrap();
        assert_eq!(quorum.members, Members::LogicalIds(vec!["m1".into(), "m2".into()]));
        assert_eq!(quorum.size(), 2);
        assert_eq!(Group::parse(&WORKERS.replace(r#""Size": 3"#, r#""Size": 0"#)).unwrap().size(), 0);
        // As Go's encoding of InfraKit's allocation gives them: both fields, one of them empty.
        let go_quorum = Group::parse(&WORKERS.replace(r#""Size": 3"#, r#""Size": 0, "LogicalIDs": ["m1"]"#)).unwrap();
        assert_eq!(go_quorum.members, Members::LogicalIds(vec!["m1".into()]));
        assert_eq!(go_quorum.spec.properties.allocation.size, None, "stored as meant");
        let go_scaled = Group::parse(&WORKERS.replace(r#""Size": 3"#, r#""Size": 3, "LogicalIDs": []"#)).unwrap();
        assert_eq!((go_scaled.size(), go_scaled.spec.properties.allocation.logical_ids), (3, None));
        let both = Group::parse(&WORKERS.replace(r#""Size": 3"#, r#""Size": 2, "LogicalIDs": ["m1"]"#));
        assert!(both.unwrap_err().to_string().contains("both given"));
    }
}
