//! A provider's socket: InfraKit's Instance/0.6.1 over one registered
//! provider. Provision starts through the host (recorded, tagged), Destroy
//! stops only the provider's own recorded instances, Label sets tags the
//! host keeps on the record, DescribeInstances filters by them.

use super::rpc::{RpcError, or_default, params};
use broker_core::broker::Broker;
use broker_core::groups::spec::{LOGICAL_ID_TAG, start_params};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// The interface and version this socket speaks.
pub(crate) const INSTANCE_API: (&str, &str) = ("Instance", "0.6.1");
/// Most labels one `Label` call sets.
pub(crate) const MAX_LABELS: usize = 64;
/// Longest label key and value.
pub(crate) const MAX_LABEL_BYTES: usize = 256;

/// The methods, as `/info/api.json` lists them, with an example of each one's params.
pub(crate) fn methods() -> Vec<(&'static str, Value)> {
    let spec = json!({"Properties": {"Constraints": "mem=1G"}, "Tags": {"role": "worker"}, "Init": "", "LogicalID": null, "Attachments": []});
    vec![
        ("Instance.Validate", json!({"Type": "", "Properties": {"Constraints": "mem=1G"}})),
        ("Instance.Provision", json!({"Type": "", "Spec": spec})),
        ("Instance.Label", json!({"Type": "", "Instance": "fake-0", "Labels": {"role": "db"}})),
        ("Instance.Destroy", json!({"Type": "", "Instance": "fake-0", "Context": {"Reason": "terminate"}})),
        ("Instance.DescribeInstances", json!({"Type": "", "Tags": {"role": "worker"}, "Properties": true})),
    ]
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Validate {
    #[serde(default, deserialize_with = "or_default")]
    r#type: String,
    #[serde(default, deserialize_with = "or_default")]
    properties: Value,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Provision {
    #[serde(default, deserialize_with = "or_default")]
    r#type: String,
    spec: Spec,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Spec {
    #[serde(default, deserialize_with = "or_default")]
    properties: Value,
    #[serde(default, deserialize_with = "or_default")]
    tags: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "or_default")]
    init: String,
    #[serde(rename = "LogicalID", default, deserialize_with = "or_default")]
    logical_id: Option<String>,
    #[serde(default, deserialize_with = "or_default")]
    attachments: Option<Vec<Value>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Label {
    #[serde(default, deserialize_with = "or_default")]
    r#type: String,
    instance: String,
    #[serde(default, deserialize_with = "or_default")]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Destroy {
    #[serde(default, deserialize_with = "or_default")]
    r#type: String,
    instance: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Describe {
    #[serde(default, deserialize_with = "or_default")]
    r#type: String,
    #[serde(default, deserialize_with = "or_default")]
    tags: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "or_default")]
    properties: bool,
}

fn spec_error(error: &broker_core::groups::spec::SpecError) -> RpcError {
    match error {
        broker_core::groups::spec::SpecError::Field { field, why } => {
            RpcError { code: super::rpc::SERVER_ERROR, message: format!("field {field}: {why}") }
        }
        other => RpcError::server(other),
    }
}

/// One call of `provider`'s instance plugin; `None` if it has no such method.
pub(crate) async fn call(broker: &Broker, provider: &str, method: &str, raw: Value) -> Option<Result<Value, RpcError>> {
    let outcome = match method {
        "Instance.Validate" => params::<Validate>(raw).and_then(|p| {
            start_params("Properties", &p.properties, &[], BTreeMap::new(), true).map_err(|e| spec_error(&e))?;
            Ok(json!({"Type": p.r#type, "OK": true}))
        }),
        "Instance.Provision" => provision(broker, provider, raw).await,
        "Instance.Label" => label(broker, provider, raw).await,
        "Instance.Destroy" => destroy(broker, provider, raw).await,
        "Instance.DescribeInstances" => describe(broker, provider, raw).await,
        _ => return None,
    };
    Some(outcome)
}

async fn provision(broker: &Broker, provider: &str, raw: Value) -> Result<Value, RpcError> {
    let p: Provision = params(raw)?;
    if p.spec.attachments.as_ref().is_some_and(|a| !a.is_empty()) {
        return Err(RpcError {
            code: super::rpc::SERVER_ERROR,
            message: "field Spec.Attachments: attachments are not supported by this host".into(),
        });
    }
    let mut tags = p.spec.tags;
    if let Some(logical_id) = p.spec.logical_id {
        tags.entry(LOGICAL_ID_TAG.to_owned()).or_insert(logical_id);
    }
    let init: Vec<String> = (!p.spec.init.is_empty()).then_some(p.spec.init).into_iter().collect();
    let params = start_params("Spec.Properties", &p.spec.properties, &init, tags, true).map_err(|e| spec_error(&e))?;
    let started =
        broker.start_instance(provider, &params, &Default::default()).await.map_err(|e| RpcError::server(&e))?;
    Ok(json!({"Type": p.r#type, "ID": started.id}))
}

/// The instance `id` must be recorded for this provider: a socket never acts on another's.
fn own(broker: &Broker, provider: &str, id: &str) -> Result<(), RpcError> {
    match broker.provider_of(id) {
        Ok(owner) if owner == provider => Ok(()),
        Ok(_) | Err(broker_core::broker::BrokerServiceError::UnknownInstance(_)) => Err(RpcError {
            code: super::rpc::SERVER_ERROR,
            message: format!(
                "no instance {} is recorded for provider {provider}",
                broker_core::store::records::id_for_message(id)
            ),
        }),
        Err(other) => Err(RpcError::server(&other)),
    }
}

async fn label(broker: &Broker, provider: &str, raw: Value) -> Result<Value, RpcError> {
    let p: Label = params(raw)?;
    if p.labels.len() > MAX_LABELS {
        return Err(RpcError::params(format!("{} labels; at most {MAX_LABELS} a call", p.labels.len())));
    }
    for (key, value) in &p.labels {
        let bad = |text: &str| text.len() > MAX_LABEL_BYTES || text.chars().any(char::is_control);
        if key.is_empty() || bad(key) || bad(value) {
            return Err(RpcError::params(format!(
                "label {:?}: keys are 1 to {MAX_LABEL_BYTES} bytes, values at most {MAX_LABEL_BYTES}, no control characters",
                key.chars().take(64).collect::<String>()
            )));
        }
    }
    own(broker, provider, &p.instance)?;
    let labelled = broker.store().label_instance(provider, &p.instance, &p.labels).await;
    labelled
        .map_err(|e| RpcError::server(&e))?
        .map_err(|why| RpcError { code: super::rpc::SERVER_ERROR, message: why })?;
    Ok(json!({"Type": p.r#type, "OK": true}))
}

async fn destroy(broker: &Broker, provider: &str, raw: Value) -> Result<Value, RpcError> {
    let p: Destroy = params(raw)?;
    own(broker, provider, &p.instance)?;
    broker.stop_instances(provider, std::slice::from_ref(&p.instance)).await.map_err(|e| RpcError::server(&e))?;
    Ok(json!({"Type": p.r#type, "OK": true}))
}

async fn describe(broker: &Broker, provider: &str, raw: Value) -> Result<Value, RpcError> {
    let p: Describe = params(raw)?;
    let listed = broker.provider_instances(provider).await.map_err(|e| RpcError::server(&e))?;
    let descriptions: Vec<Value> = listed
        .into_iter()
        .filter(|record| p.tags.iter().all(|(k, v)| record.instance_tags.get(k) == Some(v)))
        .map(|record| {
            let mut described = json!({"ID": record.id, "Tags": record.instance_tags});
            if let Some(logical_id) = record.instance_tags.get(LOGICAL_ID_TAG) {
                described["LogicalID"] = json!(logical_id);
            }
            if p.properties {
                described["Properties"] =
                    json!({"Status": record.status, "Message": record.message, "Hardware": record.hardware});
            }
            described
        })
        .collect();
    Ok(json!({"Type": p.r#type, "Descriptions": descriptions}))
}
