//! A provider as `provider show` and `GET /v1/providers/NAME` report it: the
//! registered record, the effective limits and grants, and (from a daemon)
//! the crash policy's state.

use crate::manifest::Method;
use crate::manifest::{Isolation, Manifest};
use crate::store::ProviderRecord;
use serde::{Deserialize, Serialize};

/// The effective grants: everything not listed here is denied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GrantsView {
    /// Each room's report of its grant, by key (`kv`, `process`, `local-sockets`, …).
    #[serde(flatten)]
    pub rooms: std::collections::BTreeMap<String, serde_json::Value>,
}

/// A provider as `provider show` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ProviderView {
    /// The manifest's `name`.
    pub name: String,
    /// What the component's `describe` reported.
    pub version: String,
    /// The component file.
    pub component: String,
    /// Its SHA-256, hex.
    pub component_sha256: String,
    /// The manifest file.
    pub manifest: String,
    /// How its calls are isolated from each other.
    pub isolation: Isolation,
    /// The linear memory an instance may grow to.
    pub memory_mib: u64,
    /// Instances kept ready.
    pub pool_size: usize,
    /// Calls an instance serves before it is replaced.
    pub max_calls: u64,
    /// How long an instance serves before it is replaced.
    pub max_age: String,
    /// Method name -> deadline.
    pub deadlines: Vec<(String, String)>,
    /// `[limits]` key -> the bound on what it may make the host hold.
    #[serde(default)]
    pub quotas: Vec<(String, String)>,
    /// What it was granted, room by room.
    pub grants: GrantsView,
    /// Its `[config]`, secrets shown by name only.
    pub config: serde_json::Value,
    /// Only a daemon has one: a CLI process loads the provider afresh.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerView>,
}

/// The crash policy's state for the version new calls get.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BreakerView {
    /// New calls are let through one at a time, to see whether it recovered.
    pub half_open: bool,
    /// How often it tripped since it was loaded.
    pub trips: u64,
}

/// The config as shown: each `[secrets]` key as `<secret NAME>`, and a value
/// that looks like a secret given inline as `<redacted>`.
fn shown_config(manifest: &Manifest) -> serde_json::Value {
    let mut config = manifest.config.clone();
    hide_inline(&mut config, false);
    let mut shown = serde_json::to_value(&config).unwrap_or(serde_json::Value::Null);
    if let serde_json::Value::Object(map) = &mut shown {
        for (key, name) in &manifest.secrets {
            map.insert(key.clone(), format!("<secret {name}>").into());
        }
    }
    shown
}

fn hide_inline(table: &mut toml::Table, secret: bool) {
    for (key, value) in table.iter_mut() {
        hide_value(value, secret || broker_capabilities::secrets::looks_secret(key));
    }
}

fn hide_value(value: &mut toml::Value, secret: bool) {
    match value {
        toml::Value::String(text) if secret && !text.is_empty() => *text = "<redacted>".into(),
        toml::Value::Table(table) => hide_inline(table, secret),
        toml::Value::Array(items) => items.iter_mut().for_each(|item| hide_value(item, secret)),
        _ => {}
    }
}

impl ProviderView {
    /// The view of a recorded provider loaded with `manifest`.
    pub fn new(record: &ProviderRecord, manifest: &Manifest) -> Self {
        let limits = &manifest.limits;
        let methods = Method::ALL;
        let grants = &manifest.grants;
        ProviderView {
            name: record.name.clone(),
            version: record.version.clone(),
            component: manifest.component.display().to_string(),
            component_sha256: record.component_sha256.clone(),
            manifest: record.manifest.clone(),
            isolation: manifest.isolation,
            memory_mib: limits.memory_mib,
            pool_size: limits.pool_size,
            max_calls: limits.max_calls,
            max_age: humantime::format_duration(limits.max_age).to_string(),
            deadlines: methods
                .iter()
                .map(|m| (m.name().to_owned(), humantime::format_duration(limits.deadlines.for_method(*m)).to_string()))
                .collect(),
            quotas: [
                ("call-data-mib", limits.call_data_mib.to_string()),
                ("max-records", limits.max_records.to_string()),
                ("max-concurrent-calls", limits.max_concurrent_calls.to_string()),
                ("queue-wait", humantime::format_duration(limits.queue_wait).to_string()),
                ("log-lines-per-second", limits.log_lines_per_second.to_string()),
                ("kv-keys", limits.kv_keys.to_string()),
                ("kv-mib", limits.kv_mib.to_string()),
                ("data-mib", limits.data_mib.to_string()),
            ]
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value))
            .collect(),
            grants: GrantsView { rooms: grants.rooms.view() },
            config: shown_config(manifest),
            breaker: None,
        }
    }
}
