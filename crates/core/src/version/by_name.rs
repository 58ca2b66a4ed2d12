//! One export called by name with JSON params, its typed answer as JSON:
//! what `broker provider call` runs, on a component in the kit's sandbox or
//! on a registered provider.

use super::{CallError, ProviderVersion};
use crate::manifest::Method;
use broker_capabilities::contract::start::{StartInput, start_params};
use broker_capabilities::rooms::context::CallHooks;
use broker_capabilities::secrets::Redactor;
use serde::Deserialize;
use serde_json::Value;

/// Why a call by name did not answer.
#[derive(Debug, thiserror::Error)]
pub enum ByNameError {
    /// No export of that name.
    #[error(
        "no method {0:?}: one of describe, validate-config, start-instance, stop-instances, all-instances, maintain-instance"
    )]
    UnknownMethod(String),
    /// The params do not fit the method.
    #[error("{method} --params: {reason}")]
    Params {
        /// The method called.
        method: Method,
        /// What is wrong with them.
        reason: String,
    },
    /// The call itself failed.
    #[error(transparent)]
    Call(#[from] CallError),
}

/// The method named `name` (as manifests and errors spell it).
pub fn method_named(name: &str) -> Result<Method, ByNameError> {
    Method::ALL.into_iter().find(|m| m.name() == name).ok_or_else(|| ByNameError::UnknownMethod(name.to_owned()))
}

/// `all-instances --params`: one page (`{"cursor", "size"}`); none: every page.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PageParams {
    #[serde(default)]
    cursor: Option<String>,
    size: u32,
}

/// `maintain-instance --params`: the instance and the params it was started with.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MaintainParams {
    id: String,
    #[serde(default)]
    params: Option<Value>,
}

/// Call `method` with `params` (each method's shape: the README's "provider
/// call"); the answer as JSON, every string in it redacted of the provider's secrets.
pub async fn call_by_name(
    provider: &ProviderVersion,
    method: Method,
    params: Option<&Value>,
    hooks: &CallHooks,
) -> Result<Value, ByNameError> {
    // `null` is no params, however it came (a CLI flag, or the API's JSON).
    let params = params.filter(|value| !value.is_null());
    let refused = |reason: String| ByNameError::Params { method, reason };
    let decode = |value: &Value| -> Result<_, ByNameError> {
        start_params(StartInput { params: Some(value), constraints: "", placement: None, user_data: None, tags: &[] })
            .map_err(|e| refused(e.to_string()))
    };
    let mut answer = match method {
        Method::Describe => json(provider.describe().await?),
        Method::ValidateConfig => {
            let config = match params {
                Some(config) => config.to_string(),
                None => provider.guest_config().to_string(),
            };
            provider.validate_config(&config).await?;
            Value::Null
        }
        Method::StartInstance => {
            let params = match params {
                Some(value) => decode(value)?,
                None => broker_capabilities::contract::empty_params(),
            };
            json(provider.start_instance(hooks, &params).await?)
        }
        Method::StopInstances => {
            let ids: Vec<String> = match params {
                Some(value) => Vec::deserialize(value).map_err(|e| refused(format!("a list of ids: {e}")))?,
                None => return Err(refused("a list of ids, e.g. [\"fake-0\"]".into())),
            };
            provider.stop_instances(hooks, &ids).await?;
            Value::Null
        }
        Method::AllInstances => match params {
            None => json(provider.listed_instances(hooks).await?),
            Some(value) => {
                let page =
                    PageParams::deserialize(value).map_err(|e| refused(format!("{{\"cursor\", \"size\"}}: {e}")))?;
                json(provider.instances_page(hooks, page.cursor, page.size).await?)
            }
        },
        Method::MaintainInstance => {
            let Some(value) = params else {
                return Err(refused("{\"id\": …, \"params\": {…}}".into()));
            };
            let maintain =
                MaintainParams::deserialize(value).map_err(|e| refused(format!("{{\"id\", \"params\"}}: {e}")))?;
            let params = match &maintain.params {
                Some(value) => decode(value)?,
                None => broker_capabilities::contract::empty_params(),
            };
            provider.maintain_instance(hooks, &maintain.id, &params).await?;
            Value::Null
        }
    };
    redact_strings(&mut answer, provider.redactor());
    Ok(answer)
}

/// The contract's types all serialise; a failure would be a bug, shown as such.
fn json(value: impl serde::Serialize) -> Value {
    serde_json::to_value(value).unwrap_or_else(|e| Value::String(format!("(the answer does not serialise: {e})")))
}

/// Every string in `value`, keys included, with the secrets' values hidden.
fn redact_strings(value: &mut Value, redactor: &Redactor) {
    if redactor.is_empty() {
        return;
    }
    match value {
        Value::String(text) => redactor.redact_string(text),
        Value::Array(items) => items.iter_mut().for_each(|item| redact_strings(item, redactor)),
        Value::Object(map) => {
            let entries = std::mem::take(map);
            for (mut key, mut item) in entries {
                redactor.redact_string(&mut key);
                redact_strings(&mut item, redactor);
                map.insert(key, item);
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_are_named_as_manifests_spell_them() {
        assert_eq!(method_named("all-instances").unwrap(), Method::AllInstances);
        let unknown = method_named("startInstance").unwrap_err().to_string();
        assert!(unknown.contains("one of describe, validate-config"), "{unknown}");
    }
}
