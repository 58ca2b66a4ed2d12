//! The provider config (the manifest's `[config]`, as JSON). It holds no
//! credential: the host signs for the grant named by `authority`.

use crate::Ec2Error;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    /// This host's namespace: every instance carries the tag
    /// `<tag-key>=<namespace>`, and only instances carrying it are this host's.
    pub namespace: String,
    /// The region the grant's endpoint serves (image metadata is matched on it).
    pub region: String,
    /// The `wasi:http` authority the manifest grants for the EC2 endpoint.
    #[serde(default = "default_authority")]
    pub authority: String,
    /// The tag key that marks this namespace's instances.
    #[serde(default = "default_tag_key")]
    pub tag_key: String,
    /// Images by architecture, used when the image metadata has none for the region.
    #[serde(default)]
    pub images: BTreeMap<String, String>,
    /// The architecture asked for when the constraints name none.
    #[serde(default = "default_arch")]
    pub default_arch: String,
    /// The subnet every instance goes in; `zones` must then name its one zone.
    #[serde(default)]
    pub subnet_id: Option<String>,
    #[serde(default)]
    pub security_group_ids: Vec<String>,
    #[serde(default)]
    pub key_name: Option<String>,
    /// The zones this host may use; empty: every zone the region offers.
    #[serde(default)]
    pub zones: Vec<String>,
    /// How long a start waits for the instance to be `running`.
    #[serde(default = "default_wait_running_s")]
    pub wait_running_s: u64,
    /// How long to wait for one EC2 answer.
    #[serde(default = "default_request_timeout_s")]
    pub request_timeout_s: u64,
    /// Instances per `DescribeInstances` page (EC2 takes 5-1000).
    #[serde(default = "default_describe_page_size")]
    pub describe_page_size: u32,
}

fn default_authority() -> String {
    "ec2".into()
}
fn default_tag_key() -> String {
    "broker-namespace".into()
}
fn default_arch() -> String {
    "amd64".into()
}
fn default_wait_running_s() -> u64 {
    300
}
fn default_request_timeout_s() -> u64 {
    30
}
fn default_describe_page_size() -> u32 {
    1000
}

fn invalid(message: String) -> Ec2Error {
    Ec2Error::InvalidParams(message)
}

/// EC2 resource ids and names go into form values; keep them plain.
fn check_word(field: &str, value: &str, max: usize) -> Result<(), Ec2Error> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/'));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!("config: {field} {value:?} must be 1-{max} letters, digits, '-', '_', '.', ':' or '/'")))
    }
}

pub const ARCHES: [&str; 2] = ["amd64", "arm64"];

impl Config {
    pub fn parse(json: &str) -> Result<Config, Ec2Error> {
        let config: Config = serde_json::from_str(json).map_err(|e| invalid(format!("config: {e}")))?;
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), Ec2Error> {
        check_word("namespace", &self.namespace, 64)?;
        check_word("region", &self.region, 32)?;
        check_word("authority", &self.authority, 64)?;
        check_word("tag-key", &self.tag_key, 127)?;
        if self.tag_key.starts_with("aws:") {
            return Err(invalid("config: tag-key must not start with \"aws:\" (reserved by AWS)".into()));
        }
        for (arch, image) in &self.images {
            if !ARCHES.contains(&arch.as_str()) {
                return Err(invalid(format!("config: images: unknown architecture {arch:?} (one of {ARCHES:?})")));
            }
            check_word("images", image, 64)?;
        }
        if !ARCHES.contains(&self.default_arch.as_str()) {
            return Err(invalid(format!("config: default-arch {:?} is not one of {ARCHES:?}", self.default_arch)));
        }
        for (field, value) in [("subnet-id", &self.subnet_id), ("key-name", &self.key_name)] {
            if let Some(value) = value {
                check_word(field, value, 255)?;
            }
        }
        for group in &self.security_group_ids {
            check_word("security-group-ids", group, 64)?;
        }
        for zone in &self.zones {
            check_word("zones", zone, 64)?;
        }
        // A subnet lives in one zone: every start must go there.
        if self.subnet_id.is_some() && self.zones.len() != 1 {
            return Err(invalid(
                "config: subnet-id needs zones = [the subnet's zone] (a subnet lives in one zone)".into(),
            ));
        }
        if !(1..=3600).contains(&self.wait_running_s) {
            return Err(invalid("config: wait-running-s must be 1-3600".into()));
        }
        if !(5..=1000).contains(&self.describe_page_size) {
            return Err(invalid("config: describe-page-size must be 5-1000 (EC2's own bounds)".into()));
        }
        if !(1..=600).contains(&self.request_timeout_s) {
            return Err(invalid("config: request-timeout-s must be 1-600".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_config_gets_defaults() {
        let c = Config::parse(r#"{"namespace":"host0","region":"us-east-1"}"#).unwrap();
        assert_eq!(
            (c.authority.as_str(), c.tag_key.as_str(), c.default_arch.as_str()),
            ("ec2", "broker-namespace", "amd64")
        );
        assert_eq!(c.wait_running_s, 300);
    }

    #[test]
    fn bad_configs_say_which_field() {
        for (json, needle) in [
            (r#"{"region":"us-east-1"}"#, "namespace"),
            (r#"{"namespace":"h","region":"us-east-1","secret-key":"x"}"#, "unknown field `secret-key`"),
            (r#"{"namespace":"h a","region":"us-east-1"}"#, "namespace"),
            (r#"{"namespace":"h","region":"us-east-1","tag-key":"aws:x"}"#, "aws:"),
            (r#"{"namespace":"h","region":"us-east-1","images":{"sparc":"ami-1"}}"#, "sparc"),
            (r#"{"namespace":"h","region":"us-east-1","default-arch":"s390x"}"#, "default-arch"),
            (r#"{"namespace":"h","region":"us-east-1","zones":["a&b"]}"#, "zones"),
            (r#"{"namespace":"h","region":"us-east-1","wait-running-s":0}"#, "wait-running-s"),
            (r#"{"namespace":"h","region":"us-east-1","subnet-id":"subnet-1"}"#, "subnet's zone"),
            (r#"{"namespace":"h","region":"us-east-1","describe-page-size":4}"#, "describe-page-size"),
        ] {
            let Err(Ec2Error::InvalidParams(message)) = Config::parse(json) else { panic!("{json} accepted") };
            assert!(message.contains(needle), "{json}: {message}");
        }
    }
}
