//! What the host remembers about providers and instances.

use broker_capabilities::bindings::{HardwareCharacteristics, InstanceStatus, StartInstanceParams};
use serde::{Deserialize, Serialize};

/// A registered provider: where its manifest is, and what it was when added.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ProviderRecord {
    /// The provider's name, from its manifest; the key it is registered under.
    pub name: String,
    /// Absolute path of the manifest.
    pub manifest: String,
    /// sha256 of the component serving now, hex.
    pub component_sha256: String,
    /// The version its component's `describe` reported when added or swapped in.
    pub version: String,
    /// When it was added, RFC 3339, UTC.
    pub added: String,
    /// A component swapped in (`broker provider swap`), kept in the data dir; it
    /// replaces the manifest's `component` until the provider is re-added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component: Option<String>,
    /// The manifest's text as the operator last added it: what its grants may
    /// not exceed when the host loads it again (a file changed since is refused
    /// if it widens them, until added again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_manifest: Option<String>,
}

/// Hardware with Juju's names and units (MiB); absent = unknown.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Hardware {
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Architecture, as Juju names it (`amd64`).
    pub arch: Option<String>,
    /// Memory, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem: Option<u64>,
    /// Root disk size, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_disk: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Where the root disk lives (a pool or storage name), as the provider says.
    pub root_disk_source: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Number of CPU cores.
    pub cpu_cores: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// CPU power in Juju's units (100 = one core of a reference machine).
    pub cpu_power: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Tags the instance's hardware was matched on.
    pub tags: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// The zone it runs in.
    pub availability_zone: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// How it is virtualised (`container`, `virtual-machine`).
    pub virt_type: Option<String>,
}

/// Longest text a record keeps of what a provider reported (a name, a zone, an address).
pub(crate) const MAX_REPORTED_WORD_BYTES: usize = 256;
/// Longest status message a record keeps.
pub(crate) const MAX_REPORTED_MESSAGE_BYTES: usize = 4096;
/// Most list entries (tags, addresses) a record keeps.
pub(crate) const MAX_REPORTED_ENTRIES: usize = 64;

/// `text` cut to `max` bytes on a character boundary: a record keeps at
/// most this of what a provider reported (it is held, listed and stored).
pub fn reported(text: &str, max: usize) -> String {
    broker_capabilities::rooms::log::truncate(text, max).to_owned()
}

impl From<&HardwareCharacteristics> for Hardware {
    /// Cut to the record's bounds: the provider chose every byte.
    fn from(h: &HardwareCharacteristics) -> Self {
        let word = |w: &Option<String>| w.as_deref().map(|w| reported(w, MAX_REPORTED_WORD_BYTES));
        Hardware {
            arch: word(&h.arch),
            mem: h.mem,
            root_disk: h.root_disk,
            root_disk_source: word(&h.root_disk_source),
            cpu_cores: h.cpu_cores,
            cpu_power: h.cpu_power,
            tags: h.tags.as_ref().map(|tags| {
                tags.iter().take(MAX_REPORTED_ENTRIES).map(|t| reported(t, MAX_REPORTED_WORD_BYTES)).collect()
            }),
            availability_zone: word(&h.availability_zone),
            virt_type: word(&h.virt_type),
        }
    }
}

impl Hardware {
    /// Juju's text form: `arch=amd64 cores=2 mem=2048M …`.
    pub fn juju_text(&self) -> String {
        let mut parts = Vec::new();
        if let Some(v) = &self.arch {
            parts.push(format!("arch={v}"));
        }
        if let Some(v) = self.cpu_cores {
            parts.push(format!("cores={v}"));
        }
        if let Some(v) = self.cpu_power {
            parts.push(format!("cpu-power={v}"));
        }
        if let Some(v) = self.mem {
            parts.push(format!("mem={v}M"));
        }
        if let Some(v) = self.root_disk {
            parts.push(format!("root-disk={v}M"));
        }
        if let Some(v) = &self.root_disk_source {
            parts.push(format!("root-disk-source={v}"));
        }
        if let Some(v) = &self.tags {
            parts.push(format!("tags={}", v.join(",")));
        }
        if let Some(v) = &self.availability_zone {
            parts.push(format!("availability-zone={v}"));
        }
        if let Some(v) = &self.virt_type {
            parts.push(format!("virt-type={v}"));
        }
        parts.join(" ")
    }
}

/// Lower-case names of instance statuses, as the CLI and API show them.
pub fn status_name(status: InstanceStatus) -> &'static str {
    match status {
        InstanceStatus::Pending => "pending",
        InstanceStatus::Allocating => "allocating",
        InstanceStatus::Provisioning => "provisioning",
        InstanceStatus::Running => "running",
        InstanceStatus::ProvisioningError => "provisioning-error",
        InstanceStatus::Stopping => "stopping",
        InstanceStatus::Stopped => "stopped",
        InstanceStatus::Error => "error",
        InstanceStatus::Unknown => "unknown",
    }
}

/// The status [`status_name`] calls `name`.
pub fn status_from_name(name: &str) -> Option<InstanceStatus> {
    const ALL: [InstanceStatus; 9] = [
        InstanceStatus::Pending,
        InstanceStatus::Allocating,
        InstanceStatus::Provisioning,
        InstanceStatus::Running,
        InstanceStatus::ProvisioningError,
        InstanceStatus::Stopping,
        InstanceStatus::Stopped,
        InstanceStatus::Error,
        InstanceStatus::Unknown,
    ];
    ALL.into_iter().find(|status| status_name(*status) == name)
}

/// The host's record of an instance it started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct InstanceRecord {
    /// The provider's id for it; unique across the host.
    pub id: String,
    /// The provider that started it.
    pub provider: String,
    /// Last known status, as [`status_name`] spells it (`running`).
    pub status: String,
    /// The provider's word on the status; may be empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The provider's name for it, for people; may be empty.
    pub display_name: String,
    /// What the provider reported it got.
    pub hardware: Hardware,
    /// Tags the provider gave it.
    pub tags: Vec<String>,
    /// Its addresses, as the provider reported them.
    pub addresses: Vec<String>,
    /// RFC 3339, UTC.
    pub created: String,
    /// The instance config's tags it was started with (`infrakit.group`, …):
    /// what a group knows its members by.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub instance_tags: std::collections::BTreeMap<String, String>,
    /// The params it was started with, replayed by `maintain-instance`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Boxed: most records in hand (a listing's) have none, and a record
    /// moves through joins and sorts.
    pub params: Option<Box<StartInstanceParams>>,
}

/// Of an instance record, only the start params a record from before their
/// own table holds inline: every other field skipped unread.
#[derive(Deserialize)]
pub(crate) struct InlineParams {
    /// Decoded apart, so that params that do not are that instance's error.
    #[serde(default)]
    pub(crate) params: Option<serde_json::Value>,
}

/// An instance record as a listing reads it: every field but the start
/// params, which only `maintain-instance` needs (they are most of a record's
/// bytes, and of the time to decode it), skipped unread.
#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct ListedRecord {
    id: String,
    provider: String,
    status: String,
    #[serde(default)]
    message: String,
    display_name: String,
    hardware: Hardware,
    tags: Vec<String>,
    addresses: Vec<String>,
    created: String,
    #[serde(default)]
    instance_tags: std::collections::BTreeMap<String, String>,
}

impl From<ListedRecord> for InstanceRecord {
    fn from(listed: ListedRecord) -> InstanceRecord {
        let ListedRecord {
            id,
            provider,
            status,
            message,
            display_name,
            hardware,
            tags,
            addresses,
            created,
            instance_tags,
        } = listed;
        InstanceRecord {
            id,
            provider,
            status,
            message,
            display_name,
            hardware,
            tags,
            addresses,
            created,
            instance_tags,
            params: None,
        }
    }
}

/// A component hash as tables, messages and metric labels show it: its first
/// 12 hex digits. A stored hash that is short or not hex (a corrupt store, a
/// garbage answer) shows the hex it starts with instead of panicking.
pub fn short_sha256(hash: &str) -> &str {
    let hex = hash.bytes().take(12).take_while(u8::is_ascii_hexdigit).count();
    &hash[..hex]
}

/// The longest instance id the host takes from a provider, in bytes.
pub(crate) const MAX_INSTANCE_ID_BYTES: usize = 255;

/// Why the host refuses an instance id a provider returned, if it does: an id
/// is recorded, printed and passed back on the command line, so it must be
/// 1 to 255 bytes with no whitespace and no control characters.
pub(crate) fn instance_id_problem(id: &str) -> Option<String> {
    if id.is_empty() {
        return Some("it is empty".into());
    }
    if id.len() > MAX_INSTANCE_ID_BYTES {
        return Some(format!("it is {} bytes long; at most {MAX_INSTANCE_ID_BYTES} are allowed", id.len()));
    }
    let (at, c) =
        id.char_indices().find(|(_, c)| c.is_whitespace() || broker_capabilities::error_text::is_unprintable(*c))?;
    let kind = if broker_capabilities::error_text::is_unprintable(c) { "control character" } else { "whitespace" };
    Some(format!("it has the {kind} U+{:04X} at byte {at}; ids must be printable without whitespace", c as u32))
}

/// An id as an error or warning quotes it: control characters escaped, and
/// only its first 64 characters when it is longer.
pub fn id_for_message(id: &str) -> String {
    const SHOWN: usize = 64;
    match id.char_indices().nth(SHOWN) {
        None => format!("\"{}\"", broker_capabilities::error_text::escape_unprintable(id)),
        Some((cut, _)) => {
            format!("\"{}\"… ({} bytes)", broker_capabilities::error_text::escape_unprintable(&id[..cut]), id.len())
        }
    }
}

/// The host network as last observed after bridging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObservedNetwork {
    /// RFC 3339, UTC.
    pub observed: String,
    /// The devices and bridges found.
    pub devices: Vec<broker_capabilities::network::Device>,
}

/// Now, as RFC 3339 UTC with seconds.
pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hardware_uses_juju_names_and_omits_unknowns() {
        let hw = Hardware { arch: Some("amd64".into()), mem: Some(2048), cpu_cores: Some(2), ..Default::default() };
        let json = serde_json::to_value(&hw).unwrap();
        assert_eq!(json, serde_json::json!({"arch": "amd64", "mem": 2048, "cpu-cores": 2}));
        assert_eq!(hw.juju_text(), "arch=amd64 cores=2 mem=2048M");
    }

    #[test]
    fn every_status_name_reads_back_and_nothing_else_does() {
        for name in ["pending", "allocating", "provisioning", "running", "provisioning-error"] {
            assert_eq!(status_from_name(name).map(status_name), Some(name));
        }
        for name in ["stopping", "stopped", "error", "unknown"] {
            assert_eq!(status_from_name(name).map(status_name), Some(name));
        }
        assert_eq!(status_from_name("Running"), None);
        assert_eq!(status_from_name(""), None);
    }

    #[test]
    fn instance_ids_must_be_printable_without_whitespace_and_bounded() {
        for good in ["fake-0", "juju-4f2a-machine-1", "vm:ü/1", &"x".repeat(MAX_INSTANCE_ID_BYTES)] {
            assert_eq!(instance_id_problem(good), None, "{good}");
        }
        let cases = [
            ("", "empty"),
            ("\x1b[2J\n", "control character U+001B at byte 0"),
            ("a\nb", "control character U+000A at byte 1"),
            ("a b", "whitespace U+0020 at byte 1"),
            ("a\u{a0}b", "whitespace U+00A0"),
            ("a\x7f", "control character U+007F"),
            ("a\u{85}", "control character U+0085"),
            ("a\u{202e}b", "control character U+202E"),
        ];
        for (bad, why) in cases {
            let problem = instance_id_problem(bad).unwrap_or_default();
            assert!(problem.contains(why), "{bad:?}: {problem}");
        }
        let long = instance_id_problem(&"x".repeat(MAX_INSTANCE_ID_BYTES + 1)).unwrap_or_default();
        assert!(long.contains("256 bytes long; at most 255"), "{long}");
        assert_eq!(id_for_message("\x1b[2J\n"), r#""\x1b[2J\n""#);
        assert_eq!(id_for_message(&"x".repeat(1 << 20)), format!("\"{}\"… (1048576 bytes)", "x".repeat(64)));
    }

    #[test]
    fn a_short_or_corrupt_hash_is_shown_as_far_as_it_is_hex() {
        assert_eq!(super::short_sha256(&"ab".repeat(32)), "abababababab");
        assert_eq!(super::short_sha256("abc"), "abc");
        assert_eq!(super::short_sha256(""), "");
        assert_eq!(super::short_sha256("12\"}\n€456789abcdef"), "12");
        assert_eq!(super::short_sha256("€"), "");
    }
}
