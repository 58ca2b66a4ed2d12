//! Juju's constraint syntax: `mem=2G cores=2 arch=amd64 tags=a,b zones=z1,z2`.
//! Sizes take M/G/T/P suffixes (MiB without one); a key set twice or an unknown
//! key is an error naming it; an empty value leaves the constraint unset.

use crate::bindings::Constraints;

/// Why a constraints string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintsError {
    /// An item without `=`.
    #[error("malformed constraint {0:?}: expected key=value")]
    Malformed(String),
    /// A key Juju's syntax does not have.
    #[error("unknown constraint {0:?}")]
    UnknownKey(String),
    /// A key given twice (`cpu-cores` and `cores` are one key).
    #[error("bad {key:?} constraint: already set")]
    Duplicate {
        /// The key.
        key: String,
    },
    /// A value the key does not take.
    #[error("bad {key:?} constraint: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// What is wrong with the value.
        reason: String,
    },
}

/// Parse Juju's `key=value` constraints, separated by whitespace; an empty
/// string is no constraints.
pub fn parse(text: &str) -> Result<Constraints, ConstraintsError> {
    let mut c = empty();
    let mut seen: Vec<&str> = Vec::new();
    for item in text.split_whitespace() {
        let (key, value) = item.split_once('=').ok_or_else(|| ConstraintsError::Malformed(item.to_owned()))?;
        let key = if key == "cpu-cores" { "cores" } else { key };
        if seen.contains(&key) {
            return Err(ConstraintsError::Duplicate { key: key.to_owned() });
        }
        seen.push(key);
        let bad = |reason: String| ConstraintsError::BadValue { key: key.to_owned(), reason };
        let text = (!value.is_empty()).then(|| value.to_owned());
        let list = || (!value.is_empty()).then(|| value.split(',').map(str::to_owned).collect::<Vec<_>>());
        match key {
            "arch" => c.arch = text,
            "container" => c.container = text,
            "cores" => c.cores = parse_count(value).map_err(bad)?,
            "cpu-power" => c.cpu_power = parse_count(value).map_err(bad)?,
            "mem" => c.mem = parse_size(value).map_err(bad)?,
            "root-disk" => c.root_disk = parse_size(value).map_err(bad)?,
            "root-disk-source" => c.root_disk_source = text,
            "tags" => c.tags = list(),
            "instance-role" => c.instance_role = text,
            "instance-type" => c.instance_type = text,
            "spaces" => c.spaces = list(),
            "virt-type" => c.virt_type = text,
            "zones" => c.zones = list(),
            "allocate-public-ip" => c.allocate_public_ip = parse_bool(value).map_err(bad)?,
            "image-id" => c.image_id = text,
            other => return Err(ConstraintsError::UnknownKey(other.to_owned())),
        }
    }
    Ok(c)
}

/// No constraints at all.
pub fn empty() -> Constraints {
    Constraints {
        arch: None,
        container: None,
        cores: None,
        cpu_power: None,
        mem: None,
        root_disk: None,
        root_disk_source: None,
        tags: None,
        instance_role: None,
        instance_type: None,
        spaces: None,
        virt_type: None,
        zones: None,
        allocate_public_ip: None,
        image_id: None,
    }
}

fn parse_count(value: &str) -> Result<Option<u64>, String> {
    if value.is_empty() {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|_| format!("expected a non-negative integer, got {value:?}"))
}

fn parse_bool(value: &str) -> Result<Option<bool>, String> {
    match value {
        "" => Ok(None),
        "true" => Ok(Some(true)),
        "false" => Ok(Some(false)),
        _ => Err(format!("expected true or false, got {value:?}")),
    }
}

/// A size in MiB: `512`, `512M`, `2G`, `1.5T`, `1P`.
fn parse_size(value: &str) -> Result<Option<u64>, String> {
    if value.is_empty() {
        return Ok(None);
    }
    let (number, multiplier) = match value.char_indices().last() {
        Some((i, 'M')) => (&value[..i], 1.0),
        Some((i, 'G')) => (&value[..i], 1024.0),
        Some((i, 'T')) => (&value[..i], 1024.0 * 1024.0),
        Some((i, 'P')) => (&value[..i], 1024.0 * 1024.0 * 1024.0),
        _ => (value, 1.0),
    };
    let amount: f64 = number
        .parse()
        .map_err(|_| format!("must be a non-negative float with optional M/G/T/P suffix, got {value:?}"))?;
    if !amount.is_finite() || amount < 0.0 {
        return Err(format!("must be a non-negative float with optional M/G/T/P suffix, got {value:?}"));
    }
    Ok(Some((amount * multiplier).ceil() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzzed (bolero): any text made of the grammar's own tokens is
    /// constraints or an error, never a panic.
    #[test]
    fn fuzz_constraints_parse() {
        let tokens = [
            "mem=",
            "cores=",
            "cpu-cores=",
            "cpu-power=",
            "arch=",
            "tags=",
            "zones=",
            "root-disk=",
            "root-disk-source=",
            "instance-type=",
            "virt-type=",
            "container=",
            "spaces=",
            "allocate-public-ip=",
            "G",
            "M",
            "T",
            "P",
            "amd64",
            "true",
            "false",
            "^",
            "18446744073709551615",
            "-1",
            "1.5",
        ];
        bolero::check!().with_iterations(20_000).for_each(|bytes: &[u8]| {
            let _ = parse(&crate::fuzz_text::of(bytes, "abz019 ,.=-_^\u{e9}", &tokens));
        });
    }

    #[test]
    fn parses_the_issue_example() {
        let c = parse("mem=2G cores=2 arch=amd64 tags=a,b zones=z1,z2").unwrap();
        assert_eq!(c.mem, Some(2048));
        assert_eq!(c.cores, Some(2));
        assert_eq!(c.arch.as_deref(), Some("amd64"));
        assert_eq!(c.tags, Some(vec!["a".to_string(), "b".to_string()]));
        assert_eq!(c.zones, Some(vec!["z1".to_string(), "z2".to_string()]));
    }

    #[test]
    fn sizes_take_suffixes_in_mib() {
        assert_eq!(parse("mem=512").unwrap().mem, Some(512));
        assert_eq!(parse("mem=512M").unwrap().mem, Some(512));
        assert_eq!(parse("root-disk=1.5G").unwrap().root_disk, Some(1536));
        assert_eq!(parse("root-disk=1T").unwrap().root_disk, Some(1 << 20));
        assert_eq!(parse("mem=").unwrap().mem, None);
    }

    #[test]
    fn errors_name_the_key() {
        assert_eq!(parse("colour=red"), Err(ConstraintsError::UnknownKey("colour".into())));
        assert_eq!(parse("mem=1G mem=2G"), Err(ConstraintsError::Duplicate { key: "mem".into() }));
        assert_eq!(parse("cores=2 cpu-cores=4"), Err(ConstraintsError::Duplicate { key: "cores".into() }));
        assert!(parse("mem=lots").unwrap_err().to_string().contains("\"mem\""));
        assert!(matches!(parse("mem"), Err(ConstraintsError::Malformed(_))));
        assert!(parse("allocate-public-ip=maybe").is_err());
    }
}
