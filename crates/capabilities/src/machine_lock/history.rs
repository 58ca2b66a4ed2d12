//! The lock's history log: `YYYY-MM-DD HH:MM:SS agent: worker (comment), waited 1s, held 5s`,
//! rotated once it passes a size.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// The log is rotated to `<name>.log.1` past this size.
const ROTATE_BYTES: u64 = 1 << 20;

pub(crate) struct History {
    path: PathBuf,
}

/// Go's `time.Duration` text for whole seconds, as Juju prints them: `0s`, `5s`, `2m0s`, `1h0m0s`.
pub(crate) fn go_duration(d: Duration) -> String {
    let secs = d.as_secs_f64().round() as u64;
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
fn timestamp(at: SystemTime) -> String {
    let rfc3339 = humantime::format_rfc3339_seconds(at).to_string();
    rfc3339.trim_end_matches('Z').replacen('T', " ", 1)
}

pub(crate) fn line(at: SystemTime, agent: &str, holder: &str, waited: Duration, held: Duration) -> String {
    format!("{} {agent}: {holder}, waited {}, held {}", timestamp(at), go_duration(waited), go_duration(held))
}

impl History {
    pub(crate) fn new(path: PathBuf) -> History {
        History { path }
    }

    /// Append one line; failures are logged, never fatal to a release.
    pub(crate) fn append(&self, agent: &str, holder: &str, waited: Duration, held: Duration) {
        let text = line(SystemTime::now(), agent, holder, waited, held);
        if let Err(e) = self.try_append(&text) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot write machine lock history");
        }
    }

    fn try_append(&self, text: &str) -> std::io::Result<()> {
        if std::fs::metadata(&self.path).is_ok_and(|m| m.len() > ROTATE_BYTES) {
            let mut rotated = self.path.clone().into_os_string();
            rotated.push(".1");
            std::fs::rename(&self.path, rotated)?;
        }
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&self.path)?;
        writeln!(file, "{text}")
    }

    /// The last `n` lines, oldest first.
    pub(crate) fn tail(&self, n: usize) -> Vec<String> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].iter().map(|l| l.to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_as_go_does() {
        assert_eq!(go_duration(Duration::from_millis(400)), "0s");
        assert_eq!(go_duration(Duration::from_secs(5)), "5s");
        assert_eq!(go_duration(Duration::from_secs(120)), "2m0s");
        assert_eq!(go_duration(Duration::from_secs(3725)), "1h2m5s");
    }

    #[test]
    fn history_line_has_jujus_format() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            line(at, "broker", "uniter (run install hook)", Duration::from_secs(1), Duration::from_secs(5)),
            "2023-11-14 22:13:20 broker: uniter (run install hook), waited 1s, held 5s"
        );
    }

    #[test]
    fn rotates_past_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let history = History::new(dir.path().join("machine-lock.log"));
        std::fs::write(dir.path().join("machine-lock.log"), vec![b'x'; ROTATE_BYTES as usize + 1]).unwrap();
        history.append("a", "w", Duration::ZERO, Duration::ZERO);
        assert!(dir.path().join("machine-lock.log.1").exists());
        assert_eq!(history.tail(10).len(), 1);
    }
}
