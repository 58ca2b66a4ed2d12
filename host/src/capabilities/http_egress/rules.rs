//! What a signed grant's credential may be used for, checked before
//! anything leaves the host: the AWS Query actions allowed, a cap on
//! `MaxCount` (and `MinCount`) per `RunInstances`, and a tag every
//! `RunInstances` must carry on its instances in the same call.
//!
//! The request is read as the server will read it: the query string and a
//! form body together. A parameter given twice (in either, in any letter
//! case) is refused, so the host never checks one value and the server
//! acts on another; a body that is not a form is refused when rules apply.

use std::collections::BTreeMap;

/// The largest request body the host reads to check and sign.
pub const MAX_SIGNED_BODY: usize = 4 << 20;

/// A grant's rules (all optional; none: anything the credential can do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    /// The `Action`s allowed; empty: any.
    pub actions: Vec<String>,
    /// The most instances one `RunInstances` may ask for.
    pub max_count: Option<u32>,
    /// `(key, value)`: a tag every `RunInstances` must put on its instances.
    pub require_tag: Option<(String, String)>,
}

/// A request the rules refuse: nothing was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("refused by the grant's rule `{rule}`: {reason}")]
pub struct Refused {
    /// The grant key that refused it (`actions`, `max-count`, `require-tag`, …).
    pub rule: &'static str,
    /// Why, naming the request's own values.
    pub reason: String,
}

fn refused(rule: &'static str, reason: impl Into<String>) -> Refused {
    Refused { rule, reason: reason.into() }
}

impl Rules {
    /// Whether any rule is set (then every request is read and checked).
    pub fn any(&self) -> bool {
        !self.actions.is_empty() || self.max_count.is_some() || self.require_tag.is_some()
    }

    /// Check one request: its query string and its body (a form, or empty).
    pub fn check(&self, query: Option<&str>, content_type: Option<&str>, body: &[u8]) -> Result<(), Refused> {
        if !self.any() {
            return Ok(());
        }
        let form = content_type.is_some_and(|t| {
            t.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/x-www-form-urlencoded"))
        });
        if !body.is_empty() && !form {
            return Err(refused("actions", "the body is not an AWS Query form (application/x-www-form-urlencoded)"));
        }
        let mut params: BTreeMap<String, String> = BTreeMap::new();
        let mut seen = std::collections::BTreeSet::new();
        let pairs = form_urlencoded::parse(query.unwrap_or_default().as_bytes()).chain(form_urlencoded::parse(body));
        for (key, value) in pairs {
            if !seen.insert(key.to_ascii_lowercase()) {
                return Err(refused("actions", format!("parameter {key:?} is given more than once")));
            }
            params.insert(key.into_owned(), value.into_owned());
        }
        let action = params.get("Action").ok_or_else(|| refused("actions", "the request names no Action"))?;
        if !self.actions.is_empty() && !self.actions.iter().any(|allowed| allowed == action) {
            return Err(refused("actions", format!("Action {action:?} is not among {:?}", self.actions)));
        }
        if action == "RunInstances" {
            self.check_run_instances(&params)?;
        }
        Ok(())
    }

    fn check_run_instances(&self, params: &BTreeMap<String, String>) -> Result<(), Refused> {
        if let Some(cap) = self.max_count {
            for key in ["MaxCount", "MinCount"] {
                let value =
                    params.get(key).ok_or_else(|| refused("max-count", format!("RunInstances without {key}")))?;
                let count: u64 = value
                    .trim()
                    .parse()
                    .map_err(|_| refused("max-count", format!("{key} {value:?} is not a count")))?;
                if count > u64::from(cap) {
                    return Err(refused("max-count", format!("{key} {count} is over the grant's {cap}")));
                }
            }
        }
        if let Some((key, value)) = &self.require_tag
            && !tags_instances_with(params, key, value)
        {
            return Err(refused(
                "require-tag",
                format!(
                    "RunInstances must tag its instances {key}={value} in a TagSpecification of ResourceType instance"
                ),
            ));
        }
        Ok(())
    }
}

/// Whether a `TagSpecification.N` of `ResourceType=instance` has a
/// `Tag.M` with `key` and `value`.
fn tags_instances_with(params: &BTreeMap<String, String>, key: &str, value: &str) -> bool {
    params.iter().any(|(name, resource)| {
        let Some(spec) = name.strip_prefix("TagSpecification.").and_then(|r| r.strip_suffix(".ResourceType")) else {
            return false;
        };
        resource == "instance"
            && params.iter().any(|(tag, tag_key)| {
                let Some(n) =
                    tag.strip_prefix(&format!("TagSpecification.{spec}.Tag.")).and_then(|r| r.strip_suffix(".Key"))
                else {
                    return false;
                };
                tag_key == key
                    && params.get(&format!("TagSpecification.{spec}.Tag.{n}.Value")).map(String::as_str) == Some(value)
            })
    })
}

/// `k=v` as the grant writes `require-tag`.
pub fn parse_tag(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("require-tag {text:?} must be key=value")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: Option<&str> = Some("application/x-www-form-urlencoded; charset=utf-8");

    fn rules() -> Rules {
        Rules {
            actions: vec!["RunInstances".into(), "DescribeInstances".into()],
            max_count: Some(5),
            require_tag: Some(("broker-namespace".into(), "ns1".into())),
        }
    }

    fn run(extra: &str) -> String {
        format!(
            "Action=RunInstances&Version=2016-11-15&ImageId=ami-1&MinCount=1&MaxCount=3\
             &TagSpecification.1.ResourceType=instance&TagSpecification.1.Tag.1.Key=broker-namespace\
             &TagSpecification.1.Tag.1.Value=ns1{extra}"
        )
    }

    #[test]
    fn a_request_within_the_rules_passes_and_each_rule_refuses_by_name() {
        let rules = rules();
        assert_eq!(rules.check(None, FORM, run("").as_bytes()), Ok(()));
        assert_eq!(rules.check(Some("Action=DescribeInstances&Version=2016-11-15"), None, b""), Ok(()));
        let rule = |query: Option<&str>, body: &str| rules.check(query, FORM, body.as_bytes()).unwrap_err().rule;
        assert_eq!(rule(None, "Action=TerminateInstances&InstanceId.1=i-1"), "actions");
        assert_eq!(rule(None, &run("").replace("MaxCount=3", "MaxCount=6")), "max-count");
        assert_eq!(rule(None, &run("").replace("MinCount=1", "MinCount=99")), "max-count");
        assert_eq!(rule(None, &run("").replace("&MaxCount=3", "")), "max-count");
        assert_eq!(rule(None, &run("").replace("Value=ns1", "Value=ns2")), "require-tag");
        assert_eq!(rule(None, &run("").replace("ResourceType=instance", "ResourceType=volume")), "require-tag");
        assert_eq!(rule(None, "Version=2016-11-15"), "actions");
    }

    #[test]
    fn a_parameter_given_twice_or_a_body_that_is_not_a_form_is_refused() {
        let rules = rules();
        // The server might act on the second Action, or the query's.
        let twice = run("&Action=TerminateInstances");
        assert!(rules.check(None, FORM, twice.as_bytes()).unwrap_err().reason.contains("more than once"));
        let split = rules.check(Some("Action=TerminateInstances"), FORM, run("").as_bytes()).unwrap_err();
        assert!(split.reason.contains("more than once"), "{split}");
        let cased = rules.check(None, FORM, run("&maxcount=50").as_bytes()).unwrap_err();
        assert!(cased.reason.contains("more than once"), "{cased}");
        let json = rules.check(None, Some("application/json"), b"{\"Action\":\"RunInstances\"}").unwrap_err();
        assert!(json.reason.contains("not an AWS Query form"), "{json}");
        // Encoded keys are read as the server reads them.
        let encoded = run("").replace("MaxCount=3", "Max%43ount=60");
        assert_eq!(rules.check(None, FORM, encoded.as_bytes()).unwrap_err().rule, "max-count");
        // Without rules, nothing is read.
        assert_eq!(Rules::default().check(None, Some("application/json"), b"{}"), Ok(()));
    }
}
