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
pub(crate) const MAX_SIGNED_BODY: usize = 4 << 20;

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

/// The most parameters a checked request may carry.
const MAX_PARAMETERS: usize = 1000;

/// A guest's value in a refusal: cut, so a 4 MiB value is not a 4 MiB log line.
fn shown(text: &str) -> String {
    match text.char_indices().nth(100) {
        Some((at, _)) => format!("{:?}…", &text[..at]),
        None => format!("{text:?}"),
    }
}

/// Headers that could make the server read a request otherwise than the
/// host did: an action from a header, a compressed or re-framed body.
pub(crate) fn check_headers(headers: &http::HeaderMap) -> Result<(), Refused> {
    if headers.contains_key("x-amz-target") {
        return Err(refused("actions", "x-amz-target names an action the host does not read: refused"));
    }
    if headers.get_all(http::header::CONTENT_ENCODING).iter().any(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity")) {
        return Err(refused("actions", "a content-encoding other than identity hides the body from the host"));
    }
    if headers.contains_key(http::header::TRANSFER_ENCODING) {
        return Err(refused("actions", "transfer-encoding is the host's to set"));
    }
    if headers.get_all(http::header::CONTENT_TYPE).iter().count() > 1 {
        return Err(refused("actions", "content-type is given more than once"));
    }
    Ok(())
}

impl Rules {
    /// Whether any rule is set (then every request is read and checked).
    pub fn any(&self) -> bool {
        !self.actions.is_empty() || self.max_count.is_some() || self.require_tag.is_some()
    }

    /// Check one whole request as the server will read it: its headers
    /// ([`check_headers`]), then its query string and body ([`Rules::check`]).
    pub(crate) fn check_request(
        &self,
        headers: &http::HeaderMap,
        query: Option<&str>,
        body: &[u8],
    ) -> Result<(), Refused> {
        if !self.any() {
            return Ok(());
        }
        check_headers(headers)?;
        let content_type = headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        self.check(query, content_type, body)
    }

    /// Check one request: its query string and its body (a form, or empty).
    /// Parameters come from one of the two, never both.
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
        let query = query.unwrap_or_default();
        if !query.is_empty() && !body.is_empty() {
            return Err(refused("actions", "parameters in both the query string and the body: send them in one"));
        }
        let source = if body.is_empty() { query.as_bytes() } else { body };
        let mut params: BTreeMap<String, String> = BTreeMap::new();
        let mut seen = std::collections::BTreeSet::new();
        for (key, value) in form_urlencoded::parse(source) {
            if params.len() >= MAX_PARAMETERS {
                return Err(refused("actions", format!("more than {MAX_PARAMETERS} parameters")));
            }
            if !seen.insert(key.to_ascii_lowercase()) {
                return Err(refused("actions", format!("parameter {} is given more than once", shown(&key))));
            }
            params.insert(key.into_owned(), value.into_owned());
        }
        let action = params.get("Action").ok_or_else(|| refused("actions", "the request names no Action"))?;
        if !self.actions.is_empty() && !self.actions.iter().any(|allowed| allowed == action) {
            return Err(refused("actions", format!("Action {} is not among {:?}", shown(action), self.actions)));
        }
        if action.trim().eq_ignore_ascii_case("RunInstances") {
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
                    .map_err(|_| refused("max-count", format!("{key} {} is not a count", shown(value))))?;
                if count > u64::from(cap) {
                    return Err(refused("max-count", format!("{key} {count} is over the grant's {cap}")));
                }
            }
        }
        if let Some((key, value)) = &self.require_tag {
            instance_tags_carry(params, key, value)?;
        }
        Ok(())
    }
}

/// One `TagSpecification.N`: whether it is for instances, and its `Tag.M` (key, value).
type Spec<'a> = (bool, BTreeMap<&'a str, (Option<&'a str>, Option<&'a str>)>);

/// A list index as AWS writes it: decimal, no leading zero.
fn canonical_index(text: &str) -> bool {
    !text.is_empty() && text.len() <= 6 && text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0')
}

/// Every tag on instances (`TagSpecification.N` of `ResourceType=instance`,
/// `Tag.M`) whose key is `key` carries `value`, and there is one: the server
/// keeps whichever comes last, so one right tag beside a wrong one is not enough.
/// One pass over the parameters (sorted: a spec's keys are together).
fn instance_tags_carry(params: &BTreeMap<String, String>, key: &str, value: &str) -> Result<(), Refused> {
    let wrong =
        |why: String| refused("require-tag", format!("RunInstances must tag its instances {key}={value}: {why}"));
    let mut specs: BTreeMap<&str, Spec<'_>> = BTreeMap::new();
    for (name, given) in
        params.range::<str, _>((std::ops::Bound::Included("TagSpecification."), std::ops::Bound::Unbounded))
    {
        let Some(rest) = name.strip_prefix("TagSpecification.") else { break };
        let (spec, field) = rest.split_once('.').unwrap_or((rest, ""));
        if !canonical_index(spec) {
            return Err(wrong(format!("TagSpecification index {} is not plain decimal", shown(spec))));
        }
        let entry = specs.entry(spec).or_default();
        if field == "ResourceType" {
            entry.0 = given == "instance";
        } else if let Some(tag) = field.strip_prefix("Tag.") {
            let (n, part) = tag.split_once('.').unwrap_or((tag, ""));
            if !canonical_index(n) {
                return Err(wrong(format!("Tag index {} is not plain decimal", shown(n))));
            }
            let slot = entry.1.entry(n).or_default();
            match part {
                "Key" => slot.0 = Some(given),
                "Value" => slot.1 = Some(given),
                _ => {}
            }
        }
    }
    let mut carried = false;
    for (_, tags) in specs.values().filter(|(instances, _)| *instances) {
        for (tag_key, tag_value) in tags.values() {
            if *tag_key == Some(key) {
                if *tag_value != Some(value) {
                    return Err(wrong(format!("another value {} is given too", shown(tag_value.unwrap_or("")))));
                }
                carried = true;
            }
        }
    }
    if carried { Ok(()) } else { Err(wrong("in a TagSpecification of ResourceType instance".into())) }
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
        assert!(split.reason.contains("both the query string and the body"), "{split}");
        let cased = rules.check(None, FORM, run("&maxcount=50").as_bytes()).unwrap_err();
        assert!(cased.reason.contains("more than once"), "{cased}");
        let json = rules.check(None, Some("application/json"), b"{\"Action\":\"RunInstances\"}").unwrap_err();
        assert!(json.reason.contains("not an AWS Query form"), "{json}");
        // Encoded keys are read as the server reads them.
        let encoded = run("").replace("MaxCount=3", "Max%43ount=60");
        assert_eq!(rules.check(None, FORM, encoded.as_bytes()).unwrap_err().rule, "max-count");
        // Split between the query and the body, a second tag that overrides, odd indexes, headers.
        let both = rules.check(Some("Action=DescribeInstances"), FORM, b"MaxCount=900").unwrap_err();
        assert!(both.reason.contains("both the query string and the body"), "{both}");
        let second = run("&TagSpecification.2.ResourceType=instance&TagSpecification.2.Tag.1.Key=broker-namespace\
                          &TagSpecification.2.Tag.1.Value=ns2");
        assert_eq!(rules.check(None, FORM, second.as_bytes()).unwrap_err().rule, "require-tag");
        let padded = run("").replace("TagSpecification.1.Tag.1.Value", "TagSpecification.1.Tag.01.Value");
        assert_eq!(rules.check(None, FORM, padded.as_bytes()).unwrap_err().rule, "require-tag");
        let mut headers = http::HeaderMap::new();
        headers.insert("x-amz-target", "x.RunInstances".parse().unwrap());
        assert!(check_headers(&headers).is_err());
        let mut headers = http::HeaderMap::new();
        headers.insert("content-encoding", "gzip".parse().unwrap());
        assert!(check_headers(&headers).is_err());
        let mut headers = http::HeaderMap::new();
        headers.append("content-type", "application/x-www-form-urlencoded".parse().unwrap());
        headers.append("content-type", "multipart/form-data".parse().unwrap());
        assert!(check_headers(&headers).is_err());
        // Many specs are read in one pass, and past a bound not at all.
        let many: String = (2..2000).map(|i| format!("&TagSpecification.{i}.ResourceType=instance")).collect();
        assert!(rules.check(None, FORM, run(&many).as_bytes()).unwrap_err().reason.contains("more than 1000"));
        // Without rules, nothing is read.
        assert_eq!(Rules::default().check(None, Some("application/json"), b"{}"), Ok(()));
    }
}
