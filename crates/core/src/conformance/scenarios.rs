//! Scenarios a provider brings of its own (`<manifest stem>.scenarios.json`
//! beside its manifest): steps, each one call by name with its params and
//! what it must answer, run after the built-in cases in the same sandbox.
//!
//! ```json
//! {"scenarios": [{"name": "a placement in zone-b is kept",
//!   "steps": [
//!     {"call": "start-instance", "params": {"placement": "zone=zone-b"},
//!      "expect": {"answer": {"hardware": {"availability_zone": "zone-b"}}}, "save": "started"},
//!     {"call": "all-instances", "expect": {"answer": [{"instance": {"id": "${started.instance.id}"}}]}},
//!     {"call": "stop-instances", "params": ["${started.instance.id}"]},
//!     {"call": "start-instance", "params": {"placement": "zone=mars"}, "expect": {"error": "zone-unavailable"}}
//!   ]}]}
//! ```
//!
//! An `answer` matches when every field it names matches (objects: the fields
//! given; lists: each element given matches some element); `error` names
//! the failure's kind (see the README's "Errors"); no `expect`: the call
//! succeeds. `save` keeps a step's answer; a string `"${NAME.field.…}"`
//! anywhere in a later step's params or expectation is that part of it.

use crate::manifest::Method;
use serde::Deserialize;
use serde_json::Value;

/// Most scenarios in one file, and most steps in one scenario.
const MAX_SCENARIOS: usize = 64;
const MAX_STEPS: usize = 64;
/// The largest scenarios file read.
pub(super) const MAX_SCENARIOS_BYTES: u64 = 1 << 20;

/// The file: its scenarios.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenarios {
    scenarios: Vec<Scenario>,
}

/// One scenario: its name (the case's) and its steps, in order.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Scenario {
    pub(super) name: String,
    pub(super) steps: Vec<Step>,
}

/// One call and what it must answer.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Step {
    /// The method, as manifests spell it.
    call: String,
    #[serde(default)]
    params: Option<Value>,
    #[serde(default)]
    expect: Expect,
    /// Keep the answer under this name for later steps.
    #[serde(default)]
    save: Option<String>,
}

/// What a step's call must answer.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    /// A success whose answer matches this.
    #[serde(default)]
    answer: Option<Value>,
    /// A failure of this kind (`invalid-params`, `not-found`, `trap`, …).
    #[serde(default)]
    error: Option<String>,
}

impl Scenarios {
    /// The file's text, read and checked: every method known, the bounds kept.
    pub fn parse(text: &str) -> Result<Scenarios, String> {
        let scenarios: Scenarios = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if scenarios.scenarios.len() > MAX_SCENARIOS {
            return Err(format!("{} scenarios; at most {MAX_SCENARIOS}", scenarios.scenarios.len()));
        }
        for scenario in &scenarios.scenarios {
            if scenario.steps.is_empty() || scenario.steps.len() > MAX_STEPS {
                return Err(format!("scenario {:?}: 1 to {MAX_STEPS} steps", scenario.name));
            }
            for (i, step) in scenario.steps.iter().enumerate() {
                crate::version::by_name::method_named(&step.call)
                    .map_err(|e| format!("scenario {:?} step {}: {e}", scenario.name, i + 1))?;
                if step.expect.answer.is_some() && step.expect.error.is_some() {
                    return Err(format!(
                        "scenario {:?} step {}: expect an answer or an error, not both",
                        scenario.name,
                        i + 1
                    ));
                }
            }
        }
        Ok(scenarios)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Scenario> {
        self.scenarios.iter()
    }

    /// No scenarios (a provider that brings none).
    pub fn none() -> Scenarios {
        Scenarios { scenarios: Vec::new() }
    }
}

impl Step {
    /// The method (checked when the file was read).
    pub(super) fn method(&self) -> Method {
        crate::version::by_name::method_named(&self.call).unwrap_or(Method::Describe)
    }

    pub(super) fn call_name(&self) -> &str {
        &self.call
    }

    /// Its params with the saved answers put in.
    pub(super) fn params(&self, saved: &Saved) -> Result<Option<Value>, String> {
        self.params.as_ref().map(|params| saved.fill(params)).transpose()
    }

    pub(super) fn save_as(&self) -> Option<&str> {
        self.save.as_deref()
    }

    /// Whether `outcome` (an answer, or a failure's kind and message) is what
    /// the step expects; the reason if not.
    pub(super) fn check(&self, outcome: &Result<Value, (String, String)>, saved: &Saved) -> Result<(), String> {
        match (&self.expect.error, outcome) {
            (Some(kind), Err((got, _))) if got == kind => Ok(()),
            (Some(kind), Err((got, message))) => Err(format!("expected a {kind} error, got {got}: {message}")),
            (Some(kind), Ok(answer)) => Err(format!("expected a {kind} error, got the answer {}", shown(answer))),
            (None, Err((got, message))) => Err(format!("failed ({got}): {message}")),
            (None, Ok(answer)) => match &self.expect.answer {
                None => Ok(()),
                Some(expected) => {
                    let expected = saved.fill(expected)?;
                    if matches(&expected, answer) {
                        Ok(())
                    } else {
                        Err(format!("expected an answer matching {}, got {}", shown(&expected), shown(answer)))
                    }
                }
            },
        }
    }
}

/// Answers kept by `save`, by name.
#[derive(Default)]
pub(super) struct Saved(std::collections::BTreeMap<String, Value>);

impl Saved {
    pub(super) fn keep(&mut self, name: &str, answer: Value) {
        self.0.insert(name.to_owned(), answer);
    }

    /// `value` with every string `"${NAME.field.…}"` replaced by that part of a saved answer.
    fn fill(&self, value: &Value) -> Result<Value, String> {
        Ok(match value {
            Value::String(text) => match text.strip_prefix("${").and_then(|rest| rest.strip_suffix('}')) {
                Some(path) => self.lookup(path)?,
                None => value.clone(),
            },
            Value::Array(items) => Value::Array(items.iter().map(|item| self.fill(item)).collect::<Result<_, _>>()?),
            Value::Object(map) => {
                Value::Object(map.iter().map(|(k, v)| Ok((k.clone(), self.fill(v)?))).collect::<Result<_, String>>()?)
            }
            other => other.clone(),
        })
    }

    fn lookup(&self, path: &str) -> Result<Value, String> {
        let mut parts = path.split('.');
        let name = parts.next().unwrap_or_default();
        let mut at = self.0.get(name).ok_or_else(|| format!("${{{path}}}: no answer was saved as {name:?}"))?;
        for part in parts {
            let next = match at {
                Value::Array(items) => part.parse::<usize>().ok().and_then(|i| items.get(i)),
                Value::Object(map) => map.get(part),
                _ => None,
            };
            at = next.ok_or_else(|| format!("${{{path}}}: the saved answer has no {part:?}"))?;
        }
        Ok(at.clone())
    }
}

/// Whether `actual` has everything `expected` names.
fn matches(expected: &Value, actual: &Value) -> bool {
    match (expected, actual) {
        (Value::Object(expected), Value::Object(actual)) => {
            expected.iter().all(|(key, want)| actual.get(key).is_some_and(|got| matches(want, got)))
        }
        (Value::Array(expected), Value::Array(actual)) => {
            expected.iter().all(|want| actual.iter().any(|got| matches(want, got)))
        }
        _ => expected == actual,
    }
}

/// A value in a case's detail: compact, and cut short.
fn shown(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(300) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answers_match_by_the_fields_given_and_saved_answers_fill_later_steps() {
        let answer = json!({"instance": {"id": "x-1", "status": "running"}, "hardware": {"mem": 2048}});
        assert!(matches(&json!({"hardware": {"mem": 2048}}), &answer));
        assert!(!matches(&json!({"hardware": {"mem": 4096}}), &answer));
        assert!(!matches(&json!({"volumes": []}), &answer), "a field it lacks");
        assert!(matches(&json!([{"id": "b"}]), &json!([{"id": "a"}, {"id": "b"}])));
        let mut saved = Saved::default();
        saved.keep("started", answer);
        assert_eq!(saved.fill(&json!(["${started.instance.id}"])).unwrap(), json!(["x-1"]));
        assert!(saved.fill(&json!("${started.nope}")).unwrap_err().contains("no \"nope\""));
        assert!(saved.fill(&json!("${other.id}")).unwrap_err().contains("no answer was saved"));
    }

    #[test]
    fn a_file_is_checked_before_anything_runs() {
        let ok =
            r#"{"scenarios": [{"name": "n", "steps": [{"call": "describe", "expect": {"answer": {"name": "x"}}}]}]}"#;
        assert_eq!(Scenarios::parse(ok).unwrap().iter().count(), 1);
        for (bad, says) in [
            (r#"{"scenarios": [{"name": "n", "steps": [{"call": "reboot"}]}]}"#, "no method \"reboot\""),
            (r#"{"scenarios": [{"name": "n", "steps": []}]}"#, "1 to 64 steps"),
            (r#"{"scenarios": [], "extra": 1}"#, "unknown field"),
            (
                r#"{"scenarios": [{"name": "n", "steps": [{"call": "describe", "expect": {"answer": 1, "error": "trap"}}]}]}"#,
                "not both",
            ),
        ] {
            let refused = Scenarios::parse(bad).unwrap_err();
            assert!(refused.contains(says), "{bad}: {refused}");
        }
    }
}
