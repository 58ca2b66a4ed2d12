//! A start's params from what a user gives, the same for the CLI's flags and
//! the API's body: the whole `StartInstanceParams` as JSON (any field left out
//! is empty; an unknown one is an error naming it), then Juju constraint text,
//! a placement, user data and instance tags over it.

use super::constraints::{self, ConstraintsError};
use super::empty_instance_config;
use crate::bindings::StartInstanceParams;
use serde_json::Value;

/// The most user data the host passes on: it must fit, as JSON, in a request
/// to the daemon (64 KiB); EC2 itself takes 16 KiB.
pub const MAX_USER_DATA: usize = 48 << 10;
/// The most instance tags one start takes, and their sizes (EC2's).
pub(crate) const MAX_TAGS: usize = 50;
/// The longest tag key.
pub(crate) const MAX_TAG_KEY: usize = 128;
/// The longest tag value.
pub(crate) const MAX_TAG_VALUE: usize = 256;

/// Why what the user gave makes no start.
#[derive(Debug, thiserror::Error)]
pub enum StartParamsError {
    /// The params JSON: an unknown field, a wrong type.
    #[error("params: {0}")]
    Params(String),
    /// The constraint text.
    #[error("invalid constraints {text:?}: {}", crate::error_text::cause_text(.cause))]
    Constraints {
        /// As given.
        text: String,
        /// What is wrong with it.
        cause: ConstraintsError,
    },
    /// More user data than [`MAX_USER_DATA`].
    #[error("user data is {0} bytes; the host takes at most {MAX_USER_DATA}")]
    UserDataTooLarge(usize),
    /// A tag that is malformed or too long, or too many.
    #[error("tags: {0}")]
    Tag(String),
}

/// What a user gave for one start.
#[derive(Debug, Default, Clone)]
pub struct StartInput<'a> {
    /// `StartInstanceParams` as JSON.
    pub params: Option<&'a Value>,
    /// Juju's syntax; empty: the params' own (or none).
    pub constraints: &'a str,
    /// A placement directive (`zone=NAME`).
    pub placement: Option<&'a str>,
    /// cloud-init user data, set on the instance config.
    pub user_data: Option<Vec<u8>>,
    /// `key=value` pairs, set on the instance config (a key given again replaces it).
    pub tags: &'a [(String, String)],
}

/// `given` over `template`, object by object (what neither has is left for
/// [`unknown_field`] to name).
fn merged(template: Value, given: &Value, top: bool) -> Result<Value, String> {
    let (Value::Object(mut into), Value::Object(fields)) = (template, given) else {
        return Ok(given.clone());
    };
    for (key, value) in fields {
        // An absent record (null) takes its fields from an empty one.
        let under = match (top, key.as_str(), into.get(key)) {
            (true, "instance_config", Some(Value::Null)) => {
                serde_json::to_value(empty_instance_config()).map_err(|e| e.to_string())?
            }
            (_, _, existing) => existing.cloned().unwrap_or(Value::Null),
        };
        let value = match (value.is_object(), under.is_object()) {
            (true, true) => merged(under, value, false)?,
            _ => value.clone(),
        };
        into.insert(key.clone(), value);
    }
    Ok(Value::Object(into))
}

/// The first field of `given` that `typed` (what it became) lacks, with the
/// fields it has there: serde drops what it does not know, at any depth.
fn unknown_field(given: &Value, typed: &Value, path: &str) -> Option<String> {
    match (given, typed) {
        (Value::Object(fields), Value::Object(known)) => fields.iter().find_map(|(key, value)| match known.get(key) {
            None => Some(format!("{path}{key} (known: {:?})", known.keys().collect::<Vec<_>>())),
            Some(became) => unknown_field(value, became, &format!("{path}{key}.")),
        }),
        (Value::Array(items), Value::Array(became)) => (items.iter().zip(became).enumerate())
            .find_map(|(i, (item, became))| unknown_field(item, became, &format!("{path}{i}."))),
        _ => None,
    }
}

fn check_tag(key: &str, value: &str) -> Result<(), StartParamsError> {
    let plain = |s: &str| !s.chars().any(char::is_control);
    if key.is_empty() || key.len() > MAX_TAG_KEY || value.len() > MAX_TAG_VALUE || !plain(key) || !plain(value) {
        let key: String = key.chars().take(40).collect();
        return Err(StartParamsError::Tag(format!(
            "{key:?}: keys are 1-{MAX_TAG_KEY} bytes, values at most {MAX_TAG_VALUE}, no control characters"
        )));
    }
    Ok(())
}

/// `key=value` as a tag (the CLI's `--tag`).
pub fn parse_tag(text: &str) -> Result<(String, String), StartParamsError> {
    let (key, value) =
        text.split_once('=').ok_or_else(|| StartParamsError::Tag(format!("{text:?} is not KEY=VALUE")))?;
    check_tag(key, value)?;
    Ok((key.to_owned(), value.to_owned()))
}

/// The params of one start from `input`, checked against the host's bounds.
pub fn start_params(input: StartInput<'_>) -> Result<StartInstanceParams, StartParamsError> {
    let mut params = match input.params {
        None => super::empty_params(),
        Some(given) => {
            let template =
                serde_json::to_value(super::empty_params()).map_err(|e| StartParamsError::Params(e.to_string()))?;
            let value = merged(template, given, true).map_err(StartParamsError::Params)?;
            let params: StartInstanceParams =
                serde_json::from_value(value).map_err(|e| StartParamsError::Params(e.to_string()))?;
            let typed = serde_json::to_value(&params).map_err(|e| StartParamsError::Params(e.to_string()))?;
            if let Some(unknown) = unknown_field(given, &typed, "") {
                return Err(StartParamsError::Params(format!("unknown field {unknown}")));
            }
            params
        }
    };
    if !input.constraints.trim().is_empty() {
        params.constraints = constraints::parse(input.constraints)
            .map_err(|source| StartParamsError::Constraints { text: input.constraints.to_owned(), cause: source })?;
    }
    if let Some(placement) = input.placement {
        params.placement = Some(placement.to_owned());
    }
    if input.user_data.is_some() || !input.tags.is_empty() {
        let config = params.instance_config.get_or_insert_with(empty_instance_config);
        if let Some(data) = input.user_data {
            config.user_data = Some(data);
        }
        for (key, value) in input.tags {
            match config.tags.iter_mut().find(|(k, _)| k == key) {
                Some(existing) => existing.1 = value.clone(),
                None => config.tags.push((key.clone(), value.clone())),
            }
        }
    }
    if let Some(config) = &params.instance_config {
        if let Some(data) = &config.user_data
            && data.len() > MAX_USER_DATA
        {
            return Err(StartParamsError::UserDataTooLarge(data.len()));
        }
        if config.tags.len() > MAX_TAGS {
            return Err(StartParamsError::Tag(format!("{} tags; at most {MAX_TAGS}", config.tags.len())));
        }
        for (key, value) in &config.tags {
            check_tag(key, value)?;
        }
    }
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn params_json_fills_what_it_leaves_out_and_names_what_it_does_not_know() {
        let given = json!({
            "placement": "zone=b",
            "constraints": {"mem": 2048},
            "instance_config": {"machine_id": "3", "tags": [["team", "blue"]]}
        });
        let tags = [("team".to_owned(), "red".to_owned()), ("env".to_owned(), "ci".to_owned())];
        let params = start_params(StartInput {
            params: Some(&given),
            constraints: "",
            user_data: Some(b"#cloud-config\n".to_vec()),
            tags: &tags,
            ..StartInput::default()
        })
        .unwrap();
        assert_eq!(params.placement.as_deref(), Some("zone=b"));
        assert_eq!(params.constraints.mem, Some(2048));
        let config = params.instance_config.unwrap();
        assert_eq!(config.machine_id, "3");
        assert_eq!(config.user_data.as_deref(), Some(&b"#cloud-config\n"[..]));
        assert_eq!(config.tags, [("team".to_owned(), "red".to_owned()), ("env".to_owned(), "ci".to_owned())]);

        for (bad, needle) in [
            (json!({"placment": "x"}), "unknown field placment"),
            (json!({"instance_config": {"machine": "3"}}), "unknown field instance_config.machine"),
            (json!({"constraints": {"memory": 1}}), "unknown field constraints.memory"),
            (json!({"placement": 3}), "invalid type"),
            (
                json!({"image_metadata": [{"id": "ami-1", "arch": "amd64", "base": "", "region": "", "endpoint": "",
                                            "stream": "", "virt_type": null, "storage": null, "extra": [], "sise": 1}]}),
                "unknown field image_metadata.0.sise",
            ),
        ] {
            let err = start_params(StartInput { params: Some(&bad), ..StartInput::default() }).unwrap_err();
            assert!(err.to_string().contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn constraint_text_wins_and_bounds_hold() {
        let given = json!({"constraints": {"mem": 2048}});
        let params =
            start_params(StartInput { params: Some(&given), constraints: "cores=4", ..StartInput::default() }).unwrap();
        assert_eq!((params.constraints.mem, params.constraints.cores), (None, Some(4)));
        let big = StartInput { user_data: Some(vec![0; MAX_USER_DATA + 1]), ..StartInput::default() };
        assert!(matches!(start_params(big), Err(StartParamsError::UserDataTooLarge(_))));
        assert!(parse_tag("novalue").is_err());
        assert!(parse_tag("=v").is_err());
        assert!(parse_tag("k=a\nb").is_err());
        assert_eq!(parse_tag("k=a=b").unwrap(), ("k".to_owned(), "a=b".to_owned()));
        let many: Vec<(String, String)> = (0..=MAX_TAGS).map(|i| (format!("k{i}"), String::new())).collect();
        assert!(start_params(StartInput { tags: &many, ..StartInput::default() }).is_err());
    }
}
