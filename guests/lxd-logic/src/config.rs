//! The provider config (the manifest's `[config]`, as JSON).

use crate::LxdError;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    /// This host's namespace: containers are `juju-<namespace>-<machine>`, and
    /// only containers with that prefix are this host's.
    pub namespace: String,
    /// The `wasi:http` authority the manifest grants for the LXD/Incus socket.
    #[serde(default = "default_authority")]
    pub authority: String,
    #[serde(default = "default_name")]
    pub project: String,
    /// Pool of the root disk device, when a root-disk size is asked for.
    #[serde(default = "default_name")]
    pub storage_pool: String,
    /// The profile every container gets first (charm profiles follow it).
    #[serde(default = "default_name")]
    pub profile: String,
    /// Image alias used when the image metadata names none.
    #[serde(default)]
    pub image_alias: Option<String>,
    /// Juju's fallback: with no network info, one NIC bridged to this (e.g.
    /// `lxdbr0`); unset, such a container has only its profile's NICs.
    #[serde(default)]
    pub default_bridge: Option<String>,
    /// How long to wait on one LXD operation (create, start, stop, delete).
    #[serde(default = "default_operation_timeout_s")]
    pub operation_timeout_s: u64,
}

fn default_authority() -> String {
    "lxd".into()
}
fn default_name() -> String {
    "default".into()
}
fn default_operation_timeout_s() -> u64 {
    120
}

/// Longest namespace: `juju-<namespace>-<machine>` must stay a short hostname.
pub const MAX_NAMESPACE: usize = 16;

fn invalid(message: String) -> LxdError {
    LxdError::InvalidParams(message)
}

/// LXD names (projects, pools, profiles, aliases) go into URL paths and queries.
fn check_name(field: &str, value: &str) -> Result<(), LxdError> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !value.starts_with('.');
    if ok { Ok(()) } else { Err(invalid(format!("{field} {value:?} must be 1-63 letters, digits, '-', '_' or '.'"))) }
}

impl Config {
    pub fn parse(json: &str) -> Result<Config, LxdError> {
        let config: Config = serde_json::from_str(json).map_err(|e| invalid(format!("lxd provider config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), LxdError> {
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
        let authority_ok = !self.authority.is_empty()
            && self.authority.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'));
        if !authority_ok {
            return Err(invalid(format!(
                "authority {:?} must be the granted http authority (lowercase letters, digits, '-', '.')",
                self.authority
            )));
        }
        check_name("project", &self.project)?;
        check_name("storage-pool", &self.storage_pool)?;
        check_name("profile", &self.profile)?;
        if let Some(alias) = &self.image_alias {
            check_name("image-alias", alias)?;
        }
        if let Some(bridge) = &self.default_bridge
            && (bridge.is_empty() || bridge.len() > 15 || bridge.contains(['/', ' ']))
        {
            return Err(invalid(format!("default-bridge {bridge:?} is not a network device name")));
        }
        if self.operation_timeout_s == 0 || self.operation_timeout_s > 3600 {
            return Err(invalid("operation-timeout-s must be between 1 and 3600".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_refusals() {
        let c = Config::parse(r#"{"namespace":"host0"}"#).unwrap();
        assert_eq!((c.authority.as_str(), c.project.as_str(), c.profile.as_str()), ("lxd", "default", "default"));
        for (json, needle) in [
            (r#"{}"#, "namespace"),
            (r#"{"namespace":"Host"}"#, "namespace"),
            (r#"{"namespace":"h","project":"a/b"}"#, "project"),
            (r#"{"namespace":"h","storage-pool":""}"#, "storage-pool"),
            (r#"{"namespace":"h","profile":"x?y"}"#, "profile"),
            (r#"{"namespace":"h","authority":"unix:/x"}"#, "authority"),
            (r#"{"namespace":"h","image-alias":"a b"}"#, "image-alias"),
            (r#"{"namespace":"h","default-bridge":"a-very-long-bridge"}"#, "default-bridge"),
            (r#"{"namespace":"h","operation-timeout-s":0}"#, "operation-timeout-s"),
            (r#"{"namespace":"h","sockets":true}"#, "unknown field"),
            ("garbage", "lxd provider config"),
        ] {
            let err = Config::parse(json).unwrap_err().to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
