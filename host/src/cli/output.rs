//! How the CLI shows providers, instances and progress.

use super::describe_event;
use crate::capabilities::context::CallEvent;
use crate::providers::Manifest;
use crate::providers::manifest::Method;
use crate::store::records::Hardware;
use crate::store::{InstanceRecord, ProviderRecord};
use serde::Serialize;
use std::io::Write;

/// An instance as `--json` prints it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct InstanceView {
    pub id: String,
    pub provider: String,
    pub status: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub display_name: String,
    pub hardware: Hardware,
    pub tags: Vec<String>,
    pub addresses: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub created: String,
}

impl From<&InstanceRecord> for InstanceView {
    fn from(r: &InstanceRecord) -> Self {
        InstanceView {
            id: r.id.clone(),
            provider: r.provider.clone(),
            status: r.status.clone(),
            message: r.message.clone(),
            display_name: r.display_name.clone(),
            hardware: r.hardware.clone(),
            tags: r.tags.clone(),
            addresses: r.addresses.clone(),
            created: r.created.clone(),
        }
    }
}

/// The effective grants: everything not listed here is denied.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct GrantsView {
    pub kv: bool,
    pub log: bool,
    pub machine_lock: bool,
    pub process: Vec<String>,
    pub paths: Vec<String>,
    pub bridge_devices: Vec<String>,
    pub bridge_bridges: Vec<String>,
}

/// A provider as `provider show` prints it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ProviderView {
    pub name: String,
    pub version: String,
    pub component: String,
    pub component_sha256: String,
    pub manifest: String,
    pub isolation: crate::providers::Isolation,
    pub memory_mib: u64,
    pub pool_size: usize,
    pub max_calls: u64,
    pub max_age: String,
    /// Method name -> deadline.
    pub deadlines: Vec<(String, String)>,
    pub grants: GrantsView,
    pub config: serde_json::Value,
}

impl ProviderView {
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
            grants: GrantsView {
                kv: grants.kv,
                log: grants.log,
                machine_lock: grants.machine_lock,
                process: grants.process.clone(),
                paths: grants.paths.iter().map(|p| p.display().to_string()).collect(),
                bridge_devices: grants.bridge.as_ref().map(|b| b.devices.clone()).unwrap_or_default(),
                bridge_bridges: grants.bridge.as_ref().map(|b| b.bridges.clone()).unwrap_or_default(),
            },
            config: serde_json::from_str(&manifest.config_json).unwrap_or(serde_json::Value::Null),
        }
    }
}

pub fn provider_details(out: &mut impl Write, v: &ProviderView) -> std::io::Result<()> {
    writeln!(out, "name:       {}", v.name)?;
    writeln!(out, "version:    {}", v.version)?;
    writeln!(out, "manifest:   {}", v.manifest)?;
    writeln!(out, "component:  {} (sha256 {})", v.component, v.component_sha256)?;
    let isolation = serde_json::to_value(v.isolation).ok().and_then(|i| i.as_str().map(str::to_owned));
    writeln!(out, "isolation:  {}", isolation.unwrap_or_default())?;
    writeln!(
        out,
        "limits:     memory {} MiB, pool {}, retire after {} calls or {}",
        v.memory_mib, v.pool_size, v.max_calls, v.max_age
    )?;
    writeln!(out, "deadlines:")?;
    for (method, deadline) in &v.deadlines {
        writeln!(out, "  {method:<18} {deadline}")?;
    }
    let yes_no = |granted: bool| if granted { "granted" } else { "denied" };
    let list = |items: &[String]| if items.is_empty() { "denied".to_owned() } else { items.join(", ") };
    writeln!(out, "grants:")?;
    writeln!(out, "  {:<18} {}", "kv", yes_no(v.grants.kv))?;
    writeln!(out, "  {:<18} {}", "log", yes_no(v.grants.log))?;
    writeln!(out, "  {:<18} {}", "machine-lock", yes_no(v.grants.machine_lock))?;
    writeln!(out, "  {:<18} {}", "process", list(&v.grants.process))?;
    writeln!(out, "  {:<18} {}", "paths", list(&v.grants.paths))?;
    writeln!(out, "  {:<18} {}", "bridge devices", list(&v.grants.bridge_devices))?;
    writeln!(out, "  {:<18} {}", "bridge bridges", list(&v.grants.bridge_bridges))?;
    writeln!(out, "config:     {}", v.config)
}

/// A status update as it happens, on stderr so stdout stays parseable.
pub fn progress(provider: &str, event: &CallEvent) {
    eprintln!("[{provider}] {}", describe_event(event));
}

fn table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_owned()
    };
    writeln!(out, "{}", line(header.to_vec()))?;
    for row in rows {
        writeln!(out, "{}", line(row.iter().map(String::as_str).collect()))?;
    }
    Ok(())
}

pub fn provider_table(out: &mut impl Write, records: &[ProviderRecord]) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| vec![r.name.clone(), r.version.clone(), r.component_sha256[..12].to_owned(), r.manifest.clone()])
        .collect();
    table(out, &["NAME", "VERSION", "SHA256", "MANIFEST"], &rows)
}

pub fn instance_table(out: &mut impl Write, views: &[InstanceView]) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = views
        .iter()
        .map(|v| {
            vec![
                v.id.clone(),
                v.provider.clone(),
                v.status.clone(),
                v.hardware.availability_zone.clone().unwrap_or_default(),
                v.hardware.juju_text(),
            ]
        })
        .collect();
    table(out, &["ID", "PROVIDER", "STATUS", "ZONE", "HARDWARE"], &rows)
}

/// One line per event: `seq time kind provider old -> new detail`.
pub fn event_lines(out: &mut impl Write, events: &[crate::store::Event]) -> std::io::Result<()> {
    let short = |sha: &Option<String>| sha.as_deref().map(|s| &s[..s.len().min(12)]).unwrap_or("-").to_owned();
    for e in events {
        let versions = match (&e.old_version, &e.new_version) {
            (Some(old), Some(new)) => format!(" {old} ({}) -> {new} ({})", short(&e.old_sha256), short(&e.new_sha256)),
            (None, Some(new)) => format!(" {new} ({})", short(&e.new_sha256)),
            (Some(old), None) => format!(" {old} ({}), candidate {}", short(&e.old_sha256), short(&e.new_sha256)),
            (None, None) => String::new(),
        };
        let detail = if e.detail.is_empty() { String::new() } else { format!(": {}", e.detail) };
        writeln!(out, "{:>5} {} {:<12} {}{versions}{detail}", e.seq, e.time, e.kind, e.provider)?;
    }
    Ok(())
}
