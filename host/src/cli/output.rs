//! How the CLI shows providers, instances and progress.

use super::describe_event;
use crate::capabilities::context::CallEvent;
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
