//! How the CLI shows providers, instances and progress. Text a provider chose
//! (ids, names, versions, status messages, errors, events) is printed with control
//! characters escaped ([`escape_unprintable`]), so that it cannot forge lines or
//! drive the terminal; `--json` output is JSON with the same escaped ([`json_pretty`]).

use super::describe_event;
use crate::wire::StartLine;
use broker_capabilities::error_text::escape_unprintable as esc;
use broker_capabilities::rooms::context::CallEvent;
use broker_core::providers::view::ProviderView;
use broker_core::store::records::Hardware;
use broker_core::store::{InstanceRecord, ProviderRecord};
use serde::Serialize;
use std::io::Write;

/// An instance as `--json` prints it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct InstanceView {
    pub(crate) id: String,
    pub(crate) provider: String,
    pub(crate) status: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) message: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) display_name: String,
    pub(crate) hardware: Hardware,
    pub(crate) tags: Vec<String>,
    /// The instance config's tags the start was given (`--tag`, a group's).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub(crate) instance_tags: std::collections::BTreeMap<String, String>,
    pub(crate) addresses: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) created: String,
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
            instance_tags: r.instance_tags.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            addresses: r.addresses.clone(),
            created: r.created.clone(),
        }
    }
}

/// One line of text, escaped.
/// JSON a terminal may show: serde escapes the C0 controls inside strings;
/// this also writes `\uXXXX` for what else could drive or spoof a terminal
/// (DEL, C1 controls, bidi and zero-width characters), which reads back the
/// same. A raw newline in serde's output is only ever its own layout.
fn terminal_safe(json: String) -> String {
    let unsafe_char = |c: char| c != '\n' && broker_capabilities::error_text::is_unprintable(c);
    if !json.chars().any(unsafe_char) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if unsafe_char(c) {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `value` as indented JSON, safe for a terminal.
pub(crate) fn json_pretty(value: &impl Serialize) -> serde_json::Result<String> {
    serde_json::to_string_pretty(value).map(terminal_safe)
}

/// `value` as one line of JSON, safe for a terminal.
pub(crate) fn json_line(value: &impl Serialize) -> serde_json::Result<String> {
    serde_json::to_string(value).map(terminal_safe)
}

pub(crate) fn line(out: &mut impl Write, text: &str) -> std::io::Result<()> {
    writeln!(out, "{}", esc(text))
}

pub(crate) fn provider_details(out: &mut impl Write, v: &ProviderView) -> std::io::Result<()> {
    writeln!(out, "name:       {}", esc(&v.name))?;
    writeln!(out, "version:    {}", esc(&v.version))?;
    writeln!(out, "manifest:   {}", esc(&v.manifest))?;
    writeln!(out, "component:  {} (sha256 {})", esc(&v.component), esc(&v.component_sha256))?;
    let isolation = serde_json::to_value(v.isolation).ok().and_then(|i| i.as_str().map(str::to_owned));
    writeln!(out, "isolation:  {}", isolation.unwrap_or_default())?;
    writeln!(
        out,
        "limits:     memory {} MiB, pool {}, retire after {} calls or {}",
        v.memory_mib, v.pool_size, v.max_calls, v.max_age
    )?;
    if !v.quotas.is_empty() {
        let quotas: Vec<String> = v.quotas.iter().map(|(key, value)| format!("{} {}", esc(key), esc(value))).collect();
        writeln!(out, "quotas:     {}", quotas.join(", "))?;
    }
    writeln!(out, "deadlines:")?;
    for (method, deadline) in &v.deadlines {
        writeln!(out, "  {method:<18} {deadline}")?;
    }
    writeln!(out, "grants:")?;
    // A daemon newer than this CLI may report a room it does not know: shown as JSON.
    for (label, shown) in broker_capabilities::rooms::shown(&v.grants.rooms) {
        writeln!(out, "  {:<18} {}", esc(&label), esc(&shown))?;
    }
    writeln!(out, "config:     {}", esc(&v.config.to_string()))?;
    match &v.breaker {
        Some(b) if b.half_open => {
            writeln!(out, "breaker:    half-open ({} trips): the next call re-observes first", b.trips)
        }
        Some(b) => writeln!(out, "breaker:    closed ({} trips)", b.trips),
        None => Ok(()),
    }
}

/// Status updates as they happen, on stderr so stdout stays parseable: in a
/// terminal one line redrawn with the time so far, otherwise a line each, or
/// with `--json` the API's NDJSON lines.
pub(crate) struct Progress {
    provider: String,
    style: ProgressStyle,
    started: std::time::Instant,
    /// A redrawn line is on screen and needs its newline.
    live: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProgressStyle {
    Live,
    Lines,
    Json,
}

impl Progress {
    pub(crate) fn new(provider: &str, json: bool) -> Self {
        use std::io::IsTerminal;
        let style = match (json, std::io::stderr().is_terminal()) {
            (true, _) => ProgressStyle::Json,
            (false, true) => ProgressStyle::Live,
            (false, false) => ProgressStyle::Lines,
        };
        Progress { provider: provider.to_owned(), style, started: std::time::Instant::now(), live: Default::default() }
    }

    pub(crate) fn show(&self, event: &CallEvent) {
        let mut err = std::io::stderr().lock();
        // Progress is best effort: a closed stderr must not fail the start.
        let _ = match self.style {
            ProgressStyle::Json => {
                let line = json_line(&StartLine::from(event.clone())).unwrap_or_default();
                writeln!(err, "{line}")
            }
            ProgressStyle::Lines => line(&mut err, &format!("[{}] {}", self.provider, describe_event(event))),
            ProgressStyle::Live => {
                self.live.store(true, std::sync::atomic::Ordering::Relaxed);
                let elapsed = self.started.elapsed().as_secs_f64();
                let text = format!("[{}] {}", self.provider, describe_event(event));
                // Only the host's own sequence (return, clear the line) reaches the terminal.
                write!(err, "\r\x1b[2K{} ({elapsed:.1}s)", esc(&text)).and_then(|()| err.flush())
            }
        };
    }

    /// End a redrawn line, keeping its last state on screen.
    pub(crate) fn finish(&self) {
        if self.live.swap(false, std::sync::atomic::Ordering::Relaxed) {
            let _ = writeln!(std::io::stderr());
        }
    }
}

fn table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> =
        rows.iter().map(|row| row.iter().map(|cell| esc(cell).into_owned()).collect()).collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_owned()
    };
    writeln!(out, "{}", line(header.to_vec()))?;
    for row in &rows {
        writeln!(out, "{}", line(row.iter().map(String::as_str).collect()))?;
    }
    Ok(())
}

pub(crate) fn provider_table(out: &mut impl Write, records: &[ProviderRecord]) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                r.version.clone(),
                broker_core::store::records::short_sha256(&r.component_sha256).to_owned(),
                r.manifest.clone(),
            ]
        })
        .collect();
    table(out, &["NAME", "VERSION", "SHA256", "MANIFEST"], &rows)
}

pub(crate) fn instance_table(out: &mut impl Write, views: &[InstanceView]) -> std::io::Result<()> {
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
pub(crate) fn event_lines(out: &mut impl Write, events: &[broker_core::store::Event]) -> std::io::Result<()> {
    let short =
        |sha: &Option<String>| sha.as_deref().map(broker_core::store::records::short_sha256).unwrap_or("-").to_owned();
    for e in events {
        let versions = match (&e.old_version, &e.new_version) {
            (Some(old), Some(new)) => format!(" {old} ({}) -> {new} ({})", short(&e.old_sha256), short(&e.new_sha256)),
            (None, Some(new)) => format!(" {new} ({})", short(&e.new_sha256)),
            (Some(old), None) => format!(" {old} ({}), candidate {}", short(&e.old_sha256), short(&e.new_sha256)),
            (None, None) => String::new(),
        };
        let detail = if e.detail.is_empty() { String::new() } else { format!(": {}", e.detail) };
        line(out, &format!("{:>5} {} {:<12} {}{versions}{detail}", e.seq, e.time, e.kind, e.provider))?;
    }
    Ok(())
}

/// `broker store check` / `recover`: per table, what was read, what was not.
pub(crate) fn salvage_report(
    out: &mut impl Write,
    report: &broker_core::store::salvage::SalvageReport,
) -> std::io::Result<()> {
    writeln!(out, "state file: {}", esc(&report.path))?;
    if report.unclean {
        writeln!(
            out,
            "not closed cleanly (the process that had it open was stopped): the next open repairs it; below, a repaired copy with its write-ahead log applied"
        )?;
    }
    if let Some(why) = &report.unopenable {
        writeln!(out, "cannot be opened: {}", esc(why))?;
    }
    for table in &report.tables {
        let state = match (&table.cut_short, table.corrupt.len()) {
            (None, 0) => "ok".to_owned(),
            (None, n) => format!("{n} record(s) do not decode"),
            (Some(why), _) => format!("read up to an unreadable entry: {}", esc(why)),
        };
        writeln!(out, "{:<18} {:>8} readable  {state}", table.table, table.readable)?;
        for bad in &table.corrupt {
            writeln!(out, "  left out: {}", esc(bad))?;
        }
    }
    if let Some(kept) = &report.kept_as {
        writeln!(out, "the damaged file is kept as {}", esc(kept))?;
    }
    if let Some(tables) = &report.with_log {
        writeln!(out, "the new state file, its write-ahead log applied:")?;
        for table in tables {
            writeln!(out, "{:<18} {:>8} entries", table.table, table.readable)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_core::manifest::Manifest;

    const HOSTILE: &str = "\x1b[2J\n\rforged\x07\u{9b}31m";

    fn assert_inert(text: &str) {
        let controls: Vec<char> =
            text.chars().filter(|c| *c != '\n' && broker_capabilities::error_text::is_unprintable(*c)).collect();
        assert!(controls.is_empty(), "raw {controls:?} in {text:?}");
        assert!(!text.lines().any(|l| l.trim_start_matches('\r').starts_with("forged")), "a forged line in {text:?}");
        assert!(text.contains(r"\x1b[2J\n\rforged\x07\x9b31m"), "{text:?}");
    }

    fn printed(write: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>) -> String {
        let mut out = Vec::new();
        write(&mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn instance_tables_and_lines_escape_what_providers_chose() {
        let view = InstanceView {
            id: HOSTILE.into(),
            provider: "hostile".into(),
            status: "running".into(),
            message: String::new(),
            display_name: String::new(),
            hardware: Hardware { availability_zone: Some(HOSTILE.into()), ..Default::default() },
            instance_tags: Default::default(),
            tags: vec![],
            addresses: vec![],
            created: String::new(),
        };
        let text = printed(|out| instance_table(out, &[view]));
        assert_inert(&text);
        assert_eq!(text.lines().count(), 2, "a header and one row: {text:?}");
        assert_inert(&printed(|out| line(out, &format!("started {HOSTILE} (hostile)"))));
    }

    /// JSON for a terminal escapes what serde leaves raw (DEL, C1 controls,
    /// bidi overrides), and still reads back as what was written.
    #[test]
    fn json_for_a_terminal_escapes_what_could_drive_one_and_reads_back_the_same() {
        let hostile = "a\u{7f}b\u{9b}2Jc\u{202e}d\u{1b}[31m\n";
        let value = serde_json::json!({ "id": hostile, "list": [hostile] });
        for text in [json_pretty(&value).unwrap(), json_line(&value).unwrap()] {
            assert!(!text.chars().any(|c| c != '\n' && broker_capabilities::error_text::is_unprintable(c)), "{text:?}");
            assert!(text.contains("\\u009b") && text.contains("\\u202e"), "{text}");
            assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), value);
        }
    }

    /// A room's grant is reported under its own key (as before rooms) and
    /// shown by its room, also from a daemon's JSON; a key this CLI does not
    /// know (a newer daemon's room) is shown as its JSON, escaped.
    #[test]
    fn a_rooms_grant_is_reported_and_shown_by_its_room() {
        let text = "name = \"x\"\ncomponent = \"x\"\n[grants]\nlocal-sockets = true\nlog = true\n";
        let manifest = Manifest::parse(std::path::Path::new("/p/provider.toml"), text).unwrap();
        let record: ProviderRecord = serde_json::from_value(serde_json::json!({
            "name": "x",
            "manifest": "/p/provider.toml",
            "component-sha256": "0".repeat(64),
            "version": "1",
            "added": "",
        }))
        .unwrap();
        let view = ProviderView::new(&record, &manifest);
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["grants"]["local-sockets"], true, "{json}");
        let mut from_daemon: ProviderView = serde_json::from_value(json).unwrap();
        assert_eq!(from_daemon, view);
        let shown = printed(|out| provider_details(out, &from_daemon));
        assert!(shown.lines().any(|l| l.split_whitespace().eq(["local-sockets", "granted"])), "{shown}");
        assert!(shown.lines().any(|l| l.split_whitespace().eq(["log", "granted"])), "{shown}");
        from_daemon.grants.rooms.insert(HOSTILE.into(), serde_json::json!(HOSTILE));
        assert_inert(&printed(|out| provider_details(out, &from_daemon)));
        let denied = Manifest::parse(std::path::Path::new("/p/provider.toml"), "name = \"x\"\ncomponent = \"x\"\n");
        let shown = printed(|out| provider_details(out, &ProviderView::new(&record, &denied.unwrap())));
        assert!(shown.lines().any(|l| l.split_whitespace().eq(["local-sockets", "denied"])), "{shown}");
    }

    /// Every grant the API reports has a line: the same lines as before rooms
    /// (process and paths, the two bridge lists, http), and a value of a
    /// shape this CLI cannot read (a newer daemon's) as its JSON, never left out.
    #[test]
    fn every_reported_grant_is_shown() {
        let text = "name = \"x\"\ncomponent = \"x\"\n[grants]\nprocess = [\"qemu-img\"]\npaths = [\"/srv/images\"]\n\
                    [grants.http]\nlxd = \"unix:/run/lxd.sock\"\n[grants.bridge]\ndevices = [\"eth0\"]\n";
        let manifest = Manifest::parse(std::path::Path::new("/p/provider.toml"), text).unwrap();
        let record: ProviderRecord = serde_json::from_value(serde_json::json!({
            "name": "x", "manifest": "/p/provider.toml", "component-sha256": "0".repeat(64), "version": "1", "added": "",
        }))
        .unwrap();
        let view = ProviderView::new(&record, &manifest);
        let json = serde_json::to_value(&view).unwrap();
        let keys: Vec<&str> = json["grants"].as_object().unwrap().keys().map(String::as_str).collect();
        let expected = [
            "bridge-attach-to",
            "bridge-bridges",
            "bridge-devices",
            "http",
            "kv",
            "local-sockets",
            "log",
            "machine-lock",
        ];
        assert_eq!(keys, [&expected[..], &["paths", "process"]].concat(), "the API's keys, as before rooms");
        let shown = printed(|out| provider_details(out, &view));
        for line in [
            &["kv", "denied"][..],
            &["process", "qemu-img"],
            &["paths", "/srv/images"],
            &["http", "lxd", "->", "unix:/run/lxd.sock"],
            &["bridge", "devices", "eth0"],
            &["bridge", "bridges", "denied"],
            &["bridge", "attach-to", "denied"],
        ] {
            assert!(shown.lines().any(|l| l.split_whitespace().eq(line.iter().copied())), "{line:?}: {shown}");
        }
        let mut newer = view.clone();
        newer.grants.rooms.insert("http".into(), serde_json::json!({"lxd": {"via": "tls"}}));
        let shown = printed(|out| provider_details(out, &newer));
        assert!(shown.contains(r#"http               {"lxd":{"via":"tls"}}"#), "{shown}");
    }

    #[test]
    fn provider_details_and_events_escape_what_providers_chose() {
        let manifest = Manifest::parse(std::path::Path::new("/p/provider.toml"), "name = \"x\"\ncomponent = \"x\"\n");
        // From JSON, as the store and the daemon give it (optional fields left out).
        let record: ProviderRecord = serde_json::from_value(serde_json::json!({
            "name": "x",
            "manifest": "/p/provider.toml",
            "component-sha256": "0".repeat(64),
            "version": HOSTILE,
            "added": "",
        }))
        .unwrap();
        let view = ProviderView::new(&record, &manifest.unwrap());
        assert_inert(&printed(|out| provider_details(out, &view)));
        assert_inert(&printed(|out| provider_table(out, std::slice::from_ref(&record))));
        // A corrupt stored hash is shown as far as it goes, not a panic.
        let short = ProviderRecord { component_sha256: "ab".into(), ..record.clone() };
        assert!(printed(|out| provider_table(out, &[short])).contains(" ab "));

        let mut event = broker_core::store::Event::new(broker_core::store::EventKind::SwapRefused, "x");
        event.new_version = Some(HOSTILE.into());
        event.detail = format!("validate-config failed: {HOSTILE}");
        let text = printed(|out| event_lines(out, &[event.clone()]));
        assert_inert(&text);
        assert_eq!(text.lines().count(), 1, "{text:?}");
        // A stored hash that is not hex (a corrupt store) is cut where the hex ends, not mid-character.
        event.new_sha256 = Some("abcd€€€€€".into());
        assert!(printed(|out| event_lines(out, &[event])).contains("(abcd)"));
    }
}
