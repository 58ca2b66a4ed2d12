//! The provider config (the manifest's `[config]`, as JSON).

use crate::KvmError;
use serde::{Deserialize, Serialize};

/// How qemu accelerates: KVM when `/dev/kvm` is usable, else TCG (`auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Accel {
    #[default]
    Auto,
    Kvm,
    Tcg,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    /// This host's namespace: VM names are `juju-<namespace>-<machine>`, and
    /// only VMs with that prefix are this host's.
    pub namespace: String,
    /// Granted program names.
    #[serde(default = "default_qemu")]
    pub qemu: String,
    #[serde(default = "default_qemu_img")]
    pub qemu_img: String,
    /// Builds the NoCloud seed ISO.
    #[serde(default = "default_iso_builder")]
    pub iso_builder: String,
    /// Backing image for each VM's qcow2 overlay (a granted path).
    #[serde(default)]
    pub base_image: Option<String>,
    #[serde(default = "default_base_format")]
    pub base_format: String,
    /// Direct kernel boot (granted paths), instead of or besides a base image.
    #[serde(default)]
    pub kernel: Option<String>,
    #[serde(default)]
    pub initrd: Option<String>,
    #[serde(default)]
    pub append: Option<String>,
    #[serde(default)]
    pub accel: Accel,
    /// What this host can give one VM; more is a constraint it cannot meet.
    #[serde(default = "default_max_mem")]
    pub max_mem: u64,
    #[serde(default = "default_max_cores")]
    pub max_cores: u64,
    #[serde(default = "default_max_root_disk")]
    pub max_root_disk: u64,
    /// How long `stop-instances` waits after an ACPI powerdown before quitting qemu.
    #[serde(default = "default_stop_grace_ms")]
    pub stop_grace_ms: u64,
}

fn default_qemu() -> String {
    "qemu-system-x86_64".into()
}
fn default_qemu_img() -> String {
    "qemu-img".into()
}
fn default_iso_builder() -> String {
    "genisoimage".into()
}
fn default_base_format() -> String {
    "qcow2".into()
}
fn default_max_mem() -> u64 {
    16 * 1024
}
fn default_max_cores() -> u64 {
    8
}
fn default_max_root_disk() -> u64 {
    512 * 1024
}
fn default_stop_grace_ms() -> u64 {
    10_000
}

/// Longest namespace: the name must fit a 64-character child name with the machine id.
pub const MAX_NAMESPACE: usize = 16;

fn invalid(message: String) -> KvmError {
    KvmError::InvalidParams(message)
}

fn check_path(field: &str, value: &Option<String>) -> Result<(), KvmError> {
    match value {
        Some(path) if !path.starts_with('/') || path.split('/').any(|part| part == "..") => {
            Err(invalid(format!("{field} must be an absolute path without '..', got {path:?}")))
        }
        _ => Ok(()),
    }
}

impl Config {
    pub fn parse(json: &str) -> Result<Config, KvmError> {
        let config: Config = serde_json::from_str(json).map_err(|e| invalid(format!("kvm provider config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), KvmError> {
        let ns = &self.namespace;
        let ns_ok = !ns.is_empty()
            && ns.len() <= MAX_NAMESPACE
            && ns.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !ns.starts_with('-')
            && !ns.ends_with('-');
        if !ns_ok {
            return Err(invalid(format!(
                "namespace {ns:?} must be 1-{MAX_NAMESPACE} lowercase letters, digits or inner '-'"
            )));
        }
        check_path("base-image", &self.base_image)?;
        check_path("kernel", &self.kernel)?;
        check_path("initrd", &self.initrd)?;
        if self.initrd.is_some() && self.kernel.is_none() {
            return Err(invalid("initrd is set without a kernel".into()));
        }
        if !matches!(self.base_format.as_str(), "qcow2" | "raw") {
            return Err(invalid(format!("base-format must be qcow2 or raw, got {:?}", self.base_format)));
        }
        if self.max_mem < crate::spec::MIN_MEM || self.max_root_disk < crate::spec::MIN_ROOT_DISK || self.max_cores == 0
        {
            return Err(invalid("max-mem, max-cores and max-root-disk must allow at least the minimum VM".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_refusals() {
        let config = Config::parse(r#"{"namespace":"ns1","kernel":"/boot/vmlinuz"}"#).unwrap();
        assert_eq!(config.qemu, "qemu-system-x86_64");
        assert_eq!(config.accel, Accel::Auto);
        assert_eq!(config.max_cores, 8);
        for (json, needle) in [
            (r#"{}"#, "namespace"),
            (r#"{"namespace":"Bad_NS"}"#, "namespace"),
            (r#"{"namespace":"a","kernel":"rel/path"}"#, "kernel must be an absolute path"),
            (r#"{"namespace":"a","base-image":"/x/../etc"}"#, "base-image"),
            (r#"{"namespace":"a","initrd":"/i"}"#, "initrd is set without a kernel"),
            (r#"{"namespace":"a","accel":"hvf"}"#, "unknown variant"),
            (r#"{"namespace":"a","colour":"red"}"#, "unknown field"),
            (r#"{"namespace":"a","max-mem":100}"#, "minimum VM"),
            ("not json", "kvm provider config"),
        ] {
            let err = Config::parse(json).unwrap_err();
            assert!(matches!(&err, KvmError::InvalidParams(m) if m.contains(needle)), "{json}: {err:?}");
        }
    }
}
